"""The whole path: a CR in, an OpenAI answer out, metrics scraped, status written back.

Real parts: kopf (the operator's handlers and status poller), the gateway process the
operator's Deployment describes (`specd gateway --config <mounted ConfigMap>`), Ray (a
local cluster, the SDD's ``spec.ray.address``), the engine actors with the shipped demo
pair, the official ``openai`` client and ``kubectl``.  Stand-ins: the API server (the
kmock fake of `specd.operator.testing`) and the two controllers it lacks, played by
`Kubelet` (runs the gateway container's command with its env, refreshes the mounted
ConfigMap and admin token Secret, restarts the pod on request, stops the process when
its Deployment goes or its owner SDD is gone) — the same things kubelet, the Deployment
controller and the garbage collector do.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specd.operator import naming
from specd.operator.children import ChildOptions
from specd.operator.reconcile import OperatorContext
from specd.operator.testing.cluster import NAMESPACE, REPO, Cluster, free_port, kopf_in_thread
from specd.workers.config import SpecDecodeDeployment, ray_namespace

pytestmark = pytest.mark.slow

NAME = "demo"
# the gateway pod's credentials come from its own env (volumes), never this process's
POD_ONLY_ENV = {
    "SPECD_ADMIN_TOKEN",
    "SPECD_ADMIN_TOKEN_FILE",
    "SPECD_API_KEY",
    "SPECD_API_KEY_FILE",
}
MODELS = REPO / "examples" / "models"


def _source_roots() -> str:
    roots = [str(REPO / d) for d in ("workers", "kernels", "operator")]
    return os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])


class Kubelet:
    """Runs each gateway Deployment's container as a local process, the way a kubelet
    would run its pod: each volume (the ConfigMap, the admin token Secret) is a directory
    kept in sync with its object, the pod starts once they all exist, and the process
    gets SIGTERM when the Deployment is deleted.

    The container's command joins the Ray cluster (``ray start``) and then execs the
    gateway; this machine is already a node of that cluster, so only the gateway part
    runs, with ``RAY_ADDRESS`` pointing at the local cluster and a free local port.
    """

    def __init__(self, cluster: Cluster, workdir: Path, ray_address: str):
        self.cluster, self.workdir, self.ray_address = cluster, workdir, ray_address
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.logs: dict[str, Path] = {}
        self.exits: dict[str, str] = {}  # how each terminated gateway ended
        self._restarts: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def restart(self, name: str) -> None:
        """Restart the pod of Deployment ``name`` (what a node drain or an image update
        does): SIGTERM, then a new process on a new port."""
        self._restarts.add(name)

    def url(self, namespace: str, name: str) -> str:
        """The gateway URL the operator polls (the Service's cluster DNS name stands in)."""
        return self.urls.get(naming.gateway_name(name), "http://127.0.0.1:9")

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)
        for name in list(self.procs):
            self._terminate(name)

    def _live_deployments(self) -> dict[str, dict[str, Any]]:
        """Deployments whose owner still exists: the garbage collector removes one whose
        owner is gone (a reconcile that was in flight when the SDD was deleted may have
        written it again after the delete handler removed it)."""
        owners = {sdd["metadata"]["uid"] for sdd in self.cluster.live(self.cluster.sdd)}
        return {
            d["metadata"]["name"]: d
            for d in self.cluster.live(self.cluster.deployments)
            if all(ref["uid"] in owners for ref in d["metadata"].get("ownerReferences", []))
        }

    def _loop(self) -> None:
        while not self._stop.is_set():
            live = self._live_deployments()
            for name, deployment in live.items():
                mounted = self._sync_volumes(name, deployment)
                if name not in self.procs and mounted:
                    self._start(name, deployment)
            for name in [n for n in self.procs if n not in live or n in self._restarts]:
                self._restarts.discard(name)
                self._terminate(name)
            time.sleep(0.2)

    def _sync_volumes(self, name: str, deployment: dict[str, Any]) -> bool:
        """Each volume's files under ``workdir/<deployment>/<volume>``; whether every
        volume's object exists (a kubelet starts the pod only then)."""
        mounted = True
        for volume in deployment["spec"]["template"]["spec"]["volumes"]:
            if "configMap" in volume:
                cm = self.cluster.get(self.cluster.configmaps, volume["configMap"]["name"])
                files = None if cm is None else cm.get("data", {})
            else:
                secret = self.cluster.get(self.cluster.secrets, volume["secret"]["secretName"])
                files = None if secret is None else _secret_files(secret, volume["secret"])
            mounted = mounted and files is not None
            directory = self.workdir / name / volume["name"]
            directory.mkdir(parents=True, exist_ok=True)
            for key, value in (files or {}).items():
                path = directory / key
                if not path.exists() or path.read_text() != value:
                    path.write_text(value)
        return mounted

    def _start(self, name: str, deployment: dict[str, Any]) -> None:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        shell, flag, script = container["command"]
        assert (shell, flag) == ("/bin/sh", "-c"), container["command"]
        join, run = script.split(" && ")
        assert join.startswith("ray start --address="), join
        argv = shlex.split(run)
        assert argv[:4] == ["RAY_ADDRESS=auto", "exec", "specd", "gateway"], argv
        args = argv[4:]
        pod_dir = self.workdir / name
        mounts = {m["mountPath"]: pod_dir / m["name"] for m in container["volumeMounts"]}

        def here(path: str) -> str:  # a path in the pod -> its volume's local directory
            for mount, directory in mounts.items():
                if path.startswith(f"{mount}/"):
                    return str(directory) + path[len(mount) :]
            return path

        port = free_port()
        args[args.index("--config") + 1] = here(args[args.index("--config") + 1])
        args[args.index("--host") + 1] = "127.0.0.1"
        args[args.index("--port") + 1] = str(port)
        env = {k: v for k, v in os.environ.items() if k not in POD_ONLY_ENV}
        env.update({e["name"]: here(e["value"]) for e in container.get("env", [])})
        env.update(RAY_ADDRESS=self.ray_address, PYTHONPATH=_source_roots())
        self.logs[name] = self.workdir / f"{name}.log"
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "specd.workers.cli", "gateway", *args],
            env=env,
            stdout=self.logs[name].open("w"),
            stderr=subprocess.STDOUT,
        )
        self.urls[name] = f"http://127.0.0.1:{port}"

    def _terminate(self, name: str) -> None:
        proc = self.procs.pop(name)
        self.urls.pop(name, None)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.exits[name] = f"exit {proc.returncode} after {time.monotonic() - started:.1f} s"

    def log(self, name: str) -> str:
        path = self.logs.get(name)
        return path.read_text()[-4000:] if path and path.exists() else ""


