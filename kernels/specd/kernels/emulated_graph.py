"""A CPU stand-in for ``torch.cuda.CUDAGraph``: record a body's device work once, replay it.

CUDA graph capture freezes what a body launches; this freezes the same things, so a CPU
test sees what a GPU replay would, not what an eager re-run would:

* every aten op the body dispatches is recorded with its arguments: tensors by identity,
  everything else by value (Python ints, sizes, slices: baked in, as kernel parameters
  are); the intermediates the body makes stay alive with the record, as in a graph's
  memory pool;
* Triton launches (``specd.kernels.triton_launch.launch``) are recorded whole, with their
  grid and arguments;
* ``replay`` runs the record in order; an op that allocated its output at capture writes
  the new result into that same tensor, so later ops and the caller read the new values;
* tensors the body reads but did not make (buffers, weights, the pool) are held weakly,
  as a CUDA graph holds only their addresses: a replay after their owner dropped one
  raises ``GraphReplayError`` where a GPU would read freed memory.

Python control flow runs once, at capture.  A body whose work depends on host state that
changes between steps therefore replays stale work here exactly as on a GPU, and the
tests' outputs show it.  What cannot be captured at all raises ``GraphCaptureError`` at
capture: host syncs (``.item()``, ``.tolist()``, ``bool(t)``, boolean-mask indexing and
other data-dependent shapes) and host data entering the body (``torch.tensor([...])``,
whose copy a graph would replay from a host buffer long gone).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

aten = torch.ops.aten

# op packet -> why a CUDA capture cannot hold it
_UNCAPTURABLE = {
    aten.item: "reads a value on the host (.item(), int(t), float(t))",
    aten._local_scalar_dense: "reads a value on the host",
    aten.is_nonzero: "branches on a tensor on the host (bool(t), if t:)",
    aten.equal: "compares tensors on the host (torch.equal)",
    aten.allclose: "compares tensors on the host (torch.allclose)",
    aten.resolve_conj: "reads a tensor on the host (.tolist(), .numpy())",
    aten.resolve_neg: "reads a tensor on the host (.tolist(), .numpy())",
    aten.nonzero: "has a data-dependent shape (nonzero)",
    aten.masked_select: "has a data-dependent shape (masked_select)",
    aten._unique2: "has a data-dependent shape (unique)",
    aten.unique_dim: "has a data-dependent shape (unique)",
    aten.unique_consecutive: "has a data-dependent shape (unique_consecutive)",
    aten.bincount: "has a data-dependent shape (bincount)",
}
_HOST_DATA = {aten.lift_fresh, aten.lift_fresh_copy}  # torch.tensor(data) in the body
_BOOL_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class GraphCaptureError(RuntimeError):
    """The body does something a CUDA graph capture cannot hold."""


class GraphReplayError(RuntimeError):
    """A replay would read memory a GPU has freed since the capture."""


def _capture_error(func, args: tuple, kwargs: dict) -> str | None:
    """Why ``func(*args, **kwargs)`` breaks a capture, or None."""
    packet = func.overloadpacket
    if packet in _UNCAPTURABLE:
        return _UNCAPTURABLE[packet]
    if packet in _HOST_DATA and args[0].dim() > 0:  # 0-dim: a scalar in t[i] = 0, fine
        return "copies host data into the body (torch.tensor([...]))"
    repeats_tensor = func._overloadname in ("Tensor", "self_Tensor")
    if packet is aten.repeat_interleave and repeats_tensor and kwargs.get("output_size") is None:
        return "has a data-dependent shape (repeat_interleave by a tensor, no output_size)"
    if packet in _BOOL_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "indexes with a boolean mask (a data-dependent shape)"
    return None


def _same_view(old: torch.Tensor, new: torch.Tensor) -> bool:
    """``new`` is ``old`` again (an in-place op's result or a view recomputed)."""
    return (
        new.data_ptr() == old.data_ptr()
        and new.shape == old.shape
        and new.stride() == old.stride()
        and new.dtype == old.dtype
    )


@dataclass(slots=True)
class _Held:
    """A tensor the graph reads but does not own, held weakly: a CUDA graph keeps its
    address, not a reference, so whoever made it must keep it alive."""

    ref: weakref.ReferenceType
    what: str

    @classmethod
    def of(cls, t: torch.Tensor) -> _Held:
        return cls(weakref.ref(t), f"{tuple(t.shape)} {t.dtype}")

    def get(self) -> torch.Tensor:
        t = self.ref()
        if t is None:
            raise GraphReplayError(
                f"a captured body reads a tensor ({self.what}) that nothing outside the graph "
                "holds anymore: on a GPU its memory is freed and reused before this replay"
            )
        return t


@dataclass(slots=True)
class _Step:
    """One recorded op (or Triton launch) and the tensors it made at capture."""

    call: Callable[..., Any]
    args: tuple
    kwargs: dict
    outputs: list  # flattened; None where the op returned an input (in place) or no tensor
    keep_inputs: bool = False  # host data (a wrapped scalar): the graph's own constant

    def run(self) -> None:
        args, kwargs = tree_map_only(_Held, _Held.get, (self.args, self.kwargs))
        result = self.call(*args, **kwargs)
        if not self.outputs:  # a Triton launch: it wrote into its arguments
            return
        fresh, _ = tree_flatten(result)
        for old, new in zip(self.outputs, fresh, strict=True):
            if old is not None and not _same_view(old, new):
                old.copy_(new)


def _seal(steps: list[_Step]) -> None:
    """After capture: the graph owns what its steps made and holds the rest weakly."""
    made = {id(t) for step in steps for t in step.outputs if t is not None}

    def hold(t: torch.Tensor):
        return t if id(t) in made else _Held.of(t)

    for step in steps:
        if not step.keep_inputs:
            step.args, step.kwargs = tree_map_only(torch.Tensor, hold, (step.args, step.kwargs))


class _Recorder(TorchDispatchMode):
    """Records the ops of the thread that captures (dispatch modes are thread-local)."""

    def __init__(self, steps: list[_Step]):
        super().__init__()
        self.steps = steps
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:  # a Triton launch's own host work (the interpreter's copies)
            return func(*args, **kwargs)
        why = _capture_error(func, args, kwargs)
        if why is not None:
            raise GraphCaptureError(f"a captured body calls {func}, which {why}")
        out = func(*args, **kwargs)
        flat = [t if isinstance(t, torch.Tensor) else None for t in tree_flatten(out)[0]]
        if func.overloadpacket in _HOST_DATA:
            self.steps.append(_Step(func, args, kwargs, flat, keep_inputs=True))
        else:
            inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            outputs = [None if t is None or id(t) in inputs else t for t in flat]
            self.steps.append(_Step(func, args, kwargs, outputs))
        return out

    def record_launch(self, launch: Callable[..., None], args: tuple, kwargs: dict) -> None:
        self.paused = True
        try:
            launch(*args, **kwargs)
        finally:
            self.paused = False
        self.steps.append(_Step(launch, args, kwargs, []))


_local = threading.local()


def active_recorder() -> _Recorder | None:
    """The recorder capturing on this thread, if any (Triton launches report to it)."""
    return getattr(_local, "recorder", None)


class EmulatedGraph:
    """``with graph.capture(): out = body()`` runs and records the body; ``replay()``
    runs the record again, leaving new results in ``out``'s tensors."""

    def __init__(self) -> None:
        self._steps: list[_Step] = []
        self._inference_mode = False  # replays run in the mode the capture ran in

    @contextmanager
    def capture(self) -> Iterator[None]:
        if active_recorder() is not None:
            raise GraphCaptureError("captures do not nest")
        if self._steps:
            raise GraphCaptureError("this graph is already captured")
        self._inference_mode = torch.is_inference_mode_enabled()
        recorder = _Recorder(self._steps)
        _local.recorder = recorder
        try:
            with recorder:
                yield
        finally:
            _local.recorder = None
        _seal(self._steps)

    def replay(self) -> None:
        with torch.inference_mode(self._inference_mode):
            for step in self._steps:
                step.run()
