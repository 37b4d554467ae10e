"""Where an engine's torch work runs: inline on the loop thread, or (overlap scheduling)
on one compute thread while the loop thread prepares the next step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


def single_threaded_torch_in_this_thread() -> None:
    """Run this thread's torch ops on one core, leaving other threads as they are.

    Under overlap the loop thread's own torch ops are small; with more threads they start
    a second OpenMP team whose spinning workers take the compute thread's cores (CPU
    overlap at batch 8 ran at 0.6x of synchronous).  ``torch.set_num_threads`` also sets
    the process default that threads adopt on their first torch op, so that default is
    set back from a short-lived thread (which changes only its own team).
    """
    default = torch.get_num_threads()  # also fixes this thread's team before the change
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,))
    restore.start()
    restore.join()


def call_into(done: Future, fn: Callable[..., Any], args: tuple) -> None:
    """Run ``fn(*args)`` with its result or exception going to ``done``."""
    try:
        done.set_result(fn(*args))
    except BaseException as err:
        done.set_exception(err)


class Compute:
    """Where torch work runs: inline on the loop thread, or (overlap scheduling) on one
    worker thread, in submission order, while the loop thread prepares the next step.

    Loading runs here too, so one thread owns every large torch op: CPU torch keeps an
    OpenMP team per calling thread, and two teams halve matmul speed on small machines.
    """

    def __init__(self, threaded: bool, name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name) if threaded else None

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future = Future()
        call_into(done, fn, args)
        return done

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.submit(fn, *args).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
