"""A client that stops reading its stream (issue 31): the other streams go on, and once
``spec.gateway.maxStreamBacklog`` deltas wait for it, its stream is cut off with an
error, its request aborted and its KV freed.

The stalled client is a raw socket with a small receive buffer that sends its request
and then reads nothing; its chunks are big (two choices, 20 top log-probs each), so the
kernel buffers and the gateway's transport fill and the rest waits in the gateway.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from specd.devtools.testing import stalled_stream
from specd.devtools.tiny_checkpoint import make_tiny_checkpoint
from specd.workers.config import spec_for_model

MODEL = "tiny"
CONTEXT = 4096
BACKLOG = 32
STALLED_TOKENS = 3000  # far more chunks than the socket buffers hold
# two choices with 20 top log-probs per token: ~3 KB per token, so the stream outgrows
# the socket buffers (loopback's send buffer grows to MBs) within a few hundred tokens
STALLED_BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "a stalled reader"}],
    "max_tokens": STALLED_TOKENS,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 20,
    "n": 2,
    "stream": True,
}
OTHER_STREAMS = 3
OTHER_TOKENS = 48


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, namespace="specd-slow", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def gateway(serve_gateway, tmp_path_factory):
    folder = make_tiny_checkpoint(
        tmp_path_factory.mktemp("slow-tiny"), max_position_embeddings=CONTEXT
    )
    spec = spec_for_model(
        str(folder),
        replicas=1,
        model={"name": MODEL},
        resources={"cpu": 0.5},
        gateway={"maxStreamBacklog": BACKLOG},
    )
    return serve_gateway(spec, "slow")


def _metrics(url: str) -> dict[str, float]:
    """Unlabelled samples and ``name{reason}`` of the gateway's /metrics, summed."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            key = sample.name
            if "reason" in sample.labels:
                key += "{" + sample.labels["reason"] + "}"
            values[key] = values.get(key, 0.0) + sample.value
    return values


def _stream_tokens(url: str, results: list[int]) -> None:
    body = {
        "model": MODEL,
        "prompt": "a reader that keeps up",
        "max_tokens": OTHER_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                tokens = usage["completion_tokens"]
    results.append(tokens)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_stalled_reader_is_cut_off_and_its_kv_freed(gateway):
    url = gateway.url
    before = _metrics(url)
    stalled = stalled_stream(url, "/v1/chat/completions", STALLED_BODY)
    try:
        # while it stalls, other streams are served whole
        results: list[int] = []
        readers = [
            threading.Thread(target=_stream_tokens, args=(url, results))
            for _ in range(OTHER_STREAMS)
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=120)
        assert results == [OTHER_TOKENS] * OTHER_STREAMS

        def cut_off() -> bool:
            now = _metrics(url)
            return now["specd_gateway_streams_cut_off_total"] > before.get(
                "specd_gateway_streams_cut_off_total", 0
            )

        _wait_for(cut_off, 120, "the stalled stream was never cut off")

        def freed() -> bool:
            now = _metrics(url)
            return now["specd_kv_tokens_used"] == 0 and now["specd_requests_running"] == 0

        _wait_for(freed, 30, "the stalled request still holds KV")
        after = _metrics(url)
        assert after["specd_aborts_total"] > before.get("specd_aborts_total", 0)
        # the stalled client, reading at last, finds its stream ended with the reason
        stalled.settimeout(30)
        received = b""
        while b"data: [DONE]" not in received:
            data = stalled.recv(65536)
            if not data:
                break
            received += data
        assert b"the stream was cut off: its client stopped reading" in received
        assert b'"finish_reason":"length"' not in received  # it did not run to the end
    finally:
        stalled.close()


def test_the_replica_serves_on(gateway):
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": "still here", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
