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

The modules load with the checkpoint's names first (so loading and its error messages
stay 1:1 with ``transformers``); fusion runs after, one layer at a time, so the extra
memory is one layer's projections.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from specd.workers.model.cpu_linear import relayout_linears
from specd.workers.model.llama import LlamaAttention, LlamaMLP, RMSNorm


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


def fuse_projections(model: nn.Module) -> int:
    """Replace every attention's q/k/v and every MLP's gate/up by one stacked linear each
    (the forward passes split the output); returns how many groups were fused."""
    fused = 0
    for module in list(model.modules()):
        if isinstance(module, LlamaAttention) and module.qkv_proj is None:
            module.qkv_proj = stack_linears([module.q_proj, module.k_proj, module.v_proj])
            del module.q_proj, module.k_proj, module.v_proj
            fused += 1
        elif isinstance(module, LlamaMLP) and module.gate_up_proj is None:
            module.gate_up_proj = stack_linears([module.gate_proj, module.up_proj])
            del module.gate_proj, module.up_proj
            fused += 1
    return fused


def use_fused_elementwise(model: nn.Module) -> int:
    """Point every RMSNorm, fused SiLU-and-mul and RoPE of ``model`` at its Triton kernel;
    returns how many modules now launch one.  Works wherever Triton runs (CUDA, or the
    interpreter on CPU in tests)."""
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


def to_inference_layout(model: nn.Module, fused_elementwise: bool = True) -> None:
    """Fuse the projections; then on CPU lay out linear weights for speed, and on CUDA
    (with Triton installed, unless ``fused_elementwise`` is False) fuse the elementwise
    steps.

    On CUDA the unfused weights' memory goes back to the device: the caching allocator
    would keep it, and the KV pool is sized from the device's free memory.
    """
    on_cuda = any(p.is_cuda for p in model.parameters())
    if fuse_projections(model) and on_cuda:
        torch.cuda.empty_cache()
    if fused_elementwise and on_cuda and importlib.util.find_spec("triton") is not None:
        use_fused_elementwise(model)
    relayout_linears(model)
