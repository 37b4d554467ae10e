"""Dashboards are well-formed Grafana JSON generated from scripts/gen_dashboards.py; every
query (dashboards and rules) parses with promtool; the alerts pass their promtool unit
tests (alerts_test.yaml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def test_committed_dashboards_are_the_generated_ones():
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


def test_dashboards_are_well_formed(dashboards):
    for name, board in dashboards.items():
        assert board["uid"] == name.removesuffix(".json") and board["title"]
        assert 36 <= board["schemaVersion"] <= 41
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for var in ("deployment", "replica"):
            assert variables[var]["type"] == "query", (name, var)
            assert variables[var]["definition"].startswith("label_values("), (name, var)
            assert variables[var]["datasource"]["uid"] == "${datasource}"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells = set()
        for p in board["panels"]:
            where = f"{name} panel {p['id']} ({p.get('title')})"
            assert p["title"] and p["type"] in {"timeseries", "heatmap", "stat"}, where
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            g = p["gridPos"]
            assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, where
            area = {
                (x, y)
                for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])
            }
            assert not area & cells, f"{where} overlaps another panel"
            cells |= area
            assert p["targets"], where
            ref_ids = [t["refId"] for t in p["targets"]]
            assert len(ref_ids) == len(set(ref_ids)), where
            for t in p["targets"]:
                assert t["expr"] and t["refId"] and "legendFormat" in t, where


# the gateway's own series that no replica label could filter
GATEWAY_ONLY = (
    "specd_gateway_session_moves_total",
    "specd_gateway_session_placements_total",
    "specd_gateway_desired_replicas",
    "specd_gateway_replicas",
    "specd_gateway_ongoing_requests",
    "specd_gateway_held_requests",
)


def test_every_dashboard_query_is_filtered_by_deployment_and_replica(dashboard_queries):
    for where, expr in dashboard_queries:
        if "variable deployment" in where:
            continue  # lists the deployments themselves
        assert 'deployment=~"$deployment"' in expr, where
        if "variable replica" not in where and not any(m in expr for m in GATEWAY_ONLY):
            assert 'replica=~"$replica"' in expr, where
            if "rate(" in expr or "increase(" in expr:
                assert "[$__rate_interval]" in expr or "[$__range]" in expr, where


def test_every_query_parses(promtool, substitute, dashboard_queries, rule_queries, tmp_path):
    """One recording rule (in a group named after its source) per query: promtool parses
    each with the Prometheus PromQL parser."""
    queries = dashboard_queries + rule_queries
    groups = [
        {"name": where, "rules": [{"record": f"specd_check_{i}", "expr": substitute(expr)}]}
        for i, (where, expr) in enumerate(queries)
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    run = promtool("check", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(queries)} rules found" in run.stdout, run.stdout


def test_rules_file_is_valid_and_every_alert_is_documented(promtool, rules, rules_path):
    run = promtool("check", "rules", str(rules_path))
    assert run.returncode == 0, run.stdout + run.stderr
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "SpecdKVLeakDetected",
        "SpecdKVReserveNearExhaustion",
        "SpecdAcceptanceCollapsed",
        "SpecdReplicaDown",
        "SpecdReplicasUnavailable",
        "SpecdAutoscalerAtMaxReplicas",
        "SpecdHighTTFT",
    }
    for a in alerts:
        assert a["labels"]["severity"] in {"critical", "warning", "info"}, a["alert"]
        assert {"summary", "description", "runbook"} <= a["annotations"].keys(), a["alert"]


def test_alert_unit_tests(promtool):
    run = promtool("test", "rules", str(HERE / "alerts_test.yaml"))
    print(run.stdout, run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
