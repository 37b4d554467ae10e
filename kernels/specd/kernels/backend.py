"""What an attention backend is: its capabilities, the `AttentionBackend` interface and
`register_backend` (each backend module registers itself on import; `registry` chooses)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specd.kernels.metadata import AttentionMetadata

ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    name: str
    devices: tuple[str, ...]
    supports_custom_mask: bool
    supports_paged_tree: bool  # page_size > 1 together with topk > 1
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES  # KV / query dtypes it computes in
    supports_graphs: bool = False  # graph_plan / update_graph_plan (CUDA-graph batches)
    head_dims: tuple[int, ...] | None = None  # the head sizes its kernels take; None: any

    def runs_head_dims(self, head_dims: Iterable[int]) -> bool:
        return self.head_dims is None or all(d in self.head_dims for d in head_dims)


class AttentionBackend(Protocol):
    """flashinfer-style split: ``plan`` once per batch, ``forward`` once per layer."""

    capabilities: BackendCapabilities

    def plan(self, meta: AttentionMetadata) -> Any:
        """Precompute whatever every layer of this batch reuses (indices, masks)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_buffer: torch.Tensor,  # [pool_slots, num_kv_heads, head_dim]
        v_buffer: torch.Tensor,
        plan: Any,  # what ``plan`` returned for this batch
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    # Backends with ``supports_graphs`` also have (see metadata.GraphShape, GraphBuffers):
    #   graph_buffer_needs(shape) -> {name: (numel, dtype)}   shared buffers it views
    #   graph_plan(shape, device, buffers) -> plan          static buffers for that shape
    #   update_graph_plan(plan, meta)                        copy a padded batch's metadata
    #   update_graph_plan_lens(plan, qo_lens, kv_lens)       lengths only ...
    #   graph_kv_indices(plan) -> Tensor                     ... the graph writes the indices
    # so a captured forward reads each replay's batch from the same memory.


FACTORIES: dict[str, Callable[[], AttentionBackend]] = {}
CAPABILITIES: dict[str, BackendCapabilities] = {}
def register_backend(capabilities: BackendCapabilities):
    """Class decorator: register a backend under ``capabilities.name``."""

    def wrap(cls):
        cls.capabilities = capabilities
        FACTORIES[capabilities.name] = cls
        CAPABILITIES[capabilities.name] = capabilities
        return cls

    return wrap
