"""kopf handlers around `reconcile` (one registry per operator, built by `build_registry`).

- login:                 kopf's service-account / kubeconfig login; the same credentials
                         feed our `KubeClient`.
- create/update/resume:  ensure the children (fast reaction to a spec change); an
                         invalid spec is a `kopf.PermanentError` (no retry storm).
                         Updates trigger on ``spec`` only, never on ``status``.
- index + startup:       kopf keeps every SDD's latest body in an index; a loop
                         started at startup (`poller`) reconciles each of them every
                         poll interval: ensure children, poll the gateway, write
                         status (the only status writer), emit Events on condition
                         changes.  Not a kopf timer: timers put a finalizer on
                         every SDD.
- delete:                only for an external Ray cluster (``spec.ray.address``): the
                         finalizer has the gateway drain and kill its actors there
                         (``POST /admin/release``, with the admin token read from
                         the SDD's Secret),
                         then deletes it; everything else goes by ownerReferences (a
                         managed RayCluster takes its actors with it).  The poller
                         leaves an SDD that is being deleted alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import kopf

from specd.operator import naming
from specd.operator.crd import PLURAL
from specd.operator.kube import KubeClient, build_event, object_path
from specd.operator.poller import leads, poll_forever
from specd.operator.reconcile import (
    OperatorContext,
    now_rfc3339,
    observe,
    read_admin_token,
    release_gateway,
    write_status,
)
from specd.operator.status import transitions
from specd.workers.config import API_GROUP, API_VERSION, ray_namespace

RESOURCE = (API_GROUP, API_VERSION, PLURAL)
INDEX = "sdd_bodies"  # kopf passes the index to handlers under its handler id


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

    @kopf.index(*RESOURCE, id=INDEX, registry=registry)
    def sdd_bodies(namespace: str, name: str, body: Any, **_: Any) -> dict[Any, Any]:
        return {(namespace, name): _raw(body)}

    @kopf.on.startup(registry=registry)
    async def start_polling(**kwargs: Any) -> None:
        index = kwargs[INDEX]

        def bodies() -> list[dict[str, Any]]:
            return [body for store in index.values() for body in store]

        async def may_act() -> bool:
            # not before kopf has logged in (the login handler sets the client)
            return ctx.client is not None and await leads(ctx.client, ctx.peering)

        async def poll(body: dict[str, Any]) -> None:
            if not body["metadata"].get("deletionTimestamp"):  # going: leave its children be
                await reconcile_once("poll", body, write=True)

        ctx.poller = asyncio.create_task(
            poll_forever(bodies, poll, ctx.poll_interval_s, may_act), name="specd status poller"
        )

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        if ctx.poller is not None:
            ctx.poller.cancel()
        await ctx.close()

    async def post_events(raw: dict[str, Any], events: list[tuple[str, str, str]]) -> None:
        assert ctx.client is not None
        for type_, reason, message in events:
            await ctx.client.post_event(build_event(raw, type_, reason, message, now_rfc3339()))

    async def reconcile_once(trigger: str, body: Any, write: bool) -> None:
        started = time.perf_counter()
        raw = _raw(body)
        try:
            result = await observe(ctx, raw)
            events = [
                ("Normal", what.capitalize(), f"{kind} {name} {what}")
                for kind, name, what in result.writes
            ]
            if write:
                written = await write_status(ctx, raw, result.observation)
                if written is not None:
                    events += condition_events(*written)
            await post_events(raw, events)
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
    async def apply(body: Any, reason: Any = None, **_: Any) -> None:
        await reconcile_once(str(reason or "change"), body, write=False)

    @kopf.on.delete(*RESOURCE, when=_external_ray, registry=registry)
    async def release_external_actors(
        body: Any, namespace: str, name: str, runtime: Any, **_: Any
    ) -> None:
        """Engine actors outlive gateway pods (detached); on an external Ray cluster
        nothing else removes them, so the gateway kills them before it goes."""
        assert ctx.client is not None
        raw = _raw(body)
        path = object_path("apps/v1", "Deployment", namespace, naming.gateway_name(name))
        if await ctx.client.get(path) is None:
            return
        token = await read_admin_token(ctx.client, namespace, name)
        if token is None:
            released, error = None, f"no admin token in Secret {naming.admin_secret_name(name)}"
        else:
            released, error = await release_gateway(ctx, namespace, name, token)
        if released is None and runtime.total_seconds() < ctx.release_give_up_s:
            raise kopf.TemporaryError(f"gateway did not release its actors: {error}", delay=5)
        if released is None:
            event = ("Warning", "ActorsNotReleased", actors_left_message(raw, ctx, error))
        else:
            killed = ", ".join(released) or "none"
            event = ("Normal", "Released", f"the gateway drained and killed replicas: {killed}")
        await ctx.client.delete(path)
        await post_events(raw, [event, ("Normal", "Deleted", f"gateway {path}")])

    return registry


def actors_left_message(raw: dict[str, Any], ctx: OperatorContext, error: str | None) -> str:
    """What to tell the user when the gateway could not release its actors."""
    name, address = raw["metadata"]["name"], raw["spec"]["ray"]["address"]
    namespace = ray_namespace(raw["metadata"]["namespace"])
    return (
        f"the gateway did not release its actors in {ctx.release_give_up_s:.0f} s ({error}); "
        f"actors named specd-{name}-* may still run on Ray cluster {address} (namespace "
        f"'{namespace}'): ray.kill(ray.get_actor(NAME, namespace='{namespace}'))"
    )


def condition_events(old: Any, new: Any) -> list[tuple[str, str, str]]:
    """(type, reason, message) Events for condition changes: rollout progress,
    readiness, degradation.  Posted by our client, not ``kopf.info``: the poller runs
    outside kopf's per-object handlers, where kopf's event queue is not reachable."""
    events = []
    for cond in transitions(new, old):
        if cond.type == "Degraded" and cond.status == "True":
            events.append(("Warning", cond.reason, cond.message))
        elif cond.type == "Ready" and cond.status == "True":
            events.append(("Normal", "Ready", cond.message))
        elif cond.type == "Progressing" and cond.status == "True":
            events.append(("Normal", "RolloutProgress", cond.message))
    return events
