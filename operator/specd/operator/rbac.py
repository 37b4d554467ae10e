"""Every API permission the operator uses: the table the chart's RBAC is checked against.

Read from the code, not guessed.  `kube.KubeClient` calls get / create / merge-patch
(``patch``) / delete on the children and patches ``specdecodedeployments/status``; the
admin token Secret is only got and created (`reconcile.ensure_admin_secret`: never
patched, so never rotated);
kopf lists, watches and patches the SDDs (finalizer, progress annotations); kopf and
`kube.KubeClient.post_event` post core/v1 Events.  Peering (`main.PEERING_NAME`) lists, watches and patches
``KopfPeering`` objects in every watched namespace, or the ``ClusterKopfPeering``
when watching all namespaces, and the status poller (`poller.leads`) gets them; kopf
never creates them (the chart does).  kopf's
cluster observation lists and watches CRDs, and namespaces too when it serves named
namespaces; without those permissions it logs a warning and works from its startup
scan.  API discovery (``GET /apis/<group>/<version>``, used by kopf's scan and by
`kube.KubeClient.served`) is a non-resource URL that Kubernetes' default
``system:discovery`` role grants to every authenticated user, so no rule names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.workers.config import API_GROUP


@dataclass(frozen=True, slots=True)
class Permission:
    group: str  # "" is the core API group
    resource: str
    verbs: tuple[str, ...]
    why: str


# Granted in each watched namespace (a Role), or cluster-wide with --all-namespaces.
NAMESPACED: tuple[Permission, ...] = (
    Permission(
        API_GROUP,
        "specdecodedeployments",
        ("get", "list", "watch", "patch"),
        "kopf watches and patches (finalizer, annotations); status writes re-read on 409",
    ),
    Permission(API_GROUP, "specdecodedeployments/status", ("patch",), "the status writer"),
    Permission("", "events", ("create",), "kopf.info / kopf.warn and handler errors"),
    Permission("", "configmaps", ("get", "create", "patch"), "ensure: engine config"),
    Permission(
        "",
        "secrets",
        ("get", "create"),
        "the gateway's admin token: created once per SDD, read for /admin/release",
    ),
    Permission("", "services", ("get", "create", "patch"), "ensure: gateway Service"),
    Permission(
        "apps",
        "deployments",
        ("get", "create", "patch", "delete"),
        "ensure: gateway; delete releases an external Ray cluster's actors",
    ),
    Permission("ray.io", "rayclusters", ("get", "create", "patch"), "ensure: managed Ray"),
    Permission(
        "monitoring.coreos.com",
        "servicemonitors",
        ("get", "create", "patch"),
        "ensure: spec.metrics.serviceMonitor",
    ),
)

PEERING_NAMESPACED = Permission(
    "kopf.dev",
    "kopfpeerings",
    ("get", "list", "watch", "patch"),
    "peering keep-alives per namespace; the status poller reads who leads",
)
PEERING_CLUSTER = Permission(
    "kopf.dev",
    "clusterkopfpeerings",
    ("get", "list", "watch", "patch"),
    "cluster-wide peering; the status poller reads who leads",
)
OBSERVE_CRDS = Permission(
    "apiextensions.k8s.io",
    "customresourcedefinitions",
    ("list", "watch"),
    "kopf notices CRDs added or changed after start",
)
OBSERVE_NAMESPACES = Permission(
    "", "namespaces", ("list", "watch"), "kopf notices watched namespaces appear (named mode)"
)


@dataclass(frozen=True, slots=True)
class Grant:
    """What one operator deployment needs, split by where it is granted."""

    per_namespace: tuple[Permission, ...]  # a Role in each watched namespace
    cluster: tuple[Permission, ...]  # one ClusterRole


def grant(*, all_namespaces: bool, peering: bool, observe: bool = True) -> Grant:
    """The permissions of ``specd operator`` run with these settings."""
    if all_namespaces:
        cluster = NAMESPACED + ((PEERING_CLUSTER,) if peering else ())
        return Grant((), cluster + ((OBSERVE_CRDS,) if observe else ()))
    per_namespace = NAMESPACED + ((PEERING_NAMESPACED,) if peering else ())
    return Grant(per_namespace, (OBSERVE_CRDS, OBSERVE_NAMESPACES) if observe else ())


def triples(permissions: tuple[Permission, ...]) -> set[tuple[str, str, str]]:
    """``{(group, resource, verb)}``: the form the chart test compares."""
    return {(p.group, p.resource, v) for p in permissions for v in p.verbs}
