"""(token, slot) pairs sorted by expert in tiles of ``block_m``: what ``triton_moe``'s
grouped GEMM reads, so that every tile holds pairs of one expert.

Every shape depends only on ``N``, ``top_k``, ``E`` and ``block_m``, never on the routing,
and nothing is read on the host: the same launches serve any routing, and a CUDA graph
replays them.  Two implementations give the same arrays:

* ``align_pairs_by_expert``: about 20 torch ops (sort, searchsorted, cumsum, scatter).
  The reference, and the path for large batches.
* ``align_pairs_by_expert_triton``: one Triton launch.  In a CUDA graph each op is a node
  costing ~1.5 us however small, so at decode the torch ops spend ~30 us of a Qwen3-MoE
  layer's ~70 us on launches (H200, batch 1); this spends one.  Program e counts every
  expert's pairs itself (so no program waits on another), which gives where its run
  starts, then writes its own pairs in pair order, its padding and its tiles' expert, and
  a share of the unused tiles.  The counting compares every pair with every expert in
  every program, so ``align_pairs`` takes it only while that stays small.

Worked example, ``block_m`` 4, E 3, topk_ids [[2, 0], [0, 2], [2, 1]]: pairs 0..5
(``token * top_k + slot``) choose experts [2, 0, 0, 2, 2, 1]; counts [2, 1, 3], one tile
each, at 0, 4 and 8::

    sorted_pair_ids  | 1 2 6 6 | 5 6 6 6 | 0 3 4 6 | 6 6 6 6 |   (6 = no pair)
    block_expert     |    0    |    1    |    2    |   -1    |
    num_used_blocks  [3]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specd.kernels.triton_launch import launch

# At most this many [pairs, experts] comparisons per counting step (int32 accumulators:
# 64 a thread at 4 warps; twice as many spill), and at most this many pairs per step
# when a program scans for its own expert's
_COUNT_STEP_ELEMENTS = 8192
_PLACE_STEP_MAX = 1024
# Triton's interpreter pays per operation, not per element: there, far wider steps
_COUNT_STEP_ELEMENTS_INTERPRETED = 1 << 17
_PLACE_STEP_MAX_INTERPRETED = 1 << 14
_TAIL_STEP_SLOTS = 256  # unused slots a program fills per step
# Comparisons the busiest SM makes before the torch ops' ~20 launches are the cheaper.
# Measured on an H200 (CUDA graphs, 2026-11-26), one launch vs the torch ops: 2.8 vs
# 31.1 us at 8 pairs x 128 experts, 18.9 vs 59.4 us at 250 pairs x 512 experts (2^19
# comparisons), 113 vs 69 us at 4096 pairs x 128 experts (also ~2^19).  Half that bound
# keeps the one launch on the measured winning side: 2048 pairs at 128 experts.
ONE_LAUNCH_MAX_COMPARISONS = 1 << 18
_SMS_ASSUMED = 128  # about an H100's or H200's 132: programs past them share SMs


@dataclass(frozen=True, slots=True)
class ExpertAlignment:
    """Pairs sorted by expert in ``BLOCK_M`` tiles; every shape is static.

    ``sorted_pair_ids [max_padded]`` int64: pair ids (``token * top_k + slot``) in pair
    order within each expert's run, each run starting on a tile boundary, padded with
    ``num_pairs`` (no pair).
    ``block_expert [max_blocks]`` int64: each tile's expert; -1 for the unused tiles at
    the end.
    ``num_used_blocks [1]`` int64: how many tiles hold pairs (on the device)."""

    sorted_pair_ids: torch.Tensor
    block_expert: torch.Tensor
    num_used_blocks: torch.Tensor
    block_m: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most sorted slots any routing needs: each of at most ``min(E, pairs)`` chosen
    experts pads its run by under ``block_m``; a whole number of tiles."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> ExpertAlignment:
    """topk_ids [N, top_k] -> the pairs sorted by expert, in tiles of ``block_m``, with
    torch ops (the reference)."""
    flat_experts = topk_ids.reshape(-1).to(torch.int64)  # [P], pair p = token * top_k + slot
    num_pairs = flat_experts.numel()
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    max_blocks = max_padded // block_m
    # one arange serves all three index ranges: in a graph each op is a launch (~2 us)
    steps = torch.arange(max(num_pairs, num_experts + 1, max_blocks), device=topk_ids.device)
    sorted_experts, order = torch.sort(flat_experts, stable=True)  # [P] pairs by expert
    expert_bounds = torch.searchsorted(sorted_experts, steps[: num_experts + 1])  # [E + 1]
    counts = expert_bounds[1:] - expert_bounds[:-1]  # [E]
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_ends = torch.cumsum(tiles, 0)  # [E]
    # where each expert's pairs move: from their sorted place to their padded run's
    shift = (tile_ends - tiles) * block_m - expert_bounds[:-1]  # [E]
    destination = steps[:num_pairs] + shift[sorted_experts]  # [P]
    sorted_pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int64, device=order.device)
    sorted_pair_ids.scatter_(0, destination, order)
    # a tile's expert is the first whose tiles end after it (an expert with no pairs ends
    # where it starts, so owns no tile); past the last expert's tiles: none
    block_expert = torch.searchsorted(tile_ends, steps[:max_blocks], right=True)
    block_expert.masked_fill_(block_expert == num_experts, -1)  # [max_blocks]
    num_used_blocks = tile_ends[-1:]
    return ExpertAlignment(sorted_pair_ids, block_expert, num_used_blocks, block_m)


@triton.jit
def _align_kernel(
    expert_of_pair_ptr,  # [P] int: pair p = token * top_k + slot
    sorted_pair_ids_ptr,  # [max_blocks * BLOCK_M] int64, every slot written
    block_expert_ptr,  # [max_blocks] int64, every tile written
    num_used_blocks_ptr,  # [1] int64
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,  # num_experts rounded up to a power of two
    COUNT_STEP: tl.constexpr,  # pairs per counting step
    PLACE_STEP: tl.constexpr,  # pairs per placing step
    TAIL_TILES: tl.constexpr,  # unused tiles per filling step
):
    """Program e writes expert e's run (its pairs in pair order, then ``num_pairs`` up to
    the tile boundary) and its tiles' entries in ``block_expert``, and fills every
    ``num_experts``-th group of the unused tiles after the last run.  Every slot is
    written by one program, once: no program reads what another writes."""
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    # 1. every expert's count, hence where expert e's run starts and where all runs end
    hits = tl.zeros((COUNT_STEP, EXPERTS), dtype=tl.int32)
    for start in range(0, num_pairs, COUNT_STEP):
        pairs = start + tl.arange(0, COUNT_STEP)
        chosen = tl.load(expert_of_pair_ptr + pairs, mask=pairs < num_pairs, other=-1)
        chosen = chosen.to(tl.int32)  # ids < E: 32-bit compares
        hits += (chosen[:, None] == experts[None, :]).to(tl.int32)
    counts = tl.sum(hits, axis=0)  # [EXPERTS]
    tiles = (counts + BLOCK_M - 1) // BLOCK_M  # [EXPERTS]
    used_blocks = tl.sum(tiles, axis=0)
    first_tile = tl.sum(tl.where(experts < expert, tiles, 0), axis=0)
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    my_tiles = (count + BLOCK_M - 1) // BLOCK_M
    run_start = first_tile * BLOCK_M
    # 2. expert e's pairs, each at its run's start plus the number of e's pairs before it
    if count > 0:
        placed = 0
        for start in range(0, num_pairs, PLACE_STEP):
            pairs = start + tl.arange(0, PLACE_STEP)
            chosen = tl.load(expert_of_pair_ptr + pairs, mask=pairs < num_pairs, other=-1)
            mine = (chosen.to(tl.int32) == expert).to(tl.int32)
            slots = run_start + placed + tl.cumsum(mine, axis=0) - 1
            tl.store(sorted_pair_ids_ptr + slots, pairs.to(tl.int64), mask=mine > 0)
            placed += tl.sum(mine, axis=0)
    # 3. the run's padding up to its last tile's end, and its tiles' expert
    pad = run_start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_pair_ids_ptr + pad, num_pairs, mask=pad < run_start + my_tiles * BLOCK_M)
    for tile0 in range(0, my_tiles, TAIL_TILES):
        tile = tile0 + tl.arange(0, TAIL_TILES)
        tl.store(block_expert_ptr + first_tile + tile, expert, mask=tile < my_tiles)
    # 4. the unused tiles after the last run: no expert, no pairs
    lanes = tl.arange(0, BLOCK_M)
    for tile0 in range(used_blocks + expert * TAIL_TILES, max_blocks, num_experts * TAIL_TILES):
        tile = tile0 + tl.arange(0, TAIL_TILES)
        unused = tile < max_blocks
        tl.store(block_expert_ptr + tile, -1, mask=unused)
        slots = tile[:, None] * BLOCK_M + lanes[None, :]  # [TAIL_TILES, BLOCK_M]
        tl.store(sorted_pair_ids_ptr + slots, num_pairs, mask=unused[:, None])
    if expert == 0:
        tl.store(num_used_blocks_ptr, used_blocks.to(tl.int64))


def _pair_steps(num_pairs: int, experts_pow2: int, on_cuda: bool) -> tuple[int, int]:
    """(pairs per counting step, pairs per placing step), powers of two."""
    count_budget = _COUNT_STEP_ELEMENTS if on_cuda else _COUNT_STEP_ELEMENTS_INTERPRETED
    place_max = _PLACE_STEP_MAX if on_cuda else _PLACE_STEP_MAX_INTERPRETED
    pairs = max(16, triton.next_power_of_2(num_pairs))
    return max(16, min(pairs, count_budget // experts_pow2)), min(pairs, place_max)


def align_pairs_by_expert_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> ExpertAlignment:
    """``align_pairs_by_expert``'s arrays in one launch of ``num_experts`` programs (CUDA;
    CPU under ``TRITON_INTERPRET=1``).  ``block_m`` is a power of two."""
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    flat_experts = topk_ids.reshape(-1).contiguous()  # [P]
    num_pairs = flat_experts.numel()
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    max_blocks = max_padded // block_m
    device = topk_ids.device
    sorted_pair_ids = torch.empty((max_padded,), dtype=torch.int64, device=device)
    block_expert = torch.empty((max_blocks,), dtype=torch.int64, device=device)
    num_used_blocks = torch.empty((1,), dtype=torch.int64, device=device)
    experts_pow2 = triton.next_power_of_2(num_experts)
    count_step, place_step = _pair_steps(num_pairs, experts_pow2, topk_ids.is_cuda)
    launch(
        _align_kernel, (num_experts,), flat_experts, sorted_pair_ids, block_expert,
        num_used_blocks, num_pairs, num_experts, max_blocks,
        BLOCK_M=block_m, EXPERTS=experts_pow2,
        COUNT_STEP=count_step, PLACE_STEP=place_step,
        TAIL_TILES=max(1, _TAIL_STEP_SLOTS // block_m),
        num_warps=4,
    )  # fmt: skip
    return ExpertAlignment(sorted_pair_ids, block_expert, num_used_blocks, block_m)


def one_launch_fits(num_pairs: int, num_experts: int) -> bool:
    """Whether the one-launch alignment is the cheaper on a GPU: each of its ``E``
    programs compares every pair with every expert (padded to a power of two), several
    programs share an SM past ``_SMS_ASSUMED``, and the busiest SM's comparisons must stay
    under ``ONE_LAUNCH_MAX_COMPARISONS``.  Decode and verify batches fit; prefill chunks
    mostly do not, and there the grouped GEMM dwarfs the torch ops' launches."""
    sharing = triton.cdiv(num_experts, _SMS_ASSUMED)
    comparisons = num_pairs * triton.next_power_of_2(num_experts) * sharing
    return comparisons <= ONE_LAUNCH_MAX_COMPARISONS


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """The alignment ``fused_moe`` runs: one Triton launch on CUDA where it fits, else the
    torch ops (on CPU too: the interpreter tests compare the two directly)."""
    if topk_ids.is_cuda and one_launch_fits(topk_ids.numel(), num_experts):
        return align_pairs_by_expert_triton(topk_ids, num_experts, block_m)
    return align_pairs_by_expert(topk_ids, num_experts, block_m)
