"""The gateway: OpenAI HTTP API, health, metrics and admin status over a `PoolController`.

`build_app` makes the FastAPI app, one `APIRouter` per surface:

- `routes_completions` — ``/v1/completions``;
- `routes_chat` — ``/v1/chat/completions``;
- `routes_responses` — ``/v1/responses`` (a translation of chat);
- `routes_sessions` — ``/v1/sessions`` (a session's turns: `sessions`);
- `routes_models` — ``/v1/models``, ``/tokenize``, ``/detokenize``;
- `routes_ops` — ``/version``, ``/health``, ``/metrics``;
- `routes_admin` — ``/admin/status``, ``/admin/release``.

The generation endpoints share `serving.Serving` (a request's path through the pool);
every error is an OpenAI error object (`errors`).  `Gateway` is the process around the
app (Ray connection, pool controller, uvicorn, signal handling) that ``specd serve`` and
the Kubernetes gateway pod run.

Stopping: `Gateway` ends in one of two ways.  ``release`` (``specd serve``) drains and
kills its actors.  ``detach`` (``specd gateway``, the Kubernetes pod) leaves them
running, so the next gateway pod adopts them warm: a pod restart, node drain or image
update does not reload the model.  ``POST /admin/release`` (what the operator's
finalizer calls before deleting a deployment on an external Ray cluster) drains and
kills the actors of a running gateway and keeps it from starting new ones; it always
needs the admin token, a JSON content type and no browser ``Origin``
(`admin_auth.GuardAdmin`, docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, Literal

import ray
import uvicorn
from fastapi import FastAPI
from transformers import PreTrainedTokenizerBase

from specd.workers.config import DeploymentSpec, ray_namespace
from specd.workers.gateway.admin_auth import GuardAdmin
from specd.workers.gateway.api_keys import ApiKeys, RequireApiKey
from specd.workers.gateway.errors import install_error_handlers
from specd.workers.gateway.http_protocol import http_protocol
from specd.workers.gateway.metrics import CountRequests, GatewayMetrics
from specd.workers.gateway.ownership import Owners
from specd.workers.gateway.protocol import API_ERROR_STATUSES, error_responses
from specd.workers.gateway.rate_limits import LimitRequestRate, RateLimits
from specd.workers.gateway.request_limits import LimitRequestSize, document_bodies
from specd.workers.gateway.routes_admin import admin_router
from specd.workers.gateway.routes_chat import chat_router
from specd.workers.gateway.routes_completions import completions_router
from specd.workers.gateway.routes_models import models_router
from specd.workers.gateway.routes_ops import ops_router
from specd.workers.gateway.routes_responses import responses_router
from specd.workers.gateway.routes_sessions import sessions_router
from specd.workers.gateway.serving import Serving
from specd.workers.model.tokenizer import load_tokenizer
from specd.workers.pool.controller import PoolController
from specd.workers.pool.replica import ReplicaFailure

log = logging.getLogger(__name__)

ENGINE_NICENESS = 0  # the engine actors' CPU priority in a Ray this gateway starts


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
    api = Serving(pool, tokenizer, Owners(keyed, admin_token))
    metrics = GatewayMetrics()
    limits = RateLimits(lambda: pool.spec.auth.requests_per_minute)
    app.add_middleware(LimitRequestSize, max_bytes=lambda: pool.spec.gateway.max_request_bytes)
    app.add_middleware(LimitRequestRate, limits=limits, per_key=keyed)  # after the key check
    if keyed:
        app.add_middleware(RequireApiKey, keys=api_keys)  # inside CountRequests: 401s count
    app.add_middleware(GuardAdmin, token=admin_token)  # /admin/* only; refusals count too
    app.add_middleware(CountRequests, metrics=metrics)
    app.state.metrics = metrics
    install_error_handlers(app)
    routers = [
        completions_router(api),
        chat_router(api),
        responses_router(api),
        sessions_router(api),
        models_router(api),
        ops_router(pool, metrics),
        admin_router(pool),
    ]
    for router in routers:
        app.include_router(router)
    document_bodies(app, routers)
    return app


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
                http=http_protocol(lambda: self.pool.spec.gateway.request_read_timeout_seconds),
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
            # logical CPUs for every replica's ranks plus a rolling update's surge one
            per_replica = self.spec.resources.cpu * self.spec.parallelism.tensor
            needed = math.ceil(per_replica * (self.spec.most_replicas + 1))
            ray.init(
                namespace=ray_namespace(self.namespace),
                include_dashboard=False,
                num_cpus=max(os.cpu_count() or 1, needed),
                # Ray starts workers at nice 15 by default: the replicas would then get
                # the CPU only after this gateway and its clients on a shared machine
                _system_config={"worker_niceness": ENGINE_NICENESS},
            )
        return True
