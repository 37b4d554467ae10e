"""FP8 (``float8_e4m3fn``) weights: the published scale layouts, and GEMMs over them.

A scale turns an FP8 value back into the real one: ``real = fp8 * scale``, one float32
scale per block of the weight.  Two layouts are published:

- **block-wise** (Qwen, DeepSeek: ``weight_scale_inv``): one scale per ``[bn, bk]`` block
  of the ``[out, in]`` weight, ``[ceil(out/bn), ceil(in/bk)]``; the last row and column
  of blocks may be partial.
- **per channel / per tensor** (compressed-tensors, RedHatAI: ``weight_scale``): one
  scale per output row, or one for the whole tensor.

Writers pick ``scale = amax / 448`` per block (448 is e4m3's largest finite value), so
every block uses the whole FP8 range.

This module is torch only: the loader dequantizes FP8 checkpoints with it on CPU
installs, which may lack Triton.  The CUDA kernels live in ``specd.kernels.triton_fp8``,
imported where a GEMM first runs on an FP8 GPU; the format both read (dtype, range,
supported blocks) in ``specd.kernels.fp8_format``, re-exported here.

On CUDA (capability 8.9+: Ada, Hopper, with Triton) a linear layer reads the FP8 weight
as it is, half the bytes of bf16, which is what decode's speed is made of.  Its
activation is quantized at run time, per token and per K-group (``per_token_group_quant``:
dynamic, no calibration), and the GEMM multiplies FP8 by FP8 with float32 accumulation:

- ``fp8_block_linear``: the Triton block GEMM (``triton_fp8.fp8_block_gemm``: one FP8
  dot per scale block of K, split-K at few rows).
- ``fp8_channel_linear``: the same kernel with one ``[1, K]`` block per output row up to
  16 rows, ``torch._scaled_mm`` with row-wise scales above (see ``_use_scaled_mm``).

Measured on an H200 (CUDA graphs, weights not in L2; us per GEMM at 1 row, bf16 ->
block FP8): 4096x4096 13.0 -> 12.0, 6144x4096 15.6 -> 14.2, 28672x4096 55.1 -> 36.7,
4096x14336 31.5 -> 22.7; an 8B layer's four GEMMs 115 -> 86 us, against a weight-read
floor of 45 us in FP8 (4.8 TB/s).  The small ones are launch-bound (quantize, GEMM,
split sum).  At 512 rows the block kernel is about twice bf16's time (56 vs 27 us at
4096x4096, where ``_scaled_mm`` takes 20): prefill of block checkpoints is its weak side.

Elsewhere the model never calls them: the loader dequantizes the weights once and the
model runs in its dtype.  Called on CPU anyway, they compute the same math in torch
(``fp8_linear_reference``: slow, exact, for tests and tools); on a CUDA device without
FP8 or without Triton they raise ``Fp8UnsupportedError``.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F

from specd.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_AMAX, block_grid
from specd.kernels.fp8_format import SUPPORTED_BLOCKS_TEXT as SUPPORTED_BLOCKS_TEXT
from specd.kernels.fp8_format import supported_block as supported_block

MIN_FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer
_TRITON_MAX_ROWS = 16  # the channel linear's Triton path up to here, _scaled_mm above


class Fp8UnsupportedError(RuntimeError):
    """An FP8 GEMM was asked of a device without FP8 tensor cores (or without Triton)."""


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= MIN_FP8_CAPABILITY
    )


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_kernels() -> ModuleType:
    """``specd.kernels.triton_fp8``, imported on the first GEMM that runs on CUDA (it
    imports Triton, which CPU installs may lack)."""
    from specd.kernels import triton_fp8

    return triton_fp8


def fp8_gemm_available(device: torch.device | str) -> bool:
    """Whether ``device`` runs the FP8 GEMMs: FP8 tensor cores (CUDA capability 8.9+)
    and Triton installed (``pip install 'specd[gpu]'``).  Where not, the loader
    dequantizes FP8 checkpoints to the model dtype."""
    device = torch.device(device)
    return _has_fp8_tensor_cores(device) and _triton_installed()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] -> [row blocks, bn, col blocks, bk], zero-padded to whole blocks."""
    row_blocks, col_blocks = block_grid(x, block)
    pad_rows, pad_cols = row_blocks * block[0] - x.shape[0], col_blocks * block[1] - x.shape[1]
    if pad_rows or pad_cols:
        x = F.pad(x, (0, pad_cols, 0, pad_rows))
    return x.reshape(row_blocks, block[0], col_blocks, block[1])


