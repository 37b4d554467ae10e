"""The generated CRD: examples admitted, bad CRs refused with the right message, CEL
rules agreeing with the pydantic validators, the chart's copy up to date.

Admission is approximated offline (`admission.Admission`: defaults, jsonschema,
cel-python); kubectl against the fake API server exercises the same path in
test_operator.py."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from specd.operator.crd import CEL_RULES, build_crd, crd_yaml
from specd.operator.testing.admission import Admission
from specd.workers.config import SpecDecodeDeployment

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted([*(REPO / "examples").glob("*.yaml"), *(REPO / "e2e" / "kind").glob("*.yaml")])


@pytest.fixture(scope="module")
def admission() -> Admission:
    return Admission(build_crd())


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"demo.yaml", "gpu-eagle3-tree.yaml", "adaptive.yaml", "external-ray.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_admitted_and_parses(admission, path):
    doc = yaml.safe_load(path.read_text())
    admitted, errors = admission.admit(doc)
    assert errors == []
    # what the API server stores (defaults applied) is still a valid deployment
    sdd = SpecDecodeDeployment.model_validate(admitted)
    assert sdd.metadata.name == doc["metadata"]["name"]


def test_tree_example_is_the_paged_tree_case():
    spec = SpecDecodeDeployment.model_validate(
        yaml.safe_load((REPO / "examples/gpu-eagle3-tree.yaml").read_text())
    ).spec
    assert (spec.kv_cache.page_size, spec.speculative.topk, spec.draft.algorithm.value) == (
        64,
        8,
        "EAGLE3",
    )


def _demo() -> dict:
    """The demo example without speculation: the base every bad CR below changes."""
    doc = yaml.safe_load((REPO / "examples/demo.yaml").read_text())
    for key in ("draft", "speculative"):
        doc["spec"].pop(key, None)
    return doc


def _with(path: str, value) -> dict:
    doc = _demo()
    node = doc
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return doc


SPEC = {"draft": {"path": "/d"}}
BAD = [
    ("page-size-zero", _with("spec.kvCache.pageSize", 0), "spec.kvCache.pageSize"),
    ("unknown-field", _with("spec.kvCache.pages", 4), "'pages' was unexpected"),
    ("backend-enum", _with("spec.attentionBackend", "cuda"), "spec.attentionBackend"),
    ("negative-replicas", _with("spec.replicas", -1), "spec.replicas"),
    ("strict-mem-3", _with("spec.debug.strictMemCheck", 3), "spec.debug.strictMemCheck"),
    ("no-model", {**_demo(), "spec": {"replicas": 1}}, "'model' is a required property"),
    ("bad-interval", _with("spec.metrics.interval", "soon"), "spec.metrics.interval"),
    (
        "ema-alpha-zero",
        _with("spec.speculative", {"adaptive": {"emaAlpha": 0}}),
        "spec.speculative.adaptive.emaAlpha",
    ),
    (
        "speculative-without-draft",
        _with("spec.speculative", {"numSteps": 3, "topk": 1, "numDraftTokens": 4}),
        "spec.speculative needs spec.draft",
    ),
    ("draft-without-speculative", _with("spec.draft", {"path": "/d"}), "spec.draft needs"),
    (
        "chain-wrong-tokens",
        {
            **_demo(),
            "spec": {
                **_demo()["spec"],
                **SPEC,
                "speculative": {"numSteps": 3, "topk": 1, "numDraftTokens": 5},
            },
        },
        "numDraftTokens must be numSteps + 1 when topk is 1",
    ),
    (
        "tree-too-many-tokens",
        {
            **_demo(),
            "spec": {
                **_demo()["spec"],
                **SPEC,
                "speculative": {"numSteps": 2, "topk": 4, "numDraftTokens": 10},
            },
        },
        "numDraftTokens must be at most topk * numSteps + 1",
    ),
    (
        "ngram-with-a-path",
        {
            **_demo(),
            "spec": {
                **_demo()["spec"],
                "draft": {"algorithm": "NGRAM", "path": "/d"},
                "speculative": {},
            },
        },
        "spec.draft.path: give the draft model's folder",
    ),
    (
        "ngram-settings-for-eagle",
        {
            **_demo(),
            "spec": {**_demo()["spec"], **SPEC, "speculative": {"ngram": {"maxMatch": 4}}},
        },
        "spec.speculative.ngram configures NGRAM or SUFFIX drafting only",
    ),
    (
        "kv-both-sizes",
        _with("spec.kvCache", {"maxTokens": 10, "memFraction": 0.5}),
        "set only one of maxTokens or memFraction",
    ),
    (
        "autoscaling-bounds",
        _with("spec.autoscaling", {"minReplicas": 3, "maxReplicas": 2}),
        "minReplicas must be at most maxReplicas",
    ),
    ("autoscaling-no-max", _with("spec.autoscaling", {}), "'maxReplicas' is a required property"),
    (
        "ray-address-and-cluster",
        _with("spec.ray", {"address": "h:6379", "cluster": {}}),
        "set only one of address",
    ),
    ("tensor-enum", _with("spec.parallelism", {"tensor": 3}), "spec.parallelism.tensor"),
    (
        "gpus-not-tensor",
        {
            **_demo(),
            "spec": {**_demo()["spec"], "parallelism": {"tensor": 4}, "resources": {"gpus": 2}},
        },
        "spec.resources.gpus must be 0 or equal to spec.parallelism.tensor",
    ),
    (
        "collective-timeout-zero",
        _with("spec.parallelism", {"collectiveTimeoutSeconds": 0}),
        "spec.parallelism.collectiveTimeoutSeconds",
    ),
    (
        "collective-timeout-huge",
        _with("spec.parallelism", {"collectiveTimeoutSeconds": 1e15}),
        "spec.parallelism.collectiveTimeoutSeconds",
    ),
]


@pytest.mark.parametrize("doc,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_crs_are_refused_with_the_expected_message(admission, doc, expected):
    _, errors = admission.admit(doc)
    assert errors, "admitted a bad CR"
    assert any(expected in e for e in errors), errors


def _pydantic_ok(spec: dict) -> bool:
    try:
        SpecDecodeDeployment.model_validate(
            {
                "apiVersion": "specd.dev/v1alpha1",
                "kind": "SpecDecodeDeployment",
                "metadata": {"name": "x"},
                "spec": spec,
            }
        )
    except ValidationError:
        return False
    return True


def _parity_cases():
    base = {"model": {"path": "/m"}}
    for steps, topk, tokens in itertools.product(
        (1, 2, 3, 5), (1, 2, 4, 8), (2, 3, 4, 6, 9, 17, 41)
    ):
        yield {
            **base,
            **SPEC,
            "speculative": {"numSteps": steps, "topk": topk, "numDraftTokens": tokens},
        }
    for draft, spec in itertools.product((None, {"path": "/d"}), (None, {})):
        case = dict(base)
        if draft is not None:
            case["draft"] = draft
        if spec is not None:
            case["speculative"] = spec
        yield case
    drafts = ({"path": "/d"}, {"algorithm": "NGRAM"}, {"algorithm": "NGRAM", "path": "/d"},
              {"algorithm": "EAGLE3"}, {"algorithm": "EAGLE3", "path": "/d"},
              {"algorithm": "SUFFIX"}, {"algorithm": "SUFFIX", "path": "/d"})  # fmt: skip
    ngrams = (None, {}, {"minMatch": 2, "maxMatch": 3}, {"minMatch": 4, "maxMatch": 3},
              {"minMatch": 9}, {"maxMatch": 2})  # fmt: skip
    for draft, ngram, suffix in itertools.product(drafts, ngrams, (None, {"maxDepth": 4})):
        speculative = {} if ngram is None else {"ngram": ngram}
        if suffix is not None:
            speculative["suffix"] = suffix
        yield {**base, "draft": draft, "speculative": speculative}
    for draft in drafts:
        yield {**base, "draft": {**draft, "tokenMap": "/d/map.json"}, "speculative": {}}
    for kv in ({}, {"maxTokens": 8}, {"memFraction": 0.5}, {"maxTokens": 8, "memFraction": 0.5}):
        yield {**base, "kvCache": kv}
    for ray in ({}, {"address": "a:1"}, {"cluster": {"x": 1}}, {"address": "a:1", "cluster": {}}):
        yield {**base, "ray": ray}
    for tensor, gpus in itertools.product(
        (None, 1, 2, 4, 8), (None, 0, 0.0, 0.5, 1, 1.5, 2, 4, 4.0, 8)
    ):
        case = dict(base)
        if tensor is not None:
            case["parallelism"] = {"tensor": tensor}
        if gpus is not None:
            case["resources"] = {"gpus": gpus}
        yield case
    for low, high in itertools.product((None, 1, 2, 3), (1, 2, 3)):
        bounds = {"maxReplicas": high} | ({} if low is None else {"minReplicas": low})
        yield {**base, "autoscaling": bounds}


def test_cel_rules_agree_with_the_pydantic_validators(admission):
    cases = list(_parity_cases())
    verdicts = {True: 0, False: 0}
    for spec in cases:
        doc = {
            "apiVersion": "specd.dev/v1alpha1",
            "kind": "SpecDecodeDeployment",
            "metadata": {"name": "x"},
            "spec": copy.deepcopy(spec),
        }
        admitted = not admission.admit(doc)[1]
        assert admitted == _pydantic_ok(spec), spec
        verdicts[admitted] += 1
    assert verdicts[True] > 20 and verdicts[False] > 20  # both sides exercised


def test_every_cel_rule_is_in_the_crd():
    """Each rule on the schema node its path names (the YAML text folds long rules over
    lines, so the parsed document is checked)."""
    crd = yaml.safe_load(crd_yaml())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for rule in CEL_RULES:
        node = spec
        for name in rule.path:
            node = node["properties"][name]
        assert {"rule": rule.rule, "message": rule.message} in node["x-kubernetes-validations"]


def test_schema_is_structural():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def walk(node, path):
        if not isinstance(node, dict):
            return
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if "properties" in node:
            assert node.get("type") == "object", path
            assert "additionalProperties" not in node, path
        elif node.get("type") == "object" and path != ".metadata":  # a map or free-form
            assert "additionalProperties" in node or node.get(
                "x-kubernetes-preserve-unknown-fields"
            ), path
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(key) in (None, True), path
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}")
        walk(node.get("items"), f"{path}[]")

    walk(schema, "")
    spec = schema["properties"]["spec"]["properties"]
    assert spec["kvCache"]["default"] == {}
    assert spec["kvCache"]["properties"]["pageSize"] == {
        "default": 1,
        "maximum": 256,
        "minimum": 1,
        "type": "integer",
    }
    assert spec["attentionBackend"]["enum"] == ["auto", "torch", "cpu", "flashinfer", "triton"]
    assert spec["speculative"]["properties"]["minAcceptLength"]["default"] == 1.5


def test_crd_names_subresources_and_columns():
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert crd["metadata"]["name"] == "specdecodedeployments.specd.dev"
    assert crd["spec"]["names"]["shortNames"] == ["sdd"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert [c["name"].upper() for c in version["additionalPrinterColumns"]] == [
        "READY",
        "REPLICAS",
        "DRAFT",
        "ACCEPT-LEN",
        "KV-USAGE",
        "AGE",
    ]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for column in version["additionalPrinterColumns"]:
        root, *rest = column["jsonPath"].strip(".").split(".")
        if root == "status":  # every status column points at a field the status schema has
            node = {"properties": status}
            for part in rest:
                node = node["properties"][part]


def test_chart_crd_is_the_generated_one():
    chart = (REPO / "charts/specd/crds/specdecodedeployments.yaml").read_text()
    assert chart == crd_yaml(), (
        "regenerate: specd crd > charts/specd/crds/specdecodedeployments.yaml"
    )


def test_specd_crd_command_prints_it():
    out = subprocess.run(
        [sys.executable, "-m", "specd.workers.cli", "crd"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert out == crd_yaml()
    assert yaml.safe_load(out)["kind"] == "CustomResourceDefinition"
