"""The PrometheusRule and dashboard ConfigMaps built from the chart's own files
(rules/specd-alerts.yaml, dashboards/*.json), rendered from scratch copies of the chart."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import pytest
import yaml

RULES = "rules/specd-alerts.yaml"
ON = {"monitoring": {"prometheusRule": {"enabled": True}}}
GROUP = {
    "name": "specd.test",
    "rules": [{"alert": "SpecdTest", "expr": "up == 0", "for": "5m", "labels": {"severity": "x"}}],
}


def render_dir(path: Path, values: dict) -> list[dict]:
    with helm.Chart.load(path) as chart:
        out = chart.render(values, name="specd", namespace="specd-system")
    return [
        d for k, v in sorted(out.items()) if k.endswith(".yaml") for d in yaml.safe_load_all(v) if d
    ]


def rule(docs: list[dict]) -> dict:
    (only,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return only


def test_rule_groups_come_from_the_rules_file(render, validate_doc, chart_copy):
    shipped = yaml.safe_load((chart_copy / RULES).read_text())
    docs = render(ON)
    assert rule(docs)["spec"]["groups"] == (shipped.get("groups") or [])
    (chart_copy / RULES).write_text(yaml.safe_dump({"groups": [GROUP]}))
    got = rule(render_dir(chart_copy, ON))
    validate_doc(got)
    assert got["spec"]["groups"] == [GROUP]


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(lambda: yaml.safe_dump({"spec": {"groups": [GROUP]}}), id="whole-object"),
        pytest.param(
            lambda: "# comment\ngroups:\n" + yaml.safe_dump([GROUP]), id="comment-and-groups"
        ),
    ],
)
def test_rules_file_shapes(text, chart_copy, validate_doc):
    (chart_copy / RULES).write_text(text())
    got = rule(render_dir(chart_copy, ON))
    validate_doc(got)
    assert got["spec"]["groups"] == [GROUP]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "missing from the chart"),
        ("alerts: []\n", "expected a top-level `groups:` list"),
        ("groups: {a: 1}\n", "`groups` must be a list"),
        ("groups: [\n", "not valid YAML"),
    ],
    ids=["missing", "no-groups", "groups-not-a-list", "bad-yaml"],
)
def test_bad_rules_file_fails_with_a_message(text, message, chart_copy):
    if text is None:
        (chart_copy / RULES).unlink()
    else:
        (chart_copy / RULES).write_text(text)
    with pytest.raises(helm.HelmRenderError, match=message):
        render_dir(chart_copy, ON)
    render_dir(chart_copy, {})  # disabled: the file is not read


def test_dashboards_become_labelled_configmaps(chart_copy, validate_doc):
    board = {"title": "specd overview", "panels": [], "schemaVersion": 39}
    (chart_copy / "dashboards").mkdir(exist_ok=True)
    for old in (chart_copy / "dashboards").glob("*.json"):
        old.unlink()
    (chart_copy / "dashboards/specd-overview.json").write_text(json.dumps(board))
    (chart_copy / "dashboards/KV_Cache.json").write_text(json.dumps(board))
    docs = [d for d in render_dir(chart_copy, {}) if d["kind"] == "ConfigMap"]
    assert {d["metadata"]["name"] for d in docs} == {
        "specd-dashboard-specd-overview",
        "specd-dashboard-kv-cache",
    }
    for cm in docs:
        validate_doc(cm)
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (data,) = cm["data"].values()
        assert json.loads(data) == board
    custom = {"dashboards": {"labelKey": "dash", "labelValue": "specd", "namespace": "grafana"}}
    for cm in [d for d in render_dir(chart_copy, custom) if d["kind"] == "ConfigMap"]:
        assert cm["metadata"]["labels"]["dash"] == "specd"
        assert "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["namespace"] == "grafana"
    off = {"dashboards": {"enabled": False}}
    assert not [d for d in render_dir(chart_copy, off) if d["kind"] == "ConfigMap"]


def test_shipped_dashboards_render(render, validate_doc):
    """Whatever dashboards/*.json the chart holds: one ConfigMap each, valid JSON inside."""
    shipped = sorted((Path(__file__).resolve().parents[1] / "specd/dashboards").glob("*.json"))
    docs = [d for d in render({}) if d["kind"] == "ConfigMap"]
    assert len(docs) == len(shipped)
    for cm in docs:
        validate_doc(cm)
        for text in cm["data"].values():
            json.loads(text)
