"""Write the chart's Grafana dashboards (charts/specd/dashboards/*.json) from one source.

    python scripts/gen_dashboards.py          rewrite the JSON files
    python scripts/gen_dashboards.py --check  exit 1 when a committed file differs

Every query is filtered by the ``deployment`` (added at scrape time) and ``replica``
(set by the engine) template variables; ``$__rate_interval`` sizes every rate window.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "charts" / "specd" / "dashboards"

DS = {"type": "prometheus", "uid": "${datasource}"}
FILTER = 'deployment=~"$deployment", replica=~"$replica"'
GATEWAY_FILTER = 'deployment=~"$deployment"'  # the gateway's own series: no replica label
WINDOW = "[$__rate_interval]"
PER_REPLICA = "deployment, replica"
REPLICA_LEGEND = "{{deployment}}/{{replica}}"


def sel(metric: str, matchers: str = "", scope: str = FILTER) -> str:
    """``metric`` with the dashboard filter ``scope`` (plus ``matchers``)."""
    return f"{metric}{{{matchers + ', ' if matchers else ''}{scope}}}"


def rate(
    metric: str,
    by: str | None = PER_REPLICA,
    matchers: str = "",
    fn: str = "rate",
    window: str = WINDOW,
    scope: str = FILTER,
) -> str:
    """``sum by (by) (fn(metric{scope}[window]))``; ``by=None`` sums everything."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({fn}({sel(metric, matchers, scope)}{window}))"


def per_gateway(metric: str, matchers: str = "") -> str:
    """A gateway's own gauge per deployment (several scrapes of one gateway can overlap)."""
    return f"max by (deployment) ({sel(metric, matchers, GATEWAY_FILTER)})"


def per_replica(metric: str, agg: str = "sum") -> str:
    """A gauge aggregated per replica (several scrapes of one gateway can overlap)."""
    return f"{agg} by ({PER_REPLICA}) ({sel(metric)})"


def by_algorithm(per_replica: str) -> str:
    """A per-replica query summed per deployment and drafting algorithm."""
    info = sel("specd_spec_draft_info")
    return (
        f"sum by (deployment, algorithm) ({per_replica} * on (deployment, replica) "
        f"group_left (algorithm) {info})"
    )


def rate_per_replica_by(metric: str, label: str) -> tuple[str, str]:
    """(query, legend): a counter's rate per replica and ``label``."""
    return rate(metric, by=f"{PER_REPLICA}, {label}"), f"{REPLICA_LEGEND} {{{{{label}}}}}"


def quantiles(histogram: str) -> list[tuple[str, str]]:
    """p50/p90/p99 of a histogram, per deployment."""
    buckets = rate(f"{histogram}_bucket", by="deployment, le")
    return [
        (f"histogram_quantile({q}, {buckets})", f"{{{{deployment}}}} p{round(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


def panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    kind: str = "timeseries",
    thresholds: list[tuple[str, float | None]] | None = None,
    **extra,
) -> dict:
    """One panel; ``targets`` are (expr, legend) pairs. Ids and gridPos come from `layout`."""
    defaults: dict = {"unit": unit}
    if thresholds:
        steps = [{"color": color, "value": value} for color, value in thresholds]
        defaults["thresholds"] = {"mode": "absolute", "steps": steps}
    return {
        "type": kind,
        "title": title,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
        **extra,
    }


def heatmap(title: str, histogram: str, description: str) -> dict:
    expr = rate(f"{histogram}_bucket", by="le", fn="increase")
    p = panel(title, [(expr, "{{le}}")], kind="heatmap", description=description)
    p["targets"][0]["format"] = "heatmap"
    p["options"] = {"calculate": False, "yAxis": {"unit": "short"}, "cellGap": 1}
    return p


def layout(panels: list[dict], width: int = 12, height: int = 8) -> list[dict]:
    """Number the panels and place them two to a row."""
    per_row = 24 // width
    return [
        {
            "id": i + 1,
            "gridPos": {
                "h": height,
                "w": width,
                "x": (i % per_row) * width,
                "y": (i // per_row) * height,
            },
            **p,
        }
        for i, p in enumerate(panels)
    ]


def variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "label": name.capitalize(),
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-variable"},
        "refresh": 2,  # on time range change: replicas come and go
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {},
        "options": [],
        "sort": 1,
        "hide": 0,
    }


TEMPLATING = {
    "list": [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "options": [],
            "hide": 0,
        },
        variable("deployment", "label_values(specd_engine_healthy, deployment)"),
        variable(
            "replica", 'label_values(specd_engine_healthy{deployment=~"$deployment"}, replica)'
        ),
    ]
}


