"""CR admission as the API server does it, approximated offline (tests only).

Order as in kube-apiserver: apply the schema's defaults, check the structural
schema (jsonschema; unknown fields refused as with ``kubectl --validate=strict``),
then every ``x-kubernetes-validations`` rule with cel-python (standard CEL only;
Kubernetes' CEL library extensions and cost limits are not modelled).
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema


def _openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI v3.0 quirks -> JSON Schema: boolean exclusive bounds, nullable, strictness."""
    if isinstance(node, list):
        return [_openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: _openapi_to_jsonschema(v)
        for k, v in node.items()
        if not k.startswith("x-kubernetes") and k not in ("nullable", "default")
    }
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(bound) is True:
            out[bound] = out.pop(limit)
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill absent fields that have a default, depth first."""
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _rules(schema: dict[str, Any], value: Any, path: str):
    """(path, rule, object) for every CEL rule on a node present in ``value``."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value and value[name] is not None:
                yield from _rules(sub, value[name], f"{path}.{name}")


class Admission:
    def __init__(self, crd: dict[str, Any]):
        self.schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        self.validator = jsonschema.Draft7Validator(_openapi_to_jsonschema(self.schema))
        self.env = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def _program(self, rule: str):
        if rule not in self._programs:
            self._programs[rule] = self.env.program(self.env.compile(rule))
        return self._programs[rule]

    def admit(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """(the defaulted object, error messages); no messages means admitted."""
        obj = apply_defaults(self.schema, copy.deepcopy(obj))
        errors = [
            f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in self.validator.iter_errors(obj)
        ]
        if errors:
            return obj, errors
        for path, rule, value in _rules(self.schema, obj, ""):
            verdict = self._program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
            if not (isinstance(verdict, celpy.celtypes.BoolType) and bool(verdict)):
                errors.append(f"{path.lstrip('.')}: Invalid value: {rule['message']}")
        return obj, errors
