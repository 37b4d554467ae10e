"""The ranks 1..N-1 of a tensor-parallel replica: one Ray actor each.

A replica of tensor size N reserves a placement group of N bundles, ``STRICT_PACK``
(one node), one GPU (on GPUs) and ``resources.cpu`` CPUs each (`reserve_ranks`); the
engine actor is rank 0 in bundle 0.  It starts the other ranks itself (`start_ranks`),
in bundles 1..N-1, so they are its children: Ray ends an actor whose owner dies, which
makes the whole group share one fate (a dead rank 0 takes the others with it; a dead
other rank breaks the group's collectives and rank 0's loop, and the pool replaces the
replica).  The placement group is detached like rank 0 (a gateway restart adopts both
by name) and removed with it (`release_ranks`, from `Replica.kill`).
``RankActor.serve`` runs for the replica's life; its end (a return or an error) is how
rank 0 learns the rank has ended (`RankWatch`).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from specd.workers.bench_knobs import BenchKnobs
from specd.workers.config import DeploymentSpec
from specd.workers.engine.factory import build_follower
from specd.workers.engine.rank_group import RankRendezvous


class RankActor:
    """Ray actor body of rank ``rank`` (> 0)."""

    def __init__(self, spec: DeploymentSpec, rank: int, rendezvous: RankRendezvous):
        self.spec, self.rank, self.rendezvous = spec, rank, rendezvous

    def serve(self) -> None:
        """Join the group, load this rank's shards, run rank 0's calls until it stops."""
        build_follower(self.spec, self.rank, self.rendezvous, BenchKnobs.from_env()).serve()

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


def ranks_group_name(actor_name: str) -> str:
    """The placement group of the replica whose rank 0 is actor ``actor_name``."""
    return f"{actor_name}-ranks"


def reserve_ranks(spec: DeploymentSpec, actor_name: str) -> PlacementGroup:
    """A detached ``STRICT_PACK`` placement group with one bundle per rank."""
    bundle = {"CPU": spec.resources.cpu or 0.01}  # a bundle may not be empty
    if spec.resources.gpus > 0:
        bundle["GPU"] = rank_gpus(spec)
    return ray.util.placement_group(
        [dict(bundle) for _ in range(spec.parallelism.tensor)],
        strategy="STRICT_PACK",
        name=ranks_group_name(actor_name),
        lifetime="detached",
    )


def in_bundle(group: PlacementGroup, rank: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)


def release_ranks(actor_name: str) -> None:
    """Remove the replica's placement group, if it has one (tensor > 1)."""
    try:
        group = ray.util.get_placement_group(ranks_group_name(actor_name))
    except ValueError:  # tensor 1, or already removed
        return
    ray.util.remove_placement_group(group)


def _rendezvous_here(spec: DeploymentSpec) -> RankRendezvous:
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
    """Where the ranks meet (rank 0 joins there too), the other ranks' actors and their
    running ``serve`` calls."""

    rendezvous: RankRendezvous
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


def start_ranks(spec: DeploymentSpec, name: str | None = None) -> RankWatch:
    """Start ranks 1..N-1 in bundles 1..N-1 of this actor's placement group (or, where
    it has none, as in a test's engine, pinned to this node); each joins the rendezvous
    on this node that rank 0 (this process) then joins, and loads its shards.  ``name``:
    rank 0's actor name; rank r's is ``{name}-rank{r}`` (``ray list actors``)."""
    rendezvous = _rendezvous_here(spec)
    group = ray.util.get_current_placement_group()
    node = ray.get_runtime_context().get_node_id()

    def placed(rank: int):
        if group is not None:
            return in_bundle(group, rank)
        return NodeAffinitySchedulingStrategy(node, soft=False)

    actors = [
        _RemoteRankActor.options(
            name=None if name is None else f"{name}-rank{rank}",
            num_cpus=spec.resources.cpu,
            num_gpus=rank_gpus(spec),
            max_restarts=0,
            max_concurrency=2,  # ``pid`` beside the running ``serve``
            scheduling_strategy=placed(rank),
        ).remote(spec, rank, rendezvous)
        for rank in range(1, rendezvous.size)
    ]
    return RankWatch(rendezvous, actors, [actor.serve.remote() for actor in actors])
