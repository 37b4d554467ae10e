"""Fixtures for the chart tests.

Render the chart with Helm's own engine (helm-python-sdk) and validate what comes out.

Everything is offline: built-in kinds validate against kubernetes-validate's bundled
schemas, custom kinds against the CRD schemas in this repository (charts/specd/crds)
or vendored under charts/tests/schemas.

The dashboards and rules as PromQL queries (with Grafana's variables set), and promtool.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

CHARTS = Path(__file__).resolve().parents[1]
CHART = CHARTS / "specd"
REPO = CHARTS.parent
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE = "specd"
NAMESPACE = "specd-system"
# the chart's kubeVersion floor and the newest schemas kubernetes-validate bundles
KUBE_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version())

Doc = dict[str, Any]


def strict_schema(node: Any) -> Any:
    """A CRD schema that refuses unknown fields, like ``kubectl apply --validate=strict``
    (the API server would prune them silently; a typo in the chart should fail here)."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _with_object_meta(schema: dict[str, Any]) -> dict[str, Any]:
    """The API server implies apiVersion, kind and metadata at a CRD schema's root."""
    implied = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}
    implied["metadata"] = {"type": "object"}
    return {**schema, "properties": {**implied, **schema.get("properties", {})}}


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """``(apiVersion, kind) -> openAPIV3Schema`` of every CRD the chart ships or targets."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = _with_object_meta(version["schema"]["openAPIV3Schema"])
    for kind in ("ServiceMonitor", "PrometheusRule"):
        path = SCHEMAS / f"{kind.lower()}s.monitoring.coreos.com.yaml"
        schemas[("monitoring.coreos.com/v1", kind)] = yaml.safe_load(path.read_text())
    return schemas


CRD_SCHEMAS = _crd_schemas()


def validate(doc: Doc) -> None:
    """Built-in kinds: kubernetes-validate strict at every `KUBE_VERSIONS`; custom kinds:
    their CRD's openAPIV3Schema made strict (an approximation of admission: no CEL,
    no defaulting).  An unknown kind fails (kubernetes-validate raises)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.Draft7Validator(strict_schema(CRD_SCHEMAS[key])).validate(doc)
        return
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def documents(rendered: dict[str, str]) -> list[Doc]:
    """Every manifest `helm template` would print (NOTES.txt and empty files aside)."""
    docs: list[Doc] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: helm.Chart) -> Callable[..., list[Doc]]:
    def _render(values: dict[str, Any] | None = None, **kw: Any) -> list[Doc]:
        kw.setdefault("name", RELEASE)
        kw.setdefault("namespace", NAMESPACE)
        return documents(chart.render(copy.deepcopy(values) or {}, **kw))

    return _render


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    """A scratch copy of the chart, for tests that change its files."""
    return Path(shutil.copytree(CHART, tmp_path / "specd"))


def by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="session")
def kinds() -> Callable[[list[Doc], str], list[Doc]]:
    return by_kind


@pytest.fixture(scope="session")
def validate_doc() -> Callable[[Doc], None]:
    return validate


# -- dashboards and alert rules ----------------------------------------------
DASHBOARDS = CHART / "dashboards"
RULES = CHART / "rules" / "specd-alerts.yaml"

# Concrete values for Grafana's variables, so each query is plain PromQL
GRAFANA_VALUES = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
    "deployment": ".*",
    "replica": ".*",
}


@pytest.fixture(scope="session")
def substitute():
    """expr -> expr with Grafana's variables (``$x``, ``${x}``) set; an unknown one raises."""
    return lambda expr: re.sub(r"\$\{?(\w+)\}?", lambda m: GRAFANA_VALUES[m.group(1)], expr)


@pytest.fixture(scope="session")
def rules_path() -> Path:
    return RULES


@pytest.fixture(scope="session")
def dashboards() -> dict[str, dict]:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert [f.name for f in files] == ["specd-serving.json", "specd-speculative.json"]
    return {f.name: json.loads(f.read_text()) for f in files}


@pytest.fixture(scope="session")
def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


@pytest.fixture(scope="session")
def dashboard_queries(dashboards) -> list[tuple[str, str]]:
    """(where, raw expr) for every panel target and every variable's selector."""
    out = []
    for name, board in dashboards.items():
        for p in board["panels"]:
            for t in p["targets"]:
                out.append((f"{name} panel {p['id']} {t['refId']} ({p['title']})", t["expr"]))
        for v in board["templating"]["list"]:
            if v["type"] == "query":
                selector = re.fullmatch(r"label_values\((.*), *\w+\)", v["definition"])
                assert selector, f"{name} variable {v['name']}: {v['definition']}"
                out.append((f"{name} variable {v['name']}", selector.group(1)))
    return out


@pytest.fixture(scope="session")
def rule_queries(rules) -> list[tuple[str, str]]:
    return [
        (f"{RULES.name} {r.get('alert') or r['record']}", r["expr"])
        for group in rules["groups"]
        for r in group["rules"]
    ]


@pytest.fixture(scope="session")
def promtool():
    """``promtool(*args)`` -> CompletedProcess; fails (never skips) when it is missing."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: scripts/install.sh installs Debian's prometheus package")

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [path, *args], input=stdin, capture_output=True, text=True, timeout=60
        )

    return run
