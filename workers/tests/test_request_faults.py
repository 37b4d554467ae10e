"""Per-request fault isolation (issue 28): a hostile request fails alone.  The four
requests that used to end an engine's loop (a tiny temperature, a tiny repetition
penalty, a seed past 64 bits, a regex that matches nothing) and a grammar that dead-ends
mid-output each get a 400 or an error finish, while a concurrent request's tokens equal
its tokens alone, an open session keeps its KV, the loop stays healthy and the strict
leak checks pass."""

import asyncio
import math

import pytest
import torch

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    check_leak_free,
    collect,
    demo_prompts,
    start_engine,
    start_spec_engine,
    wait_idle,
)
from specd.workers.requests.faults import contained, replica_fault, unusable_rows
from specd.workers.requests.request import Req
from specd.workers.runner.sampling import check_sampling_params, sample_next_tokens
from specd.workers.types import Grammar, InvalidRequest, SamplingParams

VOCAB = 1000
NOTHING = "[^\\x00-\\U0010FFFF]"  # a character class no character is in


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2**40), "top_k"),
        (dict(seed=2**64), "seed"),
        (dict(seed=2**70), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(grammar=Grammar("json_object"), stop_token_ids=(VOCAB,)), "stop_token_ids"),
        (dict(grammar=Grammar("json_object"), stop_token_ids=(-1,)), "stop_token_ids"),
    ],
    ids=lambda v: v if isinstance(v, str) else repr(v)[:40],
)
def test_sampling_values_that_cannot_be_computed_are_refused_naming_the_field(params, field):
    with pytest.raises(InvalidRequest, match=f"^{field}:"):
        check_sampling_params(SamplingParams(**params), VOCAB)


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -(2**63)])
def test_every_seed_in_range_is_one_torch_takes(seed):
    check_sampling_params(SamplingParams(seed=seed, temperature=1.0), VOCAB)
    torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "temperature, greedy", [(0.0, True), (1e-300, True), (9e-6, True), (1e-5, False)]
)
def test_temperatures_below_the_epsilon_are_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_an_unusable_row_is_flagged_and_gets_a_valid_stand_in():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = math.nan
    logits[2] = -math.inf  # every token refused
    reqs = [Req(f"r{i}", [1], SamplingParams(temperature=1.0, seed=i)) for i in range(4)]
    tokens, unusable = sample_next_tokens(logits, reqs)
    assert unusable.tolist() == [False, True, True, False]
    assert ((tokens >= 0) & (tokens < 50)).all()
    alone, _ = sample_next_tokens(
        logits[3:], [Req("r3", [1], SamplingParams(temperature=1.0, seed=3))]
    )
    assert tokens[3] == alone[0]  # the healthy rows drew what they draw alone
    assert unusable_rows(torch.tensor([[0.0, math.inf], [0.0, 1.0]])).tolist() == [True, False]


def test_a_request_error_is_kept_on_the_request_and_a_replica_error_is_raised():
    req = Req("r", [1], SamplingParams())
    with contained(req, "sampling"):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")
    assert req.fault.startswith("sampling failed for this request: RuntimeError")
    for err in (AssertionError("KV leak"), RuntimeError("CUDA error: device-side assert")):
        assert replica_fault(err)
        with pytest.raises(type(err)), contained(req, "sampling"):
            raise err


ENGINES = {
    "plain": lambda **kw: start_engine(DEMO_TARGET, debug={"strictMemCheck": 1}, **kw),
    "plain overlap": lambda **kw: start_engine(
        DEMO_TARGET, debug={"strictMemCheck": 1}, scheduler={"overlap": True}, **kw
    ),
    "chain": lambda **kw: start_spec_engine(DEMO_TARGET, DEMO_EAGLE, steps=3, **kw),
    "paged tree overlap": lambda **kw: start_spec_engine(
        DEMO_TARGET, DEMO_EAGLE, page_size=16, steps=3, topk=4, overlap=True, **kw
    ),
}
HOSTILE = {  # request fields -> (finish, HTTP status of the error or None)
    "tiny temperature": (dict(temperature=1e-300), "length", None),
    "tiny repetition penalty": (dict(temperature=1.0, repetition_penalty=1e-300), "error", 400),
    "seed past 64 bits": (dict(temperature=1.0, seed=2**70), "error", 400),
    "regex matching nothing": (
        dict(grammar=Grammar("regex", NOTHING, field="regex")),
        "error",
        400,
    ),
    "regex dead-ending mid-output": (
        dict(grammar=Grammar("regex", "de" + NOTHING, field="regex")),
        "error",
        400,
    ),
    "sampled dead end": (
        dict(temperature=1.0, seed=3, grammar=Grammar("regex", "de" + NOTHING, field="regex")),
        "error",
        400,
    ),
}


@pytest.fixture(scope="module", params=list(ENGINES), ids=list(ENGINES))
def engine(request):
    engine = ENGINES[request.param](sessions={"enabled": True})
    yield engine
    engine.shutdown()


def test_hostile_requests_fail_alone(engine):
    prompt = demo_prompts(1)[0]
    alone = asyncio.run(collect(engine, "alone", prompt, max_tokens=24))[0]
    sid = engine.open_session()
    asyncio.run(collect(engine, "turn", prompt[:20], session_id=sid, max_tokens=8))
    assert wait_idle(engine)
    session_kv = engine.status().session_kv_tokens
    assert session_kv > 0

    async def both(params):
        return await asyncio.gather(
            collect(engine, "hostile", prompt, max_tokens=16, **params),
            collect(engine, "normal", prompt, max_tokens=24),
        )

    for name, (params, finish, status) in HOSTILE.items():
        (tokens, _, last), (normal, _, normal_last) = asyncio.run(both(params))
        assert last.finish_reason.value == finish, (name, last.error)
        assert last.error_code == status, (name, last.error)
        if status is not None:
            field = next(f for f in ("regex", "repetition_penalty", "seed") if f in last.error)
            assert last.error.startswith(f"{field}:"), (name, last.error)
        assert normal == alone and normal_last.finish_reason.value == "length", name
        assert engine.healthy, (name, engine.last_error)
        assert wait_idle(engine), name
        assert engine.status().session_kv_tokens == session_kv, name  # the session kept it
    # the session still serves a turn over its history
    _, _, turn = asyncio.run(collect(engine, "turn2", prompt[20:30], session_id=sid, max_tokens=4))
    assert turn.usage.cached_tokens > 0 and turn.error is None
    engine.close_session(sid)
    assert wait_idle(engine)
    check_leak_free(engine)
    assert engine.status().leak_check_failures == 0
