"""The gateway: OpenAI HTTP API, health, metrics and admin status over a `PoolController`.

`build_app` makes the FastAPI app; `Gateway` is the process around it (Ray connection,
pool controller, uvicorn, signal handling) that ``specd serve`` and the Kubernetes
gateway pod run.

Request path (both generation endpoints share it; only the `ResponseFormat` differs):
size limit (413) -> parse and validate (pydantic -> 400 naming the field) -> check the
model name (404) and token ids -> tokenize -> pick a replica (router) -> stream deltas
from its actor.  Parsing and tokenizing run off the event loop (`request_limits`: a
long prompt takes seconds), so /health and the streams in flight never wait behind
them.  The response starts only
once the first delta is in, so a request the engine refuses (prompt too long, ...)
answers with its real status code even when ``stream`` is set.  A replica that is
draining or dies before producing output is skipped for another one; one that dies
mid-stream ends the request with an error (503), never a hang.  A client that goes
away cancels the Ray stream, which aborts the request in the engine.

Stopping: `Gateway` ends in one of two ways.  ``release`` (``specd serve``) drains and
kills its actors.  ``detach`` (``specd gateway``, the Kubernetes pod) leaves them
running, so the next gateway pod adopts them warm: a pod restart, node drain or image
update does not reload the model.  ``POST /admin/release`` (what the operator's
finalizer calls before deleting a deployment on an external Ray cluster) drains and
kills the actors of a running gateway and keeps it from starting new ones; it always
needs the admin token, a JSON content type and no browser ``Origin``
(`admin_auth.GuardAdmin`, docs/security.md).

Sessions: ``POST /v1/sessions`` opens one on a replica (router) and answers an id that
names that replica's actor (`router.session_token`).  Its first turn (a generation
request with ``session_id``) may move it to the replica caching that turn's prompt
prefix (`_Api._placed`); a turn goes to the replica the session is on, which the
gateway remembers (`session_homes`: placed, or moved off a retired replica) or, after
a restart, asks the replicas for; if it died the session is gone (410).  A turn's
prompt is tokenized as usual; the engine drops the BOS of turns after the first.  With
API keys, sessions and stored responses belong to the key that made them
(`ownership.Owners`: a session id carries its owner's seal; another key gets 404).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import logging
import math
import os
import re
import signal
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, TypeVar

import ray
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
)
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from specd.workers.admin_auth import GuardAdmin
from specd.workers.api_keys import ApiKeys, RequireApiKey
from specd.workers.config import DeploymentSpec, ray_namespace
from specd.workers.engine.thinking_gate import thinking_tag_ids
from specd.workers.engine.types import FinishReason, GenerateDelta, GenerateRequest
from specd.workers.gateway_metrics import CountRequests, GatewayMetrics, merge_expositions
from specd.workers.model.tokenizer import (
    apply_chat_template,
    decode_text,
    load_tokenizer,
    token_bytes_reader,
)
from specd.workers.openai_protocol import (
    ADMIN_ERROR_STATUSES,
    API_ERROR_STATUSES,
    ChatCompletionRequest,
    ChatFormat,
    ChoiceResult,
    CompletionFormat,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RenderedLogprob,
    ResponseFormat,
    SessionDeleted,
    SessionObject,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    error_body,
    error_responses,
    output_constraints,
    render_logprobs,
)
from specd.workers.ownership import Owners
from specd.workers.parallel_choices import choice_requests, merge_streams
from specd.workers.pool import (
    PoolController,
    Replica,
    ReplicaError,
    ReplicaFailure,
    ReplicaState,
    replica_of_actor,
)
from specd.workers.rate_limits import LimitRequestRate, RateLimits
from specd.workers.reasoning import PARSERS, ReasoningParser
from specd.workers.request_limits import (
    LimitRequestSize,
    document_bodies,
    json_body,
    off_loop,
)
from specd.workers.responses_api import (
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
from specd.workers.router import parse_session_token, session_token

log = logging.getLogger(__name__)

try:
    SPECD_VERSION = importlib.metadata.version("specd")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    SPECD_VERSION = "unknown"

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED = 499  # nginx's convention; only ever seen in metrics

T = TypeVar("T")


class ApiError(Exception):
    """An error answered as an OpenAI error object with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class _ClientGone(Exception):
    pass


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param).model_dump(mode="json"), status_code=status
    )


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


# -- request plumbing --------------------------------------------------------------


def _param_of_location(loc: tuple, body: Any) -> str | None:
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


def _validation_message(err: dict, param: str | None) -> str:
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


def _param_of_message(message: str) -> str | None:
    """Engine refusals start with the field they are about: ``"prompt: ..."``,
    ``"response_format.json_schema.schema: ..."``."""
    head, sep, _ = message.partition(":")
    return head if sep and all(part.isidentifier() for part in head.split(".")) else None


