"""Adaptive and load-aware speculation: the controller's rule as a table, the ladder
config, and engines whose rung moves (down on a random draft, up on the trained demo
pair) while the output stays exact, strict memory checks pass and KV stays sized for
the widest rung."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_MODELS,
    DEMO_TARGET,
    check_exact_run,
    check_same_marginals,
    collect,
    hf_greedy,
    metric_value,
    random_prompts,
    run_all,
    sampled_continuations,
    start_engine,
)
from specd.devtools.tiny_draft import make_tiny_eagle
from specd.workers.config import AdaptiveSpec, ConfigError, spec_for_model
from specd.workers.mem_cache.sizing import SpecShape, alloc_reserve_per_decode
from specd.workers.rung import PLAIN, PlainReason, Rung
from specd.workers.speculative.adaptive import AdaptiveController, SpecPolicy

MAX_NEW = 20
CHAIN = [Rung(0, 1, 1), Rung(1, 1, 2), Rung(3, 1, 4)]

# -- the controller's rule ------------------------------------------------------------


def params(**fields) -> AdaptiveSpec:
    base = dict(
        enabled=True,
        ema_alpha=1.0,  # the rate is the last observation: each case reads off directly
        warmup_batches=0,
        update_interval=1,
        up_threshold=0.8,
        down_threshold=0.3,
        up_hysteresis=1,
        down_hysteresis=1,
    )
    return AdaptiveSpec(**{**base, **fields})


def drive(controller: AdaptiveController, batches) -> list[int]:
    """Feed (rung, accepted per request) batches -> the active steps after each."""
    out = []
    for rung, accepted in batches:
        controller.observe(rung, accepted)
        out.append(controller.rung.steps)
    return out


R0, R1, R3 = CHAIN
GOOD3, BAD3 = (R3, [3, 3]), (R3, [0, 0])  # rate 1.0 and 0.0 at steps 3


@pytest.mark.parametrize(
    "fields,initial,batches,expected",
    [
        pytest.param({}, R3, [BAD3, (R1, [0])], [1, 0], id="down-one-rung-per-decision"),
        pytest.param({}, R1, [(R1, [1]), GOOD3], [3, 3], id="up-then-clamp-at-top"),
        pytest.param({}, R0, [(R0, [0, 0])] * 2, [0, 0], id="clamp-at-bottom"),
        pytest.param({}, R0, [(R0, [1, 1, 0, 1, 1])], [1], id="probe-hits-climb-from-0"),
        pytest.param(
            {"warmup_batches": 3}, R3, [BAD3] * 5, [3, 3, 3, 1, 0], id="no-decision-in-warmup"
        ),
        pytest.param(
            {"update_interval": 3}, R3, [BAD3] * 6, [3, 3, 1, 1, 1, 0], id="every-interval"
        ),
        pytest.param(
            {"warmup_batches": 2, "update_interval": 2},
            R3,
            [BAD3] * 6,
            [3, 3, 3, 1, 1, 0],
            id="interval-counts-after-warmup",
        ),
        pytest.param({"down_hysteresis": 2}, R3, [BAD3] * 4, [3, 1, 1, 0], id="down-hysteresis-2"),
        pytest.param(
            {"up_hysteresis": 2},
            R1,
            [(R1, [1])] * 3 + [GOOD3] * 2,
            [1, 3, 3, 3, 3],
            id="up-hysteresis-2",
        ),
        pytest.param(
            {"up_hysteresis": 2},
            R1,
            [(R1, [1]), (R1, [0, 1]), (R1, [1]), (R1, [1])],
            [1, 1, 1, 3],
            id="neutral-breaks-the-up-streak",
        ),
        pytest.param(
            {"down_hysteresis": 2},
            R3,
            [BAD3, GOOD3, BAD3, BAD3],
            [3, 3, 3, 1],
            id="up-vote-breaks-the-down-streak",
        ),
        pytest.param({"ema_alpha": 0.5}, R3, [GOOD3, BAD3, BAD3], [3, 3, 1], id="ema-smooths"),
        pytest.param({}, R1, [(R3, [1, 1])], [1], id="older-batch-at-another-rung-as-a-rate"),
    ],
)
def test_controller_rule(fields, initial, batches, expected):
    controller = AdaptiveController(CHAIN, initial, params(**fields))
    assert drive(controller, batches) == expected
    moves = sum(a != b for a, b in zip([initial.steps, *expected], expected, strict=False))
    assert controller.changes == moves


def test_controller_ema_is_accepted_drafts_at_the_active_rung():
    controller = AdaptiveController(CHAIN, R3, params(ema_alpha=0.5, warmup_batches=10))
    assert controller.ema is None
    controller.observe(R3, [3, 1])  # rate 2/3
    controller.observe(R3, [0, 0])  # rate 1/3
    assert controller.rate == pytest.approx(1 / 3)
    assert controller.ema == pytest.approx(1.0)
    assert controller.batches == 2 and controller.changes == 0
    controller.observe(R3, [])  # a batch whose requests all finished: no observation
    assert controller.batches == 2


def test_policy_plain_under_load_and_no_feedback_from_it():
    spec = SimpleNamespace(
        initial_rung=R3,
        ladder=tuple(CHAIN),
        adaptive=params(),
        policy=SimpleNamespace(max_batch_for_spec=2, uses_cost_model=False),
    )
    policy = SpecPolicy(spec)
    assert policy.cost_model is None
    assert policy.choose(2) == (R3, None)
    assert policy.choose(3) == (PLAIN, PlainReason.LOAD)
    policy.observe(PLAIN, PlainReason.LOAD, [], 0.1, 3)  # load-plain: no rung move
    assert policy.active == R3 and policy.controller.batches == 0
    policy.observe(R3, None, [0, 0], 0.1, 2)
    assert policy.active == R1
    assert policy.status()["steps"] == 1 and policy.status()["rung_changes"] == 1


# -- the ladder in the config ---------------------------------------------------------


def speculative(**fields):
    spec = spec_for_model("m", draft={"path": "d"}, speculative=fields)
    return spec.speculative


@pytest.mark.parametrize(
    "fields,ladder,initial",
    [
        pytest.param(
            {"numSteps": 3, "adaptive": {"enabled": True, "candidateSteps": [0, 1, 3, 5]}},
            [(0, 1, 1), (1, 1, 2), (3, 1, 4), (5, 1, 6)],
            3,
            id="chain-ints",
        ),
        pytest.param(
            {
                "numSteps": 3,
                "topk": 4,
                "numDraftTokens": 8,
                "adaptive": {"enabled": True, "candidateSteps": [1, 2, 5]},
            },
            [(1, 4, 5), (2, 4, 8), (5, 4, 8)],
            2,
            id="tree-ints-default-T-and-initial-below-numSteps",
        ),
        pytest.param(
            {
                "numSteps": 2,
                "topk": 2,
                "numDraftTokens": 4,
                "adaptive": {
                    "enabled": True,
                    "candidateSteps": [
                        {"steps": 2, "topk": 2, "numDraftTokens": 4},
                        {"steps": 4, "topk": 4, "numDraftTokens": 8},
                    ],
                },
            },
            [(2, 2, 4), (4, 4, 8)],
            2,
            id="objects",
        ),
        pytest.param(
            {"numSteps": 1, "numDraftTokens": 2, "adaptive": {"candidateSteps": [3, 5]}},
            [(1, 1, 2)],
            1,
            id="disabled-is-the-configured-rung",
        ),
        pytest.param(
            {
                "numSteps": 1,
                "numDraftTokens": 2,
                "adaptive": {"enabled": True, "candidateSteps": [3, 5]},
            },
            [(3, 1, 4), (5, 1, 6)],
            3,
            id="initial-is-the-first-when-all-are-wider",
        ),
    ],
)
def test_ladder_resolution(fields, ladder, initial):
    spec = speculative(**fields)
    # computed once, when the spec is validated (seed 003): already cached here
    assert {"ladder", "max_draft_tokens"} <= set(spec.__dict__)
    assert [(r.steps, r.topk, r.draft_tokens) for r in spec.ladder] == ladder
    assert spec.initial_rung.steps == initial
    widest = SpecShape.from_spec(spec)
    assert widest == SpecShape(
        max(r[0] for r in ladder), max(r[1] for r in ladder), max(r[2] for r in ladder)
    )
    assert spec.max_draft_tokens == widest.max_draft_tokens


def test_widest_rung_must_fit_the_context(pair):
    """The widest rung's reserve (2 x 64 here) must be below the context length."""
    with pytest.raises(ConfigError, match=r"spec.speculative.adaptive.candidateSteps: the widest"):
        start_engine(
            pair[0],
            model={"contextLength": 96},
            draft={"path": pair[1]},
            speculative={
                "adaptive": {
                    "enabled": True,
                    "candidateSteps": [1, {"steps": 8, "topk": 8, "numDraftTokens": 32}],
                }
            },
        )


