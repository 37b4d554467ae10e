"""Triton attention backend over paged KV (CUDA; CPU only under Triton's interpreter).

``plan`` decides, once per batch, which kernel runs (split-KV decode when every request
has one causal query, the extend kernel otherwise) and prepares everything the layers
share; ``forward`` only launches, with a grid fixed at plan time (CUDA-graph safe).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch
import triton

from specd.kernels.backend import BackendCapabilities, register_backend
from specd.kernels.metadata import AttentionMetadata, GraphBuffers, GraphShape
from specd.kernels.ops import exclusive_cumsum, host_tensor
from specd.kernels.triton_attention import decode_attention, extend_attention

MAX_SPLITS = 16
MIN_KV_PER_SPLIT = 128  # fewer positions per split cost more in the merge than they save
TARGET_SPLIT_PROGRAMS = 64  # batch * splits to aim for; each also runs once per kv head


def triton_devices() -> tuple[str, ...]:
    """Devices the backend serves: CUDA, and CPU when ``TRITON_INTERPRET=1`` runs the same
    kernels through Triton's interpreter (how the tests run without a GPU)."""
    return ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)


def choose_num_splits(batch_size: int, max_kv_len: int) -> int:
    """KV splits per decode request: enough programs to fill the GPU at small batch, never
    splits shorter than MIN_KV_PER_SPLIT positions."""
    by_len = triton.cdiv(max_kv_len, MIN_KV_PER_SPLIT)
    by_batch = triton.cdiv(TARGET_SPLIT_PROGRAMS, max(batch_size, 1))
    return max(1, min(by_len, by_batch, MAX_SPLITS))


class Kernel(enum.Enum):
    EXTEND = "extend"  # any qo_len, causal or custom mask
    DECODE = "decode"  # qo_len 1 everywhere, causal: split KV + merge


@dataclass(slots=True)
class DecodeScratch:
    """Per-split partial outputs and log-sum-exps, allocated by the first layer's forward
    (heads and head_dim are only known from its shapes) and reused by every later layer."""

    batch_size: int
    num_splits: int
    part_out: torch.Tensor | None = None  # [bs, H, num_splits, D] float32
    part_lse: torch.Tensor | None = None  # [bs, H, num_splits] float32

    def buffers(self, heads: int, head_dim: int, device: torch.device):
        shape = (self.batch_size, heads, self.num_splits, head_dim)
        if self.part_out is None or self.part_out.shape != shape:
            self.part_out = torch.empty(shape, dtype=torch.float32, device=device)
            self.part_lse = torch.empty(shape[:-1], dtype=torch.float32, device=device)
        return self.part_out, self.part_lse


@dataclass(slots=True)
class TritonAttentionPlan:
    """What every layer of one batch reuses."""

    kernel: Kernel
    qo_indptr: torch.Tensor  # [bs + 1] int64
    kv_indptr: torch.Tensor  # [bs + 1] int64
    kv_indices: torch.Tensor  # [sum(kv_len)] int64 pool slots
    max_qo_len: int
    custom_mask: torch.Tensor | None = None  # [sum(qo_len * kv_len)] uint8 view of the bool mask
    mask_indptr: torch.Tensor | None = None  # [bs + 1] int64 start of each request's mask
    decode: DecodeScratch | None = None  # DECODE only


def _mask_indptr(meta: AttentionMetadata) -> torch.Tensor:
    """[bs + 1] offsets of each request's [qo_len, kv_len] block in the flat custom mask."""
    sizes = [q * k for q, k in zip(meta.qo_lens, meta.kv_lens, strict=True)]
    return host_tensor(exclusive_cumsum(sizes), meta.qo_indptr.device)


def _is_decode(qo_len: int, custom_mask: bool) -> bool:
    return qo_len == 1 and not custom_mask


