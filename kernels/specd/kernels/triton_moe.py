"""The fused mixture-of-experts layer on CUDA: a Triton grouped GEMM over (token, slot)
pairs sorted by expert, as SGLang and vLLM run it.

``moe_torch`` (``specd.kernels.moe``) reads the routing on the host to loop over experts,
which costs a sync per layer and cannot be captured in a CUDA graph.  Here the routing
never leaves the device:

1. ``align_pairs`` (``specd.kernels.moe_align``) sorts the ``N * top_k`` pairs by expert
   and pads each expert's run to a multiple of ``BLOCK_M``, so every ``BLOCK_M`` tile holds
   pairs of one expert: on CUDA in one Triton launch (at decode), else with torch ops.  Its
   shapes depend only on ``N``, ``top_k``, ``E`` and ``BLOCK_M``, never on the routing: the
   same launches serve any routing, and a graph replays them.
2. ``_expert_gemm_kernel`` runs one program per (tile, ``BLOCK_N`` output columns): it
   gathers its pairs' input rows and multiplies them by its tile's expert's weight,
   accumulating in float32.  Launched twice: ``x @ w13[e].T`` with SiLU(gate) * up fused
   into the epilogue (``[pairs, I]``), then ``@ w2[e].T`` times the pair's routing weight
   (``[pairs, H]``).  Tiles past the used ones (their expert is -1) return at once.
3. Each token's ``top_k`` pair outputs are summed in float32 and cast to x's dtype.

Rounding follows ``moe_torch``: the projections, SiLU, the product with ``up`` and the
routing-weighted expert output are each rounded to x's dtype where the eager code rounds
them; the weighted product is taken in float32 and rounded once (what torch's promotion
gives for float32 and for x-dtype routing weights alike).  For ``top_k <= 2`` the final
sum rounds as ``moe_torch``'s ``index_add_`` does; for more slots it sums in float32
where ``moe_torch`` adds in x's dtype expert by expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specd.kernels.moe_align import ExpertAlignment, align_pairs
from specd.kernels.triton_launch import launch

BLOCK_N = 64  # output columns per program
BLOCK_K = 64  # reduction step (on an H200, 64 beat 32 by 15% at one token, 30% at 32)
NUM_WARPS = 4  # 8 warps or 4 stages measured no better on an H200 (Qwen3-30B-A3B layer)
NUM_STAGES = 3
SMALL_BLOCK_M = 16  # tl.dot's smallest tile: little padding when experts see few pairs
LARGE_BLOCK_M = 64  # enough pairs per expert to fill bigger tiles


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Small tiles while experts average at most a small tile of pairs (decode), larger
    ones once they see many (prefill): padding waste against per-tile weight reads."""
    return SMALL_BLOCK_M if num_pairs <= SMALL_BLOCK_M * num_experts else LARGE_BLOCK_M


@triton.jit
def _expert_gemm_kernel(
    a_ptr,  # [rows, K] row-strided: x (a row per token) or the activations (per pair)
    w_ptr,  # [E, W_ROWS, K]: w13 (gate rows, then up rows) or w2
    out_ptr,  # [num_pairs, n_out] contiguous, x's dtype
    sorted_pair_ids_ptr,  # [max_padded]
    block_expert_ptr,  # [max_blocks]
    route_weight_ptr,  # [num_pairs]: read when not GATED
    num_pairs,
    n_out,  # I when GATED, else H
    k_dim,
    a_row_stride,
    w_expert_stride,
    w_row_stride,
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when a is x, 1 when a holds a row per pair
    GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (tile, n): out[pairs of tile, n's columns] for the tile's expert e:
    GATED: silu(a @ w[e, :n_out].T) * (a @ w[e, n_out:].T); else (a @ w[e].T) * weight."""
    tile = tl.program_id(0)
    expert = tl.load(block_expert_ptr + tile)
    if expert < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows)  # [BLOCK_M]
    row_ok = pairs < num_pairs
    a_rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * a_row_stride + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_base = w_ptr + expert.to(tl.int64) * w_expert_stride
    w_ptrs = w_base + cols[None, :].to(tl.int64) * w_row_stride + ks[:, None]  # [BLOCK_K, BLOCK_N]
    up_offset = n_out * w_row_stride  # GATED: the up rows follow the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = ks < k_dim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if GATED:  # rounded where eager rounds: each projection, SiLU, the product
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        result = (silu * up).to(dtype)
    else:
        weight = tl.load(route_weight_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        result = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * n_out + cols[None, :]
    tl.store(out_ptrs, result, mask=row_ok[:, None] & col_ok[None, :])


def _expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    route_weights: torch.Tensor,
    pairs_per_a_row: int,
    gated: bool,
) -> None:
    """One grouped-GEMM launch over every tile (unused ones return at once)."""
    num_pairs, n_out = out.shape
    max_blocks = alignment.block_expert.numel()
    grid = (max_blocks, triton.cdiv(n_out, BLOCK_N))
    # float32 is multiplied in full precision (not TF32), as the torch path does
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    launch(
        _expert_gemm_kernel, grid, a, w, out, alignment.sorted_pair_ids,
        alignment.block_expert, route_weights, num_pairs, n_out, a.shape[1],
        a.stride(0), w.stride(0), w.stride(1),
        PAIRS_PER_A_ROW=pairs_per_a_row, GATED=gated, DOT_PRECISION=precision,
        BLOCK_M=alignment.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [N, k] -> [N, H] in x's
    dtype: ``moe_torch``'s result, without host syncs (CUDA-graph capturable)."""
    n, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if n == 0:
        return torch.zeros_like(x)
    num_pairs = n * top_k
    alignment = align_pairs(topk_ids, num_experts, choose_block_m(num_pairs, num_experts))
    x, w13, w2 = _last_dim_contiguous(x), _last_dim_contiguous(w13), _last_dim_contiguous(w2)
    route_weights = topk_weights.reshape(-1)  # [P], pair order
    activations = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _expert_gemm(x, w13, activations, alignment, route_weights, top_k, gated=True)
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _expert_gemm(activations, w2, per_pair, alignment, route_weights, 1, gated=False)
    return per_pair.view(n, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
