"""``POST /v1/chat/completions``: messages through the model's chat template, with
tool calls (``spec.toolCalls``) and reasoning (``spec.reasoning``) read back."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from specd.workers.gateway.errors import ApiError
from specd.workers.gateway.protocol import ChatCompletionRequest, ChatFormat
from specd.workers.gateway.request_limits import Body
from specd.workers.gateway.serving import Serving


async def serve_chat(api: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    """A chat completion (also the Responses API's engine room)."""
    api.check_model(body.model)
    api.check_token_ids(body)
    await api.replica_ready(request)
    context_length = api.context_length()
    prompt = await api.chat_prompt(body)
    # OpenAI's chat default: as long as the context allows (the engine stops there)
    default_max_tokens = max(1, context_length - len(prompt))
    choice, parser = body.tool_choice_name(), api.pool.spec.tool_calls.parser
    if choice == "auto" and parser is None:
        raise ApiError(
            400,
            'tool_choice: "auto" (the default with tools) needs spec.toolCalls.parser '
            "(hermes or llama3_json, the model family's call format); or send "
            '"required", a named function or "none"',
            "tool_choice",
        )
    reasoning, prompt_tail = api.reasoning_for(body, prompt)
    fmt = ChatFormat(choice, parser, reasoning, prompt_tail)
    thinking = None if reasoning is None else reasoning.grammar_waits(prompt_tail)
    return await api.generate(
        request, body, fmt, prompt, default_max_tokens, parser, grammar_thinking=thinking
    )


def chat_router(api: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: Body[ChatCompletionRequest], request: Request) -> Response:
        return await serve_chat(api, body, request)

    return router
