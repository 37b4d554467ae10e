"""KV leak checks (DESIGN §5): does every slot and row have exactly one known holder?

Two pools are balanced against what the scheduler and the session store say they hold:

* ``token``: ``free + cached + protected + session_held + requests == total`` where
  ``requests`` is ``ceil_page(allocated)`` summed over live requests (running, waiting
  with KV, finished but waiting for a step in flight) less the prefix-cache pages they
  borrow, ``session_held`` the same over idle sessions, ``cached`` the prefix cache's
  evictable slots and ``protected`` its borrowed ones.
* ``req_to_token``: ``free rows + request rows + session rows == rows``.

At idle there are no live requests, so the same formulas say "only sessions hold KV".
The checks are a few sums over live requests: cheap enough for every idle moment, and
for every step in strict mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.kv_manager import RequestKV, held_slots
from specd.workers.mem_cache.prefix_cache import PrefixCache
from specd.workers.mem_cache.req_to_token import ReqToTokenPool


@dataclass(frozen=True, slots=True)
class PoolBalance:
    pool: str  # "token" or "req_to_token"
    ok: bool
    breakdown: dict[str, int]

    def describe(self) -> str:
        parts = ", ".join(f"{k}={v}" for k, v in self.breakdown.items())
        return f"{self.pool} pool {'balanced' if self.ok else 'LEAK'}: {parts}"


def token_pool_balance(
    allocator: PagedTokenAllocator,
    requests: Sequence[RequestKV],
    sessions: Sequence[RequestKV],
    cache: PrefixCache | None = None,
) -> PoolBalance:
    held_by_requests = held_slots(requests, allocator.page_size)
    session_held = held_slots(sessions, allocator.page_size)
    breakdown = {
        "total": allocator.total_tokens,
        "free": allocator.free_tokens,
        "cached": cache.evictable_tokens if cache is not None else 0,
        "protected": cache.protected_tokens if cache is not None else 0,
        "session_held": session_held,
        "requests": held_by_requests,
        "used": allocator.used_tokens,
    }
    in_use = breakdown["cached"] + breakdown["protected"] + session_held + held_by_requests
    ok = breakdown["free"] + in_use == breakdown["total"] and breakdown["used"] == in_use
    return PoolBalance("token", ok, breakdown)


def row_pool_balance(
    req_pool: ReqToTokenPool, requests: Sequence[RequestKV], sessions: Sequence[RequestKV]
) -> PoolBalance:
    request_rows = sum(1 for kv in requests if kv.row is not None)
    session_rows = sum(1 for kv in sessions if kv.row is not None)
    breakdown = {
        "rows": req_pool.num_rows,
        "free": req_pool.num_free,
        "session_held": session_rows,
        "requests": request_rows,
    }
    ok = req_pool.num_free + session_rows + request_rows == req_pool.num_rows
    return PoolBalance("req_to_token", ok, breakdown)
