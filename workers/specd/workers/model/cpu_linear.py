"""CPU linear layers whose weight layout is the one timed fastest on this machine.

``F.linear`` reads the weight as PyTorch stores it, ``[out, in]``, on every call.  Two
other layouts can be made once at load:

- ``transposed``: ``[in, out]``, run as ``x @ w``.  MKL's small-row kernels stream a
  large weight better this way: on a 2-core Sapphire Rapids VM in float32, the demo's
  [8192, 512] lm_head takes 363 us at 6 rows (a verify) vs 609 us plain, and the
  demo's batch-32 decode runs 9% faster end to end than with every layer plain.
- ``packed``: oneDNN's blocked layout (vLLM's CPU build pre-packs too).  It won at
  every row count (2x) on a 2-core AMD EPYC VM in float32, and with AMX it runs bfloat16
  2-4x faster than either other layout on Sapphire Rapids.

No layout wins everywhere, so each weight shape is timed once per process at load
(``fastest_layout``, with cold caches as in a forward pass) and its layers keep that one
layout, one copy of the weight.
Results match ``F.linear`` to float rounding (~1e-5 in float32); the exactness tests
against transformers run with the timed layouts.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

LAYOUTS = ("plain", "transposed", "packed")


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


@functools.cache
def native_bfloat16_matmuls() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX).  Without
    it a bfloat16 matmul converts to float32 first and runs slower than float32 does:
    2-100x per layer on a 2-core AMD EPYC with AVX2 only."""
    # _is_cpu_support_amx_tile: the AMX check's older name
    return _torch_reports(
        "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_cpu_support_amx_tile"
    )


def _torch_reports(*checks: str) -> bool:
    """Whether any of ``torch.cpu``'s feature ``checks`` holds.  They are private, named
    differently across the torch versions specd accepts: one this torch lacks counts as
    a feature absent (a float32 draft, never a failed start)."""
    return any(getattr(torch.cpu, check, bool)() for check in checks)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CPU linear layout {layout!r}; one of {LAYOUTS}")


def openmp_shrinks_teams() -> bool:
    """``OMP_DYNAMIC`` is on: OpenMP may run a parallel region on fewer threads than
    asked when the machine is loaded.  oneDNN's packed matmul then returns wrong values:
    on a 2-core VM at load average 2.4, all of 2,000 calls at 32 rows were wrong (NaN
    logits in a served engine); at load 0 none was, nor any plain or transposed one."""
    return os.environ.get("OMP_DYNAMIC", "").strip().lower() in ("true", "1", "yes", "on")


