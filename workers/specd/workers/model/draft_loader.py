"""Load a published-format EAGLE or EAGLE-3 draft folder next to a loaded target.

A draft folder holds a Llama-style ``config.json`` (EAGLE-3 adds ``draft_vocab_size`` and
maybe ``eagle_config``) and ``pytorch_model.bin`` (how the published checkpoints ship) or
safetensors.  Tensor names are used as published, with no renaming (tables in ``eagle.py``
and ``eagle3.py``).  The draft reuses the target's embedding (and, for EAGLE, its lm_head);
a stored ``embed_tokens.weight`` is shape-checked and dropped, as SGLang and vLLM do.

Everything that can disagree with the target is checked before any tensor is assigned,
with a ``ModelLoadError`` naming the field or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from specd.workers.config import DraftAlgorithm
from specd.workers.model.config import ModelConfig, ModelLoadError, parse_rope
from specd.workers.model.eagle import EagleDraftModel
from specd.workers.model.eagle3 import NUM_AUX_LAYERS, Eagle3DraftModel
from specd.workers.model.inference_layout import to_inference_layout
from specd.workers.model.llama import LlamaForCausalLM
from specd.workers.model.loader import check_weights, dummy_weights, resolve_dtype
from specd.workers.model.parallel import SINGLE_RANK, ShardPlan, TpGroup, TpShape
from specd.workers.model.token_map import FIELD as TOKEN_MAP_FIELD
from specd.workers.model.token_map import read_token_map

logger = logging.getLogger(__name__)

__all__ = ["DraftConfig", "DraftModel", "load_draft", "parse_draft_config", "read_draft_weights"]

DraftModel = EagleDraftModel | Eagle3DraftModel
_EMBED = "embed_tokens.weight"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_WEIGHT_FILES = (  # in the order they are looked for
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """What the engine needs to know about a loaded draft."""

    algorithm: DraftAlgorithm
    model: ModelConfig  # the draft's decoder layer(s): widths, heads, rope, eps
    vocab_size: int  # the target's vocabulary (draft tokens are target ids after mapping)
    draft_vocab_size: int  # rows of the draft's logits; EAGLE: vocab_size, or its token map's
    fc_bias: bool
    # EAGLE-3: target residual streams to capture (``forward_with_aux`` indices, ascending,
    # the order ``fuse_aux_hidden`` takes them).  EAGLE: () -- it takes the final-normed
    # hidden that ``LlamaForCausalLM.forward`` returns.
    aux_layer_ids: tuple[int, ...] = ()

    @property
    def num_kv_layers(self) -> int:
        """Layers of the draft's own ``KVPool`` (addressed by the target's slots)."""
        return self.model.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.model.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim


def load_draft(
    path: str | Path,
    algorithm: str | DraftAlgorithm,
    target_model: LlamaForCausalLM,
    target_config: ModelConfig,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    inference_layout: bool = True,
    dummy: bool = False,
    fused_elementwise: bool = True,
    token_map: str | Path | None = None,
) -> tuple[DraftModel, DraftConfig]:
    """Build the draft described by ``path``/config.json and load its weights.

    ``dtype`` ``auto`` means the target's dtype (the reference casts the draft to the base
    model's dtype).  Unless ``inference_layout`` is False the projections are fused and,
    on CPU, linear weights stored in their fastest layout (``inference_layout.py``).
    ``dummy`` (benchmarks): random weights from config.json alone (``loader.dummy_weights``)
    and, for EAGLE-3, the identity vocab map (draft id i -> target id i).
    ``fused_elementwise``: as in ``load_model``.  ``token_map`` (EAGLE): a file of the
    target ids the draft may propose (``token_map.py``); its head keeps only their rows.
    """
    folder = Path(path)
    algo = _algorithm(algorithm)
    config = parse_draft_config(_read_config(folder), algo, target_config)
    embed_tokens = target_model.model.embed_tokens
    torch_dtype = (
        embed_tokens.weight.dtype if dtype == "auto" else resolve_dtype(dtype, config.model)
    )
    tp = target_model.tp  # the draft runs on every rank, sharded as the target
    model = _draft_on_meta(algo, config, target_model, tp)
    if dummy:
        weights = dummy_weights(model, torch_dtype, device, tp.rank)
    else:
        weights = read_draft_weights(folder, torch_dtype, device)
        _check_format(folder, algo, weights)
        _drop_stored_embedding(folder, weights, target_config)
        if tp.size > 1:  # a draft is small: read whole, then cut to this rank's shard
            full = _draft_on_meta(algo, config, target_model, SINGLE_RANK)
            kv_replicas = TpShape.of(config.model, tp.size, "draft").kv_replicas
            plan = ShardPlan.between(full, model, tp, kv_replicas)
            weights = {name: plan.take(name, t) for name, t in weights.items()}
    if algo is DraftAlgorithm.EAGLE3:
        _complete_vocab_map(folder, weights, config, device, identity=dummy)
    check_weights(folder, {name: t.shape for name, t in model.state_dict().items()}, weights)
    model.load_state_dict(weights, assign=True)
    del weights  # the model holds the tensors now; fusing frees the unfused ones
    model.eval().requires_grad_(False)
    if token_map is not None:
        config = _restrict_vocab(model, config, token_map, target_model)
    if inference_layout:
        to_inference_layout(model, fused_elementwise)
    logger.info(
        "loaded %s draft from %s: %d layer(s), draft vocab %d, aux layers %s",
        algo.value,
        folder,
        config.num_kv_layers,
        config.draft_vocab_size,
        config.aux_layer_ids,
    )
    return model, config


def _restrict_vocab(
    model: DraftModel, config: DraftConfig, token_map: str | Path, target: LlamaForCausalLM
) -> DraftConfig:
    """Have an EAGLE draft propose only the token map's ids (before its layout is set, so
    the map's head gets the fastest one too)."""
    if not isinstance(model, EagleDraftModel):
        raise ModelLoadError(
            f"{TOKEN_MAP_FIELD}: {config.algorithm.value} drafts carry their own vocabulary "
            "map (d2t); a token map applies to EAGLE drafts: leave tokenMap out"
        )
    ids = read_token_map(token_map, config.vocab_size)
    model.restrict_vocab(ids, target.compute_logits)
    logger.info("draft proposes the %d token ids of %s", ids.numel(), token_map)
    return dataclasses.replace(config, draft_vocab_size=ids.numel())


