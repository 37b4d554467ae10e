"""The chart's RBAC grants exactly the permissions in `specd.operator.rbac`: nothing
missing (the operator would get 403s), nothing extra (least privilege)."""

from __future__ import annotations

import pytest

from specd.operator import kube, rbac

NAMESPACE = "specd-system"

CASES = {
    "namespaced": ({}, False, [NAMESPACE]),
    "namespace-list-ha": (
        {"watch": {"namespaces": ["a", "b"]}, "replicaCount": 2},
        False,
        ["a", "b"],
    ),
    "all-namespaces": ({"watch": {"allNamespaces": True}}, True, []),
    "all-namespaces-peering": (
        {"watch": {"allNamespaces": True}, "peering": {"enabled": True}},
        True,
        [],
    ),
    "no-cluster-observation": ({"rbac": {"observeCluster": False}}, False, [NAMESPACE]),
    "all-namespaces-no-observation": (
        {"watch": {"allNamespaces": True}, "rbac": {"observeCluster": False}},
        True,
        [],
    ),
}


def granted(role: dict) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("case", CASES)
def test_rules_are_exactly_the_operator_table(case, render, kinds):
    values, all_namespaces, namespaces = CASES[case]
    docs = render(values)
    want = rbac.grant(
        all_namespaces=all_namespaces,
        peering=bool(values.get("peering", {}).get("enabled") or values.get("replicaCount", 1) > 1),
        observe=values.get("rbac", {}).get("observeCluster", True),
    )
    roles = kinds(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces)
    for role in roles:
        assert granted(role) == rbac.triples(want.per_namespace)
    cluster = kinds(docs, "ClusterRole")
    assert set().union(*map(granted, cluster)) == rbac.triples(want.cluster)
    for role in roles + cluster:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert "nonResourceURLs" not in rule and "resourceNames" not in rule


@pytest.mark.parametrize("case", CASES)
def test_bindings_point_at_the_roles_and_the_service_account(case, render, kinds):
    docs = render(CASES[case][0])
    (sa,) = kinds(docs, "ServiceAccount")
    (workload,) = kinds(docs, "Deployment") + kinds(docs, "StatefulSet")
    assert workload["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    roles = {
        (r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"])
        for r in kinds(docs, "Role") + kinds(docs, "ClusterRole")
    }
    bindings = kinds(docs, "RoleBinding") + kinds(docs, "ClusterRoleBinding")
    assert len(bindings) == len(roles)
    for b in bindings:
        ns = b["metadata"].get("namespace")
        assert (b["roleRef"]["kind"], ns, b["roleRef"]["name"]) in roles
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
        ]


def test_rbac_off_renders_no_roles(render):
    docs = render({"rbac": {"create": False}})
    assert not [d for d in docs if d["kind"].endswith(("Role", "RoleBinding"))]


def test_table_covers_every_kind_the_client_writes():
    """Every resource `KubeClient` can address has get/create/patch in the table
    (Events: create only, the client only posts them; Secrets: get and create only,
    the admin token is never patched)."""
    table = {p.resource: set(p.verbs) for p in rbac.NAMESPACED}
    assert table["events"] == {"create"}
    assert table["secrets"] == {"get", "create"}
    for plural in set(kube.PLURALS.values()) - {"events", "secrets"}:
        assert plural in table, plural
        assert {"get", "patch"} <= table[plural]
    children = set(kube.PLURALS.values()) - {"specdecodedeployments", "events"}
    for plural in children:
        assert "create" in table[plural]
    assert table["specdecodedeployments/status"] == {"patch"}
