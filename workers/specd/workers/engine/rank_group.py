"""A tensor-parallel replica's ranks, seen from the engine.

Rank 0 runs the whole `Engine`: scheduler, KV bookkeeping, sessions, prefix cache,
drafting decisions, sampling and metrics.  Its models and KV moves are wrapped
(`MirroredModel`, `MirroredOps`) so that every call that runs collectives or writes KV
is first broadcast to the other ranks (`RankLeader.run`), which run it on their shards
in `RankFollower.serve` and keep no request state.  One lock covers a record and the
call it names, so a call's collectives never interleave with another record; an idle
rank 0 sends a `Tick` well inside the group's timeout.  Any failure of a mirrored call
breaks the group: it is kept, the engine loop dies with it (the pool then replaces the
whole replica), and every later call raises `RankGroupError` at once.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from specd.kernels import get_backend
from specd.kernels.ops import KernelOps
from specd.kernels.ops_choice import ops_for_backend
from specd.workers.config import RANK_START_TIMEOUT_S
from specd.workers.engine.rank_wire import (
    ContextOnWire,
    KVLayout,
    KVMove,
    ModelCall,
    ModelName,
    PoolName,
    RankWire,
    Record,
    Stop,
    Tick,
)
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.parallel import TpGroup, init_tensor_parallel

# the target's and the draft's methods that run collectives (the others are local)
MIRRORED_METHODS = frozenset({"__call__", "forward_with_aux", "compute_logits"})
RANK_END_GRACE_S = 2.0  # how long a failed call waits to learn which rank ended


class RankGroupError(RuntimeError):
    """The replica's rank group broke (a rank died, a collective failed or timed out)."""


@dataclass(frozen=True, slots=True)
class RankRendezvous:
    """Where a replica's ranks meet: rank 0's ``tcp://host:port``, the group's size, and
    how long any collective may wait once the group serves
    (``spec.parallelism.collectiveTimeoutSeconds``)."""

    init_method: str
    size: int
    timeout_s: float


def join_rank_group(
    rendezvous: RankRendezvous, rank: int, device: torch.device
) -> tuple[TpGroup, RankWire]:
    """Join the group (NCCL on CUDA, gloo on CPU) and the gloo group records travel on,
    both with ``RANK_START_TIMEOUT_S`` until the KV layout has crossed (`RankWire.set_timeout`)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout_s = max(rendezvous.timeout_s, RANK_START_TIMEOUT_S)
    tp = init_tensor_parallel(rank, rendezvous.size, rendezvous.init_method, timeout_s, backend)
    control = tp.group
    if backend != "gloo":  # new_group's own default timeout is 30 min: pass the group's
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return tp, RankWire(control, tp.group, device)


def leave_rank_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True, slots=True)
class PoolShape:
    """One KV pool's per-rank shape (its slots come from rank 0's `KVLayout`)."""

    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int


class RankLeader:
    """Rank 0's end of the wire."""

    def __init__(self, wire: RankWire, timeout_s: float):
        self.wire = wire
        self.error: str | None = None
        self._rank_ended = threading.Event()
        self._ended_why = ""  # which rank ended, and how (`rank_ended`)
        self._lock = threading.RLock()
        self._pools: dict[int, PoolName] = {}  # id(planes) -> the pool's name
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        self._timeout_s = timeout_s
        self._tick_every_s = timeout_s / 4
        self._ticker = threading.Thread(target=self._tick, name="specd-rank-ticks", daemon=True)

    def start(self, layout: KVLayout, pools: dict[PoolName, KVPool]) -> None:
        """Send the KV layout the other ranks build their pools from; from then on the
        group's calls time out after the spec's timeout; start ticking."""
        self._pools = {id(pool.planes): name for name, pool in pools.items()}
        self.run(layout, lambda: None)
        self.wire.set_timeout(self._timeout_s)
        self._ticker.start()

    def run(self, record: Record, local: Callable[[], Any]) -> Any:
        """Broadcast ``record``, then run ``local`` (the same call, rank 0's shard)."""
        with self._lock:
            self.check()
            try:
                self.wire.send(record)
                return local()
            except Exception as err:
                # a dead rank shows first as a failed collective: name it when its
                # actor's end is reported soon after
                self._rank_ended.wait(RANK_END_GRACE_S)
                who = self._ended_why or f"a {type(record).__name__} failed"
                self.error = f"{who} ({type(err).__name__}: {str(err)[:200]})"
                raise RankGroupError(f"the replica's rank group broke: {self.error}") from err
            finally:
                self._last_sent = time.monotonic()

    def rank_ended(self, why: str) -> None:
        """Another rank's actor ended (``why`` names it): the group is broken."""
        self._ended_why = why
        self._rank_ended.set()
        if self.error is None:
            self.error = why

    def check(self) -> None:
        """Raise `RankGroupError` once the group has broken."""
        if self.error is not None:
            raise RankGroupError(f"the replica's rank group broke: {self.error}")

    def pool_name(self, planes: torch.Tensor) -> PoolName:
        return self._pools[id(planes)]

    def on_wire(self, value: Any) -> Any:
        """A call's argument as sent: a `ForwardContext` becomes its `ContextOnWire`."""
        if not isinstance(value, ForwardContext):
            return value
        if value.attn_meta is None:
            raise RankGroupError("a captured graph's forward cannot run on several ranks")
        return ContextOnWire(
            value.attn_meta, value.out_cache_loc, self.pool_name(value.kv_pool.planes)
        )

    def _tick(self) -> None:
        while not self._closed.wait(self._tick_every_s / 4):
            if time.monotonic() - self._last_sent < self._tick_every_s:
                continue
            if not self._lock.acquire(blocking=False):  # a call is running: no tick needed
                continue
            try:
                if self.error is None and not self._closed.is_set():
                    self.run(Tick(), lambda: None)
            except RankGroupError:
                pass  # kept in ``error``: the engine loop raises it
            finally:
                self._lock.release()

    def close(self) -> None:
        """Tell the other ranks to stop (when the group still works) and leave the group."""
        self._closed.set()
        with self._lock:
            if self.error is None:
                try:
                    self.wire.send(Stop())
                except Exception as err:
                    self.error = f"{type(err).__name__}: {err}"
            leave_rank_group()


