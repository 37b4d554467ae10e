"""Benchmark-only engine settings: never in the CRD, the YAML or the config hash.

``benchmarks/bench_gpu.py`` and ``bench_structured.py`` pass them to ``Engine(..., knobs=...)`` to time a model
shape without its checkpoint and a draft at a chosen acceptance; a served engine always
runs with the defaults (all off).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchKnobs:
    """dummy_weights: build the target and the draft from their config.json alone, with
    small random weights made on the device (vLLM / SGLang ``--load-format dummy``); no
    weight file is read.

    force_accept_len: every verify accepts drafts along the tree's first-child chain so
    that the mean tokens per verify, bonus included, is this (``speculative/forced_accept.py``);
    outputs are then no longer the target's.

    eager_elementwise: on CUDA, RMSNorm, SiLU-and-mul and RoPE as eager torch ops instead
    of their one-launch Triton kernels (``model/inference_layout.use_fused_elementwise``):
    the other side of the fused kernels' A/B.

    unguided_drafts: requests with a grammar draft without it (``speculative/guided_draft.py``):
    the other side of guided drafting's A/B (``benchmarks/bench_structured.py``).
    """

    dummy_weights: bool = False
    force_accept_len: float | None = None
    eager_elementwise: bool = False
    unguided_drafts: bool = False

    def __post_init__(self) -> None:
        if self.force_accept_len is not None and self.force_accept_len < 1:
            raise ValueError(
                f"force_accept_len {self.force_accept_len} must be >= 1 (tokens per verify "
                "including the bonus)"
            )
