"""Tokenizer loading, chat formatting and end-of-sequence ids for a local model folder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

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
    tok: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]
) -> list[int]:
    """Token ids of ``messages`` followed by the assistant generation prompt.

    The text already carries the template's special tokens (bos included), so it is
    encoded without adding more.
    """
    text = tok.apply_chat_template(
        list(messages),
        chat_template=None if tok.chat_template else FALLBACK_CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def eos_token_ids(tok: PreTrainedTokenizerBase, model_config: ModelConfig) -> set[int]:
    """Ids that end generation: the model config's (config + generation config) and the tokenizer's."""
    ids = set(model_config.eos_token_ids)
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return ids
