"""The one place Triton kernels are launched from.

Launches are serialized: an engine with overlap scheduling launches from two threads
(row writes on the scheduler thread while a step computes), a kernel's first launch
with new specializations compiles it, which Triton does not promise to be safe from two
threads at once, and Triton's interpreter (``TRITON_INTERPRET=1``: the CPU tests) keeps
the running launch's grid in module-level state.  An uncontended lock costs well under
a microsecond next to a launch's tens.  A launch made while an ``EmulatedGraph``
captures on this thread runs and is recorded for replay.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

from specd.kernels.emulated_graph import active_recorder

_launch_lock = threading.Lock()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``."""
    recorder = active_recorder()
    if recorder is not None:
        recorder.record_launch(partial(_launch_now, kernel, grid), args, kwargs)
    else:
        _launch_now(kernel, grid, *args, **kwargs)


def _launch_now(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    with _launch_lock:
        kernel[grid](*args, **kwargs)
