"""Cheaper EAGLE draft steps. spec.draft.tokenMap: a draft proposing only a token map's ids
(its lm_head cut to their rows) stays lossless, drafts nothing outside the map, and bad
maps are refused naming the field.  spec.draft.dtype: a bfloat16 draft beside a float32
target stays lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    check_exact_run,
    demo_prompts,
    metric_value,
    run_all,
    start_engine,
)
from specd.devtools.token_map import build, most_frequent
from specd.devtools.train_demo import corpus_files, read_texts, split_files
from specd.workers.config import ConfigError, load_deployment, spec_for_model
from specd.workers.engine.factory import auto_draft_dtype, draft_dtype
from specd.workers.model.config import ModelLoadError
from specd.workers.model.cpu_linear import CpuLinear, native_bfloat16_matmuls, prepack_supported
from specd.workers.model.token_map import head_rows, read_token_map

MAX_NEW = 32
ALWAYS = {"policy": {"costModel": {"enabled": False}}}  # every step verifies
SHIPPED_MAP = f"{DEMO_EAGLE}/token_map.json"
DEMO_YAML = Path(DEMO_TARGET).parents[1] / "demo.yaml"


@pytest.fixture(scope="module")
def demo_reference():
    """Demo prompts and their plain greedy outputs."""
    prompts = demo_prompts(6, 48)
    plain = start_engine(DEMO_TARGET, kvCache={"pageSize": 16})
    try:
        return prompts, [r[0] for r in run_all(plain, prompts, max_tokens=MAX_NEW, ignore_eos=True)]
    finally:
        plain.shutdown()


def demo_spec_engine(draft, page_size=16, topk=1, overlap=False):
    """The demo pair speculating at every step (4 draft steps) with ``draft`` fields."""
    steps = 4
    return start_engine(
        DEMO_TARGET,
        kvCache={"pageSize": page_size},
        scheduler={"overlap": overlap},
        draft={"path": DEMO_EAGLE, **draft},
        speculative={
            "numSteps": steps,
            "topk": topk,
            "numDraftTokens": steps + 1 if topk == 1 else 8,
            **ALWAYS,
        },
    )


def mapped_engine(token_map, page_size=16, topk=1, overlap=False):
    return demo_spec_engine({"tokenMap": str(token_map)}, page_size, topk, overlap)


def check_lossless(engine, demo_reference):
    """Greedy equal to plain decode (batch 1 and together), strict leak checks passed;
    -> the drafts accepted."""
    prompts, expected = demo_reference
    check_exact_run(engine, prompts, expected, MAX_NEW)
    assert metric_value(engine, "specd_leak_checks_total", result="ok") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
    return metric_value(engine, "specd_spec_accepted_tokens_total")


@pytest.mark.parametrize(
    ("page_size", "topk", "overlap"),
    [(16, 1, False), (1, 4, True), (16, 4, False)],
    ids=["chain-page16", "tree-page1-overlap", "tree-page16"],
)
def test_the_shipped_map_is_lossless_and_still_accepts(demo_reference, page_size, topk, overlap):
    engine = mapped_engine(SHIPPED_MAP, page_size, topk, overlap)
    assert check_lossless(engine, demo_reference) > 0


@pytest.mark.slow
def test_the_draft_proposes_nothing_outside_its_map(demo_reference, tmp_path):
    """A map without any token of the outputs: not one draft can be accepted (without the
    map the trained draft accepts most of them), and the outputs are unchanged."""
    _, expected = demo_reference
    used = {t for out in expected for t in out}
    file = tmp_path / "map.json"
    file.write_text(json.dumps([i for i in range(8192) if i not in used]))
    assert check_lossless(mapped_engine(file, topk=4), demo_reference) == 0


def test_a_map_of_the_outputs_tokens_loses_no_acceptance(demo_reference, tmp_path):
    """The map holds every output token: the chain accepts about as many drafts as without
    one (where the whole vocabulary's argmax is right, the map's is the same token; where
    it is wrong, the map's may be right)."""
    _, expected = demo_reference
    file = tmp_path / "map.pt"
    torch.save(torch.tensor(sorted({t for out in expected for t in out})), file)  # SGLang's form
    with_map = check_lossless(mapped_engine(file), demo_reference)
    engine = demo_spec_engine({})
    without = check_lossless(engine, demo_reference)
    assert without > 0 and with_map >= 0.95 * without


@pytest.mark.parametrize("layout", ["plain", "transposed", "packed"])
def test_head_rows_are_the_heads_exact_rows(layout):
    if layout == "packed" and not prepack_supported(torch.float32):
        pytest.skip("oneDNN cannot pack here")
    torch.manual_seed(0)
    linear = nn.Linear(300, 1000, bias=False)
    stored = CpuLinear(linear, layout)
    ids = torch.tensor([0, 7, 500, 999])
    rows = head_rows(lambda h: stored(h).float(), 300, ids, torch.float32, linear.weight)
    assert torch.equal(rows, linear.weight.detach()[ids])


def write(tmp_path, name, content):
    file = tmp_path / name
    if isinstance(content, torch.Tensor):
        torch.save(content, file)
    else:
        file.write_text(content if isinstance(content, str) else json.dumps(content))
    return file


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("m.json", [], "lists no token ids"),
        ("m.json", [3, 1.5], "non-integer entries"),
        ("m.json", [3, True], "non-integer entries"),
        ("m.json", [3, 9000], "token id 9000"),
        ("m.json", [-1], "token id -1"),
        ("m.json", [4, 4], "more than once"),
        ("m.json", "{not json", "not valid JSON"),
        ("m.json", {"ids": [1]}, "token_ids"),
        ("m.pt", torch.tensor([1.0, 2.0]), "1-D integer tensor"),
        ("m.pt", torch.tensor([[1, 2]]), "1-D integer tensor"),
        ("m.pt", "not a tensor file", "neither a .json list"),
    ],
)
def test_bad_maps_are_refused_naming_the_field(tmp_path, name, content, says):
    with pytest.raises(ModelLoadError, match=says) as err:
        read_token_map(write(tmp_path, name, content), 8192)
    assert "spec.draft.tokenMap" in str(err.value)


