"""The admin token and the rules of ``/admin/*`` (docs/security.md).

Every state-changing admin call (``POST /admin/release`` today) needs
``Authorization: Bearer <admin token>`` and ``Content-Type: application/json``; any
admin request carrying an ``Origin`` header (a browser's) is refused, so a web page the
operator of a machine visits can neither call nor read the admin API.  ``GET
/admin/status`` is read-only and needs no token: the operator's poller, probes and
benchmarks read it.  The admin token is not an API key and an API key is not the admin
token: each guards only its own paths.

Where the token comes from (`load_admin_token`, in this order):

    SPECD_ADMIN_TOKEN        the token itself
    SPECD_ADMIN_TOKEN_FILE   a file holding it: the operator mounts the SDD's Secret
                             there; `specd serve` writes a new random token there
                             (mode 0600) when the file does not exist
    (neither)                the same, at $XDG_STATE_HOME/specd/admin-token
                             (~/.local/state/specd/admin-token), kept across runs

A token that is set but blank is refused at start: the admin API never runs open.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.workers.config import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, ConfigError
from specd.workers.gateway.api_keys import bearer_token, send_error

ADMIN_PREFIX = "/admin/"
READ_ONLY_METHODS = frozenset({"GET", "HEAD"})
JSON = b"application/json"


@dataclass(frozen=True, slots=True)
class AdminToken:
    value: str
    path: Path | None  # the file it was read from or written to (None: the environment)
    generated: bool  # written by this process just now


def default_token_path(environ: dict[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/specd/admin-token`` (per user; ``~/.local/state`` by default)."""
    env = os.environ if environ is None else environ
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "specd" / "admin-token"


def load_admin_token(environ: dict[str, str] | None = None) -> AdminToken:
    """The gateway's admin token (see the module docstring); `ConfigError` naming the
    setting when it is blank or its file cannot be read or written."""
    env = os.environ if environ is None else environ
    if ADMIN_TOKEN_ENV in env:
        if not (token := env[ADMIN_TOKEN_ENV].strip()):
            raise ConfigError(f"{ADMIN_TOKEN_ENV} is set but blank: set a token or unset it")
        return AdminToken(token, None, False)
    given = env.get(ADMIN_TOKEN_FILE_ENV)
    if given is not None and not given.strip():
        raise ConfigError(f"{ADMIN_TOKEN_FILE_ENV} is set but blank: name a file or unset it")
    path = Path(given.strip()) if given else default_token_path(env)
    try:
        return _read_or_create(path)
    except OSError as err:
        raise ConfigError(
            f"admin token file {path} ({ADMIN_TOKEN_FILE_ENV}): {err.strerror or err}"
        ) from err


def _read_or_create(path: Path) -> AdminToken:
    generated = False
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:  # O_EXCL: two processes starting at once keep one token
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            generated = True
    token = path.read_text().strip()
    if not token:
        raise ConfigError(
            f"admin token file {path} ({ADMIN_TOKEN_FILE_ENV}) is blank: delete it (a new "
            "token is written) or put a token in it"
        )
    return AdminToken(token, path, generated)


def admin_refusal(
    method: str, headers: dict[bytes, bytes], token: str | None
) -> tuple[int, str] | None:
    """Why an ``/admin/*`` request is refused, as (status, message), or None."""
    if b"origin" in headers:
        return 403, "the admin API refuses browser requests (the request has an Origin header)"
    if method in READ_ONLY_METHODS:
        return None
    given = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
    if token is None or given is None or not hmac.compare_digest(given.encode(), token.encode()):
        return 401, (
            f"{method} /admin/* needs 'Authorization: Bearer <admin token>' (the admin token, "
            "not an API key; see docs/security.md)"
        )
    if headers.get(b"content-type", b"").split(b";")[0].strip().lower() != JSON:
        return 415, f"{method} /admin/* needs 'Content-Type: application/json'"
    return None


class GuardAdmin:
    """ASGI middleware: `admin_refusal` before any ``/admin/*`` route runs.  ``token``
    None (a gateway built without one) refuses every state change."""

    def __init__(self, app: Any, token: str | None):
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith(ADMIN_PREFIX):
            headers = dict(scope.get("headers") or ())
            refusal = admin_refusal(scope["method"], headers, self.token)
            if refusal is not None:
                status, message = refusal
                challenge = [(b"www-authenticate", b"Bearer")] if status == 401 else []
                await send_error(send, status, message, challenge)
                return
        await self.app(scope, receive, send)
