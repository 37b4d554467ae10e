"""``spec.scheduler.streamInterval``: deltas gather tokens between sends, the output is
the same token for token, and requests with stop strings still send every step."""

from __future__ import annotations

import asyncio

import pytest

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    check_leak_free,
    demo_prompts,
    random_prompts,
    start_engine,
    wait_idle,
)
from specd.workers.config import ConfigError, parse_deployment
from specd.workers.types import FinishReason, GenerateRequest, SamplingParams

INTERVAL = 4


def deltas_of(engine, prompts, **params) -> list[list]:
    """Every delta of each prompt's request, all requests at once."""

    async def one(i, prompt):
        req = GenerateRequest(f"r{i}", tuple(prompt), SamplingParams(**params))
        return [delta async for delta in engine.generate(req)]

    async def all_of():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(all_of())


def outcome(deltas) -> tuple:
    tokens = [t for d in deltas for t in d.token_ids]
    return tokens, "".join(d.text for d in deltas), deltas[-1].finish_reason


def sizes(deltas) -> list[int]:
    """Tokens per delta, the deltas before the first token left out."""
    counts = [len(d.token_ids) for d in deltas]
    while counts and counts[0] == 0:
        counts.pop(0)
    return counts


@pytest.fixture(scope="module")
def engines(tiny_models):
    """(every step, every INTERVAL tokens) over the same checkpoint."""
    made = [
        start_engine(
            tiny_models("gqa"),
            kvCache={"maxTokens": 4096},
            scheduler={"streamInterval": interval, "chunkedPrefillSize": 8},
            debug={"strictMemCheck": 1},
        )
        for interval in (1, INTERVAL)
    ]
    yield made
    for engine in made:
        engine.shutdown()


def test_plain_decoding_sends_every_interval_tokens_and_the_same_output(engines):
    every_step, gathered = engines
    prompts = random_prompts(6, 300, seed=3)
    params = dict(max_tokens=14, ignore_eos=True)
    before = deltas_of(every_step, prompts, **params)
    after = deltas_of(gathered, prompts, **params)
    assert [outcome(d) for d in after] == [outcome(d) for d in before]
    for deltas in before:
        assert sizes(deltas) == [1] * 14
    for deltas in after:  # the first token at once, then 4, 4, 4, and the last 1
        assert sizes(deltas) == [1, 4, 4, 4, 1]
    assert wait_idle(gathered)
    check_leak_free(gathered)


def test_requests_with_stop_strings_send_every_step_and_cut_where_they_did(engines):
    every_step, gathered = engines
    prompt = [5, 6, 7, 8]
    [whole] = deltas_of(every_step, [prompt], max_tokens=16, ignore_eos=True)
    tokens, text, _ = outcome(whole)
    needles = sorted({text[i : i + 2] for i in range(2, len(text) - 2)} - {"", " "})
    checked = 0
    for needle in needles[:6]:
        if not needle.strip():
            continue
        params = dict(max_tokens=16, ignore_eos=True, stop=(needle,))
        [cut_before] = deltas_of(every_step, [prompt], **params)
        [cut_after] = deltas_of(gathered, [prompt], **params)
        assert outcome(cut_after) == outcome(cut_before)
        assert cut_after[-1].usage.completion_tokens == cut_before[-1].usage.completion_tokens
        assert outcome(cut_after)[2] is FinishReason.STOP
        assert sizes(cut_after)[:-1] == [1] * (len(sizes(cut_after)) - 1)
        checked += 1
    assert checked >= 3
    assert wait_idle(gathered)
    check_leak_free(gathered)


def test_speculative_deltas_gather_verify_steps_and_stay_exact():
    prompts = demo_prompts(3)
    spec = {"numSteps": 3, "topk": 1, "numDraftTokens": 4}
    made = [
        start_engine(
            DEMO_TARGET,
            draft={"path": DEMO_EAGLE},
            speculative=spec,
            scheduler={"streamInterval": interval},
        )
        for interval in (1, 8)
    ]
    try:
        before, after = (deltas_of(e, prompts, max_tokens=40, ignore_eos=True) for e in made)
    finally:
        for engine in made:
            engine.shutdown()
    assert [outcome(d) for d in after] == [outcome(d) for d in before]
    for deltas in after:
        middle = sizes(deltas)[1:-1]
        assert middle and all(n >= 8 for n in middle)
    assert sum(map(len, after)) < sum(map(len, before))


@pytest.mark.parametrize("bad", [0, -1, 1025, "four"])
def test_a_bad_interval_is_refused_naming_the_field(bad):
    doc = {
        "apiVersion": "specd.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "x"},
        "spec": {"model": {"path": "/m"}, "scheduler": {"streamInterval": bad}},
    }
    with pytest.raises(ConfigError, match=r"spec\.scheduler\.streamInterval"):
        parse_deployment(doc)
