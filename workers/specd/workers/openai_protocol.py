"""OpenAI API shapes the gateway speaks: requests, responses, stream chunks, errors.

Requests validate everything the engine cannot see (types, ranges, ``n``, batched
prompts, unsupported options) so a bad field becomes a 400 that names it.  Unknown
fields are *ignored*, not rejected as OpenAI does: clients and SDKs send vendor fields
(``extra_body``, tracing ids) that must not break a request.  Options we do not
implement are accepted when they ask for nothing (``best_of: 1``, ``tools: []``) and
refused otherwise, naming the field.

``CompletionFormat`` and ``ChatFormat`` turn engine output into the two endpoints'
response and chunk objects, so the gateway runs one code path for both.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Protocol, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specd.workers.engine.logprobs import MAX_TOP_LOGPROBS
from specd.workers.engine.types import (
    MAX_TOP_K,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
    Grammar,
    SamplingParams,
    TokenLogprob,
)
from specd.workers.engine.types import Usage as EngineUsage
from specd.workers.model.config import GENERATION_SAMPLING_KEYS  # what defaults can fill
from specd.workers.reasoning import ReasoningParser, ReasoningStream
from specd.workers.tool_calls import NO_PARAMETERS, ToolCall, ToolCallReader, tool_grammar

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_CHOICES = 32  # n: each choice is a request of its own (its prompt prefilled again)
# max_tokens and min_tokens: far past any context length (the engine stops there), and
# within int32 wherever a count meets a tensor
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key: a token id below 2**31 (then < the vocabulary)
TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # and < the vocabulary: `out_of_vocab`

FinishReasonName = Literal["stop", "length", "tool_calls"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _omit_none(value: Any) -> bool:
    return value is None


# -- requests -----------------------------------------------------------------


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    """``response_format.json_schema``: OpenAI's shape (``name`` and ``strict`` are
    accepted; the output always follows the schema)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormatParam(_Lenient):
    """The request's ``response_format``: ``text`` (no constraint), ``json_object`` (any
    JSON object), ``json_schema``, or ``structural_tag`` (xgrammar's, as vLLM and SGLang
    take it: ``format`` is its tree of free text, tags, schemas...)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    format: dict[str, Any] | None = None
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(
        cls, value: JsonSchemaFormat | None, info: ValidationInfo
    ) -> JsonSchemaFormat | None:
        if (value is None) == (info.data.get("type") == "json_schema"):
            raise ValueError(
                'send json_schema (with its "schema") exactly when type is "json_schema"'
            )
        if (info.data.get("format") is None) == (info.data.get("type") == "structural_tag"):
            raise ValueError('send format exactly when type is "structural_tag"')
        return value


# chat template arguments the server sets itself
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "chat_template", "add_generation_prompt", "tokenize",
     "return_dict", "continue_final_message", "documents"}
)  # fmt: skip


def checked_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` that leave the server's own arguments alone."""
    taken = sorted(_RESERVED_TEMPLATE_KWARGS & set(value or ()))
    if taken:
        raise ValueError(f"{', '.join(taken)} cannot be set here: the server sets them")
    return value


def output_constraints(fields: Mapping[str, Any]) -> list[str]:
    """Which of a request's grammar fields ask for one (``fields``: its values by name)."""
    fmt = fields.get("response_format")
    return [
        name
        for name, on in (
            ("response_format", fmt is not None and fmt.type != "text"),
            ("regex", fields.get("regex") is not None),
            ("ebnf", fields.get("ebnf") is not None),
        )
        if on
    ]


