"""One model replica: the loop thread that runs scheduler steps, and its async front.

Requests enter through ``generate`` (an async generator of ``GenerateDelta``) and
``abort``; both only post to an inbox.  The loop thread is the single owner of the
scheduler, the KV memory and the model: it drains the inbox between steps, runs one
step, and posts deltas back to each request's asyncio queue (``output.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from specd.kernels import available_backends, get_backend, resolve_backend_name
from specd.kernels.ops import ops_for_backend
from specd.workers.config import ConfigError, DeploymentSpec
from specd.workers.engine.bench_knobs import BenchKnobs
from specd.workers.engine.graph_runner import GraphRunner, default_sizes
from specd.workers.engine.logits_processors import LogitsProcessors, check_processor_params
from specd.workers.engine.logprobs import MAX_TOP_LOGPROBS
from specd.workers.engine.model_runner import LaunchedStep, ModelRunner
from specd.workers.engine.output import OutputProcessor, RequestStream, error_delta
from specd.workers.engine.request_faults import unusable_row_message
from specd.workers.engine.sampling import check_sampling_params
from specd.workers.engine.session_moves import SessionMover, kv_layout_of, vocabulary_of
from specd.workers.engine.structured_output import Grammars, check_grammar_params
from specd.workers.engine.types import (
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    InvalidRequest,
    SessionSnapshot,
)
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.kv_manager import KVManager
from specd.workers.mem_cache.kv_pool import KVPool
from specd.workers.mem_cache.leak_check import row_pool_balance, token_pool_balance
from specd.workers.mem_cache.prefix_cache import PrefixCache
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.mem_cache.sizing import (
    SpecShape,
    admission_headroom,
    ceil_page,
    check_widest_rung_fits_context,
    kv_pool_tokens,
    row_width,
)
from specd.workers.metrics import EngineMetrics
from specd.workers.model.config import ModelConfig
from specd.workers.model.draft_loader import load_draft
from specd.workers.model.loader import load_model
from specd.workers.model.tokenizer import eos_token_ids, load_tokenizer
from specd.workers.prefix_affinity import EvictedBlocks
from specd.workers.scheduler.batch import RunnerOutput, ScheduledBatch
from specd.workers.scheduler.request import Req, RequestStatus
from specd.workers.scheduler.scheduler import Scheduler, SchedulerConfig
from specd.workers.scheduler.sessions import SessionStore, TurnSettling
from specd.workers.speculative.adaptive import SpecPolicy
from specd.workers.speculative.decoder import KVWriteOutOfBounds, SpecDecoder
from specd.workers.speculative.draft_head import DraftHead
from specd.workers.speculative.rung import PLAIN
from specd.workers.speculative.step_graphs import SpecGraphs

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_SESSION_EXPIRY_EVERY_S = 1.0
_SETTLE_POLL_S = 0.002


def check_backend_supports_layout(backend: str, shape: SpecShape | None, page_size: int) -> None:
    """Seed 002: page size > 1 with topk > 1 only on backends that declare the paged tree."""
    if shape is None or page_size == 1 or shape.topk == 1:
        return
    backends = available_backends()
    if not backends[backend].supports_paged_tree:
        able = sorted(name for name, caps in backends.items() if caps.supports_paged_tree)
        raise ConfigError(
            f"spec.attentionBackend: {backend} does not support spec.kvCache.pageSize "
            f"{page_size} with spec.speculative.topk {shape.topk}; use one of {able}, "
            f"or pageSize 1, or topk 1"
        )


def pick_device(spec: DeploymentSpec) -> str:
    return "cuda" if spec.resources.gpus > 0 and torch.cuda.is_available() else "cpu"


def sampling_defaults(spec: DeploymentSpec, config: ModelConfig) -> dict:
    """What requests that leave sampling fields out get (``SamplingDefaultsSpec``)."""
    return spec.sampling_defaults.resolve(config.generation_sampling)


def single_threaded_torch_in_this_thread() -> None:
    """Run this thread's torch ops on one core, leaving other threads as they are.

    Under overlap the loop thread's own torch ops are small; with more threads they start
    a second OpenMP team whose spinning workers take the compute thread's cores (CPU
    overlap at batch 8 ran at 0.6x of synchronous).  ``torch.set_num_threads`` also sets
    the process default that threads adopt on their first torch op, so that default is
    set back from a short-lived thread (which changes only its own team).
    """
    default = torch.get_num_threads()  # also fixes this thread's team before the change
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,))
    restore.start()
    restore.join()


def _call_into(done: Future, fn: Callable[..., Any], args: tuple) -> None:
    """Run ``fn(*args)`` with its result or exception going to ``done``."""
    try:
        done.set_result(fn(*args))
    except BaseException as err:
        done.set_exception(err)


class _Compute:
    """Where torch work runs: inline on the loop thread, or (overlap scheduling) on one
    worker thread, in submission order, while the loop thread prepares the next step.

    Loading runs here too, so one thread owns every large torch op: CPU torch keeps an
    OpenMP team per calling thread, and two teams halve matmul speed on small machines.
    """

    def __init__(self, threaded: bool, name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name) if threaded else None

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future = Future()
        _call_into(done, fn, args)
        return done

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.submit(fn, *args).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Engine:
    def __init__(
        self,
        spec: DeploymentSpec,
        *,
        replica: str = "0",
        device: str | None = None,
        knobs: BenchKnobs = BenchKnobs(),
    ):
        self.spec = spec
        self.knobs = knobs  # benchmark-only, never from the spec
        self.replica = replica
        self.device = torch.device(device or pick_device(spec))
        self.metrics = EngineMetrics(replica)
        self.config_hash = spec.config_hash()
        self.healthy = True
        self.last_error: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status: dict = {}
        self.step_seconds = {"host": 0.0, "model": 0.0}  # loop time outside / inside the model
        self.overlap = spec.scheduler.overlap
        self._compute = _Compute(self.overlap, f"specd-compute-{replica}")
        self._pending: tuple[ScheduledBatch, Future] | None = None  # step in flight (overlap)
        self.strict_mem_check = spec.debug.strict_mem_check >= 1 or bool(
            int(os.environ.get("SPECD_STRICT_MEM_CHECK", "0") or 0)
        )
        self._idle_checked = False  # the idle leak check ran since the last work
        self._parked: list[RequestStream] = []  # turns waiting for their session's last turn
        self._next_expiry = 0.0

    # -- construction ------------------------------------------------------
    def start(self) -> None:
        """Load tokenizer and model, size the KV memory and start the loop thread.

        All torch work, loading included, happens on the loop thread: CPU torch runs
        its OpenMP thread team per calling thread, and a second team (e.g. one left by
        loading on the caller's thread) halves matmul speed on small machines
        (measured: 5.2 ms vs 11 ms per demo-model decode step on 2 cores).
        """
        ready: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"specd-engine-{self.replica}", daemon=True
        )
        self._thread.start()
        error = ready.get()
        if error is not None:
            self._thread.join()
            raise error

    def _run(self, ready: queue.SimpleQueue) -> None:
        try:
            self._compute.run(self._load)
        except BaseException as err:  # handed to start()'s caller
            self._compute.shutdown()
            ready.put(err)
            return
        ready.put(None)
        if self._compute.threaded:
            single_threaded_torch_in_this_thread()
        self._loop()

    def _load(self) -> None:
        spec = self.spec
        self.tokenizer = load_tokenizer(spec.model.tokenizer or spec.model.path)
        self.model, self.model_config = load_model(
            spec.model.path,
            dtype=spec.model.dtype.value,
            device=str(self.device),
            dummy=self.knobs.dummy_weights,
            fused_elementwise=not self.knobs.eager_elementwise,
        )
        self.context_length = spec.model.context_length or self.model_config.max_position_embeddings
        self.eos_token_ids = frozenset(eos_token_ids(self.tokenizer, self.model_config))
        self.sampling_defaults = sampling_defaults(spec, self.model_config)
        self.spec_shape = SpecShape.from_spec(spec.speculative)
        self.spec_policy: SpecPolicy | None = None
        if spec.speculative is not None:
            if spec.speculative.adaptive.enabled:
                check_widest_rung_fits_context(
                    self.spec_shape, spec.kv_cache.page_size, self.context_length
                )
            self.spec_policy = SpecPolicy(spec.speculative)
            self.metrics.spec_adaptive_steps.set(self.spec_policy.active.steps)
        self.draft_head: DraftHead | None = None
        if spec.draft is not None:
            draft, draft_config = load_draft(
                spec.draft.path,
                spec.draft.algorithm,
                self.model,
                self.model_config,
                device=str(self.device),
                dummy=self.knobs.dummy_weights,
                fused_elementwise=not self.knobs.eager_elementwise,
            )
            self.draft_head = DraftHead(draft, draft_config)
        self._build_memory()
        self.graphs: GraphRunner | SpecGraphs | None = None
        self.graphs_off = self._enable_graphs()
        self.sessions = SessionStore(
            self.kv,
            enabled=spec.sessions.enabled,
            max_sessions=spec.sessions.max_sessions,
            timeout_s=spec.sessions.timeout_seconds,
            bos_token_id=self.tokenizer.bos_token_id,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running_requests=spec.max_running_requests,
                chunked_prefill_size=spec.scheduler.chunked_prefill_size,
                context_length=self.context_length,
                eos_token_ids=self.eos_token_ids,
                spec=self.spec_shape,
                policy=spec.scheduler.policy,
            ),
            self.kv,
        )
        self.scheduler.sessions = self.sessions
        self.session_mover = SessionMover(
            self.sessions,
            self.kv,
            [self.kv_pool] + ([self.spec_decoder.draft_pool] if self.spec_decoder else []),
            self._compute.run,
            vocabulary=vocabulary_of(spec),
            kv_layout=kv_layout_of(spec, self.kv_pool.buffer.dtype),
            context_length=self.context_length,
        )
        self.outputs = OutputProcessor(self.metrics, self.tokenizer, self.scheduler.finish)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        if self.spec_decoder is not None:
            self.scheduler.on_release = self._forget_draft_state
        self._refresh_status()

    def _build_memory(self) -> None:
        cfg, spec = self.model_config, self.spec
        page = spec.kv_cache.page_size
        dtype = next(self.model.parameters()).dtype
        per_token = KVPool.bytes_per_token(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype
        )
        draft_cfg = self.draft_head.config if self.draft_head is not None else None
        if draft_cfg is not None:  # the draft's KV shares the target's slots
            per_token += KVPool.bytes_per_token(
                draft_cfg.num_kv_layers, draft_cfg.num_kv_heads, draft_cfg.head_dim, dtype
            )
        free_bytes = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        tokens = kv_pool_tokens(spec.kv_cache, per_token, free_bytes, self.context_length)
        num_pages = tokens // page
        self.allocator = PagedTokenAllocator(num_pages, page)
        sessions = spec.sessions.max_sessions if spec.sessions.enabled else 0
        self.req_pool = ReqToTokenPool(
            spec.max_running_requests + sessions,  # idle sessions keep their row
            row_width(self.context_length, self.spec_shape, page),
            self.device,
            pad_slot=num_pages * page,  # the KV pools' pad slot (one past the allocator's)
        )
        try:
            paged_tree = self.spec_shape is not None and page > 1 and self.spec_shape.topk > 1
            head_dims = [cfg.head_dim] + ([draft_cfg.head_dim] if draft_cfg is not None else [])
            backend_name = resolve_backend_name(
                spec.attention_backend, self.device.type, dtype, paged_tree, head_dims
            )
        except ValueError as err:
            raise ConfigError(str(err)) from err
        check_backend_supports_layout(backend_name, self.spec_shape, page)
        backend = get_backend(backend_name, self.device.type, dtype)
        self.backend_name = backend_name
        ops = ops_for_backend(backend_name)
        self.evicted_blocks = EvictedBlocks(page)  # for the gateway's cache-aware routing
        cache = (
            PrefixCache(
                self.allocator, self.evicted_blocks.evicted, self.evicted_blocks.block_tokens
            )
            if spec.kv_cache.prefix_cache
            else None
        )
        self.kv = KVManager(self.req_pool, self.allocator, ops, cache)
        self.kv_pool = KVPool(
            cfg.num_hidden_layers,
            num_pages * page,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
            self.device,
        )
        processors = LogitsProcessors(sorted(self.eos_token_ids))
        self.runner = ModelRunner(
            self.model, self.req_pool, self.kv_pool, backend, self.device, processors
        )
        self.spec_decoder: SpecDecoder | None = None
        if draft_cfg is not None:
            draft_pool = KVPool(
                draft_cfg.num_kv_layers,
                num_pages * page,
                draft_cfg.num_kv_heads,
                draft_cfg.head_dim,
                dtype,
                self.device,
            )
            self.spec_decoder = SpecDecoder(
                self.model,
                self.draft_head,
                page,
                self.req_pool,
                self.kv_pool,
                draft_pool,
                backend,
                self.device,
                ops=ops,
                force_accept_len=self.knobs.force_accept_len,
                processors=processors,
                guided_drafts=not self.knobs.unguided_drafts,
            )
        self.metrics.kv_tokens_total.set(self.allocator.total_tokens)

    def _enable_graphs(self) -> str | None:
        """CUDA graphs for the steps that have them, where the spec and the backend allow
        (captured on CUDA; without it emulated, see ``EmulatedGraph``).  -> why not."""
        cfg = self.spec.cuda_graph
        if not cfg.enabled:
            return "spec.cudaGraph.enabled is false"
        if not available_backends()[self.backend_name].supports_graphs:
            return f"the {self.backend_name} backend has no graph plans"
        if self.kv.ops.name != "triton":  # the torch ops read index lengths on the host
            return f"graph bodies need the Triton kernel ops, not {self.kv.ops.name}"
        sizes = default_sizes(min(cfg.max_batch_size, self.spec.max_running_requests))
        if self.spec_decoder is None:
            self.graphs = self.runner.enable_decode_graphs(sizes, self.req_pool.width)
        else:
            rungs = list(self.spec.speculative.ladder)
            if self.spec.speculative.policy.max_batch_for_spec is not None:
                rungs.append(PLAIN)  # large batches run the plain rung
            self.graphs = SpecGraphs(self.spec_decoder, rungs, sizes)
            self.spec_decoder.graphs = self.graphs
        self.graphs.capture()
        return None

    def _graph_status(self) -> dict:
        if self.graphs is None:
            return {"mode": "off", "reason": self.graphs_off}
        return self.graphs.status()

    # -- public API (any thread / event loop) --------------------------------
    def validate(self, req: GenerateRequest) -> None:
        """Raise ``InvalidRequest`` naming the field if ``req`` cannot be served (a
        session turn's length is checked on the loop, with its history)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequest("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise InvalidRequest(f"prompt: token ids must be in [0, {vocab})")
        if req.params.max_tokens < 1:
            raise InvalidRequest("max_tokens: must be at least 1")
        check_sampling_params(req.params, vocab)
        check_processor_params(req.params, vocab)
        check_grammar_params(req.params)
        for name in ("logprobs", "prompt_logprobs"):
            top = getattr(req.params, name)
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(f"{name}: must be in [0, {MAX_TOP_LOGPROBS}]")
        if req.params.prompt_logprobs is not None and req.session_id is not None:
            raise InvalidRequest(
                "prompt_logprobs: a session turn's history is cached, not scored; "
                "score the prompt without session_id"
            )
        if req.priority and self.scheduler.config.policy != "priority":
            raise InvalidRequest(
                "priority: this deployment serves requests in arrival order; set "
                "spec.scheduler.policy: priority to use request priorities"
            )
        if req.session_id is None:
            self.check_fits(n, req.params.max_tokens)

    def check_fits(self, n: int, max_tokens: int, history: int = 0) -> None:
        """``n`` context tokens (``history`` of them from a session) leave room for output
        within the context length, and the KV pool can hold the whole request."""
        if n >= self.context_length:
            if history:
                raise InvalidRequest(
                    f"prompt: the session's {history} tokens plus this turn's {n - history} "
                    f"do not fit the context length {self.context_length}; open a new session"
                )
            raise InvalidRequest(
                f"prompt: {n} tokens do not fit the context length {self.context_length} "
                "(leave room for at least one output token)"
            )
        need = ceil_page(min(n + max_tokens, self.context_length), self.kv.page_size)
        if self.spec_shape is not None:  # a verify step holds a reserve beyond committed
            need += admission_headroom(self.spec_shape, self.kv.page_size)
        if need > self.allocator.total_tokens:
            raise InvalidRequest(
                f"max_tokens: prompt + max_tokens needs {need} KV slots but the pool holds "
                f"{self.allocator.total_tokens} (spec.kvCache.maxTokens); lower max_tokens"
            )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream deltas until one is finished; leaving early aborts the request."""
        if not self.healthy:
            yield error_delta(request.rid, f"engine unhealthy: {self.last_error}", 503)
            return
        try:
            self.validate(request)
            grammar = None
            if (asked := request.params.grammar) is not None:  # compiled off the event loop
                started = time.perf_counter()
                grammar = await asyncio.to_thread(self.grammars.state_for, request.params)
                self.metrics.grammar_compile.observe(time.perf_counter() - started)
                self.metrics.structured_requests.labels(self.metrics.replica, asked.kind).inc()
        except InvalidRequest as err:
            yield error_delta(request.rid, str(err), getattr(err, "code", 400))
            return
        req = Req(
            rid=request.rid or uuid.uuid4().hex,
            prompt_ids=list(request.prompt_ids),
            params=request.params,
            grammar=grammar,
            priority=request.priority,
        )
        stream = RequestStream(asyncio.get_running_loop(), asyncio.Queue(), req, request.session_id)
        self._post(("add", stream))
        finished = False
        try:
            while not finished:
                delta = await stream.queue.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        self._post(("abort", rid))

    def open_session(self) -> str:
        """A new streaming session's id (``SessionError`` 400 when sessions are off, 429
        when ``spec.sessions.maxSessions`` are open)."""
        return self.sessions.open()

    def close_session(self, session_id: str) -> None:
        """Close a session (``SessionError`` 404 unknown, 410 already closed or expired);
        its KV is freed on the loop, after the turn in flight if any (that is aborted)."""
        self.sessions.mark_closing(session_id)
        self._post(("close", session_id))

    async def idle_session_ids(self) -> list[str]:
        """Sessions with no turn in flight: those a draining replica can move."""
        return await self._on_loop(self.sessions.idle_ids)

    async def export_session(self, session_id: str) -> SessionSnapshot:
        """Take an idle session out of this replica, its KV copied to the host
        (`SessionMover.leave`); ``SessionError`` as a turn would get, or 409 mid-turn."""
        while True:
            try:
                return await self._on_loop(self.session_mover.leave, session_id)
            except TurnSettling:
                await asyncio.sleep(_SETTLE_POLL_S)  # the step in flight ends first

    async def import_session(self, snapshot: SessionSnapshot) -> bool:
        """Hold a session that left another replica; True when its KV came along."""
        arrived = await self._on_loop(self.session_mover.arrive, snapshot)
        self.metrics.session_arrivals.labels(self.replica, "kv" if arrived else "history").inc()
        return arrived

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` on the loop thread, between steps, awaited by the caller."""
        done: Future = Future()
        self._post(("call", (done, fn, args)))
        return asyncio.wrap_future(done)

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def prefix_cache_shape(self) -> dict | None:
        """``page_size`` and ``capacity_tokens`` of the prefix cache (None when off): what
        the gateway's cache-aware router needs to mirror it."""
        if self.kv.cache is None:
            return None
        return {
            "page_size": self.allocator.page_size,
            "capacity_tokens": self.allocator.total_tokens,
        }

    def status(self) -> dict:
        return dict(self._status, healthy=self.healthy, last_error=self.last_error)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _post(self, item) -> None:
        self._inbox.put(item)
        self._wake.set()

    # -- loop thread ---------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                self._expire_sessions()
                if not self.scheduler.has_work() and self._pending is None:
                    self.outputs.flush()
                    self._refresh_status()
                    self._on_idle()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self.step()
                self.outputs.flush()
        except Exception as err:  # the loop must never die silently
            log.exception("engine %s loop failed", self.replica)
            self.healthy = False
            self.last_error = f"{type(err).__name__}: {err}"
            self.metrics.engine_healthy.set(0)
        finally:
            self._settle_pending()
            self._abort_all()
            self.outputs.flush()
            self._compute.shutdown()

    def step(self) -> None:
        """Schedule, run and account one batch (under overlap: launch the next verify
        before processing the one in flight)."""
        t0 = time.perf_counter()
        retractions_before = self.scheduler.num_retractions
        preemptions_before = self.scheduler.num_preemptions
        evictions_before = self.scheduler.num_session_evictions
        queried_before = self.scheduler.prefix_queried_tokens
        hits_before = self.scheduler.prefix_hit_tokens
        row_errors_before = self.scheduler.num_row_width_errors
        run = self._overlapped_step if self._pending is not None else self._synchronous_step
        self._idle_checked = False
        try:
            model_s = run()
        except KVWriteOutOfBounds:
            self.metrics.leak_check("req_to_token", "busy", ok=False)
            raise
        self.metrics.retractions.inc(self.scheduler.num_retractions - retractions_before)
        self.metrics.preemptions.inc(self.scheduler.num_preemptions - preemptions_before)
        self.metrics.session_evictions.inc(self.scheduler.num_session_evictions - evictions_before)
        self.metrics.prefix_cache_queried.inc(self.scheduler.prefix_queried_tokens - queried_before)
        self.metrics.prefix_cache_hits.inc(self.scheduler.prefix_hit_tokens - hits_before)
        for _ in range(self.scheduler.num_row_width_errors - row_errors_before):
            self.metrics.leak_check("req_to_token", "busy", ok=False)
        if self.strict_mem_check:
            self._leak_check("busy")
        self._refresh_status()
        host_s = time.perf_counter() - t0 - model_s
        for phase, seconds in (("host", host_s), ("model", model_s)):
            self.step_seconds[phase] += seconds
            self.metrics.step_seconds.labels(self.replica, phase).inc(seconds)

    def _synchronous_step(self) -> float:
        """One batch start to finish; under overlap a verify or a plain engine's batch is
        only launched.  Returns the seconds spent waiting for the model."""
        batch = self._with_rung(self.scheduler.schedule())
        self._emit_failed()
        if batch is None:
            return 0.0
        self._count_step(batch)
        t1 = time.perf_counter()
        future = self._submit(batch)
        if self._pipelined(batch):
            self._pending = (batch, future)
            return time.perf_counter() - t1
        out = self._wait(future)
        model_s = time.perf_counter() - t1
        self._process(batch, out)
        return model_s

    def _overlapped_step(self) -> float:
        """Launch step N+1 (committed lengths lag by step N), then process N.  Prefill
        chunks, admissions and retractions need the pipeline drained: then N+1 waits."""
        batch, future = self._pending
        nxt = self._with_rung(self._schedule_ahead(batch))
        self._emit_failed()
        self._pending = None
        if nxt is not None:
            self._count_step(nxt)
            self.metrics.steps_launched_ahead.inc()
            self._pending = (nxt, self._submit(nxt))
        t1 = time.perf_counter()
        out = self._wait(future)
        model_s = time.perf_counter() - t1
        self._process(batch, out)
        return model_s

    def _schedule_ahead(self, in_flight: ScheduledBatch) -> ScheduledBatch | None:
        """The batch to launch behind ``in_flight`` before it is resolved, if any."""
        if self.spec_decoder is None:
            return self.scheduler.schedule_decode_ahead(in_flight)
        if self.scheduler.wants_extend():
            return None
        return self.scheduler.schedule_verify(allow_retract=False)

    def _pipelined(self, batch: ScheduledBatch) -> bool:
        """Under overlap, a verify or a plain engine's batch is only launched and stays in
        flight while the next one is scheduled (a speculative engine's prefill is not)."""
        return self.overlap and (batch.verify or self.spec_decoder is None)

    def _submit(self, batch: ScheduledBatch) -> Future:
        """Queue ``batch`` on the compute thread: a verify, a launch of a pipelined batch,
        or an extend run start to finish."""
        if batch.verify:
            return self._compute.submit(
                self.spec_decoder.step, list(batch.reqs), list(batch.granted_lens), batch.rung
            )
        if self._pipelined(batch):
            return self._compute.submit(self.runner.launch, batch)
        return self._compute.submit(self._extend_compute, batch)

    @staticmethod
    def _wait(future: Future):
        """The result of a batch ``_submit`` queued (a launched one's ids on the host)."""
        out = future.result()
        return out.wait() if isinstance(out, LaunchedStep) else out

    def _process(self, batch: ScheduledBatch, out) -> None:
        """Host side of a computed batch: fail the requests that failed alone, then
        resolve, stop rules, metrics, emit."""
        self._fail_faulted(batch, out)
        if batch.verify:
            self._process_verify(batch, out)
            return
        for req in self._process_extend(batch, out):
            self.outputs.emit(req)

    def _with_rung(self, batch: ScheduledBatch | None) -> ScheduledBatch | None:
        """Fix a verify batch's rung when it is scheduled: the adaptive controller's
        active rung, or plain when the load policy says so (allocation stays widest)."""
        if batch is None or not batch.verify:
            return batch
        rung, by_load = self.spec_policy.choose(len(batch.reqs))
        return dataclasses.replace(
            batch,
            rung=rung,
            plain_by_load=by_load,
            extend_lens=tuple(rung.draft_tokens for _ in batch.reqs),
        )

    def _fail_faulted(self, batch: ScheduledBatch, out) -> None:
        """Finish with an error each request of ``batch`` that failed alone
        (``request_faults.py``): its KV is freed as on an abort, its result dropped, and
        the batch's other requests go on."""
        flagged = batch.reqs if batch.verify else batch.sampled_reqs
        for i in out.unusable if batch.verify else out.unusable_rows:
            req = flagged[i]
            req.fault = unusable_row_message(req)  # the clearer cause wins
            req.error_code = 400 if req.params.grammar is not None else 500  # its own grammar
        for req in batch.reqs:
            if req.fault is None or req.finished:
                continue
            self.scheduler.finish(req, FinishReason.ERROR)
            req.error, req.error_code = req.fault, req.error_code or 500
            self.outputs.emit(req)

    def _settle_pending(self) -> None:
        """Shutdown or failure: let the step in flight finish and account it, so its
        requests' KV can be freed."""
        if self._pending is None:
            return
        batch, future = self._pending
        self._pending = None
        try:
            self._process(batch, self._wait(future))
        except Exception:  # the loop is ending anyway; the KV is still freed below
            log.exception("engine %s: step in flight failed at shutdown", self.replica)
            for req in batch.reqs:
                req.inflight_steps = 0
                req.release_deferred = False

    def _count_step(self, batch: ScheduledBatch) -> None:
        kind = "verify" if batch.verify else "decode"
        if not batch.verify and any(n != 1 for n in batch.extend_lens):
            kind = "extend"
        self.metrics.steps.labels(self.replica, kind).inc()

    def _emit_failed(self) -> None:
        for req in self.scheduler.failed:
            self.outputs.emit(req)
        self.scheduler.failed.clear()

    def _extend_compute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Compute side of a prefill/decode batch; a speculative engine then runs the
        draft over the same positions."""
        capture = self.draft_head.capture_layers if self.draft_head is not None else None
        result = self.runner.run(batch, capture)
        if self.spec_decoder is not None:
            self._draft_after_extend(batch, result)
        return result

    def _process_extend(self, batch: ScheduledBatch, result: RunnerOutput) -> list[Req]:
        updated = self.scheduler.process_result(batch, result)
        if self.spec_decoder is not None:
            for req, sampled in zip(batch.reqs, batch.sample, strict=True):
                req.spec_ready = req.spec_ready or (sampled and not req.finished)
        return updated

    def _draft_after_extend(self, batch: ScheduledBatch, result: RunnerOutput) -> None:
        """Draft rows for the positions the target just filled (token ``p + 1`` with the
        target's hidden at ``p``; the last one of a finished prompt is the sampled token)."""
        features = self.draft_head.features(result.hidden, result.aux)
        sampled = iter(result.next_token_ids)
        starts, tokens, feats = [], [], []
        q0 = 0
        for req, start, n, done in zip(
            batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample, strict=True
        ):
            ahead = req.fill_ids[start + 1 : start + n + 1]
            tokens.append(ahead + [next(sampled)] if done else ahead)
            starts.append(start)
            feats.append(features[q0 : q0 + n])
            q0 += n
        self.spec_decoder.after_extend(list(batch.reqs), starts, tokens, feats, list(batch.sample))

    def _process_verify(self, batch: ScheduledBatch, out) -> None:
        """Host side of a verify: resolve, stop rules, metrics, emit."""
        updated = self.scheduler.process_verify(batch, out.new_tokens, out.logprobs)
        live = {id(r) for r in updated}
        accepted = tuple(
            n for r, n in zip(batch.reqs, out.accept_lens, strict=True) if id(r) in live
        )
        self.metrics.observe_verify(accepted, batch.rung.draft_tokens - 1)
        self._observe_rung(batch, out)
        for req in updated:
            self.outputs.emit(req)

    def _observe_rung(self, batch: ScheduledBatch, out) -> None:
        """Feed the batch's acceptance (probe hits on the plain rung) to the adaptive
        controller; every request the verify ran on counts, finished ones too."""
        rung = batch.rung
        self.metrics.observe_rung(rung.speculates, batch.plain_by_load)
        self.spec_policy.observe(
            rung, batch.plain_by_load, out.accept_lens if rung.speculates else out.probes
        )
        self.metrics.spec_adaptive_steps.set(self.spec_policy.active.steps)

    def _forget_draft_state(self, req: Req) -> None:
        """The scheduler freed ``req``'s KV: drop its draft state (after steps in flight)."""
        self._compute.submit(self.spec_decoder.drop, [req.rid])

    def _drain_inbox(self) -> None:
        parked, self._parked = self._parked, []
        for stream in parked:
            self._add(stream)
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._idle_checked = False
            if kind == "add":
                self._add(item)
            elif kind == "abort":
                self._abort(item)
            elif kind == "close" and (turn := self.sessions.close_now(item)) is not None:
                self._abort(turn.rid)
            elif kind == "call":
                _call_into(*item)

    def _abort(self, rid: str) -> None:
        """Abort ``rid`` wherever it is: parked (never queued; its caller has left) or
        in the scheduler."""
        if self._unpark(rid):
            return
        if (req := self.scheduler.abort(rid)) is not None:
            self.metrics.aborts.inc()
            self.outputs.emit(req)

    def _add(self, stream: RequestStream) -> None:
        """Queue a request; a session turn first joins its session's history and KV."""
        req = stream.req
        if stream.session_id is not None:
            try:
                self.sessions.begin_turn(
                    stream.session_id,
                    req,
                    lambda n, history: self.check_fits(n, req.params.max_tokens, history),
                )
            except TurnSettling:
                self._parked.append(stream)
                return
            except InvalidRequest as err:
                self.outputs.send(stream, error_delta(req.rid, str(err), getattr(err, "code", 400)))
                return
        self.outputs.open(stream)
        self.scheduler.add(req)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids) - req.cached_tokens)

    def _unpark(self, rid: str) -> bool:
        for stream in self._parked:
            if stream.req.rid == rid:
                self._parked.remove(stream)
                return True
        return False

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + _SESSION_EXPIRY_EVERY_S
            if self.sessions.expire(now):
                self._idle_checked = False

    def _leak_check(self, mode: str) -> None:
        """Balance both pools against the live requests and idle sessions (DESIGN §5);
        ``busy`` also checks each drafting request's committed length.  A failure is
        counted and logged with the full breakdown; in strict mode it fails the engine
        (the loop ends, health turns red)."""
        holders = [r.kv for r in self.scheduler.kv_holders()]
        held = [s.kv for s in self.sessions.idle_sessions()]
        problems = []
        for balance in (
            token_pool_balance(self.allocator, holders, held, self.kv.cache),
            row_pool_balance(self.req_pool, holders, held),
        ):
            extra = self._consistency_problem(balance.pool, mode) if balance.ok else None
            ok = balance.ok and extra is None
            self.metrics.leak_check(balance.pool, mode, ok)
            if not ok:
                problems.append(f"{balance.describe()}{f'; {extra}' if extra else ''}")
        if not problems:
            return
        message = f"KV leak check ({mode}) failed: " + " | ".join(problems)
        log.error("engine %s: %s", self.replica, message)
        if self.strict_mem_check:
            raise AssertionError(message)

    def _consistency_problem(self, pool: str, mode: str) -> str | None:
        """The structural checks behind a balanced pool (ownership, lengths)."""
        try:
            if pool == "req_to_token":
                self.kv.check_integrity()
            else:
                self.sessions.check()
                if mode == "busy":
                    self.scheduler.check_committed_lengths()
        except AssertionError as err:
            return str(err)
        return None

    def _on_idle(self) -> None:
        """Idle leak check, once per idle period: only sessions may hold KV."""
        if not self._idle_checked:
            self._idle_checked = True
            self._leak_check("idle")

    def _abort_all(self) -> None:
        """Finish every live request and tell its client.  After an engine failure,
        freeing a request's KV may fail again (the bookkeeping may be what broke): that
        is logged, and the client still gets its last delta."""
        for req in self.outputs.live_requests():
            reason = FinishReason.ABORT if self.healthy else FinishReason.ERROR
            try:
                self.scheduler.finish(req, reason)
            except Exception:
                log.exception("engine %s: freeing %s at shutdown failed", self.replica, req.rid)
                req.status, req.finish_reason = RequestStatus.FINISHED, reason
            if not self.healthy:
                req.error = self.last_error
            self.outputs.emit(req)

    def _refresh_status(self) -> None:
        s, a, cache = self.scheduler, self.allocator, self.kv.cache
        queued_tokens = sum(r.tokens_to_compute for r in s.waiting)
        self.metrics.requests_running.set(len(s.running))
        self.metrics.requests_queued.set(len(s.waiting))
        evictable = cache.evictable_tokens if cache is not None else 0
        cached = cache.num_pages * a.page_size if cache is not None else 0
        used = a.used_tokens - evictable  # what requests and sessions hold
        self.metrics.kv_tokens_used.set(used)
        self.metrics.kv_tokens_cached.set(cached)
        reserved = self.kv.reserved_tokens
        self.metrics.kv_tokens_reserved.set(reserved)
        self.metrics.kv_reserve_ratio.set(reserved / max(used, 1))
        session_tokens = self.sessions.held_tokens()
        self.metrics.sessions_open.set(self.sessions.num_open)
        self.metrics.session_kv_tokens.set(session_tokens)
        self._status = {
            "replica": self.replica,
            "config_hash": self.config_hash,
            "device": self.device.type,
            "attention_backend": self.backend_name,
            "kernel_ops": self.kv.ops.name,
            "cuda_graphs": self._graph_status(),
            "running": len(s.running),
            "queued": len(s.waiting),
            "queued_tokens": queued_tokens,
            "kv_used_tokens": used,
            "kv_cached_tokens": cached,
            "kv_total_tokens": a.total_tokens,
            "kv_usage": used / a.total_tokens,
            "prefix_cache": {
                "queried_tokens": s.prefix_queried_tokens,
                "hit_tokens": s.prefix_hit_tokens,
                "evicted_blocks": self.evicted_blocks.snapshot(),
            },
            "retractions": s.num_retractions,
            "preemptions": s.num_preemptions,
            "kv_reserved_tokens": reserved,
            "leak_check_failures": self.metrics.leak_failures,
            "sessions_open": self.sessions.num_open,
            "session_kv_tokens": session_tokens,
            # cumulative; mean accept length = 1 + accepted_tokens / verify_steps
            "speculation": dict(self.metrics.spec_totals) if self.spec_shape is not None else None,
            "adaptive": self._adaptive_status(),
        }

    def _adaptive_status(self) -> dict | None:
        """The active rung, the controller's estimate and the plain-step counts."""
        if self.spec_policy is None:
            return None
        return {**self.spec_policy.status(), "plain_steps": dict(self.metrics.spec_plain)}
