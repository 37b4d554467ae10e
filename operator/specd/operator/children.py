"""Desired child objects of a SpecDecodeDeployment, as plain dicts (pure builders).

    SDD ──owns──> ConfigMap   <name>-config    the resolved engine config + its hash
        ──owns──> Secret      <name>-admin-token  the gateway's admin token (random, made
                                               once, never rotated; mounted as a file)
        ──owns──> RayCluster  <name>-ray       head (no actors) + GPU "engine" workers;
                                               absent when spec.ray.address is set
        ──owns──> Deployment  <name>-gateway   one pod: joins Ray as a 0-CPU/0-GPU node,
                                               runs `specd gateway --config <mounted file>`
        ──owns──> Service     <name>-gateway   port 8000 (OpenAI API, /metrics, /admin/status)
        ──owns──> ServiceMonitor <name>-gateway   when spec.metrics.serviceMonitor

The gateway re-reads the mounted ConfigMap when it changes and rolls its actors one
at a time, so the gateway pod template never carries the config hash: a spec change
must not restart the gateway (serving would pause while it restarts).  A gateway pod
that stops leaves its actors running for the next one, which adopts them.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import yaml

from specd.operator import naming
from specd.workers.config import (
    ADMIN_TOKEN_FILE_ENV,
    API_GROUP,
    API_KEY_FILE_ENV,
    API_VERSION,
    KIND,
    SpecDecodeDeployment,
)

GATEWAY_GRACE_S = 45  # pod termination grace: the gateway's 30 s request drain + margin
WORKER_IDLE_TIMEOUT_S = 60  # autoscaled Ray workers with no actor leave after this
GPU = "nvidia.com/gpu"  # the extended resource a worker pod's GPUs are limits of


@dataclass(frozen=True, slots=True)
class Owner:
    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True, slots=True)
class ChildOptions:
    """Operator-wide settings (``specd operator`` flags)."""

    image: str = f"ghcr.io/specd/specd:{version('specd')}"
    ray_version: str = version("ray")  # the Ray inside that image: the one installed here
    gateway_cpu: str = "1"
    gateway_memory: str = "2Gi"


def _meta(owner: Owner, name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": naming.labels(owner.name, component),
        "ownerReferences": [owner.reference()],
        **extra,
    }


def engine_config_document(sdd: SpecDecodeDeployment) -> dict[str, Any]:
    """The file the gateway loads: the validated spec with defaults filled in."""
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": sdd.metadata.name, "namespace": sdd.metadata.namespace},
        "spec": sdd.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def build_configmap(sdd: SpecDecodeDeployment, owner: Owner) -> dict[str, Any]:
    config_hash = sdd.spec.config_hash()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            owner,
            naming.configmap_name(owner.name),
            "config",
            annotations={naming.CONFIG_HASH_ANNOTATION: config_hash},
        ),
        "data": {
            naming.CONFIG_FILE: yaml.safe_dump(engine_config_document(sdd), sort_keys=False),
            naming.CONFIG_HASH_KEY: config_hash,
        },
    }


def build_admin_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The Secret holding the gateway's admin token (``POST /admin/*``).  The caller
    draws ``token`` at random and creates this only when it is absent: the token is
    never rotated by a reconcile, and the SDD's uid never stands in for it."""
    encoded = base64.b64encode(token.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(owner, naming.admin_secret_name(owner.name), "gateway"),
        "type": "Opaque",
        "data": {naming.ADMIN_TOKEN_KEY: encoded},
    }