def _error_delta(rid: str, status: int, message: str) -> GenerateDelta:
    return GenerateDelta(
        rid=rid, finished=True, finish_reason=FinishReason.ERROR, error=message, error_code=status
    )


def _refused(delta: GenerateDelta) -> bool:
    """A replica's refusal before any token (draining, or unhealthy): the request may
    go elsewhere."""
    return delta.finished and delta.error_code == 503 and not delta.token_ids


def _failure(delta: GenerateDelta) -> ApiError | None:
    """The error a final delta stands for, if it is not a normal finish."""
    if delta.finish_reason is FinishReason.ERROR:
        status = delta.error_code or 500
        message = delta.error or "the engine failed to serve the request"
        return ApiError(status, message, _param_of_message(message) if status < 500 else None)
    if delta.finish_reason is FinishReason.ABORT:
        return ApiError(503, "the request was aborted: the replica is shutting down; retry")
    return None


_SESSION_ERRORS = (404, 409, 410)  # unknown, a turn already in flight, closed or expired
_PROMPT_TAIL_TOKENS = 8  # enough to see whether a chat template opened <think>
_REMEMBERED_UNPLACED = 65536  # sessions opened here whose first turn may still move them


@dataclass(frozen=True, slots=True)
class _SessionRoute:
    """Where a session lives: its replica, and its id there (``engine_sid``)."""

    session_id: str  # the id clients hold
    replica: Replica
    engine_sid: str
    owner: str | None = None  # the API key (its `key_id`) the session belongs to

    def in_gateway_terms(self, delta: GenerateDelta) -> GenerateDelta:
        """A turn's session errors (404, 409, 410) name the field and the gateway's id;
        an aborted turn means the session went away under it (closed, replica stopping)."""
        if delta.finish_reason is FinishReason.ABORT:
            message = (
                f"session {self.session_id} was closed (or its replica stopped) while this turn ran"
            )
            return _error_delta(delta.rid, 410, _about("session_id", message))
        if delta.error is None or delta.error_code not in _SESSION_ERRORS:
            return delta
        return replace(delta, error=_about("session_id", self.gateway_message(delta.error)))

    def gateway_message(self, message: str) -> str:
        """Engine messages name the engine's session id; clients know the gateway's."""
        return message.replace(self.engine_sid, self.session_id)


def _about(param: str | None, message: str) -> str:
    """``"param: message"``: errors name the field they are about (see `_param_of_message`)."""
    if param is None or message.startswith(f"{param}:"):
        return message
    return f"{param}: {message}"


@dataclass
class _Turn:
    """A session turn this gateway serves: its client, whether its stream has closed,
    and, when its client left mid-turn, the abort sent to the engine."""

    client: Request
    over: asyncio.Event = field(default_factory=asyncio.Event)
    abort: asyncio.Future | None = None


def _session_gone(session_id: str, ray_name: str, param: str | None) -> ApiError:
    replica = replica_of_actor(ray_name)
    message = (
        f"session {session_id} was held by replica {replica}, which is gone; open a new session"
    )
    return ApiError(410, _about(param, message), param)


