"""The Triton side of the FP8 GEMMs (``specd.kernels.fp8`` holds the layouts, the torch
math and the dispatch, and imports this module only on an FP8 CUDA device, so CPU
installs without Triton still read FP8 checkpoints).

- ``group_quant_triton``: ``per_token_group_quant`` on CUDA, the same bits as torch's
  (both divide with IEEE rounding).
- ``fp8_block_gemm``: one kernel; each ``BLOCK_K`` step of the K loop is a fresh FP8 dot,
  scaled by its row's activation scale and its column's weight scale, then added to the
  float32 accumulator (on Hopper an FP8 dot accumulates with reduced precision, so
  bounding each dot to one scale block also bounds that error, as DeepSeek-V3 does).
  With few rows the output tiles are too few to keep every SM reading the weight, so K
  is split and a second launch sums the splits in a fixed order (deterministic).  It
  also runs on CPU through Triton's interpreter, which is how the CPU tests check it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specd.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_AMAX, SUPPORTED_BLOCKS_TEXT, block_grid
from specd.kernels.triton_launch import launch

_MAX_BLOCK_K_STEP = 128  # K elements per step of the GEMM's loop
# split-K: a small grid (few rows, few output tiles) gets K splits up to this many
# programs per SM, each split at least this many K steps long
_PROGRAMS_PER_SM = 4
_MIN_STEPS_PER_SPLIT = 4
_REDUCE_BLOCK = 1024


@triton.jit
def _group_quant_kernel(
    x_ptr,  # [M, K], row-strided
    q_ptr,  # [M, K] fp8, contiguous
    scale_ptr,  # [M, G] float32, contiguous
    x_row_stride,
    K,
    group,
    num_groups,
    MIN_AMAX: tl.constexpr,
    MAX: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= group
):
    """Program (row, g): q[row, g's columns] = x / s with s = max(amax, MIN_AMAX) / MAX."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = g * group + offs
    ok = (offs < group) & (cols < K)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX)
    scale = tl.math.div_rn(amax, MAX)
    q = tl.clamp(tl.math.div_rn(x, scale), -MAX, MAX)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row * num_groups + g, scale)


def group_quant_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_group_quant`` of a CUDA tensor: one program per (row, group), no host
    sync, so it runs inside a captured graph."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    num_groups = triton.cdiv(k, group)
    quantized = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m:
        launch(
            _group_quant_kernel, (m, num_groups), x, quantized, scales, x.stride(0), k,
            group, num_groups, MIN_AMAX=MIN_AMAX, MAX=FP8_MAX,
            BLOCK=triton.next_power_of_2(group),
        )  # fmt: skip
    return quantized, scales


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,  # [M, K] fp8, contiguous
    x_scale_ptr,  # [M, ceil(K / group_k)] float32, contiguous
    w_ptr,  # [N, K] fp8, rows strided, K contiguous
    w_scale_ptr,  # [ceil(N / group_n), ceil(K / group_k)] float32, contiguous
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in the activation dtype; PARTIAL: [splits, M, N] float32
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    w_row_stride,
    group_n,
    group_k,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # write this split's float32 sum; _reduce_splits_kernel ends
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides group_k, or group_k >= K: a step reads one scale column
):
    """Program (m, n, split): out[m tile, n tile] = sum over the split's K steps of
    dot(x_fp8, w_fp8.T) * x_scale[row, step's group] * w_scale[col's block row, step's group]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    ks = k_start + tl.arange(0, BLOCK_K)
    num_groups = tl.cdiv(K, group_k)
    x_ptrs = x_ptr + rows64[:, None] * K + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols64[None, :] * w_row_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]: w.T
    x_scale_ptrs = x_scale_ptr + rows64 * num_groups  # [BLOCK_M]
    w_scale_ptrs = w_scale_ptr + (cols64 // group_n) * num_groups  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        g = k0 // group_k
        x_scale = tl.load(x_scale_ptrs + g, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_ptrs + g, mask=col_ok, other=0.0)
        acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        ks += BLOCK_K
    out_offsets = rows64[:, None] * N + cols64[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + split.to(tl.int64) * M * N + out_offsets, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_splits_kernel(
    partial_ptr,  # [splits, M * N] float32
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M * N], the activation dtype
    total,  # M * N
    N,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = sum of the splits' partial sums, in split order (deterministic), + bias."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + s * total + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True, slots=True)
class GemmTiles:
    """One launch configuration of the block GEMM."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def gemm_tiles(m: int) -> GemmTiles:
    """The tiles for M rows.  Few rows (decode, verify): the GEMM is a read of the
    weight, so narrow N tiles and deep pipelines keep many loads in flight (and split-K
    adds programs where the grid is still small).  Many rows (prefill): bigger tiles.
    Picked on an H200 among a few candidates per row count (16x64, 16x16 and 3 stages at
    one row; 16x64, 32x32, 32x64 at 64 rows; 128x128, 128x64 at 512 rows)."""
    if m <= 16:
        return GemmTiles(16, 32, 4, 5)
    if m <= 64:
        return GemmTiles(64, 64, 4, 4)
    return GemmTiles(64, 128, 4, 3)


