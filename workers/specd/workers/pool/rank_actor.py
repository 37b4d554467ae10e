"""The ranks 1..N-1 of a tensor-parallel replica: one Ray actor each.

The engine actor is rank 0.  It starts the other ranks itself (`start_ranks`), so they
are its children: Ray ends an actor whose owner dies, which makes the whole group share
one fate (a dead rank 0 takes the others with it; a dead other rank breaks the group's
collectives and rank 0's loop, and the pool replaces the replica).  Every rank runs on
rank 0's node (the group's collectives stay inside one node), with one GPU each when
the replica has GPUs.  ``RankActor.serve`` runs for the replica's life; its result
(or its error) is how rank 0 learns the rank has ended (`RankWatch`).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from specd.workers.bench_knobs import BenchKnobs
from specd.workers.config import DeploymentSpec
from specd.workers.engine.factory import build_follower
from specd.workers.engine.rank_group import RankRendezvous


class RankActor:
    """Ray actor body of rank ``rank`` (> 0)."""

    def __init__(self, spec: DeploymentSpec, rank: int, rendezvous: RankRendezvous):
        self.spec, self.rank, self.rendezvous = spec, rank, rendezvous

    def serve(self) -> int:
        """Join the group, load this rank's shards, run rank 0's calls until it stops;
        -> how many records it ran."""
        follower = build_follower(self.spec, self.rank, self.rendezvous, BenchKnobs.from_env())
        follower.serve()
        return follower.calls

    def pid(self) -> int:
        """This rank's process id (answered while ``serve`` runs)."""
        return os.getpid()


_RemoteRankActor = ray.remote(RankActor)


def rank_gpus(spec: DeploymentSpec) -> float:
    """GPUs of each rank's actor: one per rank (``resources.gpus`` equals the tensor
    size), or the whole share at tensor 1."""
    if spec.parallelism.tensor == 1:
        return spec.resources.gpus
    return 1 if spec.resources.gpus > 0 else 0


def rendezvous_here(spec: DeploymentSpec) -> RankRendezvous:
    """Rank 0's address on this node, on a port free now."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    host = ray.util.get_node_ip_address()
    return RankRendezvous(
        f"tcp://{host}:{port}",
        spec.parallelism.tensor,
        spec.parallelism.collective_timeout_seconds,
    )


@dataclass
class RankWatch:
    """The other ranks' actors and their running ``serve`` calls."""

    actors: list[ray.actor.ActorHandle]
    serving: list[ray.ObjectRef]

    def watch(self, on_end: Callable[[str], None]) -> None:
        """Call ``on_end(why)`` from a thread when the first rank's ``serve`` ends."""

        def wait() -> None:
            done, _ = ray.wait(self.serving, num_returns=1, timeout=None)
            rank = self.serving.index(done[0]) + 1
            try:
                ray.get(done[0])
                on_end(f"rank {rank} left the group")
            except Exception as err:
                on_end(f"rank {rank} died: {type(err).__name__}: {str(err)[:300]}")

        threading.Thread(target=wait, name="specd-rank-watch", daemon=True).start()

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def start_ranks(
    spec: DeploymentSpec, rendezvous: RankRendezvous, name: str | None = None
) -> RankWatch:
    """Start ranks 1..N-1 on this node; each joins ``rendezvous`` and loads its shards.
    ``name``: rank 0's actor name; rank r's is ``{name}-rank{r}`` (``ray list actors``)."""
    node = ray.get_runtime_context().get_node_id()
    actors = [
        _RemoteRankActor.options(
            name=None if name is None else f"{name}-rank{rank}",
            num_cpus=spec.resources.cpu,
            num_gpus=rank_gpus(spec),
            max_restarts=0,
            max_concurrency=2,  # ``pid`` beside the running ``serve``
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(spec, rank, rendezvous)
        for rank in range(1, rendezvous.size)
    ]
    return RankWatch(actors, [actor.serve.remote() for actor in actors])
