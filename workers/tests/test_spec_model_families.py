"""Speculation on the newer target families: a Qwen3 target (per-head q/k norms, explicit
head_dim) and a Qwen3-MoE target, each with an EAGLE-3 head in the published Llama
layout.  Greedy output must equal transformers' token for token across chain and tree
drafting, page 1 and 16, overlap on and off, with strict leak checks."""

from __future__ import annotations

import pytest

from specd.devtools.testing import (
    check_exact_run,
    check_token_sources,
    hf_greedy,
    metric_value,
    random_prompts,
    start_spec_engine,
)
from specd.devtools.tiny_draft import make_tiny_eagle3

MAX_NEW = 16
FAMILIES = ("qwen3", "qwen3-moe")
# (topk, page size, overlap): one case per family in the default suite, the rest slow
CASES = [
    pytest.param(1, 16, True, id="chain-page16-overlap"),
    pytest.param(1, 1, False, id="chain-page1-sync", marks=pytest.mark.slow),
    pytest.param(4, 1, True, id="tree-page1-overlap", marks=pytest.mark.slow),
    pytest.param(4, 16, False, id="tree-page16-sync", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_models, tmp_path_factory):
    """(target, EAGLE-3 head, prompts, transformers' greedy outputs) for one family."""
    target = tiny_models(request.param)
    draft = make_tiny_eagle3(tmp_path_factory.mktemp(f"eagle3-{request.param}"), target)
    prompts = random_prompts(6, 300, seed=11)
    return target, str(draft), prompts, hf_greedy(target, prompts, MAX_NEW)


@pytest.mark.parametrize("topk,page_size,overlap", CASES)
def test_eagle3_on_new_families_is_lossless(family, topk, page_size, overlap):
    target, draft, prompts, expected = family
    engine = start_spec_engine(
        target, draft, page_size, steps=3, topk=topk, algorithm="EAGLE3", overlap=overlap
    )
    results = check_exact_run(engine, prompts, expected, MAX_NEW)
    check_token_sources(engine, results, MAX_NEW)
    assert metric_value(engine, "specd_leak_checks_total", result="ok") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