def test_a_missing_map_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"spec\.draft\.tokenMap: .* is not a file"):
        read_token_map(tmp_path / "nope.json", 8192)


def test_maps_read_ascending_from_each_format(tmp_path):
    want = torch.tensor([2, 5, 9])
    for file in (
        write(tmp_path, "a.json", [9, 2, 5]),
        write(tmp_path, "b.json", {"token_ids": [5, 9, 2], "size": 3}),
        write(tmp_path, "c.pt", torch.tensor([9, 5, 2], dtype=torch.int32)),
    ):
        assert torch.equal(read_token_map(file, 10), want)


def test_a_map_smaller_than_topk_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"spec\.draft\.tokenMap: .* 3 token ids, fewer than .* 4"
    ):
        mapped_engine(write(tmp_path, "m.json", [5, 6, 7]), topk=4)


def test_an_oversized_map_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("specd.workers.model.token_map._MAX_FILE_BYTES", 10)
    with pytest.raises(ModelLoadError, match="more than any vocabulary's map"):
        read_token_map(write(tmp_path, "m.json", list(range(100))), 8192)


def test_a_bad_map_stops_the_engine_from_loading(tmp_path):
    with pytest.raises(Exception, match="spec.draft.tokenMap"):
        start_engine(
            DEMO_TARGET,
            draft={"path": DEMO_EAGLE, "tokenMap": str(write(tmp_path, "m.json", [8192]))},
        )


@pytest.mark.parametrize(
    ("draft", "says"),
    [
        ({"algorithm": "NGRAM"}, "no draft model"),
        ({"algorithm": "EAGLE3", "path": DEMO_EAGLE}, "own vocabulary map"),
    ],
)
def test_token_maps_are_for_eagle_drafts(draft, says):
    with pytest.raises(ConfigError, match=says) as err:
        spec_for_model(DEMO_TARGET, draft={**draft, "tokenMap": "m.json"})
    assert "tokenMap" in str(err.value)


def test_a_relative_map_is_read_beside_the_yaml(tmp_path):
    file = tmp_path / "sdd.yaml"
    file.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: x}\n"
        "spec:\n  model: {path: target}\n"
        "  draft: {path: draft, tokenMap: draft/token_map.json}\n  speculative: {}\n"
    )
    assert load_deployment(file).spec.draft.token_map == str(tmp_path / "draft/token_map.json")