# -- engines on the tiny pair (random draft: acceptance near zero) ----------------------


@pytest.fixture(scope="module")
def reference(pair):
    prompts = random_prompts(6, 300, seed=11)
    return prompts, hf_greedy(pair[0], prompts, MAX_NEW)


def on_submit(engine, record) -> None:
    """Call ``record(batch)`` for every batch the engine submits, as it is launched."""
    submit = engine.executor.submit

    def recording(batch):
        record(batch)
        return submit(batch)

    engine.executor.submit = recording


def record_batches(engine) -> list[tuple[Rung, bool, list[tuple[int, int]]]]:
    """Per verify batch as launched: (rung, plain by load, [(granted, committed)])."""
    seen = []

    def record(batch):
        if batch.verify:
            grants = zip(batch.granted_lens, batch.reqs, strict=True)
            by_load = batch.plain_reason == PlainReason.LOAD
            seen.append((batch.rung, by_load, [(g, r.kv.committed) for g, r in grants]))

    on_submit(engine, record)
    return seen


def record_plain_decode_batches(engine) -> list:
    """The batches of plain decodes the policy chose (not verifies), as launched."""
    seen = []

    def record(batch):
        if not batch.verify and batch.plain_reason is not None:
            seen.append(batch)

    on_submit(engine, record)
    return seen


