"""A grammar that waits for the thinking to end (structured output on a reasoning model).

As vLLM's structured output with a reasoning parser, and SGLang's reasoner grammar: a
thinking model's output is ``<think> ... </think>`` then the answer, and only the answer
is held to the grammar.  ``ThinkingGate`` wraps an xgrammar matcher with the same calls
(``accept_token``, ``rollback``, ``fill_next_token_bitmask``, ``is_terminated``), so
``GrammarState`` and the guided draft use it unchanged:

* ``thinking``: every token is allowed, none reaches the grammar; ``</think>`` ends it;
* ``undecided`` (a model whose thinking is optional, at the output's first token): the
  grammar's tokens and ``<think>``, which opens the thinking; any other token starts
  the answer;
* ``answer``: the wrapped matcher decides.

Each accepted token records the phase before it, so a rollback (a verify walking a draft
tree) can cross ``</think>`` either way.  The tags must be single tokens of the model's
vocabulary (``thinking_tag_ids``), as in Qwen3's and DeepSeek-R1's tokenizers.
"""

from __future__ import annotations

from collections import deque

import torch
from transformers import PreTrainedTokenizerBase

START, END = "<think>", "</think>"  # the thinking tags (the reasoning parsers split on them too)
THINKING, UNDECIDED, ANSWER = "thinking", "undecided", "answer"
ROLLBACK_WINDOW = 1024  # tokens a rollback may undo (a draft tree is far shallower)


def thinking_tag_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int] | None:
    """(``<think>`` id, ``</think>`` id) when each is one token of ``tokenizer``, else None."""
    ids = []
    for tag in (START, END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1 or tokenizer.decode(encoded) != tag:
            return None
        ids.append(encoded[0])
    return ids[0], ids[1]


def _set_bit(bitmask: torch.Tensor, row: int, token: int) -> None:
    bit = 1 << (token & 31)
    bitmask[row, token >> 5] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32


class ThinkingGate:
    """An xgrammar matcher (``answer``) that holds only after the thinking block."""

    def __init__(self, answer, start_id: int, end_id: int, thinks_first: bool):
        self.answer = answer
        self.start_id, self.end_id = start_id, end_id
        self.phase = THINKING if thinks_first else UNDECIDED
        self._before: deque[tuple[str, bool]] = deque(maxlen=ROLLBACK_WINDOW)

    def accept_token(self, token: int) -> bool:
        """Accept ``token``; False when the answer's grammar refuses it."""
        before = self.phase
        if before == THINKING or (before == UNDECIDED and token == self.start_id):
            self.phase = ANSWER if before == THINKING and token == self.end_id else THINKING
            self._before.append((before, False))
            return True
        if not self.answer.accept_token(token):
            return False
        self.phase = ANSWER
        self._before.append((before, True))
        return True

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens."""
        answered = 0
        for _ in range(count):
            self.phase, to_answer = self._before.pop()
            answered += to_answer
        if answered:
            self.answer.rollback(answered)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.phase == THINKING:
            bitmask[row] = -1  # every token
            return
        self.answer.fill_next_token_bitmask(bitmask, row)
        if self.phase == UNDECIDED:
            _set_bit(bitmask, row, self.start_id)

    def is_terminated(self) -> bool:
        return self.phase != THINKING and self.answer.is_terminated()
