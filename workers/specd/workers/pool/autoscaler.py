"""Replica autoscaling (``spec.autoscaling``): how many replicas the load asks for.

Ray Serve's policy on ongoing requests.  At every probe the pool reports the requests
its replicas hold (streams the gateway has open on them: running or queued in their
engines); the mean over the last ``lookBackSeconds``, divided by
``targetOngoingRequests`` and rounded up, clamped to [min, max], is the *proposal*.  A
proposal above the current count must stand for ``upscaleDelaySeconds``, one below it
for ``downscaleDelaySeconds``, before it is taken (the newest proposal then): a burst
shorter than the delay starts no replica, a lull shorter than it stops none.

Scale to zero (``minReplicas: 0``): a lull with no request at all for the look-back
window proposes 0, taken after the downscale delay, unless a streaming session is open
(its KV lives on a replica: the floor stays 1).  Requests that arrive then are held at
the gateway and count as load; a proposal above zero replicas is taken at once (no
upscale delay), as Ray Serve does for a deployment scaled to zero.

    load (mean)   12 ──────┐                        target 4, min 1, max 4
                            └──── 3 ────────
    proposal       3 ──────┐                        upscale delay 30 s
                            └──── 1 ────────        downscale delay 600 s
    count          1 ··(30 s)·· 3 ········(600 s)········ 1

Pure bookkeeping: no Ray, no clock of its own (the pool passes the time in).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from specd.workers.config import AutoscalingSpec


@dataclass(frozen=True, slots=True)
class ScaleChange:
    """A new replica count the autoscaler took, and why."""

    old: int
    new: int
    mean_ongoing: float
    target: float
    waited_s: float

    def describe(self) -> str:
        return (
            f"{self.old} -> {self.new} replicas: {self.mean_ongoing:.1f} ongoing requests "
            f"(target {self.target:g} per replica), asked for {self.waited_s:.0f} s"
        )


def keep_for_sessions(sessions_open: int) -> int:
    """The fewest replicas open streaming sessions need: one (their KV lives there)."""
    return 1 if sessions_open else 0


class Autoscaler:
    def __init__(self, policy: AutoscalingSpec, replicas: int):
        self.policy = policy
        self.replicas = policy.clamp(replicas)  # the count the pool converges to
        self._samples: deque[tuple[float, int]] = deque()  # (time, ongoing requests)
        self._pending: tuple[int, float] | None = None  # (+1 up | -1 down, since when)
        self.mean_ongoing = 0.0
        self.wanted = self.replicas  # what the load asks for, bounds aside
        self.proposal = self.replicas  # ``wanted`` within the bounds

    def retune(self, policy: AutoscalingSpec, replicas: int | None = None) -> None:
        """A new policy (its bounds apply to the current count at once), and with
        ``replicas`` a count set by hand (``spec.replicas`` changed: taken at once)."""
        self.policy = policy
        self.replicas = policy.clamp(self.replicas if replicas is None else replicas)
        self._pending = None

    def observe(self, now: float, ongoing: int, sessions_open: int = 0) -> ScaleChange | None:
        """Record the load at ``now`` (``ongoing``: streams open on replicas and requests
        held for one); returns the change when a new count is due."""
        self._samples.append((now, ongoing))
        while self._samples[0][0] < now - self.policy.look_back_seconds:
            self._samples.popleft()
        self.mean_ongoing = sum(n for _, n in self._samples) / len(self._samples)
        self.wanted = math.ceil(self.mean_ongoing / self.policy.target_ongoing_requests)
        self.proposal = self.policy.clamp(max(self.wanted, keep_for_sessions(sessions_open)))
        return self._decide(now)

    def _decide(self, now: float) -> ScaleChange | None:
        """Take the proposal once it has stood in one direction for that direction's
        delay; a proposal equal to the count, or one that turned around, starts over."""
        direction = (self.proposal > self.replicas) - (self.proposal < self.replicas)
        if direction == 0:
            self._pending = None
            return None
        if self._pending is None or self._pending[0] != direction:
            self._pending = (direction, now)
        since = self._pending[1]
        delay = (
            self.policy.upscale_delay_seconds
            if direction > 0
            else self.policy.downscale_delay_seconds
        )
        if self.replicas == 0:  # requests are waiting for any replica at all
            delay = 0
        if now - since < delay:
            return None
        change = ScaleChange(
            self.replicas,
            self.proposal,
            self.mean_ongoing,
            self.policy.target_ongoing_requests,
            now - since,
        )
        self.replicas, self._pending = self.proposal, None
        return change

    def status(self, now: float) -> dict:
        """For ``/admin/status``: the policy's figures and what is pending."""
        pending = None
        if self._pending is not None:
            pending = {
                "direction": "up" if self._pending[0] > 0 else "down",
                "for_s": round(now - self._pending[1], 1),
            }
        return {
            "min_replicas": self.policy.min_replicas,
            "max_replicas": self.policy.max_replicas,
            "target_ongoing_requests": self.policy.target_ongoing_requests,
            "mean_ongoing_requests": round(self.mean_ongoing, 2),
            "wanted": self.wanted,
            "proposal": self.proposal,
            "pending": pending,
        }
