"""OpenAI API shapes the gateway speaks: requests, responses, stream chunks, errors.

Requests validate everything the engine cannot see (types, ranges, ``n``, batched
prompts, unsupported options) so a bad field becomes a 400 that names it.  Unknown
fields are *ignored*, not rejected as OpenAI does: clients and SDKs send vendor fields
(``extra_body``, tracing ids) that must not break a request.  Options we do not
implement are accepted when they ask for nothing (``logprobs: null``, ``echo: false``,
``presence_penalty: 0``) and refused otherwise, naming the field.

``CompletionFormat`` and ``ChatFormat`` turn engine output into the two endpoints'
response and chunk objects, so the gateway runs one code path for both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specd.workers.engine.types import SamplingParams
from specd.workers.engine.types import Usage as EngineUsage

MAX_STOP_SEQUENCES = 4  # OpenAI's limit

FinishReasonName = Literal["stop", "length"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _omit_none(value: Any) -> bool:
    return value is None


# -- requests -----------------------------------------------------------------


class StreamOptions(_Lenient):
    include_usage: bool = False


class _GenerationRequest(_Lenient):
    """Fields shared by completions and chat completions."""

    # field -> values that ask for nothing; any other value of the field is refused
    _NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = {
        "presence_penalty": (0,),
        "frequency_penalty": (0,),
        "logit_bias": ({},),
    }

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(
        -1, ge=-1, description="Extension: sample from the k most likely (-1, 0: off)"
    )
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = Field(
        (), description="Extension: token ids that end the output"
    )
    ignore_eos: bool = Field(False, description="Extension: keep going past end-of-sequence")
    session_id: str | None = Field(
        None, description="Extension: append this request as a turn of the session"
    )
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return () if value is None else value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = cls._NO_OP.get(info.field_name or "")
        if allowed is not None and value is not None and value not in allowed:
            ok = " or ".join(json.dumps(v) for v in (*allowed, None))
            raise ValueError(f"not supported by this server (send {ok})")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(
        self, default_max_tokens: int, defaults: Mapping[str, float] | None = None
    ) -> SamplingParams:
        """The engine's parameters; ``defaults`` (the deployment's sampling defaults)
        fill the sampling fields this request left out."""
        chosen = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        for key, value in (defaults or {}).items():
            if key in chosen and key not in self.model_fields_set:
                chosen[key] = value
        return SamplingParams(
            max_tokens=self.requested_max_tokens() or default_max_tokens,
            temperature=chosen["temperature"],
            top_p=chosen["top_p"],
            top_k=chosen["top_k"] if chosen["top_k"] > 0 else -1,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    _NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_GenerationRequest._NO_OP,
        "echo": (False,),
        "best_of": (1,),
        "logprobs": (),
        "suffix": (),
    }

    prompt: str | list[int]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

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


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    _NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_GenerationRequest._NO_OP,
        "logprobs": (False,),
        "top_logprobs": (0,),
        "tools": ([],),
        "response_format": ({"type": "text"},),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# -- responses ----------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0

    @classmethod
    def from_engine(cls, usage: EngineUsage) -> UsageInfo:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
            spec_verify_steps=usage.spec_verify_steps,
            spec_accepted_tokens=usage.spec_accepted_tokens,
        )


class ResponseBase(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = Field(None, exclude_if=_omit_none)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReasonName | None = None


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specd"
    max_model_len: int | None = Field(None, exclude_if=_omit_none)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SessionObject(BaseModel):
    """``POST /v1/sessions``: ``replica`` is informational; the id alone routes turns."""

    id: str
    object: Literal["session"] = "session"
    created: int = Field(default_factory=lambda: int(time.time()))
    replica: str


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session"] = "session"
    deleted: bool = True


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "gone_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """The OpenAI error object for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


# -- endpoint formats ---------------------------------------------------------


class ResponseFormat(Protocol):
    """How one endpoint shapes a finished response and a stream chunk."""

    id_prefix: str

    def response(
        self, rid: str, model: str, text: str, finish: str, usage: UsageInfo
    ) -> ResponseBase: ...

    def opening_chunk(self, rid: str, model: str) -> ResponseBase | None: ...

    def chunk(self, rid: str, model: str, text: str, finish: str | None) -> ResponseBase: ...

    def usage_chunk(self, rid: str, model: str, usage: UsageInfo) -> ResponseBase: ...


class CompletionFormat:
    id_prefix = "cmpl-"

    def response(
        self, rid: str, model: str, text: str, finish: str, usage: UsageInfo
    ) -> CompletionResponse:
        choice = CompletionChoice(text=text, finish_reason=finish)
        return CompletionResponse(id=rid, model=model, choices=[choice], usage=usage)

    def opening_chunk(self, rid: str, model: str) -> None:
        return None

    def chunk(self, rid: str, model: str, text: str, finish: str | None) -> CompletionResponse:
        return CompletionResponse(
            id=rid, model=model, choices=[CompletionChoice(text=text, finish_reason=finish)]
        )

    def usage_chunk(self, rid: str, model: str, usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=rid, model=model, choices=[], usage=usage)


class ChatFormat:
    id_prefix = "chatcmpl-"

    def response(
        self, rid: str, model: str, text: str, finish: str, usage: UsageInfo
    ) -> ChatCompletionResponse:
        choice = ChatChoice(message=ChatMessageOut(content=text), finish_reason=finish)
        return ChatCompletionResponse(id=rid, model=model, choices=[choice], usage=usage)

    def opening_chunk(self, rid: str, model: str) -> ChatCompletionChunk:
        """OpenAI opens a chat stream with the role and empty content."""
        delta = ChatDelta(role="assistant", content="")
        return ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(delta=delta)])

    def chunk(self, rid: str, model: str, text: str, finish: str | None) -> ChatCompletionChunk:
        delta = ChatDelta(content=text or None)
        return ChatCompletionChunk(
            id=rid, model=model, choices=[ChatChunkChoice(delta=delta, finish_reason=finish)]
        )

    def usage_chunk(self, rid: str, model: str, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage)
