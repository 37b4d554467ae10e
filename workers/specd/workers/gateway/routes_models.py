"""The served model and its tokenizer: ``GET /v1/models``, ``POST /tokenize`` and
``POST /detokenize`` (as vLLM offers them)."""

from __future__ import annotations

import functools

from fastapi import APIRouter
from fastapi.responses import Response

from specd.workers.gateway.errors import json_response
from specd.workers.gateway.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from specd.workers.gateway.request_limits import Body, off_loop
from specd.workers.gateway.serving import Serving, checked_ids
from specd.workers.model.tokenizer import decode_text


def models_router(api: Serving) -> APIRouter:
    router = APIRouter()
    tokenizer = api.tokenizer

    @router.post("/tokenize")
    async def tokenize(body: Body[TokenizeRequest]) -> Response:
        api.check_model(body.model)
        if body.messages is not None:
            tokens = await api.chat_prompt(body)
        else:
            tokens = await api.completion_prompt(body)
        answer = functools.partial(
            TokenizeResponse, count=len(tokens), max_model_len=api.max_model_len(), tokens=tokens
        )
        return await off_loop(lambda: json_response(answer()))  # a long prompt: many ids to write

    @router.post("/detokenize")
    async def detokenize(body: Body[DetokenizeRequest]) -> Response:
        api.check_model(body.model)

        def text() -> str:
            return decode_text(tokenizer, checked_ids(body.tokens, len(tokenizer), "tokens"))

        return json_response(DetokenizeResponse(prompt=await off_loop(text)))

    @router.get("/v1/models")
    async def models() -> Response:
        return json_response(
            ModelList(data=[ModelCard(id=api.model_name, max_model_len=api.max_model_len())])
        )

    return router
