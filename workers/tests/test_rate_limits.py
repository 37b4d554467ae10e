"""Request rate limits per API key (`rate_limits.RateLimits`): a burst of the limit,
then the refill rate, one bucket per key, the limit read live, keys kept only hashed;
the middleware (one shared bucket without API keys, open paths untouched)."""

from __future__ import annotations

import asyncio

import pytest

from specd.workers.gateway.rate_limits import LimitRequestRate, RateLimits, rate_headers


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_of_the_limit_then_the_refill_rate():
    clock, limit = Clock(), {"n": 3}
    limits = RateLimits(lambda: limit["n"], clock)
    verdicts = [limits.take("a") for _ in range(4)]
    assert [v.allowed for v in verdicts] == [True, True, True, False]
    assert [v.remaining for v in verdicts] == [2, 1, 0, 0]
    assert verdicts[3].reset_s == pytest.approx(20.0)  # 3 a minute: one every 20 s
    assert verdicts[2].reset_s == pytest.approx(60.0)  # empty: full again in a minute
    clock.now += 19.0
    assert not limits.take("a").allowed
    clock.now += 1.0
    assert limits.take("a").allowed and not limits.take("a").allowed
    clock.now += 3600.0  # an idle hour refills up to the limit, no further
    assert [limits.take("a").allowed for _ in range(4)] == [True, True, True, False]


def test_each_key_has_its_own_bucket_kept_hashed():
    limits = RateLimits(lambda: 1, Clock())
    assert limits.take("a").allowed and not limits.take("a").allowed
    assert limits.take("b").allowed and limits.take("").allowed
    assert not {"a", "b"} & set(limits._buckets)
    assert all(len(k) == 64 for k in limits._buckets)  # sha256 hex digests


def test_the_limit_is_read_live():
    limit = {"n": None}
    limits = RateLimits(lambda: limit["n"], Clock())
    assert limits.take("a") is None  # no limit: nothing counted
    limit["n"] = 2
    assert [limits.take("a").allowed for _ in range(3)] == [True, True, False]
    limit["n"] = 1  # lowered: the bucket holds no more than the new limit
    assert not limits.take("a").allowed
    limit["n"] = None
    assert limits.take("a") is None


def test_openai_rate_limit_headers():
    limits = RateLimits(lambda: 1, Clock())
    allowed, refused = limits.take("k"), limits.take("k")
    assert dict(rate_headers(allowed)) == {
        b"x-ratelimit-limit-requests": b"1",
        b"x-ratelimit-remaining-requests": b"0",
        b"x-ratelimit-reset-requests": b"60.000s",
    }
    assert dict(rate_headers(refused))[b"retry-after"] == b"60"


def answers(per_key: bool, bearers: list[str], path: str = "/v1/models") -> list[int]:
    """Status codes of requests with these bearers through the middleware (limit 1)."""

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = LimitRequestRate(ok, RateLimits(lambda: 1, Clock()), per_key=per_key)
    statuses = []

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    for bearer in bearers:
        headers = [(b"authorization", f"Bearer {bearer}".encode())]
        scope = {"type": "http", "path": path, "headers": headers}
        asyncio.run(middleware(scope, None, send))
    return statuses


def test_without_keys_every_client_shares_one_bucket():
    assert answers(per_key=True, bearers=["a", "b", "a"]) == [200, 200, 429]
    assert answers(per_key=False, bearers=["a", "made-up", "another"]) == [200, 429, 429]
    assert answers(per_key=False, bearers=["a", "a"], path="/health") == [200, 200]
