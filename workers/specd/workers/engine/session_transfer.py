"""Session transfer: an idle session's history and KV leave a draining replica for another.

When the pool retires a replica (scale-down, rolling update) it drains the requests in
flight and then moves each idle session: the source copies the KV of the history to
the host and frees it (`SessionTransfer.leave`), the destination allocates slots and
writes it back (`SessionTransfer.arrive`).  The history moves whenever both replicas read
the same tokenizer; the KV only when it was computed the same way (same model files,
dtype and draft), since it is reused as is.  Without the KV the session still moves,
and its next turn prefills the history, as after a memory-pressure eviction.  A
tensor-parallel replica moves histories only: its KV is split over its ranks.

Both run on the engine loop thread, which owns the KV; tensor copies go through the
compute thread so that they follow any step in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specd.workers.config import DeploymentSpec
from specd.workers.mem_cache.kv_manager import KVManager, RequestKV
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.scheduler.session_store import SessionStore
from specd.workers.types import SessionError, SessionSnapshot


def vocabulary_of(spec: DeploymentSpec) -> str:
    """What a session's token ids mean: the tokenizer folder."""
    return spec.model.tokenizer or spec.model.path


def kv_layout_of(spec: DeploymentSpec, dtype: torch.dtype) -> str:
    """What a session's KV was computed by: target files and dtype, and the draft's."""
    draft = spec.draft
    drafted = "no draft"
    if draft is not None:
        drafted = f"{draft.path or 'no draft model'} ({draft.algorithm.value})"
    tensor = spec.parallelism.tensor
    split = f", over {tensor} ranks" if tensor > 1 else ""
    return f"{spec.model.path} {dtype}, {drafted}{split}"


class SessionTransfer:
    def __init__(
        self,
        sessions: SessionStore,
        kv: KVManager,
        pools: Sequence[KVPool],
        run: Callable[..., Any],
        *,
        vocabulary: str,
        kv_layout: str,
        context_length: int,
        moves_kv: bool = True,
    ):
        self.sessions = sessions
        self.kv = kv
        self.pools = pools  # the target's KV pool, then the draft's
        self._run = run  # on the compute thread, after any step in flight
        self.vocabulary = vocabulary
        self.kv_layout = kv_layout
        self.context_length = context_length
        self.moves_kv = moves_kv  # False: snapshots carry the history only

    def leave(self, sid: str) -> SessionSnapshot:
        """Snapshot idle session ``sid`` and free it here (409 while a turn runs)."""
        session, kv = self.sessions.leave(sid, self._read)
        return SessionSnapshot(
            session_id=sid,
            history=tuple(session.history),
            idle_s=time.monotonic() - session.last_used,
            vocabulary=self.vocabulary,
            kv_layout=self.kv_layout,
            kv=kv,
        )

    def arrive(self, snapshot: SessionSnapshot) -> bool:
        """Hold ``snapshot``'s session here; True when its KV came along.  Refused (409)
        when this replica reads another tokenizer or the history no longer fits its
        context, and as a new session would be (400 disabled, 429 full)."""
        sid = snapshot.session_id
        if snapshot.vocabulary != self.vocabulary:
            raise SessionError(
                f"session {sid}: its history is in the tokens of {snapshot.vocabulary}, "
                f"this replica reads {self.vocabulary}",
                409,
            )
        if len(snapshot.history) >= self.context_length:
            raise SessionError(
                f"session {sid}: its {len(snapshot.history)} tokens leave no room in the "
                f"context length {self.context_length}",
                409,
            )
        same_kv = bool(snapshot.kv) and snapshot.kv_layout == self.kv_layout
        return self.sessions.arrive(
            sid,
            list(snapshot.history),
            snapshot.idle_s,
            lambda held: same_kv and self._write(held, snapshot.kv),
        )

    def _read(self, held: RequestKV) -> tuple[torch.Tensor, ...]:
        if not self.moves_kv:
            return ()
        slots = self.kv.slots(held, 0, held.committed)
        return tuple(self._run(pool.read, slots) for pool in self.pools)

    def _write(self, held: RequestKV, planes: Sequence[torch.Tensor]) -> bool:
        """Slots for the history's KV and the KV into them; False (holding nothing)
        when the pools lack room: the session then arrives with its history only."""
        length = planes[0].shape[1]
        if not self.kv.grow(held, length):
            return False
        slots = self.kv.slots(held, 0, length)
        try:
            for pool, plane in zip(self.pools, planes, strict=True):
                self._run(pool.write, slots, plane)
        except BaseException:
            self.kv.release(held)
            raise
        held.committed = length
        return True