def _draft_on_meta(
    algo: DraftAlgorithm, config: DraftConfig, target: LlamaForCausalLM, tp: TpGroup
) -> DraftModel:
    """The draft built on the meta device, sharing the target's embedding (and EAGLE's
    head), at tensor size ``tp.size``."""
    embed_tokens = target.model.embed_tokens
    with torch.device("meta"):
        if algo is DraftAlgorithm.EAGLE:
            return EagleDraftModel(config.model, embed_tokens, target.lm_head, config.fc_bias, tp)
        return Eagle3DraftModel(
            config.model, config.draft_vocab_size, embed_tokens, config.fc_bias, tp
        )


def parse_draft_config(
    raw: dict[str, Any], algorithm: DraftAlgorithm, target: ModelConfig
) -> DraftConfig:
    """Draft ``config.json`` dict -> ``DraftConfig``, checked against the target's config."""
    try:
        layer = _layer_config(raw, algorithm)
    except KeyError as err:
        raise ModelLoadError(f"spec.draft: config.json is missing required key {err}") from None
    if layer.hidden_size != target.hidden_size:
        raise ModelLoadError(
            f"spec.draft: draft hidden size {layer.hidden_size} != target hidden size "
            f"{target.hidden_size}"
        )
    if layer.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"spec.draft: draft vocab size {layer.vocab_size} (config.json vocab_size) != "
            f"target vocab size {target.vocab_size}"
        )
    if algorithm is DraftAlgorithm.EAGLE:
        return DraftConfig(
            algorithm=algorithm,
            model=layer,
            vocab_size=target.vocab_size,
            draft_vocab_size=target.vocab_size,
            fc_bias=bool(raw.get("bias", True)),  # the reference's default
        )
    _check_eagle3_fields(raw, layer, target)
    draft_vocab = raw.get("draft_vocab_size") or target.vocab_size
    if not 0 < draft_vocab <= target.vocab_size:
        raise ModelLoadError(
            f"spec.draft: draft_vocab_size {draft_vocab} must be in [1, target vocab size "
            f"{target.vocab_size}]"
        )
    return DraftConfig(
        algorithm=algorithm,
        model=layer,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab,
        fc_bias=bool(raw.get("bias", False)),  # SGLang's default; the reference has none
        aux_layer_ids=eagle3_aux_layer_ids(raw, target.num_hidden_layers),
    )


