"""Shared fixtures: tiny checkpoints built offline, and engines over them."""

from __future__ import annotations

import pytest

from specd.workers.tools.tiny_checkpoint import make_tiny_checkpoint
from specd.workers.tools.tiny_draft import make_tiny_eagle, make_tiny_eagle3


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """variant -> checkpoint folder, built once per session."""
    cache: dict[str, str] = {}

    def get(variant: str = "gqa") -> str:
        if variant not in cache:
            cache[variant] = str(
                make_tiny_checkpoint(tmp_path_factory.mktemp(variant), variant=variant)
            )
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def serve_gateway(ray_cluster):
    """Start gateways (uvicorn in a thread, free loopback port) on the module's Ray
    cluster; ``serve_gateway(spec, name)`` returns one whose replicas are all ready.
    Each is stopped at the module's end, before the cluster."""
    import asyncio
    import threading
    import time

    from specd.workers.gateway import Gateway

    running = []

    def start(spec, name: str, ready_timeout_s: float = 90):
        gw = Gateway(
            spec,
            name=name,
            port=0,
            drain_timeout_s=5,
            pool_options={"health_interval_s": 0.3, "probe_timeout_s": 5},
        )
        thread = threading.Thread(
            target=lambda: asyncio.run(gw.run(handle_signals=False)), daemon=True
        )
        thread.start()
        running.append((gw, thread))
        assert gw.listening.wait(60), "gateway did not start listening"
        deadline = time.monotonic() + ready_timeout_s
        while not gw.pool.converged():
            assert time.monotonic() < deadline, f"{name}: replicas not ready"
            time.sleep(0.1)
        return gw

    yield start
    for gw, thread in running:
        gw.stop()
        thread.join(timeout=60)
        assert not thread.is_alive(), "a gateway did not stop"


@pytest.fixture(scope="session")
def pair(tiny_models, tmp_path_factory):
    """(target folder, EAGLE draft folder, EAGLE-3 draft folder): random weights, so the
    drafts' acceptance is near zero."""
    target = tiny_models("gqa")
    eagle = make_tiny_eagle(tmp_path_factory.mktemp("eagle"), target)
    eagle3 = make_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target)
    return target, str(eagle), str(eagle3)
