"""What one forward pass needs besides token ids and positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specd.kernels import AttentionBackend, AttentionMetadata
from specd.workers.mem_cache.kv_pool import KVPool


@dataclass(frozen=True, slots=True)
class ForwardContext:
    attn_plan: Any  # ``backend.plan(AttentionMetadata)`` for this batch
    out_cache_loc: torch.Tensor  # [num_tokens] pool slot where each input token's K/V goes
    kv_pool: KVPool
    backend: AttentionBackend
    attn_meta: AttentionMetadata | None = None  # what ``attn_plan`` was planned from (eager)

    @classmethod
    def planned(
        cls,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        out_cache_loc: torch.Tensor,
        kv_pool: KVPool,
    ) -> ForwardContext:
        """An eager forward's context: ``meta`` planned now, and kept (under tensor
        parallelism rank 0 sends it to the other ranks, which plan it themselves)."""
        return cls(backend.plan(meta), out_cache_loc, kv_pool, backend, meta)
