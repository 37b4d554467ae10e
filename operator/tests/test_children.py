"""Pure builders: the desired children for a spec, without any server."""

from __future__ import annotations

import json

import pytest
import yaml

from specd.operator import children, naming
from specd.operator.children import ChildOptions, Owner
from specd.workers.config import SpecDecodeDeployment, parse_deployment

OWNER = Owner("m", "ns", "uid-1")


def _sdd(**spec):
    return SpecDecodeDeployment.model_validate(
        {
            "apiVersion": "specd.dev/v1alpha1",
            "kind": "SpecDecodeDeployment",
            "metadata": {"name": "m"},
            "spec": {"model": {"path": "/m"}, **spec},
        }
    )


def test_configmap_is_a_loadable_engine_config_without_operator_fields():
    sdd = _sdd(
        replicas=3,
        metrics={"serviceMonitor": True},
        image="img:1",
        draft={"path": "/d"},
        speculative={"minAcceptLength": 3},
    )
    cm = children.build_configmap(sdd, OWNER)
    doc = yaml.safe_load(cm["data"][naming.CONFIG_FILE])
    assert "metrics" not in doc["spec"] and "image" not in doc["spec"]
    assert "minAcceptLength" not in doc["spec"]["speculative"]
    loaded = parse_deployment(doc)  # what `specd gateway` does with the file
    assert loaded.spec.config_hash() == sdd.spec.config_hash() == cm["data"]["configHash"]
    assert loaded.spec.replicas == 3


def test_operator_only_fields_do_not_change_the_config_hash():
    base = _sdd(draft={"path": "/d"}, speculative={})
    tuned = _sdd(
        draft={"path": "/d"},
        speculative={"minAcceptLength": 4},
        metrics={"serviceMonitor": True, "interval": "5s"},
        image="x",
    )
    assert base.spec.config_hash() == tuned.spec.config_hash()


def test_raycluster_overrides_merge_and_cpu_replicas_get_no_gpu():
    sdd = _sdd(
        replicas=0,
        resources={"gpus": 0, "cpu": 2},
        ray={"cluster": {"headGroupSpec": {"rayStartParams": {"block": "true"}}}},
    )
    rc = children.build_raycluster(sdd, OWNER, ChildOptions())
    assert rc["spec"]["headGroupSpec"]["rayStartParams"] == {
        "num-cpus": "0",
        "num-gpus": "0",
        "dashboard-host": "0.0.0.0",
        "block": "true",
    }
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert group["replicas"] == 0
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "2"}


def test_fractional_gpus_round_up_per_pod():
    rc = children.build_raycluster(_sdd(replicas=2, resources={"gpus": 0.5}), OWNER, ChildOptions())
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert group["rayStartParams"]["num-gpus"] == "1"
    assert group["template"]["metadata"]["labels"][naming.COMPONENT_LABEL] == "engine"


def test_a_tensor_4_replica_gets_a_4_gpu_worker_pod():
    """gpus == tensor, so each worker pod holds all four ranks of one replica (one GPU
    each, one node), with one pod per replica plus the surge pod."""
    sdd = _sdd(replicas=2, parallelism={"tensor": 4}, resources={"gpus": 4, "cpu": 16})
    rc = children.build_raycluster(sdd, OWNER, ChildOptions())
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert group["rayStartParams"] == {"num-cpus": "16", "num-gpus": "4"}
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "16", "nvidia.com/gpu": "4"}
    assert group["replicas"] == 3
    assert children.worker_gpus(rc) == 4
    assert children.tensor_exceeds_workers(sdd, rc) is None


def _workers(*groups):
    return {"spec": {"workerGroupSpecs": list(groups)}}


def _group(num_gpus=None, *limits):
    params = {} if num_gpus is None else {"num-gpus": num_gpus}
    containers = [{"resources": {"limits": {"nvidia.com/gpu": n}}} for n in limits]
    return {"rayStartParams": params, "template": {"spec": {"containers": containers}}}


@pytest.mark.parametrize(
    ("cluster", "gpus"),
    [
        pytest.param(_workers(_group("4", "8")), 4, id="num-gpus-wins"),
        pytest.param(_workers(_group(None, "4")), 4, id="container-limit"),
        pytest.param(_workers(_group(None, "2", 2)), 4, id="containers-add-up"),
        pytest.param(_workers(_group("0")), 0, id="cpu-workers"),
        pytest.param(_workers(_group("2"), _group("8")), 8, id="largest-group"),
        pytest.param(_workers(_group()), None, id="group-says-nothing"),
        pytest.param(_workers(_group("many")), None, id="not-a-count"),
        pytest.param(_workers(), None, id="no-group"),
        pytest.param({"spec": {}}, None, id="no-worker-groups"),
    ],
)
def test_worker_gpus_reads_num_gpus_else_the_gpu_limit(cluster, gpus):
    assert children.worker_gpus(cluster) == gpus


def test_a_tensor_larger_than_the_worker_pods_is_refused_naming_the_field():
    four_gpu_workers = {"workerGroupSpecs": [{"groupName": "engine", **_group("4")}]}
    sdd = _sdd(parallelism={"tensor": 8}, resources={"gpus": 8}, ray={"cluster": four_gpu_workers})
    rc = children.build_raycluster(sdd, OWNER, ChildOptions())
    assert children.worker_gpus(rc) == 4
    assert children.tensor_exceeds_workers(sdd, rc).startswith(
        "spec.parallelism.tensor 8 exceeds the 4 GPUs of each Ray worker (spec.ray.cluster"
    )
    # CPU ranks need no GPU worker
    cpu = _sdd(parallelism={"tensor": 8}, ray={"cluster": four_gpu_workers})
    assert (
        children.tensor_exceeds_workers(cpu, children.build_raycluster(cpu, OWNER, ChildOptions()))
        is None
    )


