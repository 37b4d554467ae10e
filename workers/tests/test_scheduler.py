"""The scheduler driven with hand-made model outputs (no model, no tensors math)."""

import pytest

from specd.devtools.testing import RecordingOps
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.kv_manager import KVManager
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.requests.batch import RunnerOutput
from specd.workers.requests.request import Req, RequestStatus
from specd.workers.scheduler.scheduler import Scheduler, SchedulerConfig
from specd.workers.types import FinishReason, SamplingParams

EOS = 0


def make_scheduler(pages=64, page_size=4, rows=8, chunk=16, max_running=8, context=64):
    kv = KVManager(ReqToTokenPool(rows, context + 8), PagedTokenAllocator(pages, page_size))
    cfg = SchedulerConfig(max_running, chunk, context, frozenset({EOS}))
    return Scheduler(cfg, kv)


def req(rid, prompt_len, max_tokens=4, **kw):
    return Req(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def next_of(ids: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return 100 + (sum(ids) % 50)


def fake_token(r: Req) -> int:
    return next_of(r.fill_ids)


def step(s: Scheduler):
    batch = s.schedule()
    if batch is None:
        return None
    out = RunnerOutput(tuple(fake_token(r) for r in batch.sampled_reqs))
    s.process_result(batch, out)
    s.kv.check_integrity()
    return batch


def run_to_completion(s: Scheduler, reqs, max_steps=500):
    for r in reqs:
        s.add(r)
    for _ in range(max_steps):
        if not s.has_work():
            return
        step(s)
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_splits_long_prompt_and_samples_once():
    s = make_scheduler(chunk=8)
    r = req("a", 20, max_tokens=1)
    s.add(r)
    lens = [step(s).extend_lens for _ in range(3)]
    assert lens == [(8,), (8,), (4,)]
    assert r.finished and len(r.output_ids) == 1 and r.finish_reason is FinishReason.LENGTH
    assert s.kv.allocator.used_tokens == 0


def test_decodes_and_prefill_share_a_step():
    s = make_scheduler(chunk=8)
    a, b = req("a", 3, max_tokens=5), req("b", 12, max_tokens=5)
    s.add(a)
    step(s)
    s.add(b)
    batch = step(s)
    assert batch.extend_lens == (1, 7)  # a decodes, b gets the rest of the budget
    assert batch.sample == (True, False)


def test_max_running_requests_limits_admission():
    s = make_scheduler(max_running=2)
    for i in range(4):
        s.add(req(str(i), 2))
    step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2


@pytest.mark.parametrize("pages", [pytest.param(64, id="ample"), pytest.param(6, id="tight")])
def test_retraction_keeps_outputs_identical(pages):
    def outputs(p):
        s = make_scheduler(pages=p, page_size=4)
        reqs = [req(str(i), 5 + i, max_tokens=8) for i in range(5)]
        run_to_completion(s, reqs)
        assert s.kv.allocator.used_tokens == 0
        return [r.output_ids for r in reqs], s.num_retractions

    ample, _ = outputs(64)
    got, retractions = outputs(pages)
    assert got == ample
    if pages == 6:
        assert retractions > 0


def test_stop_rules():
    s = make_scheduler()
    r = req("a", 3, max_tokens=50, stop_token_ids=(fake_token(req("x", 3)),))
    run_to_completion(s, [r])
    assert r.finish_reason is FinishReason.STOP and len(r.output_ids) == 1


def test_context_length_stops_generation():
    s = make_scheduler(context=10)
    r = req("a", 8, max_tokens=50)
    run_to_completion(s, [r])
    assert r.finish_reason is FinishReason.LENGTH and r.num_fill == 10


def test_abort_frees_kv_wherever_the_request_is():
    s = make_scheduler(max_running=1)
    a, b = req("a", 4, max_tokens=20), req("b", 4)
    s.add(a)
    s.add(b)
    step(s)
    assert s.abort("a") is a and s.abort("b") is b
    assert a.finish_reason is b.finish_reason is FinishReason.ABORT
    assert a.status is RequestStatus.FINISHED and not s.has_work()
    assert s.kv.allocator.used_tokens == 0
    s.kv.check_integrity()
    assert s.abort("missing") is None


def test_a_scheduled_batch_writes_req_to_token_once():
    """Every request's new slots of one step go out in one ``write_req_to_token`` (one
    launch per step on CUDA, not one per request), admissions and decodes alike."""
    s = make_scheduler(chunk=64)
    s.kv.ops = ops = RecordingOps()
    for r in [req(f"r{i}", 3 + i, max_tokens=6) for i in range(4)]:
        s.add(r)
    first = step(s)  # admits all four prompts
    assert len(first.reqs) == 4 and len(ops.writes) == 1
    ops.writes.clear()
    decode = step(s)
    assert decode.extend_lens == (1, 1, 1, 1) and len(ops.writes) == 1
    assert len(ops.writes[0]) == 4  # one new position each


def run_overlapped(s: Scheduler, reqs, max_steps=500) -> int:
    """Drive ``s`` as the engine does under overlap: launch a batch, schedule the next one
    ahead, then resolve the first.  The fake device samples from each request's sequence
    with the tokens it sampled but the host has not seen yet.  Returns the number of
    batches scheduled ahead."""
    device_seq: dict[str, list[int]] = {}

    def launch(batch):
        tokens = []
        for r in batch.sampled_reqs:
            seq = device_seq[r.rid] if batch.decode_ahead else r.fill_ids
            tokens.append(next_of(seq))
            device_seq[r.rid] = seq + [tokens[-1]]
        return batch, RunnerOutput(tuple(tokens))

    for r in reqs:
        s.add(r)
    pending, ahead = None, 0
    for _ in range(max_steps):
        if pending is None:
            if not s.has_work():
                return ahead
            pending = launch(s.schedule())
            continue
        batch, out = pending
        nxt = s.schedule_decode_ahead(batch)
        pending = None if nxt is None else launch(nxt)
        ahead += nxt is not None
        s.process_result(batch, out)
        s.kv.check_integrity()
    raise AssertionError("scheduler did not finish")


def mixed_requests():
    probe = req("x", 5, max_tokens=3)
    run_to_completion(make_scheduler(), [probe])
    stop = probe.output_ids[2]  # "s" stops on its third token, mid-stream
    assert stop not in probe.output_ids[:2]
    return [
        req("a", 3, max_tokens=9),
        req("b", 17, max_tokens=4),
        req("s", 5, max_tokens=30, stop_token_ids=(stop,)),
        req("c", 6, max_tokens=12, stop_token_ids=(EOS, 131, 140)),
        req("d", 1, max_tokens=1),
    ]


def test_decode_ahead_gives_the_synchronous_output():
    """Requests finishing by length, by stop token while the next step is in flight (its
    result is dropped) and mid-stream, with chunked prefill: the same tokens and finish
    reasons as one step at a time, and every slot freed at the end."""
    sync, overlapped = mixed_requests(), mixed_requests()
    run_to_completion(make_scheduler(chunk=8), sync)
    s = make_scheduler(chunk=8)
    assert run_overlapped(s, overlapped) > 5
    assert [(r.output_ids, r.finish_reason) for r in overlapped] == [
        (r.output_ids, r.finish_reason) for r in sync
    ]
    assert s.kv.allocator.used_tokens == 0 and not s.deferred


def test_decode_ahead_positions_and_who_sits_out():
    """Each request decodes at the position after its in-flight tokens; one whose pending
    token reaches max_tokens sits out (no wasted step, no KV past its end)."""
    s = make_scheduler(chunk=64)
    long, ending = req("long", 5, max_tokens=9), req("ending", 7, max_tokens=1)
    s.add(long)
    s.add(ending)
    first = s.schedule()  # both prompts, both sampled
    ahead = s.schedule_decode_ahead(first)
    assert ahead.reqs == (long,) and ahead.prefix_lens == (5,) and ahead.decode_ahead
    assert long.kv.allocated >= 6 and long.inflight_steps == 2
    assert ending.kv.allocated == 7


def test_decode_ahead_drains_for_admission_prefill_and_a_full_pool():
    """Nothing is scheduled ahead while a request waits or is mid-prefill, or when a
    request cannot grow (no retraction behind a step in flight)."""
    s = make_scheduler(chunk=8)
    s.add(req("a", 3, max_tokens=20))
    s.add(req("long", 20))
    first = s.schedule()  # a whole, long's first chunk
    assert first.sample == (True, False) and s.schedule_decode_ahead(first) is None
    s.process_result(first, RunnerOutput((fake_token(first.reqs[0]),)))

    s.add(req("late", 2))
    second = s.schedule()
    s.add(req("later", 2))
    assert s.schedule_decode_ahead(second) is None  # "later" waits for admission

    tight = make_scheduler(pages=2, page_size=4, chunk=8)
    tight.add(req("x", 4, max_tokens=20))
    tight.add(req("y", 4, max_tokens=20))
    full = tight.schedule()  # both prompts fill both pages
    assert tight.schedule_decode_ahead(full) is None and tight.num_retractions == 0


def test_a_request_aborted_in_flight_frees_its_kv_when_the_step_lands():
    s = make_scheduler()
    r = req("a", 4, max_tokens=20)
    s.add(r)
    first = s.schedule()
    ahead = s.schedule_decode_ahead(first)
    s.abort("a")
    assert r.finished and r.release_deferred and s.kv.allocator.used_tokens > 0
    assert s.process_result(first, RunnerOutput((7,))) == [] and r.output_ids == []
    assert s.kv.allocator.used_tokens > 0  # the step scheduled ahead still writes KV
    assert s.process_result(ahead, RunnerOutput((8,))) == []
    assert s.kv.allocator.used_tokens == 0 and not s.deferred
