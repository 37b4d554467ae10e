"""Scheduling policy: the order waiting requests are admitted in, and who gives way.

``fcfs`` (the default): requests are admitted in arrival order; when KV runs out the
newest running request is retracted.

``priority`` (vLLM's ``--scheduling-policy priority``, SGLang's priority scheduling):
each request carries an integer ``priority``, lower first (default 0).  Waiting
requests are admitted by ``(priority, arrival)``; when KV runs out the running request
that ranks last is retracted; and a waiting request that cannot start (the running
batch is full, or KV is short) preempts running requests of strictly lower priority
(`preemption_victims`), which go back to the queue keeping their output, as a
retraction does.  Requests of equal priority never preempt each other, so equal
priorities behave as ``fcfs``; a low priority may wait as long as higher ones keep
coming (no aging).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from typing import Literal

from specd.workers.mem_cache.kv_manager import held_slots
from specd.workers.requests.request import Req

Policy = Literal["fcfs", "priority"]


def rank(req: Req) -> tuple[int, float]:
    """Where ``req`` stands under the priority policy (lowest first)."""
    return (req.priority, req.arrival_time)


def enqueue(waiting: deque[Req], req: Req, policy: Policy, *, front: bool = False) -> None:
    """Put ``req`` in the waiting queue: ``fcfs`` at the back (``front``: a retracted
    request, at the front); ``priority`` at its rank (a retracted request keeps its
    arrival time, so it goes ahead of later arrivals of its priority)."""
    if policy == "priority":
        waiting.insert(bisect.bisect_right(waiting, rank(req), key=rank), req)
    elif front:
        waiting.appendleft(req)
    else:
        waiting.append(req)


def retraction_victim(running: Sequence[Req], policy: Policy) -> Req:
    """The running request to retract when KV runs out: the newest (``fcfs``) or the one
    ranking last (``priority``)."""
    if policy == "priority":
        return max(running, key=rank)
    return running[-1]


def preemption_victims(
    running: Sequence[Req], waiting: Req, policy: Policy, tokens_short: int = 0, page_size: int = 1
) -> list[Req]:
    """The running requests ``waiting`` preempts to start: none under ``fcfs``; under
    ``priority``, those of strictly lower priority, last-ranked first, with no step in
    flight: one when the batch is full (``tokens_short`` 0), else as many as free
    ``tokens_short`` KV slots.  Empty when they could not make enough room."""
    if policy != "priority":
        return []
    eligible = sorted(
        (r for r in running if r.priority > waiting.priority and not r.inflight_steps),
        key=rank,
        reverse=True,
    )
    if tokens_short <= 0:
        return eligible[:1]
    victims, freed = [], 0
    for victim in eligible:
        victims.append(victim)
        freed += held_slots([victim.kv], page_size)
        if freed >= tokens_short:
            return victims
    return []
