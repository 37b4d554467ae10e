"""Shapes every endpoint shares: the API's limits, usage, log-probs as OpenAI shows
them, error objects and the statuses the OpenAPI document lists, the `ResponseFormat`
an endpoint shapes its output with, and the small objects (models, sessions)."""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from specd.workers.types import (
    TokenLogprob,
)
from specd.workers.types import Usage as EngineUsage

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_CHOICES = 32  # n: each choice is a request of its own (its prompt prefilled again)
# max_tokens and min_tokens: far past any context length (the engine stops there), and
# within int32 wherever a count meets a tensor
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key: a token id below 2**31 (then < the vocabulary)
TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # and < the vocabulary: `out_of_vocab`

FinishReasonName = Literal["stop", "length", "tool_calls"]


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def omit_none(value: Any) -> bool:
    return value is None


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
    def from_engine(cls, choices: Sequence[EngineUsage]) -> UsageInfo:
        """A response's usage from its choices': the prompt counts once (OpenAI's rule
        for ``n``), completions and speculation add up."""
        prompt = choices[0].prompt_tokens
        completion = sum(u.completion_tokens for u in choices)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=choices[0].cached_tokens),
            spec_verify_steps=sum(u.spec_verify_steps for u in choices),
            spec_accepted_tokens=sum(u.spec_accepted_tokens for u in choices),
        )


class ResponseBase(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = Field(None, exclude_if=omit_none)


LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM reports impossible tokens the same way


@dataclass(frozen=True, slots=True)
class RenderedLogprob:
    """A generated token's bytes and log-prob (and its position's top tokens')."""

    token: bytes
    logprob: float | None  # None: an echoed prompt's first token
    top: tuple[tuple[bytes, float], ...]
    in_text: bool = True  # False for a special token, which the text leaves out


def token_text(token: bytes) -> str:
    """A token's text as OpenAI shows it: its UTF-8 text, or ``bytes:\\xe6\\x97`` for a
    token that holds part of a character."""
    try:
        return token.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token)


def render_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprob | None] | None,
    token_bytes: Callable[[int], bytes],
    special_ids: Container[int] = (),
) -> list[RenderedLogprob] | None:
    """The engine's log-probs of ``token_ids`` with each token's bytes (None: not asked);
    ``special_ids``: tokens the text leaves out."""
    if logprobs is None:
        return None
    return [
        RenderedLogprob(
            token_bytes(token),
            None if lp is None else max(lp.logprob, LOGPROB_FLOOR),
            () if lp is None else tuple((token_bytes(t), max(v, LOGPROB_FLOOR)) for t, v in lp.top),
            token not in special_ids,
        )
        for token, lp in zip(token_ids, logprobs, strict=True)
    ]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specd"
    max_model_len: int | None = Field(None, exclude_if=omit_none)


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


# The statuses the gateway answers with besides 200, as its OpenAPI document lists them
# (``/openapi.json``; the fuzz test holds the gateway to it).
API_ERROR_STATUSES = {
    400: "invalid request: the message names the field",
    401: "missing or unknown API key",
    404: "unknown model, session or stored response",
    409: "a session turn is already in flight",
    410: "the session was closed or has expired",
    413: "request body over the size limit",
    429: "rate limit, or too many open sessions",
    503: "no replica ready, or the replica is draining",
}
ADMIN_ERROR_STATUSES = {
    403: "a browser request (it has an Origin header)",
    415: "a state change without Content-Type: application/json",
}


def error_responses(statuses: dict[int, str]) -> dict[int | str, dict]:
    """FastAPI ``responses=`` for these statuses, each an OpenAI-shaped error body."""
    return {code: {"model": ErrorResponse, "description": why} for code, why in statuses.items()}


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
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


Logprobs = Sequence[RenderedLogprob] | None  # the tokens' of a response or chunk, if asked


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One finished choice of a non-streaming response."""

    index: int
    text: str
    finish: str
    logprobs: Logprobs


class ResponseFormat(Protocol):
    """How one endpoint shapes a finished response and a stream chunk (one instance per
    request: a format may keep state across a stream's chunks)."""

    id_prefix: str

    def response(
        self, rid: str, model: str, choices: Sequence[ChoiceResult], usage: UsageInfo | None
    ) -> ResponseBase: ...

    def opening_chunk(self, rid: str, model: str, index: int) -> ResponseBase | None: ...

    def chunk(
        self, rid: str, model: str, index: int, text: str, finish: str | None, logprobs: Logprobs
    ) -> ResponseBase | None: ...

    def usage_chunk(self, rid: str, model: str, usage: UsageInfo) -> ResponseBase: ...
