"""kopf (KopfRunner) against the fake API server over real HTTP, with a fake gateway
serving ``/admin/status`` over HTTP.  The tests play the missing controllers: they
set what the gateway reports and assert what the operator wrote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specd.operator.children import ChildOptions, admin_token_of
from specd.operator.reconcile import OperatorContext
from specd.operator.testing.cluster import free_port, kopf_in_thread
from specd.workers.config import SpecDecodeDeployment

from .conftest import NAMESPACE, REPO, Cluster, load_example
from .gateway_docs import actor, event, gateway_doc, renamed_field, without_field

SDD_PATH = f"/apis/specd.dev/v1alpha1/namespaces/{NAMESPACE}/specdecodedeployments"


@contextlib.contextmanager
def operator(cluster: Cluster, **settings: Any) -> Iterator[OperatorContext]:
    ctx = OperatorContext(
        options=ChildOptions(image="specd:test"),
        poll_interval_s=0.2,
        gateway_timeout_s=1.0,
        gateway_url=cluster.gateway.url,
        **settings,
    )
    with kopf_in_thread(ctx):
        yield ctx


def http(cluster: Cluster, method: str, path: str, body: Any = None, ctype: str | None = None):
    async def go():
        headers = {"Content-Type": ctype} if ctype else {}
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, cluster.url + path, json=body, headers=headers) as r,
        ):
            return r.status, await r.json(content_type=None)

    return cluster.call(go())


def create(cluster: Cluster, doc: dict[str, Any]) -> dict[str, Any]:
    status, body = http(cluster, "POST", SDD_PATH, doc)
    assert status in (200, 201), body
    return body


def merge(cluster: Cluster, name: str, patch: dict[str, Any], sub: str = "") -> Any:
    path = f"{SDD_PATH}/{name}" + (f"/{sub}" if sub else "")
    return http(cluster, "PATCH", path, patch, "application/merge-patch+json")


def sdd(cluster: Cluster, name: str) -> dict[str, Any] | None:
    return cluster.get(cluster.sdd, name)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions", []):
        if c["type"] == type_:
            return c
    return {}


def wait_condition(cluster, name, type_, status, reason=None, timeout=15):
    def check():
        c = condition(sdd(cluster, name), type_)
        return c if c.get("status") == status and reason in (None, c.get("reason")) else None

    return cluster.wait_for(check, timeout, f"{type_}={status} ({reason})")


def spec_of(doc: dict[str, Any]) -> Any:
    return SpecDecodeDeployment.model_validate(doc).spec


def event_messages(cluster: Cluster) -> str:
    return " ".join(f"{e.get('reason')}: {e.get('message')}" for e in cluster.live(cluster.events))


def test_create_makes_every_child_with_owner_references(cluster):
    doc = load_example("gpu-eagle3-tree.yaml")
    with operator(cluster):
        created = create(cluster, doc)
        name, uid = "llama3-eagle3", created["metadata"]["uid"]
        deploy = cluster.wait_for(lambda: cluster.get(cluster.deployments, f"{name}-gateway"))
        monitor = cluster.wait_for(lambda: cluster.get(cluster.servicemonitors, f"{name}-gateway"))
        cluster.wait_for(lambda: "ServiceMonitor " in event_messages(cluster), what="events")
    cm = cluster.get(cluster.configmaps, f"{name}-config")
    ray = cluster.get(cluster.rayclusters, f"{name}-ray")
    svc = cluster.get(cluster.services, f"{name}-gateway")
    for child in (cm, ray, deploy, svc, monitor):
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "SpecDecodeDeployment",
            name,
            uid,
            True,
        )
    # the ConfigMap holds the resolved engine config and its hash
    spec = spec_of(doc)
    engine = yaml.safe_load(cm["data"]["deployment.yaml"])
    assert spec_of(engine).model_dump() == spec.model_dump()
    assert engine["spec"]["kvCache"]["pageSize"] == 64 and "metrics" not in engine["spec"]
    assert cm["data"]["configHash"] == spec.config_hash()
    # KubeRay: a head that takes no actors, one GPU worker per replica (+1 surge)
    head = ray["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (workers,) = ray["spec"]["workerGroupSpecs"]
    assert workers["replicas"] == 3
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and limits["memory"] == "64Gi"
    # the gateway joins that cluster and serves the mounted config
    pod = deploy["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    script = container["command"][-1]
    assert f"--address={name}-ray-head-svc.{NAMESPACE}.svc:6379" in script
    assert "--num-cpus=0 --num-gpus=0" in script
    assert "specd gateway --config /etc/specd/deployment.yaml" in script
    assert pod["spec"]["volumes"][0]["configMap"]["name"] == f"{name}-config"
    assert container["image"] == "specd:test"
    # Service -> gateway pods; ServiceMonitor -> Service
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    # the dashboards' `deployment` label comes from the Service's specd.dev/deployment
    (relabel,) = monitor["spec"]["endpoints"][0]["relabelings"]
    assert relabel == {
        "sourceLabels": ["__meta_kubernetes_service_label_specd_dev_deployment"],
        "targetLabel": "deployment",
    }
    assert svc["metadata"]["labels"]["specd.dev/deployment"] == name
    # Events name each child created
    for kind in ("ConfigMap", "RayCluster", "Deployment", "Service", "ServiceMonitor"):
        assert f"{kind} " in event_messages(cluster)


def _demo_spec_doc(name: str = "demo", **spec: Any) -> dict[str, Any]:
    doc = load_example("gpu-eagle3-tree.yaml")
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return doc


def test_status_comes_from_the_gateway_admin_status(cluster):
    doc = _demo_spec_doc(replicas=2)
    spec, h = spec_of(doc), spec_of(doc).config_hash()
    with operator(cluster):
        create(cluster, doc)
        # no gateway answer yet: not ready, and says why
        c = wait_condition(cluster, "demo", "Ready", "False", "GatewayUnavailable")
        assert "/admin/status" in c["message"]
        cluster.gateway.docs[(NAMESPACE, "demo")] = gateway_doc(
            spec,
            [
                actor(
                    "r0", h, verifies=100, drafts=3100, accepted=150, kv_used=400, kv_reserved=64
                ),
                actor(
                    "r1",
                    h,
                    verifies=100,
                    drafts=3100,
                    accepted=250,
                    kv_used=200,
                    kv_reserved=128,
                    restarts=2,
                    adaptive_steps=3,
                ),
            ],
        )
        wait_condition(cluster, "demo", "Ready", "True", "AllReplicasReady")
        status = sdd(cluster, "demo")["status"]
        assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
        assert status["ready"] == "2/2" and status["configHash"] == h
        assert status["observedGeneration"] == 1
        assert status["selector"] == "specd.dev/deployment=demo,specd.dev/component=engine"
        assert status["endpoint"] == f"http://demo-gateway.{NAMESPACE}.svc:8000"
        # 400 accepted drafts over 200 verifies: 1 + 2 tokens per verify
        assert status["speculation"]["acceptLength"] == 3.0
        assert status["speculation"]["acceptRate"] == round(400 / 6200, 3)
        assert status["kv"] == {"usage": 0.4, "reserveUsage": 0.128}
        assert status["actors"] == [
            {"name": "r0", "state": "ready", "configHash": h, "restarts": 0},
            {"name": "r1", "state": "ready", "configHash": h, "restarts": 2, "specSteps": 3},
        ]
        assert condition(sdd(cluster, "demo"), "SpeculationEffective")["status"] == "True"
        assert condition(sdd(cluster, "demo"), "Degraded")["status"] == "False"
        # the next window accepts little: below minAcceptLength (2.0) -> not effective
        cluster.gateway.docs[(NAMESPACE, "demo")] = gateway_doc(
            spec,
            [
                actor("r0", h, verifies=200, drafts=6200, accepted=160, kv_used=400),
                actor("r1", h, verifies=200, drafts=6200, accepted=260, kv_used=200),
            ],
        )
        c = wait_condition(cluster, "demo", "SpeculationEffective", "False", "AcceptLengthLow")
        assert "1.1 < spec.speculative.minAcceptLength 2" in c["message"]
        assert sdd(cluster, "demo")["status"]["speculation"]["windowVerifies"] == 200


@pytest.mark.parametrize(
    "break_it,field",
    [
        (lambda doc: without_field(doc, "ready_replicas"), "ready_replicas"),
        (
            lambda doc: renamed_field(doc, "actors.0.load.kv_usage", "kv_use"),
            "actors[0].load.kv_usage",
        ),
    ],
    ids=["missing-top-level", "renamed-in-an-actors-load"],
)
def test_a_gateway_status_that_breaks_the_contract_is_a_failed_poll_naming_the_field(
    cluster, break_it, field
):
    """The operator parses /admin/status as `AdminStatus`: a document lacking a field
    (or with one renamed) is not read as zeros but as a failed poll: Ready False and
    Degraded True with the reason GatewayStatusInvalid and the field in the message, a
    Warning Event, and ``specd_operator_gateway_polls_total{result="invalid"}``."""
    doc = _demo_spec_doc(replicas=1)
    spec = spec_of(doc)
    good = gateway_doc(spec, [actor("r0", spec.config_hash(), kv_used=400)])
    with operator(cluster) as ctx:
        create(cluster, doc)
        cluster.gateway.docs[(NAMESPACE, "demo")] = break_it(good)
        ready = wait_condition(cluster, "demo", "Ready", "False", "GatewayStatusInvalid")
        assert field in ready["message"] and "/admin/status" in ready["message"]
        degraded = wait_condition(cluster, "demo", "Degraded", "True", "GatewayStatusInvalid")
        assert field in degraded["message"]
        warning = f"GatewayStatusInvalid: gateway /admin/status invalid: {field}"
        cluster.wait_for(lambda: warning in event_messages(cluster), what="a Warning Event")
        polls = ctx.metrics.registry.get_sample_value(
            "specd_operator_gateway_polls_total", {"result": "invalid"}
        )
        assert polls and polls >= 1
        # the gateway serves a valid document again: read as usual
        cluster.gateway.docs[(NAMESPACE, "demo")] = good
        wait_condition(cluster, "demo", "Ready", "True", "AllReplicasReady")
        wait_condition(cluster, "demo", "Degraded", "False", "AsExpected")
        assert sdd(cluster, "demo")["status"]["kv"]["usage"] == 0.4


def test_speculative_update_rolls_to_a_new_hash_and_is_ready_only_when_all_actors_run_it(
    cluster,
):
    doc = _demo_spec_doc(replicas=2)
    old = spec_of(doc).config_hash()
    gw = cluster.gateway.docs
    with operator(cluster):
        create(cluster, doc)
        gw[(NAMESPACE, "demo")] = gateway_doc(spec_of(doc), [actor("r0", old), actor("r1", old)])
        wait_condition(cluster, "demo", "Ready", "True")
        status, _ = merge(
            cluster, "demo", {"spec": {"speculative": {"numSteps": 4, "numDraftTokens": 24}}}
        )
        assert status == 200
        new_doc = sdd(cluster, "demo")
        new = spec_of(new_doc).config_hash()
        assert new != old and new_doc["metadata"]["generation"] == 2
        cm = cluster.wait_for(
            lambda: (
                (c := cluster.get(cluster.configmaps, "demo-config"))
                and c["data"]["configHash"] == new
                and c
            ),
            what="ConfigMap with the new hash",
        )
        assert yaml.safe_load(cm["data"]["deployment.yaml"])["spec"]["speculative"]["numSteps"] == 4
        # the gateway still runs the old config: Progressing, not Ready
        c = wait_condition(cluster, "demo", "Progressing", "True", "ConfigPending")
        assert new in c["message"]
        assert condition(sdd(cluster, "demo"), "Ready")["status"] == "False"
        assert sdd(cluster, "demo")["status"]["observedGeneration"] == 2
        # mid-roll: one new actor ready, one old still serving -> still not Ready
        new_spec = spec_of(new_doc)
        gw[(NAMESPACE, "demo")] = gateway_doc(
            new_spec, [actor("r1", old), actor("r2", new), actor("r3", new, "starting")]
        )
        c = wait_condition(cluster, "demo", "Progressing", "True", "RollingUpdate")
        assert "1/2 actors ready" in c["message"]
        assert condition(sdd(cluster, "demo"), "Ready")["status"] == "False"
        assert sdd(cluster, "demo")["status"]["updatedReplicas"] == 1
        gw[(NAMESPACE, "demo")] = gateway_doc(new_spec, [actor("r2", new), actor("r3", new)])
        wait_condition(cluster, "demo", "Ready", "True", "AllReplicasReady")
        assert condition(sdd(cluster, "demo"), "Progressing")["reason"] == "RolloutComplete"
        assert "RolloutProgress" in event_messages(cluster)


def test_scale_subresource_changes_replicas_and_the_children(cluster):
    doc = _demo_spec_doc(replicas=2)
    with operator(cluster):
        create(cluster, doc)
        cluster.wait_for(lambda: cluster.get(cluster.rayclusters, "demo-ray"))
        status, scale = http(cluster, "GET", f"{SDD_PATH}/demo/scale")
        assert status == 200 and (scale["kind"], scale["spec"]["replicas"]) == ("Scale", 2)
        status, scale = merge(cluster, "demo", {"spec": {"replicas": 3}}, sub="scale")
        assert status == 200 and scale["spec"]["replicas"] == 3
        assert sdd(cluster, "demo")["spec"]["replicas"] == 3
        cluster.wait_for(
            lambda: (
                cluster.get(cluster.rayclusters, "demo-ray")["spec"]["workerGroupSpecs"][0][
                    "replicas"
                ]
                == 4
            ),
            what="worker group resized",
        )
        cm = cluster.get(cluster.configmaps, "demo-config")
        assert yaml.safe_load(cm["data"]["deployment.yaml"])["spec"]["replicas"] == 3
        assert cm["data"]["configHash"] == spec_of(doc).config_hash()  # no roll for a scale
        cluster.wait_for(
            lambda: sdd(cluster, "demo").get("status", {}).get("ready") == "0/3", what="READY 0/3"
        )
        assert sdd(cluster, "demo")["status"]["observedGeneration"] == 2


def test_an_autoscaled_sdd_leaves_its_workers_to_the_ray_autoscaler(cluster):
    """examples/autoscaling.yaml: KubeRay's in-tree autoscaler sizes the worker group
    (the operator keeps the count it set when a spec change patches the cluster), and
    the status follows the gateway autoscaler's count."""
    doc = load_example("autoscaling.yaml")
    name = doc["metadata"]["name"]
    with operator(cluster):
        create(cluster, doc)
        ray = cluster.wait_for(lambda: cluster.get(cluster.rayclusters, f"{name}-ray"))
        assert ray["spec"]["enableInTreeAutoscaling"] is True
        (workers,) = ray["spec"]["workerGroupSpecs"]
        assert (workers["minReplicas"], workers["replicas"], workers["maxReplicas"]) == (2, 2, 7)
        path = f"/apis/ray.io/v1/namespaces/{NAMESPACE}/rayclusters/{name}-ray"
        scaled = {**workers, "replicas": 5}  # what the Ray autoscaler writes
        status, _ = http(cluster, "PATCH", path, {"spec": {"workerGroupSpecs": [scaled]}})
        assert status == 200
        merge(cluster, name, {"spec": {"resources": {"memory": "80Gi"}}})  # patches the pods

        def worker_group() -> dict:
            return cluster.get(cluster.rayclusters, f"{name}-ray")["spec"]["workerGroupSpecs"][0]

        cluster.wait_for(
            lambda: (
                worker_group()["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
                == "80Gi"
            ),
            what="the worker group patched",
        )
        assert worker_group()["replicas"] == 5  # not set back to 2

        spec = spec_of(doc)
        h = spec.config_hash()
        doc_of_gateway = gateway_doc(spec, [actor(f"r{i}", h) for i in range(4)], desired=4)
        cluster.gateway.docs[(NAMESPACE, name)] = doc_of_gateway
        cluster.wait_for(
            lambda: sdd(cluster, name).get("status", {}).get("desiredReplicas") == 4,
            what="desiredReplicas from the gateway",
        )
        assert sdd(cluster, name)["status"]["ready"] == "4/4"


def test_the_admin_token_is_a_secret_mounted_as_a_file_and_never_rotated(cluster):
    """The gateway's admin token: a random Secret owned by the SDD, created once (the
    polls' reconciles and a spec change keep it), mounted into the pod as a file.  The
    SDD's uid, which anyone who can read the SDD sees, appears nowhere in the pod."""
    with operator(cluster):
        uid = create(cluster, _demo_spec_doc())["metadata"]["uid"]
        deploy = cluster.wait_for(lambda: cluster.get(cluster.deployments, "demo-gateway"))
        secret = cluster.get(cluster.secrets, "demo-admin-token")
        (ref,) = secret["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == ("SpecDecodeDeployment", "demo", uid)
        token = admin_token_of(secret)
        assert token and len(token) >= 32 and token != uid
        pod = deploy["spec"]["template"]
        assert uid not in json.dumps(pod) and token not in json.dumps(pod)
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert "SPECD_ADMIN_TOKEN" not in env
        assert env["SPECD_ADMIN_TOKEN_FILE"] == {
            "name": "SPECD_ADMIN_TOKEN_FILE",
            "value": "/etc/specd-admin/token",
        }
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/specd-admin"]
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"] == {
            "secretName": "demo-admin-token",
            "items": [{"key": "token", "path": "token"}],
        }
        merge(cluster, "demo", {"spec": {"replicas": 3}})

        def scaled() -> bool:
            config = cluster.get(cluster.configmaps, "demo-config")["data"]
            return "replicas: 3" in config["deployment.yaml"]

        cluster.wait_for(scaled, what="the spec change applied")
        polls = cluster.gateway.polls.get((NAMESPACE, "demo"), 0)
        cluster.wait_for(lambda: cluster.gateway.polls.get((NAMESPACE, "demo"), 0) > polls + 3)
    kept = cluster.get(cluster.secrets, "demo-admin-token")
    assert admin_token_of(kept) == token
    assert kept["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
    assert [s["metadata"]["name"] for s in cluster.live(cluster.secrets)] == ["demo-admin-token"]


def test_delete_leaves_cleanup_to_owner_references(cluster):
    with operator(cluster):
        uid = create(cluster, _demo_spec_doc())["metadata"]["uid"]
        cluster.wait_for(lambda: cluster.get(cluster.services, "demo-gateway"))
        cluster.wait_for(lambda: sdd(cluster, "demo").get("status"), what="status polled")
        # managed Ray: no finalizer, so a delete never waits for the operator
        assert not sdd(cluster, "demo")["metadata"].get("finalizers")
        status, _ = http(cluster, "DELETE", f"{SDD_PATH}/demo")
        assert status == 200
        cluster.wait_for(lambda: sdd(cluster, "demo") is None, what="SDD deleted")
    # no controller here runs garbage collection: every child points at the SDD
    for res, name in [
        (cluster.configmaps, "demo-config"),
        (cluster.rayclusters, "demo-ray"),
        (cluster.deployments, "demo-gateway"),
        (cluster.services, "demo-gateway"),
    ]:
        assert cluster.get(res, name)["metadata"]["ownerReferences"][0]["uid"] == uid


def test_delete_with_external_ray_has_the_gateway_release_its_actors_first(cluster):
    doc = load_example("external-ray.yaml")
    spec = spec_of(doc)
    with operator(cluster):
        uid = create(cluster, doc)["metadata"]["uid"]
        deploy = cluster.wait_for(lambda: cluster.get(cluster.deployments, "shared-ray-gateway"))
        (container,) = deploy["spec"]["template"]["spec"]["containers"]
        assert "--address=ray-head.ray-system.svc:6379" in container["command"][-1]
        token = admin_token_of(cluster.get(cluster.secrets, "shared-ray-admin-token"))
        assert cluster.get(cluster.rayclusters, "shared-ray-ray") is None  # nothing managed
        assert sdd(cluster, "shared-ray")["metadata"]["finalizers"]
        key = (NAMESPACE, "shared-ray")
        cluster.gateway.docs[key] = gateway_doc(
            spec, [actor("r0", spec.config_hash()), actor("r1", spec.config_hash())]
        )
        http(cluster, "DELETE", f"{SDD_PATH}/shared-ray")
        cluster.wait_for(lambda: sdd(cluster, "shared-ray") is None, what="SDD deleted")
        # the gateway released its actors (authorized by the Secret's token), then went
        assert token and token != uid
        assert cluster.gateway.releases == [(key, f"Bearer {token}")]
        assert cluster.get(cluster.deployments, "shared-ray-gateway") is None
        assert "Released: the gateway drained and killed replicas: r0, r1" in event_messages(
            cluster
        )


def test_delete_with_external_ray_waits_for_an_unreachable_gateway_then_warns(cluster):
    doc = load_example("external-ray.yaml")
    with operator(cluster, release_give_up_s=3.0):
        create(cluster, doc)
        cluster.wait_for(lambda: cluster.get(cluster.deployments, "shared-ray-gateway"))
        http(cluster, "DELETE", f"{SDD_PATH}/shared-ray")  # no gateway answers
        time.sleep(1.5)
        going = sdd(cluster, "shared-ray")
        assert going["metadata"]["deletionTimestamp"] and going["metadata"]["finalizers"]
        assert cluster.get(cluster.deployments, "shared-ray-gateway") is not None
        cluster.wait_for(lambda: sdd(cluster, "shared-ray") is None, 30, "SDD deleted")
        assert cluster.get(cluster.deployments, "shared-ray-gateway") is None
        assert cluster.gateway.releases == []
        warning = event_messages(cluster)
        assert "ActorsNotReleased: the gateway did not release its actors in 3 s" in warning
        assert "specd-shared-ray-* may still run on Ray cluster ray-head.ray-system.svc:6379" in (
            warning
        )


def test_spec_invalid_in_context_is_degraded_naming_the_field(cluster):
    # Stored past admission (e.g. before a CEL rule existed): the operator validates
    # with the pydantic models itself and reports instead of crashing or retrying.
    bad = _demo_spec_doc("stale")
    del bad["spec"]["draft"]
    with operator(cluster):
        res = cluster.sdd
        cluster.run(
            lambda: cluster.kube.objects.__setitem__(
                (res, NAMESPACE, "stale"),
                {
                    **bad,
                    "metadata": {
                        "name": "stale",
                        "namespace": NAMESPACE,
                        "uid": "u-1",
                        "resourceVersion": "1",
                        "generation": 1,
                    },
                },
            )
        )
        # the object was put in place without an event: poke it so the watch sees it
        merge(cluster, "stale", {"metadata": {"labels": {"poke": "1"}}})
        c = wait_condition(cluster, "stale", "Degraded", "True", "InvalidSpec")
        assert "spec.speculative needs spec.draft" in c["message"]
        assert condition(sdd(cluster, "stale"), "Ready")["status"] == "False"
        time.sleep(0.5)
        assert cluster.get(cluster.configmaps, "stale-config") is None  # nothing created
        assert "InvalidSpec" in event_messages(cluster)


def _four_gpu_workers() -> dict[str, Any]:
    """spec.ray.cluster replacing the engine group with 4-GPU pods (KubeRay passes the
    nvidia.com/gpu limit to ``ray start``)."""
    limits = {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "4"}
    container = {"name": "ray-worker", "image": "specd:test", "resources": {"limits": limits}}
    group = {
        "groupName": "engine",
        "replicas": 2,
        "rayStartParams": {"num-cpus": "32"},
        "template": {"spec": {"containers": [container]}},
    }
    return {"workerGroupSpecs": [group]}


def test_a_tensor_4_sdd_gets_a_4_gpu_worker_pod_per_replica(cluster):
    """Each worker pod gets a replica's GPUs (resources.gpus == parallelism.tensor), so
    one pod holds all four ranks of a replica; the engine config carries the tensor size.
    Moved to tensor 8 on 4-GPU workers, it is Degraded naming the field and the operator
    rewrites none of its children (the running replicas stay as they are)."""
    doc = _demo_spec_doc("tp", parallelism={"tensor": 4}, resources={"gpus": 4, "cpu": 32})
    with operator(cluster):
        create(cluster, doc)
        ray = cluster.wait_for(lambda: cluster.get(cluster.rayclusters, "tp-ray"))
        (workers,) = ray["spec"]["workerGroupSpecs"]
        assert workers["rayStartParams"] == {"num-cpus": "32", "num-gpus": "4"}
        assert workers["replicas"] == 3  # one pod per replica, + the surge pod
        limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "4"
        config = cluster.get(cluster.configmaps, "tp-config")
        engine = yaml.safe_load(config["data"]["deployment.yaml"])["spec"]
        assert engine["parallelism"]["tensor"] == 4 and engine["resources"]["gpus"] == 4
        bigger = {"parallelism": {"tensor": 8}, "resources": {"gpus": 8}}
        status, _ = merge(
            cluster, "tp", {"spec": {**bigger, "ray": {"cluster": _four_gpu_workers()}}}
        )
        assert status == 200
        c = wait_condition(cluster, "tp", "Degraded", "True", "InvalidSpec")
        assert c["message"].startswith(
            "spec.parallelism.tensor 8 exceeds the 4 GPUs of each Ray worker (spec.ray.cluster"
        )
        assert cluster.get(cluster.configmaps, "tp-config")["data"] == config["data"]
        assert cluster.get(cluster.rayclusters, "tp-ray")["spec"] == ray["spec"]


def test_a_tensor_larger_than_the_worker_pods_is_degraded_before_any_child(cluster):
    doc = _demo_spec_doc(
        "tp8",
        parallelism={"tensor": 8},
        resources={"gpus": 8, "cpu": 32},
        ray={"cluster": _four_gpu_workers()},
    )
    with operator(cluster):
        create(cluster, doc)  # admitted: the worker pods' GPUs are beyond the CRD's reach
        c = wait_condition(cluster, "tp8", "Degraded", "True", "InvalidSpec")
        assert c["message"].startswith(
            "spec.parallelism.tensor 8 exceeds the 4 GPUs of each Ray worker (spec.ray.cluster"
        )
        assert condition(sdd(cluster, "tp8"), "Ready")["status"] == "False"
        time.sleep(0.5)
        assert cluster.get(cluster.rayclusters, "tp8-ray") is None  # nothing created
        assert cluster.get(cluster.configmaps, "tp8-config") is None
        assert "spec.parallelism.tensor 8 exceeds" in event_messages(cluster)
        # the same spec on an existing Ray cluster is not checked: its nodes are not ours
        external = _demo_spec_doc(
            "tp8-ext",
            parallelism={"tensor": 8},
            resources={"gpus": 8},
            ray={"address": "ray-head.ray-system.svc:6379"},
        )
        create(cluster, external)
        cluster.wait_for(lambda: cluster.get(cluster.deployments, "tp8-ext-gateway"))
        wait_condition(cluster, "tp8-ext", "Degraded", "False", "AsExpected")


def test_replica_that_fails_to_start_is_degraded_with_the_gateway_reason(cluster):
    doc = _demo_spec_doc(replicas=1)
    spec = spec_of(doc)
    message = (
        "failed to start (ConfigError: spec.attentionBackend: backend 'torch' cannot "
        "run page_size > 1 with topk > 1); next try in 2s"
    )
    with operator(cluster):
        create(cluster, doc)
        cluster.gateway.docs[(NAMESPACE, "demo")] = gateway_doc(
            spec,
            [actor("r1", spec.config_hash(), "starting")],
            events=[event("r0", "starting"), event("r0", "dead", message), event("r1", "starting")],
        )
        c = wait_condition(cluster, "demo", "Degraded", "True", "ReplicaFailing")
        assert "spec.attentionBackend" in c["message"] and "r0" in c["message"]
        assert sdd(cluster, "demo")["status"]["replacements"] == 1
        # the replacement comes up: recovered
        cluster.gateway.docs[(NAMESPACE, "demo")] = gateway_doc(
            spec,
            [actor("r1", spec.config_hash())],
            events=[event("r0", "dead", message), event("r1", "ready")],
        )
        wait_condition(cluster, "demo", "Degraded", "False", "AsExpected")
        wait_condition(cluster, "demo", "Ready", "True")


def test_kuberay_missing_is_degraded_with_the_install_hint(cluster_factory):
    cluster = cluster_factory(kuberay=False)
    with operator(cluster):
        create(cluster, _demo_spec_doc())
        c = wait_condition(cluster, "demo", "Degraded", "True", "KubeRayMissing")
        assert "helm install kuberay-operator" in c["message"] and "spec.ray" in c["message"]
        assert condition(sdd(cluster, "demo"), "Ready")["reason"] == "KubeRayMissing"
        assert cluster.get(cluster.configmaps, "demo-config") is not None
        assert cluster.get(cluster.deployments, "demo-gateway") is None
        assert "KubeRayMissing" in event_messages(cluster)


def test_servicemonitor_skipped_when_its_crd_is_not_served(cluster_factory):
    cluster = cluster_factory(prometheus=False)
    with operator(cluster):
        create(cluster, _demo_spec_doc())
        cluster.wait_for(lambda: cluster.get(cluster.services, "demo-gateway"))
        wait_condition(cluster, "demo", "Ready", "False", "GatewayUnavailable")


def test_kubectl_apply_get_and_scale(cluster):
    path = str(REPO / "examples" / "gpu-eagle3-tree.yaml")
    spec = spec_of(load_example("gpu-eagle3-tree.yaml"))
    h = spec.config_hash()
    cluster.gateway.docs[(NAMESPACE, "llama3-eagle3")] = gateway_doc(
        spec,
        [
            actor("r0", h, verifies=10, drafts=310, accepted=25, kv_used=370),
            actor("r1", h, verifies=10, drafts=310, accepted=15, kv_used=120),
        ],
    )
    with operator(cluster):
        # kubectl's default --validate=strict: the server validates (the fake's admission)
        assert "created" in cluster.kubectl("apply", "-f", path)
        wait_condition(cluster, "llama3-eagle3", "Ready", "True")
        table = cluster.kubectl("get", "sdd")
        header, row = table.strip().splitlines()
        columns = ["NAME", "READY", "REPLICAS", "DRAFT", "ACCEPT-LEN", "KV-USAGE", "AGE"]
        assert header.split() == columns
        assert row.split()[:6] == ["llama3-eagle3", "2/2", "2", "EAGLE3", "3", "0.37"]
        assert "scaled" in cluster.kubectl("scale", "sdd/llama3-eagle3", "--replicas", "3")
        assert sdd(cluster, "llama3-eagle3")["spec"]["replicas"] == 3
        cluster.wait_for(
            lambda: (
                cluster.kubectl("get", "sdd/llama3-eagle3", "-o", "jsonpath={.status.ready}")
                == "2/3"
            ),
            what="READY 2/3 after the scale",
        )
    # a bad CR never reaches the operator: the API server refuses it
    bad = load_example("gpu-eagle3-tree.yaml")
    bad["metadata"]["name"] = "bad"
    spec_doc = dict(bad["spec"]["speculative"])
    for field, value, message in [
        ("numDraftTokens", 99, "numDraftTokens must be at most topk * numSteps + 1"),
        # the fake words it as jsonschema does; a real server: 'unknown field "spec..."'
        ("numDraftToken", 9, "spec.speculative: Additional properties are not allowed"),
    ]:
        bad["spec"]["speculative"] = {**spec_doc, field: value}
        proc = subprocess.run(
            ["kubectl", "apply", "-f", "-"],
            input=json.dumps(bad),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0
        assert message in proc.stderr
        assert sdd(cluster, "bad") is None


def test_specd_operator_process_serves_metrics_and_liveness(cluster):
    """`specd operator` as users run it (its own process, kubeconfig login): it
    reconciles a new SDD, answers its liveness probe, exports its own metrics, and
    exits cleanly on SIGTERM."""
    metrics_port, live_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "specd.workers.cli", "operator", "--namespace", NAMESPACE,
        "--standalone", "--poll-interval", "0.5", "--metrics-port", str(metrics_port),
        "--liveness", f"http://127.0.0.1:{live_port}/healthz",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        create(cluster, _demo_spec_doc())
        cluster.wait_for(
            lambda: cluster.get(cluster.configmaps, "demo-config"), 60, "the operator's ConfigMap"
        )
        cluster.wait_for(
            lambda: _get(f"http://127.0.0.1:{live_port}/healthz") == 200, 30, "liveness"
        )
        reconciles = cluster.wait_for(
            lambda: _ok_reconciles(f"http://127.0.0.1:{metrics_port}/metrics"),
            30,
            "an ok reconcile in the operator's own metrics",
        )
        assert reconciles >= 1
    finally:
        _stop(proc)  # exits 0 on SIGTERM


def _ok_reconciles(url: str) -> float:
    """``specd_operator_reconciles_total{result="ok"}`` summed over triggers."""
    return _reconciles(url, result="ok")


def _reconciles(url: str, **labels: str) -> float:
    """``specd_operator_reconciles_total`` summed over the series matching ``labels``."""
    text = urllib.request.urlopen(url, timeout=2).read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "specd_operator_reconciles"
        for s in family.samples
        if s.name.endswith("_total") and labels.items() <= s.labels.items()
    )


def _operator_process(pod_id: str, *args: str) -> tuple[subprocess.Popen, str]:
    """A `specd operator` process on the fake (kubeconfig login); (process, metrics URL)."""
    metrics_port = free_port()
    cmd = [
        sys.executable, "-m", "specd.workers.cli", "operator", "--namespace", NAMESPACE,
        "--poll-interval", "0.3", "--metrics-port", str(metrics_port), "--liveness", "", *args,
    ]  # fmt: skip
    env = {**os.environ, "POD_ID": pod_id}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    return proc, f"http://127.0.0.1:{metrics_port}/metrics"


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        output = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        output = proc.communicate()[0]
    assert proc.returncode == 0, output
    return output


def test_two_operator_replicas_peer_and_only_the_leader_acts(cluster_factory):
    """Two `specd operator` processes with kopf peering (the KopfPeering object the
    chart creates): the higher priority one reconciles and polls, the other stays
    paused (no poll, no write); when the leader exits it takes over."""
    cluster = cluster_factory(peering=True)
    peering_path = f"/apis/kopf.dev/v1/namespaces/{NAMESPACE}/kopfpeerings"
    status, _ = http(
        cluster,
        "POST",
        peering_path,
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "specd"}},
    )
    assert status in (200, 201)

    def peers() -> set[str]:
        obj = cluster.get(cluster.kopfpeerings, "specd") or {}
        return set(obj.get("status") or {})

    leader, leader_url = _operator_process("op-leader", "--priority", "20")
    follower = None
    try:
        create(cluster, _demo_spec_doc())
        cluster.wait_for(lambda: "op-leader" in peers(), 60, "the leader in the peering")
        cluster.wait_for(
            lambda: _reconciles(leader_url, trigger="poll") >= 2, 60, "the leader polling"
        )
        follower, follower_url = _operator_process("op-follower", "--priority", "10")
        cluster.wait_for(lambda: "op-follower" in peers(), 60, "the follower in the peering")
        cluster.wait_for(lambda: _get(follower_url) == 200, 30, "the follower's metrics")
        polls = _reconciles(leader_url, trigger="poll")
        cluster.wait_for(
            lambda: _reconciles(leader_url, trigger="poll") >= polls + 5, 30, "more polls"
        )
        assert _reconciles(follower_url, trigger="poll") == 0
        # kopf may run the resume handler once before its first peering event pauses
        # it; resume only ensures children that already match, so it writes nothing
        assert _reconciles(follower_url) == _reconciles(follower_url, trigger="resume") <= 1
        assert "Updated" not in event_messages(cluster)
        _stop(leader)
        assert "op-leader" not in peers()  # kopf removes itself on exit
        cluster.wait_for(
            lambda: _reconciles(follower_url, trigger="poll") >= 2, 30, "the follower polling"
        )
    finally:
        for proc in (leader, follower):
            if proc is not None and proc.poll() is None:
                _stop(proc)


def _get(url: str) -> int | None:
    try:
        return urllib.request.urlopen(url, timeout=2).status
    except OSError:
        return None
