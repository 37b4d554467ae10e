"""Pure-torch reference attention over paged KV (runs on CPU and CUDA).

Decode rows share one padded batch, and so do the requests of a custom-mask batch
(tree verify, draft trees); prefill chunks run one by one.  All use
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


def _masked_batch(meta: AttentionMetadata, rows: list[int], qo: list[int], kv: list[int]):
    """The custom-mask requests ``rows`` as one padded batch -> (``[b, max_q]`` flat query
    index of each padded query, ``[b, max_q]`` True on real ones, ``[b, max_kv]`` pool
    slots, ``[b, 1, max_q, max_kv]`` mask).  Each request's mask sits in its top-left
    corner; a padding query sees slot 0 alone (its output is dropped), so no row of the
    mask is empty."""
    device = meta.kv_indices.device
    q_lens = [meta.qo_lens[i] for i in rows]
    max_q, max_kv = max(q_lens), max(meta.kv_lens[i] for i in rows)
    offsets = torch.arange(max_q, device=device)
    q_valid = offsets[None, :] < torch.tensor(q_lens, device=device)[:, None]
    starts = torch.tensor([qo[i] for i in rows], device=device)
    q_index = torch.where(q_valid, starts[:, None] + offsets[None, :], starts[:, None])
    slots, _ = _decode_slots(meta, rows, kv)
    mask = torch.zeros(len(rows), 1, max_q, max_kv, dtype=torch.bool, device=device)
    mask[:, 0, :, 0] = ~q_valid
    for b, i in enumerate(rows):
        mask[b, 0, : meta.qo_lens[i], : meta.kv_lens[i]] = _request_mask(meta, i, device)
    return q_index, q_valid, slots, mask


def plan_extends(
    meta: AttentionMetadata, rows: list[int], qo: list[int], kv: list[int]
) -> tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]:
    """Requests ``rows`` run one by one: (first query, end, pool slots, mask) each.
    ``qo``/``kv``: the exclusive cumsums of the batch's query and KV lengths."""
    device = meta.kv_indices.device
    return tuple(
        (qo[i], qo[i + 1], meta.kv_indices[kv[i] : kv[i + 1]], _request_mask(meta, i, device))
        for i in rows
    )


def run_extends(q, k_buffer, v_buffer, extends, scale: float, out: torch.Tensor) -> None:
    """Write the attention of each of `plan_extends`' requests into its rows of ``out``."""
    for q0, q1, slots, mask in extends:
        k = _gather(k_buffer, slots).transpose(0, 1)[None]  # [1, Hkv, kv_len, D]
        v = _gather(v_buffer, slots).transpose(0, 1)[None]
        qi = q[q0:q1].transpose(0, 1)[None]  # [1, H, q_len, D]
        out[q0:q1] = _attend(qi, k, v, mask, scale)[0].transpose(0, 1)


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
    # the custom-mask requests as one padded batch (``_masked_batch``), when two or more
    masked: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def decode_only(self) -> bool:
        """Every query is a decode request's, in order: no gather or scatter of rows."""
        return not self.extends and self.masked is None and self.decode_q_rows is not None


@register_backend(
    BackendCapabilities(
        name="torch",
        devices=("cpu", "cuda"),
        supports_custom_mask=True,
        supports_paged_tree=True,
    )
)
class TorchAttentionBackend:
    """Decode rows (one query, causal) run as one padded batch, and so do the requests
    with a custom mask (a verify's or a draft's trees: a few queries each, so padding
    them costs less than a call per request); prefill chunks run alone with their
    causal mask, so nothing is padded to the longest prompt."""

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        device = meta.kv_indices.device
        qo, kv = exclusive_cumsum(meta.qo_lens), exclusive_cumsum(meta.kv_lens)
        is_decode = [q == 1 and meta.custom_mask is None for q in meta.qo_lens]
        rows = [i for i, d in enumerate(is_decode) if d]
        q_rows = slots = mask = None
        if rows:
            q_rows = torch.tensor([qo[i] for i in rows], device=device)
            slots, mask = _decode_slots(meta, rows, kv)
        alone = [i for i, d in enumerate(is_decode) if not d]
        masked = None
        if meta.custom_mask is not None and len(alone) > 1:
            masked, alone = _masked_batch(meta, alone, qo, kv), []
        return TorchAttentionPlan(q_rows, slots, mask, plan_extends(meta, alone, qo, kv), masked)

    def forward(self, q, k_buffer, v_buffer, plan: TorchAttentionPlan, scale: float):
        """q [N, H, D] -> [N, H, D], reading K/V from the pool through ``plan``."""
        if plan.decode_only:
            return self._decode(q, k_buffer, v_buffer, plan, scale)
        out = torch.empty_like(q)
        if plan.decode_q_rows is not None:
            rows = plan.decode_q_rows
            out[rows] = self._decode(q[rows], k_buffer, v_buffer, plan, scale)
        if plan.masked is not None:
            q_index, q_valid, slots, mask = plan.masked
            k = _gather(k_buffer, slots).transpose(1, 2)  # [b, Hkv, max_kv, D]
            v = _gather(v_buffer, slots).transpose(1, 2)
            qb = q[q_index].transpose(1, 2)  # [b, H, max_q, D]
            out[q_index[q_valid]] = _attend(qb, k, v, mask, scale).transpose(1, 2)[q_valid]
        run_extends(q, k_buffer, v_buffer, plan.extends, scale, out)
        return out

    @staticmethod
    def _decode(q, k_buffer, v_buffer, plan: TorchAttentionPlan, scale: float):
        """The decode requests' queries q [b, H, D] -> [b, H, D], one padded batch."""
        k = _gather(k_buffer, plan.decode_slots).transpose(1, 2)  # [b, Hkv, max_kv, D]
        v = _gather(v_buffer, plan.decode_slots).transpose(1, 2)
        return _attend(q[:, :, None, :], k, v, plan.decode_mask, scale)[:, :, 0, :]
