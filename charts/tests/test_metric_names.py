"""Dashboards and rules use only metric and label names the code exports, checked against
a real ``/metrics`` scrape: a gateway over one speculative engine (the trained demo pair,
adaptive ladder, load policy, sessions, strict leak checks) that has served requests.
The operator's own metrics come from an `OperatorMetrics` registry.  Then a real
Prometheus server (Debian's) scrapes that gateway with the shipped rules loaded, and
every dashboard query and rule is evaluated on the live data."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.devtools.testing import DEMO_MODELS, metric_in_text, running_gateway
from specd.operator.metrics import OperatorMetrics
from specd.operator.testing.cluster import free_port
from specd.workers.config import spec_for_model

# Labels a series gets from its scrape target (the ServiceMonitor adds `deployment`)
TARGET_LABELS = {"deployment", "job", "instance", "namespace", "pod", "service", "container"}
SYNTHETIC = {"up": set()}  # written by Prometheus per target, never exported
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless", "inf", "nan"}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_NAME = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, keywords, labels)."""
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", s)  # label matchers, range and subquery windows
    s = _GROUPING.sub(" ", s)
    return {m.group(1) for m in _NAME.finditer(s) if not m.group(2) and m.group(1) not in KEYWORDS}


def label_uses(expr: str) -> list[tuple[str | None, str]]:
    """(metric, label) for each matcher; (None, label) for each grouping label."""
    s = _STRING.sub('""', expr)
    uses = [
        (m.group(1), label) for m in _SELECTOR.finditer(s) for label in _MATCHER.findall(m.group(2))
    ]
    for m in _GROUPING.finditer(s):
        uses += [(None, label.strip()) for label in m.group(1).split(",") if label.strip()]
    return uses


def unexported(queries, exported: dict[str, set[str]]) -> list[str]:
    """Problems: a metric name not in ``exported`` (sample name -> label names), a matcher
    on a label that metric lacks, a grouping label no metric of the query has."""
    problems = []
    for where, expr in queries:
        names = metric_names(expr)
        problems += [
            f"{where}: metric {n} is not exported" for n in sorted(names - exported.keys())
        ]
        labels_here = set().union(*(exported.get(n, set()) for n in names)) | TARGET_LABELS
        for metric, label in label_uses(expr):
            have = (exported.get(metric, set()) | TARGET_LABELS) if metric else labels_here
            if (metric is None or metric in exported) and label not in have:
                problems.append(f"{where}: label {label} not on {metric or 'any metric used'}")
    return list(dict.fromkeys(problems))


def sample_labels(text: str) -> dict[str, set[str]]:
    """Sample name -> label names, from an exposition."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def family_names(text: str) -> dict[str, set[str]]:
    """Sample names a family may write, by type (for families that have no sample yet)."""
    return {
        family.name + suffix: set()
        for family in text_string_to_metric_families(text)
        for suffix in SUFFIXES.get(family.type, ("",))
    }


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """A live gateway (its URL) over one speculative engine (the demo pair) with the
    adaptive ladder, the cost model, sessions and strict leak checks."""
    spec = spec_for_model(
        str(DEMO_MODELS / "demo-target"),
        replicas=1,
        model={"name": "demo"},
        resources={"cpu": 0.5},
        kvCache={"pageSize": 4, "maxTokens": 4096},
        draft={"path": str(DEMO_MODELS / "demo-eagle")},
        speculative={
            "numSteps": 3,
            "numDraftTokens": 4,
            "adaptive": {"enabled": True, "candidateSteps": [0, 1, 3], "warmupBatches": 1},
            "policy": {"costModel": {"enabled": True}},  # the default, exporting its gauges
        },
        sessions={"enabled": True},
        debug={"strictMemCheck": 1},
    )
    ray.init(num_cpus=2, include_dashboard=False, namespace="specd-obs", log_to_driver=False)
    try:
        with running_gateway(spec, "obs") as gw:
            yield gw.url
    finally:
        ray.shutdown()


def serve_mixed_traffic(url: str) -> None:
    """Plain, speculative, opted out of speculation, two at once, structured and session
    requests."""
    with httpx.Client(base_url=url, timeout=60) as c:

        def complete(prompt: str, **extra) -> None:
            body = {"model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            r = c.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 200, r.text

        complete("# " + "-" * 60 + "\n")
        # opted out: its verify batches run plain (reason "request") whatever this machine's
        # timings make of the cost model, so the plain-steps family is always exported
        complete("def plain():", speculative=False)
        complete("Answer:", regex="(yes|no)", max_tokens=8)  # structured output
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(complete, ["Hello there", "Once upon a time"]))
        sid = c.post("/v1/sessions").json()["id"]
        complete("Hi", session_id=sid)
        assert c.delete(f"/v1/sessions/{sid}").status_code == 200


@pytest.fixture(scope="module")
def scrape(gateway) -> str:
    """The gateway's ``/metrics`` after mixed traffic."""
    serve_mixed_traffic(gateway)
    return httpx.get(f"{gateway}/metrics", timeout=30).text


