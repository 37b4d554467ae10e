"""How a loaded model is rearranged for serving.

Checkpoints store q, k and v (and gate and up) as separate matrices; a serving engine
runs each group as one matmul (vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``).
At decode the matmuls are weight reads, and the small ones read far below memory
bandwidth: an 8B Llama's k and v projections are 8 MB each, too little to fill an H100,
so one [6144, 4096] read beats three.  Fusing also cuts a layer's matmuls from 7 to 4 on
every device.  Then, on CPU, each linear weight is stored in the layout timed
fastest for its shape (``cpu_linear``); on CUDA, RMSNorm, SiLU-and-mul and RoPE run as
one Triton launch each (``specd.kernels.triton_elementwise``): in bf16 a layer's 23
eager elementwise kernels (two norms of 8, SiLU-and-mul 2, RoPE 5) become 4.

Mixture-of-experts layers hold their experts stacked (``w13 [E, 2I, H]``, ``w2 [E, H, I]``,
``moe_block.py``), which the grouped expert kernels read; on CUDA they run the Triton
fused MoE (``specd.kernels.triton_moe``) instead of the torch loop over experts.

The modules load with the checkpoint's names first (so loading and its error messages
stay 1:1 with ``transformers``); fusion runs after, one layer at a time, so the extra
memory is one layer's projections (or experts).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from specd.workers.model.cpu_linear import relayout_linears
from specd.workers.model.fp8_linear import Fp8Linear, stack_fp8_linears
from specd.workers.model.llama import LlamaAttention, LlamaMLP, RMSNorm
from specd.workers.model.moe_block import SparseMoeBlock


def stack_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One frozen ``nn.Linear`` whose output is the outputs of ``linears`` side by side."""
    first = linears[0]
    if any(
        lin.in_features != first.in_features or (lin.bias is None) != (first.bias is None)
        for lin in linears
    ):
        raise ValueError("stacked linears need the same input width and all or no biases")
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = first.bias is not None
    stacked = nn.Linear(first.in_features, weight.shape[0], bias=has_bias, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        bias = torch.cat([lin.bias.detach() for lin in linears])
        stacked.bias = nn.Parameter(bias, requires_grad=False)
    return stacked


def stack_projections(linears: list[nn.Module]) -> nn.Module | None:
    """``linears`` as one module: ``stack_linears``, or for FP8 weights
    ``stack_fp8_linears`` (None where their scale blocks would straddle two parts: they
    then stay apart)."""
    if any(isinstance(lin, Fp8Linear) for lin in linears):
        return stack_fp8_linears(linears)
    return stack_linears(linears)


_PROJECTION_GROUPS = (
    (LlamaAttention, "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    (LlamaMLP, "gate_up_proj", ("gate_proj", "up_proj")),
)


def fuse_projections(model: nn.Module) -> int:
    """Replace every attention's q/k/v and every MLP's gate/up by one stacked linear each
    (the forward passes split the output); returns how many groups were fused."""
    fused = 0
    for module in list(model.modules()):
        for kind, stacked_name, part_names in _PROJECTION_GROUPS:
            if not isinstance(module, kind) or getattr(module, stacked_name) is not None:
                continue
            stacked = stack_projections([getattr(module, name) for name in part_names])
            if stacked is None:
                continue
            setattr(module, stacked_name, stacked)
            for name in part_names:
                delattr(module, name)
            fused += 1
    return fused


def stack_experts(model: nn.Module, on_cuda: bool) -> int:
    """Stack every MoE layer's experts into ``w13``/``w2``, one layer at a time, giving
    the per-expert tensors' memory back to the device after each on CUDA (a MoE model
    is mostly experts: two copies of them would not fit); returns how many layers."""
    stacked = 0
    for module in list(model.modules()):
        if isinstance(module, SparseMoeBlock) and not module.is_stacked:
            module.stack_experts()
            stacked += 1
            if on_cuda:
                torch.cuda.empty_cache()
    return stacked


def use_fused_elementwise(model: nn.Module) -> int:
    """Point every RMSNorm (Qwen3's q/k head norms included), fused SiLU-and-mul and RoPE
    of ``model`` at its Triton kernel; returns how many modules now launch one.  Works
    wherever Triton runs (CUDA, or the interpreter on CPU in tests)."""
    from specd.kernels import triton_elementwise as te

    fused = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = te.rms_norm
        elif isinstance(module, LlamaMLP) and module.gate_up_proj is not None:
            module.fused_silu_and_mul = te.silu_and_mul
        elif isinstance(module, LlamaAttention):
            module.fused_rotary = te.rotary
        else:
            continue
        fused += 1
    return fused


def use_fused_moe(model: nn.Module) -> int:
    """Point every MoE layer with stacked experts at the Triton fused MoE, which keeps the
    routing on the device (no host sync, so CUDA graphs can capture it; ``moe_torch``
    reads it on the host); returns how many layers.  Works wherever Triton runs."""
    from specd.kernels.triton_moe import fused_moe  # imported only where Triton runs

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.is_stacked]
    for block in blocks:
        block.fused = fused_moe
    return len(blocks)


def to_inference_layout(model: nn.Module, fused_elementwise: bool = True) -> None:
    """Fuse the projections and stack the experts; then on CPU lay out linear weights
    for speed, and on CUDA with Triton installed run the MoE layers fused and (unless
    ``fused_elementwise`` is False) the elementwise steps.

    On CUDA the unfused weights' memory goes back to the device: the caching allocator
    would keep it, and the KV pool is sized from the device's free memory.
    """
    on_cuda = any(p.is_cuda for p in model.parameters())
    if fuse_projections(model) and on_cuda:
        torch.cuda.empty_cache()
    has_triton = on_cuda and importlib.util.find_spec("triton") is not None
    if stack_experts(model, on_cuda) and has_triton:
        use_fused_moe(model)
    if fused_elementwise and has_triton:
        use_fused_elementwise(model)
    relayout_linears(model)
