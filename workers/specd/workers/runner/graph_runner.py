"""CUDA graphs for fixed-shape steps: capture a device-only body once per batch size and
replay it, so a decode step costs one launch instead of one per kernel.

A *body* reads every input from a *bucket*'s static buffers (token ids, positions, KV
slots, the attention backend's graph plan) and returns device tensors; it must not sync
with the host, allocate by host-known sizes, or read host state that changes between
steps.  A batch of ``n`` requests runs in the smallest bucket with ``size >= n``: the
caller fills the bucket's buffers, padding rows up to ``size`` (pad rows write their K/V
to the pool's pad slot and their outputs are ignored), then ``run`` replays the graph.

Without CUDA (Triton's interpreter in the tests) each size is captured into an
``EmulatedGraph``, which records the body's ops and launches and replays the record with
the same freezing a CUDA graph has, and rejects host syncs at capture: padding, buffer
updates, output lifetimes and stale host state are exercised everywhere; only the CUDA
capture itself needs a GPU.

    runner = GraphRunner(make_bucket, body, sizes=[1, 2, 4, 8], device)
    runner.capture()                       # once, at start
    size = runner.size_for(n)              # None: too large, run it the ordinary way
    ... fill runner.bucket(size)'s buffers for these n requests ...
    out = runner.run(size)                 # the body's outputs, rows [0, n) are real
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from specd.kernels.emulated_graph import EmulatedGraph

log = logging.getLogger(__name__)

B = TypeVar("B")  # a bucket: the static buffers of one batch size
WARMUP_RUNS = 2  # eager runs before a capture: Triton compiles and autotunes outside it


def default_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``max_batch_size``."""
    small = [s for s in (1, 2, 4) if s < max_batch_size]
    return small + list(range(8, max_batch_size, 8)) + [max_batch_size]


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Collect garbage now, then none until the block ends. Since torch 2.9 a capture no
    longer collects first, so a cycle holding a dropped engine's CUDA graph could be
    collected mid-capture on the capturing thread, and its graph's reset invalidates the
    capture (pytorch/pytorch#161037; seen intermittently in the gpu suite, 2026-11-30)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(slots=True)
class _Captured(Generic[B]):
    bucket: B
    graph: Any = None  # torch.cuda.CUDAGraph (or EmulatedGraph) once captured
    outputs: Any = None  # the body's outputs, living in the graph's memory pool


@dataclass(slots=True)
class GraphRunner(Generic[B]):
    make_bucket: Callable[[int], B]
    body: Callable[[B], Any]
    sizes: Sequence[int]
    device: torch.device
    buffer_bytes: int = 0  # static buffers the buckets share (reported in status)
    capture_seconds: float = 0.0
    replays: int = 0  # batches replayed
    _captured: dict[int, _Captured[B]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = sorted(set(self.sizes))
        for size in self.sizes:
            self._captured[size] = _Captured(self.make_bucket(size))

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @property
    def mode(self) -> str:
        """``captured`` (CUDA graphs) or ``emulated`` (``EmulatedGraph``, without CUDA)."""
        return "captured" if self.device.type == "cuda" else "emulated"

    @torch.inference_mode()
    def capture(self, pool: Any = None, stream: Any = None) -> None:
        """Capture every size, largest first, sharing one memory pool (``pool``, and the
        capture ``stream``: shared with other runners, whose freed intermediates the
        allocator reuses only on the stream they were made on).  On CUDA the body runs
        eagerly first, so kernels compile and
        lazily made scratch buffers exist outside the capture.  Bodies run under inference
        mode, as the engine's eager steps do; other threads may use the device meanwhile
        (thread-local capture errors, thread-local recording). No garbage is collected
        during the captures (``garbage_collection_paused``)."""
        start = time.perf_counter()
        with garbage_collection_paused():
            if self.mode == "captured":
                self._capture_cuda(
                    pool if pool is not None else torch.cuda.graph_pool_handle(),
                    stream if stream is not None else torch.cuda.Stream(self.device),
                )
            else:
                for size in reversed(self.sizes):
                    entry = self._captured[size]
                    entry.graph = EmulatedGraph()
                    with entry.graph.capture():
                        entry.outputs = self.body(entry.bucket)
        self.capture_seconds = time.perf_counter() - start
        log.info("%s %d graphs in %.1f s", self.mode, len(self.sizes), self.capture_seconds)

    def _capture_cuda(self, pool: Any, stream: Any) -> None:
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

    def size_for(self, n: int) -> int | None:
        """The batch size a batch of ``n`` runs padded to, or None when ``n`` is too large."""
        return next((size for size in self.sizes if size >= n), None)

    def status(self) -> dict:
        return {
            "mode": self.mode,
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
        """Replay the graph of ``size`` on its bucket (filled by the caller): the body's
        outputs, which the next replay of the same size overwrites (copy what must outlive
        it)."""
        entry = self._captured[size]
        if entry.graph is None:
            raise RuntimeError("GraphRunner.run before capture()")
        self.replays += 1
        entry.graph.replay()
        return entry.outputs
