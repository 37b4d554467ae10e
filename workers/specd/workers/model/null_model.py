"""A benchmark-only target that costs nearly nothing, to time the serving path alone.

``BenchKnobs.null_model`` swaps it in for the checkpoint's model: built from config.json
alone (no weight read), it runs no layer and writes no KV, yet the engine around it
(scheduler, KV bookkeeping, sampling, detokenizing, streaming) works as with a real model.

Its greedy choice is a fixed rule, so tests can predict every token: the token after
``t`` is the next id above ``t`` that is not an avoided id (end-of-sequence, BOS, pad and
the tokenizer's other special tokens), wrapping past the vocabulary's end.  For a
vocabulary of 8 with ids 0-2 avoided: 3 -> 4, 6 -> 7, 7 -> 3 (past 7 wraps to 0, 1, 2,
avoided).  A stream therefore never ends on its own, and its text is plain tokens.

Everything is on the device with fixed shapes (a table lookup and a scatter), so a
decode step can be captured into a CUDA graph like the real model's.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specd.workers.model.config import ModelConfig, load_model_config
from specd.workers.model.forward_context import ForwardContext
from specd.workers.model.loader import resolve_dtype
from specd.workers.model.tokenizer import eos_token_ids

# the chosen token's logit above every other's (all 0): at temperature 1 a softmax puts
# all but ~vocab * e^-30 of the mass on it, so sampling picks it too (T <= 1: in practice)
CHOSEN_LOGIT = 30.0


def successor_table(vocab_size: int, avoid: Collection[int]) -> torch.Tensor:
    """[vocab_size] int64: for each id, the next id above it not in ``avoid`` (wrapping)."""
    allowed = [t for t in range(vocab_size) if t not in avoid]
    if not allowed:
        raise ValueError(f"null model: every id of the vocabulary ({vocab_size}) is avoided")
    table = [allowed[bisect.bisect_right(allowed, t) % len(allowed)] for t in range(vocab_size)]
    return torch.tensor(table, dtype=torch.int64)


class NullCausalLM(nn.Module):
    """The ``LlamaForCausalLM`` interface a plain decode uses (``forward``,
    ``compute_logits``, ``config``, ``parameters()``) with no layers behind it."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: str | torch.device,
        avoid: Collection[int],
    ):
        super().__init__()
        self.config = config
        # the model dtype, read as ``next(model.parameters()).dtype`` to size the KV pool
        self.dtype_anchor = nn.Parameter(
            torch.zeros(1, dtype=dtype, device=device), requires_grad=False
        )
        self.register_buffer(
            "successor", successor_table(config.vocab_size, avoid).to(device), persistent=False
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids [N] int64 -> "hidden" [N, 1] int64: each row is its input id."""
        return input_ids.unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, 1] -> logits [M, vocab] float32, ``CHOSEN_LOGIT`` at each row's
        successor and 0 elsewhere."""
        chosen = self.successor[hidden[:, 0]].unsqueeze(1)  # [M, 1]
        logits = torch.zeros(
            hidden.shape[0], self.config.vocab_size, dtype=torch.float32, device=hidden.device
        )
        return logits.scatter_(1, chosen, CHOSEN_LOGIT)


def avoided_ids(tokenizer: Any, config: ModelConfig) -> set[int]:
    """Ids the null model never picks: end-of-sequence (config and tokenizer), BOS and
    every special token of the tokenizer (pad, chat markers)."""
    avoid = eos_token_ids(tokenizer, config) | set(tokenizer.all_special_ids)
    return avoid | ({config.bos_token_id} if config.bos_token_id is not None else set())


def load_null_model(
    path: str | Path, dtype: str, device: str | torch.device, tokenizer: Any
) -> tuple[NullCausalLM, ModelConfig]:
    """A `NullCausalLM` from ``path``/config.json (``dtype`` as ``load_model`` takes it)
    that avoids ``avoided_ids`` of ``tokenizer``."""
    config = load_model_config(path)
    model = NullCausalLM(
        config, resolve_dtype(dtype, config), device, avoided_ids(tokenizer, config)
    )
    return model, config
