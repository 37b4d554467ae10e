"""CPU time from /proc (Linux only): one process, a process and everything under it,
and a sampler that measures how many cores a few process trees used while a load ran.

The serving benchmarks use it to say where a machine's cores went: to the server, to
the client beside it, or to nobody.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its threads."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS


def parents() -> dict[int, int]:
    """Every process's parent, now."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                out[int(entry.name)] = int(_stat_fields(int(entry.name))[1])
    return out


def descendants(root: int) -> list[int]:
    """``root`` and every process under it, now."""
    parent_of = parents()
    found = [root]
    for pid in parent_of:
        up = pid
        while up in parent_of and up not in (root, 0, 1):
            up = parent_of[up]
        if up == root and pid != root:
            found.append(pid)
    return found


def pids_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of ``pids`` (those gone are not counted)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and the processes under it now (those that ended are not
    counted: sample often where children come and go)."""
    return pids_cpu_seconds(descendants(root))


def specd_roles(root: int) -> dict[str, list[int]]:
    """The processes of a `specd serve` ``root`` by role: the gateway (``root``), its
    engine actors and the rest of its Ray (every other process under it)."""
    roles: dict[str, list[int]] = {"gateway": [root], "engine": [], "ray": []}
    for pid in descendants(root)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        roles["engine" if cmd.startswith("ray::EngineActor") else "ray"].append(pid)
    return roles


@dataclasses.dataclass(frozen=True)
class Cores:
    """Cores each tree used over a window (CPU seconds / wall seconds)."""

    seconds: float  # the window's wall time
    cores: dict[str, float]  # tree name -> cores


class CoreSampler:
    """Samples the CPU of named process trees (name -> root pid), or of named groups
    (name -> a function giving their CPU seconds), every ``interval_s`` on a thread,
    from ``start()`` until ``stop()``.  ``cores(busy=name)`` gives the cores each used
    over the window in which ``name`` was busy (at least ``busy_cores``): a client's
    start-up and exit, when the server waits, stay out of it."""

    def __init__(self, roots: dict[str, int | Callable[[], float]], interval_s: float = 0.5):
        self.interval_s = interval_s
        self.readers = {
            name: root if callable(root) else functools.partial(tree_cpu_seconds, root)
            for name, root in roots.items()
        }
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-sampler", daemon=True)

    def start(self) -> CoreSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append(
                (time.monotonic(), {name: read() for name, read in self.readers.items()})
            )
            if self._done.wait(self.interval_s):
                return

    def cores(self, busy: str, busy_cores: float = 0.25, gap: int = 2) -> Cores | None:
        """Cores per tree over the longest stretch of intervals in which ``busy`` used at
        least ``busy_cores`` (pauses of up to ``gap`` intervals bridged, so a warm-up
        and the run are one stretch while a lone blip before them is not); None if it
        never did."""
        stretches: list[list[int]] = []  # [first sample, last sample]
        for i in range(1, len(self.samples)):
            if self._rate(i - 1, i, busy) < busy_cores:
                continue
            if stretches and i - 1 - stretches[-1][1] <= gap:
                stretches[-1][1] = i
            else:
                stretches.append([i - 1, i])
        if not stretches:
            return None
        first, last = max(stretches, key=lambda s: self.samples[s[1]][0] - self.samples[s[0]][0])
        seconds = self.samples[last][0] - self.samples[first][0]
        return Cores(seconds, {n: self._rate(first, last, n) for n in self.readers})

    def _rate(self, i: int, j: int, name: str) -> float:
        (t0, a), (t1, b) = self.samples[i], self.samples[j]
        return max(b[name] - a[name], 0.0) / max(t1 - t0, 1e-9)
