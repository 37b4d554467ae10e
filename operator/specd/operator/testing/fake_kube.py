"""A fake Kubernetes API server for operator tests: kmock's emulator plus what it lacks.

kmock 0.8's `KubernetesEmulator` serves discovery, create / get / list / watch, merge
and JSON patches and finalizers over real HTTP.  This thin subclass adds what kopf and
kubectl need from a real server (DESIGN §8):

- ``metadata.uid / resourceVersion / generation / creationTimestamp`` stamping
  (generation bumps only on spec changes);
- patch semantics: a failed JSON-patch ``test`` is 422 (kmock: 500), a merge patch
  carrying a stale ``metadata.resourceVersion`` is 409, ``/status`` changes only the
  status and the main resource never does, ``/scale`` reads and writes an
  ``autoscaling/v1 Scale``; releasing the last finalizer of a deleting object deletes it;
- admission for CRs: the CRD's defaults, schema and CEL rules (`admission.Admission`),
  refused with 422 like the real server;
- server-side printing: ``Accept: ...;as=Table`` lists render the CRD's
  ``additionalPrinterColumns`` (what ``kubectl get`` shows);
- discovery fixes: core ``groupVersion: v1`` (kmock says ``/v1``), ``/scale`` reported
  as ``autoscaling/v1 Scale``;
- an OpenAPI v3 document per CRD group-version whose PATCH takes ``fieldValidation``,
  so kubectl's default ``--validate=strict`` asks the server (admission) to validate;
- watches subscribe before the initial listing, so no event falls between the two.

No controllers or garbage collection run: tests play them and assert ownerReferences.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock

from specd.operator.testing.admission import Admission


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return aiohttp.web.json_response(body, status=code)


def _jsonpath(obj: Any, path: str) -> Any:
    for part in path.strip(".").split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _age(timestamp: str | None) -> str | None:
    if not timestamp:
        return None
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


@attrs.define(kw_only=True)
class FakeKube(kmock.KubernetesEmulator):
    crds: dict[Any, dict[str, Any]] = attrs.field(factory=dict)  # resource -> CRD object
    namespaces: tuple[str, ...] = ("default",)
    _admissions: dict[Any, Admission] = attrs.field(factory=dict, init=False)
    _rv: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)

    # -- declaring resources --------------------------------------------------
    def serve(
        self,
        group: str,
        version: str,
        plural: str,
        kind: str,
        *,
        namespaced: bool = True,
        subresources: tuple[str, ...] = (),
        shortnames: tuple[str, ...] = (),
    ) -> Any:
        res = kmock.resource(group, version, plural)
        self.resources[res] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=namespaced,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            shortnames=set(shortnames),
            subresources=set(subresources),
        )
        return res

    def install_crd(self, crd: dict[str, Any]) -> Any:
        spec = crd["spec"]
        version = spec["versions"][0]
        res = self.serve(
            spec["group"],
            version["name"],
            spec["names"]["plural"],
            spec["names"]["kind"],
            subresources=tuple(version.get("subresources", {})),
            shortnames=tuple(spec["names"].get("shortNames", ())),
        )
        self.crds[res] = crd
        self._admissions[res] = Admission(crd)
        return res

    def get(self, res: Any, namespace: str, name: str) -> dict[str, Any] | None:
        key = (res, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    # -- discovery --------------------------------------------------------------
    async def _serve_version(self, request: kmock.Request) -> Any:
        doc = await super()._serve_version(request)
        if request.resource.group == "":
            doc["groupVersion"] = "v1"
        for entry in doc["resources"]:
            if "/" in entry["name"]:  # subresources carry no short names or categories
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
            if entry["name"].endswith("/scale"):
                entry.update(group="autoscaling", version="v1", kind="Scale")
        return doc

    # -- namespaces: kmock 0.8 cannot parse /api/v1/namespaces (it reads "namespaces"
    # as the start of a namespaced path); kopf lists and watches it to find namespaces.
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.startswith("/openapi/v3"):
            return self._openapi_v3(raw_request.path)
        if raw_request.path != "/api/v1/namespaces":
            return await super().__call__(raw_request)
        if raw_request.query.get("watch") != "true":
            items = [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                for ns in self.namespaces
            ]
            return aiohttp.web.json_response(
                {"kind": "NamespaceList", "apiVersion": "v1", "metadata": {}, "items": items}
            )
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw_request)
        await asyncio.Event().wait()  # namespaces never change here; closed at shutdown
        return response

    # -- OpenAPI v3: enough for kubectl to see that the server validates fields (it
    # then sends ``fieldValidation=Strict`` and leaves validation to admission)
    def _openapi_v3(self, path: str) -> aiohttp.web.Response:
        docs = {f"apis/{res.group}/{res.version}": res for res in self.crds}
        if path.rstrip("/") == "/openapi/v3":
            paths = {gv: {"serverRelativeURL": f"/openapi/v3/{gv}"} for gv in docs}
            return aiohttp.web.json_response({"paths": paths})
        res = docs.get(path.removeprefix("/openapi/v3/"))
        if res is None:
            return _status(404, "NotFound", f"no OpenAPI v3 document at {path}")
        return aiohttp.web.json_response(self._openapi_document(res))

    def _openapi_document(self, res: Any) -> dict[str, Any]:
        crd = self.crds[res]
        kind = crd["spec"]["names"]["kind"]
        gvk = {"group": res.group, "version": res.version, "kind": kind}
        version = next(v for v in crd["spec"]["versions"] if v["name"] == res.version)
        schema = {**version["schema"]["openAPIV3Schema"], "x-kubernetes-group-version-kind": [gvk]}
        query = [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}]
        item = f"/apis/{res.group}/{res.version}/namespaces/{{namespace}}/{res.plural}/{{name}}"
        operation = {"x-kubernetes-group-version-kind": gvk, "parameters": query}
        return {
            "openapi": "3.0.0",
            "info": {"title": "fake", "version": "v0"},
            "paths": {item: {"patch": operation, "put": operation}},
            "components": {"schemas": {f"{res.group}.{res.version}.{kind}": schema}},
        }

    # -- request routing ------------------------------------------------------
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None:
            return await super()._handle(request)
        if request.action == kmock.action.CREATE:
            refused = self._stamp_new(request)
            if refused is not None:
                return refused
        elif request.action == kmock.action.UPDATE:
            return await self._update(request)
        elif request.action == kmock.action.FETCH and request.subresource == "scale":
            obj = self.get(res, request.namespace, request.name)
            if obj is None:
                return _status(404, "NotFound", f"{res.plural} {request.name!r} not found")
            return aiohttp.web.json_response(self._scale_of(obj))
        elif request.action in (kmock.action.LIST, kmock.action.FETCH) and "as=Table" in (
            request.headers.get("Accept", "")
        ):
            return await self._table(request)
        return await super()._handle(request)

    def _stamp_new(self, request: kmock.Request) -> aiohttp.web.Response | None:
        obj = request.data
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        admission = self._admissions.get(request.resource)
        if admission is not None:
            admitted, errors = admission.admit(obj)
            if errors:
                return self._invalid(request, meta.get("name"), errors)
            obj.clear()
            obj.update(admitted)
            meta = obj["metadata"]
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=str(next(self._rv)),
            generation=1,
            creationTimestamp=_now(),
        )
        return None

    def _invalid(self, request: kmock.Request, name: str | None, errors: list[str]) -> Any:
        kind = self.resources[request.resource].kind
        message = f'{kind}.{request.resource.group} "{name}" is invalid: ' + ", ".join(errors)
        return _status(422, "Invalid", message)

    @staticmethod
    def _scale_of(obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            },
            "spec": {"replicas": obj.get("spec", {}).get("replicas", 0)},
            "status": {
                "replicas": obj.get("status", {}).get("replicas", 0),
                "selector": obj.get("status", {}).get("selector", ""),
            },
        }

    # -- patches ------------------------------------------------------------------
    @staticmethod
    def _apply_patch(target: dict[str, Any], patch: Any, content_type: str) -> dict[str, Any]:
        if "json-patch" in content_type:
            return jsonpatch.apply_patch(target, patch, in_place=False)
        return json_merge(target, patch)

    async def _update(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res, sub = request.resource, request.subresource
        key = (res, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                return _status(404, "NotFound", f"{res.plural} {request.name!r} not found")
            current = copy.deepcopy(self.objects[key].raw)
            meta = current["metadata"]
            patch = request.data
            wanted_rv = (
                patch.get("metadata", {}).get("resourceVersion")
                if isinstance(patch, dict)
                else None
            )
            if wanted_rv is not None and wanted_rv != meta["resourceVersion"]:
                return _status(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your changes "
                    "to the latest version and try again",
                )
            target = self._scale_of(current) if sub == "scale" else current
            try:
                patched = self._apply_patch(target, patch, request.headers.get("Content-Type", ""))
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as err:
                return _status(422, "Invalid", f"the JSON patch failed: {err}")
            new = self._merge_subresource(current, patched, sub, res)
            if new.get("spec") != current.get("spec"):
                admission = self._admissions.get(res)
                if admission is not None and sub != "status":
                    new, errors = admission.admit(new)
                    if errors:
                        return self._invalid(request, request.name, errors)
                new["metadata"]["generation"] = int(meta.get("generation", 1)) + 1
            for fixed in ("uid", "name", "namespace", "creationTimestamp"):
                if fixed in meta:
                    new["metadata"][fixed] = meta[fixed]
            new["metadata"]["resourceVersion"] = str(next(self._rv))
            self.objects[key].patch(jsonpatch.make_patch(current, new).patch)
            released = new["metadata"].get("deletionTimestamp") and not new["metadata"].get(
                "finalizers"
            )
            if released:
                self.objects[key].delete()
            await self._buses[res].put(
                {"type": "DELETED" if released else "MODIFIED", "object": new}
            )
        body = self._scale_of(new) if sub == "scale" else new
        return aiohttp.web.json_response(body)

    def _merge_subresource(
        self, current: dict[str, Any], patched: dict[str, Any], sub: str | None, res: Any
    ) -> dict[str, Any]:
        new = copy.deepcopy(current)
        if sub == "scale":
            new.setdefault("spec", {})["replicas"] = patched["spec"]["replicas"]
        elif sub == "status":
            new["status"] = patched.get("status", {})
        else:
            new = patched
            if "status" in self.resources[res].subresources:
                new["status"] = current.get("status")
                if new["status"] is None:
                    new.pop("status")
        return new

    # -- server-side printing -------------------------------------------------
    async def _table(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        async with self._lock:
            objs = [
                copy.deepcopy(obj.raw)
                for (r, ns, name), obj in self.objects.items()
                if r == res
                and not obj.deleted
                and (request.namespace is None or ns == request.namespace)
                and (request.name is None or name == request.name)
            ]
        if request.name is not None and not objs:
            return _status(404, "NotFound", f'{res.plural} "{request.name}" not found')
        crd = self.crds.get(res)
        columns = (
            crd["spec"]["versions"][0].get("additionalPrinterColumns", [])
            if crd
            else [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        )
        definitions = [{"name": "Name", "type": "string", "format": "name", "priority": 0}]
        definitions += [
            {"name": c["name"], "type": c["type"], "format": "", "priority": c.get("priority", 0)}
            for c in columns
        ]

        def cell(obj: dict[str, Any], column: dict[str, Any]) -> Any:
            value = _jsonpath(obj, column["jsonPath"])
            return _age(value) if column["type"] == "date" else value

        rows = [
            {
                "cells": [obj["metadata"]["name"], *(cell(obj, c) for c in columns)],
                "object": {
                    "apiVersion": "meta.k8s.io/v1",
                    "kind": "PartialObjectMetadata",
                    "metadata": obj["metadata"],
                },
            }
            for obj in sorted(objs, key=lambda o: o["metadata"]["name"])
        ]
        table = {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "Table",
            "metadata": {"resourceVersion": str(next(self._rv))},
            "columnDefinitions": definitions,
            "rows": rows,
        }
        return aiohttp.web.Response(text=json.dumps(table), content_type="application/json")

    # -- watch ----------------------------------------------------------------------
    async def _serve_watch(self, request: kmock.Request) -> Any:
        yield b""
        bus = self._buses[request.resource]
        async with self._lock:  # subscribe and snapshot atomically
            marker = await bus.mark()
            existing = [
                copy.deepcopy(obj.raw)
                for (r, ns, name), obj in self.objects.items()
                if self._watched(request, r, ns, name) and not obj.deleted
            ]
        try:
            for raw in existing:
                yield {"type": "ADDED", "object": raw}
            async for event in bus.stream(since=marker):
                meta = event.get("object", {}).get("metadata", {})
                if self._watched(
                    request, request.resource, meta.get("namespace"), meta.get("name")
                ):
                    yield event
        finally:
            await bus.unmark(marker)

    @staticmethod
    def _watched(request: kmock.Request, res: Any, namespace: str | None, name: str) -> bool:
        return (
            res == request.resource
            and (request.namespace is None or namespace == request.namespace)
            and (request.name is None or name == request.name)
        )


def json_merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (kubectl and kopf send these for custom resources)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = json_merge(out.get(key), value)
    return out
