"""The reconcile plan: what to start and retire, and when a start may happen.

`plan_reconcile` is pure: it compares the live replicas with the desired count and
config hash and says how many replicas to start and which to retire (a rolling update
one replica at a time, with one surge replica).  `StartBackoff` says whether a start may
happen now: failed starts back off, and a model that fails to load the same way twice
is a `ReplicaFailure`, which holds back starts of that config until the spec changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specd.workers.pool.replica import ReplicaFailure, ReplicaState

MAX_START_BACKOFF_S = 60.0


class _ReplicaView(Protocol):
    name: str
    state: ReplicaState
    config_hash: str


@dataclass(frozen=True, slots=True)
class Plan:
    start: int = 0
    retire: tuple[str, ...] = ()


def plan_reconcile(
    replicas: Sequence[_ReplicaView], desired: int, config_hash: str, *, can_start: bool = True
) -> Plan:
    """What to start and retire so that ``desired`` ready replicas run ``config_hash``.

    ``replicas`` is in creation order.  Outdated replicas still starting are retired at
    once; outdated ready ones go one at a time as current ones become ready, with one
    surge replica started while any remains (so capacity never dips during a roll).
    Scale-down retires starting replicas first, then the newest.
    """
    live = [r for r in replicas if r.state in (ReplicaState.STARTING, ReplicaState.READY)]
    current = [r for r in live if r.config_hash == config_hash]
    outdated = [r for r in live if r.config_hash != config_hash]
    current_starting = [r for r in current if r.state is ReplicaState.STARTING]
    current_ready = [r for r in current if r.state is ReplicaState.READY]
    old_ready = [r for r in outdated if r.state is ReplicaState.READY]
    retire = [r for r in outdated if r.state is ReplicaState.STARTING]

    if len(current) > desired:
        extra = current_starting[::-1] + current_ready[::-1]
        retire += extra[: len(current) - desired] + old_ready
        return Plan(0, tuple(r.name for r in retire))

    surplus = max(0, len(current_ready) + len(old_ready) - desired)
    retire += old_ready[:surplus]
    old_kept = len(old_ready) - surplus
    start = max(0, desired - len(current) - old_kept)
    if start == 0 and old_kept and not current_starting:
        start = 1  # the rolling update's surge replica
    return Plan(start if can_start else 0, tuple(r.name for r in retire))


@dataclass(slots=True)
class StartBackoff:
    """Failed starts push the next one back (2, 4, 8 ... 60 s); the same load error
    twice in a row for a config hash is a `ReplicaFailure`: no next start of it."""

    failures: int = 0
    next_start_at: float = 0.0  # time.monotonic()
    last_load_error: tuple[str, str] | None = None  # (config hash, message)
    failure: ReplicaFailure | None = None  # see `failure_of`

    def may_start(self, config_hash: str) -> bool:
        return time.monotonic() >= self.next_start_at and self.failure_of(config_hash) is None

    def failure_of(self, config_hash: str) -> ReplicaFailure | None:
        """The `ReplicaFailure` that holds back starts of ``config_hash``, if any."""
        failure = self.failure
        return failure if failure and failure.config_hash == config_hash else None

    def started(self) -> None:
        """A replica became ready: the next failure starts the backoff over."""
        self.failures, self.last_load_error = 0, None

    def new_config(self) -> None:
        """A new config may load: start it at once, and give up only on its own errors."""
        self.failure, self.last_load_error = None, None
        self.failures, self.next_start_at = 0, 0.0

    def failed(self, config_hash: str, replica: str, reason: str, *, load_error: bool) -> str:
        """Replica ``replica`` of ``config_hash`` did not start for ``reason`` -> what
        happens next, in words.  Anything but a ``load_error`` (a timeout, a lost node)
        may pass: it is retried."""
        self.failures += 1
        backoff = min(MAX_START_BACKOFF_S, 2.0**self.failures)
        self.next_start_at = time.monotonic() + backoff
        seen = (config_hash, reason)
        if load_error and seen == self.last_load_error:
            self.failure = ReplicaFailure(config_hash, replica, reason, time.time())
            return "not restarted until the spec changes"
        self.last_load_error = seen if load_error else None
        return f"next try in {backoff:g}s"
