"""``POST /v1/completions``: a prompt (text or token ids) continued."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from specd.workers.gateway.protocol import CompletionFormat, CompletionRequest
from specd.workers.gateway.request_limits import Body
from specd.workers.gateway.serving import Serving

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def completions_router(api: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: Body[CompletionRequest], request: Request) -> Response:
        api.check_model(body.model)
        api.check_token_ids(body)
        await api.replica_ready(request)
        api.context_length()  # 503 before tokenizing when nothing can serve
        prompt = await api.completion_prompt(body)
        return await api.generate(
            request, body, CompletionFormat(), prompt, COMPLETIONS_DEFAULT_MAX_TOKENS
        )

    return router
