"""The Helm chart: renders for a matrix of values, lints clean, refuses bad values, and
every manifest validates (built-in kinds strictly, custom kinds against their CRDs)."""

from __future__ import annotations

import io
import json
import tomllib
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[1] / "specd"
REPO = CHART.parents[1]
NAMESPACE = "specd-system"

MATRIX: dict[str, dict[str, Any]] = {
    "defaults": {},
    "monitoring-on": {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "prometheusRule": {"enabled": True},
        }
    },
    "one-namespace": {"watch": {"namespaces": ["llm"]}},
    "namespace-list": {"watch": {"namespaces": ["llm-a", "llm-b"]}},
    "all-namespaces": {"watch": {"allNamespaces": True}},
    "all-namespaces-ha": {"watch": {"allNamespaces": True}, "replicaCount": 3},
    "namespaced-ha": {"watch": {"namespaces": ["llm-a", "llm-b"]}, "replicaCount": 2},
    "peering-one-replica": {"peering": {"enabled": True, "priority": 10}},
    "dashboards-off": {"dashboards": {"enabled": False}},
    "no-rbac-no-sa": {"rbac": {"create": False}, "serviceAccount": {"create": False}},
    "no-cluster-observation": {"rbac": {"observeCluster": False}},
    "overrides": {
        "fullnameOverride": "llm-operator",
        "image": {"repository": "registry.local/specd", "tag": "dev", "pullPolicy": "Always"},
        "workloadImage": {"repository": "registry.local/specd-gpu", "tag": "dev"},
        "imagePullSecrets": [{"name": "regcred"}],
        "operator": {
            "pollInterval": 2.5,
            "metricsPort": 9100,
            "rayVersion": "2.50.1",
            "extraArgs": ["--x=1"],
        },
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
        "podAnnotations": {"a": "b"},
        "metricsService": {"type": "NodePort", "port": 9100},
    },
}


def operator(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (workload,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    return workload


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (only,) = operator(docs)["spec"]["template"]["spec"]["containers"]
    return only


def test_app_version_is_the_package_version():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == project["version"]
    assert chart["apiVersion"] == "v2"


@pytest.mark.parametrize("case", MATRIX)
def test_renders_and_validates(case, render, validate_doc):
    docs = render(MATRIX[case])
    assert docs
    for doc in docs:
        validate_doc(doc)
    names = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two objects with one name"


@pytest.mark.parametrize("case", ["defaults", "monitoring-on", "all-namespaces-ha"])
def test_lint_strict_is_clean(case):
    report = helm.lint(CHART, MATRIX[case], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


def test_dry_run_install(chart):
    """`helm install --dry-run=client`: the whole install path, no cluster contacted."""
    kubeconfig = yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:1"}}],
            "users": [{"name": "none", "user": {"token": "unused"}}],
            "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
            "current-context": "none",
        }
    )
    with helm.Config(kubeconfig_content=kubeconfig, storage_driver="memory") as cfg:
        release = cfg.install(
            chart, "specd", MATRIX["monitoring-on"], namespace=NAMESPACE, dry_run="client"
        )
    kinds = {d["kind"] for d in yaml.safe_load_all(release["manifest"]) if d}
    assert {"Deployment", "ServiceAccount", "Role", "PrometheusRule", "ServiceMonitor"} <= kinds
    assert "kubectl -n specd-system get sdd" in release["notes"]


# --- the operator workload -------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "scope"),
    [
        ("defaults", ["--namespace=specd-system"]),
        ("one-namespace", ["--namespace=llm"]),
        ("namespace-list", ["--namespace=llm-a", "--namespace=llm-b"]),
        ("all-namespaces", ["--all-namespaces"]),
    ],
)
def test_watch_scope_flags(case, scope, render):
    args = container(render(MATRIX[case]))["args"]
    assert [a for a in args if a.startswith(("--namespace", "--all-namespaces"))] == scope


def test_operator_flags_match_the_cli(render):
    """Every flag the chart passes is one `specd operator` accepts, with its values."""
    from specd.workers.cli import build_parser

    for case in MATRIX:
        c = container(render(MATRIX[case]))
        assert c["command"] == ["specd", "operator"]
        args = [a for a in c["args"] if a != "--x=1"]
        args = [a.replace("$(SPECD_PEERING_PRIORITY)", "1") for a in args]
        parsed = build_parser().parse_args(["operator", *args])
        assert parsed.metrics_port == c["ports"][0]["containerPort"]
        health = next(p for p in c["ports"] if p["name"] == "health")["containerPort"]
        assert parsed.liveness == f"http://0.0.0.0:{health}/healthz"


def test_defaults_single_replica_standalone(render):
    docs = render({})
    workload = operator(docs)
    assert workload["kind"] == "Deployment"
    assert workload["spec"]["strategy"] == {"type": "Recreate"}
    c = container(docs)
    assert "--standalone" in c["args"]
    assert "--image=ghcr.io/specd/specd:0.1.0" in c["args"]
    # rayVersion defaults to the operator's own: the Ray installed in the same image
    assert not [a for a in c["args"] if a.startswith("--ray-version")]
    overridden = container(render(MATRIX["overrides"]))["args"]
    assert "--ray-version=2.50.1" in overridden
    assert not [d for d in docs if d["kind"] in ("KopfPeering", "ClusterKopfPeering")]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 9090, "health": 8080}


