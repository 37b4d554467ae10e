"""API keys: the OpenAI endpoints answer only requests that present one.

As vLLM's ``--api-key`` and SGLang's: with keys configured, every path under ``/v1/``
and ``/tokenize``, ``/detokenize`` need ``Authorization: Bearer <key>``; ``/health``,
``/version``, ``/metrics`` and ``/admin/*`` are not theirs: probes, Prometheus and the
operator read them, and ``/admin/*`` has its own token (`admin_auth`; an API key never
opens it).  Keys come from ``SPECD_API_KEY``
(several, comma-separated) and ``SPECD_API_KEY_FILE`` (one per line), a file the
operator mounts from a Kubernetes Secret (``spec.auth.apiKeySecret``).  The file is
read again whenever it changes, so keys rotate without a restart: add the new key,
move clients over, remove the old one.  A file that cannot be read keeps the keys last
read from it (none at first: every request is refused, never let through).  A setting
given but naming no key (``SPECD_API_KEY=" "`` or ``","``, a file of blank lines) is
refused at start (`ApiKeys.blank_settings`): a typo never turns authentication off.

A key's identity (`key_id`) is a hash of it, never the key: rate limits bucket by it, and
sessions and stored responses belong to it (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specd.workers.config import API_KEY_ENV, API_KEY_FILE_ENV

log = logging.getLogger(__name__)

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class ApiKeys:
    def __init__(
        self, keys: tuple[str, ...] = (), path: str | None = None, *, given: tuple[str, ...] = ()
    ):
        """``given``: the settings these came from, checked by `blank_settings`."""
        self._fixed = tuple(k for k in keys if k)
        self.path = Path(path) if path else None
        self._from_file: tuple[str, ...] = ()
        self._file_version: tuple[int, int] | None = None  # (mtime_ns, size) last read
        self._given = given

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ApiKeys:
        env = os.environ if environ is None else environ
        keys = tuple(k.strip() for k in env.get(API_KEY_ENV, "").split(","))
        given = tuple(name for name in (API_KEY_ENV, API_KEY_FILE_ENV) if name in env)
        return cls(keys, env.get(API_KEY_FILE_ENV, "").strip() or None, given=given)

    def blank_settings(self) -> list[str]:
        """The settings given that name no key: ``SPECD_API_KEY`` of blanks and commas,
        ``SPECD_API_KEY_FILE`` blank or a file of blank lines (refused at start)."""
        blank = [API_KEY_ENV] if API_KEY_ENV in self._given and not self._fixed else []
        if API_KEY_FILE_ENV in self._given and self.path is None:
            blank.append(API_KEY_FILE_ENV)
        elif self.path is not None and self.path.is_file():
            self._refresh()
            if not self._from_file:
                blank.append(f"{API_KEY_FILE_ENV} ({self.path} holds no key)")
        return blank

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self.path is not None

    def current(self) -> tuple[str, ...]:
        """Every key accepted now (the file re-read if it changed)."""
        if self.path is not None:
            self._refresh()
        return self._fixed + self._from_file

    def allows(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header value carries an accepted key."""
        given = bearer_token(authorization)
        if given is None or not given.strip():
            return False
        given_bytes = given.strip().encode()
        matches = [hmac.compare_digest(given_bytes, k.encode()) for k in self.current()]
        return any(matches)

    def _refresh(self) -> None:
        try:
            stat = self.path.stat()
            version = (stat.st_mtime_ns, stat.st_size)
            if version == self._file_version:
                return
            lines = self.path.read_text().splitlines()
        except OSError as err:
            if self._file_version is not None:
                log.warning(
                    "API key file %s unreadable (%s): keeping its last keys", self.path, err
                )
                self._file_version = None
            return
        self._from_file = tuple(k for k in (line.strip() for line in lines) if k)
        self._file_version = version
        if not self._from_file:
            log.warning("API key file %s holds no key: every /v1 request is refused", self.path)


def key_id(key: str) -> str:
    """A key's identity: its SHA-256 (what rate limits and owners are kept by)."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, as sent (None for
    another scheme)."""
    scheme, _, given = authorization.partition(" ")
    return given if scheme.lower() == "bearer" else None


def needs_key(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIXES)


class RequireApiKey:
    """ASGI middleware: a request to a protected path without an accepted key gets an
    OpenAI-shaped 401."""

    def __init__(self, app: Any, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]):
            headers = dict(scope.get("headers") or ())
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not self.keys.allows(authorization):
                await _unauthorized(send, bool(authorization))
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Callable, presented: bool) -> None:
    message = (
        "invalid API key" if presented else "missing API key"
    ) + ": send 'Authorization: Bearer <key>' (OpenAI clients: api_key=<key>)"
    await send_error(send, 401, message, [(b"www-authenticate", b"Bearer")])


async def send_error(
    send: Callable, status: int, message: str, headers: list[tuple[bytes, bytes]]
) -> None:
    """Answer an ASGI request with OpenAI's error object for ``status``."""
    from specd.workers.gateway.protocol import error_body  # torch: not for the CLI's import

    body = error_body(status, message).model_dump_json().encode()
    start_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": start_headers})
    await send({"type": "http.response.body", "body": body})
