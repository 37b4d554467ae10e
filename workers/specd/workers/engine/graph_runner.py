"""CUDA graphs for fixed-shape steps: capture a device-only body once per batch size and
replay it, so a decode step costs one launch instead of one per kernel.

A *body* reads every input from a *bucket*'s static buffers (token ids, positions, KV
slots, the attention backend's graph plan) and returns device tensors; it must not sync
with the host, allocate by host-known sizes, or read host state that changes between
steps.  A batch of ``n`` requests runs in the smallest bucket with ``size >= n``: the
caller fills the bucket's buffers, padding rows up to ``size`` (pad rows write their K/V
to the pool's pad slot and their outputs are ignored), then ``run`` replays the graph.

Without CUDA (Triton's interpreter in the tests) the same bodies run eagerly on the same
padded buffers, and their outputs are copied into per-size static outputs as a replay
leaves them (overwritten by the next run of that size), so padding, buffer updates and
output lifetimes are exercised everywhere; only the capture itself needs a GPU.

    runner = GraphRunner(make_bucket, body, sizes=[1, 2, 4, 8], device)
    runner.capture()                       # once, at start (a no-op without CUDA)
    size = runner.size_for(n)              # None: too large, run it the ordinary way
    ... fill runner.bucket(size)'s buffers for these n requests ...
    out = runner.run(size)                 # the body's outputs, rows [0, n) are real
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

log = logging.getLogger(__name__)

B = TypeVar("B")  # a bucket: the static buffers of one batch size
WARMUP_RUNS = 2  # eager runs before a capture: Triton compiles and autotunes outside it


def default_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``max_batch_size``."""
    small = [s for s in (1, 2, 4) if s < max_batch_size]
    return small + list(range(8, max_batch_size, 8)) + [max_batch_size]


@dataclass(slots=True)
class _Captured(Generic[B]):
    bucket: B
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    outputs: Any = None  # the body's outputs, living in the graph's memory pool


@dataclass(slots=True)
class GraphRunner(Generic[B]):
    make_bucket: Callable[[int], B]
    body: Callable[[B], Any]
    sizes: Sequence[int]
    device: torch.device
    buffer_bytes: int = 0  # static buffers the buckets share (reported in status)
    capture_seconds: float = 0.0
    replays: int = 0  # batches run through a bucket (captured or eager)
    _captured: dict[int, _Captured[B]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = sorted(set(self.sizes))
        for size in self.sizes:
            self._captured[size] = _Captured(self.make_bucket(size))

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @property
    def captures(self) -> bool:
        """True when bodies replay as CUDA graphs (else they run eagerly)."""
        return self.device.type == "cuda"

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """Capture every size, largest first, sharing one memory pool (``pool``: one shared
        with other runners; a no-op without CUDA).  The body runs eagerly first, so kernels compile and lazily made scratch
        buffers exist outside the capture.  Bodies run under inference mode, as the
        engine's eager steps do; other threads may use CUDA meanwhile (thread-local
        capture errors)."""
        if not self.captures:
            return
        start = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            entry = self._captured[size]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self.body(entry.bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            entry.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                entry.graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                entry.outputs = self.body(entry.bucket)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs in %.1f s", len(self.sizes), self.capture_seconds)

    def size_for(self, n: int) -> int | None:
        """The batch size a batch of ``n`` runs padded to, or None when ``n`` is too large."""
        return next((size for size in self.sizes if size >= n), None)

    def status(self) -> dict:
        return {
            "mode": "captured" if self.captures else "eager",
            "sizes": list(self.sizes),
            "graphs": len(self.sizes),
            "buffer_bytes": self.buffer_bytes,
            "capture_seconds": round(self.capture_seconds, 3),
            "replays": self.replays,
        }

    def bucket(self, size: int) -> B:
        """The static buffers of batch size ``size`` (to fill before ``run``)."""
        return self._captured[size].bucket

    def run(self, size: int) -> Any:
        """Replay the body on the bucket of ``size`` (filled by the caller): its outputs,
        which the next replay of the same size overwrites (copy what must outlive it)."""
        entry = self._captured[size]
        self.replays += 1
        if entry.graph is not None:
            entry.graph.replay()
        elif entry.outputs is None:
            entry.outputs = _clone(self.body(entry.bucket))
        else:
            _copy_into(entry.outputs, self.body(entry.bucket))
        return entry.outputs


def _clone(out: Any) -> Any:
    """A copy of a body's outputs (tensors, tuples, dataclasses of tensors and ints)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_clone(x) for x in out)
    if dataclasses.is_dataclass(out):
        fields = {f.name: _clone(getattr(out, f.name)) for f in dataclasses.fields(out)}
        return dataclasses.replace(out, **fields)
    return out


def _copy_into(static: Any, out: Any) -> None:
    """Write a body's new outputs into the static ones (same structure and shapes)."""
    if isinstance(static, torch.Tensor):
        static.copy_(out)
    elif isinstance(static, tuple):
        for s, o in zip(static, out, strict=True):
            _copy_into(s, o)
    elif dataclasses.is_dataclass(static):
        for f in dataclasses.fields(static):
            _copy_into(getattr(static, f.name), getattr(out, f.name))