def check_widest_allocation(engine, seen, narrow: bool = True) -> None:
    """Every verify, whatever its rung (``narrow``: some ran a narrower one than the
    widest), was granted committed + the reserve of every rung of the ladder (committed
    counts the root pre-claimed when it was scheduled), and the engine's shape is the
    max of steps, topk and T over the ladder."""
    page, ladder = engine.kv.page_size, engine.spec.speculative.ladder
    assert engine.spec_shape == SpecShape(
        max(r.steps for r in ladder),
        max(r.topk for r in ladder),
        max(r.draft_tokens for r in ladder),
    )
    reserve = max(
        alloc_reserve_per_decode(SpecShape(r.steps, r.topk, r.draft_tokens), page) for r in ladder
    )
    widest = max(r.draft_tokens for r in ladder)
    assert any(rung.draft_tokens < widest for rung, _, _ in seen) == narrow
    for _, _, grants in seen:
        for granted, committed in grants:
            assert granted >= committed - 1 + reserve


def plain_steps(engine, reason: str) -> float:
    """``specd_spec_plain_steps_total{reason=...}``, 0 before the first such step."""
    for family in text_string_to_metric_families(engine.metrics_text().decode()):
        for sample in family.samples:
            if sample.name == "specd_spec_plain_steps_total" and sample.labels["reason"] == reason:
                return sample.value
    return 0


def adaptive_engine(pair, speculative, page_size=1, overlap=False, algorithm="EAGLE"):
    return start_engine(
        pair[0],
        kvCache={"pageSize": page_size, "maxTokens": 4096},
        scheduler={"chunkedPrefillSize": 16, "overlap": overlap},
        draft={"path": pair[1] if algorithm == "EAGLE" else pair[2], "algorithm": algorithm},
        speculative=speculative,
        debug={"strictMemCheck": 1},
    )


def adaptive(candidates, **fields):
    return {
        "enabled": True,
        "candidateSteps": candidates,
        "warmupBatches": 2,
        "updateInterval": 1,
        **fields,
    }


TREE = [{"steps": 2, "topk": 2, "numDraftTokens": 4}, {"steps": 4, "topk": 4, "numDraftTokens": 8}]


