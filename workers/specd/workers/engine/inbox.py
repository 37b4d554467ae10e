"""The engine's inbox: what other threads ask of the loop thread, one frozen message per
kind, taken between steps (`Engine._drain_inbox` dispatches on the type)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from specd.workers.engine.output import RequestStream


@dataclass(frozen=True, slots=True)
class Submit:
    """Queue a request (a session turn first joins its session)."""

    stream: RequestStream


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort a request wherever it is (its caller has left)."""

    rid: str


@dataclass(frozen=True, slots=True)
class CloseSession:
    """Free a session marked closing (after its turn in flight, which is aborted)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class CallOnLoop:
    """Run ``fn(*args)`` on the loop thread, its result or exception into ``done``."""

    done: Future
    fn: Callable[..., Any]
    args: tuple


Message = Submit | Abort | CloseSession | CallOnLoop


class Inbox:
    """Messages for the loop thread, and the event that wakes it when idle."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wake = threading.Event()

    def post(self, message: Message) -> None:
        self._queue.put(message)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def wait(self, timeout_s: float) -> None:
        """Sleep until a message (or ``wake``) comes, at most ``timeout_s``."""
        self._wake.wait(timeout_s)
        self._wake.clear()

    def drain(self) -> Iterator[Message]:
        """The messages posted so far, oldest first."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return
