"""Whether a batch decodes in lockstep, which one verify would end for good.

A closed batch, or a held load of fixed output lengths, ends its requests together
under plain decoding, and the prompts behind them start together.  Speculating spreads
those ends, a cost no verify's step time shows (`CostModel.choose`)."""

from __future__ import annotations

from collections.abc import Sequence

LOCKSTEP_MARGIN = 0.15  # the lead speculation needs to break a batch decoding in lockstep
LOCKSTEP_GROUP = 4  # requests per distinct end, at least, of a batch in lockstep


def in_lockstep(tokens_left: Sequence[int]) -> bool:
    """Whether a batch's requests decode in lockstep: their ``tokens_left`` take at most
    one value per ``LOCKSTEP_GROUP`` requests, so plain decoding ends them in a few
    steps, and the prompts waiting behind them start together in a few prefill steps
    (a batch admitted over several prefill chunks ends in as many groups).  A verify
    advances each request by its own accepted drafts and spreads those ends for good:
    the batch ends in dwindling steps, and its successors arrive one or two per prefill
    step (100-160 prefill steps a run at a held 32 against 8, benchmarks.md), a cost no
    verify's step time shows."""
    if len(tokens_left) < LOCKSTEP_GROUP:
        return False
    return len(set(tokens_left)) * LOCKSTEP_GROUP <= len(tokens_left)