def _target_programs(device: torch.device) -> int:
    """Programs that keep every SM streaming the weight (several per SM)."""
    if device.type != "cuda":
        return 1  # the interpreter: no reason to split unless asked
    return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def choose_split_k(programs: int, k_steps: int, target: int) -> int:
    """K splits for a grid of ``programs`` tiles: enough to reach ``target`` programs,
    each split keeping at least ``_MIN_STEPS_PER_SPLIT`` K steps."""
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), k_steps // _MIN_STEPS_PER_SPLIT))


def _k_step(group_k: int, k: int) -> int:
    """BLOCK_K: a power of two >= 32 that never crosses a scale column (``group_k``
    a multiple of it, or one group covering all of K)."""
    if group_k >= k:
        return max(32, min(_MAX_BLOCK_K_STEP, triton.next_power_of_2(k)))
    step = min(group_k, _MAX_BLOCK_K_STEP)
    if step < 32 or group_k % step or step & (step - 1):
        raise ValueError(f"a K block of {group_k} is not supported; {SUPPORTED_BLOCKS_TEXT}")
    return step


def fp8_block_gemm(
    x_fp8: torch.Tensor,
    x_scales: torch.Tensor,
    weight_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    split_k: int | None = None,
) -> torch.Tensor:
    """The block kernel on quantized activations: x_fp8 [M, K], x_scales [M, ceil(K/bk)]
    (``per_token_group_quant(x, bk)``), weight_fp8 [N, K], scale_inv [ceil(N/bn),
    ceil(K/bk)] -> [M, N] in ``out_dtype``.  ``split_k``: K splits (None: enough to fill
    the GPU), summed in a fixed order by a second launch.  Runs wherever Triton does
    (CUDA; CPU through the interpreter, which is how the CPU tests check it)."""
    m, k = x_fp8.shape
    n = weight_fp8.shape[0]
    if weight_fp8.shape[1] != k or tuple(x_scales.shape) != (m, triton.cdiv(k, block[1])):
        raise ValueError(
            f"shapes do not fit: x {list(x_fp8.shape)}, x_scales {list(x_scales.shape)}, "
            f"weight {list(weight_fp8.shape)} in {list(block)} blocks"
        )
    if tuple(scale_inv.shape) != block_grid(weight_fp8, block):
        raise ValueError(
            f"scale_inv has shape {list(scale_inv.shape)}; a {list(weight_fp8.shape)} weight "
            f"in {list(block)} blocks needs {list(block_grid(weight_fp8, block))}"
        )
    if weight_fp8.stride(1) != 1:
        weight_fp8 = weight_fp8.contiguous()
    x_fp8, x_scales = x_fp8.contiguous(), x_scales.float().contiguous()
    scale_inv = scale_inv.float().contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m == 0 or n == 0:
        return out
    tiles = gemm_tiles(m)
    block_k = _k_step(block[1], k)
    k_steps = triton.cdiv(k, block_k)
    tile_grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    if split_k is None:
        split_k = choose_split_k(math.prod(tile_grid), k_steps, _target_programs(out.device))
    steps_per_split = triton.cdiv(k_steps, max(1, min(split_k, k_steps)))
    splits = triton.cdiv(k_steps, steps_per_split)  # no empty split
    partial = None
    if splits > 1:
        partial = torch.empty((splits, m, n), dtype=torch.float32, device=out.device)
    launch(
        _fp8_block_gemm_kernel, (*tile_grid, splits), x_fp8, x_scales, weight_fp8,
        scale_inv, bias if bias is not None else out, out if partial is None else partial,
        m, n, k, steps_per_split * block_k, weight_fp8.stride(0), block[0], block[1],
        HAS_BIAS=bias is not None, PARTIAL=partial is not None, EVEN_K=k % block_k == 0,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if partial is not None:
        launch(
            _reduce_splits_kernel, (triton.cdiv(m * n, _REDUCE_BLOCK),), partial,
            bias if bias is not None else out, out, m * n, n, SPLITS=splits,
            HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK,
        )  # fmt: skip
    return out
