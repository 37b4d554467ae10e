"""Reasoning output: a thinking model's ``<think> ... </think>`` block, returned apart.

As vLLM's and SGLang's ``--reasoning-parser``: with ``spec.reasoning.parser`` set, a chat
response's thinking goes to ``message.reasoning_content`` (a stream's to
``delta.reasoning_content``) and only what follows ``</think>`` is ``content`` (where
tool calls are then looked for).  Families (`PARSERS`):

* ``deepseek_r1``: the model thinks first, always (its template may open ``<think>`` in
  the prompt); everything before ``</think>`` is reasoning, all of an output that never
  closes it too;
* ``qwen3``: thinking is optional (``chat_template_kwargs: {"enable_thinking": false}``
  turns it off): the output is reasoning up to ``</think>`` only if it opens with
  ``<think>`` or the prompt ended with it; otherwise it is all content.

A request held to a grammar (structured output, a forced tool call) thinks first too
when the model's tokenizer spells ``<think>`` and ``</think>`` as single tokens: the
grammar waits for the thinking to end (``engine/thinking_gate.py``).  Otherwise the
grammar holds from the first token, so the output has no thinking and is not split.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.workers.runner.thinking_gate import END, START


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    always_thinks: bool  # deepseek_r1: reasoning until END even without START

    def starts_in_reasoning(self, prompt_tail: str) -> bool | None:
        """Whether an output begins inside the thinking block: True, or None when its
        first characters decide (they open with START or not)."""
        if self.always_thinks or prompt_tail.rstrip().endswith(START):
            return True
        return None

    def grammar_waits(self, prompt_tail: str) -> str:
        """How a grammar waits for this output's thinking (``Grammar.thinking``): "first"
        when it begins inside the thinking block, "optional" when its first token
        decides."""
        return "first" if self.starts_in_reasoning(prompt_tail) else "optional"

    def split(self, text: str, prompt_tail: str = "") -> tuple[str | None, str | None]:
        """A whole output -> (reasoning, content); None for a part that is empty."""
        stream = ReasoningStream(self, prompt_tail)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


PARSERS = {
    "deepseek_r1": ReasoningParser(always_thinks=True),
    "qwen3": ReasoningParser(always_thinks=False),
}


class ReasoningStream:
    """One choice's output as it streams: each `feed` returns the (reasoning, content)
    text it can send now, holding back what might be the start of a tag."""

    def __init__(self, parser: ReasoningParser, prompt_tail: str = ""):
        self.in_reasoning = parser.starts_in_reasoning(prompt_tail)  # None: undecided
        self.opened = False  # START seen (or skipped) at the output's beginning
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        reasoning = ""
        if self.in_reasoning is None:  # the first characters decide
            head = text.lstrip()
            if START.startswith(head):  # maybe START, not all of it yet
                self._held = text
                return "", ""
            self.in_reasoning = head.startswith(START)
        if self.in_reasoning and not self.opened:
            head = text.lstrip()
            if START.startswith(head) and head != START:
                self._held = text
                return "", ""
            if head.startswith(START):
                text = head[len(START) :]
            self.opened = True
        if self.in_reasoning:
            end = text.find(END)
            if end < 0:
                keep = _partial_suffix(text, END)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(END) :]
            self.in_reasoning = False
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """The text held back at the end: reasoning if still thinking, else content."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held: the rest of the
    tag may follow)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
