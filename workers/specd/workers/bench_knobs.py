"""Benchmark-only engine settings: never in the CRD, the YAML or the config hash.

``benchmarks/bench_gpu.py`` and ``bench_structured.py`` pass them to ``Engine(..., knobs=...)`` to time a model
shape without its checkpoint and a draft at a chosen acceptance.  A served engine runs
with the defaults (all off) unless its process has ``SPECD_BENCH_KNOBS`` (``from_env``):
``benchmarks/bench_serving.py --capacity`` and ``profile_serving.py --null-model`` set it
on ``specd serve`` to serve the null model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass
from typing import Any

ENV_VAR = "SPECD_BENCH_KNOBS"  # a JSON object of field names, e.g. {"null_model": true}


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

    null_model: the target is ``model/null_model.py``'s ``NullCausalLM``, built from
    config.json alone: no layer runs and no KV is written, each next token is a fixed
    successor of the last, so served throughput measures the serving path alone (plain
    decoding only: refused with a draft).
    """

    dummy_weights: bool = False
    force_accept_len: float | None = None
    eager_elementwise: bool = False
    unguided_drafts: bool = False
    null_model: bool = False

    def __post_init__(self) -> None:
        accept = self.force_accept_len
        if accept is not None and not (math.isfinite(accept) and accept >= 1):
            raise ValueError(
                f"force_accept_len {accept} must be a finite number >= 1 (tokens per verify "
                "including the bonus)"
            )

    @classmethod
    def from_env(cls) -> BenchKnobs:
        """The knobs ``SPECD_BENCH_KNOBS`` names (unset or empty: the defaults), for an
        engine started by ``specd serve``, which takes no knobs itself."""
        raw = os.environ.get(ENV_VAR, "").strip()
        if not raw:
            return cls()
        try:
            fields = json.loads(raw)
        except json.JSONDecodeError as err:
            raise _env_error(f"is not JSON ({err}): {raw!r}") from None
        if not isinstance(fields, dict):
            raise _env_error(f"must be a JSON object, not {raw!r}")
        hints = typing.get_type_hints(cls)
        for name, value in fields.items():
            if name not in hints:
                raise _env_error(f"has an unknown field {name!r}")
            fields[name] = _typed(name, value, hints[name])
        try:
            return cls(**fields)
        except ValueError as err:
            raise _env_error(str(err)) from None

    def as_env(self) -> dict[str, str]:
        """``SPECD_BENCH_KNOBS`` naming the fields that differ from the defaults, for a
        ``specd serve`` subprocess (``from_env`` reads it back)."""
        changed = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }
        return {ENV_VAR: json.dumps(changed)} if changed else {}


class BenchKnobsError(ValueError):
    """``SPECD_BENCH_KNOBS`` is malformed (an engine actor reports it as its load error)."""


def _env_error(why: str) -> BenchKnobsError:
    known = ", ".join(f.name for f in dataclasses.fields(BenchKnobs))
    return BenchKnobsError(f"{ENV_VAR} {why}; known fields: {known}")


def _typed(name: str, value: Any, hint: Any) -> Any:
    """``value`` as field ``name`` holds it (a JSON integer for a float field)."""
    if isinstance(value, int) and not isinstance(value, bool) and isinstance(1.0, hint):
        value = float(value)
    if not isinstance(value, hint):
        expected = getattr(hint, "__name__", hint)
        raise _env_error(f"field {name!r} must be {expected}, not {value!r}")
    return value
