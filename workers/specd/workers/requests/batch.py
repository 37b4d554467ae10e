"""The frozen description of one scheduled step, handed to the model runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specd.workers.requests.request import Req
from specd.workers.rung import PlainReason, Rung


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """Request ``reqs[i]`` feeds ``extend_lens[i]`` tokens starting at position
    ``prefix_lens[i]`` (its committed length); it samples a next token only when the
    chunk reaches the end of its known tokens (``sample[i]``).  Decode requests are
    the case ``extend_lens[i] == 1``; prefill chunks and decodes share one forward."""

    reqs: tuple[Req, ...]
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    sample: tuple[bool, ...]
    verify: bool = False  # a speculative decode step (draft tree + verify), not an extend
    granted_lens: tuple[int, ...] = ()  # verify: allocated length each request was given
    # verify: the rung it drafts with, fixed when scheduled (overlap keeps it), and why
    # it is plain (None: it speculates); KV is sized for the widest rung regardless
    rung: Rung | None = None
    plain_reason: PlainReason | None = None
    scheduled_at: float = 0.0  # verify: perf_counter() when scheduling it began (cost model)
    # overlap, plain decode: scheduled while the previous batch computes; each request's
    # input is the token that batch samples for it, read on the device (never on the host)
    decode_ahead: bool = False
    # speculative engine, prefill step: the requests that decode one token plainly beside
    # the prefill chunks (their draft reads it later); () in every other batch
    plain_decodes: tuple[bool, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def decodes_plainly(self) -> tuple[bool, ...]:
        """Per request: whether it is a drafting request's plain decode (`plain_decodes`)."""
        return self.plain_decodes or (False,) * len(self.reqs)

    @property
    def sampled_reqs(self) -> list[Req]:
        return [r for r, s in zip(self.reqs, self.sample, strict=True) if s]


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """One next token per sampled request, in ``ScheduledBatch.sampled_reqs`` order."""

    next_token_ids: tuple[int, ...]
    hidden: Any = None  # [num_tokens, H] final-normed target hidden (speculative engines)
    aux: Any = None  # {layer: [num_tokens, H]} captured residual streams (EAGLE-3)
    # per sampled request, its token's TokenLogprob (None if it did not ask); () if none did
    logprobs: tuple = ()
    # per batch request, the prompt tokens' TokenLogprobs this chunk scored (possibly none)
    prompt_logprobs: tuple = ()
    # indices into the sampled requests whose logits row was unusable (request_faults.py)
    unusable_rows: tuple[int, ...] = ()
