"""Per-request fault isolation: what goes wrong with one request ends that request, not
the replica.

Compute-side code that handles one request at a time (its logits processors, grammar
mask and advance, sampling) runs under ``contained(req, stage)``.  An error there is kept
on the request (``Req.fault``) and the step goes on with a harmless stand-in for that
request (its raw logits row, its greedy token), so the batch's other requests and the KV
bookkeeping stay consistent.  A row whose logits are unusable (NaN, +inf, or every token
refused) is flagged on the device without a sync (``unusable_rows``) and its stand-in is
the greedy token.  Before the loop resolves a step it finishes each faulted request with
``FinishReason.ERROR`` (``Engine._fail_faulted``), which frees its KV exactly as an abort
does.

Only errors no single request can be blamed for end the loop: broken invariants
(``AssertionError``), device errors and out-of-memory (``replica_fault``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from specd.workers.requests.request import Req

log = logging.getLogger(__name__)

_REPLICA_FAULTS: tuple[type[BaseException], ...] = (
    AssertionError,  # a broken invariant: the bookkeeping itself is in doubt
    torch.OutOfMemoryError,
    MemoryError,
    getattr(torch, "AcceleratorError", AssertionError),  # a CUDA error poisons the context
)


def replica_fault(err: BaseException) -> bool:
    """Whether ``err`` is the replica's, not one request's: it must end the loop."""
    return isinstance(err, _REPLICA_FAULTS) or "CUDA error" in str(err)


def record_fault(req: Req, message: str) -> None:
    """Keep the first thing that went wrong with ``req``; the loop fails it."""
    if req.fault is None:
        req.fault = message
        log.warning("request %s failed alone: %s", req.rid, message)


@contextlib.contextmanager
def contained(req: Req, stage: str) -> Iterator[None]:
    """Run one request's part of a step; an error that is the request's own is recorded
    on it (``stage`` names what failed) instead of ending the step."""
    try:
        yield
    except Exception as err:
        if replica_fault(err):
            raise
        record_fault(req, f"{stage} failed for this request: {type(err).__name__}: {err}")


def unusable_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> bool [...]: rows nothing can be sampled from (a NaN or +inf
    anywhere, or every token at -inf).  ``amax`` propagates NaN, so one reduction tells."""
    return ~torch.isfinite(logits.amax(-1))


def unusable_row_message(req: Req) -> str:
    """Why a request's row was unusable, in the terms of what the request asked."""
    grammar = req.params.grammar
    if grammar is not None:
        return (
            f"{grammar.field}: the grammar allows no token the model can write at this point "
            "of the output; check that the pattern or schema can be matched"
        )
    return (
        "sampling: this request's logits are not finite (NaN or inf) after its sampling "
        "parameters were applied; check temperature, repetition_penalty and logit_bias"
    )
