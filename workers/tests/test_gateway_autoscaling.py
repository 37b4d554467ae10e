"""Autoscaling on a real pool (local Ray, HTTP): load starts a second replica, a lull
retires it, and the sessions it held move to the replica that stays, KV and all."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from specd.devtools.testing import in_loop
from specd.devtools.tiny_checkpoint import make_tiny_checkpoint
from specd.workers.config import spec_for_model

pytestmark = pytest.mark.slow

MODEL = "tiny"
CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-test-autoscale")
    yield
    ray.shutdown()


def autoscaled(serve_gateway, tmp_path_factory, name: str, **autoscaling):
    """A gateway over one replica of a tiny model (sessions on, strict leak checks), with
    ``autoscaling`` over short look-back and delays."""
    model = make_tiny_checkpoint(tmp_path_factory.mktemp(f"{name}-tiny"))
    spec = spec_for_model(
        str(model),
        replicas=1,
        model={"name": MODEL},
        resources={"cpu": 0.5},
        sessions={"enabled": True},
        autoscaling={"maxReplicas": 2, "lookBackSeconds": 0.5, "upscaleDelaySeconds": 0.5,
                     **autoscaling},
        debug={"strictMemCheck": 1},
    )  # fmt: skip
    return serve_gateway(spec, name)


@pytest.fixture(scope="module")
def gateway(serve_gateway, tmp_path_factory):
    return autoscaled(
        serve_gateway,
        tmp_path_factory,
        "autoscale",
        targetOngoingRequests=1,
        downscaleDelaySeconds=2,
    )


def body(prompt: list[int], **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def keep_busy(client: httpx.AsyncClient, until) -> None:
    """One client sending request after request until ``until()``."""
    while not until():
        r = await client.post(CMPL, json=body([5, 6, 7, 8], max_tokens=48))
        assert r.status_code == 200, r.text


def events(gateway, kind: str) -> list[dict]:
    return [e for e in in_loop(gateway, lambda: list(gateway.pool.events)) if e.event == kind]


async def test_load_scales_up_and_a_lull_scales_down_keeping_sessions(gateway):
    pool = gateway.pool
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
        assert len(pool.ready()) == 1

        def two_ready() -> bool:
            return len(pool.ready()) == 2 or time.monotonic() > deadline

        deadline = time.monotonic() + 90
        await asyncio.gather(*(keep_busy(client, two_ready) for _ in range(3)))
        assert len(pool.ready()) == 2, pool.status()
        [up] = events(gateway, "autoscaled")
        assert up.detail.startswith("1 -> 2 replicas")
        status = (await client.get("/admin/status")).json()
        assert status["desired_replicas"] == 2
        assert status["autoscaling"]["max_replicas"] == 2
        metrics = (await client.get("/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(metrics)}
        assert families["specd_gateway_desired_replicas"].samples[0].value == 2

        # one session on each replica (new sessions go where the fewest are), a turn
        # each, while two clients keep both replicas wanted
        settled = False
        busy = [asyncio.create_task(keep_busy(client, lambda: settled)) for _ in range(2)]
        sessions, history = [], {}
        for prompt in ([9, 10, 11], [12, 13, 14]):
            sid = (await client.post("/v1/sessions")).json()["id"]
            r = await client.post(CMPL, json=body(prompt, session_id=sid))
            assert r.status_code == 200, r.text
            sessions.append(sid)
            history[sid] = r.json()["usage"]["total_tokens"]
        settled = True
        await asyncio.gather(*busy)
        assert len({sid.split(".")[0] for sid in sessions}) == 2
        assert len(events(gateway, "autoscaled")) == 1  # still two replicas

        # the lull: no request for the downscale delay -> back to one replica
        deadline = time.monotonic() + 60
        while not (len(pool.ready()) == 1 and pool.converged()):
            assert time.monotonic() < deadline, pool.status()
            await asyncio.sleep(0.2)
        down = events(gateway, "autoscaled")[-1]
        assert down.detail.startswith("2 -> 1 replicas")
        assert events(gateway, "sessions moved")
        assert pool.session_directory.outcomes["kv"] == 1

        for sid in sessions:  # both continue on the replica that stayed, history reused
            r = await client.post(CMPL, json=body([15], session_id=sid))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == history[sid]
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200


@pytest.fixture(scope="module")
def zero_gateway(serve_gateway, tmp_path_factory):
    return autoscaled(
        serve_gateway,
        tmp_path_factory,
        "zero",
        minReplicas=0,
        targetOngoingRequests=4,
        downscaleDelaySeconds=1.5,
    )


async def scaled_to_zero(pool, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while not (pool.desired_replicas == 0 and pool.converged() and not pool.status().actors):
        assert time.monotonic() < deadline, pool.status()
        await asyncio.sleep(0.1)


async def test_an_idle_pool_scales_to_zero_and_requests_wake_it(zero_gateway):
    """minReplicas 0: idle, the pool retires its last replica (/health still ok); the
    requests that arrive then wait while one starts and are all served; an open
    session keeps a replica; a cold start that takes too long answers 503 naming
    coldStartTimeoutSeconds."""
    gateway, pool = zero_gateway, zero_gateway.pool
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
        await scaled_to_zero(pool)
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "scaled_to_zero"
        metrics = (await client.get("/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(metrics)}
        assert families["specd_gateway_desired_replicas"].samples[0].value == 0

        cold = await asyncio.gather(
            *(client.post(CMPL, json=body([5, 6, 7 + i])) for i in range(3)),
            client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "temperature": 0,
            }),
        )  # fmt: skip
        assert [r.status_code for r in cold] == [200] * 4, [r.text for r in cold]
        woke = [e for e in events(gateway, "autoscaled") if e.detail.startswith("0 -> ")]
        assert len(woke) == 1, events(gateway, "autoscaled")
        assert pool.held_requests == 0

        sid = (await client.post("/v1/sessions")).json()["id"]
        await asyncio.sleep(3)  # twice the downscale delay: the session keeps its replica
        assert len(pool.ready()) == 1
        r = await client.post(CMPL, json=body([8, 9], session_id=sid))
        assert r.status_code == 200, r.text
        assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200
        await scaled_to_zero(pool)

        impatient = pool.spec.autoscaling.model_copy(update={"cold_start_timeout_seconds": 0.01})
        in_loop(gateway, pool.update_spec, pool.spec.model_copy(update={"autoscaling": impatient}))
        r = await client.post(CMPL, json=body([5]))
        assert r.status_code == 503, r.text
        assert "spec.autoscaling.coldStartTimeoutSeconds" in r.json()["error"]["message"]