@register_backend(
    BackendCapabilities(
        name="triton",
        devices=triton_devices(),
        supports_custom_mask=True,
        supports_paged_tree=True,
        supports_graphs=True,
    )
)
class TritonAttentionBackend:
    """Triton kernels reading K/V straight from the pool through ``kv_indices``."""

    def __init__(self, num_splits: int | None = None):
        self.num_splits = num_splits  # fixed decode split count; None: choose per batch

    def plan(self, meta: AttentionMetadata) -> TritonAttentionPlan:
        is_decode = meta.batch_size > 0 and all(
            _is_decode(q, meta.custom_mask is not None) for q in meta.qo_lens
        )
        common = dict(
            qo_indptr=meta.qo_indptr.to(torch.int64),
            kv_indptr=meta.kv_indptr.to(torch.int64),
            kv_indices=meta.kv_indices.to(torch.int64),
            max_qo_len=max(meta.qo_lens, default=0),
        )
        if is_decode:
            splits = self.num_splits or choose_num_splits(meta.batch_size, max(meta.kv_lens))
            scratch = DecodeScratch(meta.batch_size, splits)
            return TritonAttentionPlan(Kernel.DECODE, decode=scratch, **common)
        if meta.custom_mask is None:
            return TritonAttentionPlan(Kernel.EXTEND, **common)
        return TritonAttentionPlan(
            Kernel.EXTEND,
            custom_mask=meta.custom_mask.to(torch.bool).contiguous().view(torch.uint8),
            mask_indptr=_mask_indptr(meta),
            **common,
        )

    @staticmethod
    def graph_buffer_needs(shape: GraphShape) -> dict[str, tuple[int, torch.dtype]]:
        """The shared buffers (``GraphBuffers``) a plan of ``shape`` takes views of."""
        kv = shape.batch_size * shape.max_kv_len
        needs = {"kv_indices": (kv, torch.int64)}
        if shape.custom_mask:
            needs["custom_mask"] = (kv * shape.qo_len, torch.uint8)
        return needs

    def graph_plan(
        self, shape: GraphShape, device: torch.device, buffers: GraphBuffers
    ) -> TritonAttentionPlan:
        """Static buffers for batches of ``shape`` (see ``update_graph_plan``): the kernel,
        its grid and the decode split count are fixed by the shape, not by a batch."""
        bs, q = shape.batch_size, shape.qo_len
        needs = self.graph_buffer_needs(shape)
        common = dict(
            qo_indptr=torch.zeros(bs + 1, dtype=torch.int64, device=device),
            kv_indptr=torch.zeros(bs + 1, dtype=torch.int64, device=device),
            kv_indices=buffers.view("kv_indices", needs["kv_indices"][0]),
            max_qo_len=q,
        )
        if _is_decode(q, shape.custom_mask):
            splits = self.num_splits or choose_num_splits(bs, shape.max_kv_len)
            return TritonAttentionPlan(Kernel.DECODE, decode=DecodeScratch(bs, splits), **common)
        if not shape.custom_mask:
            return TritonAttentionPlan(Kernel.EXTEND, **common)
        return TritonAttentionPlan(
            Kernel.EXTEND,
            custom_mask=buffers.view("custom_mask", needs["custom_mask"][0]),
            mask_indptr=torch.zeros(bs + 1, dtype=torch.int64, device=device),
            **common,
        )

    def update_graph_plan(self, plan: TritonAttentionPlan, meta: AttentionMetadata) -> None:
        """Copy a batch padded to the plan's shape (``pad_metadata``) into its buffers."""
        plan.qo_indptr.copy_(meta.qo_indptr)
        plan.kv_indptr.copy_(meta.kv_indptr)
        plan.kv_indices[: meta.kv_indices.numel()].copy_(meta.kv_indices)
        if plan.custom_mask is not None:
            mask = meta.custom_mask.to(torch.bool).view(torch.uint8)
            plan.custom_mask[: mask.numel()].copy_(mask)
            plan.mask_indptr.copy_(_mask_indptr(meta))

    def update_graph_plan_lens(
        self, plan: TritonAttentionPlan, qo_lens: list[int], kv_lens: list[int]
    ) -> None:
        """Only the lengths of a padded causal batch: its ``kv_indices`` are written on the
        device, inside the graph, into ``graph_kv_indices(plan)``."""
        device = plan.qo_indptr.device
        plan.qo_indptr.copy_(host_tensor(exclusive_cumsum(qo_lens), device))
        plan.kv_indptr.copy_(host_tensor(exclusive_cumsum(kv_lens), device))

    @staticmethod
    def graph_kv_indices(plan: TritonAttentionPlan) -> torch.Tensor:
        return plan.kv_indices

    def forward(self, q, k_buffer, v_buffer, plan: TritonAttentionPlan, scale: float):
        """q [N, H, D] -> [N, H, D]; launches only (no host syncs)."""
        out = torch.empty_like(q)
        if plan.kernel is Kernel.DECODE:
            part_out, part_lse = plan.decode.buffers(q.shape[1], q.shape[2], q.device)
            decode_attention(
                q, k_buffer, v_buffer, out, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                part_out, part_lse, plan.decode.num_splits, scale,
            )  # fmt: skip
        else:
            extend_attention(
                q, k_buffer, v_buffer, out, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                plan.max_qo_len, scale, plan.custom_mask, plan.mask_indptr,
            )  # fmt: skip
        return out