def test_security_context(render):
    docs = render({})
    pod = operator(docs)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(docs)["securityContext"]
    assert sc == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in container(docs)["volumeMounts"]


@pytest.mark.parametrize(
    ("case", "kind", "namespaces"),
    [
        ("all-namespaces-ha", "ClusterKopfPeering", [None]),
        ("namespaced-ha", "KopfPeering", ["llm-a", "llm-b"]),
        ("peering-one-replica", "KopfPeering", [NAMESPACE]),
    ],
)
def test_peering(case, kind, namespaces, render):
    """Peering object `specd` (main.PEERING_NAME) where kopf looks for it; with several
    replicas each pod's priority is its index (kopf pauses equal priorities)."""
    from specd.operator.main import PEERING_NAME

    docs = render(MATRIX[case])
    peerings = [d for d in docs if d["kind"] in ("KopfPeering", "ClusterKopfPeering")]
    assert {d["kind"] for d in peerings} == {kind}
    assert [d["metadata"].get("namespace") for d in peerings] == namespaces
    assert {d["metadata"]["name"] for d in peerings} == {PEERING_NAME}
    c = container(docs)
    assert "--standalone" not in c["args"]
    if MATRIX[case].get("replicaCount", 1) > 1:
        assert operator(docs)["kind"] == "StatefulSet"
        assert "--priority=$(SPECD_PEERING_PRIORITY)" in c["args"]
        env = {e["name"]: e for e in c["env"]}
        field = env["SPECD_PEERING_PRIORITY"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == "metadata.labels['apps.kubernetes.io/pod-index']"
    else:
        assert "--priority=10" in c["args"]


def test_metrics_service_and_service_monitor(render):
    docs = render(MATRIX["monitoring-on"])
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    pod_labels = operator(docs)["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert not [d for d in render({}) if d["kind"] in ("ServiceMonitor", "PrometheusRule")]


# --- values.schema.json ----------------------------------------------------------------

BAD_VALUES = [
    ({"replicaCount": -1}, "/replicaCount"),
    ({"replicaCount": 0}, "/replicaCount"),
    ({"replicaCount": "2"}, "/replicaCount"),
    ({"colour": "blue"}, "colour"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"watch": {"allNamespaces": "yes"}}, "/watch/allNamespaces"),
    ({"watch": {"namespaces": "llm"}}, "/watch/namespaces"),
    ({"watch": {"namespaces": ["Not_A_Namespace"]}}, "/watch/namespaces/0"),
    ({"operator": {"metricsPort": 70000}}, "/operator/metricsPort"),
    ({"operator": {"pollInterval": 0}}, "/operator/pollInterval"),
    ({"operator": {"verbose": True}}, "verbose"),
    ({"metricsService": {"type": "ExternalName"}}, "/metricsService/type"),
    (
        {"monitoring": {"serviceMonitor": {"interval": "soon"}}},
        "/monitoring/serviceMonitor/interval",
    ),
    ({"monitoring": {"prometheusRule": {"enabled": "true"}}}, "/monitoring/prometheusRule/enabled"),
    ({"dashboards": {"labelValue": 1}}, "/dashboards/labelValue"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
    ({"peering": {"priority": 1.5}}, "/peering/priority"),
]


@pytest.mark.parametrize(("values", "field"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_schema_rejects_bad_values(values, field, chart):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert field in str(err.value)
    with pytest.raises(helm.HelmValuesError):  # `helm template` refuses them too
        chart.render(values, name="specd", namespace=NAMESPACE)


def test_schema_accepts_the_matrix_and_is_draft_07(chart):
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)
    for values in MATRIX.values():
        chart.validate_schema(values)


def test_kubernetes_validate_is_strict():
    """The validator this file relies on does refuse an unknown field."""
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"prots": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.28.0", strict=True)


# --- CRDs -----------------------------------------------------------------------------


def test_crds_ship_and_validate(chart, validate_doc):
    files = {c["filename"] for c in chart.crds}
    assert files == {"specd/crds/specdecodedeployments.yaml", "specd/crds/kopfpeerings.yaml"}
    crds = [
        d
        for f in sorted((CHART / "crds").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
    ]
    for crd in crds:
        validate_doc(crd)
    scopes = {crd["spec"]["names"]["kind"]: crd["spec"]["scope"] for crd in crds}
    assert scopes == {
        "SpecDecodeDeployment": "Namespaced",
        "KopfPeering": "Namespaced",
        "ClusterKopfPeering": "Cluster",
    }


def test_specd_crd_prints_the_chart_crd():
    """The documented CRD upgrade (`specd crd | kubectl apply --server-side -f -`)
    applies exactly what the chart installs."""
    from specd.workers.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["crd"]) == 0
    assert out.getvalue() == (CHART / "crds/specdecodedeployments.yaml").read_text()


def test_readme_documents_the_crd_upgrade():
    readme = (CHART / "README.md").read_text()
    assert "specd crd | kubectl apply --server-side -f -" in readme
