"""Property-based fuzzing of the gateway against its own OpenAPI document (issue 28).

schemathesis reads ``/openapi.json`` from a real gateway (real Ray, the demo target) and
generates requests for every operation, valid (positive) and invalid (negative) ones,
with a fixed budget and hypothesis's derandomized seed, sent over real HTTP.  Whatever
it sends: no 5xx, every status is one the document lists for the operation, no replica
restarts or dies, and afterwards no request holds KV and no leak check failed."""

import collections
import time

import httpx
import pytest
import ray
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from specd.devtools.testing import DEMO_TARGET, running_gateway
from specd.workers.config import spec_for_model

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 50  # per operation and generation mode
ADMIN_TOKEN = "fuzz-admin-token"  # the fuzzer never has it: /admin/release must stay shut


@pytest.fixture(scope="module")
def gateway():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    spec = spec_for_model(
        DEMO_TARGET,
        model={"dtype": "float32", "contextLength": 96},  # every request ends quickly
        kvCache={"maxTokens": 2048},
        sessions={"enabled": True},
        debug={"strictMemCheck": 1},
    )
    with running_gateway(spec, "fuzz", admin_token=ADMIN_TOKEN) as gw:
        yield gw
    ray.shutdown()


def _documented(case) -> set[int]:
    return {int(code) for code in case.operation.definition.raw["responses"] if code.isdigit()}


def _served_model(case):
    """The served model's name where a body names one: a random name is a 404 before
    anything else is read, which would leave the rest of the body untested."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "demo-target"
    return case


def test_no_generated_request_gets_a_server_error_or_restarts_a_replica(gateway):
    base = gateway.url
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    statuses: collections.Counter = collections.Counter()
    problems: list[str] = []
    per_operation: collections.Counter = collections.Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    started = time.monotonic()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                derandomize=True,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode).map(_served_model))
            def call(case):
                response = case.call(base_url=base, timeout=60)
                statuses[response.status_code] += 1
                per_operation[case.operation.label] += 1
                if response.status_code >= 500 or response.status_code not in _documented(case):
                    problems.append(
                        f"{case.operation.label} -> {response.status_code} "
                        f"{response.text[:200]!r}; body {str(case.body)[:200]!r}"
                    )

            try:
                call()
            except Unsatisfiable:  # nothing to make invalid (an operation without input)
                assert mode is GenerationMode.NEGATIVE, operation.label
    total = sum(statuses.values())
    print(f"\nfuzz: {total} requests in {time.monotonic() - started:.0f}s: {dict(statuses)}")
    print(f"fuzz: per operation {dict(per_operation)}")
    assert not problems, "\n".join(problems[:20])
    # every operation with a body got its budget in both modes (hypothesis stops early
    # only where the inputs run out, e.g. GET /health)
    bodied = [op.label for op in operations if op.body]
    assert all(per_operation[label] >= EXAMPLES_PER_OPERATION for label in bodied), per_operation
    status = httpx.get(f"{base}/admin/status", timeout=10).json()
    assert not any(status["replica_deaths"].values()), status["replica_deaths"]
    deadline = time.monotonic() + 30
    while True:
        actors = httpx.get(f"{base}/admin/status", timeout=10).json()["actors"]
        held = sum(a["load"]["kv_used_tokens"] - a["load"]["session_kv_tokens"] for a in actors)
        if held == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert held == 0, actors
    assert [a["name"] for a in actors] == ["r0"], actors  # never replaced
    assert all(a["restarts"] == 0 and a["load"]["healthy"] for a in actors), actors
    assert all(a["load"]["leak_check_failures"] == 0 for a in actors), actors
