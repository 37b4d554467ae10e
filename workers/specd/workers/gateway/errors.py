"""How the gateway answers an error: an OpenAI error object whose message and ``param``
name the field it is about.

`ApiError` is raised anywhere on a request's path and answered by the app's handler;
`install_error_handlers` also turns FastAPI's validation errors (the field found by
following the real body), unknown routes and unexpected exceptions into the same shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from specd.workers.gateway.protocol import error_body

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as an OpenAI error object with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param).model_dump(mode="json"), status_code=status
    )


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def param_of_location(loc: tuple, body: Any) -> str | None:
    """``messages[0].role`` from a pydantic error location, following the real body.

    Location parts not present in the body (pydantic's union-member tags) end the
    path, except a final missing key, which is the field being asked for.
    """
    path, node = "", body
    for i, part in enumerate(loc[1:]):  # loc[0] is "body"
        if isinstance(part, int) and isinstance(node, list) and part < len(node):
            path, node = f"{path}[{part}]", node[part]
        elif (
            isinstance(part, str) and isinstance(node, dict) and (part in node or i == len(loc) - 2)
        ):
            path, node = f"{path}.{part}" if path else part, node.get(part)
        else:
            break
    return path or None


def validation_message(err: dict, param: str | None) -> str:
    if err["type"] == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
    if err["type"] == "model_attributes_type" or (
        err["loc"] == ("body",) and err["type"] not in ("missing", "value_error")
    ):
        return "request body must be a JSON object (send Content-Type: application/json)"
    if err["type"] == "missing":
        return f"{param or 'request body'}: field required"
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    return f"{param}: {msg}" if param else msg


def param_of_message(message: str) -> str | None:
    """Engine refusals start with the field they are about: ``"prompt: ..."``,
    ``"response_format.json_schema.schema: ..."``."""
    head, sep, _ = message.partition(":")
    return head if sep and all(part.isidentifier() for part in head.split(".")) else None


def about(param: str | None, message: str) -> str:
    """``"param: message"``: errors name the field they are about (see `param_of_message`)."""
    if param is None or message.startswith(f"{param}:"):
        return message
    return f"{param}: {message}"


def install_error_handlers(app: FastAPI) -> None:
    """Every error ``app`` answers is an OpenAI error object."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        param = param_of_location(tuple(err["loc"]), exc.body)
        return error_response(400, validation_message(err, param), param)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}")
