"""What the generation endpoints share (`Serving`): the served model as its ready
replicas report it, request checks, prompts (tokenized and chat-templated off the event
loop), and the path of a request through the pool to a response.

Request path (every generation endpoint shares it; only the `ResponseFormat` differs):
size limit (413) -> parse and validate (pydantic -> 400 naming the field) -> check the
model name (404) and token ids -> tokenize -> pick a replica (router) -> stream deltas
from its actor.  Parsing and tokenizing run off the event loop (`request_limits`: a
long prompt takes seconds), so /health and the streams in flight never wait behind
them.  The response starts only once the first delta is in, so a request the engine
refuses (prompt too long, ...) answers with its real status code even when ``stream``
is set.  A replica that is draining or dies before producing output is skipped for
another one; one that dies mid-stream ends the request with an error (503), never a
hang.  A client that goes away cancels the Ray stream, which aborts the request in the
engine.  A session turn goes to its session's replica (`sessions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from specd.workers.contracts import ReplicaInfo
from specd.workers.gateway.errors import ApiError, error_response, json_response, param_of_message
from specd.workers.gateway.ownership import Owners
from specd.workers.gateway.parallel_choices import choice_requests, merge_streams
from specd.workers.gateway.protocol import (
    ChatCompletionRequest,
    ChoiceResult,
    CompletionRequest,
    RenderedLogprob,
    ResponseFormat,
    TokenizeRequest,
    UsageInfo,
    error_body,
    output_constraints,
    render_logprobs,
)
from specd.workers.gateway.reasoning import PARSERS, ReasoningParser
from specd.workers.gateway.request_limits import off_loop
from specd.workers.gateway.sessions import GatewaySessions
from specd.workers.gateway.streams import (
    CLIENT_CLOSED,
    ClientGone,
    error_delta,
    failure_of,
    prepend,
    refused,
    sse,
    unless_disconnected,
)
from specd.workers.model.tokenizer import (
    apply_chat_template,
    decode_text,
    token_bytes_reader,
)
from specd.workers.pool.controller import PoolController
from specd.workers.pool.replica import ReplicaError
from specd.workers.runner.thinking_gate import thinking_tag_ids
from specd.workers.types import GenerateDelta, GenerateRequest

_PROMPT_TAIL_TOKENS = 8  # enough to see whether a chat template opened <think>


def checked_ids(ids: Sequence[int], vocab: int, param: str) -> list[int]:
    """``ids`` as a list, each in [0, vocab), else a 400 naming ``param``."""
    ids = list(ids)
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ApiError(400, f"{param}: token ids must be in [0, {vocab})", param)
    return ids


class Serving:
    """The request logic the endpoints share (kept out of the route closures to stay
    testable), over ``pool`` and the model's ``tokenizer``."""

    def __init__(
        self,
        pool: PoolController,
        tokenizer: PreTrainedTokenizerBase,
        owners: Owners | None = None,
    ):
        self.owners = owners or Owners(keyed=False)
        self.pool = pool
        self.sessions = GatewaySessions(pool, self.owners)
        self.tokenizer = tokenizer
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
        return self._ready_info().context_length

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
        return self._ready_info().sampling_defaults

    def max_model_len(self) -> int | None:
        """The context length, once a ready replica has reported it (else None)."""
        try:
            return self.context_length()
        except ApiError:
            return None

    def _ready_info(self) -> ReplicaInfo:
        """A ready replica's `ReplicaInfo` (the replicas of a deployment agree)."""
        for replica in self.pool.ready():
            if replica.info is not None:
                return replica.info
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
            raise ApiError(400, problem, param_of_message(problem))

    def vocab_size(self) -> int:
        """How many token ids the model has (ids index its tensors), as a ready replica
        reports it; else the tokenizer's count."""
        for replica in self.pool.ready():
            if replica.info is not None:
                return replica.info.vocab_size
        return len(self.tokenizer)

    async def completion_prompt(self, body: CompletionRequest | TokenizeRequest) -> list[int]:
        """Token ids as sent are used verbatim (once checked); text is tokenized.  Both
        run off the event loop: a long prompt takes seconds."""
        if isinstance(body.prompt, str):
            return await off_loop(lambda: list(self.tokenizer(body.prompt)["input_ids"]))
        return await off_loop(checked_ids, body.prompt, self.vocab_size(), "prompt")

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
        owner = self.owners.of(request.headers)
        req = GenerateRequest(rid, tuple(prompt_ids), params, priority=body.priority, owner=owner)
        if body.session_id is None:
            choices = [self.deltas(r) for r in choice_requests(req, body.n)]
        else:  # one choice: validated
            route = await self.sessions.session_route(body.session_id, "session_id", owner)
            turn = replace(req, session_id=route.engine_sid)
            choices = [self.sessions.turn_deltas(turn, route, request)]
        try:
            firsts = await unless_disconnected(
                request, asyncio.gather(*(anext(c) for c in choices))
            )
            for first in firsts:
                if (failure := failure_of(first)) is not None:
                    raise failure
            if getattr(body, "echo", False):
                echo = body.prompt
                if not isinstance(echo, str):  # its ids decoded: off the loop, it may be long
                    echo = await off_loop(decode_text, self.tokenizer, prompt_ids, True)
                firsts = [self._echoed(first, echo, prompt_ids) for first in firsts]
            streams = [prepend(f, c) for f, c in zip(firsts, choices, strict=True)]
            if body.stream:
                events = self.stream_events(fmt, rid, streams, body.include_usage)
                choices = []  # handed to the response, which closes them
                return StreamingResponse(events, media_type="text/event-stream")
            return await unless_disconnected(request, self.respond(fmt, rid, streams))
        except ClientGone:
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
        refusal = error_delta(req.rid, 503, "no ready replica can take the request; retry shortly")
        while (replica := self.pool.route(req.prompt_ids, exclude=tried)) is not None:
            tried.add(replica.name)
            sent = False
            try:
                async with contextlib.aclosing(self.pool.stream(replica, req)) as stream:
                    async for delta in stream:
                        if not sent and refused(delta):
                            refusal = delta  # draining or unhealthy: try another replica
                            break
                        sent = True
                        yield delta
                if sent:
                    return
            except ReplicaError as err:
                if sent or not err.lost:
                    yield error_delta(req.rid, 503 if err.lost else 500, str(err))
                    return
        yield refusal

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
            if (failure := failure_of(last)) is not None:
                return error_response(failure.status, failure.message, failure.param)
        usages = [last.usage for _, _, last in results if last.usage is not None]
        usage = UsageInfo.from_engine(usages) if len(usages) == len(results) else None
        choices = [
            ChoiceResult(i, text, last.finish_reason.value, logprobs)
            for i, (text, logprobs, last) in enumerate(results)
        ]
        return json_response(fmt.response(rid, self.model_name, choices, usage))

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
                    yield sse(opening)
            async for i, delta in merged:
                if (failure := failure_of(delta)) is not None:
                    yield sse(error_body(failure.status, failure.message, failure.param))
                    failed = True
                    break
                finish = delta.finish_reason.value if delta.finished else None
                logprobs = self.logprobs_of(delta)
                if (delta.text or finish or logprobs) and (
                    chunk := fmt.chunk(rid, model, i, delta.text, finish, logprobs)
                ) is not None:
                    yield sse(chunk)
                if delta.finished and delta.usage is not None:
                    usages[i] = delta.usage
            if include_usage and not failed and len(usages) == len(streams):
                usage = UsageInfo.from_engine([usages[i] for i in range(len(streams))])
                yield sse(fmt.usage_chunk(rid, model, usage))
            yield "data: [DONE]\n\n"
        finally:  # client gone: cancels the Ray streams -> engine aborts
            await merged.aclose()
            for stream in streams:
                await stream.aclose()
