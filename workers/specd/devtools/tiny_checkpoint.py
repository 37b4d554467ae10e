"""Tiny random Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Mixtral) with a real tokenizer, built fully offline.

Tests use these as the target model: ``transformers`` builds and saves the model (so
the folder is exactly what ``save_pretrained`` writes), and a byte-level BPE trained on
an embedded paragraph gives a tokenizer with a chat template.  Weights use a large
init std so greedy argmax margins are wide and the generated tokens vary.

    python -m specd.devtools.tiny_checkpoint OUT_DIR --variant qwen3-moe [--sharded]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SPEC_FILE = "specd_tiny.json"  # the arguments a folder was built with (the cache key)

_CORPUS = """\
Speculative decoding lets a small draft model propose several tokens that a large
target model then verifies in a single forward pass. When the draft guesses well, the
target accepts many tokens per step and the answer arrives sooner; when it guesses
badly, the target still produces exactly the tokens it would have produced alone.
The key value cache holds the keys and values of every position the model has seen.
Pages of slots are handed out by an allocator, and a table maps each request and
position to the slot where its keys live. Trees of draft tokens branch at every step:
the best children by cumulative probability are kept, sorted so that parents come
before children, and checked together under a tree attention mask.
Hello, how are you today? I am fine, thank you. What is the weather like in Paris?
It is sunny and warm, with a light breeze from the river. The quick brown fox jumps
over the lazy dog while the cat sleeps on the mat near the window.
def main(argv):
    for index, value in enumerate(values):
        if value is None:
            return index
    return -1
Numbers such as 0, 1, 2, 3, 42, 100 and 2024 appear in text, as do dates, names and
places: London, Tokyo, Lagos, Lima. Once upon a time there was a little robot who
wanted to learn to read. Every morning it opened a book, looked at the letters, and
tried to guess the next word before turning the page.
"""

_BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.3,
)
_LLAMA = (LlamaConfig, LlamaForCausalLM)
_VARIANTS: dict[str, tuple[tuple[type, type], dict[str, Any]]] = {
    "gqa": (_LLAMA, {}),
    "tied": (_LLAMA, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "bias": ((Qwen2Config, Qwen2ForCausalLM), dict(use_sliding_window=False)),
    "llama3": (
        _LLAMA,
        dict(
            rope_theta=50000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "linear": (_LLAMA, dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral": ((MistralConfig, MistralForCausalLM), dict(sliding_window=None)),
    # head_dim 32 is not hidden / heads (16): Qwen3 sets it explicitly
    "qwen3": ((Qwen3Config, Qwen3ForCausalLM), dict(head_dim=32, use_sliding_window=False)),
    # layer 1 is dense (mlp_only_layers), layers 0 and 2 route each token to 2 of 8 experts
    "qwen3-moe": (
        (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            use_sliding_window=False,
        ),
    ),
    "mixtral": (
        (MixtralConfig, MixtralForCausalLM),
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
}
VARIANTS = tuple(_VARIANTS)
# Norm weights drawn around 1 instead of transformers' ones, so a norm applied with the
# wrong weight (Qwen3's q_norm for k_norm, say) changes the logits.
_RANDOM_NORM_VARIANTS = ("qwen3", "qwen3-moe", "mixtral")


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the embedded corpus; adds ``<s>`` when encoding."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_checkpoint(
    out_dir: str | Path,
    *,
    variant: str = "gqa",
    seed: int = 0,
    dtype: str = "float32",
    sharded: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny model + tokenizer folder to ``out_dir`` and return its path.

    ``overrides`` go to the transformers config (e.g. ``num_hidden_layers=4``).  A folder
    already built with the same arguments is reused as is.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    out = Path(out_dir)
    spec = dict(variant=variant, seed=seed, dtype=dtype, sharded=sharded, overrides=overrides)
    spec_file = out / _SPEC_FILE
    if spec_file.is_file() and json.loads(spec_file.read_text()) == spec:
        return out
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty and was not built with these arguments: {spec}")
    (config_cls, model_cls), variant_kwargs = _VARIANTS[variant]
    kwargs = {**_BASE, **variant_kwargs, **overrides}
    tokenizer = build_tokenizer(kwargs["vocab_size"])
    config = config_cls(
        **kwargs,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        if variant in _RANDOM_NORM_VARIANTS:
            _randomize_norms(model)
        model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="100KB" if sharded else "10GB")
    tokenizer.save_pretrained(out)
    spec_file.write_text(json.dumps(spec))
    return out


@torch.no_grad()
def _randomize_norms(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.uniform_(0.5, 1.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--variant", choices=VARIANTS, default="gqa")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--sharded", action="store_true", help="save several safetensors shards")
    args = parser.parse_args(argv)
    path = make_tiny_checkpoint(
        args.out_dir, variant=args.variant, seed=args.seed, dtype=args.dtype, sharded=args.sharded
    )
    print(path)


if __name__ == "__main__":
    main()
