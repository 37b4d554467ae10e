"""Triton kernels for a decoder layer's elementwise steps, one launch each.

Eager in bf16, a Llama layer's RMSNorm is 8 kernels (upcast, square, mean, add, rsqrt,
scale, downcast, weight), SiLU-and-mul 2 and RoPE 5 (negate, concatenate, two products,
sum): 23 per layer with its two norms, 4 here.  At decode each is a launch over a few
thousand elements, and on a GPU their fixed cost adds up across 32 layers (SGLang and
vLLM fuse them for the same reason).  These kernels keep the eager rounding order of
``transformers`` (compute in float32, round to the activation dtype where the eager code
does), so RoPE and the products round exactly as eager does; RMSNorm's mean and SiLU's
``exp`` may differ in the last float32 bit.  (Triton's CPU interpreter truncates
float32 -> bf16 instead of rounding to nearest, so bf16 is checked on the GPU only.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specd.kernels.triton_launch import launch

# elements of a row one program handles (SiLU-and-mul's intermediate, RoPE's heads x dim)
_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, H]
    weight_ptr,  # [H]
    out_ptr,  # [N, H]
    x_row_stride,
    H,
    eps,
    BLOCK_H: tl.constexpr,
):
    """Program r: out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)).to(dtype)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=ok, other=0.0)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / H
    normed = (h * tl.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * H + cols, out, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H] (rows may be strided), weight [H] of x's dtype -> [N, H] contiguous."""
    n, h = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n:
        block = triton.next_power_of_2(h)
        launch(_rms_norm_kernel, (n,), x, weight, out, x.stride(0), h, eps, BLOCK_H=block)
    return out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [N, 2I]: gate | up
    out_ptr,  # [N, I]
    gate_up_row_stride,
    inter,  # I
    BLOCK: tl.constexpr,
):
    """Program (r, block): out[r] = silu(gate[r]).to(dtype) * up[r], rounded to dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    base = gate_up_ptr + row * gate_up_row_stride
    gate = tl.load(base + cols, mask=ok, other=0.0)
    up = tl.load(base + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * inter + cols, out, mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
    n, width = gate_up.shape
    inter = width // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        grid = (n, triton.cdiv(inter, _BLOCK))
        launch(_silu_and_mul_kernel, grid, gate_up, out, gate_up.stride(0), inter, BLOCK=_BLOCK)
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,  # [N, heads, D], rows and heads strided, D contiguous
    cos_ptr,  # [N, D] contiguous
    sin_ptr,  # [N, D] contiguous
    out_ptr,  # [N, heads, D] contiguous
    x_row_stride,
    x_head_stride,
    heads,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (r, block): the rotate-half RoPE of row r's heads, pairs (i, i + D/2):
    out = round(x * cos) + round(rotate_half(x) * sin), rounded, as eager torch does."""
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # over heads * D/2 pairs
    half: tl.constexpr = D // 2
    head, i = idx // half, idx % half
    ok = head < heads
    src = x_ptr + row * x_row_stride + head * x_head_stride + i
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + half, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + row * D + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * D + half + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * D + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * D + half + i, mask=ok, other=0.0).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    dtype = x1.dtype
    out1 = ((a * c1).to(dtype).to(tl.float32) + (-b * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((b * c2).to(dtype).to(tl.float32) + (a * s2).to(dtype).to(tl.float32)).to(dtype)
    dst = out_ptr + row * heads * D + head * D + i
    tl.store(dst, out1, mask=ok)
    tl.store(dst + half, out2, mask=ok)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] (rows and heads may be strided), cos/sin [N, D] -> rotated x
    [N, heads, D] contiguous."""
    n, heads, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    if n:
        grid = (n, triton.cdiv(heads * d // 2, _BLOCK))
        launch(
            _rotary_kernel, grid, x, cos, sin, out, x.stride(0), x.stride(1), heads,
            D=d, BLOCK=_BLOCK, enable_fp_fusion=False,  # no FMA: eager rounds each product
        )  # fmt: skip
    return out
