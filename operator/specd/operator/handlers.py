"""kopf handlers around `reconcile` (one registry per operator, built by `build_registry`).

- login:                 kopf's service-account / kubeconfig login; the same credentials
                         feed our `KubeClient`.
- create/update/resume:  ensure the children (fast reaction to a spec change); an
                         invalid spec is a `kopf.PermanentError` (no retry storm).
                         Updates trigger on ``spec`` only, never on ``status``.
- timer (poll interval): the level-based loop: ensure children, poll the gateway,
                         write status (the only status writer), emit Events on
                         condition changes.
- delete:                only for an external Ray cluster (``spec.ray.address``): the
                         finalizer removes the gateway first, so its actors in that
                         cluster are released before the SDD goes; everything else
                         goes by ownerReferences.
"""

from __future__ import annotations

import json
import time
from typing import Any

import kopf

from specd.operator import naming
from specd.operator.crd import PLURAL
from specd.operator.kube import KubeClient, object_path
from specd.operator.reconcile import OperatorContext, observe, write_status
from specd.operator.status import transitions
from specd.workers.config import API_GROUP, API_VERSION

RESOURCE = (API_GROUP, API_VERSION, PLURAL)


def _raw(body: Any) -> dict[str, Any]:
    """A kopf Body (nested mapping views) as plain dicts."""
    return json.loads(json.dumps(body, default=dict))


def _external_ray(spec: Any, **_: Any) -> bool:
    return bool((spec.get("ray") or {}).get("address"))


def operator_settings(settings: kopf.OperatorSettings | None = None) -> kopf.OperatorSettings:
    """Progress and diff-base in annotations: the status schema is structural and
    would prune kopf's own ``status.kopf`` bookkeeping."""
    settings = settings or kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{API_GROUP}/operator"
    settings.posting.level = 20  # logging.INFO and up become Events
    return settings


def build_registry(ctx: OperatorContext) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            ctx.client = KubeClient(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await ctx.close()

    async def reconcile_once(trigger: str, body: Any, logger: Any, write: bool) -> None:
        started = time.perf_counter()
        raw = _raw(body)
        try:
            result = await observe(ctx, raw)
            for kind, name, what in result.writes:
                kopf.info(body, reason=what.capitalize(), message=f"{kind} {name} {what}")
            if write:
                written = await write_status(ctx, raw, result.observation)
                if written is not None:
                    _announce(body, *written)
        except Exception as err:
            ctx.metrics.errors.labels(type(err).__name__).inc()
            ctx.metrics.reconciles.labels(trigger, "error").inc()
            raise
        finally:
            ctx.metrics.latency.observe(time.perf_counter() - started)
        invalid = result.observation.invalid
        ctx.metrics.reconciles.labels(trigger, "invalid" if invalid else "ok").inc()
        if invalid and not write:
            raise kopf.PermanentError(invalid)

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, field="spec", registry=registry)
    async def apply(body: Any, logger: Any, reason: Any = None, **_: Any) -> None:
        await reconcile_once(str(reason or "change"), body, logger, write=False)

    @kopf.timer(*RESOURCE, interval=ctx.poll_interval_s, registry=registry)
    async def poll(body: Any, logger: Any, **_: Any) -> None:
        await reconcile_once("poll", body, logger, write=True)

    @kopf.on.delete(*RESOURCE, when=_external_ray, registry=registry)
    async def release_external_actors(body: Any, namespace: str, name: str, **_: Any) -> None:
        assert ctx.client is not None
        path = object_path("apps/v1", "Deployment", namespace, naming.gateway_name(name))
        if await ctx.client.delete(path):
            kopf.info(body, reason="Releasing", message=f"deleting gateway {path}")
        if await ctx.client.get(path) is not None:
            raise kopf.TemporaryError("waiting for the gateway to stop", delay=5)

    return registry


def _announce(body: Any, old: Any, new: Any) -> None:
    """Events for condition changes: rollout progress, readiness, degradation."""
    for cond in transitions(new, old):
        if cond.type == "Degraded" and cond.status == "True":
            kopf.warn(body, reason=cond.reason, message=cond.message)
        elif cond.type == "Ready" and cond.status == "True":
            kopf.info(body, reason="Ready", message=cond.message)
        elif cond.type == "Progressing" and cond.status == "True":
            kopf.info(body, reason="RolloutProgress", message=cond.message)
