"""What one request may cost the gateway, so that no request can stall or crash it.

* `LimitRequestSize` (ASGI middleware): a body over ``spec.gateway.maxRequestBytes`` is
  refused with 413, at once when its ``Content-Length`` says so, else (a chunked body)
  as soon as the bytes read pass the limit; it is never read whole.
* `json_body`: the FastAPI dependency that reads a request model from the body, parsed
  and validated on `off_loop` (FastAPI would do both on the event loop), strictly:
  JSON's own numbers only (Python's json takes ``NaN`` and ``Infinity``, and ``1e999``
  is an infinity) and text only (a lone UTF-16 surrogate such as ``"\\ud800"`` cannot be
  encoded, and the tokenizer and the native libraries raise on it).  Each refusal is a
  400 naming the field, as FastAPI's own validation errors are.
* `Body`: ``Body[Model]`` annotates a route's parameter as its body parsed by `json_body`.
* `off_loop`: a small thread pool for the work that grows with a request's size
  (parsing, tokenizing and chat templating, detokenizing), so the event loop stays
  free for ``/health``, ``/metrics`` and the streams in flight.  Its few workers bound
  how many threads contend with the loop for the GIL: a fast tokenizer's Rust encode
  and decode release it, Jinja templating and list conversions do not.

docs/robustness.md has the limits and the measurements behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import functools
import json
import math
import os
import re
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specd.workers.gateway.api_keys import send_error

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# Threads for request work: half the cores, at most 4.  Each competes with the event
# loop for the GIL in its Python parts (the loop waits up to 5 ms for a thread in
# Python code, as long as a C call lasts for one in C), and `specd serve` shares the
# machine with its replicas.
OFF_LOOP_WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))

# ... and they run at a lower CPU priority (Linux nice, per thread), so a busy machine
# still schedules the event loop, the replicas and the probes first
OFF_LOOP_NICE = 10

_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(
            OFF_LOOP_WORKERS, thread_name_prefix="specd-request", initializer=_lower_priority
        )
    return _executor


def _lower_priority() -> None:
    if sys.platform.startswith("linux"):  # a thread id is a process id there only
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), OFF_LOOP_NICE)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the request threads; the caller's loop is free meanwhile.  A
    caller cancelled while it runs (its client left) lets it finish unawaited."""
    return await asyncio.get_running_loop().run_in_executor(_pool(), functools.partial(fn, *args))


# -- body size ---------------------------------------------------------------------


class RequestTooLarge(HTTPException):
    """Raised while a body is read, once its bytes pass the limit (the app's HTTP
    exception handler answers it as OpenAI's error object)."""

    def __init__(self, limit: int):
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    size = f"{limit / (1 << 20):g} MiB" if limit % (1 << 20) == 0 else f"{limit} bytes"
    return (
        f"request body too large: the limit is {size} ({limit} bytes; spec.gateway.maxRequestBytes)"
    )


class LimitRequestSize:
    """ASGI middleware: 413 for a body over ``max_bytes()`` (read from the live spec
    on each request).  The rest of a refused body is discarded by the server as it
    arrives, never buffered.  A client that leaves before its body is in ends its
    request quietly: there is no one to answer."""

    def __init__(self, app: Any, max_bytes: Callable[[], int]):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes()
        length = _content_length(scope)
        if length is not None and length > limit:
            await send_error(send, 413, too_large_message(limit), [])
            return
        read = 0

        async def counted() -> dict:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise RequestTooLarge(limit)
            return message

        try:
            await self.app(scope, counted, send)
        except ClientDisconnect:  # the client left mid-body: nobody to answer, no error
            return


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


# -- strict JSON bodies ----------------------------------------------------------