def _secret_files(secret: dict[str, Any], source: dict[str, Any]) -> dict[str, str]:
    """A Secret volume's files: each item's key, decoded, at its path."""
    data = secret.get("data", {})
    return {i["path"]: base64.b64decode(data[i["key"]]).decode() for i in source["items"]}


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-e2e", log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@contextlib.contextmanager
def running_operator(kubelet: Kubelet) -> Iterator[None]:
    ctx = OperatorContext(
        options=ChildOptions(image="specd:e2e"),
        poll_interval_s=0.5,
        gateway_timeout_s=5.0,
        gateway_url=kubelet.url,
    )
    with kopf_in_thread(ctx):
        yield


def _sdd_document(ray_address: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    doc["metadata"] = {"name": NAME, "namespace": NAMESPACE}
    spec = doc["spec"]
    spec["model"]["path"] = str(MODELS / "demo-target")
    spec["draft"]["path"] = str(MODELS / "demo-eagle")
    spec["draft"]["tokenMap"] = str(MODELS / "demo-eagle" / "token_map.json")
    spec["kvCache"]["maxTokens"] = 4096
    spec["resources"]["cpu"] = 1  # replicas and a rolling update's surge fit the 4-CPU Ray
    spec["ray"] = {"address": ray_address}
    spec["speculative"]["minAcceptLength"] = 1.0
    # calibrate batch 1 only: up to four 1-CPU engines share 2 cores during the roll, and
    # batches of 8 and 32 at load cost each new replica tens of seconds there
    policy = spec["speculative"].setdefault("policy", {})
    policy.setdefault("costModel", {})["calibrationBatchSizes"] = [1]
    return doc


def _sdd(cluster: Cluster) -> dict[str, Any]:
    return cluster.get(cluster.sdd, NAME) or {}


def _condition(cluster: Cluster, type_: str) -> dict[str, Any]:
    conditions = (_sdd(cluster).get("status") or {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == type_), {})


def _ready_on(cluster: Cluster, config_hash: str, replicas: int) -> bool:
    status = _sdd(cluster).get("status") or {}
    actors = status.get("actors", [])
    return (
        _condition(cluster, "Ready").get("status") == "True"
        and status.get("configHash") == config_hash
        and status.get("readyReplicas") == replicas
        and len(actors) == replicas
        and all(a["configHash"] == config_hash and a["state"] == "ready" for a in actors)
    )


def _converged(url: str) -> bool:
    try:
        return httpx.get(f"{url}/admin/status", timeout=5).json()["converged"]
    except httpx.HTTPError:
        return False


def _named_actors(prefix: str) -> list[str]:
    """The engine actors' names; they live in the SDD's namespace's Ray namespace."""
    actors = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    ]
    assert {a["namespace"] for a in actors} <= {ray_namespace(NAMESPACE)}, actors
    return [a["name"] for a in actors]