def test_names_and_selectors_agree():
    sdd = _sdd()
    deploy = children.build_gateway_deployment(sdd, OWNER, ChildOptions())
    svc = children.build_service(OWNER)
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert naming.gateway_url("m", "ns") == f"http://{svc['metadata']['name']}.ns.svc:8000"
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    # a spec change must not restart the gateway: the pod template carries no hash
    other = children.build_gateway_deployment(_sdd(kvCache={"pageSize": 4}), OWNER, ChildOptions())
    assert other["spec"]["template"] == deploy["spec"]["template"]


def test_an_autoscaled_raycluster_lets_the_ray_autoscaler_size_its_workers():
    """With spec.autoscaling the worker group spans [minReplicas, maxReplicas + 1] (the
    surge pod of a rolling update), KubeRay's in-tree autoscaler is on, and the
    operator keeps the live worker count when it patches the cluster."""
    sdd = _sdd(replicas=9, autoscaling={"minReplicas": 2, "maxReplicas": 4})
    rc = children.build_raycluster(sdd, OWNER, ChildOptions())
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    assert rc["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (2, 4, 5)

    live = {"spec": {"workerGroupSpecs": [{**group, "replicas": 3}]}}
    kept = children.autoscaled_workers(rc, live)
    assert kept["spec"]["workerGroupSpecs"][0]["replicas"] == 3
    assert rc["spec"]["workerGroupSpecs"][0]["replicas"] == 4  # the desired copy untouched

    fixed = children.build_raycluster(_sdd(replicas=2), OWNER, ChildOptions())
    assert "enableInTreeAutoscaling" not in fixed["spec"]
    assert children.autoscaled_workers(fixed, live) is fixed  # the operator sizes it
    (group,) = fixed["spec"]["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (0, 3, 3)


def test_api_keys_come_from_the_secret_as_a_file_and_probes_stay_open():
    """``spec.auth.apiKeySecret``: the Secret's key is mounted as a file the gateway reads
    (so a rotated Secret applies without a restart), and the probes use the open
    ``/version`` (``/v1`` needs a key).  Turning keys on changes the pod (a restart);
    without them the pod mounts no Secret but its admin token's."""
    plain = children.build_gateway_deployment(_sdd(), OWNER, ChildOptions())
    keyed = children.build_gateway_deployment(
        _sdd(auth={"apiKeySecret": {"name": "llm-keys", "key": "tokens"}}), OWNER, ChildOptions()
    )
    (container,) = keyed["spec"]["template"]["spec"]["containers"]
    path = f"{naming.API_KEYS_DIR}/{naming.API_KEYS_FILE}"
    assert {"name": "SPECD_API_KEY_FILE", "value": path} in container["env"]
    assert {"name": "api-keys", "mountPath": naming.API_KEYS_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    secret = {"secretName": "llm-keys", "items": [{"key": "tokens", "path": naming.API_KEYS_FILE}]}
    assert {"name": "api-keys", "secret": secret} in keyed["spec"]["template"]["spec"]["volumes"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/version"
    (bare,) = plain["spec"]["template"]["spec"]["containers"]
    assert [e["name"] for e in bare["env"]] == ["SPECD_ADMIN_TOKEN_FILE"]
    volumes = plain["spec"]["template"]["spec"]["volumes"]
    assert [v["secret"]["secretName"] for v in volumes if "secret" in v] == ["m-admin-token"]


def test_the_admin_token_comes_from_the_sdds_secret_as_a_file_never_the_uid():
    """The gateway reads its admin token from a file mounted from the SDD's own Secret
    (random, owned by the SDD); the SDD's uid, readable by anyone who can read the SDD,
    appears nowhere in the pod."""
    secret = children.build_admin_secret(OWNER, "t0ken")
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "m-admin-token"
    assert secret["metadata"]["ownerReferences"] == [OWNER.reference()]
    assert children.admin_token_of(secret) == "t0ken" and "t0ken" not in json.dumps(secret)
    assert children.admin_token_of({"data": {}}) is None
    keyed, external = {"apiKeySecret": {"name": "llm-keys"}}, {"address": "r:6379"}
    for sdd in (_sdd(), _sdd(auth=keyed), _sdd(ray=external)):
        pod = children.build_gateway_deployment(sdd, OWNER, ChildOptions())["spec"]["template"]
        assert OWNER.uid not in json.dumps(pod)
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert "SPECD_ADMIN_TOKEN" not in env
        assert env["SPECD_ADMIN_TOKEN_FILE"] == f"{naming.ADMIN_TOKEN_DIR}/token"
        mount = {"name": "admin-token", "mountPath": naming.ADMIN_TOKEN_DIR, "readOnly": True}
        assert mount in container["volumeMounts"]
        items = [{"key": "token", "path": "token"}]
        volume = {"name": "admin-token", "secret": {"secretName": "m-admin-token", "items": items}}
        assert volume in pod["spec"]["volumes"]
