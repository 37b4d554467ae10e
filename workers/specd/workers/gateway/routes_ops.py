"""What the pod's probes and Prometheus read: ``GET /version``, ``GET /health`` (503
with a ``reason`` when no replica can serve) and ``GET /metrics`` (the gateway's own
metrics and every replica's exposition, merged)."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from specd.workers.contracts import GatewayHealth
from specd.workers.gateway.metrics import GatewayMetrics, merge_expositions
from specd.workers.pool.controller import PoolController

try:
    SPECD_VERSION = importlib.metadata.version("specd")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    SPECD_VERSION = "unknown"


def ops_router(pool: PoolController, metrics: GatewayMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/version")
    async def version() -> JSONResponse:  # open, with or without API keys: the pod's probes
        return JSONResponse({"version": SPECD_VERSION})

    @router.get("/health")
    async def health() -> JSONResponse:
        ready = pool.ready()
        unhealthy = [r.name for r in ready if not r.healthy]
        idle = pool.scales_to_zero and pool.desired_replicas == 0  # a request starts one
        ok = (bool(ready) or idle) and not unhealthy
        reason = None
        if (failure := pool.current_failure()) is not None:  # no replica will start
            reason = f"replica {failure.replica} failed to load: {failure.message}"
        elif not ok:
            reason = "no replica is ready yet"
            if unhealthy:
                reason = f"engine unhealthy on {', '.join(unhealthy)}"
        body = GatewayHealth(
            status="scaled_to_zero" if idle and not ready else "ok" if ok else "unavailable",
            ready_replicas=len(ready),
            desired_replicas=pool.desired_replicas,
            unhealthy_replicas=tuple(unhealthy),
            reason=reason,
        )
        return JSONResponse(body.document(), status_code=200 if ok else 503)

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.observe_pool(pool)
        text = merge_expositions(await pool.supervisor.metrics_texts(), metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return router
