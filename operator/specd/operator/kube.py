"""A small async Kubernetes API client on kopf's credentials (aiohttp, no extra deps).

Only what the operator needs: discovery of one API, get / create / merge-patch /
delete by path, and a status patch guarded by ``resourceVersion``.
"""

from __future__ import annotations

import logging
import ssl
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"

# plural of every kind the operator writes
PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "Deployment": "deployments",
    "RayCluster": "rayclusters",
    "ServiceMonitor": "servicemonitors",
    "SpecDecodeDeployment": "specdecodedeployments",
    "Event": "events",
}
EVENT_SOURCE = "specd-operator"


def build_event(obj: dict[str, Any], type_: str, reason: str, message: str, now: str) -> dict:
    """A core/v1 Event about ``obj`` (what ``kubectl describe`` lists under Events)."""
    meta = obj["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
            "namespace": meta["namespace"],
        },
        "involvedObject": {
            "apiVersion": obj["apiVersion"],
            "kind": obj["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": EVENT_SOURCE},
        "reportingComponent": EVENT_SOURCE,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """``/api/v1/namespaces/ns/configmaps[/name]`` or ``/apis/group/version/...``."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{root}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


@dataclass
class KubeClient:
    info: kopf.ConnectionInfo
    timeout_s: float = 10.0
    _session: aiohttp.ClientSession | None = None

    def _ssl(self) -> ssl.SSLContext | bool:
        if self.info.insecure:
            return False
        ctx = ssl.create_default_context(
            cafile=self.info.ca_path,
            cadata=self.info.ca_data.decode() if self.info.ca_data else None,
        )
        if self.info.certificate_path and self.info.private_key_path:
            ctx.load_cert_chain(self.info.certificate_path, self.info.private_key_path)
        return ctx

    def _headers(self) -> dict[str, str]:
        if self.info.token:
            return {"Authorization": f"{self.info.scheme or 'Bearer'} {self.info.token}"}
        return {}

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                base_url=self.info.server,
                headers=self._headers(),
                connector=aiohttp.TCPConnector(ssl=self._ssl()),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        session = await self.session()
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs = {"json": body, "headers": {"Content-Type": content_type}}
        async with session.request(method, path, **kwargs) as resp:
            data = await resp.json(content_type=None) if resp.content_length != 0 else None
            return resp.status, data

    async def _send(
        self, method: str, path: str, body: Any = None, *, tolerate: int = 0, **kw: Any
    ) -> tuple[bool, Any]:
        """(True, response) on success, (False, None) on the ``tolerate`` status code."""
        status, data = await self.request(method, path, body, **kw)
        if status == tolerate:
            return False, None
        if status >= 400:
            message = data.get("message", "") if isinstance(data, dict) else str(data)
            raise ApiError(status, f"{method} {path}: {message}")
        return True, data

    async def served(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves ``group/version/plural`` (i.e. its CRD exists)."""
        status, data = await self.request("GET", f"/apis/{group}/{version}")
        if status != 200 or not isinstance(data, dict):
            return False
        return any(r.get("name") == plural for r in data.get("resources", []))

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or ``None`` when absent (404)."""
        return (await self._send("GET", path, tolerate=404))[1]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create ``obj``; ``None`` when it already exists (409)."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return (await self._send("POST", path, obj, tolerate=409))[1]

    async def post_event(self, event: dict[str, Any]) -> None:
        """Create an Event; a failure is logged, never raised (events are best effort)."""
        try:
            await self.create(event)
        except (ApiError, aiohttp.ClientError, TimeoutError) as err:
            log.warning("event %s not posted: %s", event.get("reason"), err)

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return (await self._send("PATCH", path, patch, content_type=MERGE_PATCH))[1]

    async def delete(self, path: str) -> bool:
        """Delete (foreground); ``False`` when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Foreground"}
        return (await self._send("DELETE", path, body, tolerate=404))[0]

    async def patch_status(
        self, path: str, patch: dict[str, Any], resource_version: str
    ) -> tuple[bool, dict[str, Any] | None]:
        """Merge-patch ``.status``, only if the object is still at ``resource_version``.

        Returns ``(True, object)``, or ``(False, None)`` on a 409 conflict.
        """
        guarded = {"metadata": {"resourceVersion": resource_version}, "status": patch}
        return await self._send(
            "PATCH", f"{path}/status", guarded, tolerate=409, content_type=MERGE_PATCH
        )
