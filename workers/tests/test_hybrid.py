"""Hybrid drafting: an EAGLE or EAGLE-3 draft with SUFFIX's output cache, each request
verifying SUFFIX's tree when it scores above the threshold.  Lossless over page size x
topk x overlap with strict leak checks, the sampling law unchanged, the threshold obeyed."""

from __future__ import annotations

import pytest

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    check_exact_run,
    check_same_marginals,
    demo_reference,
    metric_value,
    run_all,
    sampled_continuations,
    start_engine,
)

MAX_NEW = 24


def hybrid_engine(page_size=1, topk=1, overlap=False, threshold=1.0, draft=DEMO_EAGLE, **extra):
    steps = 4
    return start_engine(
        extra.pop("target", DEMO_TARGET),
        kvCache={"pageSize": page_size, "maxTokens": 4096},
        scheduler={"chunkedPrefillSize": 16, "overlap": overlap},
        draft={"path": draft, "algorithm": extra.pop("algorithm", "EAGLE")},
        speculative={
            "numSteps": steps,
            "topk": topk,
            "numDraftTokens": steps + 1 if topk == 1 else 2 * steps,
            "suffix": {"hybridThreshold": threshold},
        },
        debug={"strictMemCheck": 1},
    )


@pytest.fixture(scope="module")
def reference():
    """Python-source prompts (which repeat themselves: prompt lookup finds matches) and
    their plain greedy outputs, checked against transformers."""
    return demo_reference(6, 48, MAX_NEW)


CORNERS = [(1, 1, False), (16, 4, True)]  # the rest of page x topk x overlap: slow
MATRIX = [
    (page, topk, overlap) if (page, topk, overlap) in CORNERS
    else pytest.param(page, topk, overlap, marks=pytest.mark.slow)
    for page in (1, 16) for topk in (1, 4) for overlap in (False, True)
]  # fmt: skip


@pytest.mark.parametrize("page_size, topk, overlap", MATRIX)
def test_hybrid_greedy_is_lossless(reference, page_size, topk, overlap):
    """The batch-1 run's output is cached when the concurrent run starts: the first
    prompt's request verifies SUFFIX trees, the others the draft model's."""
    prompts, expected = reference
    engine = hybrid_engine(page_size, topk, overlap)
    check_exact_run(engine, prompts, expected, MAX_NEW)
    assert metric_value(engine, "specd_spec_hybrid_suffix_trees_total") > 0
    assert metric_value(engine, "specd_spec_draft_info", algorithm="EAGLE") == 1
    assert metric_value(engine, "specd_leak_checks_total", result="ok") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0


def test_a_threshold_no_proposal_reaches_keeps_the_draft_models_trees(reference):
    prompts, expected = reference
    engine = hybrid_engine(threshold=256)
    check_exact_run(engine, prompts, expected, MAX_NEW)
    assert metric_value(engine, "specd_spec_hybrid_suffix_trees_total") == 0


def test_cached_outputs_lift_acceptance(reference):
    """The same prompts twice: the second time SUFFIX's trees, made of the first outputs,
    are verified and accepted more than the draft model's were."""
    prompts, expected = reference
    engine = hybrid_engine()
    try:
        counts = []
        for _ in range(2):
            results = run_all(engine, prompts, max_tokens=MAX_NEW, ignore_eos=True)
            assert [r[0] for r in results] == expected
            counts.append(sum(r[2].usage.spec_accepted_tokens for r in results))
    finally:
        engine.shutdown()
    assert counts[1] > counts[0] + 20


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_hybrid_sampling_keeps_the_target_distribution(pair, algorithm):
    """Temperature 1, a random draft model and a threshold of 0: SUFFIX's tree wins
    wherever it proposes anything, the draft model's elsewhere; generated tokens 2 and
    3 keep the target's law.  A first round of samples fills SUFFIX's cache with the
    target's own continuations, so the measured round's trees get accepted."""
    target, eagle, eagle3 = pair
    prompt = [5, 17, 42, 9] * 3 + [5, 17]
    plain = start_engine(target, kvCache={"pageSize": 1})
    draft = eagle if algorithm == "EAGLE" else eagle3
    spec = hybrid_engine(threshold=0.0, target=target, draft=draft, algorithm=algorithm)
    n = 800
    try:
        sampled_continuations(spec, prompt, n // 4, first_seed=2 * n)
        runs = [
            sampled_continuations(engine, prompt, n, first_seed=k * n)
            for k, engine in enumerate((plain, spec))
        ]
        trees = metric_value(spec, "specd_spec_hybrid_suffix_trees_total")
        accepted = metric_value(spec, "specd_spec_accepted_tokens_total")
    finally:
        plain.shutdown()
        spec.shutdown()
    assert trees > 0 and accepted > 0
    check_same_marginals(*runs)
