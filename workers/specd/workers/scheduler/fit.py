"""Whether a request fits this replica: its context within the context length, and its
whole KV (prompt + max_tokens, plus a verify step's reserve) within the pool.

`FitPolicy.check` runs before a request is queued; a session turn runs it on the loop,
with its session's history (`SessionStore.begin_turn`).
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.workers.mem_cache.sizing import SpecShape, admission_headroom, ceil_page
from specd.workers.types import InvalidRequest


@dataclass(frozen=True, slots=True)
class FitPolicy:
    context_length: int
    page_size: int
    pool_tokens: int  # token slots of the KV pool (spec.kvCache.maxTokens)
    spec: SpecShape | None = None  # speculative layout: a verify holds a reserve

    def check(self, n: int, max_tokens: int, history: int = 0) -> None:
        """``n`` context tokens (``history`` of them from a session) leave room for output
        within the context length, and the KV pool can hold the whole request; raises
        ``InvalidRequest`` naming the field otherwise."""
        if n >= self.context_length:
            if history:
                raise InvalidRequest(
                    f"prompt: the session's {history} tokens plus this turn's {n - history} "
                    f"do not fit the context length {self.context_length}; open a new session"
                )
            raise InvalidRequest(
                f"prompt: {n} tokens do not fit the context length {self.context_length} "
                "(leave room for at least one output token)"
            )
        need = ceil_page(min(n + max_tokens, self.context_length), self.page_size)
        if self.spec is not None:  # a verify step holds a reserve beyond committed
            need += admission_headroom(self.spec, self.page_size)
        if need > self.pool_tokens:
            raise InvalidRequest(
                f"max_tokens: prompt + max_tokens needs {need} KV slots but the pool holds "
                f"{self.pool_tokens} (spec.kvCache.maxTokens); lower max_tokens"
            )
