"""Priority scheduling (``scheduler.policy: priority``): admission order, who is retracted
when KV runs out, preemption of lower priorities, and exact outputs through it all."""

from __future__ import annotations

import asyncio

import pytest

from specd.devtools.testing import (
    collect,
    hf_greedy,
    metric_value,
    random_prompts,
    start_engine,
    start_spec_engine,
    wait_idle,
)
from specd.workers.config import ConfigError
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.kv_manager import KVManager
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.requests.request import RequestStatus
from specd.workers.scheduler.scheduler import Scheduler, SchedulerConfig
from specd.workers.types import FinishReason

from .test_scheduler import EOS, req, step


def make_scheduler(policy="priority", pages=64, page_size=4, max_running=8, chunk=64):
    kv = KVManager(ReqToTokenPool(8, 72), PagedTokenAllocator(pages, page_size))
    return Scheduler(SchedulerConfig(max_running, chunk, 64, frozenset({EOS}), policy=policy), kv)


def ranked(rid, priority, prompt_len=4, max_tokens=4, arrival=0.0):
    r = req(rid, prompt_len, max_tokens)
    r.priority, r.arrival_time = priority, arrival
    return r


def admitted_order(s: Scheduler) -> list[str]:
    order = []
    while s.has_work():
        for r in step(s).reqs:
            if r.rid not in order:
                order.append(r.rid)
    return order


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("priority", ["high", "mid-1", "mid-2", "low"]), ("fcfs", ["low", "mid-1", "high", "mid-2"])],
)
def test_waiting_requests_start_by_priority_then_arrival(policy, expected):
    s = make_scheduler(policy, max_running=1)
    for i, (rid, priority) in enumerate([("low", 9), ("mid-1", 3), ("high", -2), ("mid-2", 3)]):
        s.add(ranked(rid, priority, arrival=float(i)))
    assert admitted_order(s) == expected


def test_a_higher_priority_preempts_the_lowest_running_request_when_the_batch_is_full():
    s = make_scheduler(max_running=2)
    low, mid = ranked("low", 5, max_tokens=8, arrival=0), ranked("mid", 1, max_tokens=8, arrival=1)
    s.add(low)
    s.add(mid)
    step(s)
    step(s)
    kept = list(low.output_ids)
    high = ranked("high", 0, max_tokens=2, arrival=2)
    s.add(high)
    batch = step(s)
    assert high in batch.reqs and low not in batch.reqs
    assert low.status is RequestStatus.WAITING and low.kv.row is None  # its KV is freed
    assert low.output_ids == kept and low.num_retractions == 1  # its output is kept
    assert (s.num_preemptions, s.num_retractions) == (1, 0)
    while s.has_work():
        step(s)
    assert all(r.finish_reason is FinishReason.LENGTH for r in (low, mid, high))
    assert len(low.output_ids) == 8 and s.kv.allocator.used_tokens == 0


def test_equal_priorities_never_preempt_each_other():
    s = make_scheduler(max_running=1)
    first = ranked("first", 2, max_tokens=6, arrival=0)
    s.add(first)
    step(s)
    s.add(ranked("second", 2, arrival=1))
    assert step(s).reqs == (first,)
    assert s.num_preemptions == 0


def test_fcfs_never_preempts():
    s = make_scheduler("fcfs", max_running=1)
    s.add(ranked("low", 9, max_tokens=6))
    step(s)
    s.add(ranked("high", 0, arrival=1))
    assert [r.rid for r in step(s).reqs] == ["low"]
    assert s.num_preemptions == 0


def test_a_higher_priority_preempts_for_kv_room_only_when_that_makes_enough():
    # 12 pages of 4: two running requests of 5 pages each (20-token prompts)
    s = make_scheduler(pages=12, chunk=64)
    low = ranked("low", 4, prompt_len=19, max_tokens=20, arrival=0)
    mid = ranked("mid", 2, prompt_len=19, max_tokens=20, arrival=1)
    for r in (low, mid):
        s.add(r)
    step(s)
    too_big = ranked("too-big", 3, prompt_len=30, arrival=2)  # outranks only low: not enough
    s.add(too_big)
    assert too_big not in step(s).reqs and s.num_preemptions == 0
    high = ranked("high", 0, prompt_len=8, arrival=3)
    s.add(high)
    assert [r.rid for r in s.waiting] == ["high", "too-big"]
    batch = step(s)
    assert high in batch.reqs and low not in batch.reqs and mid in batch.reqs
    assert s.num_preemptions == 1 and [r.rid for r in s.waiting] == ["too-big", "low"]


