"""Where streaming sessions live after their replica left the pool, and their moves.

A session id names the actor that opened it (`router.session_token`).  When the pool
retires a replica (scale-down, rolling update) it first drains the requests in flight,
then moves each idle session to the replica a new session would go to
(`move_sessions`): the destination's ``import_session`` takes the source's
``export_session`` result as a Ray object reference, so the KV goes from actor to actor
without passing through the gateway.  A new session also moves, before its first turn,
to the replica that holds that turn's prompt prefix in its cache (`place`).
`SessionDirectory` remembers each session's actor; a turn for a replica whose moves are
under way waits for them (`settled`).  A gateway that restarted knows no homes, and
asks the ready replicas instead (``has_session``).  `find_session` puts it together:
where a session's next turn goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from ray.exceptions import RayError

from specd.workers.pool.replica import Replica

log = logging.getLogger(__name__)

_REMEMBERED_HOMES = 65536
_MAX_SESSION_HOPS = 8  # replicas a session may have moved through (then: ask around)


class ReadyReplicas(Protocol):
    """What `SessionDirectory.find_session` asks of the pool."""

    def ready(self) -> list[Replica]: ...

    def serving_actor(self, ray_name: str) -> Replica | None: ...


class SessionDirectory:
    def __init__(self) -> None:
        self._homes: dict[str, str] = {}  # engine session id -> actor now holding it
        self._leaving: dict[str, asyncio.Event] = {}  # draining actor -> set once it left
        self.outcomes: Counter[str] = Counter()  # "kv", "history", "ended"
        self.placements: Counter[str] = Counter()  # "moved", "stayed", "refused", "ended"

    def home_of(self, engine_sid: str) -> str | None:
        return self._homes.get(engine_sid)

    def note_home(self, engine_sid: str, actor_name: str) -> None:
        self._homes.pop(engine_sid, None)  # newest last: the oldest go first
        self._homes[engine_sid] = actor_name
        while len(self._homes) > _REMEMBERED_HOMES:
            del self._homes[next(iter(self._homes))]

    def begin_leaving(self, actor_name: str) -> None:
        """``actor_name`` is draining: its sessions' turns wait (`settled`) until its
        sessions have moved (`end_leaving`)."""
        self._leaving.setdefault(actor_name, asyncio.Event())

    def end_leaving(self, actor_name: str) -> None:
        if (leaving := self._leaving.pop(actor_name, None)) is not None:
            leaving.set()

    async def settled(self, actor_name: str, timeout_s: float) -> None:
        """Return once ``actor_name`` has drained and moved its sessions (at once when it
        is not leaving; at ``timeout_s`` at the latest)."""
        leaving = self._leaving.get(actor_name)
        if leaving is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await leaving.wait()

    async def move_sessions(
        self,
        source: Replica,
        pick: Callable[[set[str]], Replica | None],
        timeout_s: float,
    ) -> Counter[str]:
        """Move every idle session of drained ``source`` to a replica ``pick`` chooses
        (given the names already tried for it); returns how many went with their KV
        (``kv``), with their history only (``history``) or nowhere (``ended``)."""
        moved: Counter[str] = Counter()
        try:
            async with asyncio.timeout(timeout_s):
                ids = await source.handle.idle_session_ids.remote()
            for sid in ids:
                outcome, _ = await self._move_one(source, sid, pick, timeout_s)
                moved["ended" if outcome == "stayed" else outcome] += 1  # it leaves with source
        except (TimeoutError, RayError) as err:
            log.warning("sessions of %s could not move: %s", source.name, err)
        self.outcomes.update(moved)
        return moved

    async def _move_one(
        self,
        source: Replica,
        sid: str,
        pick: Callable[[set[str]], Replica | None],
        timeout_s: float,
    ) -> tuple[str, Replica | None]:
        """Offer ``sid``'s snapshot to one replica after another until one takes it ->
        (outcome, the replica holding it): ``kv`` or ``history`` (what came along),
        ``stayed`` (the source would not let it go: closed meanwhile, or mid-turn) or
        ``ended`` (nobody took it)."""
        snapshot: Any = None  # exported once a destination exists
        tried: set[str] = set()
        while (target := pick(tried)) is not None:
            tried.add(target.name)
            snapshot = snapshot or source.handle.export_session.remote(sid)
            try:
                async with asyncio.timeout(timeout_s):
                    reply = await target.handle.import_session.remote(snapshot)
            except (TimeoutError, RayError) as err:
                log.warning("session %s did not move to %s: %s", sid, target.name, err)
                continue
            if reply.ok:
                self.note_home(sid, target.actor_name)
                target.note_session_opened()
                return ("kv" if reply.kv_moved else "history"), target
            if reply.from_source:  # it cannot leave (closed meanwhile, or mid-turn)
                return "stayed", source
            log.info("session %s refused by %s: %s", sid, target.name, reply.error)
        return "ended", None

    async def place(
        self,
        source: Replica,
        sid: str,
        target: Replica,
        others: Callable[[set[str]], Replica | None],
        timeout_s: float,
    ) -> Replica | None:
        """Move new session ``sid`` (no turn yet) from ``source`` to ``target``, where its
        first turn's prompt prefix is cached; if ``target`` refuses it (full), back to
        ``source``, else to a replica ``others`` picks.  -> the replica holding it now
        (None: none took it back)."""
        order = [target, source]

        def pick(tried: set[str]) -> Replica | None:
            return order.pop(0) if order else others(tried)

        outcome, holder = await self._move_one(source, sid, pick, timeout_s)
        if outcome not in ("stayed", "ended"):  # "stayed": e.g. closed meanwhile
            outcome = "moved" if holder is target else "refused"
        self.placements[outcome] += 1
        return holder

    async def find(self, engine_sid: str, ready: list[Replica], timeout_s: float) -> str | None:
        """The actor of a ready replica holding ``engine_sid`` (asked of each), or None."""

        async def holds(replica: Replica) -> bool:
            try:
                ref = replica.handle.has_session.remote(engine_sid)
                async with asyncio.timeout(timeout_s):
                    return bool(await ref)
            except (TimeoutError, RayError):
                return False

        answers = await asyncio.gather(*(holds(r) for r in ready))
        home = next((r.actor_name for r, yes in zip(ready, answers, strict=True) if yes), None)
        if home is not None:
            self.note_home(engine_sid, home)
        return home

    async def find_session(
        self,
        ray_name: str,
        engine_sid: str,
        replicas: ReadyReplicas,
        settle_timeout_s: float,
        timeout_s: float,
    ) -> Replica | None:
        """The ready replica holding session ``engine_sid``, opened on actor ``ray_name``:
        where this gateway last placed it (opened, moved for its first turn, or moved
        off a retired replica, once that one has drained: ``settle_timeout_s`` at most),
        else whichever holds it."""
        actor = self.home_of(engine_sid)
        if actor is None:  # opened before this gateway started
            return await self._locate(ray_name, engine_sid, replicas, timeout_s)
        for _ in range(_MAX_SESSION_HOPS):
            if (replica := replicas.serving_actor(actor)) is not None:
                return replica
            await self.settled(actor, settle_timeout_s)
            home = self.home_of(engine_sid)
            if home is None or home == actor:
                break
            actor = home  # it moved; that replica may be leaving too
        return await self._locate(ray_name, engine_sid, replicas, timeout_s)

    async def _locate(
        self, ray_name: str, engine_sid: str, replicas: ReadyReplicas, timeout_s: float
    ) -> Replica | None:
        """Ask the ready replicas who holds ``engine_sid``; if none does, its opener
        ``ray_name`` (still serving) answers why (closed, expired, unknown)."""
        home = await self.find(engine_sid, replicas.ready(), timeout_s)
        return replicas.serving_actor(ray_name if home is None else home)
