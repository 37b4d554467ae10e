"""The sparse mixture-of-experts feed-forward of Qwen3-MoE and Mixtral decoder layers.

Each token's router logits pick ``top_k`` experts (``specd.kernels.moe.route_topk``);
the experts' SiLU-gated MLP outputs are summed, weighted by the router.  Modules carry
the published tensor names, so a checkpoint loads 1:1:

    Qwen3-MoE  model.layers.{i}.mlp.gate.weight                         [E, H]
               model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
    Mixtral    model.layers.{i}.block_sparse_moe.gate.weight            [E, H]
               model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight
               (w1 = gate, w3 = up, w2 = down)

After loading, ``stack_experts`` (called by ``inference_layout``) replaces the per-expert
linears by two stacked weights, as serving engines hold them: ``w13 [E, 2I, H]`` (gate
rows, then up rows) and ``w2 [E, H, I]``.  Unstacked (``inference_layout=False``), each
forward stacks them on the fly, so both layouts run the same expert code
(``moe_torch`` on CPU; on CUDA ``fused`` points at the Triton grouped GEMM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specd.kernels.moe import moe_torch, route_topk
from specd.workers.model.config import ModelConfig
from specd.workers.model.parallel import SINGLE_RANK, TpGroup, TpShape

# (x [N, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [N, k], topk_ids [N, k]) -> [N, H]
ExpertsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


@dataclass(frozen=True, slots=True)
class MoeFamily:
    """What differs between the MoE families: names, and the routing weights' dtype."""

    block: str  # the decoder layer's attribute holding the block
    gate: str  # an expert's projections, as the checkpoint names them
    up: str
    down: str
    # Qwen3-MoE rounds the top-k weights to the activations' dtype before scaling an
    # expert's output; Mixtral scales in float32 (transformers does each)
    weights_in_model_dtype: bool


MOE_FAMILIES = {
    "Qwen3MoeForCausalLM": MoeFamily("mlp", "gate_proj", "up_proj", "down_proj", True),
    "MixtralForCausalLM": MoeFamily("block_sparse_moe", "w1", "w3", "w2", False),
}


def feed_forward_name(config: ModelConfig, layer: int) -> str:
    """The decoder layer's attribute for layer ``layer``'s feed-forward: ``mlp`` for a
    dense MLP and Qwen3-MoE's experts, ``block_sparse_moe`` for Mixtral's."""
    if not config.is_sparse_layer(layer):
        return "mlp"
    return MOE_FAMILIES[config.architecture].block


class TopKRouter(nn.Module):
    """The router: ``weight [E, H]``, no bias.  Not an ``nn.Linear``, so the CPU linear
    re-layout (``cpu_linear``) and FP8 leave it as published: its logits choose the
    experts, and rounding them otherwise could flip a near tie."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> router logits [N, E] in x's dtype."""
        return F.linear(x, self.weight)


class ExpertMLP(nn.Module):
    """One expert's SiLU-gated MLP; its linears carry the family's checkpoint names."""

    def __init__(self, hidden_size: int, intermediate_size: int, family: MoeFamily):
        super().__init__()
        self.family = family
        setattr(self, family.gate, nn.Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, family.up, nn.Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, family.down, nn.Linear(intermediate_size, hidden_size, bias=False))

    def gate_up_down(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        family = self.family
        return getattr(self, family.gate), getattr(self, family.up), getattr(self, family.down)


class SparseMoeBlock(nn.Module):
    """Router + ``num_experts`` experts over a flat batch ``[N, H]`` of any ``N``: prefill
    chunks, decode batches and speculative verify batches go through the same path.
    Under tensor parallelism every rank holds every expert's share of columns (gate/up
    column parallel, down row parallel) and the block's output is all-reduced; the
    router is replicated."""

    def __init__(self, config: ModelConfig, tp: TpGroup = SINGLE_RANK):
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.architecture} has no experts")
        self.tp = tp
        width = TpShape.of(config, tp.size).moe_intermediate
        self.family = MOE_FAMILIES[config.architecture]
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = TopKRouter(config.hidden_size, moe.num_experts)
        self.experts: nn.ModuleList | None = nn.ModuleList(
            ExpertMLP(config.hidden_size, width, self.family) for _ in range(moe.num_experts)
        )
        self.w13: nn.Parameter | None = None  # [E, 2I, H] once stacked
        self.w2: nn.Parameter | None = None  # [E, H, I] once stacked
        self.fused: ExpertsFn | None = None  # the Triton grouped GEMM (inference_layout.py)

    @property
    def is_stacked(self) -> bool:
        return self.w13 is not None

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]): the stacked parameters, or stacked now from the
        per-expert linears (the checkpoint layout; a copy per call)."""
        if self.w13 is not None and self.w2 is not None:
            return self.w13, self.w2
        gate, _, down = self.experts[0].gate_up_down()
        inter, hidden = gate.weight.shape
        w13 = gate.weight.new_empty(len(self.experts), 2 * inter, hidden)
        w2 = down.weight.new_empty(len(self.experts), hidden, inter)
        for e, expert in enumerate(self.experts):  # copied in place: one copy in memory
            gate, up, down = expert.gate_up_down()
            w13[e, :inter], w13[e, inter:], w2[e] = gate.weight, up.weight, down.weight
        return w13, w2

    def stack_experts(self) -> None:
        """Hold the experts as ``w13``/``w2`` and drop the per-expert linears."""
        if self.is_stacked:
            return
        with torch.no_grad():
            w13, w2 = self.expert_weights()
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [N, H] in x's dtype."""
        logits = self.gate(x)  # [N, E]
        weights, ids = route_topk(logits, self.top_k, self.renormalize)  # [N, k] each
        if self.family.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        w13, w2 = self.expert_weights()
        return self.tp.all_reduce((self.fused or moe_torch)(x, w13, w2, weights, ids))

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}, stacked={self.is_stacked}"