class _GenerationRequest(_Lenient):
    """Fields shared by completions and chat completions."""

    # field -> values that ask for nothing; any other value of the field is refused
    _NO_OP: ClassVar[dict[str, tuple[Any, ...]]] = {}

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(
        -1, ge=-1, le=MAX_TOP_K, description="Extension: sample from the k most likely (-1, 0: off)"
    )
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[TokenId, ...] = Field(
        (), description="Extension: token ids that end the output"
    )
    ignore_eos: bool = Field(False, description="Extension: keep going past end-of-sequence")
    session_id: str | None = Field(
        None, description="Extension: append this request as a turn of the session"
    )
    priority: int = Field(
        0,
        ge=-(2**31),
        lt=2**31,
        description="Extension (vLLM's): lower starts first under spec.scheduler.policy: "
        "priority, preempting running requests of a higher value; 0 elsewhere",
    )
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    repetition_penalty: float = Field(
        1.0,
        ge=REPETITION_PENALTY_RANGE[0],
        le=REPETITION_PENALTY_RANGE[1],
        description="Extension: > 1 discourages prompt and output tokens (1: off)",
    )
    min_p: float = Field(
        0.0, ge=0, le=1, description="Extension: drop tokens below min_p * the top probability"
    )
    min_tokens: int = Field(
        0,
        ge=0,
        le=MAX_TOKENS,
        description="Extension: hold back EOS and stop_token_ids until this many",
    )
    response_format: ResponseFormatParam | None = None
    regex: str | None = Field(
        None, description="Extension (SGLang's): the output matches this regular expression"
    )
    ebnf: str | None = Field(
        None, description="Extension (SGLang's): the output follows this EBNF grammar (root rule)"
    )

    @model_validator(mode="after")
    def _one_grammar(self) -> Self:
        asked = output_constraints(vars(self))
        if len(asked) > 1:
            raise ValueError(f"send one output constraint, not {' and '.join(asked)}")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            # ASCII digits only: str.isdigit() also takes "²" and "١٢", which int() refuses
            if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f'key {key!r} is not a token id (send ids as strings: "1234")')
            if not -100 <= bias <= 100:
                raise ValueError(f"bias {bias} of token {key} is not in [-100, 100]")
        return value

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
    def _one_choice_per_turn(cls, value: int, info: ValidationInfo) -> int:
        if value > 1 and info.data.get("session_id") is not None:
            raise ValueError("a session turn continues one conversation; send n=1")
        seed = info.data.get("seed")  # choice i samples with seed + i (`parallel_choices`)
        if seed is not None and seed + value - 1 > SEED_RANGE[1]:
            raise ValueError(f"choice i samples with seed + i, which must be <= {SEED_RANGE[1]}")
        return value

    def out_of_vocab(self, vocab: int) -> str | None:
        """``"field: ..."`` for the first token id outside [0, vocab) (the model's ids),
        if any; the engine indexes its tensors with them."""
        for token in self.stop_token_ids:
            if token >= vocab:
                return f"stop_token_ids: token id {token} is not in [0, {vocab})"
        for key in self.logit_bias or {}:
            if int(key) >= vocab:
                return f"logit_bias: token id {key} is not in [0, {vocab})"
        return None

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

    def requested_logprobs(self) -> int | None:
        """How many top log-probs per token the engine returns (None: no log-probs)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (completions' ``echo``)."""
        return None

    def sampling_params(
        self,
        default_max_tokens: int,
        defaults: Mapping[str, float] | None = None,
        tool_parser: str | None = None,
    ) -> SamplingParams:
        """The engine's parameters; ``defaults`` (the deployment's sampling defaults)
        fill the sampling fields this request left out."""
        chosen = {key: getattr(self, key) for key in GENERATION_SAMPLING_KEYS}
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
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            min_p=chosen["min_p"],
            min_tokens=self.min_tokens,
            repetition_penalty=chosen["repetition_penalty"],
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            grammar=self.grammar(tool_parser),
        )

    def grammar(self, tool_parser: str | None = None) -> Grammar | None:
        """The output constraint asked for (structured output), if any (``tool_parser``:
        the call format of chat's ``tool_choice: auto``)."""
        if self.regex is not None:
            return Grammar("regex", self.regex, "regex")
        if self.ebnf is not None:
            return Grammar("ebnf", self.ebnf, "ebnf")
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Grammar("json_object", field="response_format")
        if fmt.type == "structural_tag":
            tag = json.dumps({"type": "structural_tag", "format": fmt.format})
            return Grammar("structural_tag", tag, "response_format.format")
        schema = json.dumps(fmt.json_schema.schema_)
        return Grammar("json_schema", schema, "response_format.json_schema.schema")


