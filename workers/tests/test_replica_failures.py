"""Replicas that cannot load or that die: reported, counted, not restarted forever.

`specd serve` and `specd validate` on a checkpoint whose config.json names an
unsupported architecture (the shipped demo target, renamed), then pools and gateways
on one local Ray for the module: a model that fails to load twice alike is not started
again until the spec changes (and a `specd serve` gateway stops); an engine loop that
dies turns /health 503 at once; deaths are counted by reason and a dead replica's
leak-check failures stay exported.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from specd.devtools.testing import DEMO_EAGLE, DEMO_MODELS, DEMO_TARGET, source_roots
from specd.workers.cli import EXIT_INVALID, main
from specd.workers.config import spec_for_model
from specd.workers.gateway.app import build_app
from specd.workers.model.tokenizer import load_tokenizer
from specd.workers.pool.actor import MAX_CONCURRENCY, EngineActor
from specd.workers.pool.controller import PoolController
from specd.workers.pool.replica import DeathReason

EXAMPLES = DEMO_MODELS.parent
UNSUPPORTED = "architecture FooForCausalLM is not supported"


@pytest.fixture(scope="module")
def foo_model(tmp_path_factory) -> str:
    """The demo target whose config.json names an architecture this engine lacks (its
    weights linked, not copied)."""
    folder = tmp_path_factory.mktemp("foo-model")
    for file in Path(DEMO_TARGET).iterdir():
        if file.suffix == ".safetensors":
            (folder / file.name).symlink_to(file)
        else:
            shutil.copy(file, folder / file.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    return str(folder)


def spec_file(tmp_path: Path, model: str, draft: str | None = None, name: str = "spec") -> Path:
    path = tmp_path / f"{name}.yaml"
    spec = {"model": {"path": model}, "replicas": 1, "resources": {"cpu": 0.5}}
    if draft is not None:
        spec |= {"draft": {"path": draft}, "speculative": {"numSteps": 2, "numDraftTokens": 3}}
    doc = {"apiVersion": "specd.dev/v1alpha1", "kind": "SpecDecodeDeployment"}
    path.write_text(json.dumps({**doc, "metadata": {"name": "bad"}, "spec": spec}))
    return path


# -- `specd serve` and `specd validate` (no Ray) ------------------------------------------


def test_serve_exits_2_naming_an_unsupported_architecture(foo_model, tmp_path):
    """On a local Ray, `specd serve` checks the folders first (as `specd validate`
    does): exit 2 with the message, no actor started, no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = source_roots()
    cmd = [sys.executable, "-m", "specd.workers.cli", "serve", str(spec_file(tmp_path, foo_model))]
    started = time.monotonic()
    run = subprocess.run(
        [*cmd, "--port", "0"], env=env, capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - started
    print(f"specd serve exited {run.returncode} after {took:.1f}s")
    out = run.stdout + run.stderr
    assert run.returncode == EXIT_INVALID, out
    assert f"specd: spec.model.path: config.json: {UNSUPPORTED}" in run.stderr, out
    assert "starting actor" not in out and "Traceback" not in out, out
    assert took < 30, out


def test_validate_checks_the_model_folders_would_load(foo_model, tiny_models, tmp_path, capsys):
    """Without loading a weight: an unsupported architecture, a missing folder, a draft
    that does not fit its target; each exits 2 naming the spec field."""
    cases = {
        "unsupported": (foo_model, None, f"spec.model.path: config.json: {UNSUPPORTED}"),
        "missing": (str(tmp_path / "nope"), None, "spec.model.path: model folder"),
        "draft": (tiny_models("gqa"), DEMO_EAGLE, "spec.draft.path: draft hidden size"),
    }
    for name, (model, draft, message) in cases.items():
        path = spec_file(tmp_path, model, draft, name)
        assert main(["validate", str(path)]) == EXIT_INVALID, name
        assert message in capsys.readouterr().err, name
        assert main(["validate", "--schema-only", str(path)]) == 0, name
        assert "model folders not checked" in capsys.readouterr().out


def test_the_examples_validate(capsys):
    """The demo pair ships: checked in full; the others name folders of a cluster."""
    assert main(["validate", str(EXAMPLES / "demo.yaml")]) == 0
    for example in sorted(EXAMPLES.glob("*.yaml")):
        assert main(["validate", "--schema-only", str(example)]) == 0, capsys.readouterr().err


def test_validate_reads_safetensors_headers_only(tmp_path, capsys):
    """A tensor of the wrong shape is found from the header: the message names it."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "reshaped"
    shutil.copytree(DEMO_TARGET, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, folder / "model.safetensors")
    assert main(["validate", str(spec_file(tmp_path, str(folder)))]) == EXIT_INVALID
    assert "spec.model.path: checkpoint" in (err := capsys.readouterr().err)
    assert "tensor model.norm.weight has shape" in err


# -- the module's cluster ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-test", log_to_driver=False)
    yield
    ray.shutdown()


async def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.05)
    return value


@pytest.mark.slow  # two real model loads: CI's slow pass runs it
async def test_a_model_that_fails_to_load_twice_alike_is_not_restarted(
    ray_cluster, foo_model, tiny_models
):
    """Two identical load errors: no third start; /admin/status and /health (503) say
    why; a spec change (new config hash) clears it and starts again."""
    spec = spec_for_model(foo_model, replicas=1, resources={"cpu": 0.5})
    pool = PoolController(spec, name="foo", health_interval_s=0.2)
    app = build_app(pool, load_tokenizer(foo_model))
    await pool.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://gw"
        ) as http:
            failure = await _wait(pool.current_failure, 90, "the pool to give up")
            assert UNSUPPORTED in failure.message
            await asyncio.sleep(5)  # longer than the backoff after two failures (4 s)
            starts = [e for e in pool.events if e.event == "starting"]
            assert len(starts) == 2, list(pool.events)
            status = (await http.get("/admin/status")).json()
            assert UNSUPPORTED in status["failure"]["message"]
            assert status["failure"]["config_hash"] == spec.config_hash()
            assert status["replica_deaths"][DeathReason.LOAD_ERROR.value] == 2
            health = await http.get("/health")
            assert health.status_code == 503 and UNSUPPORTED in health.json()["reason"]

            good = spec_for_model(tiny_models("gqa"), replicas=1, resources={"cpu": 0.5})
            pool.update_spec(good)
            assert pool.current_failure() is None
            assert await pool.wait_converged(90), list(pool.events)
            status = (await http.get("/admin/status")).json()
            assert status["failure"] is None and status["ready_replicas"] == 1
            assert (await http.get("/health")).status_code == 200
    finally:
        await pool.stop(drain_timeout_s=1)


@pytest.mark.slow  # two real model loads: CI's slow pass runs it
def test_a_serve_gateway_stops_with_the_failure(ray_cluster, foo_model):
    """What `specd serve` does when a load error gets past its check of the folders:
    after the second identical failure its gateway stops by itself, saying why (the
    CLI then exits 2 with ``failure``)."""
    from specd.workers.gateway.app import Gateway

    spec = spec_for_model(foo_model, replicas=1, resources={"cpu": 0.5})
    gw = Gateway(spec, name="foo-serve", port=0, stop_on_failure=True)
    started = time.monotonic()

    async def run_within_two_minutes() -> None:
        async with asyncio.timeout(120):
            await gw.run(handle_signals=False)

    asyncio.run(run_within_two_minutes())
    print(f"the gateway stopped {time.monotonic() - started:.1f}s after it started")
    assert gw.failure is not None and UNSUPPORTED in gw.failure.message
    assert [e.event for e in gw.pool.events].count("starting") == 2, list(gw.pool.events)


# -- a gateway whose engines' loops die (seed 004's bonus pre-claim reverted) --------------


def _reverting(toggle: str):
    """An actor factory like `create_engine_actor` whose actors run with the fault
    toggle ``toggle`` (`debug_toggles`) in their environment."""

    def create(spec, *, replica: str, actor_name: str):
        return (
            ray.remote(EngineActor)
            .options(
                name=actor_name,
                lifetime="detached",
                num_cpus=spec.resources.cpu,
                max_restarts=0,
                max_concurrency=MAX_CONCURRENCY,
                runtime_env={"env_vars": {"SPECD_DEBUG_REVERT": toggle}},
            )
            .remote(spec, replica)
        )

    return create


@pytest.fixture(scope="module")
def failing_gateway(ray_cluster, pair):
    """One replica of the tiny speculative pair under overlap with strict leak checks
    and no bonus pre-claim: its first speculative request fails a leak check, which
    stops its engine loop.  Health probes every 30 s: what turns /health 503 is not a
    probe."""
    from specd.workers.gateway.app import Gateway

    target, eagle, _ = pair
    spec = spec_for_model(
        target,
        replicas=1,
        model={"name": "tiny"},
        resources={"cpu": 0.5},
        kvCache={"pageSize": 1, "maxTokens": 4096},
        scheduler={"overlap": True},
        draft={"path": eagle},
        speculative={"numSteps": 3, "topk": 1, "numDraftTokens": 4},
        debug={"strictMemCheck": 1},
    )
    gw = Gateway(
        spec,
        name="dying",
        port=0,
        drain_timeout_s=5,
        pool_options={
            "health_interval_s": 30,
            "probe_timeout_s": 5,
            "actor_factory": _reverting("bonus-preclaim"),
        },
    )
    thread = threading.Thread(target=lambda: asyncio.run(gw.run(handle_signals=False)), daemon=True)
    thread.start()
    try:
        assert gw.listening.wait(60), "gateway did not start listening"
        deadline = time.monotonic() + 90
        while not gw.pool.converged():
            assert time.monotonic() < deadline, "replica not ready"
            time.sleep(0.1)
        yield gw
    finally:
        gw.stop()
        thread.join(timeout=60)


def _counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _wait_sync(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.01)
    return value


@pytest.mark.slow
@pytest.mark.serial  # times /health turning 503 within a second
def test_health_is_503_once_an_engine_loop_dies_and_its_leak_failures_stay(failing_gateway):
    url, pool = failing_gateway.url, failing_gateway.pool
    deaths_before = _counter(url, "specd_replica_deaths_total", reason="engine_error")
    [victim] = pool.ready()
    assert httpx.get(f"{url}/health").status_code == 200
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 20, "ignore_eos": True}
    answer = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=60)
    failed_at = time.monotonic()
    assert answer.status_code >= 500, answer.text
    _wait_sync(lambda: httpx.get(f"{url}/health").status_code == 503, 2, "/health 503")
    print(f"/health 503 {time.monotonic() - failed_at:.3f}s after the failed request")
    assert time.monotonic() - failed_at < 1.0  # the probes run every 30 s
    assert victim.error.startswith("engine unhealthy: AssertionError: KV leak check")

    _wait_sync(lambda: pool.converged() and pool.ready()[0] is not victim, 90, "a replacement")
    assert _counter(url, "specd_replica_deaths_total", reason="engine_error") == deaths_before + 1
    assert _counter(url, "specd_leak_checks_total", replica=victim.name) == 0  # gone with it
    assert _counter(url, "specd_retired_leak_check_failures_total") >= 1


@pytest.mark.slow
def test_a_killed_actor_is_counted(failing_gateway):
    url, pool = failing_gateway.url, failing_gateway.pool
    killed_before = _counter(url, "specd_replica_deaths_total", reason="killed")
    _wait_sync(pool.converged, 90, "a ready replica")
    [victim] = pool.ready()
    ray.kill(ray.get_actor(victim.actor_name, namespace="specd-test"))
    _wait_sync(lambda: victim.state.value == "dead", 2, "the kill noticed")  # not a probe
    _wait_sync(lambda: pool.converged() and pool.ready()[0] is not victim, 90, "a replacement")
    assert _counter(url, "specd_replica_deaths_total", reason="killed") == killed_before + 1
