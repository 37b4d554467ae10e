"""The SpecDecodeDeployment CRD, generated from the pydantic config models.

One source of truth: ``spec`` is `DeploymentSpec`'s JSON schema and ``status`` is
`SddStatus`'s, rewritten into a Kubernetes *structural* schema (every ``$ref``
inlined, ``anyOf [T, null]`` -> ``T`` + ``nullable``, JSON-Schema 2020 exclusive bounds
-> OpenAPI 3.0 booleans, free-form dicts -> ``x-kubernetes-preserve-unknown-fields``,
``default: {}`` on optional sub-objects so the API server applies nested defaults).
Cross-field rules the schema cannot say are `CEL_RULES` (standard CEL in
``x-kubernetes-validations``); they mirror the pydantic validators in
`specd.workers.config`, which a test checks case by case.

``specd crd`` prints `crd_yaml()`; ``charts/specd/crds/specdecodedeployments.yaml`` is
that output (a test keeps them identical).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from specd.operator.status import SddStatus
from specd.workers.config import API_GROUP, API_VERSION, KIND, DeploymentSpec

PLURAL = "specdecodedeployments"
SINGULAR = "specdecodedeployment"
SHORT_NAMES = ["sdd"]
CRD_NAME = f"{PLURAL}.{API_GROUP}"


@dataclass(frozen=True, slots=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry on the object at ``path`` (under spec)."""

    path: tuple[str, ...]
    rule: str
    message: str


# The cross-field rules, in one place.  Each mirrors a pydantic validator in
# specd.workers.config (test_crd checks they agree on a grid of specs).
CEL_RULES: tuple[CelRule, ...] = (
    CelRule(
        (),
        "has(self.draft) || !has(self.speculative)",
        "spec.speculative needs spec.draft (the draft model folder and algorithm)",
    ),
    CelRule(
        (),
        "has(self.speculative) || !has(self.draft)",
        "spec.draft needs spec.speculative (numSteps, topk, numDraftTokens); "
        "add `speculative: {}` for the defaults",
    ),
    CelRule(
        ("draft",),
        "(has(self.algorithm) && self.algorithm in ['NGRAM', 'SUFFIX']) != has(self.path)",
        "spec.draft.path: give the draft model's folder for EAGLE and EAGLE3; leave it "
        "out for NGRAM and SUFFIX, which draft from tokens",
    ),
    CelRule(
        ("draft",),
        "!has(self.tokenMap) || !has(self.algorithm) || self.algorithm == 'EAGLE'",
        "spec.draft.tokenMap restricts an EAGLE draft's lm_head: leave it out for EAGLE3 "
        "(its own vocabulary map), NGRAM and SUFFIX",
    ),
    CelRule(
        (),
        "!has(self.speculative) || !has(self.speculative.ngram)"
        " || (has(self.draft) && has(self.draft.algorithm)"
        " && self.draft.algorithm in ['NGRAM', 'SUFFIX'])",
        "spec.speculative.ngram configures NGRAM or SUFFIX drafting only: drop it or "
        "change spec.draft.algorithm",
    ),
    CelRule(
        (),
        "!has(self.speculative) || !has(self.speculative.suffix)"
        " || (has(self.draft) && (!has(self.draft.algorithm) || self.draft.algorithm != 'NGRAM'))",
        "spec.speculative.suffix configures SUFFIX drafting, or hybrid drafting with EAGLE "
        "or EAGLE3: drop it or change spec.draft.algorithm",
    ),
    CelRule(
        ("speculative", "ngram"),
        "!has(self.minMatch) || !has(self.maxMatch) || self.minMatch <= self.maxMatch",
        "minMatch must be at most maxMatch",
    ),
    # gpus is a CEL double, tensor an int: double() on both sides (Kubernetes types a
    # `number` field double; a JSON integer there is an int to cel-python)
    CelRule(
        (),
        "double(self.resources.gpus) == 0.0"
        " || double(self.resources.gpus) == double(self.parallelism.tensor)"
        " || (self.parallelism.tensor == 1 && double(self.resources.gpus) < 1.0)",
        "spec.resources.gpus must be 0 or equal to spec.parallelism.tensor "
        "(or below 1 to share one GPU at tensor 1): one GPU per rank",
    ),
    CelRule(
        ("speculative",),
        "self.topk != 1 || self.numDraftTokens == self.numSteps + 1",
        "numDraftTokens must be numSteps + 1 when topk is 1 "
        "(a chain verifies the root and one token per step)",
    ),
    CelRule(
        ("speculative",),
        "self.topk == 1 || self.numDraftTokens <= self.topk * self.numSteps + 1",
        "numDraftTokens must be at most topk * numSteps + 1 (the tree has no more nodes)",
    ),
    CelRule(
        ("kvCache",),
        "!(has(self.maxTokens) && has(self.memFraction))",
        "set only one of maxTokens or memFraction",
    ),
    CelRule(
        ("autoscaling",),
        "self.minReplicas <= self.maxReplicas",
        "minReplicas must be at most maxReplicas",
    ),
    CelRule(
        ("ray",),
        "!(has(self.address) && has(self.cluster))",
        "set only one of address (an existing Ray cluster) or cluster "
        "(overrides for the RayCluster the operator manages)",
    ),
)

PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Draft", "type": "string", "jsonPath": ".status.speculation.algorithm"},
    {"name": "Accept-Len", "type": "number", "jsonPath": ".status.speculation.acceptLength"},
    {"name": "KV-Usage", "type": "number", "jsonPath": ".status.kv.usage"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP = {"title", "additionalProperties", "$defs"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """One pydantic JSON-schema node -> a structural OpenAPI v3 node."""
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:  # inline, keeping sibling keys (default, description)
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **{k: v for k, v in node.items() if k != "title"}}
    options = node.get("anyOf")
    if options is not None:
        non_null = [o for o in options if o.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {options}")
        rest = {k: v for k, v in node.items() if k not in _DROP and k != "anyOf"}
        if rest.get("default", 0) is None:
            rest.pop("default")
        return {**_structural(non_null[0], defs), **rest, "nullable": True}
    out: dict[str, Any] = {}
    free_form = (
        node.get("type") == "object"
        and "properties" not in node
        and not isinstance(node.get("additionalProperties"), dict)
    )
    for key, value in node.items():
        if key in _DROP and not (key == "additionalProperties" and isinstance(value, dict)):
            continue
        if key in ("properties",):
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if free_form:
        out["x-kubernetes-preserve-unknown-fields"] = True
    for name, sub in out.get("properties", {}).items():
        optional = name not in out.get("required", ())
        if optional and "default" not in sub and not sub.get("nullable"):
            if sub.get("type") == "object" and "properties" in sub:
                sub["default"] = {}
            elif sub.get("type") == "array":
                sub["default"] = []
    return out


def structural_schema(model: type) -> dict[str, Any]:
    """A pydantic model's (camelCase, validation-mode) schema as a structural schema."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    return node


def _at(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for name in path:
        schema = schema["properties"][name]
    return schema


def spec_schema() -> dict[str, Any]:
    schema = structural_schema(DeploymentSpec)
    for rule in CEL_RULES:
        node = _at(schema, rule.path)
        node.setdefault("x-kubernetes-validations", []).append(
            {"rule": rule.rule, "message": rule.message}
        )
    return schema


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    status = _without_defaults(structural_schema(SddStatus))  # written, never defaulted
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["specd"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A speculative-decoding LLM deployment served by specd",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status,
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = (
        "# Generated by `specd crd` from specd.workers.config (do not edit by hand).\n"
        "# Regenerate: specd crd > charts/specd/crds/specdecodedeployments.yaml\n"
    )
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