class MirroredModel:
    """Rank 0's face of a model every rank holds a shard of: the collective methods are
    broadcast first (`MIRRORED_METHODS`), everything else is rank 0's own."""

    def __init__(self, inner: torch.nn.Module, name: ModelName, leader: RankLeader):
        self._inner, self._name, self._leader = inner, name, leader

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        if attr in MIRRORED_METHODS:
            return functools.partial(self._call, attr)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("__call__", *args, **kwargs)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        wire = self._leader.on_wire
        record = ModelCall(
            self._name, method, tuple(map(wire, args)), {k: wire(v) for k, v in kwargs.items()}
        )
        return self._leader.run(record, lambda: getattr(self._inner, method)(*args, **kwargs))


class MirroredOps:
    """Rank 0's kernel ops: KV moves are broadcast first, the rest are rank 0's own."""

    def __init__(self, inner: KernelOps, leader: RankLeader):
        self._inner, self._leader = inner, leader

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    def move_kv(self, planes: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        record = KVMove(self._leader.pool_name(planes), src, dst)
        self._leader.run(record, lambda: self._inner.move_kv(planes, src, dst))


class RankFollower:
    """A rank other than 0: its model shards, KV pools built to rank 0's layout, and a
    loop that runs each record rank 0 sends until `Stop`."""

    def __init__(
        self,
        wire: RankWire,
        models: dict[ModelName, torch.nn.Module],
        pool_shapes: dict[PoolName, PoolShape],
        dtype: torch.dtype,
        device: torch.device,
        timeout_s: float,
    ):
        self.wire, self.models, self.pool_shapes = wire, models, pool_shapes
        self.dtype, self.device = dtype, device
        self.timeout_s = timeout_s  # the group's, once the KV layout has crossed
        self.pools: dict[PoolName, KVPool] = {}
        self.backend: Any = None  # rank 0's choice, from its `KVLayout`

    @torch.inference_mode()
    def serve(self) -> None:
        layout = self.wire.receive()
        if not isinstance(layout, KVLayout):
            raise RankGroupError(f"rank 0 sent {type(layout).__name__} before its KV layout")
        self.pools = {
            name: KVPool(
                s.num_layers, layout.num_slots, s.num_kv_heads, s.head_dim, self.dtype, self.device
            )
            for name, s in self.pool_shapes.items()
        }
        self.backend = get_backend(layout.backend_name, self.device.type, self.dtype)
        ops = ops_for_backend(layout.backend_name)
        self.wire.set_timeout(self.timeout_s)
        while True:
            record = self.wire.receive()
            match record:
                case Stop():
                    return
                case Tick():
                    continue
                case KVMove(pool, src, dst):
                    ops.move_kv(self.pools[pool].planes, src, dst)
                case ModelCall(model, method, args, kwargs):
                    args = tuple(map(self._here, args))
                    kwargs = {k: self._here(v) for k, v in kwargs.items()}
                    getattr(self.models[model], method)(*args, **kwargs)
                case _:
                    raise RankGroupError(f"rank 0 sent an unknown record {record!r}")

    def _here(self, value: Any) -> Any:
        """A call's argument as this rank runs it: a `ContextOnWire` planned on this
        rank's backend over this rank's pool."""
        if not isinstance(value, ContextOnWire):
            return value
        plan = self.backend.plan(value.attn_meta)
        return ForwardContext(plan, value.out_cache_loc, self.pools[value.pool], self.backend)