@pytest.mark.parametrize(
    "shape,page_size,overlap,algorithm",
    [
        pytest.param("chain", 1, False, "EAGLE", id="chain-P1"),
        pytest.param("chain", 4, True, "EAGLE", id="chain-P4-overlap"),
        pytest.param("chain", 4, False, "EAGLE3", id="chain-P4-eagle3"),
        pytest.param("tree", 1, False, "EAGLE", id="tree-P1"),
        pytest.param("tree", 4, False, "EAGLE", id="tree-P4"),
        pytest.param("tree", 4, True, "EAGLE", id="tree-P4-overlap"),
    ],
)
def test_random_draft_moves_the_rung_down(pair, reference, shape, page_size, overlap, algorithm):
    """Starting at the widest rung, near-zero acceptance walks the rung to the bottom
    one decision at a time (warm-up 2, a decision per batch); exact output, strict
    checks clean, allocation always for the widest rung."""
    prompts, expected = reference
    if shape == "chain":
        spec = {"numSteps": 3, "adaptive": adaptive([0, 1, 3])}
        bottom, moves = 0, 2
    else:
        spec = {"numSteps": 4, "topk": 4, "numDraftTokens": 8, "adaptive": adaptive(TREE)}
        bottom, moves = 2, 1
    engine = adaptive_engine(pair, spec, page_size, overlap, algorithm)
    seen = record_batches(engine)
    check_exact_run(engine, prompts, expected, MAX_NEW)
    status = engine.status().adaptive
    assert (status.steps, status.rung_changes) == (bottom, moves)
    assert metric_value(engine, "specd_spec_adaptive_steps") == bottom
    assert metric_value(engine, "specd_leak_checks_total") > 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
    steps = [rung.steps for rung, _, _ in seen]
    assert steps[0] == (3 if shape == "chain" else 4)
    # warm-up 2, then one move per processed batch; overlap launches one batch early
    first_at_bottom = steps.index(bottom)
    assert first_at_bottom <= 2 + moves + int(overlap), steps
    assert set(steps[first_at_bottom:]) == {bottom}
    check_widest_allocation(engine, seen)
    plain = plain_steps(engine, "rung")
    assert plain == (steps.count(0) if bottom == 0 else 0)
    assert metric_value(engine, "specd_spec_enabled") == (0 if bottom == 0 else 1)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_load_policy_runs_large_batches_plain(pair, reference, overlap):
    """maxBatchForSpec 2: one request speculates, four at once run plain (reason load),
    then one request speculates again; the output is exact throughout.  Without overlap
    a plain batch is the runner's batch of plain decodes; under overlap, a root-only
    verify (verifies are what it pipelines)."""
    prompts, expected = reference
    spec = {"numSteps": 3, "policy": {"maxBatchForSpec": 2}}
    engine = adaptive_engine(pair, spec, 1, overlap)
    seen = record_batches(engine)
    decode_batches = record_plain_decode_batches(engine)
    enabled, by_load = [], []
    try:
        for picked in ([0], [0, 1, 2, 3], [1]):
            batch = [prompts[i] for i in picked]
            results = run_all(engine, batch, max_tokens=MAX_NEW, ignore_eos=True)
            assert [r[0] for r in results] == [expected[i] for i in picked]
            enabled.append(metric_value(engine, "specd_spec_enabled"))
            by_load.append(plain_steps(engine, "load"))
        # the four ran plain while more than two were decoding (the last of them, with
        # two finished, may speculate again)
        assert enabled[0] == enabled[2] == 1
        assert by_load[0] == 0 < by_load[1] == by_load[2]
        load = plain_steps(engine, "load")
        assert load == sum(by_load for _, by_load, _ in seen) + len(decode_batches) > 0
        assert bool(decode_batches) != overlap
        assert all(
            b.plain_reason == PlainReason.LOAD and len(b.reqs) > 2 and all(b.plain_decodes)
            for b in decode_batches
        )
        assert all(
            (rung == PLAIN) == by_load and (len(grants) > 2) == by_load
            for rung, by_load, grants in seen
        )
        plain = engine.status().adaptive.plain_steps.model_dump()
        assert plain == {"rung": 0, "load": load, "cost": 0, "end": 0, "lockstep": 0, "request": 0}
        assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
        check_widest_allocation(engine, seen, narrow=overlap)  # sync: no plain verify
    finally:
        engine.shutdown()


# -- the trained demo pair: a repetitive prompt the draft predicts ------------------------


@pytest.fixture(scope="module")
def demo_repetitive():
    """A comment rule the demo model continues as '#' lines: the draft accepts nearly
    everything -> (prompt, plain greedy output)."""
    tok = Tokenizer.from_file(str(DEMO_MODELS / "demo-target" / "tokenizer.json"))
    prompt = tok.encode("# " + "-" * 60 + "\n").ids
    plain = start_engine(DEMO_TARGET)
    try:
        [(tokens, _, _)] = run_all(plain, [prompt], max_tokens=MAX_NEW + 10, ignore_eos=True)
    finally:
        plain.shutdown()
    return prompt, tokens


