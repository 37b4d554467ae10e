"""Contracts with neighbours: the real gateway's /admin/status document against the
typed contract the operator parses it with (`specd.workers.contracts.AdminStatus`), and
the status write that retries a 409 against the fake API server."""

from __future__ import annotations

import subprocess
import sys

import kopf
import pytest
from pydantic import ValidationError

from specd.devtools.status_docs import replica_status
from specd.operator.kube import KubeClient
from specd.operator.reconcile import OperatorContext, write_status
from specd.operator.status import Observation
from specd.workers.config import SpecDecodeDeployment
from specd.workers.contracts import DELTA_WIRE, AdminStatus, ReplicaInfo, field_errors

from .conftest import NAMESPACE, load_example
from .gateway_docs import actor, gateway_doc, renamed_field, without_field


def _real_pool_document() -> AdminStatus:
    """`PoolController.status()` of a real pool (imports ray, starts nothing) with one
    ready replica: its info and load as an actor answers them, and one event."""
    from specd.workers.pool.controller import PoolController
    from specd.workers.pool.replica import Replica, ReplicaState

    spec = SpecDecodeDeployment.model_validate(load_example("demo.yaml")).spec
    pool = PoolController(spec, name="demo")
    h = spec.config_hash()
    replica = Replica("r0", "specd-demo-x-r0", None, h, ReplicaState.READY)
    replica.info = ReplicaInfo(
        replica="r0",
        delta_wire=DELTA_WIRE,
        config_hash=h,
        model=spec.served_model_name,
        context_length=4096,
        vocab_size=512,
        sampling_defaults={"temperature": 0.6, "top_k": 20},
        device="cpu",
        prefix_cache={"page_size": 1, "capacity_tokens": 4096},
    )
    speculation = {"verify_steps": 10, "draft_tokens": 30, "accepted_tokens": 12}
    replica.load = replica_status("r0", h, kv_used_tokens=100, speculation=speculation)
    pool._replicas["r0"] = replica
    pool._event("r0", "ready", "context length 4096")
    return pool.status()


def test_the_real_pools_document_is_an_admin_status_and_so_are_the_fakes():
    """The pool builds `AdminStatus` itself; its JSON parses back to the same value
    (what the operator does with the HTTP body), as does every fake document."""
    real = _real_pool_document()
    assert isinstance(real, AdminStatus)
    assert AdminStatus.model_validate(real.model_dump(mode="json")) == real
    assert real.actors[0].load is not None and real.actors[0].load.kv_used_tokens == 100
    spec = SpecDecodeDeployment.model_validate(load_example("demo.yaml")).spec
    fake = gateway_doc(spec, [actor("r0", spec.config_hash()), actor("r1", "h", "starting")])
    assert AdminStatus.model_validate(fake.model_dump(mode="json")) == fake
    assert set(fake.model_dump()) == set(real.model_dump())


PRODUCED_FIELDS = [
    "ready_replicas",
    "desired_replicas",
    "kv_usage",
    "config_hash",
    "actors",
    "events",
    "failure",
    "retired_leak_check_failures",
    "actors.0.load.kv_usage",
    "actors.0.load.leak_check_failures",
    "actors.0.load.speculation.accepted_tokens",
    "actors.0.sampling_defaults",
    "events.0.time",
]


def _named(path: str) -> str:
    """``actors.0.load`` as `field_errors` names it: ``actors[0].load``."""
    out = ""
    for part in path.split("."):
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


@pytest.mark.parametrize("path", PRODUCED_FIELDS)
def test_renaming_a_field_of_the_produced_document_fails_validation_naming_it(path):
    raw = renamed_field(_real_pool_document(), path, "renamed")
    with pytest.raises(ValidationError) as err:
        AdminStatus.model_validate(raw)
    problems = field_errors(err.value)
    assert f"{_named(path)}: Field required" in problems
    assert "renamed: Extra inputs are not permitted" in problems


@pytest.mark.parametrize(
    "path", ["ready_replicas", "kv_usage", "failure", "actors.0.load.kv_usage", "events.0.detail"]
)
def test_a_missing_field_of_the_produced_document_fails_validation_naming_it(path):
    with pytest.raises(ValidationError) as err:
        AdminStatus.model_validate(without_field(_real_pool_document(), path))
    assert field_errors(err.value) == f"{_named(path)}: Field required"


def test_the_contracts_and_the_operator_load_no_torch_and_no_ray():
    code = (
        "import sys\n"
        "import specd.workers.contracts, specd.devtools.status_docs\n"
        "import specd.operator.handlers, specd.operator.reconcile, specd.operator.status\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'triton') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_conflicting_status_write_is_retried_on_a_fresh_read(cluster):
    doc = load_example("gpu-eagle3-tree.yaml")
    body = cluster.call(_create(cluster, doc))
    sdd = SpecDecodeDeployment.model_validate(doc)
    h = sdd.spec.config_hash()
    ctx = OperatorContext(client=KubeClient(kopf.ConnectionInfo(server=cluster.url)))
    stale = {**body, "metadata": {**body["metadata"], "resourceVersion": "1"}}
    gw = gateway_doc(sdd.spec, [actor("r0", h), actor("r1", h)])
    written = cluster.call(write_status(ctx, stale, Observation(1, sdd, gateway=gw)))
    cluster.call(ctx.close())
    assert written is not None
    metrics = ctx.metrics.registry
    assert (
        metrics.get_sample_value("specd_operator_status_writes_total", {"result": "conflict"}) == 1
    )
    assert (
        metrics.get_sample_value("specd_operator_status_writes_total", {"result": "written"}) == 1
    )
    stored = cluster.get(cluster.sdd, "llama3-eagle3")
    assert stored["status"]["ready"] == "2/2"
    assert stored["spec"] == body["spec"]  # /status never touches the spec


async def _create(cluster, doc):
    client = KubeClient(kopf.ConnectionInfo(server=cluster.url))
    try:
        return await client.create({**doc, "metadata": {**doc["metadata"], "namespace": NAMESPACE}})
    finally:
        await client.close()
