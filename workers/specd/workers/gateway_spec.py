"""`spec.auth` and `spec.gateway`: who may call the OpenAI endpoints and what one request
may cost the gateway.  Gateway-only: not in the config hash, so a change rolls no
replica."""

from __future__ import annotations

from pydantic import Field

from specd.workers.spec_model import SpecModel


class SecretKeyRef(SpecModel):
    name: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
        description="A Secret in the deployment's namespace",
    )
    key: str = Field(
        "api-key", pattern=r"^[-._a-zA-Z0-9]{1,253}$", description="Its key holding the value"
    )


class AuthSpec(SpecModel):
    """Gateway-only (not in the config hash): who may call the OpenAI endpoints."""

    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="API keys (one per line) that /v1 requests must send as "
        "'Authorization: Bearer <key>'; the gateway reads changes live. specd serve: "
        "set SPECD_API_KEY or SPECD_API_KEY_FILE instead",
    )
    requests_per_minute: int | None = Field(
        None,
        ge=1,
        description="Requests each API key may start a minute on the OpenAI endpoints "
        "(bursts up to this many; all clients together when there are no keys); over it: "
        "429 with Retry-After",
    )


MIB = 1 << 20


class GatewaySpec(SpecModel):
    """Gateway-only (not in the config hash): what one request may cost the gateway."""

    max_request_bytes: int = Field(
        16 * MIB,
        ge=64 * 1024,
        le=1 << 30,
        description="Largest request body the gateway reads, in bytes (default 16 MiB: "
        "a 1M-token prompt as text or as token ids); over it: 413, before the body is "
        "read whole",
    )
    max_stream_backlog: int = Field(
        1024,
        ge=16,
        le=1 << 20,
        description="Deltas a streamed response may have waiting for a client that does "
        "not read; past it the stream is cut off with an error and its request aborted "
        "(its KV freed), so a stalled reader holds neither gateway memory nor KV",
    )
    request_read_timeout_seconds: float = Field(
        60.0,
        ge=1,
        le=3600,
        description="How long a client may take to send a request's header (from the "
        "connection opening, or its first byte on a kept-alive connection) and may pause "
        "between two reads of its body; past it: 408 and the connection closed, so a "
        "connection that sends nothing, or a header or body that stalls, holds no socket",
    )
