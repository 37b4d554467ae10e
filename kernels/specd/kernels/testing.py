"""Helpers for tests of the attention backends: random paged cases and dense attention."""

from __future__ import annotations

import torch


def dense_attention(q, k, v, mask, scale):
    """q [q, H, D], k/v [kv, Hkv, D], mask [q, kv] -> [q, H, D] (explicit softmax)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_case(qo_lens, kv_lens, heads=4, kv_heads=2, dim=8, slots=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(slots, kv_heads, dim, generator=g)
    v_buf = torch.randn(slots, kv_heads, dim, generator=g)
    width = max(kv_lens) + 3
    req_to_token = torch.zeros(len(kv_lens), width, dtype=torch.int64)
    perm = torch.randperm(slots, generator=g)
    used = 0
    for i, n in enumerate(kv_lens):  # scattered, non-contiguous slots
        req_to_token[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(sum(qo_lens), heads, dim, generator=g)
    return q, k_buf, v_buf, req_to_token
