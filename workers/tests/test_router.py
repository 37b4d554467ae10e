"""Replica routing (`router.pick_replica`) as a table.  No Ray cluster, no HTTP."""

from __future__ import annotations

import pytest

from specd.workers.router import ReplicaLoad, pick_replica

L = ReplicaLoad

ROUTING = {
    "no replica": ([], None),
    "single": ([L("r0")], "r0"),
    "idle tie -> name": ([L("r1"), L("r0")], "r0"),
    "fewer in flight": ([L("r0", inflight=2), L("r1", inflight=1)], "r1"),
    "queued tokens count": ([L("r0", queued_tokens=500), L("r1", inflight=3)], "r1"),
    "tokens + in flight summed": (
        [L("r0", queued_tokens=2, inflight=2), L("r1", queued_tokens=5)],
        "r0",
    ),
    "kv usage breaks a load tie": (
        [L("r0", inflight=1, kv_usage=0.9), L("r1", inflight=1, kv_usage=0.2)],
        "r1",
    ),
    "load beats kv usage": ([L("r0", inflight=1, kv_usage=0.0), L("r1", kv_usage=0.99)], "r1"),
    "full tie -> name": ([L("b", 3, 1, 0.5), L("a", 3, 1, 0.5), L("c", 3, 1, 0.5)], "a"),
}


@pytest.mark.parametrize("replicas,expected", ROUTING.values(), ids=ROUTING.keys())
def test_pick_replica(replicas, expected):
    assert pick_replica(replicas) == expected
    assert pick_replica(reversed(replicas)) == expected  # order of the input never matters
