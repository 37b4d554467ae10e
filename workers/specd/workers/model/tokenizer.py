"""Tokenizer loading, chat formatting and end-of-sequence ids for a local model folder."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specd.workers.model.config import ModelConfig, ModelLoadError

# Used only when the tokenizer ships no chat template.  It renders
#   <bos><|user|>\nHello<eos>\n<|assistant|>\n
# i.e. each message as "<|role|>\n content <eos>\n", then the assistant header.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token or '' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer files in ``path`` without touching the network."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"tokenizer folder {folder} does not exist")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load a tokenizer from {folder}: {err}") from err


def apply_chat_template(
    tok: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` (and the ``tools`` a template may list) followed by the
    assistant generation prompt; ``template_kwargs``: more template variables (e.g.
    Qwen3's ``enable_thinking``).

    The text already carries the template's special tokens (bos included), so it is
    encoded without adding more.
    """
    text = tok.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        chat_template=None if tok.chat_template else FALLBACK_CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
        **(template_kwargs or {}),
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def decode_text(
    tok: PreTrainedTokenizerBase, ids: Sequence[int], skip_special_tokens: bool = False
) -> str:
    """``tok.decode(ids)``; a fast tokenizer's Rust decode runs as a batch of one, which
    releases the GIL (its single decode holds it, ~0.6 µs a token: a long text would
    stall every other thread).  A tokenizer that cleans up spaces after decoding keeps
    its own ``decode`` (the clean-up rules vary with the transformers version)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or tok.clean_up_tokenization_spaces:
        return tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]


def eos_token_ids(tok: PreTrainedTokenizerBase, model_config: ModelConfig) -> set[int]:
    """Ids that end generation: the model config's (config + generation config) and the tokenizer's."""
    ids = set(model_config.eos_token_ids)
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's piece for a raw byte


def _decoder_types(tok: PreTrainedTokenizerBase) -> set[str]:
    """The kinds of decoder steps of a fast tokenizer (``ByteLevel``, ``ByteFallback``...)."""
    backend = getattr(tok, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    steps = (decoder or {}).get("decoders", [decoder] if decoder else [])
    return {step["type"] for step in steps}


def token_bytes_reader(tok: PreTrainedTokenizerBase) -> Callable[[int], bytes]:
    """token id -> the exact bytes it adds to the text, where the vocabulary says so.

    Byte-level BPE (GPT-2, Llama 3) and SentencePiece byte fallback (``<0xE2>``) tokens
    may hold part of a UTF-8 character, which decoding one token alone turns into
    U+FFFD, so distinct tokens would look alike.  Special tokens and other vocabularies
    give their decoded text."""
    kinds = _decoder_types(tok)
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    special = set(tok.all_special_ids)

    def read(token_id: int) -> bytes:
        piece = tok.convert_ids_to_tokens(token_id)
        if token_id not in special and isinstance(piece, str):
            if "ByteLevel" in kinds and all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
            if "ByteFallback" in kinds and (found := _BYTE_FALLBACK.fullmatch(piece)):
                return bytes([int(found.group(1), 16)])
            if "ByteFallback" in kinds or "Metaspace" in kinds:
                return piece.replace("\u2581", " ").encode()
        return tok.decode([token_id]).encode()

    return read
