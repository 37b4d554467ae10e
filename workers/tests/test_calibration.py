"""The cost model's calibration at load (engine/calibration.py): made-up batches measure
the speculating and plain step costs before the replica serves, and leave nothing
behind (KV, prefix cache, metrics, acceptance)."""

from __future__ import annotations

import pytest

from specd.devtools.testing import (
    check_exact_run,
    check_leak_free,
    hf_greedy,
    metric_value,
    random_prompts,
    start_engine,
    start_spec_engine,
)
from specd.workers.config import ConfigError, spec_for_model
from specd.workers.engine.calibration import PROMPT_TOKENS, CalibrationPlan, made_up_prompt

MAX_NEW = 16


def plan(asked, max_running=64, kv_tokens=100_000, context_length=2048, chunk_tokens=2048):
    return CalibrationPlan.of(
        asked,
        max_running=max_running,
        kv_tokens=kv_tokens,
        context_length=context_length,
        chunk_tokens=chunk_tokens,
        verify_tokens=5,
    )


def test_a_plan_runs_the_sizes_asked_within_what_the_replica_runs():
    assert plan([32, 1, 8]).batch_sizes == (1, 8, 32)
    assert plan([1, 8, 32], max_running=16).batch_sizes == (1, 8, 16)
    assert plan([1, 8, 8]).batch_sizes == (1, 8)
    first = plan([1, 8, 32])
    assert first.prompt_tokens == PROMPT_TOKENS
    # the KV pool holds about 2 x 12 of these requests: 32 runs as 12
    per_request = first.prompt_tokens + first.max_tokens + 5
    assert plan([1, 8, 32], kv_tokens=24 * per_request + 1).batch_sizes == (1, 8, 12)


def test_a_plan_fits_the_context_and_the_prefill_chunk():
    short = plan([1, 8], context_length=128, chunk_tokens=16)
    assert short.prompt_tokens + short.max_tokens + 5 < 128
    assert short.prompt_tokens == 8  # 4 chunks of 16 tokens over 8 prompts
    # an output of room for one plain decode per prefill step, and both rungs' verifies
    assert short.max_tokens >= 8 * 8 // 16 + 2 * 3 * 5


def test_a_size_too_large_for_the_context_is_left_out_not_the_rest():
    """1,024 made-up requests would each need an output longer than a 512-token context
    (a plain decode per prefill step beside the others' prompts): that size is left
    out, 1 and 8 still run."""
    fitted = plan([1, 8, 1024], max_running=4096, context_length=512, chunk_tokens=16)
    assert fitted.batch_sizes == (1, 8)


@pytest.mark.parametrize(
    "asked, fields",
    [
        ([], {}),  # off
        ([1, 8], {"context_length": 32}),  # no room for a request
        ([1, 8], {"kv_tokens": 10}),  # no room in the pool
    ],
    ids=["off", "context", "pool"],
)
def test_nothing_to_run_is_no_plan(asked, fields):
    assert plan(asked, **fields) is None


def test_made_up_prompts_are_fixed_and_within_the_vocabulary():
    prompt = made_up_prompt(3, 64, 100)
    assert prompt == made_up_prompt(3, 64, 100) != made_up_prompt(4, 64, 100)
    assert len(prompt) == 64 and all(0 <= t < 100 for t in prompt)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ([0], "calibrationBatchSizes"),
        ([1, 5000], "calibrationBatchSizes"),
        (list(range(1, 10)), "calibrationBatchSizes"),
        ("8", "calibrationBatchSizes"),
    ],
    ids=["zero", "huge", "too-many", "not-a-list"],
)
def test_bad_calibration_sizes_name_the_field(sizes, message):
    policy = {"costModel": {"calibrationBatchSizes": sizes}}
    with pytest.raises(ConfigError, match=message):
        spec_for_model("t", draft={"path": "d"}, speculative={"policy": policy})


# -- engines --------------------------------------------------------------------------
def calibrated_engine(target, draft, sizes=(1, 4), **fields):
    """A speculative engine with the cost model on, calibrated at ``sizes``."""
    policy = {"costModel": {"calibrationBatchSizes": list(sizes)}}
    return start_spec_engine(target, draft, policy=policy, **fields)


