"""Per-layer K/V buffers indexed by token-pool slot.

Slot ``s`` of layer ``l`` holds the key/value of whichever request position
``req_to_token`` maps to ``s``.  Pages are ``page_size`` consecutive slots; the
allocator hands out pages, this class only stores tensors.
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
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` [num_tokens, kv_heads, head_dim] into slots ``loc`` [num_tokens]."""
        self.k_buffers[layer][loc] = k.to(self.k_buffers[layer].dtype)
        self.v_buffers[layer][loc] = v.to(self.v_buffers[layer].dtype)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer], self.v_buffers[layer]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots ``src`` to slots ``dst`` (same length)."""
        for k, v in zip(self.k_buffers, self.v_buffers, strict=True):
            k[dst] = k[src]
            v[dst] = v[src]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        )
