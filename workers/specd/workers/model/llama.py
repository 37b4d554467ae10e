"""Llama-family decoder (Llama 2/3, Mistral without sliding window, Qwen2, Qwen3,
Qwen3-MoE, Mixtral) over paged KV.

Input is a flattened ragged batch: ``N`` tokens from any number of requests, no
padding.  Which tokens belong to which request, where their K/V are written and which
slots each query reads all come from the ``ForwardContext`` (see ``specd.kernels.metadata``).

Module and parameter names are exactly those of ``transformers`` so a checkpoint's
state dict loads 1:1 (``model.layers.{i}.self_attn.q_proj.weight``, ...); the loaders
then fuse q/k/v and gate/up for serving (``inference_layout.py``), and on CUDA point
RMSNorm, SiLU-and-mul and RoPE at one-launch Triton kernels (``fused`` attributes).
The families differ in two places: Qwen3's per-head RMSNorm on q and k before RoPE
(``q_norm``/``k_norm``), and a sparse mixture of experts in place of the MLP in some
layers (``moe_block.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.model.config import ModelConfig
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.moe_block import SparseMoeBlock, feed_forward_name
from specd.workers.model.parallel import (
    SINGLE_RANK,
    TpGroup,
    TpShape,
    VocabParallelEmbedding,
    gather_logits,
)
from specd.workers.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalise in float32, round, then scale.

    ``torch.nn.RMSNorm`` scales before rounding, which differs by one ulp in bf16.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused: Callable | None = None  # (x, weight, eps) -> out, one launch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> same shape (the fused kernel sees rows [-1, hidden])."""
        if self.fused is not None:
            return self.fused(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaAttention(nn.Module):
    """Self-attention over paged KV; under tensor parallelism this rank's heads (q/k/v
    column parallel, o_proj row parallel and all-reduced)."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        shape = TpShape.of(config, tp.size)
        self.tp = tp
        self.layer_id = layer_id  # index of this layer's buffers in the KV pool
        self.num_heads = shape.heads
        self.num_kv_heads = shape.kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, q_size, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)
        self.q_norm: RMSNorm | None = None  # over each head, before RoPE (Qwen3)
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qkv_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj: nn.Module | None = None  # q|k|v as one matmul (inference_layout.py)
        self.fused_rotary: Callable | None = None  # apply_rotary in one launch

    def rotated_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, in] -> q [N, heads, hd] and k [N, kv_heads, hd] with RoPE applied (and
        Qwen3's head norms before it), and v [N, kv_heads, hd].  Fused without head
        norms, q and k are adjacent columns of one output and take one rotation (the
        same arithmetic, half the ops)."""
        n, hd = x.shape[0], self.head_dim
        rotate = self.fused_rotary or apply_rotary
        if self.qkv_proj is None:
            q = self.q_proj(x).view(n, self.num_heads, hd)
            k = self.k_proj(x).view(n, self.num_kv_heads, hd)
            v = self.v_proj(x).view(n, self.num_kv_heads, hd)
        else:
            qkv = self.qkv_proj(x)  # [N, q | k | v]
            if self.q_norm is None:
                qk_size = self.qkv_sizes[0] + self.qkv_sizes[1]
                qk = rotate(qkv[:, :qk_size].view(n, -1, hd), cos, sin)
                q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
                return q, k, qkv[:, qk_size:].view(n, self.num_kv_heads, hd)
            q, k, v = (part.view(n, -1, hd) for part in qkv.split(self.qkv_sizes, dim=1))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over the last dim: per head
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """x [N, hidden], cos/sin [N, head_dim] -> [N, hidden]; writes this layer's K/V."""
        q, k, v = self.rotated_qkv(x, cos, sin)
        ctx.kv_pool.store(self.layer_id, ctx.out_cache_loc, k, v)
        k_buffer, v_buffer = ctx.kv_pool.layer(self.layer_id)
        out = ctx.backend.forward(q, k_buffer, v_buffer, ctx.attn_plan, scale=self.scale)
        out = self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))
        return self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    """SiLU-gated MLP; under tensor parallelism this rank's columns (gate/up column
    parallel, down row parallel and all-reduced)."""

    def __init__(self, config: ModelConfig, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        self.tp = tp
        hidden, bias = config.hidden_size, config.mlp_bias
        inter = TpShape.of(config, tp.size).intermediate
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # gate|up as one matmul (inference_layout.py)
        self.fused_silu_and_mul: Callable | None = None  # gate|up [N, 2I] -> [N, I], one launch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        elif self.fused_silu_and_mul is not None:
            return self.tp.all_reduce(self.down_proj(self.fused_silu_and_mul(self.gate_up_proj(x))))
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp)
        # a dense MLP or the experts, under the checkpoint's name (mlp / block_sparse_moe)
        sparse = config.is_sparse_layer(layer_id)
        ffn = SparseMoeBlock(config, tp) if sparse else LlamaMLP(config, tp)
        self.feed_forward_name = feed_forward_name(config, layer_id)
        setattr(self, self.feed_forward_name, ffn)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def feed_forward(self) -> nn.Module:
        return getattr(self, self.feed_forward_name)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """x [N, hidden] residual stream in -> out."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """-> (final-normed hidden [N, hidden], {i: residual stream entering layer i})."""
        x = self.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = self.rotary_emb(positions, x.dtype)  # [N, head_dim] each
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                captured[i] = x
            x = layer(x, cos, sin, ctx)
        if len(self.layers) in capture_layers:
            captured[len(self.layers)] = x
        return self.norm(x), captured


class LlamaForCausalLM(nn.Module):
    """Target model.  ``forward`` returns final-normed hidden states; ``compute_logits``
    turns the rows the caller needs (last prompt token, draft tokens) into logits.

    ``tp``: this rank's group under tensor parallelism (``parallel.py``); the default,
    a group of one, is the whole model on one device."""

    def __init__(self, config: ModelConfig, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        self.config, self.tp = config, tp
        self.model = LlamaModel(config, tp)
        vocab_rows = self.model.embed_tokens.num_embeddings  # this rank's (padded) share
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``model.embed_tokens.weight``."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids [N] int64, positions [N] int64 -> final-normed hidden [N, hidden]."""
        return self.model(input_ids, positions, ctx)[0]

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        capture_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Like ``forward``, also returning intermediate hidden states for draft models.

        Index ``i`` in ``capture_layers`` is the residual stream entering decoder layer
        ``i`` ([N, hidden], before any norm): 0 is the embeddings, ``num_hidden_layers``
        is the last layer's output before the final norm.  This is the indexing of
        transformers' ``output_hidden_states`` (whose last entry is normed, though) and
        of SGLang's EAGLE-3 ``layers_to_capture``.  EAGLE (v1) consumes the
        final-normed hidden, i.e. the first element of the result.
        """
        bad = [i for i in capture_layers if not 0 <= i <= self.config.num_hidden_layers]
        if bad:
            raise ValueError(
                f"capture_layers {bad} out of range [0, {self.config.num_hidden_layers}]"
            )
        return self.model(input_ids, positions, ctx, capture_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] -> logits [M, vocab] float32 (all ranks' columns)."""
        return gather_logits(self.tp, self.lm_head(hidden), self.config.vocab_size)