class CompletionRequest(_GenerationRequest):
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


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class CalledFunction(_Lenient):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Lenient):
    """A call in an assistant message (a response's, or a request's earlier turn)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallOut] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: a call's arguments as an object."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(call: ToolCallOut) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them."""
    return [m.for_template() for m in messages]


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Lenient):
    type: Literal["function"]
    function: FunctionDef


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(
        id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments)
    )


def tools_for_template(tools: list[ToolParam] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (None: no tools)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolParam] | None = None
    parallel_tool_calls: bool = True
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, validate_default=True
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extension (vLLM's): more variables for the chat template, e.g. "
        '{"enable_thinking": false}',
    )
    _template_kwargs = field_validator("chat_template_kwargs")(checked_template_kwargs)

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if len(set(names)) != len(names):
            raise ValueError("two tools share a name")
        if not names:
            if value not in (None, "none"):
                raise ValueError("needs tools to choose from")
            return value
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"names {value.function.name!r}, which is not one of the tools")
        if value != "none" and output_constraints(info.data):
            raise ValueError(
                "a tool call is the output's constraint: send no response_format, regex or ebnf"
            )
        return value

    def tool_choice_name(self) -> str | None:
        """``"required"``, ``"auto"`` (OpenAI's default with tools), the named function,
        or None (no tools, or ``"none"``: no call is made)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tool_choice or "auto"

    def grammar(self, tool_parser: str | None = None) -> Grammar | None:
        choice = self.tool_choice_name()
        if choice is None:
            return super().grammar()
        schemas = {t.function.name: t.function.parameters or NO_PARAMETERS for t in self.tools}
        return tool_grammar(schemas, choice, self.parallel_tool_calls, tool_parser)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return tools_for_template(self.tools)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true as well")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.messages)


class TokenizeRequest(_Lenient):
    """``POST /tokenize`` (as vLLM offers it): the token ids a completion (``prompt``) or
    a chat request (``messages``, with the assistant header) would send the model."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, validate_default=True)
    tools: list[ToolParam] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    _template_kwargs = field_validator("chat_template_kwargs")(checked_template_kwargs)

    @field_validator("messages")
    @classmethod
    def _one_input(
        cls, value: list[ChatMessage] | None, info: ValidationInfo
    ) -> list[ChatMessage] | None:
        if (value is None) == (info.data.get("prompt") is None):
            raise ValueError("send either prompt (completions) or messages (chat), not both")
        return value

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.messages or [])

    def template_tools(self) -> list[dict[str, Any]] | None:
        return tools_for_template(self.tools)


class DetokenizeRequest(_Lenient):
    """``POST /detokenize``: token ids -> text (special tokens kept)."""

    model: str
    tokens: list[int]


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
    usage: UsageInfo | None = Field(None, exclude_if=_omit_none)


# -- log-probs ----------------------------------------------------------------

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


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token;
    ``text_offset`` is where each token's text starts in the completion."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]

    @classmethod
    def of(cls, token: bytes, logprob: float, **extra: Any) -> Self:
        return cls(token=token_text(token), logprob=logprob, bytes=list(token), **extra)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


def chat_logprobs(rendered: Sequence[RenderedLogprob] | None) -> ChatLogprobs | None:
    if rendered is None:
        return None
    content = [
        ChatTokenLogprob.of(
            r.token, r.logprob, top_logprobs=[TopLogprob.of(t, v) for t, v in r.top]
        )
        for r in rendered
    ]
    return ChatLogprobs(content=content)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)  # spec.reasoning
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=_omit_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ToolCallDelta(ToolCallOut):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None = Field(None, exclude_if=_omit_none)
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


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


# -- endpoint formats ---------------------------------------------------------


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


