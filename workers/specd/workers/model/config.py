"""Target-model settings parsed from a Hugging Face ``config.json``.

Only what the forward pass needs is kept, in one frozen dataclass.  Settings this
engine cannot run exactly (sliding-window attention, rope types other than default /
linear / llama3, activations other than SiLU, shared experts) are refused here with a
message naming the setting, rather than silently producing different logits from
``transformers``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.workers.model.errors import ModelLoadError
from specd.workers.model.quantization import QuantizationConfig, parse_quantization

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # q_norm / k_norm per head
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# architectures whose sliding window is off unless use_sliding_window says otherwise
_WINDOW_OPT_IN = ("Qwen2ForCausalLM", *QK_NORM_ARCHITECTURES)
# the config fields that make a model a mixture of experts (refused on a dense architecture)
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_SHARED_EXPERT_FIELDS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
)
_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = tuple(_ROPE_REQUIRED_KEYS)
# generation_config.json's sampling recommendations, applied as vLLM applies them
# (``SamplingDefaultsSpec.resolve``)
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")


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
class MoeConfig:
    """A sparse mixture-of-experts feed-forward: each token goes to ``top_k`` of
    ``num_experts`` SiLU-gated MLPs of width ``intermediate_size``, weighted by the router."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # per expert: moe_intermediate_size (Qwen3-MoE), intermediate_size
    renormalize: bool  # top-k weights divided by their sum (norm_topk_prob; always for Mixtral)
    sparse_layers: frozenset[int]  # the layers with experts; the others run a dense MLP


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
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    moe: MoeConfig | None = None  # sparse feed-forward layers (Qwen3-MoE, Mixtral)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # checkpoint dtype name, e.g. "bfloat16"
    # generation_config.json's sampling recommendations as written (GENERATION_SAMPLING_KEYS)
    generation_sampling: dict[str, Any] = field(default_factory=dict)
    quantization: QuantizationConfig | None = None  # FP8 weights (quantization.py)

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` runs experts (else a dense MLP)."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Parse a ``config.json`` dict (and optionally ``generation_config.json``'s)."""
        architecture = _architecture(raw)
        _refuse_unsupported(raw, architecture)
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        # Mixtral's attention has no bias; Qwen3's attention_bias covers o_proj as Llama's
        llama_bias = architecture != "MixtralForCausalLM" and bool(raw.get("attention_bias", False))
        # only Llama's MLP has a bias option (transformers ignores mlp_bias elsewhere)
        mlp_bias = architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=_head_dim(raw, architecture),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope=parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=not is_qwen2 and llama_bias,
            mlp_bias=mlp_bias,
            qk_norm=architecture in QK_NORM_ARCHITECTURES,
            moe=parse_moe(raw, architecture),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation or {}),
            generation_sampling={
                key: value
                for key, value in (generation or {}).items()
                if key in GENERATION_SAMPLING_KEYS and value is not None
            },
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            quantization=parse_quantization(raw),
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


def _head_dim(raw: dict[str, Any], architecture: str) -> int:
    """As transformers: Qwen3's config defaults head_dim to 128; the others derive it."""
    derived = raw["hidden_size"] // raw["num_attention_heads"]
    return raw.get("head_dim") or (128 if architecture == "Qwen3ForCausalLM" else derived)


def parse_moe(raw: dict[str, Any], architecture: str) -> MoeConfig | None:
    """The sparse feed-forward of a MoE architecture; None for a dense one (whose config
    must not describe experts).  Shared experts are refused on any architecture."""
    shared = [name for name in _SHARED_EXPERT_FIELDS if raw.get(name)]
    if shared:
        raise ModelLoadError(
            f"config.json: {shared[0]}={raw[shared[0]]!r}: shared experts are not supported "
            f"({architecture} has none); supported MoE: {', '.join(MOE_ARCHITECTURES)}"
        )
    if architecture not in MOE_ARCHITECTURES:
        named = [name for name in _MOE_FIELDS if raw.get(name)]
        if named:
            raise ModelLoadError(
                f"config.json: {named[0]}={raw[named[0]]!r} describes experts, but "
                f"{architecture} is dense; a mixture-of-experts checkpoint names one of "
                f"{', '.join(MOE_ARCHITECTURES)}"
            )
        return None
    num_experts = _num_experts(raw, architecture)
    layers = raw["num_hidden_layers"]
    if architecture == "MixtralForCausalLM":
        for name, default in (("decoder_sparse_step", 1), ("mlp_only_layers", [])):
            if raw.get(name, default) not in (None, default):
                raise ModelLoadError(
                    f"config.json: {name}={raw[name]!r} is not supported on "
                    "MixtralForCausalLM: every Mixtral layer is sparse"
                )
        sparse, inter, renormalize = frozenset(range(layers)), raw["intermediate_size"], True
    else:
        if num_experts == 0:  # transformers' rule: no experts, every layer dense
            return None
        step = raw.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ModelLoadError(f"config.json: decoder_sparse_step={step!r} must be >= 1")
        dense = set(raw.get("mlp_only_layers") or ())
        sparse = frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        inter = _required(raw, "moe_intermediate_size", architecture)
        renormalize = bool(raw.get("norm_topk_prob", False))
    top_k = _required(raw, "num_experts_per_tok", architecture)
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"config.json: num_experts_per_tok={top_k} must be between 1 and the number "
            f"of experts ({num_experts})"
        )
    return MoeConfig(num_experts, top_k, inter, renormalize, sparse)


def _num_experts(raw: dict[str, Any], architecture: str) -> int:
    """Qwen3-MoE publishes ``num_experts``, Mixtral (and transformers 5 for both) saves
    ``num_local_experts``; either is read, and they must agree."""
    names = ("num_experts", "num_local_experts")
    given = {name: raw[name] for name in names if raw.get(name) is not None}
    if not given:
        raise ModelLoadError(
            f"config.json: {architecture} needs num_experts (or num_local_experts)"
        )
    if len(set(given.values())) > 1:
        raise ModelLoadError(f"config.json: num_experts and num_local_experts disagree: {given}")
    (num_experts,) = set(given.values())
    least = 0 if architecture == "Qwen3MoeForCausalLM" else 1
    if not isinstance(num_experts, int) or num_experts < least:
        name = next(iter(given))
        raise ModelLoadError(f"config.json: {name}={num_experts!r} must be >= {least}")
    return num_experts


def _required(raw: dict[str, Any], name: str, architecture: str) -> Any:
    if raw.get(name) is None:
        raise ModelLoadError(f"config.json: {architecture} needs {name}")
    return raw[name]


def _refuse_sliding_window(raw: dict[str, Any], architecture: str) -> None:
    # Qwen configs carry a sliding_window value that is only used with use_sliding_window.
    uses_window = raw.get("use_sliding_window", architecture not in _WINDOW_OPT_IN)
    window = raw.get("sliding_window") if uses_window else None
    max_positions = raw.get("max_position_embeddings", 2048)
    if window is None or window >= max_positions:
        return
    if architecture != "Qwen3ForCausalLM":
        raise ModelLoadError(
            f"config.json: sliding_window={window} (< max_position_embeddings={max_positions}) "
            "is not supported: this engine runs full attention only"
        )
    # Qwen3 windows only its "sliding_attention" layers: from max_window_layers on by default
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention"
        for i in range(raw["num_hidden_layers"])
    ]
    windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if windowed:
        raise ModelLoadError(
            f"config.json: use_sliding_window with sliding_window={window} on layers "
            f"{windowed} (layer_types / max_window_layers) is not supported: this engine "
            "runs full attention only; set use_sliding_window to false"
        )


def _refuse_unsupported(raw: dict[str, Any], architecture: str) -> None:
    _refuse_sliding_window(raw, architecture)
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