async def _prepend(
    first: GenerateDelta, rest: AsyncGenerator[GenerateDelta, None]
) -> AsyncGenerator[GenerateDelta, None]:
    """``first`` then ``rest``; closing this closes ``rest`` (and so the Ray stream)."""
    async with contextlib.aclosing(rest):
        yield first
        if not first.finished:
            async for delta in rest:
                yield delta


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``; if the client disconnects first, cancel it and raise `_ClientGone`."""
    work = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise _ClientGone
    return work.result()


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _checked_ids(ids: Sequence[int], vocab: int, param: str) -> list[int]:
    """``ids`` as a list, each in [0, vocab), else a 400 naming ``param``."""
    ids = list(ids)
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ApiError(400, f"{param}: token ids must be in [0, {vocab})", param)
    return ids


class _Api:
    """Route logic shared by the endpoints (kept out of closures to stay testable)."""

    def __init__(
        self,
        pool: PoolController,
        tokenizer: PreTrainedTokenizerBase,
        owners: Owners | None = None,
    ):
        self.owners = owners or Owners(keyed=False)
        self.pool = pool
        self.tokenizer = tokenizer
        self._turns: dict[str, _Turn] = {}  # session id -> its latest turn here
        self._unplaced: OrderedDict[str, bool] = OrderedDict()  # opened here, no turn yet
        self._token_bytes = functools.lru_cache(maxsize=1 << 16)(token_bytes_reader(tokenizer))
        self._special_ids = frozenset(tokenizer.all_special_ids)  # left out of the text
        self._has_thinking_tags = thinking_tag_ids(tokenizer) is not None
        # a fast tokenizer's first call resets the truncation and padding its file may
        # set: done here, before `off_loop` threads share it (a reset while another
        # thread encodes raises "Already borrowed")
        tokenizer("")

    def logprobs_of(self, delta: GenerateDelta) -> list[RenderedLogprob] | None:
        """``delta``'s log-probs with token texts, or None if the request asked for none."""
        return render_logprobs(
            delta.token_ids, delta.logprobs, self._token_bytes, self._special_ids
        )

    @property
    def model_name(self) -> str:
        return self.pool.spec.served_model_name

    def context_length(self) -> int:
        return int(self._ready_info("context_length"))

    async def replica_ready(self, request: Request) -> None:
        """Return once a replica is ready: at once, or (a pool scaled to zero) after one
        started for this request; 503 naming the timeout if none did in time."""
        pool = self.pool
        if await pool.wait_for_replica(request.is_disconnected) or not pool.scales_to_zero:
            return  # (nothing to wait for: the caller answers 503 as before)
        if pool.released:
            raise ApiError(503, "this deployment's replicas were released")
        timeout = pool.autoscaler.policy.cold_start_timeout_seconds
        raise ApiError(
            503,
            f"no replica became ready within {timeout:g} s of this request (scaled to zero; "
            "spec.autoscaling.coldStartTimeoutSeconds); retry shortly",
        )

    def sampling_defaults(self) -> dict[str, float]:
        """What a request that leaves a sampling field out gets (the engine resolved it
        from spec.samplingDefaults and the model's generation_config.json)."""
        return self._ready_info("sampling_defaults")

    def max_model_len(self) -> int | None:
        """The context length, once a ready replica has reported it (else None)."""
        try:
            return self.context_length()
        except ApiError:
            return None

    def _ready_info(self, key: str) -> Any:
        for replica in self.pool.ready():
            if replica.info.get(key) is not None:
                return replica.info[key]
        raise ApiError(503, "no ready replica; retry shortly")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
            )

    def check_fits_context(
        self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: Sequence[int]
    ) -> None:
        """A prompt that fills the context is refused here, before it is routed and sent
        (hashing its blocks and pickling it would hold the event loop for as long as it
        is big); the engine checks again, with a session's history and its KV pool."""
        context = self.context_length()
        if body.session_id is None and len(prompt_ids) >= context:
            message = (
                f"prompt: {len(prompt_ids)} tokens do not fit the context length {context} "
                "(leave room for at least one output token)"
            )
            raise ApiError(400, message, "prompt")

    def check_token_ids(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """A 400 naming the field of a token id (``stop_token_ids``, a ``logit_bias``
        key) outside the model's vocabulary: the engine indexes tensors with them."""
        if (problem := body.out_of_vocab(self.vocab_size())) is not None:
            raise ApiError(400, problem, _param_of_message(problem))

    def vocab_size(self) -> int:
        """How many token ids the model has (ids index its tensors), as a ready replica
        reports it; else the tokenizer's count."""
        for replica in self.pool.ready():
            if (vocab := replica.info.get("vocab_size")) is not None:
                return int(vocab)
        return len(self.tokenizer)

    async def completion_prompt(self, body: CompletionRequest | TokenizeRequest) -> list[int]:
        """Token ids as sent are used verbatim (once checked); text is tokenized.  Both
        run off the event loop: a long prompt takes seconds."""
        if isinstance(body.prompt, str):
            return await off_loop(lambda: list(self.tokenizer(body.prompt)["input_ids"]))
        return await off_loop(_checked_ids, body.prompt, self.vocab_size(), "prompt")

    async def chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        """The chat template over ``messages`` (a session turn: the new messages only),
        rendered and tokenized off the event loop."""
        return await off_loop(self._chat_prompt, body)

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        try:
            return apply_chat_template(
                self.tokenizer,
                body.chat_messages(),
                body.template_tools(),
                body.chat_template_kwargs,
            )
        except Exception as err:  # jinja template errors: the messages do not fit the template
            raise ApiError(
                400, f"messages: the model's chat template refused them: {err}", "messages"
            ) from err

    def reasoning_for(
        self, body: ChatCompletionRequest, prompt: Sequence[int]
    ) -> tuple[ReasoningParser | None, str]:
        """``spec.reasoning``'s parser for ``body`` and the end of its prompt (which may
        open the thinking block).  A request held to a grammar (structured output, a
        forced tool call) thinks first too when the tokenizer has single-token <think>
        and </think>, since the grammar can then wait for the thinking to end; without
        them the grammar holds from the first token, so it gets no parser."""
        name = self.pool.spec.reasoning.parser
        forced = body.tool_choice_name() not in (None, "auto") or output_constraints(vars(body))
        if name is None or (forced and not self._has_thinking_tags):
            return None, ""
        return PARSERS[name], self.tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:])

    # -- sessions -------------------------------------------------------------
    def check_sessions_enabled(self, param: str | None) -> None:
        if not self.pool.spec.sessions.enabled:
            message = "sessions are disabled on this deployment (set spec.sessions.enabled: true)"
            raise ApiError(400, _about(param, message), param)

    async def session_route(
        self, session_id: str, param: str | None, owner: str | None = None
    ) -> _SessionRoute:
        """Where ``session_id`` lives: the replica that opened it, or the one it moved to
        when that one was retired; 404 if it is no session id (or not ``owner``'s), 410 if
        it is nowhere (its replica died, or no replica could take it)."""
        self.check_sessions_enabled(param)
        token = self.owners.unseal(session_id, owner)
        parsed = None if token is None else parse_session_token(token)
        if parsed is None:
            raise ApiError(404, _about(param, f"no session {session_id!r}"), param)
        ray_name, engine_sid = parsed
        replica = await self.pool.find_session(ray_name, engine_sid)
        if replica is None:
            raise _session_gone(session_id, ray_name, param)
        return _SessionRoute(session_id, replica, engine_sid, owner)

    async def open_session(self, owner: str | None = None) -> SessionObject:
        """Open a session on the replica the router picks; a replica that is full (429),
        draining or unreachable is skipped for the next one."""
        self.check_sessions_enabled(None)
        tried: set[str] = set()
        refusal = ApiError(503, "no ready replica can open a session; retry shortly")
        while (replica := self.pool.pick(exclude=tried, for_session=True)) is not None:
            tried.add(replica.name)
            replica.note_session_opened()  # before the call: concurrent opens spread
            try:
                reply = await self.pool.call(replica, "open_session")
            except ReplicaError as err:
                refusal = ApiError(503, str(err))
                continue
            if reply.ok:
                token = session_token(replica.actor_name, reply.session_id)
                token = self.owners.seal(token, owner)
                self.pool.session_homes.note_home(reply.session_id, replica.actor_name)
                self._note_unplaced(token)
                return SessionObject(id=token, replica=replica.name)
            refusal = ApiError(reply.code, reply.error)
            if reply.code not in (429, 503):
                break
        raise refusal

    def _note_unplaced(self, session_id: str) -> None:
        """``session_id`` was opened here: its first turn may move it (`_placed`)."""
        self._unplaced[session_id] = True
        while len(self._unplaced) > _REMEMBERED_UNPLACED:
            self._unplaced.popitem(last=False)

    async def _placed(self, route: _SessionRoute, prompt: Sequence[int]) -> _SessionRoute:
        """Before a session's first turn: move it to the replica cache-aware routing
        would send ``prompt`` to for its cached prefix (`PoolController.first_turn_home`),
        so sessions that open alike gather where their prompt's KV is; a replica that
        refuses it (full) leaves it where it was.  The prompt goes on the prefix record
        of the replica that runs it."""
        if not self._unplaced.pop(route.session_id, False):
            return route
        pool = self.pool
        target = pool.first_turn_home(prompt, route.replica)
        if target is not None:
            holder = await pool.session_homes.place(
                route.replica,
                route.engine_sid,
                target,
                lambda tried: pool.pick(tried, for_session=True),
                pool.probe_timeout_s,
            )
            if holder is None:
                raise _session_gone(route.session_id, route.replica.actor_name, "session_id")
            route = replace(route, replica=holder)
        pool.note_prompt_served(route.replica, prompt)
        return route

    async def close_session(self, session_id: str, owner: str | None = None) -> SessionDeleted:
        """Close ``session_id`` on its replica (a turn in flight is aborted)."""
        route = await self.session_route(session_id, None, owner)
        self._unplaced.pop(session_id, None)
        try:
            reply = await self.pool.call(route.replica, "close_session", route.engine_sid)
        except ReplicaError as err:
            if err.lost:
                raise _session_gone(session_id, route.replica.actor_name, None) from err
            raise ApiError(503, str(err)) from err
        if not reply.ok:
            raise ApiError(reply.code, route.gateway_message(reply.error))
        return SessionDeleted(id=session_id)

    async def generate(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        fmt: ResponseFormat,
        prompt_ids: list[int],
        default_max_tokens: int,
        tool_parser: str | None = None,
        grammar_thinking: str | None = None,
    ) -> Response:
        """``grammar_thinking``: a grammar waits for the thinking (``Grammar.thinking``)."""
        self.check_fits_context(body, prompt_ids)
        rid = fmt.id_prefix + uuid.uuid4().hex
        params = body.sampling_params(default_max_tokens, self.sampling_defaults(), tool_parser)
        if grammar_thinking is not None and params.grammar is not None:
            params = replace(params, grammar=replace(params.grammar, thinking=grammar_thinking))
        req = GenerateRequest(rid, tuple(prompt_ids), params, priority=body.priority)
        if body.session_id is None:
            choices = [self.deltas(r) for r in choice_requests(req, body.n)]
        else:  # one choice: validated
            owner = self.owners.of(request.headers)
            route = await self.session_route(body.session_id, "session_id", owner)
            turn = replace(req, session_id=route.engine_sid)
            choices = [self.turn_deltas(turn, route, request)]
        try:
            firsts = await _unless_disconnected(
                request, asyncio.gather(*(anext(c) for c in choices))
            )
            for first in firsts:
                if (failure := _failure(first)) is not None:
                    raise failure
            if getattr(body, "echo", False):
                echo = body.prompt
                if not isinstance(echo, str):  # its ids decoded: off the loop, it may be long
                    echo = await off_loop(decode_text, self.tokenizer, prompt_ids, True)
                firsts = [self._echoed(first, echo, prompt_ids) for first in firsts]
            streams = [_prepend(f, c) for f, c in zip(firsts, choices, strict=True)]
            if body.stream:
                events = self.stream_events(fmt, rid, streams, body.include_usage)
                choices = []  # handed to the response, which closes them
                return StreamingResponse(events, media_type="text/event-stream")
            return await _unless_disconnected(request, self.respond(fmt, rid, streams))
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            for choice in choices:
                await choice.aclose()

    def _echoed(self, delta: GenerateDelta, text: str, prompt_ids: list[int]) -> GenerateDelta:
        """``echo``: the prompt (``text``: as sent, or its ids decoded) leads the text and,
        with ``logprobs``, the token lists (the engine scored the prompt)."""
        logprobs = None
        if delta.logprobs is not None:
            logprobs = (*delta.prompt_logprobs, *delta.logprobs)
        return replace(
            delta,
            text=text + delta.text,
            token_ids=(*prompt_ids, *delta.token_ids),
            logprobs=logprobs,
        )

    async def deltas(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        """``req``'s deltas from the replica the router picks; errors arrive as error deltas.

        Until the first delta is out, a replica that is draining (503) or dies is
        skipped for another one: nothing was shown to the client yet.
        """
        tried: set[str] = set()
        refusal = _error_delta(req.rid, 503, "no ready replica can take the request; retry shortly")
        while (replica := self.pool.route(req.prompt_ids, exclude=tried)) is not None:
            tried.add(replica.name)
            sent = False
            try:
                async with contextlib.aclosing(self.pool.stream(replica, req)) as stream:
                    async for delta in stream:
                        if not sent and _refused(delta):
                            refusal = delta  # draining or unhealthy: try another replica
                            break
                        sent = True
                        yield delta
                if sent:
                    return
            except ReplicaError as err:
                if sent or not err.lost:
                    yield _error_delta(req.rid, 503 if err.lost else 500, str(err))
                    return
        yield refusal

    async def turn_deltas(
        self, req: GenerateRequest, route: _SessionRoute, client: Request
    ) -> AsyncGenerator[GenerateDelta, None]:
        """A session turn's deltas from its session's replica only: the history lives
        there, so nothing is retried elsewhere; a replica lost meanwhile means 410.  A
        replica that began draining as the turn set out refuses it (503), and the turn
        follows its session to where it moves."""
        await self._previous_turn_settled(route.session_id)
        turn = self._turns[route.session_id] = _Turn(client)
        finished = False
        try:
            route = await self._placed(route, req.prompt_ids)
            while True:
                async with contextlib.aclosing(self.pool.stream(route.replica, req)) as stream:
                    async for delta in stream:
                        if _refused(delta) and route.replica.state is ReplicaState.DRAINING:
                            break
                        finished = delta.finished
                        yield route.in_gateway_terms(delta)
                    else:
                        break
                route = await self.session_route(route.session_id, "session_id", route.owner)
        except ApiError as err:
            finished = True
            yield _error_delta(req.rid, err.status, err.message)
        except ReplicaError as err:
            finished = True  # nothing left to abort
            if err.lost:
                gone = _session_gone(route.session_id, route.replica.actor_name, "session_id")
                yield _error_delta(req.rid, gone.status, gone.message)
            else:
                yield _error_delta(req.rid, 500, str(err))
        finally:
            if not finished:  # the client left mid-turn (the stream's close cancels it)
                turn.abort = asyncio.ensure_future(self._abort_turn(route, req.rid, turn))
            elif self._turns.get(route.session_id) is turn:
                del self._turns[route.session_id]
            turn.over.set()

    async def _abort_turn(self, route: _SessionRoute, rid: str, turn: _Turn) -> None:
        """Post the abort of a turn its client left, as a call of its own (see
        `_previous_turn_settled`); a replica gone meanwhile has nothing to abort."""
        try:
            with contextlib.suppress(ReplicaError):
                await self.pool.call(route.replica, "abort", rid)
        finally:
            if self._turns.get(route.session_id) is turn:
                del self._turns[route.session_id]

    async def _previous_turn_settled(self, session_id: str) -> None:
        """Before a session's next turn: if the client left the previous one, wait until
        that turn's abort has reached its engine (whose inbox is ordered), so the new
        turn is not refused with 409 for a turn that is already gone.  Cancelling the
        Ray stream aborts it too, but in no fixed order with the next call."""
        previous = self._turns.get(session_id)
        if previous is None:
            return
        timeout = self.pool.probe_timeout_s
        with contextlib.suppress(TimeoutError):  # `_abort_turn` never raises
            if not previous.over.is_set() and await previous.client.is_disconnected():
                await asyncio.wait_for(previous.over.wait(), timeout)  # the stream closes
            if previous.abort is not None:
                await asyncio.wait_for(asyncio.shield(previous.abort), timeout)

    async def respond(
        self, fmt: ResponseFormat, rid: str, streams: list[AsyncGenerator[GenerateDelta, None]]
    ) -> Response:
        """The whole (non-streaming) response, or the error a choice ended with."""

        async def whole(stream: AsyncGenerator[GenerateDelta, None]):
            text, logprobs, last = [], [], None
            async for delta in stream:
                text.append(delta.text)
                logprobs += self.logprobs_of(delta) or []
                last = delta
            return "".join(text), (logprobs if last.logprobs is not None else None), last

        results = await asyncio.gather(*(whole(s) for s in streams))
        for _, _, last in results:
            if (failure := _failure(last)) is not None:
                return error_response(failure.status, failure.message, failure.param)
        usages = [last.usage for _, _, last in results if last.usage is not None]
        usage = UsageInfo.from_engine(usages) if len(usages) == len(results) else None
        choices = [
            ChoiceResult(i, text, last.finish_reason.value, logprobs)
            for i, (text, logprobs, last) in enumerate(results)
        ]
        return _json(fmt.response(rid, self.model_name, choices, usage))

    async def stream_events(
        self,
        fmt: ResponseFormat,
        rid: str,
        streams: list[AsyncGenerator[GenerateDelta, None]],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """SSE ``data:`` events of every choice as they come (``index`` tells them apart),
        an error event if a choice fails, the usage of all choices, then ``[DONE]``."""
        model = self.model_name
        merged = merge_streams(streams)
        usages, failed = {}, False
        try:
            for i in range(len(streams)):
                if (opening := fmt.opening_chunk(rid, model, i)) is not None:
                    yield _sse(opening)
            async for i, delta in merged:
                if (failure := _failure(delta)) is not None:
                    yield _sse(error_body(failure.status, failure.message, failure.param))
                    failed = True
                    break
                finish = delta.finish_reason.value if delta.finished else None
                logprobs = self.logprobs_of(delta)
                if (delta.text or finish or logprobs) and (
                    chunk := fmt.chunk(rid, model, i, delta.text, finish, logprobs)
                ) is not None:
                    yield _sse(chunk)
                if delta.finished and delta.usage is not None:
                    usages[i] = delta.usage
            if include_usage and not failed and len(usages) == len(streams):
                usage = UsageInfo.from_engine([usages[i] for i in range(len(streams))])
                yield _sse(fmt.usage_chunk(rid, model, usage))
            yield "data: [DONE]\n\n"
        finally:  # client gone: cancels the Ray streams -> engine aborts
            await merged.aclose()
            for stream in streams:
                await stream.aclose()


class _Body:
    """``_Body[Model]``: a request body parsed and validated off the event loop, with
    NaN, Infinity and lone surrogates refused (`request_limits.json_body`)."""

    def __class_getitem__(cls, model: type[BaseModel]) -> Any:
        return Annotated[model, Depends(json_body(model))]


def build_app(
    pool: PoolController,
    tokenizer: PreTrainedTokenizerBase,
    admin_token: str | None = None,
    api_keys: ApiKeys | None = None,
) -> FastAPI:
    """The gateway's FastAPI app over ``pool`` (which must be started by the caller);
    ``admin_token`` guards ``POST /admin/*`` (None: every state change is refused),
    ``api_keys`` (if enabled) the OpenAI endpoints."""
    app = FastAPI(
        title="specd",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        responses=error_responses(API_ERROR_STATUSES),
    )
    keyed = api_keys is not None and api_keys.enabled
    owners = Owners(keyed, admin_token)
    api = _Api(pool, tokenizer, owners)
    release: asyncio.Future[list[str]] | None = None
    metrics = GatewayMetrics()
    limits = RateLimits(lambda: pool.spec.auth.requests_per_minute)
    app.add_middleware(LimitRequestSize, max_bytes=lambda: pool.spec.gateway.max_request_bytes)
    app.add_middleware(LimitRequestRate, limits=limits, per_key=keyed)  # after the key check
    if keyed:
        app.add_middleware(RequireApiKey, keys=api_keys)  # inside CountRequests: 401s count
    app.add_middleware(GuardAdmin, token=admin_token)  # /admin/* only; refusals count too
    app.add_middleware(CountRequests, metrics=metrics)
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        param = _param_of_location(tuple(err["loc"]), exc.body)
        return error_response(400, _validation_message(err, param), param)

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

    @app.post("/v1/completions")
    async def completions(body: _Body[CompletionRequest], request: Request) -> Response:
        api.check_model(body.model)
        api.check_token_ids(body)
        await api.replica_ready(request)
        api.context_length()  # 503 before tokenizing when nothing can serve
        prompt = await api.completion_prompt(body)
        return await api.generate(
            request, body, CompletionFormat(), prompt, COMPLETIONS_DEFAULT_MAX_TOKENS
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: _Body[ChatCompletionRequest], request: Request) -> Response:
        return await serve_chat(body, request)

    async def serve_chat(body: ChatCompletionRequest, request: Request) -> Response:
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

    stored = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: _Body[ResponsesRequest], request: Request) -> Response:
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
            answer = await serve_chat(chat, request)
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

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        owner = owners.of(request.headers)
        if (found := stored.get(response_id, owner)) is None:
            raise ApiError(404, f"no stored response {response_id!r}")
        return JSONResponse(found[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        if not stored.delete(response_id, owners.of(request.headers)):
            raise ApiError(404, f"no stored response {response_id!r}")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/sessions")
    async def open_session(request: Request) -> Response:
        api.check_sessions_enabled(None)
        await api.replica_ready(request)
        return _json(await api.open_session(owners.of(request.headers)))

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> Response:
        owner = owners.of(request.headers)
        return _json(await api.close_session(session_id, owner))

    @app.post("/tokenize")
    async def tokenize(body: _Body[TokenizeRequest]) -> Response:
        api.check_model(body.model)
        if body.messages is not None:
            tokens = await api.chat_prompt(body)
        else:
            tokens = await api.completion_prompt(body)
        answer = functools.partial(
            TokenizeResponse, count=len(tokens), max_model_len=api.max_model_len(), tokens=tokens
        )
        return await off_loop(lambda: _json(answer()))  # a long prompt: many ids to write

    @app.post("/detokenize")
    async def detokenize(body: _Body[DetokenizeRequest]) -> Response:
        api.check_model(body.model)

        def text() -> str:
            return decode_text(tokenizer, _checked_ids(body.tokens, len(tokenizer), "tokens"))

        return _json(DetokenizeResponse(prompt=await off_loop(text)))

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(
            ModelList(data=[ModelCard(id=api.model_name, max_model_len=api.max_model_len())])
        )

    @app.get("/version")
    async def version() -> JSONResponse:  # open, with or without API keys: the pod's probes
        return JSONResponse({"version": SPECD_VERSION})

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = pool.ready()
        unhealthy = [r.name for r in ready if not r.healthy]
        idle = pool.scales_to_zero and pool.desired_replicas == 0  # a request starts one
        ok = (bool(ready) or idle) and not unhealthy
        body = {
            "status": "scaled_to_zero" if idle and not ready else "ok" if ok else "unavailable",
            "ready_replicas": len(ready),
            "desired_replicas": pool.desired_replicas,
            "unhealthy_replicas": unhealthy,
        }
        if (failure := pool.current_failure()) is not None:  # no replica will start
            body["reason"] = f"replica {failure.replica} failed to load: {failure.message}"
        elif not ok:
            body["reason"] = "no replica is ready yet"
            if unhealthy:
                body["reason"] = f"engine unhealthy on {', '.join(unhealthy)}"
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.observe_pool(pool)
        text = merge_expositions(await pool.metrics_texts(), metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/status", responses=error_responses(ADMIN_ERROR_STATUSES))
    async def admin_status() -> JSONResponse:
        return JSONResponse(pool.status())

    @app.post("/admin/release", responses=error_responses(ADMIN_ERROR_STATUSES))
    async def admin_release() -> JSONResponse:  # token, content type, Origin: GuardAdmin
        nonlocal release
        if release is None:  # concurrent and repeated calls share the one release
            release = asyncio.ensure_future(pool.stop())
        return JSONResponse({"released": await asyncio.shield(release)})

    document_bodies(app)
    return app


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
        chat_error = ApiError(400, _validation_message(first, param), param)
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


# -- the serving process --------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: `Gateway` owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class Gateway:
    """Ray connection + pool controller + HTTP server: what ``specd serve`` runs.

    Its actors live in the Ray namespace of its Kubernetes ``namespace`` (`ray_namespace`).
    Connects to ``RAY_ADDRESS`` (or ``spec.ray.address``) when set, else starts a
    local Ray; an already initialized Ray (tests) is used as is and left running.
    SIGINT/SIGTERM (or `stop`) stop accepting connections, let open requests finish
    (up to ``drain_timeout_s``), then, by ``on_stop``, drain and kill the actors
    (``release``) or leave them to the next gateway (``detach``).  With
    ``stop_on_failure`` (``specd serve``) it also stops when no replica is ready and the
    pool gave up loading the model (``failure``); the gateway pod keeps running and
    reports it in /health and /admin/status instead.
    """

    def __init__(
        self,
        spec: DeploymentSpec,
        *,
        name: str = "specd",
        namespace: str | None = None,
        host: str = "127.0.0.1",
        port: int = 8000,
        drain_timeout_s: float = 30.0,
        on_stop: Literal["release", "detach"] = "release",
        admin_token: str | None = None,
        api_keys: ApiKeys | None = None,
        pool_options: dict[str, Any] | None = None,
        stop_on_failure: bool = False,
    ):
        self.spec = spec
        self.name, self.namespace = name, namespace
        self.host, self.port = host, port
        self.drain_timeout_s = drain_timeout_s
        self.on_stop, self.admin_token, self.api_keys = on_stop, admin_token, api_keys
        self.pool_options = pool_options or {}
        self.stop_on_failure = stop_on_failure
        self.failure: ReplicaFailure | None = None  # why `stop_on_failure` stopped it
        self.pool: PoolController | None = None
        self.url: str | None = None
        self.listening = threading.Event()  # set once `url` is known
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop `pool` lives on
        self._server: _Server | None = None
        self._stop_requested = False

    async def run(
        self, *, handle_signals: bool = True, on_ready: Callable[[str], None] | None = None
    ) -> None:
        """Serve until stopped; ``on_ready(url)`` runs once all replicas are first ready."""
        self.loop = asyncio.get_running_loop()
        tokenizer = load_tokenizer(
            self.spec.model.tokenizer or self.spec.model.path
        )  # fail before Ray
        owns_ray = self._connect_ray()
        try:
            self.pool = PoolController(self.spec, name=self.name, **self.pool_options)
            config = uvicorn.Config(
                build_app(self.pool, tokenizer, self.admin_token, self.api_keys),
                host=self.host,
                port=self.port,
                log_level="warning",
                lifespan="off",
                timeout_graceful_shutdown=max(1, math.ceil(self.drain_timeout_s)),
            )
            self._server = _Server(config)
            self._server.should_exit = self._stop_requested
            if handle_signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    self.loop.add_signal_handler(sig, self.stop)
            await self.pool.start()
            serving = asyncio.create_task(self._server.serve())
            if self.stop_on_failure:
                watcher = asyncio.create_task(self._stop_when_failed())
                serving.add_done_callback(lambda _: watcher.cancel())
            await self._announce(serving, on_ready)
            await serving
        finally:
            if self.pool is not None and self.on_stop == "detach":
                await self.pool.detach()
            elif self.pool is not None:
                await self.pool.stop(self.drain_timeout_s)
            if owns_ray:
                ray.shutdown()

    async def _stop_when_failed(self) -> None:
        """Stop once no replica is ready and none will be started (the pool's
        `ReplicaFailure`); ``failure`` then says why."""
        while (failure := self.pool.current_failure()) is None or self.pool.ready():
            await asyncio.sleep(0.1)
        log.error("gateway %s: replica %s failed: %s", self.name, failure.replica, failure.message)
        self.failure = failure
        self.stop()

    def stop(self) -> None:
        """Begin a graceful shutdown (a second call forces it); thread-safe."""
        self._stop_requested = True
        if self._server is None:
            return
        if self._server.should_exit:
            self._server.force_exit = True
        self._server.should_exit = True

    async def _announce(
        self, serving: asyncio.Task, on_ready: Callable[[str], None] | None
    ) -> None:
        server = self._server
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if serving.done():
            return
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        self.listening.set()
        log.info("gateway %s listening on %s", self.name, self.url)
        if on_ready is not None:

            async def announce_ready() -> None:
                while not self.pool.converged():
                    await asyncio.sleep(0.1)
                on_ready(self.url)

            waiter = asyncio.create_task(announce_ready())
            serving.add_done_callback(lambda _: waiter.cancel())

    def _connect_ray(self) -> bool:
        """Returns whether this gateway started (and so must shut down) Ray."""
        if ray.is_initialized():
            return False
        address = os.environ.get("RAY_ADDRESS") or self.spec.ray.address
        if address:
            ray.init(address=address, namespace=ray_namespace(self.namespace))
        else:
            # logical CPUs for every replica plus a rolling update's surge one
            needed = math.ceil(self.spec.resources.cpu * (self.spec.most_replicas + 1))
            ray.init(
                namespace=ray_namespace(self.namespace),
                include_dashboard=False,
                num_cpus=max(os.cpu_count() or 1, needed),
            )
        return True
