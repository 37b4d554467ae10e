"""Load a local Hugging Face folder (config.json + safetensors) into ``LlamaForCausalLM``.

The model is built on the meta device and the checkpoint tensors, cast to the target
dtype, are assigned in place: no random init, no second copy in another dtype.  Names,
shapes, and an FP8 checkpoint's weight dtypes and scales are checked against the model
before anything is assigned (``check_checkpoint``), so a wrong checkpoint fails with a
message naming the tensor instead of a deep torch error, and nothing is half loaded.

FP8 checkpoints (``quantization.py``) are read without casting their FP8 weights and
scales.  On CUDA with FP8 GEMMs (capability 8.9+) the dense linears stay FP8, as
``Fp8Linear`` (``fp8_linear.py``); everywhere else, and for MoE experts, each FP8 weight
is dequantized once into the model dtype and the model is an ordinary one.

``dummy=True`` (benchmarks only) assigns small random tensors made on the device in the
target dtype instead of reading any weight file, so only config.json is needed; an FP8
config gets FP8 weights and scales in the checkpoint's shapes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specd.kernels.fp8 import FP8_DTYPE
from specd.workers.model.config import ModelConfig, ModelLoadError, load_model_config
from specd.workers.model.fp8_linear import use_fp8_linears
from specd.workers.model.inference_layout import to_inference_layout
from specd.workers.model.llama import LlamaForCausalLM
from specd.workers.model.parallel import SINGLE_RANK, ShardPlan, TpGroup, TpShape
from specd.workers.model.quantization import (
    INPUT_SCALE,
    QuantizationConfig,
    QuantizedWeight,
    TensorHeader,
    canonical_scale,
    check_quantized_tensors,
    dequantize,
    expected_quantized_tensors,
    pop_scales,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ModelLoadError",
    "check_checkpoint",
    "dummy_weights",
    "load_model",
    "read_weights",
    "resolve_dtype",
]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints saved the rope buffer
_KEPT_AS_STORED = (".weight_scale_inv", ".weight_scale", f".{INPUT_SCALE}")  # FP8 scales
_MAX_NAMES_LISTED = 8
_DUMMY_RANGE = 1e-3  # vLLM's dummy init: activations stay finite through any depth


def _checkpoint_dtype(config: ModelConfig) -> str:
    """config.json's dtype; an FP8 checkpoint's is its activation dtype (bfloat16 when it
    names none or names a float8 one)."""
    name = config.torch_dtype
    if config.quantization is not None and (name is None or name.startswith("float8")):
        return "bfloat16"
    return name or "float32"


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype (float32 when config.json names none, bfloat16
    for FP8 checkpoints); never a float8 dtype, which only weights have."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _FLOAT8:
            return dtype
        dtype = str(dtype).removeprefix("torch.")  # refused below
    name = _checkpoint_dtype(config) if dtype == "auto" else dtype
    if name.startswith(("float8", "fp8")):
        raise ModelLoadError(
            f"dtype {name!r} is not an activation dtype: FP8 weights are read from "
            "config.json's quantization_config (quant_method fp8 or compressed-tensors); "
            "set dtype to auto (the checkpoint's activation dtype) or bfloat16"
        )
    if name not in _DTYPES:
        raise ModelLoadError(
            f"dtype {name!r} is not supported; supported: auto, {', '.join(_DTYPES)}"
        )
    return _DTYPES[name]


def weight_files(folder: Path) -> list[Path]:
    """``model.safetensors``, or every shard named by ``model.safetensors.index.json``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index} names shard files that do not exist: {', '.join(missing)}"
            )
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"no weights in {folder}: expected {single.name} or {index.name} (safetensors only)"
    )