def eagle3_aux_layer_ids(raw: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """Target layers whose incoming residual stream EAGLE-3 fuses, ascending.

    Default ``(2, L // 2, L - 3)``, the layers the reference captures the input of.
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` names layers whose *output* is taken,
    so each id maps to ``id + 1`` here (as SGLang does).  Capture happens in layer order,
    so the fused order is ascending whatever order the config lists.
    """
    layers = num_target_layers
    override = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = [2, layers // 2, layers - 3] if override is None else [i + 1 for i in override]
    field = (
        "eagle_config.eagle_aux_hidden_state_layer_ids"
        if override is not None
        else f"the default EAGLE-3 layers (2, L//2, L-3) for L={layers}"
    )
    if len(ids) != NUM_AUX_LAYERS or len(set(ids)) != len(ids):
        raise ModelLoadError(
            f"spec.draft: {field} must name {NUM_AUX_LAYERS} distinct target layers; "
            f"got capture points {ids}"
        )
    if not all(0 <= i <= layers for i in ids):
        raise ModelLoadError(
            f"spec.draft: {field} gives capture points {ids} outside [0, {layers}] for a "
            f"target with {layers} layers"
        )
    return tuple(sorted(ids))


def read_draft_weights(
    folder: Path, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint; floating ones cast to ``dtype`` (the int64
    ``d2t`` and bool ``t2d`` keep their types)."""
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        if file.suffix == ".safetensors":
            tensors = load_file(file, device=str(device))
        else:
            tensors = torch.load(file, map_location=device, weights_only=True)
        for name, tensor in tensors.items():
            if not name.endswith(_IGNORED_SUFFIXES):
                state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def _algorithm(algorithm: str | DraftAlgorithm) -> DraftAlgorithm:
    try:
        return DraftAlgorithm(algorithm)
    except ValueError:
        supported = ", ".join(a.value for a in DraftAlgorithm)
        raise ModelLoadError(
            f"spec.draft.algorithm: {algorithm!r} is not supported; supported: {supported}"
        ) from None


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise ModelLoadError(f"spec.draft: draft folder {folder} does not exist")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"spec.draft: draft folder {folder} has no config.json")
    return json.loads(config_file.read_text())


def _layer_config(raw: dict[str, Any], algorithm: DraftAlgorithm) -> ModelConfig:
    """The draft decoder's settings, in the target's ``ModelConfig`` shape."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"spec.draft: config.json hidden_act {act!r} is not supported")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    is_eagle3 = algorithm is DraftAlgorithm.EAGLE3
    # cnets1 (EAGLE) always derives head_dim; cnets (EAGLE-3) honours a configured one.
    head_dim = (raw.get("head_dim") if is_eagle3 else None) or hidden // heads
    return ModelConfig(
        architecture=(raw.get("architectures") or [algorithm.value])[0],
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw.get("num_hidden_layers", 1),
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),  # EConfig's default
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope=parse_rope(raw),
        attention_bias=not is_eagle3 and bool(raw.get("qkv_bias", False)),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _check_eagle3_fields(raw: dict[str, Any], layer: ModelConfig, target: ModelConfig) -> None:
    if layer.num_hidden_layers != 1:
        raise ModelLoadError(
            f"spec.draft: EAGLE-3 num_hidden_layers {layer.num_hidden_layers} is not "
            "supported; published EAGLE-3 heads have exactly one midlayer"
        )
    target_hidden = raw.get("target_hidden_size", target.hidden_size)
    if target_hidden != target.hidden_size:
        raise ModelLoadError(
            f"spec.draft: draft target_hidden_size {target_hidden} != target hidden size "
            f"{target.hidden_size}"
        )
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False:
        raise ModelLoadError(
            "spec.draft: eagle_config.use_aux_hidden_state=false is not supported "
            "(EAGLE-3 fuses three target layers)"
        )


def _weight_files(folder: Path) -> list[Path]:
    for name in _WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise ModelLoadError(
                f"{path} names shard files that do not exist: {', '.join(missing)}"
            )
        return [folder / shard for shard in shards]
    raise ModelLoadError(
        f"spec.draft: no weights in {folder}: expected one of {', '.join(_WEIGHT_FILES)}"
    )


def _check_format(
    folder: Path, algorithm: DraftAlgorithm, weights: dict[str, torch.Tensor]
) -> None:
    """Name the right algorithm when the folder holds the other format."""
    eagle3 = any(name.startswith("midlayer.") for name in weights)
    eagle = any(name.startswith("layers.") for name in weights)
    if algorithm is DraftAlgorithm.EAGLE and eagle3 and not eagle:
        raise ModelLoadError(
            f"spec.draft: {folder} holds an EAGLE-3 checkpoint (midlayer.* tensors) but "
            "spec.draft.algorithm is EAGLE; set it to EAGLE3"
        )
    if algorithm is DraftAlgorithm.EAGLE3 and eagle and not eagle3:
        raise ModelLoadError(
            f"spec.draft: {folder} holds an EAGLE checkpoint (layers.* tensors) but "
            "spec.draft.algorithm is EAGLE3; set it to EAGLE"
        )


def _drop_stored_embedding(
    folder: Path, weights: dict[str, torch.Tensor], target: ModelConfig
) -> None:
    """Published EAGLE checkpoints store a frozen copy of the target's embedding; it is
    checked and dropped so the target's single copy serves both models."""
    stored = weights.pop(_EMBED, None)
    expected = (target.vocab_size, target.hidden_size)
    if stored is not None and tuple(stored.shape) != expected:
        raise ModelLoadError(
            f"checkpoint {folder}: tensor {_EMBED} has shape {tuple(stored.shape)}, expected "
            f"{expected} (the target's embedding)"
        )


def _complete_vocab_map(
    folder: Path,
    weights: dict[str, torch.Tensor],
    config: DraftConfig,
    device: str | torch.device,
    identity: bool = False,
) -> None:
    """Fill in the identity ``d2t``/``t2d`` (draft id i -> target id i) for full-vocab
    drafts that omit them (the reference deletes both when draft_vocab_size ==
    vocab_size), or for any draft when ``identity`` (dummy weights); then validate ``d2t``."""
    vocab, draft_vocab = config.vocab_size, config.draft_vocab_size
    if identity or draft_vocab == vocab:
        weights.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.int64, device=device))
        weights.setdefault("t2d", torch.arange(vocab, device=device) < draft_vocab)
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if d2t is None or t2d is None:
        return  # check_weights names the missing tensor
    if d2t.is_floating_point():
        raise ModelLoadError(f"checkpoint {folder}: tensor d2t must hold integer id offsets")
    if d2t.shape != (draft_vocab,):
        return  # check_weights names the shape
    weights["d2t"], weights["t2d"] = d2t.to(torch.int64), t2d.to(torch.bool)
    _check_d2t(folder, weights["d2t"], weights["t2d"], vocab)


def _check_d2t(folder: Path, d2t: torch.Tensor, t2d: torch.Tensor, vocab: int) -> None:
    """``d2t`` must map each draft id to a distinct id inside the target vocabulary."""
    target_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t  # [draft_vocab]
    bad = ((target_ids < 0) | (target_ids >= vocab)).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise ModelLoadError(
            f"spec.draft: d2t in {folder} maps draft id {i} to target id {int(target_ids[i])}, "
            f"outside the target vocab [0, {vocab}) ({len(bad)} ids out of range)"
        )
    if torch.unique(target_ids).numel() != target_ids.numel():
        raise ModelLoadError(
            f"spec.draft: d2t in {folder} maps several draft ids to the same target id"
        )
    if t2d.shape == (vocab,) and (int(t2d.sum()) != len(target_ids) or not t2d[target_ids].all()):
        logger.warning(
            "%s: t2d does not mark exactly the target ids d2t maps to; using d2t", folder
        )
