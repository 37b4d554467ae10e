"""`specd.operator.rbac` against what the operator really sends: kopf and the operator
run through a recording proxy in front of the fake API server, and every request they
make must be allowed by the table (the Helm chart's RBAC is tested against the table)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import aiohttp.web
import pytest
import yaml

from specd.operator import rbac
from specd.workers.config import SpecDecodeDeployment

from .conftest import NAMESPACE, Cluster, load_example
from .gateway_docs import gateway_doc
from .test_operator import SDD_PATH, create, http, operator, sdd

RESOURCE_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)"
    r"(?:/namespaces/[^/]+)?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
DISCOVERY = re.compile(r"^/(api|apis)(/[^/]+){0,2}$")


def permission(method: str, path: str, watch: bool) -> tuple[str, str, str] | None:
    """The (group, resource, verb) RBAC checks for one request; None for discovery."""
    if DISCOVERY.match(path) and not path.startswith("/api/v1/"):
        return None
    m = RESOURCE_PATH.match(path)
    assert m, f"unexpected API path {path}"
    resource = m["resource"] + (f"/{m['sub']}" if m["sub"] else "")
    named = m["name"] is not None
    verb = {
        "GET": "get" if named else ("watch" if watch else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if named else "deletecollection",
    }[method]
    return (m["group"] or "", resource, verb)


class RecordingProxy:
    """Forwards every request to the fake API server (streaming watches) and records it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: set[tuple[str, str, str]] = set()
        self.sessions: set[aiohttp.ClientSession] = set()
        self.app = aiohttp.web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self._forward)

    async def _forward(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        watch = request.query.get("watch") in ("true", "1")
        if (perm := permission(request.method, request.path, watch)) is not None:
            self.seen.add(perm)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self.sessions.add(session)
        async with (
            session,
            session.request(
                request.method,
                self.upstream + request.rel_url.path_qs,
                data=await request.read(),
                headers=headers,
            ) as upstream,
        ):
            response = aiohttp.web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            with contextlib.suppress(aiohttp.ClientError):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
        self.sessions.discard(session)
        return response

    async def close(self) -> None:
        """Cut the open watch streams (the fake server waits for them at shutdown)."""
        for session in list(self.sessions):
            await session.close()


@contextlib.contextmanager
def proxied(cluster: Cluster, kubeconfig: Path, mp: pytest.MonkeyPatch) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(cluster.url)
    runner = aiohttp.web.AppRunner(proxy.app, shutdown_timeout=0.5)

    async def start() -> str:
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    config = yaml.safe_load(cluster.kubeconfig(kubeconfig).read_text())
    config["clusters"][0]["cluster"]["server"] = cluster.call(start())
    kubeconfig.write_text(yaml.safe_dump(config))
    mp.setenv("KUBECONFIG", str(kubeconfig))
    try:
        yield proxy
    finally:
        cluster.call(proxy.close())
        cluster.call(runner.cleanup())


def test_every_request_is_in_the_rbac_table(cluster, tmp_path, monkeypatch):
    kubeconfig = tmp_path / "proxied-kubeconfig"
    with proxied(cluster, kubeconfig, monkeypatch) as proxy, operator(cluster):
        doc = load_example("gpu-eagle3-tree.yaml")
        name = doc["metadata"]["name"]
        create(cluster, doc)
        cluster.wait_for(lambda: (sdd(cluster, name) or {}).get("status"), what="status")
        external = load_example("external-ray.yaml")
        create(cluster, external)
        cluster.wait_for(lambda: cluster.get(cluster.deployments, "shared-ray-gateway"))
        spec = SpecDecodeDeployment.model_validate(external).spec
        cluster.gateway.docs[(NAMESPACE, "shared-ray")] = gateway_doc(spec, [])
        http(cluster, "DELETE", f"{SDD_PATH}/shared-ray")
        # the delete handler has the gateway release, then removes it (the SDD's own
        # removal is not awaited)
        cluster.wait_for(lambda: not cluster.get(cluster.deployments, "shared-ray-gateway"))
    grant = rbac.grant(all_namespaces=False, peering=False, observe=True)
    allowed = rbac.triples(grant.per_namespace + grant.cluster)
    assert proxy.seen - allowed == set(), "requests the chart's RBAC would refuse"
    # the run exercised the table's main rows (a stale table would show here)
    assert {
        ("specd.dev", "specdecodedeployments", "watch"),
        ("specd.dev", "specdecodedeployments", "patch"),
        ("specd.dev", "specdecodedeployments/status", "patch"),
        ("", "events", "create"),
        ("", "namespaces", "watch"),
        ("", "configmaps", "create"),
        ("", "secrets", "create"),
        ("", "secrets", "get"),
        ("apps", "deployments", "delete"),
        ("ray.io", "rayclusters", "create"),
        ("monitoring.coreos.com", "servicemonitors", "create"),
    } <= proxy.seen
