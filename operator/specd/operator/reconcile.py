"""One level-based reconcile: ordered, idempotent ``ensure_*`` steps, then the gateway poll.

    parse spec (pydantic only: what an engine refuses when it loads, such as an
    attention backend that cannot serve the layout, the gateway reports)
      -> [managed Ray: a replica's ranks fit one worker pod?  else InvalidSpec]
      -> ensure ConfigMap -> ensure admin token Secret (created once, never patched)
      -> [managed Ray: KubeRay served? -> ensure RayCluster]
      -> ensure gateway Deployment -> ensure Service -> [ensure ServiceMonitor]
      -> GET <gateway>/admin/status, parsed as `AdminStatus` (a document that breaks
         the contract is a failed poll naming the field, never zeros)
      => `Observation` (status.compute_status turns it into the CR status)

Every ensure reads the live object first and writes only what differs from the
desired one (a create that meets 409 counts as "exists"), so running it every poll
costs one GET per child.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from pydantic import ValidationError

from specd.operator import children, naming
from specd.operator.children import ChildOptions, Owner
from specd.operator.kube import KubeClient, object_path
from specd.operator.metrics import OperatorMetrics
from specd.operator.poller import Peering
from specd.operator.status import (
    Observation,
    SddStatus,
    compute_status,
    merge_patch,
    parse_status,
    status_document,
)
from specd.workers.config import SpecDecodeDeployment, format_validation_error
from specd.workers.contracts import AdminStatus, field_errors

log = logging.getLogger(__name__)

STATUS_WRITE_ATTEMPTS = 5


# the gateway drains open requests (up to 60 s) before it kills its actors
RELEASE_TIMEOUT_S = 90.0


@dataclass
class OperatorContext:
    """Everything the handlers share; `client` is set by the login handler."""

    options: ChildOptions = field(default_factory=ChildOptions)
    poll_interval_s: float = 10.0
    gateway_timeout_s: float = 3.0
    gateway_url: Callable[[str, str], str] = lambda namespace, name: naming.gateway_url(
        name, namespace
    )
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    peering: Peering | None = None  # None: standalone, the poller always acts
    # a delete finalizer waits this long for the gateway to release its actors
    release_give_up_s: float = 300.0
    client: KubeClient | None = None
    poller: asyncio.Task | None = None
    _http: aiohttp.ClientSession | None = None

    async def http(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.gateway_timeout_s)
            )
        return self._http

    async def close(self) -> None:
        for session in (self._http, self.client):
            if session is not None:
                await session.close()


def parse_sdd(body: dict[str, Any]) -> tuple[SpecDecodeDeployment | None, str | None]:
    """The CR as a validated deployment, or why not (the message names the field)."""
    meta = body.get("metadata", {})
    doc = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
        "spec": body.get("spec") or {},
    }
    try:
        return SpecDecodeDeployment.model_validate(doc), None
    except ValidationError as err:
        return None, format_validation_error(err)


def _subset(desired: Any, live: Any) -> bool:
    """Whether ``live`` already has everything ``desired`` says (server defaults aside)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(_subset(v, live.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(_subset(d, v) for d, v in zip(desired, live, strict=True))
        )
    return desired == live


async def ensure(
    client: KubeClient,
    desired: dict[str, Any],
    keep_live: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None,
) -> str:
    """Create or patch ``desired``; returns "created", "updated" or "unchanged".
    ``keep_live(desired, live)`` puts back what another controller owns in the live
    object before comparing."""
    meta = desired["metadata"]
    path = object_path(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    live = await client.get(path)
    if live is None:
        return "created" if await client.create(desired) is not None else "unchanged"
    if keep_live is not None:
        desired = keep_live(desired, live)
    if _subset(desired, live):
        return "unchanged"
    patch = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    await client.merge_patch(path, patch)
    return "updated"


async def ensure_admin_secret(client: KubeClient, owner: Owner) -> str:
    """The gateway's admin token Secret, created with a random token when absent;
    "created" or "unchanged".  Never patched: a reconcile never rotates the token (the
    running gateway holds it), and a create that meets 409 keeps the one there."""
    path = object_path("v1", "Secret", owner.namespace, naming.admin_secret_name(owner.name))
    if await client.get(path) is not None:
        return "unchanged"
    secret = children.build_admin_secret(owner, secrets.token_urlsafe(32))
    return "created" if await client.create(secret) is not None else "unchanged"


async def read_admin_token(client: KubeClient, namespace: str, name: str) -> str | None:
    """The admin token of SDD ``name`` from its Secret (None when it has none)."""
    live = await client.get(object_path("v1", "Secret", namespace, naming.admin_secret_name(name)))
    return None if live is None else children.admin_token_of(live)


@dataclass(frozen=True, slots=True)
class Pass:
    """One reconcile's outcome: what it saw and which children it wrote."""

    observation: Observation
    writes: tuple[tuple[str, str, str], ...] = ()  # (kind, name, created|updated)


async def ensure_children(
    ctx: OperatorContext, body: dict[str, Any]
) -> tuple[Observation, list[tuple[str, str, str]]]:
    meta = body["metadata"]
    generation = int(meta.get("generation") or 0)
    owner = Owner(meta["name"], meta["namespace"], meta["uid"])
    sdd, invalid = parse_sdd(body)
    if sdd is None:
        return Observation(generation, None, invalid=invalid), []
    cluster = None  # the RayCluster this SDD owns (None: spec.ray.address's cluster)
    if sdd.spec.ray.address is None:
        cluster = children.build_raycluster(sdd, owner, ctx.options)
        if (invalid := children.tensor_exceeds_workers(sdd, cluster)) is not None:
            return Observation(generation, None, invalid=invalid), []
    client = ctx.client
    assert client is not None, "the login handler sets the client"
    writes: list[tuple[str, str, str]] = []

    async def step(obj: dict[str, Any], keep_live=None) -> None:
        result = await ensure(client, obj, keep_live)
        if result != "unchanged":
            writes.append((obj["kind"], obj["metadata"]["name"], result))

    selector = naming.selector(owner.name, "engine")
    await step(children.build_configmap(sdd, owner))
    if await ensure_admin_secret(client, owner) == "created":  # before the pod mounts it
        writes.append(("Secret", naming.admin_secret_name(owner.name), "created"))
    if cluster is not None:
        if not await client.served("ray.io", "v1", "rayclusters"):
            return Observation(generation, sdd, kuberay_missing=True, selector=selector), writes
        await step(cluster, children.autoscaled_workers)
    await step(children.build_gateway_deployment(sdd, owner, ctx.options))
    await step(children.build_service(owner))
    if sdd.spec.metrics.service_monitor and await client.served(
        "monitoring.coreos.com", "v1", "servicemonitors"
    ):
        await step(children.build_servicemonitor(sdd, owner))
    endpoint = naming.gateway_url(owner.name, owner.namespace)
    return Observation(generation, sdd, endpoint=endpoint, selector=selector), writes


@dataclass(frozen=True, slots=True)
class GatewayPoll:
    """One ``GET /admin/status``: the document, or why there is none."""

    doc: AdminStatus | None = None
    error: str | None = None  # unreachable, an HTTP error, or the fields that are wrong
    invalid: bool = False  # it answered a document that breaks the contract


async def poll_gateway(ctx: OperatorContext, namespace: str, name: str) -> GatewayPoll:
    """The gateway's ``/admin/status`` parsed as `AdminStatus`.  A document that fails
    validation (a missing, renamed or mistyped field) is a failed poll whose error
    names the fields (``specd_operator_gateway_polls_total{result="invalid"}``)."""
    url = ctx.gateway_url(namespace, name) + "/admin/status"
    try:
        session = await ctx.http()
        async with session.get(url) as resp:
            if resp.status != 200:
                ctx.metrics.gateway_polls.labels("error").inc()
                return GatewayPoll(error=f"HTTP {resp.status} from {url}")
            raw = await resp.json()
    except (TimeoutError, aiohttp.ClientError, ValueError) as err:
        ctx.metrics.gateway_polls.labels("unreachable").inc()
        return GatewayPoll(error=f"{type(err).__name__} on {url}")
    try:
        doc = AdminStatus.model_validate(raw)
    except ValidationError as err:
        ctx.metrics.gateway_polls.labels("invalid").inc()
        log.warning("invalid /admin/status from %s: %s", url, field_errors(err))
        return GatewayPoll(error=f"{field_errors(err)} (from {url})", invalid=True)
    ctx.metrics.gateway_polls.labels("ok").inc()
    return GatewayPoll(doc)


async def release_gateway(
    ctx: OperatorContext, namespace: str, name: str, token: str
) -> tuple[list[str] | None, str | None]:
    """``POST /admin/release`` with the admin token (`read_admin_token`) and a JSON body,
    as the gateway requires: it drains and kills its actors (waited for, up to
    `RELEASE_TIMEOUT_S`).  (released replica names, None) or (None, why not)."""
    url = ctx.gateway_url(namespace, name) + "/admin/release"
    try:
        session = await ctx.http()
        async with session.post(
            url,
            json={},  # Content-Type: application/json
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S),
        ) as resp:
            if resp.status != 200:
                return None, f"HTTP {resp.status} from {url}: {(await resp.text())[:200]}"
            return list((await resp.json())["released"]), None
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as err:
        return None, f"{type(err).__name__} on {url}"


async def observe(ctx: OperatorContext, body: dict[str, Any]) -> Pass:
    """Ensure the children, then (when the spec is servable) poll the gateway."""
    observation, writes = await ensure_children(ctx, body)
    if observation.sdd is not None and not observation.kuberay_missing:
        meta = body["metadata"]
        poll = await poll_gateway(ctx, meta["namespace"], meta["name"])
        observation = Observation(
            observation.generation,
            observation.sdd,
            gateway=poll.doc,
            gateway_error=poll.error,
            gateway_invalid=poll.invalid,
            endpoint=observation.endpoint,
            selector=observation.selector,
        )
    return Pass(observation, tuple(writes))


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def write_status(
    ctx: OperatorContext, body: dict[str, Any], observation: Observation
) -> tuple[SddStatus, SddStatus] | None:
    """Compute and patch the status if it changed; retry 409s on a fresh read.

    Returns (old, new) when a new status was written, else None.
    """
    meta = body["metadata"]
    path = object_path(body["apiVersion"], body["kind"], meta["namespace"], meta["name"])
    client = ctx.client
    assert client is not None
    current = body
    for _ in range(STATUS_WRITE_ATTEMPTS):
        old_raw = current.get("status") or {}
        old = parse_status(old_raw)
        new = compute_status(observation, old, now_rfc3339())
        # a status that differs only in transition times is not a change
        if status_document(new) == old_raw:
            return None
        patch = merge_patch(old_raw, status_document(new))
        ok, _ = await client.patch_status(path, patch, meta_rv(current))
        if ok:
            ctx.metrics.status_writes.labels("written").inc()
            return old, new
        ctx.metrics.status_writes.labels("conflict").inc()
        fresh = await client.get(path)
        if fresh is None:
            return None  # deleted meanwhile
        current = fresh
    log.warning("status of %s: gave up after %d conflicts", path, STATUS_WRITE_ATTEMPTS)
    return None


def meta_rv(obj: dict[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("resourceVersion", ""))