def test_the_generator_keeps_the_most_frequent_ids():
    counts = torch.tensor([5, 0, 9, 5, 1])
    assert most_frequent(counts, 3) == [0, 2, 3]  # 9, then the tie 5/5 by id
    with pytest.raises(ValueError, match="--size"):
        most_frequent(counts, 6)


@pytest.mark.slow
def test_the_shipped_map_is_what_its_generator_writes():
    """The demo's map, rebuilt from its corpus (this Python's standard library): the same
    ids where the corpus is the same, else a map covering as much of this one."""
    shipped = json.loads(Path(SHIPPED_MAP).read_text())
    assert shipped["reproduce"].startswith("python -m specd.devtools.token_map")
    texts = read_texts(split_files(corpus_files())[0])
    rebuilt = build(DEMO_TARGET, shipped["size"], texts, "test")
    if rebuilt["corpus"]["sha256"] == shipped["corpus"]["sha256"]:
        assert rebuilt["token_ids"] == shipped["token_ids"]
    assert rebuilt["coverage"] > 0.8 and shipped["coverage"] > 0.8


# -- spec.draft.dtype: a bfloat16 draft beside a float32 target ----------------------------


def test_a_bfloat16_draft_is_lossless_and_keeps_its_kv_in_bfloat16(demo_reference):
    """The draft's weights, activations and KV pool in bfloat16 beside a float32 target
    (the demo's setting, with its token map): the same greedy outputs, drafts accepted."""
    engine = demo_spec_engine({"tokenMap": SHIPPED_MAP, "dtype": "bfloat16"}, topk=4, overlap=True)
    head = engine.executor.decoder.head
    assert head.dtype == torch.bfloat16 and head.model.token_head.weight.dtype == torch.bfloat16
    assert engine.executor.decoder.draft_pool.buffer.dtype == torch.bfloat16
    assert check_lossless(engine, demo_reference) > 0


def test_a_bfloat16_draft_reads_the_whole_float32_head(demo_reference):
    """No token map: the bfloat16 draft's hidden goes through the target's float32 lm_head."""
    engine = demo_spec_engine({"dtype": "bfloat16"})
    assert check_lossless(engine, demo_reference) > 0


def test_on_cuda_the_draft_runs_in_the_targets_dtype():
    spec = spec_for_model(
        DEMO_TARGET,
        model={"dtype": "bfloat16"},
        draft={"path": DEMO_EAGLE, "dtype": "float32"},
        speculative={},
    )
    with pytest.raises(ConfigError, match=r"spec\.draft\.dtype: float32 differs"):
        draft_dtype(spec, torch.device("cuda"), torch.bfloat16)
    assert draft_dtype(spec, torch.device("cpu"), torch.bfloat16) == "float32"
    same = spec_for_model(DEMO_TARGET, draft={"path": DEMO_EAGLE}, speculative={})
    assert draft_dtype(same, torch.device("cuda"), torch.float32) == "auto"


@pytest.mark.parametrize(
    ("device", "target", "native", "expected"),
    [
        ("cpu", torch.float32, True, "bfloat16"),
        ("cpu", torch.float32, False, "auto"),
        ("cpu", torch.bfloat16, True, "auto"),
        ("cuda", torch.float32, True, "auto"),
    ],
)
def test_an_auto_draft_is_bfloat16_only_beside_float32_on_a_native_bfloat16_cpu(
    device, target, native, expected
):
    assert auto_draft_dtype(target, torch.device(device), native) == expected


def test_the_demo_draft_runs_in_the_dtype_this_cpu_computes_fastest():
    """examples/demo.yaml leaves the draft's dtype to auto: bfloat16 beside its float32
    target where this CPU multiplies bfloat16 natively, float32 where it does not (which
    made speculation lose to plain decode at batch 8 and 32 on a 2-core AVX2 EPYC)."""
    demo = load_deployment(DEMO_YAML).spec
    assert demo.draft.dtype.value == "auto" and demo.model.dtype.value == "float32"
    engine = demo_spec_engine({"tokenMap": SHIPPED_MAP, "dtype": demo.draft.dtype.value})
    try:
        expected = torch.bfloat16 if native_bfloat16_matmuls() else torch.float32
        assert engine.executor.decoder.head.dtype == expected
        assert engine.executor.decoder.draft_pool.buffer.dtype == expected
    finally:
        engine.shutdown()