def layouts_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The layouts this CPU can hold ``dtype`` weights in (not ``packed`` where oneDNN
    cannot pack it, or computes it wrong: `openmp_shrinks_teams`)."""
    if openmp_shrinks_teams():
        log.warning("OMP_DYNAMIC is on: oneDNN's packed layout is not used (unset it)")
        return LAYOUTS[:2]
    return LAYOUTS if prepack_supported(dtype) else LAYOUTS[:2]


def _plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    out = torch.matmul(x, weight)  # weight [in, out]
    return out if bias is None else out.add_(bias)


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_FORWARD: dict[str, Callable] = {"plain": _plain, "transposed": _transposed, "packed": _packed}


def stored_weight(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """``weight`` ([out, in], as ``nn.Linear`` holds it) rearranged into ``layout``."""
    weight = weight.detach()
    if layout == "transposed":
        return weight.t().contiguous()  # [in, out]
    if layout == "packed":
        return torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    return weight


# rows per call at which the layouts are timed: decode at batch 1, a verify or a small
# batch, a large batch.  From a few hundred rows (prefill) they are within a few percent.
_ROW_LADDER = (1, 8, 32)
# Timing reads this much weight per round, cycling through copies: in a forward pass a
# weight comes back to a core after every other layer's weights, so it is not in the
# core's L2 (2 MB on Sapphire Rapids).  Timed hot, MKL's plain layout looks fastest at 8
# rows for the demo's 2-3 MB matrices, and a decode step at 32 rows runs 4% slower.
_COLD_BYTES = 48 << 20
# Larger weights are timed on their first outputs only (cost is linear in outputs).
_TIMED_ELEMENTS = 1 << 22


def _timed_weights(dtype: torch.dtype, in_features: int, out_features: int, layout: str):
    """Copies of one random weight in ``layout``, enough that a round through them
    leaves the core's caches cold."""
    out_features = max(1, min(out_features, _TIMED_ELEMENTS // in_features))
    weight = torch.randn(out_features, in_features, dtype=dtype) * in_features**-0.5
    copies = min(64, -(-_COLD_BYTES // (weight.numel() * weight.element_size())))
    return [stored_weight(weight.clone(), layout) for _ in range(copies)]  # distinct memory


# Each layout and row count is timed for about this long at most: on a CPU without
# native bfloat16 matmuls a bf16 transposed call can take 100x a plain one, and timing
# every cold copy four times once took 55 s of a 66 s engine start (the demo's draft).
_TIMING_BUDGET_S = 0.1


def _seconds_per_call(layout: str, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Best seconds per call over up to three rounds through ``weights`` (after one
    warm-up round: oneDNN builds its primitive), each round cut short once it has taken
    a quarter of ``_TIMING_BUDGET_S``; rounds stop once the budget is spent."""
    forward = _FORWARD[layout]
    best = float("inf")
    began = time.perf_counter()
    for attempt in range(4):
        start = time.perf_counter()
        calls = 0
        for weight in weights:
            forward(x, weight, None)
            calls += 1
            if time.perf_counter() - start > _TIMING_BUDGET_S / 4:
                break
        if attempt:
            best = min(best, (time.perf_counter() - start) / calls)
            if time.perf_counter() - began > _TIMING_BUDGET_S:
                break
    return best


@functools.cache
@torch.inference_mode()
def fastest_layout(
    dtype: torch.dtype,
    in_features: int,
    out_features: int,
    candidates: tuple[str, ...] | None = None,
) -> str:
    """The layout of ``candidates`` (default: `layouts_for`) whose calls are fastest for
    this weight shape on this machine, timed once per shape and process with cold caches.
    Each row count of ``_ROW_LADDER`` weighs the same: a layout's score is the sum of its
    time relative to ``plain``."""
    inputs = [torch.randn(rows, in_features, dtype=dtype) for rows in _ROW_LADDER]
    seconds = {}
    for layout in candidates or layouts_for(dtype):  # one layout's copies in memory at a time
        weights = _timed_weights(dtype, in_features, out_features, layout)
        seconds[layout] = [_seconds_per_call(layout, weights, x) for x in inputs]
    scores = {
        layout: sum(s / p for s, p in zip(times, seconds["plain"], strict=True))
        for layout, times in seconds.items()
    }
    best = min(scores, key=scores.get)
    log.debug("%s linear %dx%d: %s (scores %s)", dtype, in_features, out_features, best, scores)
    return best


class CpuLinear(nn.Module):
    """Inference-only stand-in for ``nn.Linear`` holding its weight in one of ``LAYOUTS``."""

    def __init__(self, linear: nn.Linear, layout: str):
        super().__init__()
        _check_layout(layout)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.layout = layout
        self.weight = stored_weight(linear.weight, layout)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._forward = _FORWARD[layout]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        return self._forward(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, layout={self.layout}"


def relayout_linears(model: nn.Module, layout: str | None = None) -> int:
    """Swap CPU ``nn.Linear`` layers of ``model`` for ``CpuLinear`` in the layout timed
    fastest for their shape (``fastest_layout``), or in ``layout`` for every one; a layer
    whose fastest is ``plain`` stays as it is.  Returns how many were swapped.

    A ``packed`` request where that layout is unusable (`layouts_for`) leaves the model
    unchanged (and logs why).
    """
    if layout is not None:
        _check_layout(layout)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears or linears[0][1].weight.device.type != "cpu":
        return 0
    dtype = linears[0][1].weight.dtype
    usable = layouts_for(dtype)
    if layout is not None and layout not in usable:
        log.info("oneDNN's packed %s layout is unusable here; keeping plain linear layers", dtype)
        return 0
    swapped = 0
    for name, linear in linears:
        shape = (linear.weight.dtype, linear.in_features, linear.out_features)
        chosen = layout or fastest_layout(*shape, usable)
        if chosen == "plain":
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, CpuLinear(linear, chosen))
        swapped += 1
    return swapped
