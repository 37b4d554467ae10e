"""Sessions and stored responses belong to the API key that made them (docs/security.md).

With API keys, a request's owner is its key's `api_keys.key_id` (a hash, never the key);
without keys there is no owner and everything is shared, as before.  Another key asking
for what it does not own gets the same 404 as an unknown id, so it cannot even learn
that the id exists.

A stored response keeps its owner beside it (`responses_api.ResponseStore`).  A session
lives in an engine, which knows no keys, and outlives a gateway restart (the next
gateway adopts the actors), so its owner travels in the id the client holds: the
router's ``<actor>.<engine session>`` token, sealed as ``<token>-<tag>`` where ``tag``
is an HMAC of (owner, token) under a gateway secret.  Another key cannot make a tag
that holds for itself without the secret.  The secret derives from the admin token,
which the operator keeps in a Secret that is never rotated, so a restarted gateway
still recognizes the tags; a gateway without an admin token draws one at random.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from specd.workers.gateway.api_keys import bearer_token, key_id

TAG_CHARS = 32  # hex: 128 bits of HMAC-SHA256


class Owners:
    """Who owns a request's sessions and responses, and the seal on session ids."""

    def __init__(self, keyed: bool, admin_token: str | None = None):
        self.keyed = keyed
        base = admin_token.encode() if admin_token else os.urandom(32)
        self._secret = hmac.new(base, b"specd session owner", hashlib.sha256).digest()

    def of(self, headers: Mapping[str, str]) -> str | None:
        """The owner of a request with these headers: its key's id (None without keys;
        the key check already let only listed keys through)."""
        if not self.keyed:
            return None
        key = bearer_token(headers.get("authorization", ""))
        return None if key is None else key_id(key.strip())

    def seal(self, token: str, owner: str | None) -> str:
        """The session id a client gets for session ``token``."""
        return token if owner is None else f"{token}-{self._tag(token, owner)}"

    def unseal(self, session_id: str, owner: str | None) -> str | None:
        """The session token in ``session_id`` if ``owner`` owns it, else None (without
        keys the id is the token)."""
        if not self.keyed:
            return session_id
        token, _, tag = session_id.rpartition("-")
        if owner is None or not token:
            return None
        expected = self._tag(token, owner).encode()
        return token if hmac.compare_digest(tag.encode(), expected) else None

    def _tag(self, token: str, owner: str) -> str:
        message = f"{owner}\n{token}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:TAG_CHARS]
