"""``n`` choices: their engine requests, and merging their delta streams."""

from __future__ import annotations

import asyncio

import pytest

from specd.workers.gateway.parallel_choices import choice_requests, merge_streams
from specd.workers.types import GenerateRequest, SamplingParams


def test_choice_requests_get_ids_and_consecutive_seeds():
    req = GenerateRequest("cmpl-x", (1, 2), SamplingParams(seed=7, temperature=1.0))
    assert choice_requests(req, 1) == [req]
    three = choice_requests(req, 3)
    assert [(r.rid, r.params.seed) for r in three] == [(f"cmpl-x-{i}", 7 + i) for i in range(3)]
    assert all(r.prompt_ids == req.prompt_ids and r.params.temperature == 1.0 for r in three)
    unseeded = choice_requests(GenerateRequest("y", (1,), SamplingParams()), 2)
    assert [r.params.seed for r in unseeded] == [None, None]


async def _items(name, count, delay, closed):
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        closed.append(name)


async def test_merge_keeps_each_streams_order_and_interleaves():
    closed = []
    merged = [
        x
        async for x in merge_streams([_items("a", 3, 0.01, closed), _items("b", 2, 0.003, closed)])
    ]
    assert [x for i, x in merged if i == 0] == ["a0", "a1", "a2"]
    assert [x for i, x in merged if i == 1] == ["b0", "b1"]
    assert merged[0] == (1, "b0")  # the faster stream is not held back
    assert sorted(closed) == ["a", "b"]


async def test_merge_raises_a_streams_error_and_closes_the_others():
    closed = []

    async def broken():
        yield "x"
        raise RuntimeError("replica lost")

    merged = merge_streams([_items("slow", 100, 0.05, closed), broken()])
    with pytest.raises(RuntimeError, match="replica lost"):
        async for _ in merged:
            pass
    assert closed == ["slow"]


async def test_closing_the_merge_closes_every_stream():
    closed = []
    merged = merge_streams([_items("a", 100, 0.01, closed), _items("b", 100, 0.01, closed)])
    assert (await anext(merged))[1] in ("a0", "b0")
    await merged.aclose()
    assert sorted(closed) == ["a", "b"]
