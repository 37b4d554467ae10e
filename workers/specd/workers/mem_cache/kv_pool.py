"""Per-layer K/V buffers indexed by token-pool slot.

Slot ``s`` of layer ``l`` holds the key/value of whichever request position
``req_to_token`` maps to ``s``.  Pages are ``page_size`` consecutive slots; the
allocator hands out pages, this class only stores tensors.  One more slot than the
allocator knows, ``pad_slot``, takes the K/V of the pad rows of graph batches.

Every layer's K and V live in one tensor ``[2, num_layers, num_slots + 1, kv_heads,
head_dim]`` (K = 0, V = 1); the per-layer buffers the attention backends read are
views of it, and ``planes`` views it as ``[2 * num_layers, num_slots + 1, kv_heads *
head_dim]`` so one KV move (``KernelOps.move_kv``) covers every layer at once.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_slots = num_slots
        self.pad_slot = num_slots  # one slot past the allocator's: pad rows of graph batches
        self.buffer = torch.zeros(
            (2, num_layers, num_slots + 1, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.k_buffers = list(self.buffer[0].unbind(0))  # [num_slots, kv_heads, head_dim] each
        self.v_buffers = list(self.buffer[1].unbind(0))
        self.planes = self.buffer.view(2 * num_layers, num_slots + 1, num_kv_heads * head_dim)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` [num_tokens, kv_heads, head_dim] into slots ``loc`` [num_tokens]."""
        self.k_buffers[layer][loc] = k.to(self.buffer.dtype)
        self.v_buffers[layer][loc] = v.to(self.buffer.dtype)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K/V at ``slots``, copied to the host: ``[2 * num_layers,
        len(slots), kv_heads * head_dim]`` (a session moving to another replica)."""
        return self.planes[:, slots].cpu()

    def write(self, slots: torch.Tensor, planes: torch.Tensor) -> None:
        """Put what `read` returned (on another replica) into ``slots``."""
        self.planes[:, slots] = planes.to(self.planes.device, self.planes.dtype)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer], self.v_buffers[layer]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        )
