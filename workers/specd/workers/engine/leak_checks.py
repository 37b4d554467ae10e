"""The engine's KV leak checks (DESIGN §5): both pools balanced against the live requests
and idle sessions (`mem_cache/leak_check.py`), then the structural checks behind a
balanced pool.  ``busy`` runs after each step in strict mode, ``idle`` once per idle
period (only sessions may hold KV then)."""

from __future__ import annotations

import logging

from specd.workers.engine.metrics import EngineMetrics
from specd.workers.mem_cache.kv_manager import KVManager
from specd.workers.mem_cache.leak_check import row_pool_balance, token_pool_balance
from specd.workers.scheduler.accounting import check_committed_lengths
from specd.workers.scheduler.scheduler import Scheduler
from specd.workers.scheduler.session_store import SessionStore

log = logging.getLogger(__name__)


class LeakChecks:
    def __init__(
        self,
        scheduler: Scheduler,
        sessions: SessionStore,
        kv: KVManager,
        metrics: EngineMetrics,
        *,
        strict: bool,
    ):
        self.scheduler = scheduler
        self.sessions = sessions
        self.kv = kv  # its request rows and page allocator too
        self.metrics = metrics
        self.strict = strict  # a failure fails the engine

    def run(self, mode: str) -> None:
        """Balance both pools against the live requests and idle sessions (DESIGN §5);
        ``busy`` also checks each drafting request's committed length.  A failure is
        counted and logged with the full breakdown; in strict mode it fails the engine
        (the loop ends, health turns red)."""
        holders = [r.kv for r in self.scheduler.kv_holders()]
        held = [s.kv for s in self.sessions.idle_sessions()]
        problems = []
        for balance in (
            token_pool_balance(self.kv.allocator, holders, held, self.kv.cache),
            row_pool_balance(self.kv.req_pool, holders, held),
        ):
            extra = self._consistency_problem(balance.pool, mode) if balance.ok else None
            ok = balance.ok and extra is None
            self.metrics.leak_check(balance.pool, mode, ok)
            if not ok:
                problems.append(f"{balance.describe()}{f'; {extra}' if extra else ''}")
        if not problems:
            return
        message = f"KV leak check ({mode}) failed: " + " | ".join(problems)
        log.error("engine %s: %s", self.metrics.replica, message)
        if self.strict:
            raise AssertionError(message)

    def _consistency_problem(self, pool: str, mode: str) -> str | None:
        """The structural checks behind a balanced pool (ownership, lengths)."""
        try:
            if pool == "req_to_token":
                self.kv.check_integrity()
            else:
                self.sessions.check()
                if mode == "busy":
                    check_committed_lengths(self.scheduler.running)
        except AssertionError as err:
            return str(err)
        return None
