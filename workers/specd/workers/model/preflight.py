"""What ``specd validate`` checks of a spec's model folders, without loading a weight.

The target: config.json parses and names a supported architecture, rope and
quantization (`load_model_config`), the dtype resolves, the weight files exist, and their
tensors' names and shapes, read from the safetensors headers, are the ones the model
built on the meta device expects; an FP8 checkpoint's weights are FP8 and come with
scales of the right shapes (`check_checkpoint`, as the loader checks).  The tokenizer
loads.  The draft: its config.json agrees with the target's (hidden size, vocabulary;
EAGLE-3's fields: `parse_draft_config`) and its weight files exist.  Every error names
the spec field: ``spec.model.path: ...``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from specd.workers.config import ConfigError, DeploymentSpec, DraftSpec
from specd.workers.model.config import ModelConfig, ModelLoadError, load_model_config
from specd.workers.model.draft_loader import DraftConfig, parse_draft_config
from specd.workers.model.llama import LlamaForCausalLM
from specd.workers.model.loader import check_checkpoint, resolve_dtype, weight_files
from specd.workers.model.parallel import FIELD, TpShape
from specd.workers.model.quantization import TensorHeader
from specd.workers.model.tokenizer import load_tokenizer

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # as the loader: old checkpoints' rope buffer
_DRAFT_WEIGHT_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def safetensors_headers(file: Path) -> dict[str, TensorHeader]:
    """The tensors of a safetensors file, from its header: an 8-byte little-endian
    length, then that many bytes of JSON (``name -> {dtype, shape, data_offsets}``)."""
    with file.open("rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= _MAX_HEADER_BYTES:
            raise ModelLoadError(f"{file} is not a safetensors file (no header)")
        try:
            header = json.loads(f.read(size))
        except ValueError as err:
            raise ModelLoadError(f"{file} is not a safetensors file: {err}") from None
    return {
        name: TensorHeader(entry["dtype"], tuple(entry["shape"]))
        for name, entry in header.items()
        if name != "__metadata__"
    }


def check_target(path: str, dtype: str, weights: bool = True) -> ModelConfig:
    """The target folder would load (see the module docstring; its weights left out
    unless ``weights``); returns its config."""
    folder = Path(path)
    config = load_model_config(folder)
    resolve_dtype(dtype, config)
    if not weights:
        return config
    found: dict[str, TensorHeader] = {}
    for file in weight_files(folder):
        found.update(safetensors_headers(file))
    found = {n: t for n, t in found.items() if not n.endswith(_IGNORED_SUFFIXES)}
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    check_checkpoint(folder, model, found)
    return config


def check_draft(draft: DraftSpec, target: ModelConfig, weights: bool = True) -> DraftConfig:
    """The draft's config.json agrees with the target and (``weights``) its weights
    exist; returns its config."""
    folder = Path(draft.path)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise ModelLoadError(f"draft folder {folder} does not exist")
    if not config_file.is_file():
        raise ModelLoadError(f"draft folder {folder} has no config.json")
    config = parse_draft_config(json.loads(config_file.read_text()), draft.algorithm, target)
    if weights and not any((folder / name).is_file() for name in _DRAFT_WEIGHT_FILES):
        raise ModelLoadError(
            f"no weights in {folder}: expected one of {', '.join(_DRAFT_WEIGHT_FILES)}"
        )
    return config


def check_model_folders(spec: DeploymentSpec, weights: bool = True) -> None:
    """Raise `ConfigError` naming the spec field whose folder would not load; without
    ``weights`` (the benchmarks' dummy weights) the weight files are not looked at."""
    target = _about(
        "spec.model.path", check_target, spec.model.path, spec.model.dtype.value, weights
    )
    tensor = spec.parallelism.tensor
    _about(FIELD, TpShape.of, target, tensor)
    tokenizer_field = "spec.model.tokenizer" if spec.model.tokenizer else "spec.model.path"
    _about(tokenizer_field, load_tokenizer, spec.model.tokenizer or spec.model.path)
    if spec.has_draft_model:  # NGRAM and SUFFIX have no draft folder
        draft = _about("spec.draft.path", check_draft, spec.draft, target, weights)
        _about(FIELD, TpShape.of, draft.model, tensor, "draft")


def _about(field: str, check, *args):
    """``check(*args)``, its `ModelLoadError` as a `ConfigError` that names ``field``
    (or the more precise field the loader named, e.g. ``spec.draft.algorithm``)."""
    try:
        return check(*args)
    except ModelLoadError as err:
        message = str(err).removeprefix("spec.draft: ")
        if not message.startswith("spec."):
            message = f"{field}: {message}"
        raise ConfigError(message) from None
