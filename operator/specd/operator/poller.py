"""The status poller: one operator-level loop over kopf's index of SDDs.

kopf timers pin kopf's finalizer on every object they tick for (by design: kopf must
see the deletion to stop the timer), and a finalizer on a managed SDD would make
``kubectl delete`` hang whenever the operator is down.  So the periodic reconcile is
not a timer: an index handler keeps the latest body of every SDD in memory, and this
loop reconciles each of them every ``poll_interval_s``.  Only SDDs with actors in an
external Ray cluster carry a finalizer (their delete handler).

kopf pauses its own handlers while a peer with a higher (or the same) priority is
alive; this loop is outside kopf's handlers, so it applies the same rule itself by
reading the peering objects (`leads`).
"""

from __future__ import annotations

import asyncio
import getpass
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from specd.operator.kube import KubeClient

log = logging.getLogger(__name__)

PEERING_GROUP = "kopf.dev/v1"


def own_identity() -> str:
    """This replica's peering identity (the pod name when the chart sets ``POD_ID``)."""
    pod = os.environ.get("POD_ID")
    if pod:
        return pod
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (runAsUser in a pod)
        user = "specd"
    return f"{user}@{socket.gethostname()}/{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class Peering:
    """Where this replica's kopf peering lives and who it is there."""

    name: str
    identity: str
    priority: int
    namespaces: tuple[str, ...] = ()  # empty: cluster-wide (ClusterKopfPeering)

    def paths(self) -> list[str]:
        if not self.namespaces:
            return [f"/apis/{PEERING_GROUP}/clusterkopfpeerings/{self.name}"]
        return [
            f"/apis/{PEERING_GROUP}/namespaces/{ns}/kopfpeerings/{self.name}"
            for ns in self.namespaces
        ]


def outranked_by(
    peers: Mapping[str, Any], identity: str, priority: int, now: datetime
) -> list[str]:
    """Live peers other than us whose priority is at least ours (kopf pauses for them)."""
    rivals = []
    for peer_id, info in peers.items():
        if peer_id == identity or not isinstance(info, dict):
            continue
        lastseen = info.get("lastseen")
        seen = datetime.fromisoformat(lastseen) if lastseen else now
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=UTC)
        alive = seen + timedelta(seconds=int(info.get("lifetime", 60))) > now
        if alive and int(info.get("priority", 0)) >= priority:
            rivals.append(peer_id)
    return rivals


async def leads(client: KubeClient, peering: Peering | None) -> bool:
    """Whether kopf would let this replica act now (standalone, or no live rival).

    A missing peering object counts as "no rivals", as kopf's non-mandatory peering does.
    """
    if peering is None:
        return True
    now = datetime.now(UTC)
    for path in peering.paths():
        obj = await client.get(path)
        peers = (obj or {}).get("status") or {}
        if outranked_by(peers, peering.identity, peering.priority, now):
            return False
    return True


async def poll_forever(
    bodies: Callable[[], Iterable[dict[str, Any]]],
    reconcile: Callable[[dict[str, Any]], Awaitable[None]],
    interval_s: float,
    may_act: Callable[[], Awaitable[bool]],
) -> None:
    """Every ``interval_s``: if this replica may act, reconcile every indexed SDD at once.

    One SDD's failure is logged (the handler counts it) and never stops the others.
    """
    while True:
        try:
            if await may_act():
                results = await asyncio.gather(
                    *(reconcile(body) for body in bodies()), return_exceptions=True
                )
                for result in results:
                    if isinstance(result, Exception):
                        log.warning("status poll failed: %s", result)
        except Exception:  # the peering read itself failed: try again next tick
            log.exception("status poll tick failed")
        await asyncio.sleep(interval_s)