def read_weights(
    folder: Path, dtype: torch.dtype, device: str | torch.device, plan: ShardPlan | None = None
) -> dict[str, torch.Tensor]:
    """All checkpoint tensors by name on ``device`` (file by file), cast to ``dtype``
    except FP8 weights and their scales, which keep their stored dtypes.  With a
    tensor-parallel ``plan``, only this rank's piece of each tensor is read."""
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        if plan is None:
            tensors = load_file(file, device=str(device))
        else:
            with safe_open(file, "pt", device=str(device)) as f:
                names = f.keys()  # safe_open is not iterable
                tensors = {name: plan.take(name, f.get_slice(name)) for name in names}
        for name, tensor in tensors.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            as_stored = tensor.dtype == FP8_DTYPE or name.endswith(_KEPT_AS_STORED)
            state[name] = tensor if as_stored else tensor.to(dtype)
    return state


def shard_plan(config: ModelConfig, model: LlamaForCausalLM, tp: TpGroup) -> ShardPlan | None:
    """How this rank cuts the checkpoint into ``model`` (built on meta at ``tp``); None
    at tensor 1."""
    if tp.size == 1:
        return None
    with torch.device("meta"):
        full = LlamaForCausalLM(config)
    return ShardPlan.between(full, model, tp, TpShape.of(config, tp.size).kv_replicas)


def dummy_weights(
    model: torch.nn.Module,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    quantized: Mapping[str, QuantizedWeight] | None = None,
) -> dict[str, torch.Tensor]:
    """Random stand-ins for ``model``'s floating tensors (built on meta), made on ``device``
    in ``dtype`` and filled in place: norm weights 1, everything else uniform in
    +-1e-3.  Non-floating buffers are left to the caller.  ``quantized`` weights come
    as a checkpoint stores them instead: FP8 values in +-1 and a scale of 1e-3."""
    generator = torch.Generator(device).manual_seed(seed)
    quantized = quantized or {}
    weights = {}
    for name, meta in model.state_dict().items():
        if not meta.is_floating_point() or name in quantized:
            continue
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.uniform_(-_DUMMY_RANGE, _DUMMY_RANGE, generator=generator)
        weights[name] = tensor
    for name, q in quantized.items():
        values = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
        weights[name] = values.uniform_(-1.0, 1.0, generator=generator).to(FP8_DTYPE)
        weights[q.scale] = torch.full(q.scale_shapes[0], _DUMMY_RANGE, device=device)
    return weights


def _listed(names: list[str]) -> str:
    more = len(names) - _MAX_NAMES_LISTED
    return ", ".join(names[:_MAX_NAMES_LISTED]) + (f" (and {more} more)" if more > 0 else "")


