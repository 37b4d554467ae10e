"""What one forward pass needs besides token ids and positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specd.kernels import AttentionBackend
from specd.workers.mem_cache.kv_pool import KVPool


@dataclass(frozen=True, slots=True)
class ForwardContext:
    attn_plan: Any  # ``backend.plan(AttentionMetadata)`` for this batch
    out_cache_loc: torch.Tensor  # [num_tokens] pool slot where each input token's K/V goes
    kv_pool: KVPool
    backend: AttentionBackend
