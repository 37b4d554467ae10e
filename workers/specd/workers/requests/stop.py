"""Stop rules evaluated on each new token (stop strings live in the detokenizer)."""

from __future__ import annotations

from collections.abc import Iterable

from specd.workers.requests.request import Req
from specd.workers.types import FinishReason, SamplingParams


def stop_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> list[int]:
    """The token ids that end ``params``' output (``check_stop``'s token rule): its stop
    token ids, and EOS unless ``ignore_eos``."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return sorted(ids)


def check_stop(req: Req, eos_token_ids: frozenset[int], context_length: int) -> FinishReason | None:
    """Why ``req`` must stop after its last output token, or None to continue."""
    token = req.output_ids[-1]
    params = req.params
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return FinishReason.STOP
    if reaches_length_limit(req, context_length):
        return FinishReason.LENGTH
    return None


def reaches_length_limit(req: Req, context_length: int, pending: int = 0) -> bool:
    """``req`` is at ``max_tokens`` or the context length once ``pending`` more output
    tokens (sampled on the device, not yet appended) are in."""
    outputs = len(req.output_ids) + pending
    return outputs >= req.params.max_tokens or req.num_fill + pending >= context_length