def dashboard(uid: str, title: str, description: str, panels: list[dict]) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["specd"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": TEMPLATING,
        "panels": layout(panels),
    }


def speculative() -> dict:
    accepted, verifies = "specd_spec_accepted_tokens_total", "specd_spec_verify_steps_total"
    drafts = "specd_spec_draft_tokens_total"
    return dashboard(
        "specd-speculative",
        "specd / Speculative decoding",
        "Draft acceptance, the adaptive rung, KV reserve and sessions, KV leak checks",
        [
            panel(
                "Mean accept length (tokens per verify, bonus included)",
                [(f"1 + {rate(accepted)} / {rate(verifies)}", REPLICA_LEGEND)],
                description="1 + accepted drafts / verify steps: the number kubectl shows "
                "as Accept-Len and the operator compares with minAcceptLength",
            ),
            panel(
                "Mean accept length by drafting algorithm",
                [
                    (
                        f"1 + {by_algorithm(rate(accepted))} / {by_algorithm(rate(verifies))}",
                        "{{deployment}} {{algorithm}}",
                    )
                ],
                description="As above, replicas summed per spec.draft.algorithm "
                "(specd_spec_draft_info): EAGLE, EAGLE3, NGRAM or SUFFIX",
            ),
            panel(
                "Accept rate (accepted / proposed drafts)",
                [(f"{rate(accepted)} / {rate(drafts)}", REPLICA_LEGEND)],
                unit="percentunit",
            ),
            heatmap(
                "Accept length per verify (bonus excluded)",
                "specd_spec_accept_length",
                "Accepted draft tokens per verify step, one bucket per length",
            ),
            panel(
                "Acceptance by draft position",
                [
                    (
                        f"{rate('specd_spec_accepted_by_position_total', by='position')} "
                        f"/ ignoring (position) group_left {rate(verifies, by=None)}",
                        "depth {{position}}",
                    )
                ],
                unit="percentunit",
                description="Share of verify steps whose accepted path reached this depth",
            ),
            panel(
                "Draft vs accepted tokens/s",
                [
                    (rate(drafts), f"{REPLICA_LEGEND} proposed"),
                    (rate(accepted), f"{REPLICA_LEGEND} accepted"),
                    (
                        rate("specd_spec_prefill_step_decodes_total"),
                        f"{REPLICA_LEGEND} decoded in prefill steps",
                    ),
                ],
                unit="tps",
                description="Draft tokens proposed and accepted by verifies, and tokens "
                "drafting requests decoded plainly beside prefill chunks",
            ),
            panel(
                "Adaptive rung (draft steps)",
                [(per_replica("specd_spec_adaptive_steps", "max"), REPLICA_LEGEND)],
                description="Draft steps of the active rung; 0 = plain decode",
            ),
            panel(
                "Speculation on/off",
                [(per_replica("specd_spec_enabled", "max"), REPLICA_LEGEND)],
                description="1 when the last verify batch speculated, 0 when it ran plain",
            ),
            panel(
                "Plain verify batches/s by reason",
                [rate_per_replica_by("specd_spec_plain_steps_total", "reason")],
                unit="ops",
                description="rung: the active rung is 0; load: the batch exceeded "
                "policy.maxBatchForSpec; cost: the cost model predicted more tokens/s "
                "from plain decode (or explored it)",
            ),
            panel(
                "Cost model: predicted tokens/s per request by batch bucket and steps",
                [
                    (
                        f"max by ({PER_REPLICA}, batch_bucket, steps) "
                        f"({sel('specd_spec_cost_predicted_tokens_per_second')})",
                        f"{REPLICA_LEGEND} batch<={{{{batch_bucket}}}} steps={{{{steps}}}}",
                    )
                ],
                description="(1 + accepted drafts) / measured seconds per request; each "
                "verify batch runs the higher of its bucket's speculating rung and plain "
                "(steps 0)",
            ),
            panel(
                "KV usage (used / total)",
                [
                    (
                        per_replica("specd_kv_tokens_used")
                        + " / "
                        + per_replica("specd_kv_tokens_total"),
                        REPLICA_LEGEND,
                    )
                ],
                unit="percentunit",
            ),
            panel(
                "KV speculative reserve (share of used KV)",
                [(per_replica("specd_kv_reserve_usage_ratio", "max"), REPLICA_LEGEND)],
                unit="percentunit",
                description="Slots allocated beyond committed length / used slots",
            ),
            panel(
                "Prefix-cache KV tokens",
                [(per_replica("specd_kv_tokens_cached"), REPLICA_LEGEND)],
                description="Finished requests' KV kept for later requests with the same "
                "prefix (borrowed or evictable); not counted as used",
            ),
            panel(
                "Prefix-cache hit rate (tokens)",
                [
                    (
                        rate("specd_prefix_cache_hit_tokens_total")
                        + " / "
                        + rate("specd_prefix_cache_queried_tokens_total"),
                        REPLICA_LEGEND,
                    )
                ],
                unit="percentunit",
                description="Share of admitted requests' tokens found in the prefix cache "
                "(their prefill skipped)",
            ),
            panel(
                "Gateway routing: prompts/s by replica and reason",
                [rate_per_replica_by("specd_gateway_routed_requests_total", "reason")],
                unit="reqps",
                description="Why the gateway chose each prompt's replica: prefix (the longest "
                "predicted prefix-cache hit), load (least loaded), balance (the cached "
                "replica was too busy; spec.routing)",
            ),
            panel(
                "Session-held KV tokens",
                [(per_replica("specd_session_kv_tokens"), REPLICA_LEGEND)],
            ),
            panel(
                "Sessions open, KV evictions and moves",
                [
                    (per_replica("specd_sessions_open"), f"{REPLICA_LEGEND} open"),
                    (
                        rate("specd_session_kv_evictions_total", fn="increase"),
                        f"{REPLICA_LEGEND} evicted",
                    ),
                    (
                        rate(
                            "specd_gateway_session_moves_total",
                            "deployment, outcome",
                            fn="increase",
                            scope=GATEWAY_FILTER,
                        ),
                        "{{deployment}} moved: {{outcome}}",
                    ),
                    (
                        rate(
                            "specd_gateway_session_placements_total",
                            "deployment, outcome",
                            fn="increase",
                            scope=GATEWAY_FILTER,
                        ),
                        "{{deployment}} placed: {{outcome}}",
                    ),
                ],
                description="Moves: idle sessions of replicas retired by a rolling update or "
                "scale-down, moved with their KV (kv), with their history only (history), "
                "or ended (no replica could take them). Placed: new sessions moved before "
                "their first turn to the replica caching its prompt's prefix (moved), or "
                "left where they were because it was full (refused)",
            ),
            panel(
                "KV leak checks/s by pool, mode, result",
                [
                    (
                        rate("specd_leak_checks_total", by="pool, mode, result"),
                        "{{pool}} {{mode}} {{result}}",
                    )
                ],
                unit="ops",
            ),
            panel(
                "KV leak-check failures (time range)",
                [
                    (
                        rate(
                            "specd_leak_checks_total",
                            None,
                            'result="fail"',
                            "increase",
                            "[$__range]",
                        ),
                        "failures",
                    )
                ],
                kind="stat",
                options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"},
                thresholds=[("green", None), ("red", 1)],
                description="Any failure means KV slots were lost or double-owned: see the "
                "SpecdKVLeakDetected runbook",
            ),
        ],
    )


