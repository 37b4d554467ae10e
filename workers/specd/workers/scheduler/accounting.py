"""KV length accounting of a speculative decode step (seeds 002 and 004).

Before the step the request's committed length counts every token but the last (the
bonus token of the previous verify, whose KV the verify writes as the tree root).
``preclaim_bonus_slot`` claims that slot up front, like plain decode does, so that a
request seen between prepare and resolve already counts it; ``resolve_committed`` then
adds the rest of the verify's new tokens.  The net change per step is the number of new
tokens either way.
"""

from __future__ import annotations

from collections.abc import Sequence

from specd.workers.debug_toggles import reverted
from specd.workers.mem_cache.kv_manager import RequestKV
from specd.workers.requests.request import Req


def preclaim_bonus_slot(kv: RequestKV) -> None:
    """Count the root (last bonus) slot as committed before the verify runs."""
    if not reverted("bonus-preclaim"):
        kv.committed += 1


def resolve_committed(kv: RequestKV, num_new_tokens: int) -> None:
    """After verify: the root and the accepted drafts have KV; the new bonus does not.

    ``num_new_tokens`` = accepted drafts + the bonus (``VerifyResult.num_new_tokens``);
    the pre-claimed root slot is already counted, so ``num_new_tokens - 1`` is added.
    """
    kv.committed += num_new_tokens if reverted("bonus-preclaim") else num_new_tokens - 1


def return_preclaimed_slot(kv: RequestKV) -> None:
    """A request finished before this step's result was used: its root slot was claimed
    for nothing (seed 004: keeps a finished request's committed length exact)."""
    if not reverted("bonus-preclaim"):
        kv.committed -= 1


def check_committed_lengths(running: Sequence[Req]) -> None:
    """Strict mode (seed 004): a drafting request's committed length is every token
    but the last (whose KV the next verify writes), plus the root slot pre-claimed by
    each verify still in flight.  Raises AssertionError naming the request."""
    for req in running:
        if not req.spec_ready:
            continue
        expected = req.num_fill - 1 + req.inflight_steps
        if req.kv.committed != expected:
            raise AssertionError(
                f"request {req.rid}: committed {req.kv.committed} != {req.num_fill - 1} "
                f"tokens with KV + {req.inflight_steps} pre-claimed root(s) of verify "
                f"steps in flight"
            )
