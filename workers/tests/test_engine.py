"""The engine end to end on tiny checkpoints: exact against transformers greedy,
retraction under a small KV pool, sampling, stop rules and aborts."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import pytest
import torch

from specd.devtools.testing import (
    check_exact_run,
    check_small_pool_run,
    hf_greedy,
    metric_value,
    random_prompts,
    run_all,
    start_engine,
    wait_idle,
)
from specd.workers.config import ConfigError
from specd.workers.engine.engine import single_threaded_torch_in_this_thread
from specd.workers.types import FinishReason, GenerateRequest, SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def references(tiny_models):
    """variant -> (prompts, transformers greedy outputs), computed once."""
    cache = {}

    def get(variant):
        if variant not in cache:
            path = tiny_models(variant)
            prompts = random_prompts(16, 300, seed=len(variant))
            cache[variant] = (prompts, hf_greedy(path, prompts, MAX_NEW))
        return cache[variant]

    return get


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
STRICT = {"strictMemCheck": 1}


@OVERLAP
@pytest.mark.parametrize("variant", ["gqa", "tied", "bias"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers(tiny_models, references, variant, page_size, overlap):
    """Batch 1 and 16 concurrent mixed-length requests, chunked prefill on (chunk 8)."""
    prompts, expected = references(variant)
    engine = start_engine(
        tiny_models(variant),
        kvCache={"pageSize": page_size, "maxTokens": 4096},
        scheduler={"chunkedPrefillSize": 8, "overlap": overlap},
        debug=STRICT,
    )
    check_exact_run(engine, prompts, expected, MAX_NEW)


@OVERLAP
def test_small_pool_retracts_and_output_is_unchanged(tiny_models, references, overlap):
    prompts, expected = references("gqa")
    engine = start_engine(
        tiny_models("gqa"),
        kvCache={"pageSize": 4, "maxTokens": 96},
        scheduler={"chunkedPrefillSize": 64, "overlap": overlap},
        debug=STRICT,
    )
    check_small_pool_run(engine, prompts, expected, MAX_NEW)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(tiny_models, request):
    eng = start_engine(
        tiny_models("gqa"),
        kvCache={"maxTokens": 2048},
        scheduler={"overlap": request.param},
        debug=STRICT,
    )
    yield eng
    eng.shutdown()


def test_seeded_sampling_is_reproducible_and_varies(engine):
    prompt = [5, 6, 7, 8]
    params = dict(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    a = run_all(engine, [prompt], seed=1, **params)[0][0]
    b = run_all(engine, [prompt], seed=1, **params)[0][0]
    c = run_all(engine, [prompt], seed=2, **params)[0][0]
    assert a == b
    assert a != c


def test_stop_token_and_stop_string(engine):
    prompt = [5, 6, 7, 8]
    tokens, text, _ = run_all(engine, [prompt], max_tokens=10, ignore_eos=True)[0]
    stopped, _, last = run_all(
        engine, [prompt], max_tokens=10, stop_token_ids=(tokens[3],), ignore_eos=True
    )[0]
    assert (
        stopped == tokens[: tokens.index(tokens[3]) + 1] and last.finish_reason is FinishReason.STOP
    )
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    if needle.strip():
        _, cut, last = run_all(engine, [prompt], max_tokens=10, stop=(needle,), ignore_eos=True)[0]
        assert cut == text[: text.index(needle)] and last.finish_reason is FinishReason.STOP
        # min_tokens covering the whole output: no stop string counts (vLLM's rule)
        whole = dict(max_tokens=10, stop=(needle,), ignore_eos=True, min_tokens=10)
        _, uncut, last = run_all(engine, [prompt], **whole)[0]
        assert uncut == text and last.finish_reason is FinishReason.LENGTH


def test_a_stop_string_ended_by_the_last_allowed_token_is_a_stop(engine):
    """The stop string is checked before the length (vLLM's order): completed by the
    max_tokens-th token, the finish reason is "stop", not "length"."""
    prompt = [5, 6, 7, 8]
    tokens, text, _ = run_all(engine, [prompt], max_tokens=10, ignore_eos=True)[0]
    ends = [
        text[-n:] for n in (1, 2, 3) if text[-n:].strip() and text.find(text[-n:]) == len(text) - n
    ]
    assert ends, f"no suffix of {text!r} occurs only at its end"
    got, cut, last = run_all(engine, [prompt], max_tokens=10, stop=(ends[0],), ignore_eos=True)[0]
    assert got == tokens and cut == text[: -len(ends[0])]
    assert last.finish_reason is FinishReason.STOP


def test_bad_requests_get_400(engine):
    bad = [
        ([], dict(max_tokens=1), "prompt"),
        ([1] * 5000, dict(max_tokens=1), "prompt"),
        ([10**6], dict(max_tokens=1), "prompt"),
        ([1, 2], dict(max_tokens=0), "max_tokens"),
    ]
    for prompt, params, field in bad:
        _, _, last = run_all(engine, [prompt], **params)[0]
        assert last.finish_reason is FinishReason.ERROR and last.error_code == 400
        assert last.error.startswith(field)


def test_consumer_leaving_aborts_the_request(engine):
    aborts_before = metric_value(engine, "specd_aborts_total")

    async def go():
        gen = engine.generate(
            GenerateRequest("leave", (5, 6, 7), SamplingParams(max_tokens=500, ignore_eos=True))
        )
        async for _ in gen:
            break
        await gen.aclose()

    asyncio.run(go())
    deadline = time.monotonic() + 5
    while (
        metric_value(engine, "specd_aborts_total") == aborts_before and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert metric_value(engine, "specd_aborts_total") == aborts_before + 1
    assert wait_idle(engine)


def test_overlap_gives_the_synchronous_output(tiny_models):
    """Plain decode under overlap scheduling launches decode N+1 before N is resolved and
    still returns what one step at a time returns: greedy with stop tokens hit
    mid-stream (the step in flight is dropped), max_tokens, and seeded sampling."""
    prompts = random_prompts(8, 40, seed=5)
    sync = start_engine(tiny_models("gqa"), debug=STRICT)
    plain = run_all(sync, prompts, max_tokens=16, ignore_eos=True)
    stops = tuple({tokens[5] for tokens, _, _ in plain})
    runs = {
        "stop": dict(max_tokens=16, stop_token_ids=stops, ignore_eos=True),
        "sampled": dict(max_tokens=10, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True),
    }
    expected = {name: run_all(sync, prompts, **params) for name, params in runs.items()}
    sync.shutdown()
    assert any(len(t) < 16 for t, _, _ in expected["stop"])

    overlapped = start_engine(tiny_models("gqa"), scheduler={"overlap": True}, debug=STRICT)
    try:
        for name, params in runs.items():
            got = run_all(overlapped, prompts, **params)
            assert [(t, x, d.finish_reason) for t, x, d in got] == [
                (t, x, d.finish_reason) for t, x, d in expected[name]
            ], name
        assert metric_value(overlapped, "specd_engine_steps_launched_ahead_total") > 10
        assert wait_idle(overlapped) and overlapped.status().healthy
    finally:
        overlapped.shutdown()


class WakeCountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the wake-ups other threads send it."""

    wakeups = 0

    def call_soon_threadsafe(self, callback, *args, context=None):
        WakeCountingLoop.wakeups += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_a_step_wakes_each_consumer_loop_once(tiny_models):
    """Deltas of one step reach their streams in one hand-over per event loop (a thread
    wake-up costs the engine loop tens of microseconds), and every token still arrives."""
    engine = start_engine(tiny_models("gqa"), kvCache={"pageSize": 4, "maxTokens": 4096})
    prompts = random_prompts(8, 300, seed=3)
    try:
        run_all(engine, prompts[:1], max_tokens=2)  # the step counter's first samples
        steps_before = metric_value(engine, "specd_engine_steps_total")
        WakeCountingLoop.wakeups = 0
        results = run_all(
            engine, prompts, loop_factory=WakeCountingLoop, max_tokens=10, ignore_eos=True
        )
        steps = metric_value(engine, "specd_engine_steps_total") - steps_before
    finally:
        engine.shutdown()
    deltas = sum(len(tokens) for tokens, _, _ in results)
    assert deltas == 8 * 10 and all(len(tokens) == 10 for tokens, _, _ in results)
    # one per step that emitted, plus one per request's admission
    assert WakeCountingLoop.wakeups <= steps + len(prompts) < deltas


def test_requests_per_step_are_counted_by_kind(tiny_models):
    """``engine_step_requests_total`` counts each step's requests by the step's kind, so
    over ``engine_steps_total`` it is the mean batch.  Plain decoding of short prompts
    (one chunk each) puts a request in one step per token it samples."""
    engine = start_engine(tiny_models("gqa"), kvCache={"pageSize": 4, "maxTokens": 4096})
    try:
        run_all(engine, random_prompts(5, 300, seed=5), max_tokens=6, ignore_eos=True)
        requests = {
            kind: metric_value(engine, "specd_engine_step_requests_total", kind=kind)
            for kind in ("extend", "decode")
        }
        steps = {
            kind: metric_value(engine, "specd_engine_steps_total", kind=kind)
            for kind in ("extend", "decode")
        }
    finally:
        engine.shutdown()
    assert requests["extend"] + requests["decode"] == 5 * 6
    assert steps["extend"] <= requests["extend"] and steps["decode"] <= requests["decode"]
    assert 1 <= requests["decode"] / steps["decode"] <= 5


def test_the_loop_thread_under_overlap_runs_torch_on_one_core_and_no_other_thread_does():
    """Under overlap the loop thread's torch ops must not start a second OpenMP team
    next to the compute thread's; the process default for new threads stays as it was."""

    def threads_in_a_new_thread() -> int:
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        worker.start()
        worker.join()
        return seen[0]

    default = threads_in_a_new_thread()
    seen: dict[str, int] = {}

    def loop_thread() -> None:
        single_threaded_torch_in_this_thread()
        seen["after"] = torch.get_num_threads()

    worker = threading.Thread(target=loop_thread)
    worker.start()
    worker.join()
    assert seen["after"] == 1
    assert threads_in_a_new_thread() == default


def test_sampling_defaults_come_from_the_model_file_under_the_spec(tiny_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models("gqa"), folder)
    generation = folder / "generation_config.json"
    written = json.loads(generation.read_text()) if generation.is_file() else {}

    def defaults_with(file_values: dict, **spec) -> dict:
        generation.write_text(json.dumps({**written, **file_values}))
        engine = start_engine(str(folder), **spec)
        try:
            return engine.sampling_defaults
        finally:
            engine.shutdown()

    recommended = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.1}
    assert defaults_with(recommended) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "repetition_penalty": 1.1,
    }
    mine = defaults_with(recommended, samplingDefaults={"temperature": 0})
    assert mine == {"temperature": 0, "top_p": 0.8, "repetition_penalty": 1.1}
    with pytest.raises(ConfigError, match="generation_config.json has top_p=1.5"):
        defaults_with({"top_p": 1.5})
    assert defaults_with({"top_p": 1.5}, samplingDefaults={"fromModel": False}) == {}
