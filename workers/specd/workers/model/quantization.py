"""FP8 checkpoints: what a ``quantization_config`` means, and which tensors it implies.

Two published layouts are read, both with ``float8_e4m3fn`` weights ``[out, in]``:

- **block-wise** (``quant_method: fp8``, as Qwen and DeepSeek publish): a float32
  ``X.weight_scale_inv`` of ``[ceil(out/b0), ceil(in/b1)]`` for ``weight_block_size``
  ``[b0, b1]``; the weight is ``fp8 * scale_inv`` block by block (the last row and
  column of blocks may be partial).
- **compressed-tensors** (``quant_method: compressed-tensors``, as RedHatAI publishes
  Llama-3.x-FP8): a float32 ``X.weight_scale`` of ``[out, 1]`` (strategy ``channel``) or
  ``[1]`` / ``[]`` (strategy ``tensor``), and for static activations an
  ``X.input_scale``, which is read and dropped: activations are always quantized per
  token at run time (dynamic), which needs no calibrated scale and is at least as exact.

What is quantized: every linear weight inside the decoder layers (2-D ``*.weight`` under
``model.layers.``), MoE experts included, except the MoE router gates and the modules
the config ignores.  Embeddings, norms and the LM head stay in the activation dtype.
Anything else (AWQ, GPTQ, int8, group or block strategies of compressed-tensors, static
activation scales for block-wise FP8) is refused at config parse, naming the field.

Scales are normalised at load (``canonical_scale``): block scales stay 2-D, channel and
tensor scales become one float32 per output row ``[out]`` (a per-tensor scale broadcast,
which is exact), so the kernels see two layouts, not three.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import torch

from specd.kernels import fp8
from specd.workers.model.errors import ModelLoadError

_SUPPORTED_FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors' FP8 formats
FP8_CODE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
_FLOAT_CODES = ("F32", "BF16", "F16", "F64")
_SAFETENSORS_CODES = {
    torch.float8_e4m3fn: FP8_CODE,
    torch.float8_e5m2: "F8_E5M2",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
}
_LAYERS_PREFIX = "model.layers."
# MoE routers: one tiny linear per layer, kept in high precision by every published FP8 MoE
_ROUTER_GATES = ("mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate")
INPUT_SCALE = "input_scale"
T = TypeVar("T")


class Scheme(str, Enum):
    """How the weight scales are laid out in the checkpoint."""

    BLOCK = "block"  # weight_scale_inv [ceil(out/b0), ceil(in/b1)]
    CHANNEL = "channel"  # weight_scale [out, 1]
    TENSOR = "tensor"  # weight_scale [1] or []


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """An FP8 checkpoint's ``quantization_config`` as this engine runs it."""

    method: str  # quant_method as written: "fp8" or "compressed-tensors"
    scheme: Scheme
    block: tuple[int, int] | None = None  # BLOCK only: weight_block_size (rows, cols)
    # modules kept in high precision: a dotted name (or a run of its parts, as
    # "lm_head" or "mlp.gate"), or "re:" and a regular expression (compressed-tensors)
    ignored: tuple[str, ...] = ()

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.scheme is Scheme.BLOCK else "weight_scale"


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """One FP8 linear weight of the checkpoint and the scale tensor it comes with."""

    module: str  # "model.layers.0.self_attn.q_proj"
    shape: tuple[int, int]  # [out, in]
    scale: str  # the scale tensor's name
    scale_shapes: tuple[tuple[int, ...], ...]  # the shapes it may have; the first is canonical
    scale_rule: str  # why those shapes, for error messages

    @property
    def weight(self) -> str:
        return f"{self.module}.weight"

    @property
    def input_scale(self) -> str:
        return f"{self.module}.{INPUT_SCALE}"


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """One tensor as a safetensors header describes it (nothing read), or as ``of`` a
    tensor read: what the checks of an FP8 checkpoint look at."""

    dtype: str  # safetensors' code: "F8_E4M3", "BF16", "F32", ...
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor | TensorHeader) -> TensorHeader:
        """A read tensor's header; a header (from a file, unread) as it is."""
        if isinstance(tensor, TensorHeader):
            return tensor
        return cls(_SAFETENSORS_CODES.get(tensor.dtype, str(tensor.dtype)), tuple(tensor.shape))


def _refuse(field: str, value: Any, supported: str) -> ModelLoadError:
    return ModelLoadError(
        f"config.json: quantization_config.{field} {value!r} is not supported; supported: "
        f"{supported}"
    )


