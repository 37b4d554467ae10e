"""Attention over paged KV, tree build/verify helpers and KV moves.

Modules (one line each in docs/architecture.md):
- ``metadata``   AttentionMetadata: the ragged (qo_indptr, kv_indptr, kv_indices,
                 custom_mask) description every backend takes; graph shapes and buffers.
- ``registry``   backend registry, capabilities and ``auto`` resolution.
- ``torch_backend``  pure-torch reference backend (CPU and CUDA): the ground truth.
- ``triton_backend``, ``flashinfer_backend``  the CUDA backends (Triton also runs on CPU
                 through its interpreter).
- ``ops``, ``triton_ops``  KernelOps: tree structure, greedy walk, verify mask, row-slot
                 gathers and writes, KV moves (torch and Triton).
- ``emulated_graph``  a CPU stand-in for CUDA graph capture and replay.
"""

from specd.kernels.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    build_metadata_from_slots,
)
from specd.kernels.registry import (
    AttentionBackend,
    BackendCapabilities,
    available_backends,
    get_backend,
    resolve_backend_name,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BackendCapabilities",
    "available_backends",
    "build_attention_metadata",
    "build_metadata_from_slots",
    "get_backend",
    "resolve_backend_name",
]
