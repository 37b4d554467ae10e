"""``specd operator``: runs the kopf operator (peering, liveness probe, metrics endpoint).

Two operator replicas coordinate through kopf peering (``KopfPeering`` object
``specd``; its CRD ships in charts/specd/crds): only the one with the highest
priority acts.  ``--standalone`` turns peering off (one replica, or tests).
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from specd.operator.children import ChildOptions
from specd.operator.handlers import build_registry, operator_settings
from specd.operator.poller import Peering, own_identity
from specd.operator.reconcile import OperatorContext

PEERING_NAME = "specd"


def run_operator(
    *,
    namespaces: list[str] | None = None,
    clusterwide: bool = False,
    options: ChildOptions | None = None,
    poll_interval_s: float = 10.0,
    metrics_port: int | None = 9090,
    liveness: str | None = "http://0.0.0.0:8080/healthz",
    standalone: bool = False,
    priority: int = 0,
) -> int:
    """Blocks until SIGINT/SIGTERM; returns the exit code."""
    ctx = OperatorContext(options=options or ChildOptions(), poll_interval_s=poll_interval_s)
    if metrics_port is not None:
        ctx.metrics.serve(metrics_port)
    logging.getLogger("kopf").setLevel(logging.INFO)
    settings = operator_settings()
    # Peering through settings: kopf's `peering_name=` argument would switch peering
    # on (and wait for the KopfPeering CRD) even with `standalone=True`.
    settings.peering.name = PEERING_NAME
    settings.peering.standalone = standalone
    settings.peering.priority = priority
    settings.peering.clusterwide = clusterwide
    identity = own_identity()
    if not standalone:
        watched = () if clusterwide else tuple(namespaces or ())
        ctx.peering = Peering(PEERING_NAME, identity, priority, watched)
    asyncio.run(
        kopf.operator(
            registry=build_registry(ctx),
            settings=settings,
            identity=identity,  # type: ignore[arg-type]  # kopf's Identity is a NewType of str
            clusterwide=clusterwide,
            namespaces=namespaces or [],
            liveness_endpoint=liveness,
        )
    )
    return 0
