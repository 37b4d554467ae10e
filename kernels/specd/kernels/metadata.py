"""Ragged attention metadata, in the layout flashinfer's paged prefill takes.

For a batch of ``bs`` requests, request ``i`` contributes ``qo_len[i]`` query tokens
(flattened in batch order) that attend to ``kv_len[i]`` KV positions whose token-pool
slots are ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` (position order).  The new tokens'
K/V are written to the pool before attention, so ``kv_len`` includes them.

Without ``custom_mask`` attention is causal with the queries at the end of the KV:
query ``j`` of request ``i`` sits at position ``kv_len[i] - qo_len[i] + j``.
With ``custom_mask`` (bool, flattened per request as ``[qo_len[i], kv_len[i]]``
row-major, concatenated) the mask is taken as given: this is how tree verify works.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specd.kernels.ops import exclusive_cumsum, host_tensor


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [bs + 1] int64, on device
    kv_indptr: torch.Tensor  # [bs + 1] int64, on device
    kv_indices: torch.Tensor  # [sum(kv_len)] int64 token-pool slots, on device
    qo_lens: tuple[int, ...]  # host copies, used for padding and planning
    kv_lens: tuple[int, ...]
    custom_mask: torch.Tensor | None = None  # [sum(qo_len[i] * kv_len[i])] bool

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)


def metadata_from_indices(
    kv_indices: torch.Tensor,
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    custom_mask: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Metadata around ``kv_indices`` already gathered on the device (host lengths)."""
    for q, k in zip(qo_lens, kv_lens, strict=True):
        if q > k:
            raise ValueError(f"query length {q} exceeds kv length {k}")
    indptrs = host_tensor(exclusive_cumsum(qo_lens) + exclusive_cumsum(kv_lens), kv_indices.device)
    return AttentionMetadata(
        qo_indptr=indptrs[: len(qo_lens) + 1],
        kv_indptr=indptrs[len(qo_lens) + 1 :],
        kv_indices=kv_indices,
        qo_lens=tuple(qo_lens),
        kv_lens=tuple(kv_lens),
        custom_mask=custom_mask,
    )


def build_attention_metadata(
    req_to_token: torch.Tensor,
    rows: Sequence[int],
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    custom_mask: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Metadata for requests in host ``rows`` reading positions ``[0, kv_len)`` of their
    row through ``req_to_token`` ([num_rows, width]): one copy of the row prefixes, sliced
    with host lengths (no device read)."""
    if not len(rows) == len(qo_lens) == len(kv_lens):
        raise ValueError("rows, qo_lens and kv_lens must have one entry per request")
    prefixes = [req_to_token[r, :n] for r, n in zip(rows, kv_lens, strict=True)]
    kv_indices = torch.cat(prefixes).long() if prefixes else req_to_token.new_empty(0).long()
    return metadata_from_indices(kv_indices, qo_lens, kv_lens, custom_mask)


def build_metadata_from_slots(
    slot_lists: list[torch.Tensor],
    qo_lens: list[int],
    custom_mask: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Metadata from explicit KV slot lists (one [kv_len] tensor per query group).

    For reads that are not a row prefix, e.g. a draft-tree node reading the prefix, its
    ancestors and itself: one group per node with ``qo_len`` 1 is causal decode."""
    if not slot_lists:
        raise ValueError("build_metadata_from_slots needs at least one slot list")
    kv_lens = [int(s.numel()) for s in slot_lists]
    return metadata_from_indices(
        torch.cat(slot_lists).to(torch.int64), qo_lens, kv_lens, custom_mask
    )


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What a CUDA-graph batch of one model looks like, fixed when it is captured: exactly
    ``batch_size`` requests of ``qo_len`` queries each (1: decode, T: verify), each reading
    at most ``max_kv_len`` KV slots, with or without a custom mask; and the model's heads
    (flashinfer plans with them before the first layer runs)."""

    batch_size: int
    qo_len: int
    max_kv_len: int
    custom_mask: bool
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def pad_metadata(meta: AttentionMetadata, shape: GraphShape, pad_slot: int) -> AttentionMetadata:
    """``meta`` (every request with ``shape.qo_len`` queries) grown to ``shape.batch_size``
    requests: each pad request reads ``qo_len`` copies of ``pad_slot`` (a slot no request
    owns, where the pad queries' own K/V go), fully visible; its output is never read."""
    pad = shape.batch_size - meta.batch_size
    q = shape.qo_len
    if pad < 0 or any(n != q for n in meta.qo_lens):
        raise ValueError(
            f"a graph batch of {shape.batch_size} x {q} queries cannot hold "
            f"{meta.batch_size} requests of {sorted(set(meta.qo_lens))} queries"
        )
    if any(n > shape.max_kv_len for n in meta.kv_lens):
        raise ValueError(f"a request reads {max(meta.kv_lens)} > {shape.max_kv_len} KV slots")
    device = meta.kv_indices.device
    indices = torch.cat([meta.kv_indices, torch.full((pad * q,), pad_slot, device=device)])
    mask = meta.custom_mask
    if mask is not None:
        mask = torch.cat([mask, torch.ones(pad * q * q, dtype=torch.bool, device=device)])
    return metadata_from_indices(indices, [q] * shape.batch_size, meta.kv_lens + (q,) * pad, mask)


class GraphBuffers:
    """The large static buffers of an engine's graph plans (KV indices, masks), shared by
    all of them: graphs replay one at a time, and each replay's metadata is written right
    before it in stream order, so one storage per buffer, sized for the largest need,
    serves every plan through prefix views.

    needs: one ``backend.graph_buffer_needs(shape)`` per shape the engine captures.
    """

    def __init__(self, needs: Iterable[dict[str, tuple[int, torch.dtype]]], device):
        largest: dict[str, tuple[int, torch.dtype]] = {}
        for need in needs:
            for name, (numel, dtype) in need.items():
                largest[name] = (max(numel, largest.get(name, (0, dtype))[0]), dtype)
        self._store = {
            name: torch.zeros(numel, dtype=dtype, device=device)
            for name, (numel, dtype) in largest.items()
        }

    def view(self, name: str, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the shared buffer ``name``."""
        return self._store[name][:numel]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._store.values())