@pytest.fixture(scope="module")
def exported(scrape, rules) -> dict[str, set[str]]:
    operator = generate_latest(OperatorMetrics().registry).decode()
    recorded = {
        r["record"]: {"deployment", "replica"}
        for g in rules["groups"]
        for r in g["rules"]
        if "record" in r
    }
    return {**family_names(operator), **sample_labels(scrape), **recorded, **SYNTHETIC}


def test_the_extraction_finds_names_and_labels():
    expr = (
        'sum by (pool, le) (rate(specd_nope_total{result="x{y}", replica=~"$replica"}[5m])) '
        "/ ignoring (pool) group_left sum(specd_kv_tokens_used) > bool 0.5e3 and on() up"
    )
    assert metric_names(expr) == {"specd_nope_total", "specd_kv_tokens_used", "up"}
    exported = {"specd_kv_tokens_used": {"replica"}, "up": set()}
    assert unexported([("q", expr)], exported) == [
        "q: metric specd_nope_total is not exported",
        "q: label pool not on any metric used",
        "q: label le not on any metric used",
    ]
    wrong_label = 'specd_kv_tokens_used{reason="x"}'
    assert unexported([("q", wrong_label)], exported) == [
        "q: label reason not on specd_kv_tokens_used"
    ]


def test_the_scrape_has_every_speculative_family(scrape):
    names = sample_labels(scrape)
    for name in (
        "specd_spec_accept_length_bucket",
        "specd_spec_accepted_by_position_total",
        "specd_spec_plain_steps_total",
        "specd_spec_cost_seconds_per_request",
        "specd_spec_cost_predicted_tokens_per_second",
        "specd_sessions_open",
        "specd_gateway_requests_total",
        "specd_structured_requests_total",
        "specd_grammar_compile_seconds_bucket",
    ):
        assert name in names, name
    assert metric_in_text(scrape, "specd_spec_plain_steps_total", reason="request") > 0
    leak = [
        s
        for f in text_string_to_metric_families(scrape)
        for s in f.samples
        if s.name == "specd_leak_checks_total"
    ]
    assert {s.labels["result"] for s in leak} == {"ok", "fail"}  # "fail": the alert's matcher
    assert all(s.value == 0 for s in leak if s.labels["result"] == "fail")


def test_dashboards_and_rules_use_only_exported_names(exported, dashboard_queries, rule_queries):
    problems = unexported(dashboard_queries + rule_queries, exported)
    assert not problems, "\n".join(problems)


def test_metrics_lint(promtool, scrape):
    """promtool's exposition lint: only the known, intentional finding (the DESIGN name
    ``specd_kv_tokens_total`` is a gauge)."""
    run = promtool("check", "metrics", stdin=scrape)
    findings = {line for line in (run.stdout + run.stderr).splitlines() if line.strip()}
    assert findings <= {'specd_kv_tokens_total non-counter metrics should not have "_total" suffix'}


# -- a real Prometheus scraping the live gateway --------------------------------------
LIVE_VALUES = {"deployment": "demo", "replica": ".*", "__rate_interval": "20s"}
LIVE_VALUES |= {"__interval": "5s", "__range": "5m"}
LIVE_LABELS = {"deployment": "demo"}  # as the ServiceMonitor's relabeling sets it


@pytest.fixture(scope="module")
def prometheus(gateway, rules_path, tmp_path_factory) -> Iterator[str]:
    """Debian's Prometheus server scraping the gateway every second (target label
    ``deployment``, as the ServiceMonitor's relabeling sets it) with the shipped rules."""
    home = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules_path)],
        "scrape_configs": [
            {
                "job_name": "specd",
                "static_configs": [
                    {"targets": [gateway.removeprefix("http://")], "labels": LIVE_LABELS}
                ],
            }
        ],
    }
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = shutil.which("prometheus")
    if server is None:
        pytest.fail("prometheus not found: scripts/install.sh installs Debian's prometheus")
    proc = subprocess.Popen(
        [
            server,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=(home / "log").open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, (home / "log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.mark.slow
def test_a_real_prometheus_evaluates_every_query_on_live_data(
    gateway, prometheus, dashboard_queries, rule_queries
):
    """Every dashboard query and rule runs on what Prometheus scraped from a serving
    gateway: every panel and recording rule returns data, no alert fires, and the
    recorded accept length shows the draft being accepted."""
    deadline = time.monotonic() + 8  # several scrapes and rule evaluations under load
    while time.monotonic() < deadline:
        serve_mixed_traffic(gateway)
    time.sleep(2)  # the last scrape and evaluation
    empty = []
    for where, expr in dashboard_queries + rule_queries:
        live = re.sub(r"\$\{?(\w+)\}?", lambda m: LIVE_VALUES[m.group(1)], expr)
        if not query(prometheus, live):
            empty.append(where)
    # every panel and recording rule has data; every alert is quiet (healthy, no leak,
    # accepted drafts, fast first tokens)
    alerts = [w for w, _ in rule_queries if " Specd" in w]
    assert alerts and empty == alerts
    (accept,) = query(prometheus, 'specd:spec_accept_length:mean5m{deployment="demo"}')
    assert float(accept["value"][1]) > 1.0  # the trained draft is accepted
    assert query(prometheus, 'up{deployment="demo"}')[0]["value"][1] == "1"
    assert query(prometheus, "ALERTS") == []