@pytest.mark.parametrize(
    "candidates,num_steps,overlap",
    [
        pytest.param([1, 3, 5], 1, False, id="chain-from-1"),
        pytest.param([0, 2, 4], 0, True, id="from-plain-by-probes-overlap"),
    ],
)
def test_trained_draft_moves_the_rung_up(demo_repetitive, candidates, num_steps, overlap):
    prompt, expected = demo_repetitive
    engine = start_engine(
        DEMO_TARGET,
        kvCache={"pageSize": 4},
        scheduler={"overlap": overlap},
        draft={"path": DEMO_EAGLE},
        speculative={
            "numSteps": max(num_steps, 1),
            "numDraftTokens": max(num_steps, 1) + 1,
            "adaptive": adaptive(candidates, warmupBatches=1, upHysteresis=2),
        },
        debug={"strictMemCheck": 1},
    )
    seen = record_batches(engine)
    try:
        [(tokens, _, _)] = run_all(engine, [prompt], max_tokens=len(expected), ignore_eos=True)
        assert tokens == expected
        status = engine.status().adaptive
        assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
    finally:
        engine.shutdown()
    steps = [rung.steps for rung, _, _ in seen]
    assert steps[0] == num_steps
    # warm-up 1, then two up votes per move (plus a launched batch of lag under overlap)
    top = candidates[-1]
    assert status.steps == top and status.rung_changes == 2
    assert steps.index(top) <= 1 + 2 * 2 + 2 * int(overlap), steps
    assert status.acceptance_rate >= 0.8
    check_widest_allocation(engine, seen)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_request_that_opts_out_runs_its_batches_plain(demo_repetitive, overlap):
    """``speculative: false``: alone, the request drafts nothing (every decode step
    runs plain, reason request); beside a speculating request it makes the batches
    they share plain; both stay token-exact, and once it is done the other
    speculates again.  The cost model is off, so every other batch speculates."""
    prompt, expected = demo_repetitive
    engine = start_engine(
        DEMO_TARGET,
        kvCache={"pageSize": 16},
        scheduler={"overlap": overlap},
        draft={"path": DEMO_EAGLE},
        speculative={
            "numSteps": 3,
            "numDraftTokens": 4,
            "policy": {"costModel": {"enabled": False}},
        },
        debug={"strictMemCheck": 1},
    )
    short, n = len(expected) // 2, len(expected)

    async def both():
        return await asyncio.gather(
            collect(engine, "out", prompt, max_tokens=short, ignore_eos=True, speculative=False),
            collect(engine, "in", prompt, max_tokens=n, ignore_eos=True),
        )

    try:
        drafted = metric_value(engine, "specd_spec_draft_tokens_total")
        [(alone, _, _)] = run_all(
            engine, [prompt], max_tokens=short, ignore_eos=True, speculative=False
        )
        assert alone == expected[:short]
        assert metric_value(engine, "specd_spec_draft_tokens_total") == drafted
        opted_out = plain_steps(engine, "request")
        assert opted_out == short - 1  # the first token comes from the prefill
        (out, _, _), (spec, _, _) = asyncio.run(both())
        assert out == expected[:short] and spec == expected
        assert plain_steps(engine, "request") > opted_out
        assert metric_value(engine, "specd_spec_draft_tokens_total") > drafted
        assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
    finally:
        engine.shutdown()


def test_plain_rung_samples_the_target_distribution(tiny_models, tmp_path):
    """Temperature 1 on the plain rung alone (a root-only verify per step): generated
    tokens 2 and 3 follow the target's law (chi-square against plain decode)."""
    target = tiny_models("tied")
    draft = make_tiny_eagle(tmp_path / "d", target)
    prompt, n = [5, 17, 42], 600
    plain = start_engine(target, kvCache={"pageSize": 1})
    spec = start_engine(
        target,
        kvCache={"pageSize": 1},
        draft={"path": str(draft)},
        speculative={"adaptive": {"enabled": True, "candidateSteps": [0]}},
    )
    try:
        runs = [
            sampled_continuations(engine, prompt, n, first_seed=k * n)
            for k, engine in enumerate((plain, spec))
        ]
        assert plain_steps(spec, "rung") > 0
    finally:
        plain.shutdown()
        spec.shutdown()
    check_same_marginals(*runs)
