"""Load a local Hugging Face folder (config.json + safetensors) into ``LlamaForCausalLM``.

The model is built on the meta device and the checkpoint tensors, cast to the target
dtype, are assigned in place: no random init, no second copy in another dtype.  Names
and shapes are checked against the model before anything is assigned, so a wrong
checkpoint fails with a message naming the tensor instead of a deep torch error.

``dummy=True`` (benchmarks only) assigns small random tensors made on the device in the
target dtype instead of reading any weight file, so only config.json is needed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from specd.workers.model.config import ModelConfig, ModelLoadError, load_model_config
from specd.workers.model.inference_layout import to_inference_layout
from specd.workers.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

__all__ = ["ModelLoadError", "dummy_weights", "load_model", "read_weights", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints saved the rope buffer
_MAX_NAMES_LISTED = 8
_DUMMY_RANGE = 1e-3  # vLLM's dummy init: activations stay finite through any depth


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype (float32 when config.json names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (config.torch_dtype or "float32") if dtype == "auto" else dtype
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
    folder: Path, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """All checkpoint tensors by name, cast to ``dtype`` on ``device`` (shard by shard)."""
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        for name, tensor in load_file(file, device=str(device)).items():
            if not name.endswith(_IGNORED_SUFFIXES):
                state[name] = tensor.to(dtype)
    return state


def dummy_weights(
    model: torch.nn.Module, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random stand-ins for ``model``'s floating tensors (built on meta), made on ``device``
    in ``dtype`` and filled in place: norm weights 1, everything else uniform in
    +-1e-3.  Non-floating buffers are left to the caller."""
    generator = torch.Generator(device).manual_seed(seed)
    weights = {}
    for name, meta in model.state_dict().items():
        if not meta.is_floating_point():
            continue
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.uniform_(-_DUMMY_RANGE, _DUMMY_RANGE, generator=generator)
        weights[name] = tensor
    return weights


def _listed(names: list[str]) -> str:
    more = len(names) - _MAX_NAMES_LISTED
    return ", ".join(names[:_MAX_NAMES_LISTED]) + (f" (and {more} more)" if more > 0 else "")


def check_weights(
    folder: Path, expected: dict[str, torch.Size], found: dict[str, torch.Tensor]
) -> None:
    """Raise ``ModelLoadError`` naming missing, unexpected or wrongly shaped tensors."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelLoadError(f"checkpoint {folder} is missing tensors: {_listed(missing)}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ModelLoadError(f"checkpoint {folder} has unexpected tensors: {_listed(unexpected)}")
    for name, shape in expected.items():
        if found[name].shape != shape:
            raise ModelLoadError(
                f"checkpoint {folder}: tensor {name} has shape {tuple(found[name].shape)}, "
                f"expected {tuple(shape)} from config.json"
            )


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    inference_layout: bool = True,
    dummy: bool = False,
    fused_elementwise: bool = True,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from ``path``/config.json and load its safetensors weights.

    ``dtype``: ``auto`` (the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.
    The LM head is tied to the embeddings when ``tie_word_embeddings`` is set (a stored
    ``lm_head.weight`` is then ignored, as transformers does) or when the checkpoint has
    no ``lm_head.weight``.  Unless ``inference_layout`` is False, q/k/v and gate/up are
    fused and, on CPU, linear weights stored in their fastest layout (``inference_layout.py``).
    ``dummy``: random weights, no weight file read (``dummy_weights``).
    ``fused_elementwise=False`` keeps the eager elementwise ops on CUDA (benchmarks' A/B).
    """
    folder = Path(path)
    config = load_model_config(folder)
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if dummy:
        weights = dummy_weights(model, torch_dtype, device)
    else:
        weights = read_weights(folder, torch_dtype, device)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    tie = "lm_head.weight" not in weights
    if tie:
        expected.pop("lm_head.weight")
        if not config.tie_word_embeddings:
            logger.warning("%s has no lm_head.weight; tying it to the embeddings", folder)
    check_weights(folder, expected, weights)
    model.load_state_dict(weights, strict=False, assign=True)
    del weights  # the model holds the tensors now; fusing frees the unfused ones
    if tie:
        model.tie_weights()
    model.eval().requires_grad_(False)
    if inference_layout:
        to_inference_layout(model, fused_elementwise)
    return model, config