def serving() -> dict:
    health = per_replica("specd_engine_healthy", "min")
    return dashboard(
        "specd-serving",
        "specd / Serving",
        "Request rates, latency quantiles, token throughput, queueing, engine health",
        [
            panel(
                "Finished requests/s by reason",
                [
                    (
                        rate("specd_requests_finished_total", by="deployment, reason"),
                        "{{deployment}} {{reason}}",
                    )
                ],
                unit="reqps",
            ),
            panel("Time to first token", quantiles("specd_time_to_first_token_seconds"), "s"),
            panel("Inter-token latency", quantiles("specd_inter_token_latency_seconds"), "s"),
            panel(
                "End-to-end request latency", quantiles("specd_e2e_request_latency_seconds"), "s"
            ),
            panel(
                "Prompt and generation tokens/s",
                [
                    (rate("specd_prompt_tokens_total"), f"{REPLICA_LEGEND} prompt"),
                    (rate("specd_generation_tokens_total"), f"{REPLICA_LEGEND} generated"),
                ],
                unit="tps",
            ),
            panel(
                "Requests running / queued",
                [
                    (per_replica("specd_requests_running"), f"{REPLICA_LEGEND} running"),
                    (per_replica("specd_requests_queued"), f"{REPLICA_LEGEND} queued"),
                ],
            ),
            panel(
                "Retractions, preemptions and aborts/s",
                [
                    (rate("specd_retractions_total"), f"{REPLICA_LEGEND} retracted"),
                    (rate("specd_preemptions_total"), f"{REPLICA_LEGEND} preempted"),
                    (rate("specd_aborts_total"), f"{REPLICA_LEGEND} aborted"),
                ],
                unit="reqps",
                description="Retracted: KV ran out and the request went back to the queue; "
                "preempted: it went back to let a waiting request of higher priority start "
                "(scheduler.policy: priority); aborted: the client went away or the session "
                "was closed",
            ),
            panel(
                "Replicas: ready and desired; ongoing requests",
                [
                    (per_gateway("specd_gateway_desired_replicas"), "{{deployment}} desired"),
                    (
                        per_gateway("specd_gateway_replicas", 'state="ready"'),
                        "{{deployment}} ready",
                    ),
                    (
                        per_gateway("specd_gateway_ongoing_requests"),
                        "{{deployment}} ongoing requests",
                    ),
                    (
                        per_gateway("specd_gateway_held_requests"),
                        "{{deployment}} held for a replica",
                    ),
                ],
                description="Desired: spec.replicas, or the autoscaler's count "
                "(spec.autoscaling: ongoing requests averaged over lookBackSeconds / "
                "targetOngoingRequests); ongoing: streams open on the replicas and requests "
                "held; held: requests waiting for a replica to start (minReplicas 0, scaled "
                "to zero)",
            ),
            panel(
                "Engine healthy",
                [(health, REPLICA_LEGEND)],
                kind="stat",
                thresholds=[("red", None), ("green", 1)],
                options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"},
            ),
            panel(
                "Engine loop time by phase (share of wall time)",
                [rate_per_replica_by("specd_engine_step_seconds_total", "phase")],
                unit="percentunit",
                description="host: scheduling and bookkeeping; model: forward passes",
            ),
            panel(
                "Engine steps/s by kind",
                [
                    rate_per_replica_by("specd_engine_steps_total", "kind"),
                    (
                        rate("specd_engine_steps_launched_ahead_total"),
                        f"{REPLICA_LEGEND} launched ahead",
                    ),
                ],
                unit="ops",
                description="launched ahead: overlap scheduling started the step before "
                "the previous one was resolved (near the decode/verify rate when it pays)",
            ),
            panel(
                "Requests per step by kind (mean batch)",
                [
                    (
                        f"{rate('specd_engine_step_requests_total', by=f'{PER_REPLICA}, kind')}"
                        f" / {rate('specd_engine_steps_total', by=f'{PER_REPLICA}, kind')}",
                        f"{REPLICA_LEGEND} {{{{kind}}}}",
                    )
                ],
                description="verify: requests a verify step drafted for (under a served "
                "load, fewer than maxRunningRequests while finished requests' successors "
                "wait for the next prefill step); extend: requests in a step that read "
                "prompts, decodes beside them included; decode: a plain decode step",
            ),
            panel(
                "Structured-output requests/s by kind",
                [rate_per_replica_by("specd_structured_requests_total", "kind")],
                unit="reqps",
                description="Requests held to a grammar: response_format (json_object, "
                "json_schema, structural_tag), regex, ebnf, and tool calls",
            ),
            panel(
                "Grammar compile time",
                quantiles("specd_grammar_compile_seconds"),
                "s",
                description="Compiling a request's grammar, or finding it in the replica's "
                "cache, off the event loop",
            ),
        ],
    )


DASHBOARDS = {"specd-speculative.json": speculative, "specd-serving.json": serving}


def render(build) -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    check = argv[1:] == ["--check"]
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = OUT / name, render(build)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python scripts/gen_dashboards.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
