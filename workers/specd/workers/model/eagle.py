"""EAGLE (v1, also used by EAGLE-2's dynamic trees) draft head over paged KV.

Structure and tensor names follow the published checkpoints (``yuhuili/EAGLE-*``, read by
SafeAILab/EAGLE ``eagle/model/cnets1.py``, SGLang and vLLM ``llama_eagle.py``)::

    fc.weight [H, 2H], fc.bias [H]          bias unless config.json says "bias": false
    layers.{i}.self_attn.{q,k,v}_proj       [heads*hd | kv*hd, H]; bias with "qkv_bias": true
    layers.{i}.self_attn.o_proj             [H, heads*hd]
    layers.{i}.mlp.{gate,up,down}_proj
    layers.{i}.post_attention_layernorm     [H]
    layers.{i}.input_layernorm              [H], for i >= 1 only: layer 0 has none
    embed_tokens.weight [V, H]              frozen copy of the target's; the target's is used

There is no final norm and no lm_head: the draft hidden goes straight into the target's
``lm_head``.  Which target hidden EAGLE consumes: the target's final-normed output
(``LlamaForCausalLM.forward``), because the reference feeds ``base_model.model(...)[0]``
(transformers' ``last_hidden_state``, after the final norm) to the draft and applies
``base_model.lm_head`` to that same tensor for the target's own logits.

Each draft row pairs a token with the hidden of the position *before* it, and takes that
earlier position (the reference drops the first token, not the last hidden)::

    target tokens   x_0      x_1      ...  x_{L-1}       positions 0 .. L-1
    target hidden   h_0      h_1      ...  h_{L-1}       (final-normed)
    draft rows     (x_1,h_0) (x_2,h_1) ... (x_L,h_{L-1})  positions 0 .. L-1, same KV slots
                    -> d_0 ...           d_{L-1}; lm_head(d_{L-1}) scores x_{L+1}
    next step      (x_{L+1}, d_{L-1}) at position L -> d_L, which scores x_{L+2}

``x_L`` is the bonus token the target just sampled.  The caller builds these rows; this
module only runs them.  The draft's KV lives in its own ``KVPool`` (one buffer per draft
layer, layer ids from 0) addressed by the same slots as the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from specd.workers.model.config import ModelConfig
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.llama import LlamaDecoderLayer
from specd.workers.model.parallel import SINGLE_RANK, TpGroup, gather_logits
from specd.workers.model.rope import RotaryEmbedding
from specd.workers.model.token_map import Logits, restricted_head


class EagleDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer; layer 0 has no ``input_layernorm`` (``fc`` feeds attention)."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TpGroup = SINGLE_RANK):
        super().__init__(config, layer_id, tp)
        if layer_id == 0:
            self.input_layernorm = nn.Identity()


class EagleDraftModel(nn.Module):
    """EAGLE head: ``fc`` over [token embedding, target hidden] + Llama decoder layer(s).

    ``embed_tokens`` and ``lm_head`` are the target's modules.  They are kept outside this
    module's tree, so ``state_dict()`` holds only the draft's own weights and moving or
    pre-packing the draft never copies the target's vocabulary-sized matrices.  Under
    tensor parallelism (``tp``) the decoder layers are sharded as the target's and
    ``fc`` is replicated.
    """

    def __init__(
        self,
        config: ModelConfig,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        fc_bias: bool = True,
        tp: TpGroup = SINGLE_RANK,
    ):
        super().__init__()
        self.config, self.tp = config, tp
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList(
            EagleDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)
        self._shared = (embed_tokens, lm_head)  # a tuple: not registered as submodules
        self.token_head: nn.Linear | None = None  # the lm_head's rows of a token map
        self.token_ids: torch.Tensor | None = None  # [N] the map's target ids, ascending

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """input_ids [N], target_hidden [N, H] (final-normed, or the draft's own output on
        later steps), positions [N] -> draft hidden [N, H]; writes the draft's K/V."""
        embeds = self.embed_tokens(input_ids).to(target_hidden.dtype)  # [N, H]
        x = self.fc(torch.cat((embeds, target_hidden), dim=-1))  # [N, 2H] -> [N, H]
        cos, sin = self.rotary_emb(positions, x.dtype)  # [N, head_dim] each
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return x

    @property
    def maps_vocab(self) -> bool:
        """Whether draft ids are positions in a token map rather than target ids."""
        return self.token_ids is not None

    def restrict_vocab(self, token_ids: torch.Tensor, target_logits: Logits) -> None:
        """Draft only ``token_ids`` [N] (ascending target ids): score them with their rows
        of the target's head (read through ``target_logits``) instead of the whole head."""
        like, head_dtype = self.fc.weight, self.embed_tokens.weight.dtype  # draft's, target's
        self.token_head = restricted_head(
            target_logits, self.fc.out_features, token_ids, head_dtype, like
        )
        self.token_ids = token_ids.to(like.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] -> logits [M, vocab] float32, through the target's lm_head, or
        [M, N] over a token map's ids (``restrict_vocab``).

        No norm first: EAGLE applies the target's head to the layer output directly.
        """
        if self.token_head is not None:
            return self.token_head(hidden).float()
        hidden = hidden.to(self.embed_tokens.weight.dtype)  # the target's head, its dtype
        return gather_logits(self.tp, self.lm_head(hidden), self.config.vocab_size)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids: through the token map, if there is one."""
        return ids if self.token_ids is None else self.token_ids[ids]
