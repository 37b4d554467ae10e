"""What rank 0 of a tensor-parallel replica sends its other ranks, and how.

Rank 0 owns every request's state; the other ranks hold weights and KV shards only.
Before each call that runs collectives (a forward, a logits gather) or writes KV (a KV
move), rank 0 broadcasts one record that names the call and carries its inputs, and
every rank then runs the same call on its shard (the driver-worker scheme of vLLM v0).

A record is pickled with its host tensors inline and its device tensors left out and
broadcast on the device group after it, in pickling order (``persistent_id``), so a CUDA
replica moves its tensors over NCCL while the pickle goes over gloo.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from specd.kernels import AttentionMetadata
from specd.workers.model.parallel import set_group_timeout

ModelName = Literal["target", "draft"]
PoolName = Literal["target", "draft"]


@dataclass(frozen=True, slots=True)
class ContextOnWire:
    """A `ForwardContext` as sent: the metadata its plan came from, its write slots and
    which KV pool it writes (each rank plans the metadata on its own backend)."""

    attn_meta: AttentionMetadata
    out_cache_loc: torch.Tensor
    pool: PoolName


@dataclass(frozen=True, slots=True)
class ModelCall:
    """Run ``model.method(*args, **kwargs)`` on every rank."""

    model: ModelName
    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KVMove:
    """``KernelOps.move_kv`` on one pool's planes: ``planes[:, dst] = planes[:, src]``."""

    pool: PoolName
    src: torch.Tensor
    dst: torch.Tensor


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Rank 0's KV sizing, which the other ranks copy: slots per pool (one more for the
    pad slot is added by `KVPool`) and the attention backend that reads them."""

    num_slots: int
    backend_name: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Nothing to run: rank 0 is idle, and says so before the group's timeout."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The replica is shutting down: the other ranks leave their loop."""


Record = ModelCall | KVMove | KVLayout | Tick | Stop


def on_device(tensor: torch.Tensor) -> bool:
    """Whether a record's tensor travels on the device group (else inside the pickle)."""
    return tensor.device.type != "cpu"


class _Pickler(pickle.Pickler):
    def __init__(
        self,
        file: io.BytesIO,
        device_tensors: list[torch.Tensor],
        separate: Callable[[torch.Tensor], bool],
    ):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.device_tensors, self.separate = device_tensors, separate

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and self.separate(obj):
            self.device_tensors.append(obj.contiguous())
            return ("tensor", tuple(obj.shape), obj.dtype)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, receive_tensor):
        super().__init__(file)
        self.receive_tensor = receive_tensor

    def persistent_load(self, pid: Any) -> Any:
        _, shape, dtype = pid
        return self.receive_tensor(shape, dtype)


class RankWire:
    """Broadcasts records from rank 0 on the control group (gloo), their device tensors
    on the device group; every call fails after the group's timeout instead of hanging."""

    def __init__(
        self,
        control_group: Any,
        device_group: Any,
        device: torch.device,
        separate: Callable[[torch.Tensor], bool] = on_device,
    ):
        self.control_group, self.device_group, self.device = control_group, device_group, device
        self.separate = separate  # which tensors travel on the device group

    def set_timeout(self, timeout_s: float) -> None:
        """Every later call fails after ``timeout_s`` (the groups form with a longer one)."""
        set_group_timeout(self.control_group, timeout_s)
        if self.device_group is not self.control_group:
            set_group_timeout(self.device_group, timeout_s)

    def send(self, record: Record) -> None:
        device_tensors: list[torch.Tensor] = []
        buffer = io.BytesIO()
        _Pickler(buffer, device_tensors, self.separate).dump(record)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([payload.numel()]), 0, group=self.control_group)
        dist.broadcast(payload, 0, group=self.control_group)
        for tensor in device_tensors:
            dist.broadcast(tensor, 0, group=self.device_group)

    def receive(self) -> Record:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control_group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=self.control_group)

        def receive_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(tensor, 0, group=self.device_group)
            return tensor

        return _Unpickler(io.BytesIO(payload.numpy().tobytes()), receive_tensor).load()
