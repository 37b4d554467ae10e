"""The operator's own Prometheus metrics (prefix ``specd_operator_``) on its ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "specd_operator_reconciles_total",
            "Reconcile passes by trigger and result",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "specd_operator_reconcile_errors_total",
            "Reconcile passes that raised, by exception type",
            ["error"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "specd_operator_reconcile_seconds",
            "Duration of one reconcile pass (children + gateway poll + status)",
            registry=self.registry,
        )
        self.gateway_polls = Counter(
            "specd_operator_gateway_polls_total",
            "Polls of a gateway's /admin/status by result",
            ["result"],
            registry=self.registry,
        )
        self.status_writes = Counter(
            "specd_operator_status_writes_total",
            "Status patches by result (written, conflict = 409 then retried)",
            ["result"],
            registry=self.registry,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``port`` (a background thread)."""
        start_http_server(port, addr=addr, registry=self.registry)
