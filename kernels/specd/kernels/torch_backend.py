"""Pure-torch reference attention over paged KV (runs on CPU and CUDA).

Decode rows share one padded batch; other requests run one by one. Both use
``scaled_dot_product_attention`` with an explicit boolean mask (causal, or the
caller's custom tree mask).  Slow but simple: the ground truth for other backends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.kernels.backend import BackendCapabilities, register_backend
from specd.kernels.metadata import AttentionMetadata
from specd.kernels.ops import exclusive_cumsum


def _request_mask(meta: AttentionMetadata, i: int, device: torch.device) -> torch.Tensor:
    """[qo_len, kv_len] bool for request ``i``: causal, or its slice of the custom mask."""
    q_len, kv_len = meta.qo_lens[i], meta.kv_lens[i]
    if meta.custom_mask is not None:
        start = sum(q * k for q, k in zip(meta.qo_lens[:i], meta.kv_lens[:i], strict=True))
        return meta.custom_mask[start : start + q_len * kv_len].view(q_len, kv_len).to(device)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]


def _attend(q, k, v, mask, scale):
    """q [b, H, q, D], k/v [b, Hkv, kv, D], mask broadcastable to [b, H, q, kv]."""
    return F.scaled_dot_product_attention(
        q,
        k.to(q.dtype),
        v.to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def _decode_slots(
    meta: AttentionMetadata, rows: list[int], kv_indptr: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decode requests ``rows``' pool slots as one padded ``[b, max_kv]`` (0 where
    padded) and its ``[b, 1, 1, max_kv]`` validity mask; None when no row is padded."""
    lens = [meta.kv_lens[i] for i in rows]
    ragged = min(lens) != max(lens)
    if len(rows) == meta.batch_size and not ragged:  # the indices as they are
        return meta.kv_indices.view(len(rows), lens[0]), None
    device = meta.kv_indices.device
    offsets = torch.arange(max(lens), device=device)
    valid = offsets[None, :] < torch.tensor(lens, device=device)[:, None]  # [b, max_kv]
    starts = torch.tensor([kv_indptr[i] for i in rows], device=device)
    flat = (starts[:, None] + offsets[None, :]).clamp(max=max(len(meta.kv_indices) - 1, 0))
    slots = torch.where(valid, meta.kv_indices[flat], 0)
    return slots, (valid[:, None, None, :] if ragged else None)  # SDPA is faster unmasked


def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buffer [num_slots, Hkv, D], slots [...] -> [..., Hkv, D].  ``index_select`` copies
    whole rows: 1.6-2x faster than advanced indexing on CPU (measured at 1 x 100 and
    32 x 113 slots)."""
    return buffer.index_select(0, slots.reshape(-1)).view(*slots.shape, *buffer.shape[1:])


@dataclass(frozen=True, slots=True)
class TorchAttentionPlan:
    """Index tensors computed once per batch and reused by every layer."""

    decode_q_rows: torch.Tensor | None  # [b] flat query index of each decode request
    decode_slots: torch.Tensor | None  # [b, max_kv] pool slots, 0 where padded
    decode_mask: torch.Tensor | None  # [b, 1, 1, max_kv] True on real KV positions; None: all
    extends: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]  # (q0, q1, slots, mask)

    @property
    def decode_only(self) -> bool:
        """Every query is a decode request's, in order: no gather or scatter of rows."""
        return not self.extends and self.decode_q_rows is not None


@register_backend(
    BackendCapabilities(
        name="torch",
        devices=("cpu", "cuda"),
        supports_custom_mask=True,
        supports_paged_tree=True,
    )
)
class TorchAttentionBackend:
    """Decode rows (one query, causal) run as one padded batch; every other request
    (prefill chunks, tree verify) runs alone with its exact mask, so nothing is padded
    to the longest prompt."""

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        device = meta.kv_indices.device
        qo, kv = exclusive_cumsum(meta.qo_lens), exclusive_cumsum(meta.kv_lens)
        is_decode = [q == 1 and meta.custom_mask is None for q in meta.qo_lens]
        rows = [i for i, d in enumerate(is_decode) if d]
        q_rows = slots = mask = None
        if rows:
            q_rows = torch.tensor([qo[i] for i in rows], device=device)
            slots, mask = _decode_slots(meta, rows, kv)
        extends = tuple(
            (qo[i], qo[i + 1], meta.kv_indices[kv[i] : kv[i + 1]], _request_mask(meta, i, device))
            for i, d in enumerate(is_decode)
            if not d
        )
        return TorchAttentionPlan(q_rows, slots, mask, extends)

    def forward(self, q, k_buffer, v_buffer, plan: TorchAttentionPlan, scale: float):
        """q [N, H, D] -> [N, H, D], reading K/V from the pool through ``plan``."""
        if plan.decode_only:
            return self._decode(q, k_buffer, v_buffer, plan, scale)
        out = torch.empty_like(q)
        if plan.decode_q_rows is not None:
            rows = plan.decode_q_rows
            out[rows] = self._decode(q[rows], k_buffer, v_buffer, plan, scale)
        for q0, q1, slots, mask in plan.extends:
            k = _gather(k_buffer, slots).transpose(0, 1)[None]  # [1, Hkv, kv_len, D]
            v = _gather(v_buffer, slots).transpose(0, 1)[None]
            qi = q[q0:q1].transpose(0, 1)[None]  # [1, H, q_len, D]
            out[q0:q1] = _attend(qi, k, v, mask, scale)[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_buffer, v_buffer, plan: TorchAttentionPlan, scale: float):
        """The decode requests' queries q [b, H, D] -> [b, H, D], one padded batch."""
        k = _gather(k_buffer, plan.decode_slots).transpose(1, 2)  # [b, Hkv, max_kv, D]
        v = _gather(v_buffer, plan.decode_slots).transpose(1, 2)
        return _attend(q[:, :, None, :], k, v, plan.decode_mask, scale)[:, :, 0, :]
