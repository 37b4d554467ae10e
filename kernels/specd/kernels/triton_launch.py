"""The one place Triton kernels are launched from.

Compiled kernels launch as usual.  Under Triton's interpreter (``TRITON_INTERPRET=1``:
the CPU tests) launches are serialized, because the interpreter keeps the running
launch's grid in module-level state, and an engine with overlap scheduling launches
from two threads (row writes on the scheduler thread while a step computes).
"""

from __future__ import annotations

import os
import threading
from typing import Any

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read when kernels are defined
_interpreter_lock = threading.Lock()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``."""
    if INTERPRETING:
        with _interpreter_lock:
            kernel[grid](*args, **kwargs)
    else:
        kernel[grid](*args, **kwargs)
