"""Per-engine Prometheus metrics (names per DESIGN §4, every sample labelled ``replica``).

Each engine owns a private ``CollectorRegistry`` so several engines can live in one
process (tests) and the gateway can merge their expositions.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from specd.workers.rung import PlainReason
from specd.workers.scheduler.step_stats import StepStats

disable_created_metrics()  # no *_created series: they double the exposition for no use here

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineMetrics:
    def __init__(self, replica: str):
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["replica"]

        def bind(metric, labels):
            """Metrics without extra labels come back bound to this replica."""
            return metric if labels else metric.labels(replica)

        def gauge(name, doc, labels=()):
            return bind(Gauge(name, doc, lbl + list(labels), registry=r), labels)

        def counter(name, doc, labels=()):
            return bind(Counter(name, doc, lbl + list(labels), registry=r), labels)

        def histogram(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(name, doc, lbl, registry=r, buckets=buckets).labels(replica)

        self.requests_running = gauge(
            "specd_requests_running", "Requests holding KV and being served"
        )
        self.requests_queued = gauge("specd_requests_queued", "Requests waiting for admission")
        self.kv_tokens_total = gauge("specd_kv_tokens_total", "Token slots in the KV pool")
        self.kv_tokens_used = gauge(
            "specd_kv_tokens_used",
            "Token slots held by requests and sessions (whole pages; cached prefixes they "
            "borrow included, evictable ones not)",
        )
        self.kv_tokens_cached = gauge(
            "specd_kv_tokens_cached",
            "Token slots of the prefix cache (whole pages), borrowed by requests or evictable",
        )
        self.prefix_cache_queried = counter(
            "specd_prefix_cache_queried_tokens",
            "Tokens of admitted requests looked up in the prefix cache",
        )
        self.prefix_cache_hits = counter(
            "specd_prefix_cache_hit_tokens",
            "Tokens found in the prefix cache (their prefill skipped)",
        )
        self.kv_tokens_reserved = gauge(
            "specd_kv_tokens_reserved",
            "Slots allocated beyond committed length, summed over requests",
        )
        self.engine_healthy = gauge("specd_engine_healthy", "1 while the engine loop is healthy")
        self.ttft = histogram("specd_time_to_first_token_seconds", "Arrival to first output token")
        self.itl = histogram("specd_inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("specd_e2e_request_latency_seconds", "Arrival to finish")
        self.prompt_tokens = counter("specd_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("specd_generation_tokens", "Output tokens generated")
        self.retractions = counter("specd_retractions", "Requests retracted because KV ran out")
        self.preemptions = counter(
            "specd_preemptions",
            "Running requests retracted so that a waiting request of higher priority starts",
        )
        self.session_evictions = counter(
            "specd_session_kv_evictions",
            "Session KV freed under memory pressure (history kept; the next turn re-prefills)",
        )
        self.session_arrivals = counter(
            "specd_session_arrivals",
            "Sessions moved here from a draining replica, by what came along: kv, or "
            "history only (the next turn re-prefills it)",
            ["carried"],
        )
        self.aborts = counter("specd_aborts", "Requests aborted before finishing")
        self.finished = counter("specd_requests_finished", "Finished requests", ["reason"])
        self.structured_requests = counter(
            "specd_structured_requests",
            "Requests admitted with a grammar (structured output, tool calls), by kind",
            ["kind"],
        )
        self.grammar_compile = histogram(
            "specd_grammar_compile_seconds",
            "Time to compile a request's grammar (or find it cached) and make its matcher",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
        self.steps = counter("specd_engine_steps", "Scheduler steps run", ["kind"])
        self.step_requests = counter(
            "specd_engine_step_requests",
            "Requests in the scheduler steps run, by step kind (over engine_steps_total: "
            "the mean batch)",
            ["kind"],
        )
        self.steps_launched_ahead = counter(
            "specd_engine_steps_launched_ahead",
            "Steps launched before the previous one was resolved (overlap scheduling)",
        )
        self.step_seconds = counter(
            "specd_engine_step_seconds",
            "Engine loop time by phase (host bookkeeping vs model)",
            ["phase"],
        )
        self.leak_checks = counter(
            "specd_leak_checks",
            "KV leak checks run, by pool (token, req_to_token), mode (idle, busy) and result",
            ["pool", "mode", "result"],
        )
        self.sessions_open = gauge("specd_sessions_open", "Streaming sessions open")
        self.session_kv_tokens = gauge(
            "specd_session_kv_tokens", "KV slots held by sessions between turns (whole pages)"
        )
        self.kv_reserve_ratio = gauge(
            "specd_kv_reserve_usage_ratio",
            "Share of the used KV slots that is speculative reserve (allocated beyond committed)",
        )
        self.spec_verify_steps = counter("specd_spec_verify_steps", "Speculative verify steps")
        self.spec_draft_tokens = counter(
            "specd_spec_draft_tokens", "Draft tokens proposed for verification (tree nodes)"
        )
        self.spec_accepted_tokens = counter(
            "specd_spec_accepted_tokens", "Draft tokens accepted by verification (bonus excluded)"
        )
        self.spec_accepted_by_position = counter(
            "specd_spec_accepted_by_position",
            "Verifies whose accepted path reached this depth (1 = first draft token)",
            ["position"],
        )
        self.spec_accept_length = Histogram(
            "specd_spec_accept_length",
            "Accepted draft tokens per verify (bonus excluded)",
            lbl,
            registry=r,
            buckets=tuple(range(0, 17)),
        ).labels(replica)
        self.spec_draft_info = gauge(
            "specd_spec_draft_info",
            "1 for the replica's drafting algorithm (EAGLE, EAGLE3, NGRAM, SUFFIX): join "
            "on replica to read acceptance per algorithm",
            ["algorithm"],
        )
        self.spec_adaptive_steps = gauge(
            "specd_spec_adaptive_steps",
            "Draft steps of the active speculation rung (0 = plain decode)",
        )
        self.spec_enabled = gauge(
            "specd_spec_enabled",
            "1 when the last verify batch speculated, 0 when it ran plain (rung, load or cost)",
        )
        self.spec_plain_steps = counter(
            "specd_spec_plain_steps",
            "Verify batches run as plain decode (steps 0): reason rung (the active rung), "
            "load (policy.maxBatchForSpec) or cost (the cost model)",
            ["reason"],
        )
        self.spec_prefill_step_decodes = counter(
            "specd_spec_prefill_step_decodes",
            "Tokens drafting requests decoded plainly in a prefill step, beside its "
            "chunks, instead of waiting for the next verify (their draft reads them later)",
        )
        self.spec_prefill_catch_up = counter(
            "specd_spec_prefill_catch_up_seconds",
            "Draft seconds spent reading the tokens that prefill steps decoded, in the "
            "verifies that read them; the cost model counts them in the verify's cost",
        )
        self.spec_shadow_walks = counter(
            "specd_spec_shadow_walks",
            "NGRAM drafts measured on plain steps: proposed where the engine decoded "
            "plainly, then walked with the tokens plain decode produced, as a verify would",
        )
        self.spec_shadow_accepted = counter(
            "specd_spec_shadow_accepted",
            "Drafts the shadow walks accepted (their mean is the acceptance plain steps "
            "measure for the cost model)",
        )
        self.spec_root_only_requests = counter(
            "specd_spec_root_only_requests",
            "NGRAM/SUFFIX speculating steps: requests with nothing to propose, which "
            "verified their root alone (a plain decode's cost) beside the drafting ones",
        )
        self.spec_hybrid_suffix_trees = counter(
            "specd_spec_hybrid_suffix_trees",
            "Hybrid drafting: requests that verified SUFFIX's tree instead of the draft "
            "model's (its score cleared speculative.suffix.hybridThreshold)",
        )
        self.spec_cost_seconds = gauge(
            "specd_spec_cost_seconds_per_request",
            "The cost model's EMA of a verify step's compute seconds per request, by batch "
            "size bucket (the power of two at or above it) and rung steps (0 = plain)",
            ["batch_bucket", "steps"],
        )
        self.spec_cost_predicted = gauge(
            "specd_spec_cost_predicted_tokens_per_second",
            "The cost model's predicted tokens per second per request: (1 + accepted "
            "drafts) / seconds per request, by batch size bucket and rung steps",
            ["batch_bucket", "steps"],
        )
        self.replica = replica
        for pool in ("token", "req_to_token"):  # export zeros: alerts see "no failures"
            for mode in ("idle", "busy"):
                for result in ("ok", "fail"):
                    self.leak_checks.labels(replica, pool, mode, result)
        self.engine_healthy.set(1)
        # Plain-number copies of the counters /admin/status reports (the operator's input)
        self.spec_totals = {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.spec_plain = {reason.value: 0 for reason in PlainReason}
        self.leak_failures = 0

    def leak_check(self, pool: str, mode: str, ok: bool) -> None:
        """Count one leak check of ``pool`` (``token`` or ``req_to_token``)."""
        self.leak_checks.labels(self.replica, pool, mode, "ok" if ok else "fail").inc()
        if not ok:
            self.leak_failures += 1

    def observe_scheduler(self, stats: StepStats) -> None:
        """Add what the scheduler did during one step (a row that could not grow counts
        as a failed busy check of the row pool)."""
        self.retractions.inc(stats.retractions)
        self.preemptions.inc(stats.preemptions)
        self.session_evictions.inc(stats.session_evictions)
        self.prefix_cache_queried.inc(stats.prefix_queried_tokens)
        self.prefix_cache_hits.inc(stats.prefix_hit_tokens)
        for _ in range(stats.row_width_errors):
            self.leak_check("req_to_token", "busy", ok=False)

    def observe_verify(self, accept_lens: tuple[int, ...], draft_tokens: int) -> None:
        """Account one verify batch: accept_lens are accepted drafts per request, and
        ``draft_tokens`` the drafts verified for them all."""
        totals = self.spec_totals
        totals["verify_steps"] += len(accept_lens)
        totals["draft_tokens"] += draft_tokens
        totals["accepted_tokens"] += sum(accept_lens)
        self.spec_verify_steps.inc(len(accept_lens))
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted_tokens.inc(sum(accept_lens))
        for n in accept_lens:
            self.spec_accept_length.observe(n)
            for depth in range(1, n + 1):
                self.spec_accepted_by_position.labels(self.replica, str(depth)).inc()

    def observe_rung(self, plain_reason: PlainReason | None) -> None:
        """Account one verify batch's rung: speculating (None), or plain and why."""
        self.spec_enabled.set(1 if plain_reason is None else 0)
        if plain_reason is not None:
            self.spec_plain_steps.labels(self.replica, plain_reason.value).inc()
            self.spec_plain[plain_reason.value] += 1

    def observe_plain_decodes(self, tokens: int) -> None:
        """Count the tokens a prefill step decoded plainly for drafting requests."""
        if tokens:
            self.spec_prefill_step_decodes.inc(tokens)

    def observe_prefill_catch_up(self, seconds: float) -> None:
        """Count a verify's draft seconds on tokens decoded in prefill steps."""
        if seconds > 0:
            self.spec_prefill_catch_up.inc(seconds)

    def observe_shadow(self, accepted: tuple[int, ...]) -> None:
        """Count finished shadow walks and the drafts they accepted."""
        if accepted:
            self.spec_shadow_walks.inc(len(accepted))
            self.spec_shadow_accepted.inc(sum(accepted))

    def observe_cost(
        self, bucket: int, steps: int, seconds: float | None, predicted: float | None
    ) -> None:
        """Export the cost model's estimates for one (bucket, rung), once measured."""
        labels = (self.replica, str(bucket), str(steps))
        if seconds is not None:
            self.spec_cost_seconds.labels(*labels).set(seconds)
        if predicted is not None:
            self.spec_cost_predicted.labels(*labels).set(predicted)

    def start_over(self) -> None:
        """Forget everything counted so far (the load's calibration ran made-up
        requests): every metric back at its initial value, in a fresh registry."""
        self.__init__(self.replica)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
