"""OpenAI's Responses API: ``POST /v1/responses`` (and ``GET`` / ``DELETE`` of a stored
one), served as a translation of a chat completion (`responses_api`): the request
becomes a chat request, the answer a Response, the chat stream Responses events.  A
stored response's conversation continues with ``previous_response_id``."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from specd.workers.gateway.errors import ApiError, validation_message
from specd.workers.gateway.protocol import ChatCompletionRequest
from specd.workers.gateway.request_limits import Body
from specd.workers.gateway.responses_api import (
    InvalidItem,
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    conversation_after,
    created_now,
    output_items,
    response_object,
    to_chat,
)
from specd.workers.gateway.routes_chat import serve_chat
from specd.workers.gateway.serving import Serving


def responses_router(api: Serving) -> APIRouter:
    router = APIRouter()
    owners = api.owners
    stored = ResponseStore()

    @router.post("/v1/responses")
    async def create_response(body: Body[ResponsesRequest], request: Request) -> Response:
        api.check_model(body.model)
        owner = owners.of(request.headers)
        history = []
        if body.previous_response_id is not None:
            if (found := stored.get(body.previous_response_id, owner)) is None:
                message = f"no stored response {body.previous_response_id!r} (store: false, deleted, or this gateway restarted)"
                raise ApiError(404, f"previous_response_id: {message}", "previous_response_id")
            history = found[1]
        chat = _as_chat(body, history)
        rid, created = f"resp_{uuid.uuid4().hex}", created_now()
        try:
            answer = await serve_chat(api, chat, request)
        except ApiError as err:
            raise _in_responses_terms(err, body, len(history)) from err
        conversation = history + [
            m.for_template() for m in chat.messages[bool(body.instructions) :]
        ]
        if isinstance(answer, StreamingResponse):
            events = ResponseEvents(rid, body, created)

            async def translated() -> AsyncIterator[str]:
                async for event in events.translate(answer.body_iterator):
                    yield event
                if body.store and not events.failed:
                    response = response_object(
                        rid, body, events.output, events.finish, events.usage, created
                    )
                    stored.put(response, conversation + conversation_after(events.output), owner)

            return StreamingResponse(translated(), media_type="text/event-stream")
        if answer.status_code != 200:
            return answer
        chat_answer = json.loads(answer.body)
        choice = chat_answer["choices"][0]
        output = output_items(choice["message"])
        usage = chat_answer.get("usage")
        response = response_object(rid, body, output, choice["finish_reason"], usage, created)
        if body.store:
            stored.put(response, conversation + conversation_after(output), owner)
        return JSONResponse(response)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        owner = owners.of(request.headers)
        if (found := stored.get(response_id, owner)) is None:
            raise ApiError(404, f"no stored response {response_id!r}")
        return JSONResponse(found[0])

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        if not stored.delete(response_id, owners.of(request.headers)):
            raise ApiError(404, f"no stored response {response_id!r}")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router


# chat fields a Responses request sets through its own (longest first)
_RESPONSES_PARAMS = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
)


def _as_chat(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """``body`` as a chat request; what cannot be one is a 400 naming the Responses
    field."""
    try:
        return ChatCompletionRequest.model_validate(to_chat(body, history))
    except InvalidItem as err:
        raise ApiError(400, str(err), err.param) from err
    except ValidationError as err:
        first = err.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        param = param.lstrip(".") or None
        chat_error = ApiError(400, validation_message(first, param), param)
        raise _in_responses_terms(chat_error, body, len(history)) from err


def _in_responses_terms(err: ApiError, body: ResponsesRequest, history: int) -> ApiError:
    """A chat error about a field the Responses request names otherwise, renamed (the
    chat ``messages[i]`` are the instructions, the history, then ``input``)."""
    if err.param is None:
        return err
    param = err.param
    if (message := re.match(r"messages\[(\d+)\]", param)) is not None:
        i = int(message[1]) - bool(body.instructions) - history
        head = f"input[{i}]" if i >= 0 and not isinstance(body.input, str) else "input"
        param = head + param[message.end() :]
        if i < 0:
            param = (
                "instructions"
                if int(message[1]) == 0 and body.instructions
                else "previous_response_id"
            )
    for chat_name, name in _RESPONSES_PARAMS:
        if param == chat_name or param.startswith((f"{chat_name}.", f"{chat_name}[")):
            param = name + param[len(chat_name) :]
            break
    if param == err.param:
        return err
    return ApiError(err.status, err.message.replace(err.param, param, 1), param)
