"""``POST /v1/chat/completions``: messages and tools, the request, the response and
chunks, and the `ChatFormat` that shapes engine output into them (tool calls read back,
reasoning split off)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
)

from specd.workers.gateway.protocol.generation import (
    GenerationRequest,
    checked_template_kwargs,
    output_constraints,
)
from specd.workers.gateway.protocol.shared import (
    MAX_TOKENS,
    ChoiceResult,
    FinishReasonName,
    Lenient,
    Logprobs,
    RenderedLogprob,
    ResponseBase,
    UsageInfo,
    omit_none,
    token_text,
)
from specd.workers.gateway.reasoning import ReasoningParser, ReasoningStream
from specd.workers.gateway.tool_calls import NO_PARAMETERS, ToolCall, ToolCallReader, tool_grammar
from specd.workers.runner.logprobs import MAX_TOP_LOGPROBS
from specd.workers.types import (
    Grammar,
)


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class CalledFunction(Lenient):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Lenient):
    """A call in an assistant message (a response's, or a request's earlier turn)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Lenient):
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


class FunctionDef(Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(Lenient):
    type: Literal["function"]
    function: FunctionDef


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(
        id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments)
    )


def tools_for_template(tools: list[ToolParam] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (None: no tools)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
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


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, exclude_if=omit_none)  # spec.reasoning
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=omit_none)


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
    role: Literal["assistant"] | None = Field(None, exclude_if=omit_none)
    content: str | None = Field(None, exclude_if=omit_none)
    reasoning_content: str | None = Field(None, exclude_if=omit_none)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=omit_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


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
