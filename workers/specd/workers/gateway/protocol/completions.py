"""``POST /v1/completions``: its request, its response and chunks, and the
`CompletionFormat` that shapes engine output into them (log-probs in the legacy shape)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
)

from specd.workers.gateway.protocol.generation import GenerationRequest
from specd.workers.gateway.protocol.shared import (
    ChoiceResult,
    FinishReasonName,
    Logprobs,
    RenderedLogprob,
    ResponseBase,
    UsageInfo,
    token_text,
)
from specd.workers.runner.logprobs import MAX_TOP_LOGPROBS


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    _NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = {
        "best_of": (1,),
        "suffix": (),
    }

    prompt: str | list[int]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="each token's log-prob and the top n"
    )
    suffix: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_scores_in_sessions(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("echo") and info.data.get("session_id"):
            raise ValueError(
                "with echo, a session turn cannot score its prompt (the session's history "
                "is cached, not recomputed); send it without session_id, or without echo"
            )
        return value

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A string, token ids, or a list holding exactly one of those."""
        if isinstance(value, list) and value and not all(isinstance(v, int) for v in value):
            if len(value) != 1:
                raise ValueError(
                    f"got {len(value)} prompts; send one prompt per request "
                    "(a string, a list of token ids, or a list with one of those)"
                )
            value = value[0]
        if isinstance(value, str) or (
            isinstance(value, list)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            return value
        raise ValueError("must be a string, a list of token ids, or a list with one of those")


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token;
    ``text_offset`` is where each token's text starts in the completion."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class _TextOffsets:
    """Where each token's text starts in one completion, counted from the tokens' bytes
    (bytes that never make a character count as the U+FFFD the text shows for them)."""

    def __init__(self) -> None:
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def advance(self, rendered: Sequence[RenderedLogprob]) -> list[int]:
        offsets = []
        for r in rendered:
            pending, _ = self._chars.getstate()  # a character's bytes not yet complete
            offsets.append(self._offset + len(pending.decode(errors="replace")))
            if r.in_text:
                self._offset += len(self._chars.decode(r.token))
        return offsets


class CompletionFormat:
    id_prefix = "cmpl-"

    def __init__(self) -> None:
        self._offsets: dict[int, _TextOffsets] = {}  # per choice index

    def response(
        self, rid: str, model: str, choices: Sequence[ChoiceResult], usage: UsageInfo | None
    ) -> CompletionResponse:
        out = [
            CompletionChoice(
                index=c.index,
                text=c.text,
                finish_reason=c.finish,
                logprobs=self._logprobs(c.index, c.logprobs),
            )
            for c in choices
        ]
        return CompletionResponse(id=rid, model=model, choices=out, usage=usage)

    def opening_chunk(self, rid: str, model: str, index: int) -> None:
        return None

    def chunk(
        self, rid: str, model: str, index: int, text: str, finish: str | None, logprobs: Logprobs
    ) -> CompletionResponse:
        choice = CompletionChoice(
            index=index,
            text=text,
            finish_reason=finish,
            logprobs=self._logprobs(index, logprobs),
        )
        return CompletionResponse(id=rid, model=model, choices=[choice])

    def usage_chunk(self, rid: str, model: str, usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=rid, model=model, choices=[], usage=usage)

    def _logprobs(self, index: int, rendered: Logprobs) -> CompletionLogprobs | None:
        """OpenAI's legacy shape; each ``top_logprobs`` entry holds the top n and the
        chosen token (so up to n + 1 entries, as OpenAI documents)."""
        if rendered is None:
            return None
        offsets = self._offsets.setdefault(index, _TextOffsets()).advance(rendered)
        return CompletionLogprobs(
            tokens=[token_text(r.token) for r in rendered],
            token_logprobs=[r.logprob for r in rendered],
            top_logprobs=[
                None
                if r.logprob is None
                else {**{token_text(t): v for t, v in r.top}, token_text(r.token): r.logprob}
                for r in rendered
            ],
            text_offset=offsets,
        )
