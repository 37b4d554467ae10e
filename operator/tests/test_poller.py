"""The poller's peering rule (kopf's: pause for any live peer of higher or equal priority)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from specd.operator.poller import Peering, outranked_by, own_identity

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def seen(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).isoformat()


@pytest.mark.parametrize(
    ("peers", "rivals"),
    [
        ({}, []),
        ({"me": {"priority": 10, "lastseen": seen(1), "lifetime": 60}}, []),
        ({"b": {"priority": 20, "lastseen": seen(1), "lifetime": 60}}, ["b"]),
        ({"b": {"priority": 10, "lastseen": seen(1), "lifetime": 60}}, ["b"]),  # a tie pauses
        ({"b": {"priority": 5, "lastseen": seen(1), "lifetime": 60}}, []),
        ({"b": {"priority": 20, "lastseen": seen(61), "lifetime": 60}}, []),  # dead
        ({"b": {"priority": 20, "lastseen": seen(1), "lifetime": 0}}, []),  # leaving
        ({"b": {"priority": 20}}, ["b"]),  # no lastseen: alive, as kopf assumes
        ({"b": None}, []),  # a removed entry (merge patch null) left behind
    ],
)
def test_outranked_by_follows_kopfs_rule(peers, rivals):
    assert outranked_by(peers, "me", 10, NOW) == rivals


def test_peering_paths_cover_every_watched_namespace():
    assert Peering("specd", "me", 0).paths() == ["/apis/kopf.dev/v1/clusterkopfpeerings/specd"]
    assert Peering("specd", "me", 0, ("a", "b")).paths() == [
        "/apis/kopf.dev/v1/namespaces/a/kopfpeerings/specd",
        "/apis/kopf.dev/v1/namespaces/b/kopfpeerings/specd",
    ]


def test_own_identity_prefers_the_pod_name(monkeypatch):
    monkeypatch.setenv("POD_ID", "specd-operator-1")
    assert own_identity() == "specd-operator-1"
    monkeypatch.delenv("POD_ID")
    assert own_identity() != own_identity()  # a fresh suffix per process start
