"""Rotary position embeddings for Llama-family models, from arbitrary integer positions.

Numerics follow ``transformers`` exactly: inverse frequencies in float32, angles as
``position * inv_freq`` in float32, ``cos``/``sin`` of ``cat(freqs, freqs)`` cast to the
activation dtype, applied in the "rotate_half" convention (the first and second halves
of each head are the two coordinates of each rotated pair).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specd.workers.model.config import RopeConfig


def compute_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: keep short wavelengths, divide long ones by ``factor``, blend between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Maps positions to ``(cos, sin)``; holds no parameters or buffers.

    The inverse frequencies are a plain attribute rather than a buffer so that
    ``model.to(bfloat16)`` cannot round them and building the model on the meta device
    (as the loader does) leaves them intact.
    """

    def __init__(self, head_dim: int, rope: RopeConfig):
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq = compute_inv_freq(head_dim, rope)  # [head_dim // 2] float32

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int -> (cos, sin), each [N, head_dim] in ``dtype``."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [N, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D], cos/sin [N, D] -> rotated x [N, heads, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
