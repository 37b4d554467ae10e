"""Attention over paged KV, tree build/verify helpers and KV moves.

Modules:
- ``metadata``   AttentionMetadata: the ragged (qo_indptr, kv_indptr, kv_indices,
                 custom_mask) description every backend takes; built through req_to_token.
- ``registry``   backend registry, capabilities and ``auto`` resolution.
- ``torch_backend``  pure-torch reference backend (CPU and CUDA): the ground truth.
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
