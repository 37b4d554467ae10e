"""Pure-torch reference attention over paged KV (runs on CPU and CUDA).

Gathers each request's K/V through ``kv_indices`` into a padded batch and runs
``scaled_dot_product_attention`` with an explicit boolean mask (causal, or the
caller's custom tree mask).  Slow but simple: the ground truth for other backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specd.kernels.metadata import AttentionMetadata
from specd.kernels.registry import BackendCapabilities, register_backend


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

    def forward(self, q, k_buffer, v_buffer, meta: AttentionMetadata, scale: float):
        out = torch.empty_like(q)
        qo = meta.qo_indptr.tolist()
        kv = meta.kv_indptr.tolist()
        decode_rows = [
            i for i in range(meta.batch_size) if meta.qo_lens[i] == 1 and meta.custom_mask is None
        ]
        if decode_rows:
            self._decode(q, k_buffer, v_buffer, meta, scale, decode_rows, qo, kv, out)
        decode_set = set(decode_rows)
        for i in range(meta.batch_size):
            if i in decode_set:
                continue
            slots = meta.kv_indices[kv[i] : kv[i + 1]]
            k = k_buffer[slots].transpose(0, 1)[None]  # [1, Hkv, kv_len, D]
            v = v_buffer[slots].transpose(0, 1)[None]
            qi = q[qo[i] : qo[i + 1]].transpose(0, 1)[None]  # [1, H, q_len, D]
            mask = _request_mask(meta, i, q.device)
            out[qo[i] : qo[i + 1]] = _attend(qi, k, v, mask, scale)[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_buffer, v_buffer, meta, scale, rows, qo, kv, out):
        device = q.device
        lens = [meta.kv_lens[i] for i in rows]
        max_kv = max(lens)
        slots = torch.zeros(len(rows), max_kv, dtype=torch.int64, device=device)
        for j, i in enumerate(rows):
            slots[j, : lens[j]] = meta.kv_indices[kv[i] : kv[i + 1]]
        k = k_buffer[slots].transpose(1, 2)  # [b, Hkv, max_kv, D]
        v = v_buffer[slots].transpose(1, 2)
        q_rows = torch.tensor([qo[i] for i in rows], device=device)
        qd = q[q_rows][:, :, None, :]  # [b, H, 1, D]
        valid = (
            torch.arange(max_kv, device=device)[None, :]
            < torch.tensor(lens, device=device)[:, None]
        )
        o = _attend(qd, k, v, valid[:, None, None, :], scale)  # [b, H, 1, D]
        out[q_rows] = o[:, :, 0, :]
