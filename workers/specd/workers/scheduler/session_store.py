"""Streaming sessions (seed 004): a session keeps its request row and KV between turns.

A turn is an ordinary request whose prompt is the session's history (every earlier
prompt and completion) followed by the new tokens, and whose ``RequestKV`` is the
session's own: it starts with ``committed == len(history) - 1`` (all history KV but the
last token's, which the turn's first forward writes, as any decode step would), so only
the new tokens are prefilled.

When a turn ends (``end_turn``, on the engine loop thread, after any step in flight):

* finished normally -> ``save_turn``: the history grows by the turn, speculative
  overshoot is trimmed (``trim_overshoot``) and the KV stays with the session, its whole
  pages shared with the prefix cache (``share_history``);
* aborted, failed, or out of context -> ``rollback_turn`` to the last finished turn; the
  KV of the history is kept (unless a retraction took it), so the next turn reuses it;
* the session was closed meanwhile -> everything is freed.

With a prefix cache, sessions and requests share KV pages: a turn whose session holds
no KV (the first, or one after an eviction) starts on the cached prefix of its tokens,
e.g. a system prompt another session or request computed; a finished turn's whole
pages go to the cache, which lends them to anyone starting the same way while the
session keeps them borrowed (a page several sessions share is held once); KV a session
frees (closed, expired, or evicted under memory pressure) stays cached until the pool
needs it, so an evicted session's next turn usually borrows its history back.

An idle session can leave for another replica (``leave``: its history and a copy of
its KV, then freed here) and arrive on one (``arrive``); see `engine.session_transfer`.

Idle sessions expire after ``timeout_s``.  Closed and expired ids are remembered (a
bounded list) so a late turn gets 410, not 404.  ``open``/``close`` may be called from
any thread; the rest runs on the engine loop thread, which owns the KV.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specd.workers.mem_cache.kv_manager import KVManager, RequestKV
from specd.workers.requests.request import Req
from specd.workers.scheduler.fit import FitPolicy
from specd.workers.types import FinishReason, SessionError

_REMEMBERED_ENDED = 4096  # closed/expired ids kept for a 410 answer


class TurnSettling(SessionError):
    """The previous turn has finished but a step in flight still holds its KV: the new
    turn waits (the engine retries it after the step) instead of getting 409."""


@dataclass(slots=True, eq=False)
class Session:
    sid: str
    kv: RequestKV = field(default_factory=RequestKV)  # shared with the turn in flight
    history: list[int] = field(default_factory=list)  # prompts + completions of past turns
    last_used: float = field(default_factory=time.monotonic)
    turn: Req | None = None  # the turn in flight
    closing: bool = False  # closed while a turn was in flight: free after it

    @property
    def final_kv_tokens(self) -> list[int]:
        """The history tokens whose KV the session holds (its last token's is computed
        by the next turn)."""
        return self.history[: min(len(self.history) - 1, self.kv.committed)]

    @property
    def kv_intact(self) -> bool:
        """The KV of the whole history (but its last token) is held."""
        return bool(self.history) and self.kv.committed == len(self.history) - 1


class SessionStore:
    def __init__(
        self,
        kv: KVManager,
        *,
        fit: FitPolicy,
        enabled: bool,
        max_sessions: int,
        timeout_s: float,
        bos_token_id: int | None = None,
    ):
        self.kv = kv
        self.fit = fit  # whether a turn, with the history, fits the context and the pool
        self.bos_token_id = bos_token_id  # later turns drop it: no second BOS mid-context
        self.enabled = enabled
        self.max_sessions = max_sessions
        self.timeout_s = timeout_s
        self._sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # sid -> "closed" | "expired"
        self._lock = threading.Lock()

    # -- any thread ------------------------------------------------------------
    def open(self) -> str:
        sid = uuid.uuid4().hex
        self._add(Session(sid))
        return sid

    def _add(self, session: Session) -> None:
        """Hold a new session (400 sessions disabled, 429 full, 409 id already here)."""
        if not self.enabled:
            raise SessionError(
                "sessions are disabled on this deployment (set spec.sessions.enabled: true)",
                400,
            )
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise SessionError(
                    f"{self.max_sessions} sessions are open (spec.sessions.maxSessions); "
                    "close one or retry later",
                    429,
                )
            if session.sid in self._sessions:
                raise SessionError(f"session {session.sid} is already on this replica", 409)
            self._sessions[session.sid] = session

    def holds(self, sid: str) -> bool:
        """``sid`` is open here (a turn could go to it)."""
        with self._lock:
            session = self._sessions.get(sid)
            return session is not None and not session.closing

    def mark_closing(self, sid: str) -> None:
        """First half of a close (caller's thread): later turns get 410 at once."""
        with self._lock:
            self._get(sid).closing = True

    def _get(self, sid: str) -> Session:
        session = self._sessions.get(sid)
        if session is not None and not session.closing:
            return session
        if session is not None or sid in self._ended:
            how = self._ended.get(sid, "closed")
            raise SessionError(f"session {sid} was {how}; open a new session", 410)
        if not self.enabled:
            raise SessionError(
                "session_id: sessions are disabled on this deployment "
                "(set spec.sessions.enabled: true)",
                400,
            )
        raise SessionError(f"session_id: no session {sid}", 404)

    # -- engine loop thread ----------------------------------------------------
    def begin_turn(self, sid: str, req: Req) -> None:
        """Make ``req`` (prompt = the new tokens) a turn of ``sid``: prepend the history,
        hand it the session's KV, and record the reused length in ``req.cached_tokens``.
        The fit policy may refuse the turn (``InvalidRequest``); the session is then
        untouched."""
        with self._lock:
            session = self._get(sid)
        if session.turn is not None and session.turn.finished:
            raise TurnSettling(f"session {sid}: the last turn is still settling", 409)
        if session.turn is not None:
            raise SessionError(
                f"session {sid} already has a turn in flight; wait for it to finish", 409
            )
        if session.history and self.bos_token_id is not None:
            req.prompt_ids = drop_leading(req.prompt_ids, self.bos_token_id)
        history = len(session.history)
        self.fit.check(history + len(req.prompt_ids), req.params.max_tokens, history)
        session.turn = req
        req.prompt_ids = session.history + req.prompt_ids
        req.kv = session.kv
        req.session = session
        req.cached_tokens = len(session.history) if session.kv_intact else session.kv.committed

    def end_turn(self, req: Req, context_length: int) -> None:
        """The turn ``req`` is over and no step is in flight for it."""
        session = req.session
        session.turn = None
        session.last_used = time.monotonic()
        if session.closing:
            self._free(session, "closed", req.final_kv_tokens)
        elif completed_turn(req, context_length):
            save_turn(self.kv, session, req)
        else:
            rollback_turn(self.kv, session, req.final_kv_tokens)

    def close_now(self, sid: str) -> Req | None:
        """Second half of a close (loop thread): free an idle session at once; a busy
        one is freed when its turn ends.  Returns the turn to abort, if any."""
        session = self._sessions.get(sid)
        if session is None:
            return None
        if session.turn is None:
            self._free(session, "closed", session.final_kv_tokens)
        return session.turn

    def expire(self, now: float | None = None) -> int:
        """Close sessions idle for longer than the timeout; returns how many."""
        now = time.monotonic() if now is None else now
        idle = [
            s
            for s in self._sessions.values()
            if s.turn is None and not s.closing and now - s.last_used > self.timeout_s
        ]
        for session in idle:
            self._free(session, "expired", session.final_kv_tokens)
        return len(idle)

    def idle_ids(self) -> list[str]:
        """Sessions that can move (once their last turn has settled): no turn running,
        not closing."""
        with self._lock:  # `open` may add one from another thread
            sessions = list(self._sessions.values())
        return [s.sid for s in sessions if not s.closing and (s.turn is None or s.turn.finished)]

    def leave(self, sid: str, read_kv: Callable[[RequestKV], tuple]) -> tuple[Session, tuple]:
        """Take idle ``sid`` out for a move to another replica: its KV as ``read_kv``
        copies it (nothing when the session no longer holds it all), then freed here;
        later calls for it get 410.  `TurnSettling` while a step in flight still holds
        its last turn's KV."""
        with self._lock:
            session = self._get(sid)
        if session.turn is not None and session.turn.finished:
            raise TurnSettling(f"session {sid}: the last turn is still settling", 409)
        if session.turn is not None:
            raise SessionError(f"session {sid} has a turn in flight; it cannot move", 409)
        kv = read_kv(session.kv) if session.kv_intact else ()
        self._free(session, "moved to another replica", ())  # its turns go where it went
        return session, kv

    def arrive(
        self, sid: str, history: list[int], idle_s: float, write_kv: Callable[[RequestKV], bool]
    ) -> bool:
        """Take in a session that left another replica (refused as `open` is); ``write_kv``
        may give it the history's KV, else its next turn prefills the history.  Returns
        whether the KV came along."""
        session = Session(sid, history=list(history), last_used=time.monotonic() - idle_s)
        self._add(session)
        try:
            return write_kv(session.kv)
        except BaseException:
            with self._lock:
                del self._sessions[sid]
            raise

    def evict_lru(self) -> bool:
        """Give up the KV of the least recently used idle session (its history stays;
        its pages stay in the prefix cache, if any, until the pool needs them, so its
        next turn borrows what is left and prefills the rest).  False when no idle
        session holds KV."""
        holding = [s for s in self.idle_sessions() if s.kv.row is not None]
        if not holding:
            return False
        session = min(holding, key=lambda s: s.last_used)
        self.kv.release(session.kv, session.final_kv_tokens)
        return True

    def _free(self, session: Session, how: str, final_tokens: Sequence[int]) -> None:
        """End ``session``: its KV is released, the whole pages of ``final_tokens`` (the
        tokens its KV is final for) kept in the prefix cache."""
        if session.kv.row is not None:
            self.kv.release(session.kv, final_tokens)
        with self._lock:
            self._sessions.pop(session.sid, None)
            self._ended[session.sid] = how
            while len(self._ended) > _REMEMBERED_ENDED:
                self._ended.popitem(last=False)

    # -- accounting ------------------------------------------------------------
    @property
    def num_open(self) -> int:
        return len(self._sessions)

    def idle_sessions(self) -> list[Session]:
        return [s for s in self._sessions.values() if s.turn is None]

    def held_tokens(self) -> int:
        """KV slots idle sessions keep: whole pages, their own and the cached ones they
        borrow (a page several sessions share counts once)."""
        pages = {page for s in self.idle_sessions() for page in s.kv.pages}
        return len(pages) * self.kv.page_size

    def check(self) -> None:
        """Every idle session holds exactly its history's KV (or none): raises
        AssertionError naming the session."""
        for s in self.idle_sessions():
            kv = s.kv
            if kv.row is None and kv.committed == kv.allocated == 0:
                continue
            if not s.kv_intact or kv.allocated != kv.committed:
                raise AssertionError(
                    f"session {s.sid}: holds committed {kv.committed} / allocated "
                    f"{kv.allocated} for a history of {len(s.history)} tokens (expected "
                    f"{len(s.history) - 1} / {len(s.history) - 1})"
                )


def drop_leading(ids: list[int], token: int) -> list[int]:
    """``ids`` without a leading ``token`` (a turn's BOS, when it continues a history);
    a turn that is nothing but that token keeps it."""
    return ids[1:] if len(ids) > 1 and ids[0] == token else ids


def completed_turn(req: Req, context_length: int) -> bool:
    """A turn that joins the history: stopped or reached max_tokens, inside the context."""
    if req.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        return False
    return req.num_fill < context_length


def save_turn(kv: KVManager, session: Session, req: Req) -> None:
    """Keep a finished turn: its tokens join the history, its KV stays."""
    session.history = req.fill_ids
    trim_overshoot(kv, req.kv, len(session.history) - 1)
    share_history(kv, session)


def share_history(kv: KVManager, session: Session) -> None:
    """Put the whole pages of ``session``'s history KV in the prefix cache (no-op
    without one) and borrow them back: a request or session that starts the same way
    reuses them, and a page the cache already held is not kept twice."""
    kv.share_computed(session.kv, session.final_kv_tokens)


def trim_overshoot(kv: KVManager, held: RequestKV, target: int) -> None:
    """Speculation may have committed or allocated past the turn's last token: free
    ``[ceil_page(target), allocated)`` and clamp both lengths to ``target`` (a turn
    retracted and never re-admitted holds nothing: nothing changes)."""
    kv.free_tail(held, target)


def rollback_turn(kv: KVManager, session: Session, final_tokens: Sequence[int]) -> None:
    """Forget an unfinished turn: keep the history's KV if it is all there (free what
    the turn added), else release everything (the whole pages of ``final_tokens``, the
    tokens the turn's KV is final for, stay cached) and let the next turn borrow or
    prefill the history."""
    held, keep = session.kv, len(session.history) - 1
    if held.row is None:
        return
    if keep > 0 and held.committed >= keep:
        kv.free_tail(held, keep)
    else:
        kv.release(held, final_tokens)
