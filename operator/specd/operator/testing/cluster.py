"""A fake cluster for tests: the fake API server (kmock) and a fake gateway on a
background loop.  Nothing blocks the loop that serves the fakes: tests talk to them
through `Cluster.call` (thread-safe).  Needs the ``test`` extra (kmock, cel-python)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml
from kopf.testing import KopfRunner

from specd.operator.crd import build_crd
from specd.operator.handlers import build_registry, operator_settings
from specd.operator.reconcile import OperatorContext
from specd.operator.testing.fake_kube import FakeKube
from specd.workers.contracts import AdminStatus

NAMESPACE = "default"
REPO = Path(__file__).resolve().parents[4]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def kopf_in_thread(ctx: OperatorContext, namespace: str = NAMESPACE) -> Iterator[None]:
    """The operator's registry run by kopf in `KopfRunner`'s thread (standalone, one
    namespace); on exit, asserts kopf stopped cleanly."""
    args = ["run", "--standalone", "--verbose", "--namespace", namespace]
    with KopfRunner(
        args, registry=build_registry(ctx), settings=operator_settings(), timeout=20
    ) as runner:
        yield
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None


class FakeGateway:
    """Serves ``/{namespace}/{name}/admin/status`` from documents the test sets (an
    `AdminStatus`, or a raw JSON mapping to play a gateway that breaks the contract),
    and ``POST .../admin/release`` (JSON only; records the call and its Authorization,
    empties the document's actors)."""

    def __init__(self) -> None:
        self.docs: dict[tuple[str, str], AdminStatus | dict[str, Any]] = {}
        self.polls: dict[tuple[str, str], int] = {}
        self.releases: list[tuple[tuple[str, str], str]] = []  # (key, Authorization)
        self.app = aiohttp.web.Application()
        self.app.router.add_get("/{namespace}/{name}/admin/status", self._status)
        self.app.router.add_post("/{namespace}/{name}/admin/release", self._release)
        self.port = 0

    async def _status(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        key = (request.match_info["namespace"], request.match_info["name"])
        self.polls[key] = self.polls.get(key, 0) + 1
        if key not in self.docs:
            return aiohttp.web.json_response({"error": "not up"}, status=503)
        doc = self.docs[key]
        if isinstance(doc, AdminStatus):
            doc = doc.model_dump(mode="json")
        return aiohttp.web.json_response(doc)

    async def _release(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        key = (request.match_info["namespace"], request.match_info["name"])
        if key not in self.docs:
            return aiohttp.web.json_response({"error": "not up"}, status=503)
        if request.content_type != "application/json":  # as the real gateway (GuardAdmin)
            return aiohttp.web.json_response({"error": "needs JSON"}, status=415)
        self.releases.append((key, request.headers.get("Authorization", "")))
        doc = self.docs[key]
        if isinstance(doc, AdminStatus):
            released = [a.name for a in doc.actors]
            self.docs[key] = doc.model_copy(update={"actors": (), "released": True})
        else:
            released = [a["name"] for a in doc.get("actors", [])]
            self.docs[key] = {**doc, "actors": [], "released": True}
        return aiohttp.web.json_response({"released": released})

    def url(self, namespace: str, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{namespace}/{name}"


class Cluster:
    """The fakes on their own event loop thread."""

    def __init__(
        self, *, kuberay: bool = True, prometheus: bool = True, peering: bool = False
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.kuberay, self.prometheus, self.peering = kuberay, prometheus, peering
        self.gateway = FakeGateway()
        self.kubeconfig_path: Path | None = None
        self.call(self._start())

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], Any]) -> Any:
        async def wrapper() -> Any:
            return fn()

        return self.call(wrapper())

    async def _start(self) -> None:
        self.kube = FakeKube()
        await self.kube.__aenter__()
        self.server = kmock.Server(self.kube)
        await self.server.__aenter__()
        kube = self.kube
        self.sdd = kube.install_crd(build_crd())
        self.configmaps = kube.serve("", "v1", "configmaps", "ConfigMap")
        self.secrets = kube.serve("", "v1", "secrets", "Secret")
        self.services = kube.serve("", "v1", "services", "Service")
        self.events = kube.serve("", "v1", "events", "Event")
        kube.serve("", "v1", "namespaces", "Namespace", namespaced=False)
        self.deployments = kube.serve("apps", "v1", "deployments", "Deployment")
        if self.kuberay:
            self.rayclusters = kube.serve("ray.io", "v1", "rayclusters", "RayCluster")
        if self.prometheus:
            self.servicemonitors = kube.serve(
                "monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor"
            )
        if self.peering:  # kopf's peering CRD, as the chart installs it
            self.kopfpeerings = kube.serve("kopf.dev", "v1", "kopfpeerings", "KopfPeering")
        runner = aiohttp.web.AppRunner(self.gateway.app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.gateway.port = site._server.sockets[0].getsockname()[1]
        self._gateway_runner = runner

    async def _stop(self) -> None:
        await self._gateway_runner.cleanup()
        await self.server.__aexit__(None, None, None)
        await self.kube.__aexit__(None, None, None)

    def close(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    # -- object access (on the fakes' loop) -----------------------------------
    def get(self, res: Any, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        return self.run(lambda: self.kube.get(res, namespace, name))

    def live(self, res: Any) -> list[dict[str, Any]]:
        """Copies of every not-deleted object of ``res``, in every namespace."""
        return self.run(
            lambda: [
                copy.deepcopy(obj.raw)
                for (kind, _, _), obj in list(self.kube.objects.items())
                if kind == res and not obj.deleted
            ]
        )

    def wait_for(
        self, predicate: Callable[[], Any], timeout: float = 15, what: str = "condition"
    ) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": NAMESPACE},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config))
        self.kubeconfig_path = path
        return path

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        """Run the real kubectl against the fake (after `kubeconfig`); its stdout."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig_path)}
        out = subprocess.run(
            ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=60, env=env
        )
        assert out.returncode == 0, out.stderr
        return out.stdout


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / name).read_text())
