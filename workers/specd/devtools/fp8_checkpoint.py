"""FP8 copies of tiny checkpoints in the published layouts, and their float32 judges.

``quantize_checkpoint`` turns a checkpoint from ``tiny_checkpoint`` into one of the FP8
layouts the engine reads (``specd.workers.model.quantization``), with the tensor names
and ``quantization_config`` fields as published:

- ``block``: ``quant_method: fp8``, ``weight_block_size`` [b0, b1], ``X.weight_scale_inv``
  (Qwen, DeepSeek);
- ``channel`` / ``tensor``: ``quant_method: compressed-tensors``, ``X.weight_scale``
  ``[out, 1]`` or ``[]`` (RedHatAI Llama-3.x-FP8); ``static_activations`` adds a static
  per-tensor ``X.input_scale`` as the older RedHatAI checkpoints carry.

Every decoder-layer linear is quantized (MoE experts included), except router gates;
embeddings, norms and the LM head keep the source dtype.  ``dequantized_reference``
writes the FP8 weights back out as a plain float32 checkpoint (dequantized here with
plain torch, not the engine's kernels), which ``transformers`` loads as the judge.

    python -m specd.devtools.fp8_checkpoint SRC OUT --layout block --block 32 32 \
        [--reference REF_OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specd.kernels.fp8 import FP8_DTYPE, quantize_block, quantize_channel
from specd.workers.model.loader import weight_files
from specd.workers.model.quantization import (
    QuantizationConfig,
    Scheme,
    expected_quantized_tensors,
    parse_quantization,
)

LAYOUTS = ("block", "channel", "tensor")
_STATIC_INPUT_SCALE = 0.05  # any positive value: the engine drops static input scales
# weights and config are rewritten; specd_tiny.json is tiny_checkpoint's cache key
_NOT_COPIED = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "specd_tiny.json",
)


def quantization_config(layout: str, block: tuple[int, int], static_activations: bool) -> dict:
    """``config.json``'s ``quantization_config`` as published for ``layout``."""
    if layout == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
    activations = {"num_bits": 8, "type": "float", "symmetric": True}
    if static_activations:
        activations |= {"strategy": "tensor", "dynamic": False}
    else:
        activations |= {"strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": layout,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _read(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        tensors.update(load_file(file))
    return tensors


def _write(out: Path, src: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """``tensors`` as one ``model.safetensors`` and ``config`` as ``config.json`` in
    ``out``, with every other file of ``src`` (tokenizer, generation config) copied."""
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name not in _NOT_COPIED and not item.name.startswith("model-"):
            shutil.copy(item, out / item.name)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", {"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _quantized(weight: torch.Tensor, layout: str, block: tuple[int, int]):
    """-> (FP8 weight, its scale in the published shape)."""
    if layout == "block":
        return quantize_block(weight.float(), block)
    fp8, scale = quantize_channel(weight.float(), per_tensor=layout == "tensor")
    shape = (weight.shape[0], 1) if layout == "channel" else ()
    return fp8, scale.float().reshape(shape)


def quantize_checkpoint(
    src_folder: str | Path,
    out_folder: str | Path,
    layout: str = "block",
    block: tuple[int, int] = (32, 32),
    static_activations: bool = False,
) -> Path:
    """Write an FP8 copy of ``src_folder`` in ``layout`` (``LAYOUTS``) to ``out_folder``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    src, out = Path(src_folder), Path(out_folder)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(layout, tuple(block), static_activations)
    qconfig = parse_quantization(config)
    tensors = _read(src)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    for name, q in expected_quantized_tensors(shapes, qconfig).items():
        tensors[name], tensors[q.scale] = _quantized(tensors[name], layout, tuple(block))
        if static_activations:
            tensors[q.input_scale] = torch.tensor([_STATIC_INPUT_SCALE])
    return _write(out, src, config, tensors)


def dequantized_weight(
    weight: torch.Tensor, scale: torch.Tensor, qconfig: QuantizationConfig
) -> torch.Tensor:
    """float32 ``weight * scale``, each scale spread over its block, row or tensor."""
    values = weight.float()
    if qconfig.scheme is Scheme.BLOCK:
        b0, b1 = qconfig.block
        spread = scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        return values * spread[: values.shape[0], : values.shape[1]]
    if qconfig.scheme is Scheme.CHANNEL:
        return values * scale.float().reshape(-1, 1)
    return values * scale.float().reshape(())


def dequantized_reference(fp8_folder: str | Path, out_folder: str | Path) -> Path:
    """Write ``fp8_folder``'s model as a plain float32 checkpoint (no quantization_config)
    to ``out_folder``: the weights the engine computes with, for ``transformers``."""
    src, out = Path(fp8_folder), Path(out_folder)
    config = json.loads((src / "config.json").read_text())
    qconfig = parse_quantization(config)
    if qconfig is None:
        raise ValueError(f"{src}/config.json has no quantization_config")
    tensors = _read(src)
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t.dtype == FP8_DTYPE}
    for name, q in expected_quantized_tensors(shapes, qconfig).items():
        tensors[name] = dequantized_weight(tensors[name], tensors.pop(q.scale), qconfig)
        tensors.pop(q.input_scale, None)
    config.pop("quantization_config")
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = "float32"
    return _write(out, src, config, {name: t.float() for name, t in tensors.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a float32 or bf16 checkpoint (tiny_checkpoint)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--layout", choices=LAYOUTS, default="block")
    parser.add_argument("--block", type=int, nargs=2, default=[32, 32], metavar=("ROWS", "COLS"))
    parser.add_argument("--static-activations", action="store_true", help="add input_scale tensors")
    parser.add_argument("--reference", type=Path, help="also write the float32 judge here")
    args = parser.parse_args(argv)
    path = quantize_checkpoint(
        args.src, args.out, args.layout, tuple(args.block), args.static_activations
    )
    print(path)
    if args.reference:
        print(dequantized_reference(path, args.reference))


if __name__ == "__main__":
    main()