def _from_blocks(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of ``_as_blocks``: drop the padding -> ``shape``, contiguous."""
    row_blocks, bn, col_blocks, bk = blocks.shape
    whole = blocks.reshape(row_blocks * bn, col_blocks * bk)
    return whole[: shape[0], : shape[1]].contiguous()


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    """Round to e4m3; values were scaled into [-448, 448], the clamp only catches a last
    float32 ulp over the top (a plain cast would make it NaN)."""
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=MIN_AMAX) / FP8_MAX


def quantize_block(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (FP8 [out, in], ``scale_inv`` [ceil(out/bn), ceil(in/bk)] float32):
    each block scaled by ``amax / 448`` (the writers' side; ``dequantize_block`` inverts)."""
    blocks = _as_blocks(weight.float(), block)  # [R, bn, C, bk]
    scale = _scale_of(blocks.abs().amax(dim=(1, 3)))  # [R, C]
    quantized = _to_fp8(blocks / scale[:, None, :, None])
    return _from_blocks(quantized, weight.shape), scale


def dequantize_block(
    weight_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """weight_fp8 [out, in] and its ``scale_inv`` [ceil(out/bn), ceil(in/bk)] -> the
    weight [out, in] in ``dtype``: each value times its block's scale, in float32."""
    expected = block_grid(weight_fp8, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv has shape {list(scale_inv.shape)}; a {list(weight_fp8.shape)} weight "
            f"in {list(block)} blocks needs {list(expected)}"
        )
    compute = _compute_dtype(dtype)
    blocks = _as_blocks(weight_fp8.to(compute), block)
    scaled = blocks * scale_inv.to(compute)[:, None, :, None]
    return _from_blocks(scaled, weight_fp8.shape).to(dtype)


def quantize_channel(weight: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (FP8 [out, in], ``weight_scale`` float32): ``[out, 1]`` (one per
    output row) or, ``per_tensor``, ``[1]`` (compressed-tensors' shapes)."""
    w = weight.float()
    if per_tensor:
        scale = _scale_of(w.abs().amax()).reshape(1)
        return _to_fp8(w / scale), scale
    scale = _scale_of(w.abs().amax(dim=1, keepdim=True))  # [out, 1]
    return _to_fp8(w / scale), scale


def dequantize_channel(
    weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """weight_fp8 [out, in] and its ``weight_scale`` (``[out, 1]``, ``[out]``, ``[1]`` or a
    scalar) -> the weight [out, in] in ``dtype``."""
    out = weight_fp8.shape[0]
    compute = _compute_dtype(dtype)
    flat = scale.to(compute).reshape(-1)
    if flat.numel() == 1:
        per_row = flat.expand(out)
    elif tuple(scale.shape) in ((out,), (out, 1)):
        per_row = flat
    else:
        raise ValueError(
            f"weight_scale has shape {list(scale.shape)}; a {list(weight_fp8.shape)} weight "
            f"needs [{out}, 1], [{out}] (per channel), or [1] / [] (per tensor)"
        )
    return (weight_fp8.to(compute) * per_row[:, None]).to(dtype)


def per_token_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [M, K] -> (FP8 [M, K], scales [M, ceil(K/group)]
    float32), each row's run of ``group`` columns scaled by its ``amax / 448`` (the last
    run may be shorter; ``group = K``: one scale per token).  Same bits on CUDA (Triton)
    and elsewhere (torch): both divide with IEEE rounding."""
    if x.dim() != 2:
        raise ValueError(f"expected x [M, K], got shape {list(x.shape)}")
    if x.is_cuda:
        return _triton_kernels().group_quant_triton(x, group)
    return quantize_block(x, (1, group))  # a row's K-groups are its 1 x group blocks


def fp8_linear_reference(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the FP8 GEMMs compute, in torch: x quantized as they quantize it, both sides
    dequantized, multiplied in float32 -> [M, N] in x's dtype.  A channel weight is the
    block layout with ``block = (1, K)`` and ``scale_inv = scale [N, 1]``."""
    x_fp8, x_scales = per_token_group_quant(x, block[1])
    x_real = dequantize_block(x_fp8, x_scales, (1, block[1]), torch.float32)
    w_real = dequantize_block(weight_fp8, scale_inv, block, torch.float32)
    out = F.linear(x_real, w_real, None if bias is None else bias.float())
    return out.to(x.dtype)


def _runs_on_fp8_gpu(x: torch.Tensor) -> bool:
    """True on an FP8 CUDA device, False on CPU (the torch reference path); raise on a GPU
    without FP8 or without Triton."""
    if x.device.type != "cuda":
        return False
    if not _has_fp8_tensor_cores(x.device):
        major, minor = torch.cuda.get_device_capability(x.device)
        raise Fp8UnsupportedError(
            f"FP8 GEMMs need CUDA compute capability {MIN_FP8_CAPABILITY[0]}."
            f"{MIN_FP8_CAPABILITY[1]}+ (Ada, Hopper); {x.device} is {major}.{minor}: load "
            f"FP8 checkpoints dequantized to the model dtype on this device"
        )
    if not _triton_installed():
        raise Fp8UnsupportedError(
            "FP8 GEMMs on CUDA need Triton: pip install 'specd[gpu]', or load FP8 "
            "checkpoints dequantized to the model dtype"
        )
    return True


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def fp8_block_linear(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` over a block-scaled FP8 weight: x [..., K] (bf16, fp16 or float32),
    weight_fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] -> [..., N] in x's dtype.
    CUDA: x quantized per token per ``bk`` group, then the Triton block GEMM.  CPU: the
    same math in torch (``fp8_linear_reference``)."""
    rows = _flat_rows(x)
    if _runs_on_fp8_gpu(x):
        x_fp8, x_scales = per_token_group_quant(rows, block[1])
        out = _triton_kernels().fp8_block_gemm(
            x_fp8, x_scales, weight_fp8, scale_inv, block, bias, x.dtype
        )
    else:
        out = fp8_linear_reference(rows, weight_fp8, scale_inv, block, bias)
    return out.reshape(*x.shape[:-1], weight_fp8.shape[0])


def _use_scaled_mm(rows: torch.Tensor, weight_fp8: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Where ``torch._scaled_mm``'s row-wise scaling runs, and runs faster: more than 16
    rows (below, the split-K Triton kernel reads the weight faster: on an H200, 12.9 vs
    17.2 us for a 4096 x 4096 weight at one row, 28.6 vs 51.4 us for 4096 x 14336; above,
    _scaled_mm wins, 19.5 vs 49.1 us at 512 rows); a bf16 output (its only row-wise output
    type); K and N multiples of 16; the weight K-contiguous (its transpose is then the
    column-major operand it wants); Hopper or newer (where the GPU tests ran it; Ada runs
    the Triton kernel)."""
    n, k = weight_fp8.shape
    return (
        rows.shape[0] > _TRITON_MAX_ROWS
        and rows.dtype == torch.bfloat16
        and k % 16 == 0
        and n % 16 == 0
        and weight_fp8.stride() == (k, 1)
        and (bias is None or bias.dtype == torch.bfloat16)
        and torch.cuda.get_device_capability(rows.device) >= (9, 0)
    )


def fp8_channel_linear(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` over an FP8 weight with one scale per output row: x [..., K],
    weight_fp8 [N, K], scale [N] float32 -> [..., N] in x's dtype; x is quantized per
    token.  CUDA: ``torch._scaled_mm`` (row-wise scales) where ``_use_scaled_mm``, else
    the block kernel with ``block = (1, K)``.  CPU: the same math in torch."""
    rows = _flat_rows(x)
    n, k = weight_fp8.shape
    scale_rows = scale.float().reshape(n, 1)  # the block layout with block (1, K)
    if not _runs_on_fp8_gpu(x):
        out = fp8_linear_reference(rows, weight_fp8, scale_rows, (1, k), bias)
    elif _use_scaled_mm(rows, weight_fp8, bias):
        x_fp8, x_scales = per_token_group_quant(rows, k)  # [M, K], [M, 1]
        out = torch._scaled_mm(
            x_fp8, weight_fp8.t(), scale_a=x_scales, scale_b=scale_rows.reshape(1, n),
            bias=bias, out_dtype=x.dtype,
        )  # fmt: skip
    else:
        x_fp8, x_scales = per_token_group_quant(rows, k)
        gemm = _triton_kernels().fp8_block_gemm
        out = gemm(x_fp8, x_scales, weight_fp8, scale_rows, (1, k), bias, x.dtype)
    return out.reshape(*x.shape[:-1], n)
