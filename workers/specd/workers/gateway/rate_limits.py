"""Request rate limits per API key (``spec.auth.requestsPerMinute``).

Each API key may start at most N requests a minute on the OpenAI endpoints (the paths
API keys guard); without keys, all clients share one allowance.  A token bucket per key
holds up to N requests and refills N a minute, so a burst of N is let through and the
rate then evens out.  A request over the limit gets OpenAI's 429 (``type:
rate_limit_exceeded``) with ``Retry-After``; every answer on those paths carries
OpenAI's ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests`` and
``x-ratelimit-reset-requests`` headers.  The limit is read from the live spec on each
request, so changing it needs no restart; buckets are kept by a hash of the key, never
the key itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specd.workers.gateway.api_keys import bearer_token, key_id, needs_key, send_error


@dataclass(slots=True)
class _Bucket:
    requests: float  # requests the key may still start now (fractions refill)
    stamp: float  # when ``requests`` was last brought up to date


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    limit: int
    remaining: int  # whole requests left after this one
    reset_s: float  # until the bucket is full again (refused: until one more request)


class RateLimits:
    """Token buckets of the keys seen, under the limit ``per_minute()`` gives now."""

    def __init__(
        self, per_minute: Callable[[], int | None], clock: Callable[[], float] = time.monotonic
    ):
        self.per_minute, self.clock = per_minute, clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: str) -> Verdict | None:
        """One request for ``key`` (None when no limit is set)."""
        limit = self.per_minute()
        if limit is None:
            return None
        now, rate = self.clock(), limit / 60.0
        bucket = self._buckets.setdefault(key_id(key), _Bucket(float(limit), now))
        bucket.requests = min(float(limit), bucket.requests + (now - bucket.stamp) * rate)
        bucket.stamp = now
        if bucket.requests < 1:
            return Verdict(False, limit, 0, (1 - bucket.requests) / rate)
        bucket.requests -= 1
        return Verdict(True, limit, int(bucket.requests), (limit - bucket.requests) / rate)


def rate_headers(verdict: Verdict) -> list[tuple[bytes, bytes]]:
    """OpenAI's rate-limit headers (and ``Retry-After`` on a refusal)."""
    headers = [
        (b"x-ratelimit-limit-requests", str(verdict.limit).encode()),
        (b"x-ratelimit-remaining-requests", str(verdict.remaining).encode()),
        (b"x-ratelimit-reset-requests", f"{verdict.reset_s:.3f}s".encode()),
    ]
    if not verdict.allowed:
        headers.append((b"retry-after", str(math.ceil(verdict.reset_s)).encode()))
    return headers


class LimitRequestRate:
    """ASGI middleware: a request to a guarded path over its key's limit gets a 429; the
    others pass with the rate-limit headers added to their answer."""

    def __init__(self, app: Any, limits: RateLimits, per_key: bool):
        self.app, self.limits, self.per_key = app, limits, per_key  # False: one bucket

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        key = ""  # without API keys a made-up bearer must not buy a bucket of its own
        if self.per_key:
            headers = dict(scope.get("headers") or ())
            key = bearer_token(headers.get(b"authorization", b"").decode("latin-1")) or ""
        verdict = self.limits.take(key.strip())
        if verdict is None:
            await self.app(scope, receive, send)
        elif not verdict.allowed:
            await _refuse(send, verdict)
        else:
            await self.app(scope, receive, _with_headers(send, rate_headers(verdict)))


def _with_headers(send: Callable, extra: list[tuple[bytes, bytes]]) -> Callable:
    async def send_with_headers(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_with_headers


async def _refuse(send: Callable, verdict: Verdict) -> None:
    message = (
        f"rate limit reached: {verdict.limit} requests per minute for this API key "
        f"(spec.auth.requestsPerMinute); retry after {math.ceil(verdict.reset_s)} s"
    )
    await send_error(send, 429, message, rate_headers(verdict))
