"""What a replica loads before it can decode: the models (`Models`) and the KV memory
(`KVMemory`), built by ``factory.py`` and read by the parts built on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specd.kernels import AttentionBackend
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.block_keys import EvictedBlocks
from specd.workers.mem_cache.kv_manager import KVManager
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.mem_cache.sizing import SpecShape
from specd.workers.model.config import ModelConfig
from specd.workers.speculative.adaptive import SpecPolicy
from specd.workers.speculative.draft_head import DraftHead


@dataclass(frozen=True, slots=True)
class Models:
    """The loaded weights and what they fix: context length, eos ids, the draft."""

    tokenizer: Any
    model: torch.nn.Module
    config: ModelConfig
    context_length: int
    eos_token_ids: frozenset[int]
    sampling_defaults: dict  # for requests that leave sampling fields out
    spec_shape: SpecShape | None  # the widest speculative layout; None for plain decode
    spec_policy: SpecPolicy | None
    draft_head: DraftHead | None


@dataclass(frozen=True, slots=True)
class KVMemory:
    """One replica's KV memory: request rows, pages, the K/V pools on the same slots."""

    req_pool: ReqToTokenPool
    allocator: PagedTokenAllocator
    kv: KVManager  # rows, pages, committed/allocated lengths and the prefix cache
    kv_pool: KVPool  # the target's K/V
    draft_pool: KVPool | None  # the draft's K/V (speculative engines)
    evicted_blocks: EvictedBlocks  # for the gateway's cache-aware routing
    backend_name: str
    backend: AttentionBackend

    @property
    def pools(self) -> list[KVPool]:
        """Every K/V pool: the target's, then the draft's (a session moves them all)."""
        return [self.kv_pool] + ([self.draft_pool] if self.draft_pool is not None else [])