def test_kv_pressure_retracts_the_lowest_priority_not_the_newest():
    s = make_scheduler(pages=8)  # 32 slots
    old_low = ranked("old-low", 7, prompt_len=12, max_tokens=20, arrival=0)
    new_high = ranked("new-high", 1, prompt_len=12, max_tokens=20, arrival=1)
    for r in (old_low, new_high):
        s.add(r)
    step(s)
    assert s.running == [new_high, old_low]  # the newest running is the low one: make it so
    s.running.reverse()
    while old_low.status is RequestStatus.RUNNING and not new_high.finished:
        step(s)
    assert old_low.status is RequestStatus.WAITING and new_high.num_retractions == 0
    assert s.num_retractions >= 1 and s.num_preemptions == 0
    while s.has_work():
        step(s)
    assert len(old_low.output_ids) == len(new_high.output_ids) == 20


MAX_NEW = 24


@pytest.fixture(scope="module")
def references(pair):
    target = pair[0]
    prompts = random_prompts(2, 300, seed=11, lo=20, hi=30)
    return prompts, hf_greedy(target, prompts, MAX_NEW)


async def _low_then_high(engine, prompts):
    """A long low-priority request, then (once it streams) a short high-priority one:
    -> (their outputs, the order they finished in)."""
    finished: list[str] = []

    async def run(rid, prompt, priority, max_tokens, started=None):
        tokens = []
        async for delta in engine.generate(_request(rid, prompt, priority, max_tokens)):
            tokens += delta.token_ids
            if started is not None and not started.is_set():
                started.set()
        finished.append(rid)
        return tokens

    started = asyncio.Event()
    low = asyncio.create_task(run("low", prompts[0], 8, MAX_NEW, started))
    await started.wait()
    high = await run("high", prompts[1], -1, 6)
    return (await low, high), finished


def _request(rid, prompt, priority, max_tokens):
    from specd.workers.types import GenerateRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(rid, tuple(prompt), params, priority=priority)


@pytest.mark.parametrize(
    "engine_kind", ["plain", "plain-overlap", "eagle-tree", "eagle-tree-overlap"]
)
def test_a_preempted_request_resumes_exactly(pair, references, engine_kind):
    """One request may run at a time: the high-priority request preempts the low one,
    finishes first, and both outputs equal transformers greedy (strict leak checks)."""
    prompts, expected = references
    options = {"maxRunningRequests": 1}
    if engine_kind.startswith("eagle-tree"):
        engine = start_spec_engine(
            pair[0], pair[1], page_size=4, steps=3, topk=2, **options,
            overlap=engine_kind.endswith("overlap"), scheduler={"policy": "priority"},
        )  # fmt: skip
    else:
        overlap = engine_kind == "plain-overlap"
        engine = start_engine(
            pair[0], **options, debug={"strictMemCheck": 1},
            scheduler={"chunkedPrefillSize": 8, "policy": "priority", "overlap": overlap},
        )  # fmt: skip
    try:
        (low, high), finished = asyncio.run(_low_then_high(engine, prompts))
        assert finished == ["high", "low"]
        assert low == expected[0] and high == expected[1][:6]
        assert metric_value(engine, "specd_preemptions_total") == 1
        assert metric_value(engine, "specd_retractions_total") == 0
        assert engine.status().preemptions == 1
        assert wait_idle(engine)
    finally:
        engine.shutdown()


def test_fcfs_refuses_a_priority_naming_the_field_and_the_fix(pair):
    engine = start_engine(pair[0])
    try:
        _, _, last = asyncio.run(collect(engine, "r", [5, 6, 7], priority=3, max_tokens=2))
        assert last.error_code == 400 and last.finish_reason is FinishReason.ERROR
        assert last.error.startswith("priority:")
        assert "spec.scheduler.policy: priority" in last.error
        tokens, _, last = asyncio.run(collect(engine, "ok", [5, 6, 7], priority=0, max_tokens=2))
        assert len(tokens) == 2 and last.error is None
    finally:
        engine.shutdown()


def test_an_unknown_policy_is_refused_naming_the_field(pair):
    with pytest.raises(ConfigError, match=r"scheduler\.policy.*'fcfs' or 'priority'"):
        start_engine(pair[0], scheduler={"policy": "lifo"})
