"""The ``cpu`` attention backend: the C kernel of `cpu_attention` for requests with few
queries (decode steps, verify and draft trees, with or without a custom mask), reading
K/V in place; prefill chunks, and any batch whose dtypes the kernel does not compute,
run as in the torch reference.  ``auto`` picks it on CPU wherever the kernel builds.

Importing this module builds the kernel (once per machine, cached) and fails with the
reason where it cannot run, so the registry lists the backend as missing with that
reason instead of registering it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.kernels.backend import BackendCapabilities, register_backend
from specd.kernels.cpu_attention import DTYPES, MAX_QUERIES, paged_attention, unavailable_reason
from specd.kernels.metadata import AttentionMetadata
from specd.kernels.ops import exclusive_cumsum, host_tensor
from specd.kernels.torch_backend import TorchAttentionBackend, plan_extends, run_extends

if (_why := unavailable_reason()) is not None:
    raise ImportError(_why)


@dataclass(frozen=True, slots=True)
class CpuAttentionPlan:
    meta: AttentionMetadata
    native: torch.Tensor  # [R] int64: the requests the C kernel computes
    extends: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]  # the others (SDPA)


@register_backend(
    BackendCapabilities(
        name="cpu",
        devices=("cpu",),
        supports_custom_mask=True,
        supports_paged_tree=True,
        dtypes=DTYPES,
    )
)
class CpuAttentionBackend:
    def __init__(self) -> None:
        self._reference = TorchAttentionBackend()  # for dtypes the kernel does not compute

    def plan(self, meta: AttentionMetadata) -> CpuAttentionPlan:
        few = [q <= MAX_QUERIES for q in meta.qo_lens]
        native = host_tensor([i for i, f in enumerate(few) if f], meta.kv_indices.device)
        qo, kv = exclusive_cumsum(meta.qo_lens), exclusive_cumsum(meta.kv_lens)
        rest = [i for i, f in enumerate(few) if not f]
        return CpuAttentionPlan(meta, native, plan_extends(meta, rest, qo, kv))

    def forward(self, q, k_buffer, v_buffer, plan: CpuAttentionPlan, scale: float):
        """q [N, H, D] -> [N, H, D], reading K/V from the pool through ``plan``."""
        if q.dtype not in DTYPES or k_buffer.dtype != q.dtype:
            ref = self._reference
            return ref.forward(q, k_buffer, v_buffer, ref.plan(plan.meta), scale)
        meta = plan.meta
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if len(plan.native):
            paged_attention(
                q, k_buffer, v_buffer, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                meta.custom_mask, plan.native, scale, out,
            )  # fmt: skip
        run_extends(q, k_buffer, v_buffer, plan.extends, scale, out)
        return out
