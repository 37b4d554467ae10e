"""Contracts with neighbours: the real gateway's /admin/status shape, and the status
write that retries a 409 against the fake API server."""

from __future__ import annotations

import kopf

from specd.operator.kube import KubeClient
from specd.operator.reconcile import OperatorContext, write_status
from specd.operator.status import Observation
from specd.workers.config import SpecDecodeDeployment

from .conftest import NAMESPACE, load_example
from .gateway_docs import actor, gateway_doc


def test_fake_gateway_documents_have_the_real_pools_keys():
    from specd.workers.pool import PoolController, Replica  # imports ray, starts nothing

    doc = load_example("demo.yaml")
    spec = SpecDecodeDeployment.model_validate(doc).spec
    pool = PoolController(spec, name="demo")
    ours = gateway_doc(spec, [actor("r0", spec.config_hash())])
    assert set(pool.status()) == set(ours)
    replica = Replica("r0", "specd-demo-x-r0", None, spec.config_hash())
    assert set(replica.summary()) == set(ours["actors"][0])


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
