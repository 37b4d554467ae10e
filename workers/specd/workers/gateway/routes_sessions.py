"""``POST /v1/sessions`` and ``DELETE /v1/sessions/{id}``: open and close a streaming
session (its turns are generation requests with ``session_id``; `sessions`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from specd.workers.gateway.errors import json_response
from specd.workers.gateway.serving import Serving


def sessions_router(api: Serving) -> APIRouter:
    router = APIRouter()
    sessions, owners = api.sessions, api.owners

    @router.post("/v1/sessions")
    async def open_session(request: Request) -> Response:
        sessions.check_sessions_enabled(None)
        await api.replica_ready(request)
        return json_response(await sessions.open_session(owners.of(request.headers)))

    @router.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> Response:
        owner = owners.of(request.headers)
        return json_response(await sessions.close_session(session_id, owner))

    return router
