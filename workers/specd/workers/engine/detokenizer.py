"""Incremental detokenization with stop strings.

Text is decoded from a short window of tokens before the unread ones so that
tokenizers which add spaces by context (SentencePiece) produce the right deltas, and
a delta is held back while it ends in an incomplete UTF-8 sequence ("\\ufffd").
With stop strings, the last ``max(len(stop)) - 1`` characters are also held back
until it is clear they do not start a stop string, so streamed text never has to be
taken back.  Under ``min_tokens`` a stop string counts only if it ends after the text
of the first ``min_tokens`` output tokens (vLLM's rule: stop strings are looked for
once more than ``min_tokens`` tokens are out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: object
    prompt_len: int
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    text: str = ""  # all output text decoded so far (cut at a stop string)
    emitted: int = 0  # characters of ``text`` already handed out
    stopped: bool = False
    _prefix_offset: int = field(init=False)
    _read_offset: int = field(init=False)
    _stop_floor: int = field(init=False, default=0)  # no stop string may end at or before

    def __post_init__(self):
        self._read_offset = self.prompt_len
        self._prefix_offset = max(self.prompt_len - _CONTEXT_TOKENS, 0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def feed(self, all_ids: list[int], final: bool = False) -> str:
        """Take prompt + output ids; return newly released text.  Sets ``stopped``
        when a stop string appeared (the text is cut before it)."""
        if not self.stopped:
            before = self._decode(all_ids[self._prefix_offset : self._read_offset])
            after = self._decode(all_ids[self._prefix_offset :])
            if len(after) > len(before) and (final or not after.endswith("\ufffd")):
                self.text += after[len(before) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(all_ids)
            if len(all_ids) - self.prompt_len <= self.min_tokens:
                self._stop_floor = len(self.text)
            else:
                self._apply_stop_strings()
        release = len(self.text)
        if self.stop and not (final or self.stopped):
            release = max(self.emitted, release - (max(map(len, self.stop)) - 1))
        delta = self.text[self.emitted : release]
        self.emitted = release
        return delta

    def _apply_stop_strings(self) -> None:
        if not self.stop:
            return
        search_from = max(0, self.emitted - max(map(len, self.stop)))
        hits = [
            i
            for s in self.stop
            if (i := self.text.find(s, max(search_from, self._stop_floor - len(s) + 1))) >= 0
        ]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