class ChatFormat:
    """Chat responses and chunks; with a ``tool_choice`` (``"required"``, ``"auto"`` and
    its ``tool_parser``, or a function's name) the output is read back as tool calls,
    and a stream holds a choice's text from where a call opens until it ends (a call is
    sent whole, as one delta).  With a ``reasoning`` parser (and the prompt's last
    characters, which may open the thinking block) a choice's thinking is returned as
    ``reasoning_content`` and only the rest is content (`reasoning`)."""

    id_prefix = "chatcmpl-"

    def __init__(
        self,
        tool_choice: str | None = None,
        tool_parser: str | None = None,
        reasoning: ReasoningParser | None = None,
        prompt_tail: str = "",
    ):
        self.tools = ToolCallReader(tool_choice, tool_parser) if tool_choice is not None else None
        self.reasoning, self.prompt_tail = reasoning, prompt_tail
        self._held: dict[int, str] = {}  # per choice: text held back
        self._thinking: dict[int, ReasoningStream] = {}  # per choice, while streaming

    def _message(self, text: str, finish: str) -> tuple[ChatMessageOut, str]:
        if self.tools is None:
            return ChatMessageOut(content=text), finish
        content, calls, finish = self.tools.message(text, finish)
        out = [_call_out(c) for c in calls] or None
        return ChatMessageOut(content=content, tool_calls=out), finish

    def _whole_message(self, text: str, finish: str) -> tuple[ChatMessageOut, str]:
        """A finished choice's message: its reasoning apart, the rest read for calls."""
        if self.reasoning is None:
            return self._message(text, finish)
        reasoning, content = self.reasoning.split(text, self.prompt_tail)
        if self.tools is None:
            return ChatMessageOut(content=content, reasoning_content=reasoning), finish
        message, finish = self._message(content or "", finish)
        return message.model_copy(update={"reasoning_content": reasoning}), finish

    def response(
        self, rid: str, model: str, choices: Sequence[ChoiceResult], usage: UsageInfo | None
    ) -> ChatCompletionResponse:
        out = []
        for c in choices:
            message, finish = self._whole_message(c.text, c.finish)
            out.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    finish_reason=finish,
                    logprobs=chat_logprobs(c.logprobs),
                )
            )
        return ChatCompletionResponse(id=rid, model=model, choices=out, usage=usage)

    def opening_chunk(self, rid: str, model: str, index: int) -> ChatCompletionChunk:
        """OpenAI opens each choice of a chat stream with the role and empty content."""
        choice = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        return ChatCompletionChunk(id=rid, model=model, choices=[choice])

    def chunk(
        self, rid: str, model: str, index: int, text: str, finish: str | None, logprobs: Logprobs
    ) -> ChatCompletionChunk | None:
        reasoning = ""
        if self.reasoning is not None:
            thinking = self._thinking.setdefault(
                index, ReasoningStream(self.reasoning, self.prompt_tail)
            )
            reasoning, text = thinking.feed(text)
            if finish is not None:
                more_reasoning, more_text = thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        delta = ChatDelta(content=text or None, reasoning_content=reasoning or None)
        if self.tools is not None:
            text = self._held.pop(index, "") + text
            if finish is None:
                now, self._held[index] = self.tools.streamable(text)
                if not now and not reasoning and logprobs is None:
                    return None
                delta = ChatDelta(content=now or None, reasoning_content=reasoning or None)
            else:
                message, finish = self._message(text, finish)
                calls = [
                    ToolCallDelta(index=j, **call.model_dump())
                    for j, call in enumerate(message.tool_calls or [])
                ]
                delta = ChatDelta(
                    content=message.content or None,
                    reasoning_content=reasoning or None,
                    tool_calls=calls or None,
                )
        choice = ChatChunkChoice(
            index=index, delta=delta, finish_reason=finish, logprobs=chat_logprobs(logprobs)
        )
        return ChatCompletionChunk(id=rid, model=model, choices=[choice])

    def usage_chunk(self, rid: str, model: str, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage)
