"""The FP8 format both sides of the FP8 GEMMs read: e4m3's dtype and range, the block
sizes the kernel runs, and a weight's grid of scale blocks.

Its own module so that ``fp8`` (torch only, the public API) and ``triton_fp8`` (the
kernels, which ``fp8`` imports lazily) share it without importing each other.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
# a block of zeros still gets a positive scale (its values quantize to 0)
MIN_AMAX = 1e-10

# ``weight_block_size`` entries the block kernel runs: powers of two in these ranges.
# The K entry is at least 32 because an FP8 dot's K is at least 32, and a K step of the
# kernel never spans two scale blocks; at most 256 bounds a step's shared memory.  The
# N entry only picks each output column's scale row.  Published: [128, 128].
SUPPORTED_BLOCK_N = (16, 256)
SUPPORTED_BLOCK_K = (32, 256)
SUPPORTED_BLOCKS_TEXT = (
    "[bn, bk] with bn a power of two in [16, 256] and bk a power of two in [32, 256], "
    "e.g. [128, 128]"
)


def _is_power_of_two_in(value: object, bounds: tuple[int, int]) -> bool:
    return isinstance(value, int) and bounds[0] <= value <= bounds[1] and value & (value - 1) == 0


def supported_block(block: tuple[int, int]) -> bool:
    """Whether ``fp8_block_linear`` runs ``weight_block_size`` ``block`` (``[bn, bk]``);
    see ``SUPPORTED_BLOCKS_TEXT``.  The loader refuses the others."""
    return (
        len(block) == 2
        and _is_power_of_two_in(block[0], SUPPORTED_BLOCK_N)
        and _is_power_of_two_in(block[1], SUPPORTED_BLOCK_K)
    )


def block_grid(x: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    """x [rows, cols] -> (row blocks, column blocks), the last ones partial."""
    return -(-x.shape[0] // block[0]), -(-x.shape[1] // block[1])