def test_cr_to_openai_answer_to_status_scale_update_delete(tmp_path, ray_address, monkeypatch):
    cluster = Cluster(kuberay=False)
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
    doc = _sdd_document(ray_address)
    spec = SpecDecodeDeployment.model_validate(doc).spec
    gateway = naming.gateway_name(NAME)
    try:
        with Kubelet(cluster, tmp_path, ray_address) as kubelet, running_operator(kubelet):
            # -- a CR in -> children -> gateway -> actors -> Ready from the real gateway
            out = cluster.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
            assert "created" in out
            try:
                cluster.wait_for(
                    lambda: _ready_on(cluster, spec.config_hash(), 1), 180, "Ready, 1 replica"
                )
            except AssertionError:
                raise AssertionError(kubelet.log(gateway)) from None
            url = kubelet.urls[gateway]

            # -- an OpenAI answer out (the official client, unmodified)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            answer = client.completions.create(
                model="demo", prompt="def fibonacci(n):", max_tokens=24, temperature=0
            )
            assert answer.choices[0].text and answer.usage.completion_tokens == 24

            # -- metrics scraped from the gateway; status written back from it
            families = {
                f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
            }
            generated = sum(s.value for s in families["specd_generation_tokens"].samples)
            assert generated >= 24
            cluster.wait_for(
                lambda: (
                    (_sdd(cluster)["status"].get("speculation") or {}).get("acceptLength", 0) > 1.0
                ),
                30,
                "status.speculation.acceptLength from the real engine",
            )
            assert _condition(cluster, "SpeculationEffective")["status"] == "True"
            table = cluster.kubectl("get", "sdd")
            assert table.split()[:9] == [
                "NAME", "READY", "REPLICAS", "DRAFT", "ACCEPT-LEN", "KV-USAGE", "AGE", NAME, "1/1",
            ]  # fmt: skip

            # -- scale through the scale subresource -> the gateway follows the ConfigMap
            assert "scaled" in cluster.kubectl("scale", f"sdd/{NAME}", "--replicas", "2")
            cluster.wait_for(
                lambda: _ready_on(cluster, spec.config_hash(), 2), 180, "Ready, 2 replicas"
            )

            # -- a speculative update rolls the actors under traffic: no failed request
            statuses: list[int] = []
            stop = threading.Event()

            def traffic() -> None:
                with httpx.Client(base_url=url, timeout=120) as http:
                    while not stop.is_set():
                        r = http.post(
                            "/v1/completions",
                            json={"model": "demo", "prompt": "import os", "max_tokens": 16},
                        )
                        statuses.append(r.status_code)

            threads = [threading.Thread(target=traffic) for _ in range(2)]
            for t in threads:
                t.start()
            try:
                patch = {"spec": {"speculative": {"numSteps": 3, "numDraftTokens": 4}}}
                cluster.kubectl("patch", f"sdd/{NAME}", "--type=merge", "-p", json.dumps(patch))
                doc["spec"]["speculative"].update(patch["spec"]["speculative"])
                new_hash = SpecDecodeDeployment.model_validate(doc).spec.config_hash()
                assert new_hash != spec.config_hash()
                cluster.wait_for(
                    lambda: (
                        _condition(cluster, "Progressing").get("reason")
                        in ("ConfigPending", "RollingUpdate")
                    ),
                    30,
                    "Progressing during the roll",
                )
                cluster.wait_for(lambda: _ready_on(cluster, new_hash, 2), 240, "rolled, Ready")
            finally:
                stop.set()
                for t in threads:
                    t.join(120)
            assert statuses and set(statuses) == {200}, statuses
            assert _condition(cluster, "Progressing")["reason"] == "RolloutComplete"

            # -- the gateway pod restarts: the new one adopts the warm actors
            prefix = f"specd-{NAME}-"
            actors = sorted(_named_actors(prefix))
            assert len(actors) == 2
            kubelet.restart(gateway)
            cluster.wait_for(lambda: kubelet.urls.get(gateway, url) != url, 60, "a new pod")
            url = kubelet.urls[gateway]
            try:
                cluster.wait_for(lambda: _converged(url), 120, "the new gateway converged")
            except AssertionError:
                raise AssertionError(kubelet.log(gateway)) from None
            assert sorted(_named_actors(prefix)) == actors  # adopted, not restarted
            assert "exit 0" in kubelet.exits[gateway]
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            again = client.completions.create(
                model="demo", prompt="def fibonacci(n):", max_tokens=24, temperature=0
            )
            assert again.usage.completion_tokens == 24

            # -- delete: the finalizer has the gateway kill its actors, then removes it
            cluster.kubectl("delete", f"sdd/{NAME}", "--wait=false")
            try:
                cluster.wait_for(lambda: not _sdd(cluster), 180, "the SDD gone")
                cluster.wait_for(lambda: not _named_actors(prefix), 30, "the actors gone")
            except AssertionError as err:
                raise AssertionError(f"{err}: {kubelet.exits} {kubelet.log(gateway)}") from None
            cluster.wait_for(lambda: gateway not in kubelet.procs, 60, "the pod gone")
            assert "Released" in {e.get("reason") for e in cluster.live(cluster.events)}
    finally:
        cluster.close()
