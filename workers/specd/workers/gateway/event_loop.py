"""The gateway's event loop: uvloop's (libuv) where it is installed, asyncio's otherwise.

The gateway's work per request is mostly socket reads and writes and wake-ups from its
threads (body parsing, tokenizing); uvloop does each in C, as vLLM's and SGLang's API
servers run it (HTTP is parsed in C as well: `http_protocol`).  uvloop is a dependency
of specd; the fallback keeps a machine that lacks it (an offline GPU image) serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None (asyncio's default) where uvloop is missing."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_gateway_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the gateway's loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
