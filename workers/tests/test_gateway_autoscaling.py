"""Autoscaling on a real pool (local Ray, HTTP): load starts a second replica, a lull
retires it, and the sessions it held move to the replica that stays, KV and all."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from specd.workers.config import spec_for_model
from specd.workers.testing import in_loop
from specd.workers.tools.tiny_checkpoint import make_tiny_checkpoint

pytestmark = pytest.mark.slow

MODEL = "tiny"
CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-test-autoscale")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def gateway(serve_gateway, tmp_path_factory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("autoscale-tiny"))
    spec = spec_for_model(
        str(model),
        replicas=1,
        model={"name": MODEL},
        resources={"cpu": 0.5},
        sessions={"enabled": True},
        autoscaling={
            "maxReplicas": 2,
            "targetOngoingRequests": 1,
            "lookBackSeconds": 0.5,
            "upscaleDelaySeconds": 0.5,
            "downscaleDelaySeconds": 2,
        },
        debug={"strictMemCheck": 1},
    )
    return serve_gateway(spec, "autoscale")


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
    return [e for e in in_loop(gateway, lambda: list(gateway.pool.events)) if e["event"] == kind]


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
        assert up["detail"].startswith("1 -> 2 replicas")
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
        assert down["detail"].startswith("2 -> 1 replicas")
        assert events(gateway, "sessions moved")
        assert pool.session_homes.outcomes["kv"] == 1

        for sid in sessions:  # both continue on the replica that stayed, history reused
            r = await client.post(CMPL, json=body([15], session_id=sid))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == history[sid]
            assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 200
