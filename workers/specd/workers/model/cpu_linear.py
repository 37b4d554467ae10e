"""oneDNN pre-packed linear layers for CPU inference.

``F.linear`` on CPU reads the weight in its PyTorch layout on every call; oneDNN can
reorder it once into its blocked layout (vLLM's CPU build does too).  Whether that is
faster depends on the CPU's BLAS and the rows per call, so each weight shape is timed
once at load (``packed_from_rows``) and packed only from the row count where it wins.
Results match ``F.linear`` to float rounding (~1e-5 in float32); the exactness tests
against transformers run with packing on.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


@functools.cache
def prepack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack ``dtype`` weights on this CPU: tried once on a tiny
    weight (bf16 packing needs AVX-512 or AVX-NE-CONVERT, which many AMD and older
    Intel CPUs lack; torch then raises instead of falling back)."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and dtype in (torch.float32, torch.bfloat16)
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


# rows per call at which packed and plain are timed; from a few hundred rows (prefill)
# they are within a few percent of each other on both CPUs measured
_ROW_LADDER = (1, 8, 32)


def _best_seconds(fn, x: torch.Tensor, calls: int = 3, tries: int = 3) -> float:
    fn(x)  # warm-up (oneDNN builds its primitive on the first call)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
@torch.inference_mode()
def packed_from_rows(dtype: torch.dtype, in_features: int, out_features: int) -> int | None:
    """From how many rows per call the packed weight beats ``F.linear`` for this shape on
    this machine: 1 = always, ``None`` = never.  Timed once per shape and process.

    It depends on the CPU's BLAS: measured on a 2-core AMD EPYC VM, packing won at every
    row count (2x); on a 2-core Sapphire Rapids VM, plain MKL won at 1 row (by 1.1-2x),
    packing won by 1.1-1.5x at 8-32 rows for some shapes, and neither from 128 rows.
    """
    weight = torch.randn(out_features, in_features, dtype=dtype) * in_features**-0.5
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    from_rows = None
    for rows in reversed(_ROW_LADDER):
        x = torch.randn(rows, in_features, dtype=dtype)
        plain_s = _best_seconds(lambda x: F.linear(x, weight), x)
        packed_s = _best_seconds(lambda x: _packed_linear(x, packed, None), x)
        if packed_s >= plain_s:
            break
        from_rows = rows
    log.debug("%s linear %dx%d: packed from %s rows", dtype, in_features, out_features, from_rows)
    return from_rows


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """Inference-only stand-in for ``nn.Linear`` holding a oneDNN-packed weight, used
    from ``from_rows`` rows per call; below that it keeps the plain weight and
    ``F.linear`` (where the CPU's BLAS is faster for small batches)."""

    def __init__(self, linear: nn.Linear, from_rows: int = 1):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.from_rows = from_rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.weight = linear.weight.detach() if from_rows > 1 else None
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        if x.numel() < self.from_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, self.packed, self.bias)


def prepack_linears(model: nn.Module, always: bool = False) -> int:
    """Swap CPU ``nn.Linear`` layers of ``model`` for ``PackedLinear``; returns the count.

    Each shape is packed where timing says it pays (``packed_from_rows``), or every one
    with ``always``.  Leaves the model unchanged (and logs why) where oneDNN cannot pack
    its dtype.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears or linears[0][1].weight.device.type != "cpu":
        return 0
    dtype = linears[0][1].weight.dtype
    if not prepack_supported(dtype):
        log.info("oneDNN weight packing unavailable for %s; using plain linear layers", dtype)
        return 0
    swapped = 0
    for name, linear in linears:
        shape = (linear.weight.dtype, linear.in_features, linear.out_features)
        from_rows = 1 if always else packed_from_rows(*shape)
        if from_rows is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PackedLinear(linear, from_rows))
        swapped += 1
    return swapped
