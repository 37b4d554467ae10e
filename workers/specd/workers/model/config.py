"""Target-model settings parsed from a Hugging Face ``config.json``.

Only what the forward pass needs is kept, in one frozen dataclass.  Settings this
engine cannot run exactly (sliding-window attention, rope types other than default /
linear / llama3, activations other than SiLU) are refused here with a message naming
the setting, rather than silently producing different logits from ``transformers``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = tuple(_ROPE_REQUIRED_KEYS)
# generation_config.json's sampling recommendations, applied as vLLM applies them
# (``SamplingDefaultsSpec.resolve``)
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")


class ModelLoadError(ValueError):
    """A model folder cannot be loaded; the message names the file, tensor or setting."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (``rope_type`` as in transformers' ``rope_parameters``)."""

    theta: float = 10000.0
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # checkpoint dtype name, e.g. "bfloat16"
    # generation_config.json's sampling recommendations as written (GENERATION_SAMPLING_KEYS)
    generation_sampling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Parse a ``config.json`` dict (and optionally ``generation_config.json``'s)."""
        architecture = _architecture(raw)
        _refuse_unsupported(raw, architecture)
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        llama_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope=parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=not is_qwen2 and llama_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation or {}),
            generation_sampling={
                key: value
                for key, value in (generation or {}).items()
                if key in GENERATION_SAMPLING_KEYS and value is not None
            },
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def load_model_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a model folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json ({config_file})")
    generation_file = folder / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    try:
        return ModelConfig.from_dict(json.loads(config_file.read_text()), generation)
    except KeyError as err:
        raise ModelLoadError(f"{config_file}: missing required key {err}") from None


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Rope settings from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta``."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("config.json: partial_rotary_factor != 1.0 is not supported")
    missing = [key for key in _ROPE_REQUIRED_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise ModelLoadError(f"config.json: rope type {rope_type!r} needs {', '.join(missing)}")
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get(
                "original_max_position_embeddings", defaults.original_max_position_embeddings
            )
        ),
    )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"config.json: architecture {', '.join(architectures) or '(none)'} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architectures[0]


def _refuse_unsupported(raw: dict[str, Any], architecture: str) -> None:
    # Qwen2 configs carry a sliding_window value that is only used with use_sliding_window.
    uses_window = raw.get("use_sliding_window", architecture != "Qwen2ForCausalLM")
    window = raw.get("sliding_window") if uses_window else None
    max_positions = raw.get("max_position_embeddings", 2048)
    if window is not None and window < max_positions:
        raise ModelLoadError(
            f"config.json: sliding_window={window} (< max_position_embeddings={max_positions}) "
            "is not supported: this engine runs full attention only"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported; supported: silu")


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos ids (Llama 3 splits them)."""
    ids: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(token)
    return tuple(ids)