@pytest.mark.parametrize(
    "page_size, topk, overlap",
    [(1, 1, False), (16, 4, False), (1, 1, True), (16, 4, True)],
    ids=["chain", "page16-tree", "chain-overlap", "page16-tree-overlap"],
)
def test_calibration_measures_both_rungs_and_leaves_nothing_behind(pair, page_size, topk, overlap):
    """After the load's calibration both rungs of every calibrated bucket have a step
    cost, no acceptance was learned from made-up prompts, no KV or cache page is held,
    the metrics start at zero, and the engine then serves the target's greedy tokens."""
    target, draft, _ = pair
    engine = calibrated_engine(target, draft, page_size=page_size, topk=topk, overlap=overlap)
    status = engine.status()
    model = status.adaptive.cost_model
    assert model.calibration is not None and model.calibration.batch_sizes == (1, 4)
    assert model.calibration.steps > 0 and model.explorations == 0
    assert model.accepted_drafts == ()
    measured = {
        b.max_batch: {r.steps for r in b.rungs if r.seconds_per_request} for b in model.buckets
    }
    assert measured[1] == measured[4] == {0, 3}, model
    assert status.kv_used_tokens == 0 and status.kv_cached_tokens == 0
    assert status.speculation.verify_steps == 0
    for name in ("specd_generation_tokens_total", "specd_spec_verify_steps_total"):
        assert metric_value(engine, name) == 0, name
    assert metric_value(engine, "specd_kv_tokens_total") == status.kv_total_tokens
    assert metric_value(engine, "specd_spec_draft_info") == 1
    check_leak_free(engine)
    prompts = random_prompts(4, 300, seed=11)
    check_exact_run(engine, prompts, hf_greedy(target, prompts, MAX_NEW), MAX_NEW)


def test_a_calibrated_bucket_explores_only_the_drafts_acceptance(pair):
    """A batch of one on the random draft (it accepts nearly nothing): with both costs
    measured at load, the only explorations are the verifies that learn its acceptance,
    then batches run plain; uncalibrated, plain is explored as well."""
    target, draft, _ = pair
    prompts = random_prompts(1, 300, seed=12)
    expected = hf_greedy(target, prompts, 48)
    counts = {}
    for sizes in ((1,), ()):
        engine = calibrated_engine(target, draft, sizes=sizes)
        check_exact_run(engine, prompts, expected, 48)
        status = engine.status().adaptive
        verifies = engine.status().speculation.verify_steps
        counts[sizes] = (status.cost_model.explorations, verifies, status.plain_steps.cost)
    explored, verified, plain = counts[(1,)]
    assert explored == verified > 0 and plain > 0, counts
    explored, verified, plain = counts[()]
    assert explored > verified, counts  # plain's own exploration


def test_calibration_off_and_draft_free_drafters_measure_online_only(pair):
    target, draft, _ = pair
    engine = calibrated_engine(target, draft, sizes=())
    try:
        assert engine.status().adaptive.cost_model.calibration is None
        assert engine.status().adaptive.cost_model.buckets == ()
    finally:
        engine.shutdown()
    engine = calibrated_engine(target, None, algorithm="NGRAM")
    try:
        assert engine.status().adaptive.cost_model.calibration is None
    finally:
        engine.shutdown()


def test_a_pool_too_small_for_the_sizes_asked_calibrates_what_fits(pair):
    """A KV pool of 512 tokens cannot hold 32 made-up requests: calibration runs the
    largest batch it holds, and the engine still serves exactly."""
    target, draft, _ = pair
    engine = start_engine(
        target,
        kvCache={"pageSize": 1, "maxTokens": 512},
        scheduler={"chunkedPrefillSize": 16},
        draft={"path": draft},
        speculative={"numSteps": 3, "policy": {"costModel": {"calibrationBatchSizes": [1, 32]}}},
        debug={"strictMemCheck": 1},
    )
    sizes = engine.status().adaptive.cost_model.calibration.batch_sizes
    assert sizes[0] == 1 and 1 < sizes[-1] < 32, sizes
    prompts = random_prompts(2, 300, seed=13)
    check_exact_run(engine, prompts, hf_greedy(target, prompts, MAX_NEW), MAX_NEW)
