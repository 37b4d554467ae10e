"""``GET /admin/status`` (the document the operator builds the CR status from) and
``POST /admin/release`` (what the operator's finalizer calls before deleting a
deployment on an external Ray cluster: drain and kill the actors of a running gateway,
and start no new ones).  Both are guarded by `admin_auth.GuardAdmin`: a state change
always needs the admin token, a JSON content type and no browser ``Origin``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from specd.workers.gateway.protocol import ADMIN_ERROR_STATUSES, error_responses
from specd.workers.pool.controller import PoolController


def admin_router(pool: PoolController) -> APIRouter:
    router = APIRouter()
    release: asyncio.Future[list[str]] | None = None

    @router.get("/admin/status", responses=error_responses(ADMIN_ERROR_STATUSES))
    async def admin_status() -> JSONResponse:
        return JSONResponse(pool.status().model_dump(mode="json"))

    @router.post("/admin/release", responses=error_responses(ADMIN_ERROR_STATUSES))
    async def admin_release() -> JSONResponse:  # token, content type, Origin: GuardAdmin
        nonlocal release
        if release is None:  # concurrent and repeated calls share the one release
            release = asyncio.ensure_future(pool.stop())
        return JSONResponse({"released": await asyncio.shield(release)})

    return router
