"""FP8 linear layers, for CUDA devices with FP8 GEMMs (capability 8.9+: Ada, Hopper).

At decode the linears are weight reads: an FP8 weight is one byte per value, so a step
of an 8B model reads about half the bytes of bf16.  An ``Fp8Linear`` keeps the
checkpoint's FP8 weight and scale as loaded (``quantization.canonical_scale``) and runs
one FP8 GEMM per call (``specd.kernels.fp8``).  Its activations are quantized per token
at run time (dynamic): a compressed-tensors checkpoint's static ``input_scale`` is not
used, which needs no calibration and is at least as exact.

Two layouts, named as in the checkpoint so the state dict loads 1:1:

- block: ``weight_scale_inv [ceil(out/b0), ceil(in/b1)]`` (``fp8_block_linear``);
- channel: ``weight_scale [out]`` (``fp8_channel_linear``); per-tensor checkpoints
  arrive broadcast to one scale per row, which is exact.

MoE experts are not swapped: on CUDA they are dequantized to the activation dtype at
load for now (the fused MoE kernels take bf16 expert weights), so only the dense
linears (attention, dense MLPs) run in FP8.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specd.kernels import fp8
from specd.kernels.fp8 import FP8_DTYPE


class Fp8Linear(nn.Module):
    """Inference-only ``nn.Linear`` over an FP8 weight ``[out, in]`` and its float32 scale
    (block: ``weight_scale_inv``; channel: ``weight_scale``); the bias, if any, stays in
    the activation dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        block: tuple[int, int] | None,
        bias: bool,
        device: str | torch.device | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        # the GEMMs import Triton on their first call
        self._gemm = fp8.fp8_channel_linear if block is None else fp8.fp8_block_linear
        weight = torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        if block is None:
            self.register_buffer("weight_scale", torch.empty(out_features, device=device))
        else:
            rows, cols = math.ceil(out_features / block[0]), math.ceil(in_features / block[1])
            self.register_buffer("weight_scale_inv", torch.empty(rows, cols, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def on_meta_like(cls, linear: nn.Linear, block: tuple[int, int] | None) -> Fp8Linear:
        """An empty stand-in for ``linear`` (built on meta, filled by ``load_state_dict``)."""
        return cls(linear.in_features, linear.out_features, block, linear.bias is not None, "meta")

    @property
    def scale(self) -> torch.Tensor:
        return self.weight_scale if self.block is None else self.weight_scale_inv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] in the activation dtype -> [N, out] in that dtype."""
        if self.block is None:
            return self._gemm(x, self.weight, self.weight_scale, self.bias)
        return self._gemm(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def extra_repr(self) -> str:
        layout = "channel" if self.block is None else f"block={list(self.block)}"
        return f"{self.in_features}, {self.out_features}, fp8 {layout}"


def use_fp8_linears(
    model: nn.Module,
    modules: list[str],
    block: tuple[int, int] | None,
    device: str | torch.device,
) -> list[str]:
    """Where ``device`` runs FP8 GEMMs (CUDA capability 8.9+), replace each of
    ``modules`` (dotted names of ``nn.Linear`` in ``model``, built on meta) by an empty
    ``Fp8Linear``, except MoE experts and anything that is not an ``nn.Linear``; returns
    the names replaced.  The loader dequantizes the rest."""
    if not fp8.fp8_gemm_available(device):
        return []
    replaced = []
    for name in modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child, None)
        if ".experts." in name or not isinstance(linear, nn.Linear):
            continue
        setattr(parent, child, Fp8Linear.on_meta_like(linear, block))
        replaced.append(name)
    return replaced


def stack_fp8_linears(linears: list[Fp8Linear]) -> Fp8Linear | None:
    """One ``Fp8Linear`` whose output is the outputs of ``linears`` side by side (q|k|v,
    gate|up), or None when stacking would not be exact (keep them apart then), or some
    are not ``Fp8Linear`` (a module the checkpoint left unquantized).

    Channel scales stack row by row.  Block scales stack as rows of blocks, which is
    exact only where every part but the last ends on a block row: a part of 1000 rows in
    128-row blocks would leave its last block row shared with the next part's first
    rows, which have another scale.
    """
    first = linears[0]
    if not all(isinstance(lin, Fp8Linear) for lin in linears) or any(
        lin.in_features != first.in_features
        or lin.block != first.block
        or (lin.bias is None) != (first.bias is None)
        for lin in linears
    ):
        return None
    if first.block is not None and any(lin.out_features % first.block[0] for lin in linears[:-1]):
        return None
    # as bytes: concatenation is a copy, and not every build's cat takes float8
    weight = torch.cat([lin.weight.view(torch.uint8) for lin in linears]).view(FP8_DTYPE)
    stacked = Fp8Linear(
        first.in_features, weight.shape[0], first.block, first.bias is not None, "meta"
    )
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    scale = torch.cat([lin.scale for lin in linears])
    if first.block is None:
        stacked.weight_scale = scale
    else:
        stacked.weight_scale_inv = scale
    if first.bias is not None:
        bias = torch.cat([lin.bias for lin in linears])
        stacked.bias = nn.Parameter(bias, requires_grad=False)
    return stacked
