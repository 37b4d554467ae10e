"""EAGLE-3 draft head over paged KV.

Structure and tensor names follow the published checkpoints (``yuhuili/EAGLE3-*``, read
by SafeAILab/EAGLE ``eagle/model/cnets.py``, SGLang and vLLM ``llama_eagle3.py``)::

    fc.weight [H, 3H]                                 fuses three target layers, no bias
    midlayer.self_attn.{q,k,v}_proj.weight [.., 2H]   read [input_layernorm(emb), hidden_norm(h)]
    midlayer.self_attn.o_proj.weight [H, heads*hd]
    midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
    norm.weight [H]
    lm_head.weight [draft_vocab, H]                   the draft's own reduced-vocab head
    d2t [draft_vocab] int64                           target_id = draft_id + d2t[draft_id]
    t2d [vocab] bool                                  True on target ids the draft can emit

Checkpoints carry no ``embed_tokens`` (it is frozen and left out when saved): the target's
embedding is used.

Hidden flow, per the reference (``Model.forward`` / ``topK_genrate``)::

    step 0:  h = fc(cat(aux_low, aux_mid, aux_high))           [N, 3H] -> [N, H]
    layer:   r = h + attn(cat(input_layernorm(emb), hidden_norm(h)))
             out = r + mlp(post_attention_layernorm(r))
    next step's hidden = out (pre-norm);   logits = lm_head(norm(out))

Rows pair a token with the hidden of the position before it, exactly as in EAGLE (see
``eagle.py``).  The aux hidden states are the residual streams entering target layers
``DraftConfig.aux_layer_ids`` (``LlamaForCausalLM.forward_with_aux`` indexing).
"""

from __future__ import annotations

import torch
from torch import nn

from specd.workers.model.config import ModelConfig
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.llama import LlamaAttention, LlamaMLP, RMSNorm
from specd.workers.model.parallel import SINGLE_RANK, TpGroup, gather_logits, vocab_shard
from specd.workers.model.rope import RotaryEmbedding

NUM_AUX_LAYERS = 3  # fc takes low, mid and high target layers


class Eagle3Attention(LlamaAttention):
    """``LlamaAttention`` whose q/k/v projections read a 2H-wide input."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TpGroup = SINGLE_RANK):
        super().__init__(config, layer_id, tp)
        width, bias = 2 * config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(width, self.q_proj.out_features, bias=bias)
        self.k_proj = nn.Linear(width, self.k_proj.out_features, bias=bias)
        self.v_proj = nn.Linear(width, self.v_proj.out_features, bias=bias)


class Eagle3MidLayer(nn.Module):
    """The single EAGLE-3 decoder layer: attention over [normed embeds, normed hidden]."""

    def __init__(self, config: ModelConfig, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Eagle3Attention(config, 0, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(hidden, eps)  # on the token embeddings
        self.hidden_norm = RMSNorm(hidden, eps)  # on the incoming hidden
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """embeds, hidden [N, H] -> [N, H]; the residual is the un-normed ``hidden``."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)  # [N, 2H]
        h = hidden + self.self_attn(x, cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(nn.Module):
    """EAGLE-3 head with its own reduced-vocabulary ``lm_head`` and draft->target id map.

    ``embed_tokens`` is the target's module, kept outside this module's tree (not in
    ``state_dict()``, never copied).  Under tensor parallelism (``tp``) the mid layer is
    sharded as the target's layers, ``lm_head`` is vocab parallel over the draft
    vocabulary, and ``fc`` and the vocab maps are replicated.
    """

    def __init__(
        self,
        config: ModelConfig,
        draft_vocab_size: int,
        embed_tokens: nn.Module,
        fc_bias: bool = False,
        tp: TpGroup = SINGLE_RANK,
    ):
        super().__init__()
        self.config, self.tp, self.draft_vocab_size = config, tp, draft_vocab_size
        hidden = config.hidden_size
        self.fc = nn.Linear(NUM_AUX_LAYERS * hidden, hidden, bias=fc_bias)
        self.midlayer = Eagle3MidLayer(config, tp)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, vocab_shard(draft_vocab_size, tp.size), bias=False)
        # Until a checkpoint's map is loaded: draft id i -> target id i.
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)
        self._shared = (embed_tokens,)  # a tuple: not registered as a submodule

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared[0]

    def fuse_aux_hidden(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """[low, mid, high] target hidden states, each [N, H] -> fused [N, H]."""
        fused_in = torch.cat(aux, dim=-1)  # [N, 3H]
        if fused_in.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"EAGLE-3 fc takes {self.fc.in_features} features "
                f"({NUM_AUX_LAYERS} target layers); got {len(aux)} tensors, "
                f"{fused_in.shape[-1]} wide"
            )
        return self.fc(fused_in)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [N], hidden [N, H] (fused aux, or the previous step's first output),
        positions [N] -> (hidden for the next step [N, H], hidden for logits [N, H])."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [N, H]
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # [N, head_dim] each
        out = self.midlayer(embeds, hidden, cos, sin, ctx)  # [N, H]
        return out, self.norm(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] (already normed: forward's second output) -> [M, draft_vocab] float32."""
        return gather_logits(self.tp, self.lm_head(hidden), self.draft_vocab_size)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids (any shape) -> target-vocab ids of the same shape."""
        return ids + self.d2t[ids]
