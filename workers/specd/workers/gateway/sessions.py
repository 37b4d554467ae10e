"""Sessions at the gateway: where a session's turns go (`SessionRoute`), and the calls
that open, place and close sessions and run their turns (`GatewaySessions`).

``POST /v1/sessions`` opens one on a replica (router) and answers an id that names that
replica's actor (`router.session_token`).  Its first turn (a generation request with
``session_id``) may move it to the replica caching that turn's prompt prefix
(`GatewaySessions._placed`); a turn goes to the replica the session is on, which the
pool's `SessionDirectory` remembers (placed, or moved off a retired replica) or, after
a restart, asks the replicas for; if it died the session is gone (410).  With API keys,
sessions belong to the key that made them (`ownership.Owners`: a session id carries its
owner's seal; another key gets 404).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace

from fastapi import Request

from specd.workers.gateway.errors import ApiError, about
from specd.workers.gateway.ownership import Owners
from specd.workers.gateway.protocol import SessionDeleted, SessionObject
from specd.workers.gateway.streams import error_delta, refused
from specd.workers.pool.controller import PoolController
from specd.workers.pool.replica import Replica, ReplicaError, ReplicaState, replica_of_actor
from specd.workers.pool.router import parse_session_token, session_token
from specd.workers.types import FinishReason, GenerateDelta, GenerateRequest

_SESSION_ERRORS = (404, 409, 410)  # unknown, a turn already in flight, closed or expired
_REMEMBERED_UNPLACED = 65536  # sessions opened here whose first turn may still move them


@dataclass(frozen=True, slots=True)
class SessionRoute:
    """The gateway's name for where a session's turns go: its replica, and its id there
    (``engine_sid``)."""

    session_id: str  # the id clients hold
    replica: Replica
    engine_sid: str
    owner: str | None = None  # the API key (its `key_id`) the session belongs to

    def in_gateway_terms(self, delta: GenerateDelta) -> GenerateDelta:
        """A turn's session errors (404, 409, 410) name the field and the gateway's id;
        an aborted turn means the session went away under it (closed, replica stopping)."""
        if delta.finish_reason is FinishReason.ABORT:
            message = (
                f"session {self.session_id} was closed (or its replica stopped) while this turn ran"
            )
            return error_delta(delta.rid, 410, about("session_id", message))
        if delta.error is None or delta.error_code not in _SESSION_ERRORS:
            return delta
        return replace(delta, error=about("session_id", self.gateway_message(delta.error)))

    def gateway_message(self, message: str) -> str:
        """Engine messages name the engine's session id; clients know the gateway's."""
        return message.replace(self.engine_sid, self.session_id)


@dataclass
class _Turn:
    """A session turn this gateway serves: its client, whether its stream has closed,
    and, when its client left mid-turn, the abort sent to the engine."""

    client: Request
    over: asyncio.Event = field(default_factory=asyncio.Event)
    abort: asyncio.Future | None = None


def session_gone(session_id: str, ray_name: str, param: str | None) -> ApiError:
    replica = replica_of_actor(ray_name)
    message = (
        f"session {session_id} was held by replica {replica}, which is gone; open a new session"
    )
    return ApiError(410, about(param, message), param)


class GatewaySessions:
    """The session calls of the gateway's endpoints over ``pool``; ``owners`` seals
    session ids with their API key's."""

    def __init__(self, pool: PoolController, owners: Owners):
        self.pool = pool
        self.owners = owners
        self._turns: dict[str, _Turn] = {}  # session id -> its latest turn here
        self._unplaced: OrderedDict[str, bool] = OrderedDict()  # opened here, no turn yet

    def check_sessions_enabled(self, param: str | None) -> None:
        if not self.pool.spec.sessions.enabled:
            message = "sessions are disabled on this deployment (set spec.sessions.enabled: true)"
            raise ApiError(400, about(param, message), param)

    async def session_route(
        self, session_id: str, param: str | None, owner: str | None = None
    ) -> SessionRoute:
        """Where ``session_id`` lives: the replica that opened it, or the one it moved to
        when that one was retired; 404 if it is no session id (or not ``owner``'s), 410 if
        it is nowhere (its replica died, or no replica could take it)."""
        self.check_sessions_enabled(param)
        token = self.owners.unseal(session_id, owner)
        parsed = None if token is None else parse_session_token(token)
        if parsed is None:
            raise ApiError(404, about(param, f"no session {session_id!r}"), param)
        ray_name, engine_sid = parsed
        replica = await self.pool.find_session(ray_name, engine_sid)
        if replica is None:
            raise session_gone(session_id, ray_name, param)
        return SessionRoute(session_id, replica, engine_sid, owner)

    async def open_session(self, owner: str | None = None) -> SessionObject:
        """Open a session on the replica the router picks; a replica that is full (429),
        draining or unreachable is skipped for the next one."""
        self.check_sessions_enabled(None)
        tried: set[str] = set()
        refusal = ApiError(503, "no ready replica can open a session; retry shortly")
        while (replica := self.pool.pick(exclude=tried, for_session=True)) is not None:
            tried.add(replica.name)
            replica.note_session_opened()  # before the call: concurrent opens spread
            try:
                reply = await self.pool.call(replica, "open_session")
            except ReplicaError as err:
                refusal = ApiError(503, str(err))
                continue
            if reply.ok:
                token = session_token(replica.actor_name, reply.session_id)
                token = self.owners.seal(token, owner)
                self.pool.session_directory.note_home(reply.session_id, replica.actor_name)
                self._note_unplaced(token)
                return SessionObject(id=token, replica=replica.name)
            refusal = ApiError(reply.code, reply.error)
            if reply.code not in (429, 503):
                break
        raise refusal

    def _note_unplaced(self, session_id: str) -> None:
        """``session_id`` was opened here: its first turn may move it (`_placed`)."""
        self._unplaced[session_id] = True
        while len(self._unplaced) > _REMEMBERED_UNPLACED:
            self._unplaced.popitem(last=False)

    async def _placed(self, route: SessionRoute, prompt: Sequence[int]) -> SessionRoute:
        """Before a session's first turn: move it to the replica cache-aware routing
        would send ``prompt`` to for its cached prefix (`PoolController.first_turn_home`),
        so sessions that open alike gather where their prompt's KV is; a replica that
        refuses it (full) leaves it where it was.  The prompt goes on the prefix record
        of the replica that runs it."""
        if not self._unplaced.pop(route.session_id, False):
            return route
        pool = self.pool
        target = pool.first_turn_home(prompt, route.replica)
        if target is not None:
            holder = await pool.session_directory.place(
                route.replica,
                route.engine_sid,
                target,
                lambda tried: pool.pick(tried, for_session=True),
                pool.probe_timeout_s,
            )
            if holder is None:
                raise session_gone(route.session_id, route.replica.actor_name, "session_id")
            route = replace(route, replica=holder)
        pool.routing.record(route.replica, prompt)
        return route

    async def close_session(self, session_id: str, owner: str | None = None) -> SessionDeleted:
        """Close ``session_id`` on its replica (a turn in flight is aborted)."""
        route = await self.session_route(session_id, None, owner)
        self._unplaced.pop(session_id, None)
        try:
            reply = await self.pool.call(route.replica, "close_session", route.engine_sid)
        except ReplicaError as err:
            if err.lost:
                raise session_gone(session_id, route.replica.actor_name, None) from err
            raise ApiError(503, str(err)) from err
        if not reply.ok:
            raise ApiError(reply.code, route.gateway_message(reply.error))
        return SessionDeleted(id=session_id)

    async def turn_deltas(
        self, req: GenerateRequest, route: SessionRoute, client: Request
    ) -> AsyncGenerator[GenerateDelta, None]:
        """A session turn's deltas from its session's replica only: the history lives
        there, so nothing is retried elsewhere; a replica lost meanwhile means 410.  A
        replica that began draining as the turn set out refuses it (503), and the turn
        follows its session to where it moves."""
        await self._previous_turn_settled(route.session_id)
        turn = self._turns[route.session_id] = _Turn(client)
        finished = False
        try:
            route = await self._placed(route, req.prompt_ids)
            while True:
                async with contextlib.aclosing(self.pool.stream(route.replica, req)) as stream:
                    async for delta in stream:
                        if refused(delta) and route.replica.state is ReplicaState.DRAINING:
                            break
                        finished = delta.finished
                        yield route.in_gateway_terms(delta)
                    else:
                        break
                route = await self.session_route(route.session_id, "session_id", route.owner)
        except ApiError as err:
            finished = True
            yield error_delta(req.rid, err.status, err.message)
        except ReplicaError as err:
            finished = True  # nothing left to abort
            if err.lost:
                gone = session_gone(route.session_id, route.replica.actor_name, "session_id")
                yield error_delta(req.rid, gone.status, gone.message)
            else:
                yield error_delta(req.rid, 500, str(err))
        finally:
            if not finished:  # the client left mid-turn (the stream's close cancels it)
                turn.abort = asyncio.ensure_future(self._abort_turn(route, req.rid, turn))
            elif self._turns.get(route.session_id) is turn:
                del self._turns[route.session_id]
            turn.over.set()

    async def _abort_turn(self, route: SessionRoute, rid: str, turn: _Turn) -> None:
        """Post the abort of a turn its client left, as a call of its own (see
        `_previous_turn_settled`); a replica gone meanwhile has nothing to abort."""
        try:
            with contextlib.suppress(ReplicaError):
                await self.pool.call(route.replica, "abort", rid)
        finally:
            if self._turns.get(route.session_id) is turn:
                del self._turns[route.session_id]

    async def _previous_turn_settled(self, session_id: str) -> None:
        """Before a session's next turn: if the client left the previous one, wait until
        that turn's abort has reached its engine (whose inbox is ordered), so the new
        turn is not refused with 409 for a turn that is already gone.  Cancelling the
        Ray stream aborts it too, but in no fixed order with the next call."""
        previous = self._turns.get(session_id)
        if previous is None:
            return
        timeout = self.pool.probe_timeout_s
        with contextlib.suppress(TimeoutError):  # `_abort_turn` never raises
            if not previous.over.is_set() and await previous.client.is_disconnected():
                async with asyncio.timeout(timeout):
                    await previous.over.wait()  # the stream closes
            if previous.abort is not None:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(previous.abort)
