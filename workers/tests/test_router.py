"""Replica routing (`router.pick_replica`, also ``for_session``; cache-aware
`router.pick_for_prompt`) and session ids as tables.  No Ray cluster, no HTTP."""

from __future__ import annotations

import pytest

from specd.workers.config import RoutingSpec
from specd.workers.pool.replica import actor_name, replica_of_actor
from specd.workers.pool.router import (
    ReplicaLoad,
    parse_session_token,
    pick_for_prompt,
    pick_replica,
    session_token,
)

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


SESSION_ROUTING = {
    "no replica": ([], None),
    "fewer sessions wins over load": (
        [L("r0", inflight=0, sessions_open=3), L("r1", inflight=4, sessions_open=1)],
        "r1",
    ),
    "session tie -> least loaded": (
        [L("r0", inflight=2, sessions_open=1), L("r1", inflight=1, sessions_open=1)],
        "r1",
    ),
    "full tie -> name": ([L("r1"), L("r0")], "r0"),
}


@pytest.mark.parametrize("replicas,expected", SESSION_ROUTING.values(), ids=SESSION_ROUTING.keys())
def test_pick_session_replica(replicas, expected):
    assert pick_replica(replicas, for_session=True) == expected
    assert pick_replica(reversed(replicas), for_session=True) == expected


RULE = RoutingSpec(cache_threshold=0.3, balance_abs_threshold=8, balance_rel_threshold=1.5)
PROMPT = 100  # tokens
PROMPT_ROUTING = {
    "no replica": ([], None),
    "the longest hit wins": (
        [L("r0", predicted_hit=48), L("r1", predicted_hit=96, inflight=3)],
        ("r1", "prefix"),
    ),
    "a hit under the threshold is ignored": (
        [L("r0", inflight=1, predicted_hit=29), L("r1")],
        ("r1", "load"),
    ),
    "exactly the threshold counts": (
        [L("r0", inflight=2, predicted_hit=30), L("r1")],
        ("r0", "prefix"),
    ),
    "no hit: least loaded": ([L("r0", inflight=1), L("r1", inflight=2)], ("r0", "load")),
    "no hit, load tie: the least cache credited": (
        [L("r0", tracked_tokens=512), L("r1", tracked_tokens=64)],
        ("r1", "load"),
    ),
    "equal hits: the less loaded": (
        [L("r0", inflight=3, predicted_hit=64), L("r1", inflight=1, predicted_hit=64)],
        ("r1", "prefix"),
    ),
    "too busy on both thresholds": (
        [L("r0", inflight=13, predicted_hit=96), L("r1", inflight=4)],
        ("r1", "balance"),
    ),
    "absolute gap but not relative": (
        [L("r0", inflight=30, predicted_hit=96), L("r1", inflight=21)],
        ("r0", "prefix"),
    ),
    "relative gap but not absolute": (
        [L("r0", inflight=8, predicted_hit=96), L("r1", inflight=0)],
        ("r0", "prefix"),
    ),
}


@pytest.mark.parametrize("replicas,expected", PROMPT_ROUTING.values(), ids=PROMPT_ROUTING.keys())
def test_pick_for_prompt(replicas, expected):
    assert pick_for_prompt(replicas, PROMPT, RULE) == expected
    assert pick_for_prompt(reversed(replicas), PROMPT, RULE) == expected


@pytest.mark.parametrize("deployment", ["chat", "my.model-v2"])
def test_session_token_round_trip(deployment):
    ray_name = actor_name(deployment, "a1b2c3", "r12")
    token = session_token(ray_name, "0123abcd")
    assert parse_session_token(token) == (ray_name, "0123abcd")
    assert replica_of_actor(ray_name) == "r12"


MALFORMED = ["", "nodot", "actor.", ".sid", "a/b.c", "a.b c", "a.b?x", "x" * 400 + ".y"]


@pytest.mark.parametrize("token", MALFORMED)
def test_malformed_session_tokens(token):
    assert parse_session_token(token) is None


def test_replica_of_a_foreign_actor_name_is_the_name():
    assert replica_of_actor("someone-else") == "someone-else"
