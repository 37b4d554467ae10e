"""``POST /tokenize`` and ``POST /detokenize`` (as vLLM offers them)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
)

from specd.workers.gateway.protocol.chat import (
    ChatMessage,
    ToolParam,
    chat_messages,
    tools_for_template,
)
from specd.workers.gateway.protocol.generation import checked_template_kwargs
from specd.workers.gateway.protocol.shared import Lenient, omit_none


class TokenizeRequest(Lenient):
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


class DetokenizeRequest(Lenient):
    """``POST /detokenize``: token ids -> text (special tokens kept)."""

    model: str
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None = Field(None, exclude_if=omit_none)
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