def admin_token_of(secret: dict[str, Any]) -> str | None:
    """The token in a live admin Secret (None if it holds none)."""
    encoded = (secret.get("data") or {}).get(naming.ADMIN_TOKEN_KEY)
    if not encoded:
        return None
    return base64.b64decode(encoded).decode().strip() or None


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` laid over ``base``: dicts merge, anything else (lists too) replaces."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _quantity(value: float) -> str:
    return f"{value:g}"


def build_raycluster(
    sdd: SpecDecodeDeployment, owner: Owner, options: ChildOptions
) -> dict[str, Any]:
    """A KubeRay RayCluster: a head that runs no actors and one worker pod per replica.

    Each worker pod gets ``ceil(resources.gpus)`` GPUs and the replica's CPU/memory;
    ``resources.gpus`` equals ``parallelism.tensor`` on GPUs (`DeploymentSpec`'s rule),
    so one pod holds all of a replica's ranks (one GPU each, one node).
    The group holds ``replicas + 1`` pods: the pool rolls a config change with one
    surge actor, which must find a free GPU.  With ``spec.autoscaling`` the Ray
    autoscaler sizes the group instead (KubeRay's in-tree autoscaling): pods start for
    actors the gateway's autoscaler asks for and that find no room, between
    ``minReplicas`` and ``maxReplicas + 1``, and idle ones leave after a minute; the
    operator then leaves the group's live ``replicas`` alone (`autoscaled_workers`).
    ``spec.ray.cluster`` is merged over the result (dicts merge, lists replace).
    """
    spec = sdd.spec
    res = spec.resources
    gpus = math.ceil(res.gpus)
    image = spec.image or options.image
    limits: dict[str, str] = {"cpu": _quantity(res.cpu)}
    if res.memory:
        limits["memory"] = res.memory
    if gpus:
        limits[GPU] = str(gpus)
    workers = spec.replicas + 1 if spec.replicas else 0
    fewest, most = 0, max(workers, 1)
    if spec.autoscaling is not None:
        workers = spec.autoscaling.clamp(spec.replicas)
        fewest, most = spec.autoscaling.min_replicas, spec.autoscaling.max_replicas + 1
    worker_labels = naming.labels(owner.name, "engine")
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _meta(owner, naming.raycluster_name(owner.name), "ray"),
        "spec": {
            "rayVersion": options.ray_version,
            "headGroupSpec": {
                "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
                "template": {
                    "metadata": {"labels": naming.labels(owner.name, "ray-head")},
                    "spec": {
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": image,
                                "ports": [
                                    {"name": "gcs", "containerPort": naming.RAY_GCS_PORT},
                                    {"name": "dashboard", "containerPort": 8265},
                                ],
                                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
                            }
                        ]
                    },
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": "engine",
                    "replicas": workers,
                    "minReplicas": fewest,
                    "maxReplicas": most,
                    "rayStartParams": {
                        "num-cpus": _quantity(res.cpu),
                        "num-gpus": str(gpus),
                    },
                    "template": {
                        "metadata": {"labels": worker_labels},
                        "spec": {
                            "containers": [
                                {
                                    "name": "ray-worker",
                                    "image": image,
                                    "resources": {"limits": limits, "requests": dict(limits)},
                                }
                            ]
                        },
                    },
                }
            ],
        },
    }
    if spec.autoscaling is not None:
        cluster["spec"]["enableInTreeAutoscaling"] = True
        cluster["spec"]["autoscalerOptions"] = {
            "upscalingMode": "Default",
            "idleTimeoutSeconds": WORKER_IDLE_TIMEOUT_S,
        }
    if spec.ray.cluster:
        cluster["spec"] = deep_merge(cluster["spec"], spec.ray.cluster)
    return cluster


def _count(value: Any) -> int | None:
    """A GPU count as rayStartParams or a resource quantity writes it ("4", 4)."""
    try:
        return int(float(str(value)))
    except (ValueError, OverflowError):
        return None


def _group_gpus(group: dict[str, Any]) -> int | None:
    """One worker group's GPUs per pod: ``rayStartParams.num-gpus``, else the
    containers' ``nvidia.com/gpu`` limits (what KubeRay passes to ``ray start``)."""
    param = (group.get("rayStartParams") or {}).get("num-gpus")
    if param is not None:
        return _count(param)
    containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
    limits = [((c.get("resources") or {}).get("limits") or {}).get(GPU) for c in containers]
    counts = [n for limit in limits if limit is not None and (n := _count(limit)) is not None]
    return sum(counts) if counts else None


def worker_gpus(cluster: dict[str, Any]) -> int | None:
    """GPUs of each Ray worker pod of a RayCluster (``spec.ray.cluster`` merged in):
    the largest over its worker groups, or None when no group says."""
    groups = cluster.get("spec", {}).get("workerGroupSpecs") or []
    counts = [n for g in groups if (n := _group_gpus(g)) is not None]
    return max(counts) if counts else None


def tensor_exceeds_workers(sdd: SpecDecodeDeployment, cluster: dict[str, Any]) -> str | None:
    """Why ``cluster``'s worker pods cannot hold one replica's ranks (all on one node,
    one GPU each), or None.  CPU specs (``resources.gpus`` 0) need no GPU."""
    tensor = sdd.spec.parallelism.tensor
    gpus = worker_gpus(cluster)
    if sdd.spec.resources.gpus == 0 or gpus is None or gpus >= tensor:
        return None
    return (
        f"spec.parallelism.tensor {tensor} exceeds the {gpus} GPUs of each Ray worker "
        "(spec.ray.cluster workerGroupSpecs: num-gpus or nvidia.com/gpu): a replica's "
        f"ranks must fit on one worker pod; give the workers {tensor} GPUs, or lower "
        "spec.parallelism.tensor"
    )


def autoscaled_workers(desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """``desired`` RayCluster with the live worker counts where the Ray autoscaler sizes
    the groups (patching them back would undo its decisions)."""
    if not desired["spec"].get("enableInTreeAutoscaling"):
        return desired
    counts = {
        group.get("groupName"): group.get("replicas")
        for group in live.get("spec", {}).get("workerGroupSpecs", [])
    }
    groups = [
        group
        if counts.get(group.get("groupName")) is None
        else {**group, "replicas": counts[group.get("groupName")]}
        for group in desired["spec"].get("workerGroupSpecs", [])
    ]
    return {**desired, "spec": {**desired["spec"], "workerGroupSpecs": groups}}


def gateway_command(ray_address: str) -> list[str]:
    """Join Ray as a node that takes no actors, then run the gateway (a local driver)."""
    config = f"{naming.CONFIG_DIR}/{naming.CONFIG_FILE}"
    script = (
        f"ray start --address={ray_address} --num-cpus=0 --num-gpus=0 && "
        f"RAY_ADDRESS=auto exec specd gateway --config {config} "
        f"--host 0.0.0.0 --port {naming.GATEWAY_PORT}"
    )
    return ["/bin/sh", "-c", script]


def build_gateway_deployment(
    sdd: SpecDecodeDeployment, owner: Owner, options: ChildOptions
) -> dict[str, Any]:
    """One gateway pod (Recreate: two drivers would each start a full actor pool)."""
    spec = sdd.spec
    address = spec.ray.address or naming.ray_head_address(owner.name, owner.namespace)
    probe = {"httpGet": {"path": "/version", "port": "http"}, "periodSeconds": 10}  # open
    # the admin token (POST /admin/release: the delete finalizer's call), as a file
    admin_file = f"{naming.ADMIN_TOKEN_DIR}/{naming.ADMIN_TOKEN_KEY}"
    env = [{"name": ADMIN_TOKEN_FILE_ENV, "value": admin_file}]
    mounts = [
        {"name": "config", "mountPath": naming.CONFIG_DIR},
        {"name": "admin-token", "mountPath": naming.ADMIN_TOKEN_DIR, "readOnly": True},
    ]
    admin_items = [{"key": naming.ADMIN_TOKEN_KEY, "path": naming.ADMIN_TOKEN_KEY}]
    admin_secret = {"secretName": naming.admin_secret_name(owner.name), "items": admin_items}
    volumes = [
        {"name": "config", "configMap": {"name": naming.configmap_name(owner.name)}},
        {"name": "admin-token", "secret": admin_secret},
    ]
    if (secret := spec.auth.api_key_secret) is not None:  # a volume: key changes go live
        keys_file = f"{naming.API_KEYS_DIR}/{naming.API_KEYS_FILE}"
        env.append({"name": API_KEY_FILE_ENV, "value": keys_file})
        mounts.append({"name": "api-keys", "mountPath": naming.API_KEYS_DIR, "readOnly": True})
        items = [{"key": secret.key, "path": naming.API_KEYS_FILE}]
        volumes.append({"name": "api-keys", "secret": {"secretName": secret.name, "items": items}})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, naming.gateway_name(owner.name), "gateway"),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": naming.selector_labels(owner.name, "gateway")},
            "template": {
                "metadata": {"labels": naming.labels(owner.name, "gateway")},
                "spec": {
                    "containers": [
                        {
                            "name": "gateway",
                            "image": spec.image or options.image,
                            "command": gateway_command(address),
                            "ports": [{"name": "http", "containerPort": naming.GATEWAY_PORT}],
                            "env": env,
                            "readinessProbe": probe,
                            "livenessProbe": {**probe, "failureThreshold": 6},
                            "resources": {
                                "requests": {
                                    "cpu": options.gateway_cpu,
                                    "memory": options.gateway_memory,
                                }
                            },
                            "volumeMounts": mounts,
                        }
                    ],
                    # open requests get the gateway's 30 s drain, then it detaches
                    "terminationGracePeriodSeconds": GATEWAY_GRACE_S,
                    "volumes": volumes,
                },
            },
        },
    }


def build_service(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, naming.gateway_name(owner.name), "gateway"),
        "spec": {
            "selector": naming.selector_labels(owner.name, "gateway"),
            "ports": [
                {"name": "http", "port": naming.GATEWAY_PORT, "targetPort": "http"},
            ],
        },
    }


def _prometheus_label(service_label: str) -> str:
    """The meta label Prometheus' Kubernetes discovery gives a Service label."""
    return "__meta_kubernetes_service_label_" + "".join(
        c if c.isalnum() else "_" for c in service_label
    )


def build_servicemonitor(sdd: SpecDecodeDeployment, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(owner, naming.gateway_name(owner.name), "gateway"),
        "spec": {
            "selector": {"matchLabels": naming.selector_labels(owner.name, "gateway")},
            "endpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": sdd.spec.metrics.interval,
                    # the dashboards' and alerts' `deployment` label (`up` included)
                    "relabelings": [
                        {
                            "sourceLabels": [_prometheus_label(naming.DEPLOYMENT_LABEL)],
                            "targetLabel": "deployment",
                        }
                    ],
                }
            ],
        },
    }