def check_weights(folder: Path, expected: dict[str, torch.Size], found: Mapping[str, Any]) -> None:
    """Raise ``ModelLoadError`` naming missing, unexpected or wrongly shaped tensors
    (``found``: tensors or anything with a ``shape``)."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelLoadError(f"checkpoint {folder} is missing tensors: {_listed(missing)}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ModelLoadError(f"checkpoint {folder} has unexpected tensors: {_listed(unexpected)}")
    for name, shape in expected.items():
        if tuple(found[name].shape) != tuple(shape):
            raise ModelLoadError(
                f"checkpoint {folder}: tensor {name} has shape {tuple(found[name].shape)}, "
                f"expected {tuple(shape)} from config.json"
            )


@dataclass(slots=True)
class CheckedCheckpoint:
    """What ``check_checkpoint`` learned: the FP8 weights (by name), the scales it took
    out of the tensors (by weight name), and whether the LM head is tied."""

    quantized: dict[str, QuantizedWeight]
    scales: dict[str, Any]
    tie: bool


def check_checkpoint(
    folder: Path,
    model: LlamaForCausalLM,
    found: dict[str, torch.Tensor | TensorHeader],
) -> CheckedCheckpoint:
    """Check ``found`` (the checkpoint's tensors, or their safetensors headers) against ``model`` built on meta: FP8 weights' dtypes and scales
    (``check_quantized_tensors``), then every name and shape (``check_weights``).  Takes
    the scales, and a head ``tie_word_embeddings`` ignores, out of ``found``.

    The LM head is tied when config.json says so or the checkpoint has none."""
    config = model.config
    expected = {name: t.shape for name, t in model.state_dict().items()}
    quantized = expected_quantized_tensors(expected, config.quantization)
    if config.tie_word_embeddings:
        found.pop("lm_head.weight", None)
    headers = {name: TensorHeader.of(t) for name, t in found.items()}
    check_quantized_tensors(folder, quantized, headers, config.quantization)
    scales = pop_scales(found, quantized)
    tie = "lm_head.weight" not in found
    if tie:
        expected.pop("lm_head.weight")
    check_weights(folder, expected, found)
    return CheckedCheckpoint(quantized, scales, tie)


def place_fp8_weights(
    model: LlamaForCausalLM,
    weights: dict[str, torch.Tensor],
    checked: CheckedCheckpoint,
    qconfig: QuantizationConfig,
    dtype: torch.dtype,
    device: str | torch.device,
) -> int:
    """Make ``weights`` (checked) fit ``model`` (on meta): where the device runs FP8
    GEMMs, the dense linears become ``Fp8Linear`` and take their FP8 weight and canonical
    scale; every other FP8 weight is dequantized into ``dtype``, one at a time.  Returns
    how many linears stay FP8."""
    modules = [q.module for q in checked.quantized.values()]
    kept = set(use_fp8_linears(model, modules, qconfig.block, device))
    for name, q in checked.quantized.items():
        scale = canonical_scale(checked.scales.pop(name), q, qconfig)
        if q.module in kept:
            weights[q.scale] = scale
        else:
            weights[name] = dequantize(weights[name], scale, qconfig, dtype)
    return len(kept)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    inference_layout: bool = True,
    dummy: bool = False,
    fused_elementwise: bool = True,
    tp: TpGroup = SINGLE_RANK,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from ``path``/config.json and load its safetensors weights.

    ``dtype``: ``auto`` (the checkpoint's; an FP8 checkpoint's activation dtype),
    ``float32``, ``bfloat16`` or ``float16``.
    The LM head is tied to the embeddings when ``tie_word_embeddings`` is set (a stored
    ``lm_head.weight`` is then ignored, as transformers does) or when the checkpoint has
    no ``lm_head.weight``.  Unless ``inference_layout`` is False, q/k/v and gate/up are
    fused and, on CPU, linear weights stored in their fastest layout (``inference_layout.py``).
    ``dummy``: random weights, no weight file read (``dummy_weights``).
    ``fused_elementwise=False`` keeps the eager elementwise ops on CUDA (benchmarks' A/B).
    ``tp``: this rank's group under tensor parallelism; the rank reads and holds only
    its shard of each tensor (``parallel.py``).
    """
    folder = Path(path)
    config = load_model_config(folder)
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    if dummy:
        shapes = {name: t.shape for name, t in model.state_dict().items()}
        quantized = expected_quantized_tensors(shapes, config.quantization)
        weights = dummy_weights(model, torch_dtype, device, tp.rank, quantized)
    else:
        weights = read_weights(folder, torch_dtype, device, shard_plan(config, model, tp))
    checked = check_checkpoint(folder, model, weights)
    if config.quantization is not None:
        kept = place_fp8_weights(model, weights, checked, config.quantization, torch_dtype, device)
        logger.info(
            "%s: %d FP8 linears, %d dequantized", folder, kept, len(checked.quantized) - kept
        )
    if checked.tie and not config.tie_word_embeddings:
        logger.warning("%s has no lm_head.weight; tying it to the embeddings", folder)
    model.load_state_dict(weights, strict=False, assign=True)
    del weights  # the model holds the tensors now; fusing frees the unfused ones
    if checked.tie:
        model.tie_weights()
    model.eval().requires_grad_(False)
    if inference_layout:
        to_inference_layout(model, fused_elementwise)
    return model, config