def parse_quantization(raw: Mapping[str, Any]) -> QuantizationConfig | None:
    """``config.json``'s ``quantization_config`` (None when the checkpoint has none)."""
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ModelLoadError("config.json: quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_block_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise _refuse(
        "quant_method",
        method,
        "fp8 (block-wise, weight_block_size), compressed-tensors (FP8 weights per channel "
        "or per tensor)",
    )


def _parse_block_fp8(qc: Mapping[str, Any]) -> QuantizationConfig:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, "e4m3 (float8_e4m3fn weights)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(
            "activation_scheme",
            scheme,
            "dynamic (activations are quantized per token at run time; a static "
            "checkpoint's calibrated input scales are not used)",
        )
    block = qc.get("weight_block_size")
    if block is None:
        raise ModelLoadError(
            "config.json: quantization_config.weight_block_size is missing: quant_method "
            "fp8 is read as block-wise FP8 (e.g. weight_block_size [128, 128]); per-tensor "
            "FP8 checkpoints are read in the compressed-tensors layout"
        )
    if not (
        isinstance(block, Sequence)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise _refuse("weight_block_size", block, "two positive integers, e.g. [128, 128]")
    if not fp8.supported_block(tuple(block)):
        raise _refuse("weight_block_size", list(block), fp8.SUPPORTED_BLOCKS_TEXT)
    ignored = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return QuantizationConfig("fp8", Scheme.BLOCK, (block[0], block[1]), tuple(ignored))


def _parse_compressed_tensors(qc: Mapping[str, Any]) -> QuantizationConfig:
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ModelLoadError(
            "config.json: quantization_config.config_groups is missing: a compressed-tensors "
            "checkpoint names its weight scheme there"
        )
    strategies = {_group_strategy(f"config_groups.{name}", g) for name, g in groups.items()}
    if len(strategies) > 1:
        raise _refuse("config_groups", sorted(strategies), "one weight strategy for every group")
    fmt = qc.get("format")
    if fmt is not None and fmt not in _SUPPORTED_FORMATS:
        raise _refuse("format", fmt, ", ".join(_SUPPORTED_FORMATS))
    if qc.get("kv_cache_scheme") is not None:
        raise ModelLoadError(
            "config.json: quantization_config.kv_cache_scheme is not supported: the KV "
            "cache stays in the activation dtype; use a checkpoint without FP8 KV scales"
        )
    return QuantizationConfig(
        "compressed-tensors", Scheme(strategies.pop()), None, tuple(qc.get("ignore") or ())
    )


def _group_strategy(where: str, group: Mapping[str, Any]) -> str:
    """A config group's weight strategy (``channel`` or ``tensor``), after refusing what
    the engine cannot run exactly, naming the field."""
    targets = group.get("targets")
    if list(targets or ()) != ["Linear"]:
        raise _refuse(f"{where}.targets", targets, "['Linear']")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise ModelLoadError(f"config.json: quantization_config.{where}.weights is missing")
    _check_fp8_args(f"{where}.weights", weights)
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise _refuse(f"{where}.weights.strategy", strategy, "channel, tensor")
    if weights.get("symmetric", True) is not True:
        raise _refuse(f"{where}.weights.symmetric", weights.get("symmetric"), "true")
    if weights.get("dynamic", False) is not False:
        raise _refuse(f"{where}.weights.dynamic", weights.get("dynamic"), "false")
    activations = group.get("input_activations")
    if activations is not None:
        _check_fp8_args(f"{where}.input_activations", activations)
        if activations.get("strategy") not in ("token", "tensor"):
            raise _refuse(
                f"{where}.input_activations.strategy", activations.get("strategy"), "token, tensor"
            )
    if group.get("output_activations") is not None:
        raise _refuse(f"{where}.output_activations", group["output_activations"], "null")
    return strategy


def _check_fp8_args(where: str, args: Mapping[str, Any]) -> None:
    if args.get("num_bits") != 8:
        raise _refuse(f"{where}.num_bits", args.get("num_bits"), "8 (FP8)")
    if args.get("type") != "float":
        raise _refuse(f"{where}.type", args.get("type"), "float (FP8 e4m3)")


def _ignored(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return f".{pattern}." in f".{module}."


def is_quantized_linear(module: str, qconfig: QuantizationConfig) -> bool:
    """Whether ``module`` (a linear's dotted name) holds FP8 weights in the checkpoint."""
    if not module.startswith(_LAYERS_PREFIX):
        return False  # embeddings and the LM head stay in the activation dtype
    if module.endswith(tuple(f".{gate}" for gate in _ROUTER_GATES)):
        return False
    return not any(_ignored(module, pattern) for pattern in qconfig.ignored)


def _scale_shapes(qconfig: QuantizationConfig, out: int, inp: int):
    if qconfig.scheme is Scheme.BLOCK:
        b0, b1 = qconfig.block
        return (
            ((math.ceil(out / b0), math.ceil(inp / b1)),),
            f"one per {b0}x{b1} block of the [{out}, {inp}] weight "
            f"(quantization_config.weight_block_size)",
        )
    if qconfig.scheme is Scheme.CHANNEL:
        return ((out, 1), (out,)), "one per output row (weights.strategy channel)"
    return ((), (1,)), "one for the tensor (weights.strategy tensor)"


def expected_quantized_tensors(
    model_shapes: Mapping[str, Sequence[int]], qconfig: QuantizationConfig | None
) -> dict[str, QuantizedWeight]:
    """The FP8 weights the checkpoint holds, by weight name, from the model's state-dict
    names and shapes (built on meta, in the checkpoint's names); ``{}`` unquantized."""
    if qconfig is None:
        return {}
    quantized = {}
    for name, shape in model_shapes.items():
        module = name.removesuffix(".weight")
        if module == name or len(shape) != 2 or not is_quantized_linear(module, qconfig):
            continue
        out, inp = shape
        shapes, rule = _scale_shapes(qconfig, out, inp)
        scale = f"{module}.{qconfig.scale_suffix}"
        quantized[name] = QuantizedWeight(module, (out, inp), scale, shapes, rule)
    return quantized


def check_quantized_tensors(
    folder: Path,
    quantized: Mapping[str, QuantizedWeight],
    found: Mapping[str, TensorHeader],
    qconfig: QuantizationConfig | None,
) -> None:
    """Raise ``ModelLoadError`` naming an FP8 weight of the wrong dtype, a missing or
    misshapen scale, or an FP8 tensor the config does not quantize.  Missing weights
    and wrong weight shapes are left to ``check_weights``."""
    for q in quantized.values():
        weight = found.get(q.weight)
        if weight is None:
            continue
        if weight.dtype != FP8_CODE:
            raise ModelLoadError(
                f"checkpoint {folder}: tensor {q.weight} is {weight.dtype}, expected "
                f"{FP8_CODE} (float8_e4m3fn): config.json's quantization_config quantizes it"
            )
        scale = found.get(q.scale)
        if scale is None:
            raise ModelLoadError(
                f"checkpoint {folder} is missing tensor {q.scale}: the float32 scale of "
                f"FP8 weight {q.weight}, {q.scale_rule}"
            )
        if scale.dtype not in _FLOAT_CODES or tuple(scale.shape) not in q.scale_shapes:
            raise ModelLoadError(
                f"checkpoint {folder}: tensor {q.scale} is {scale.dtype} "
                f"{list(scale.shape)}, expected F32 {list(q.scale_shapes[0])}: {q.scale_rule}"
            )
        input_scale = found.get(q.input_scale)
        if input_scale is not None and math.prod(input_scale.shape) != 1:
            raise ModelLoadError(
                f"checkpoint {folder}: tensor {q.input_scale} has shape "
                f"{list(input_scale.shape)}, expected one value (a per-tensor input scale)"
            )
    for name, info in found.items():
        if info.dtype.startswith("F8") and name not in quantized:
            why = (
                "config.json has no quantization_config"
                if qconfig is None
                else "quantization_config does not quantize it (an ignored module, a "
                "router gate, or not a decoder-layer linear)"
            )
            raise ModelLoadError(f"checkpoint {folder}: tensor {name} is {info.dtype}, but {why}")


def pop_scales(found: dict[str, T], quantized: Mapping[str, QuantizedWeight]) -> dict[str, T]:
    """Take the scale tensors out of ``found`` (which then holds the model's names only):
    -> ``{weight name: its scale}``.  Input scales are dropped (see the module docstring)."""
    scales = {}
    for name, q in quantized.items():
        found.pop(q.input_scale, None)
        if q.scale in found:
            scales[name] = found.pop(q.scale)
    return scales


def canonical_scale(
    scale: torch.Tensor, q: QuantizedWeight, qconfig: QuantizationConfig
) -> torch.Tensor:
    """float32 ``[ceil(out/b0), ceil(in/b1)]`` for block scales; ``[out]`` (one per output
    row) for channel and tensor scales."""
    scale = scale.float()
    if qconfig.scheme is Scheme.BLOCK:
        return scale.contiguous()
    return scale.reshape(-1).expand(q.shape[0]).contiguous()


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, qconfig: QuantizationConfig, dtype: torch.dtype
) -> torch.Tensor:
    """An FP8 weight ``[out, in]`` and its canonical scale -> the weight in ``dtype``."""
    if qconfig.scheme is Scheme.BLOCK:
        return fp8.dequantize_block(weight, scale, qconfig.block, dtype)
    return fp8.dequantize_channel(weight, scale, dtype)