# a \u escape of a UTF-16 surrogate (D800-DFFF), or one's UTF-8-style bytes (json
# decodes bytes with "surrogatepass"): only then can a parsed string hold a lone one
_SURROGATE_IN_RAW = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
NOT_FINITE = "must be a finite number (JSON has no NaN or Infinity)"
NOT_TEXT = "holds a lone UTF-16 surrogate (such as \\ud800), which is not text"


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: ``model`` from the request's JSON body, parsed and
    validated off the event loop (`parse_body`)."""

    async def parsed(request: Request) -> M:
        raw = await request.body()
        return await off_loop(parse_body, model, raw, request.headers.get("content-type"))

    parsed.body_model = model  # type: ignore[attr-defined]  # for `document_bodies`
    return parsed


class Body:
    """``Body[Model]``: a request body parsed and validated off the event loop, with
    NaN, Infinity and lone surrogates refused (`json_body`)."""

    def __class_getitem__(cls, model: type[BaseModel]) -> Any:
        return Annotated[model, Depends(json_body(model))]


def document_bodies(app: FastAPI, routers: Iterable[APIRouter] = ()) -> None:
    """List in the app's OpenAPI document the request body of each route that parses
    it with `json_body` (a dependency, so FastAPI would leave it out): the models'
    schemas under ``components/schemas``, each route's ``requestBody`` a ref to its own.
    ``routers``: those included in ``app`` (newer FastAPI keeps their routes there)."""
    bodies = {
        (route.path, method.lower()): dep.call.body_model
        for route in [*app.routes, *(r for router in routers for r in router.routes)]
        if isinstance(route, APIRoute)
        for dep in route.dependant.dependencies
        if hasattr(dep.call, "body_model")
        for method in route.methods
    }
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = generate()  # cached by FastAPI as app.openapi_schema: completed in place
        _, defs = models_json_schema(
            [(model, "validation") for model in set(bodies.values())],
            ref_template="#/components/schemas/{model}",
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        for (path, method), model in bodies.items():
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            doc["paths"][path][method]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref}},
            }
        return doc

    app.openapi = openapi


def parse_body(model: type[M], raw: bytes, content_type: str | None) -> M:
    """``model`` from a JSON body, or `RequestValidationError` as FastAPI raises it
    (``loc`` starts with ``"body"``), naming the field of a non-finite number or a
    lone surrogate."""
    if not raw:
        raise _invalid("missing", (), "Field required", None)
    if not _is_json(content_type):
        raise _invalid("model_attributes_type", (), "not a JSON body", raw)
    try:
        data, suspect = _loads(raw)
    except (ValueError, RecursionError) as err:
        raise _not_json(err) from err
    if suspect and (found := _unsound(data)) is not None:
        path, problem = found
        raise _invalid("value_error", path, problem, data)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in err.errors()]
        raise RequestValidationError(errors, body=data) from err


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: ``application/json`` or ``application/*+json`` only."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _loads(raw: bytes) -> tuple[Any, bool]:
    """The parsed body, and whether it may hold a non-finite number or a lone
    surrogate (then `_unsound` looks for it; most bodies never pay for that walk)."""
    odd = False

    def constant(name: str) -> float:  # NaN, Infinity, -Infinity
        nonlocal odd
        odd = True
        return float(name)

    def number(text: str) -> float:
        nonlocal odd
        value = float(text)
        odd = odd or not math.isfinite(value)  # 1e999
        return value

    data = json.loads(raw, parse_constant=constant, parse_float=number)
    return data, odd or _SURROGATE_IN_RAW.search(raw) is not None


def _unsound(data: Any) -> tuple[tuple, str] | None:
    """The path of the first non-finite number or string with a lone surrogate (a
    value or a key), in document order, and what is wrong with it."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return path, NOT_FINITE
        if isinstance(node, str) and not _is_text(node):
            return path, NOT_TEXT
        if isinstance(node, dict):
            for key in node:
                if not _is_text(key):
                    return path, f"a key {NOT_TEXT}"
            stack.extend(((*path, k), v) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(node))))
    return None


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def _invalid(kind: str, path: tuple, message: str, body: Any) -> RequestValidationError:
    error: dict[str, Any] = {"type": kind, "loc": ("body", *path), "msg": message}
    if kind == "value_error":
        error["ctx"] = {"error": ValueError(message)}
    return RequestValidationError([error], body=body)


def _not_json(err: Exception) -> RequestValidationError:
    if isinstance(err, json.JSONDecodeError):
        position, why = err.pos, err.msg
    elif isinstance(err, RecursionError):
        position, why = 0, "nested too deeply"
    elif isinstance(err, UnicodeDecodeError):
        position, why = err.start, "not UTF-8"
    else:  # an integer of more digits than Python converts
        position, why = 0, str(err)
    error = {
        "type": "json_invalid",
        "loc": ("body", position),
        "msg": "JSON decode error",
        "ctx": {"error": why},
    }
    return RequestValidationError([error], body=None)
