"""Tiny random EAGLE / EAGLE-3 draft checkpoints for a tiny target, in the published layout.

``config.json`` keys, tensor names, shapes, dtypes and the weights file
(``pytorch_model.bin`` as ``yuhuili/EAGLE-*`` and ``yuhuili/EAGLE3-*`` ship, or
``model.safetensors``) match the published checkpoints, so loading these exercises the
real format.  Norm weights are random around 1 (not all ones) so that a swapped or
skipped norm changes the numbers.  Built offline and deterministically in well under a
second.

    python -m specd.devtools.tiny_draft OUT_DIR TARGET_DIR --algorithm EAGLE3
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specd.workers.model.config import ModelConfig, load_model_config
from specd.workers.model.loader import weight_files

_SPEC_FILE = "specd_tiny_draft.json"  # the arguments a folder was built with (the cache key)
_TARGET_EMBED = "model.embed_tokens.weight"
WEIGHT_FORMATS = ("bin", "safetensors")


def make_tiny_eagle(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    fc_bias: bool = True,
    weights_format: str = "bin",
) -> Path:
    """Write an EAGLE (v1) head for the target in ``target_dir``; returns ``out_dir``.

    ``fc_bias=False`` writes ``"bias": false`` as EAGLE-LLaMA3-Instruct-8B does; a Qwen2
    target (q/k/v biases) gets ``"qkv_bias": true`` and q/k/v bias tensors.
    """
    spec = dict(
        algorithm="EAGLE",
        target=str(target_dir),
        seed=seed,
        dtype=dtype,
        fc_bias=fc_bias,
        weights_format=weights_format,
    )
    out = _prepare(out_dir, spec)
    if out is None:
        return Path(out_dir)
    target, raw = _target(target_dir)
    qkv_bias = target.attention_bias
    config = _llama_config(target, raw, dtype, architecture="LlamaForCausalLM")
    if not fc_bias:
        config["bias"] = False
    if qkv_bias:
        config["qkv_bias"] = True
    g = torch.Generator().manual_seed(seed)
    hidden = target.hidden_size
    weights = {"fc.weight": _linear(g, hidden, 2 * hidden)}
    if fc_bias:
        weights["fc.bias"] = 0.1 * torch.randn(hidden, generator=g)
    # EAGLE (v1) derives its head size from hidden / heads whatever the target's is
    head_dim = hidden // target.num_attention_heads
    weights.update(_attention(g, target, "layers.0.self_attn", hidden, head_dim, bias=qkv_bias))
    weights.update(_mlp(g, target, "layers.0.mlp"))
    # Layer 0 has no input_layernorm in the published structure.
    weights["layers.0.post_attention_layernorm.weight"] = _norm(g, hidden)
    weights["embed_tokens.weight"] = _target_embedding(Path(target_dir))
    _write(out, config, weights, dtype, weights_format, spec)
    return out


def make_tiny_eagle3(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    draft_vocab_size: int = 128,
    seed: int = 0,
    dtype: str = "float32",
    aux_layer_ids: list[int] | None = None,
    weights_format: str = "bin",
    keep_ids: Sequence[int] = (),
) -> Path:
    """Write an EAGLE-3 head for the target in ``target_dir``; returns ``out_dir``.

    The draft vocabulary is ``draft_vocab_size`` target ids: ``keep_ids``, then ids drawn
    at random (sorted, as the reference's frequency-ranked set is).  ``aux_layer_ids`` writes
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (output-of-layer indices).
    """
    spec = dict(
        algorithm="EAGLE3",
        target=str(target_dir),
        draft_vocab_size=draft_vocab_size,
        seed=seed,
        dtype=dtype,
        aux_layer_ids=aux_layer_ids,
        weights_format=weights_format,
        keep_ids=sorted(set(keep_ids)),
    )
    out = _prepare(out_dir, spec)
    if out is None:
        return Path(out_dir)
    target, raw = _target(target_dir)
    vocab, hidden = target.vocab_size, target.hidden_size
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab}]")
    config = _llama_config(target, raw, dtype, architecture="LlamaForCausalLMEagle3")
    config["draft_vocab_size"] = draft_vocab_size
    if aux_layer_ids is not None:
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    g = torch.Generator().manual_seed(seed)
    # The tiny targets' residual streams reach |x| ~ 80; a smaller fc keeps the draft hidden
    # O(1), so float32 comparisons at a fixed absolute tolerance stay meaningful.
    weights = {"fc.weight": 0.1 * _linear(g, hidden, 3 * hidden)}
    attention = _attention(g, target, "midlayer.self_attn", 2 * hidden, target.head_dim, False)
    weights.update(attention)
    weights.update(_mlp(g, target, "midlayer.mlp"))
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        weights[f"midlayer.{norm}.weight"] = _norm(g, hidden)
    weights["norm.weight"] = _norm(g, hidden)
    weights["lm_head.weight"] = _linear(g, draft_vocab_size, hidden)
    kept = set(keep_ids)
    drawn = [i for i in torch.randperm(vocab, generator=g).tolist() if i not in kept]
    used = torch.tensor(sorted([*kept, *drawn][:draft_vocab_size]))  # target ids
    weights["d2t"] = used - torch.arange(draft_vocab_size)  # int64
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    weights["t2d"] = t2d
    _write(out, config, weights, dtype, weights_format, spec)
    return out


def _prepare(out_dir: str | Path, spec: dict[str, Any]) -> Path | None:
    """-> the folder to write, or None when it was already built with ``spec``."""
    if spec["weights_format"] not in WEIGHT_FORMATS:
        raise ValueError(f"weights_format must be one of {WEIGHT_FORMATS}")
    out = Path(out_dir)
    spec_file = out / _SPEC_FILE
    if spec_file.is_file() and json.loads(spec_file.read_text()) == spec:
        return None
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty and was not built with these arguments: {spec}")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _target(target_dir: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    return load_model_config(target_dir), raw


def _llama_config(
    target: ModelConfig, raw: dict[str, Any], dtype: str, architecture: str
) -> dict[str, Any]:
    """The Llama-style config.json the published heads carry (one layer, target widths)."""
    config = {
        "architectures": [architecture],
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_id": raw.get("eos_token_id"),
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        "head_dim": target.head_dim,  # Qwen3's differs from hidden / heads
        "initializer_range": 0.02,
        "intermediate_size": target.intermediate_size,
        "max_position_embeddings": target.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": target.rms_norm_eps,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": target.vocab_size,
        "rope_theta": target.rope.theta,
    }
    scaling = raw.get("rope_scaling")
    if scaling is None and raw.get("rope_parameters", {}).get("rope_type", "default") != "default":
        scaling = {k: v for k, v in raw["rope_parameters"].items() if k != "rope_theta"}
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _linear(g: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=g) * in_features**-0.5


def _norm(g: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(size, generator=g)


def _attention(
    g: torch.Generator,
    target: ModelConfig,
    prefix: str,
    in_width: int,
    head_dim: int,
    bias: bool,
) -> dict[str, torch.Tensor]:
    q_size = target.num_attention_heads * head_dim
    kv_size = target.num_key_value_heads * head_dim
    weights = {}
    for name, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
        weights[f"{prefix}.{name}.weight"] = _linear(g, size, in_width)
        if bias:
            weights[f"{prefix}.{name}.bias"] = 0.1 * torch.randn(size, generator=g)
    weights[f"{prefix}.o_proj.weight"] = _linear(g, target.hidden_size, q_size)
    return weights


def _mlp(g: torch.Generator, target: ModelConfig, prefix: str) -> dict[str, torch.Tensor]:
    hidden, inter = target.hidden_size, target.intermediate_size
    return {
        f"{prefix}.gate_proj.weight": _linear(g, inter, hidden),
        f"{prefix}.up_proj.weight": _linear(g, inter, hidden),
        f"{prefix}.down_proj.weight": _linear(g, hidden, inter),
    }


def _target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's ``model.embed_tokens.weight``, read from whichever shard holds it."""
    for file in weight_files(target_dir):
        with safe_open(file, framework="pt") as f:
            if _TARGET_EMBED in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return f.get_tensor(_TARGET_EMBED).float()
    raise ValueError(f"{target_dir} has no {_TARGET_EMBED}")


def _write(
    out: Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    dtype: str,
    weights_format: str,
    spec: dict[str, Any],
) -> None:
    cast = {
        name: t.to(getattr(torch, dtype)).contiguous() if t.is_floating_point() else t
        for name, t in weights.items()
    }
    if weights_format == "bin":
        torch.save(cast, out / "pytorch_model.bin")
    else:
        save_file(cast, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / _SPEC_FILE).write_text(json.dumps(spec))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("target_dir", type=Path)
    parser.add_argument("--algorithm", choices=("EAGLE", "EAGLE3"), default="EAGLE")
    parser.add_argument("--draft-vocab-size", type=int, default=128, help="EAGLE3 only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights-format", choices=WEIGHT_FORMATS, default="bin")
    args = parser.parse_args(argv)
    if args.algorithm == "EAGLE":
        path = make_tiny_eagle(
            args.out_dir, args.target_dir, seed=args.seed, weights_format=args.weights_format
        )
    else:
        path = make_tiny_eagle3(
            args.out_dir,
            args.target_dir,
            draft_vocab_size=args.draft_vocab_size,
            seed=args.seed,
            weights_format=args.weights_format,
        )
    print(path)


if __name__ == "__main__":
    main()
