"""The one place Triton kernels are launched from.

Compiled kernels launch as usual.  Under Triton's interpreter (``TRITON_INTERPRET=1``:
the CPU tests) launches are serialized, because the interpreter keeps the running
launch's grid in module-level state, and an engine with overlap scheduling launches
from two threads (row writes on the scheduler thread while a step computes).  A launch
made while an ``EmulatedGraph`` captures on this thread runs and is recorded for replay.
"""

from __future__ import annotations

import os
import threading
from functools import partial
from typing import Any

from specd.kernels.emulated_graph import active_recorder

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read when kernels are defined
_interpreter_lock = threading.Lock()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``."""
    recorder = active_recorder()
    if recorder is not None:
        recorder.record_launch(partial(_launch_now, kernel, grid), args, kwargs)
    else:
        _launch_now(kernel, grid, *args, **kwargs)


def _launch_now(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    if INTERPRETING:
        with _interpreter_lock:
            kernel[grid](*args, **kwargs)
    else:
        kernel[grid](*args, **kwargs)
