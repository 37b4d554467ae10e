"""Streaming sessions in the engine (seed 004's matrix): KV inheritance, concurrency,
aborts, over-length turns, retraction, idle expiry, and leak checks that catch the
seeds' bugs.  Every engine runs with strict busy checks; every scenario ends with all
sessions closed, no KV held and no leak-check failure."""

from __future__ import annotations

import asyncio
import inspect
import json
import time

import pytest
from tokenizers import Tokenizer

from specd.devtools.testing import (
    DEMO_MODELS,
    collect,
    hf_greedy,
    metric_value,
    random_prompts,
    start_engine,
    wait_idle,
)
from specd.devtools.tiny_checkpoint import make_tiny_checkpoint
from specd.workers.debug_toggles import reverted_behaviours
from specd.workers.types import (
    FinishReason,
    GenerateRequest,
    SamplingParams,
    SessionError,
)

MAX_NEW = 12
CONFIGS = {
    "plain": {},
    "plain-page16": {"kvCache": {"pageSize": 16}},
    "plain-overlap": {"scheduler": {"overlap": True}},
    "chain-overlap": {
        "speculative": {"numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "scheduler": {"overlap": True, "chunkedPrefillSize": 16},
    },
    "tree-overlap-page16": {
        "speculative": {"numSteps": 3, "topk": 4, "numDraftTokens": 8},
        "scheduler": {"overlap": True, "chunkedPrefillSize": 16},
        "kvCache": {"pageSize": 16},
    },
    "ngram-tree-overlap-page16": {
        "draft": {"algorithm": "NGRAM"},
        "speculative": {"numSteps": 3, "topk": 4, "numDraftTokens": 8},
        "scheduler": {"overlap": True, "chunkedPrefillSize": 16},
        "kvCache": {"pageSize": 16},
    },
    "suffix-chain-overlap": {
        "draft": {"algorithm": "SUFFIX"},
        "speculative": {"numSteps": 3, "topk": 1, "numDraftTokens": 4},
        "scheduler": {"overlap": True, "chunkedPrefillSize": 16},
    },
    "hybrid-tree-overlap": {  # the EAGLE draft, or SUFFIX's tree wherever it proposes
        "speculative": {
            "numSteps": 3,
            "topk": 4,
            "numDraftTokens": 8,
            "suffix": {"hybridThreshold": 0},
        },
        "scheduler": {"overlap": True, "chunkedPrefillSize": 16},
    },
    # batches of more than two run plain with the draft deferred; smaller ones catch up
    # and speculate (speculative/deferred_extend.py)
    "chain-deferred-overlap": {
        "speculative": {"numSteps": 3, "policy": {"maxBatchForSpec": 2}},
        "scheduler": {"overlap": True, "chunkedPrefillSize": 16},
    },
}


@pytest.fixture(scope="module")
def models(pair):
    return pair[0], pair[1]  # target, EAGLE draft (random weights)


def session_engine(models, config, **extra):
    target, draft = models
    spec = {k: dict(v) for k, v in config.items()}
    if "speculative" in spec:
        spec.setdefault("draft", {"path": draft})
    kv = {"maxTokens": 4096, **spec.pop("kvCache", {}), **extra.pop("kvCache", {})}
    sessions = {"enabled": True, **extra.pop("sessions", {})}
    return start_engine(
        target, kvCache=kv, sessions=sessions, debug={"strictMemCheck": 1}, **spec, **extra
    )


# the same session paths as the NGRAM and EAGLE configs: CI's slow pass runs them
SLOW_CONFIGS = {"suffix-chain-overlap", "hybrid-tree-overlap"}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CONFIGS else name
        for name in CONFIGS
    ],
    ids=list(CONFIGS),
)
def engine(request, models):
    engine = session_engine(models, CONFIGS[request.param])
    yield engine
    engine.shutdown()


async def turn(engine, sid, rid, prompt, max_tokens=MAX_NEW):
    return await collect(engine, rid, prompt, sid, max_tokens=max_tokens, ignore_eos=True)


def expected_chain(engine, turns, max_tokens=MAX_NEW):
    """Greedy outputs of each turn, computed without sessions: turn i continues the
    concatenation of every earlier prompt and output, sent whole."""
    history, outputs = [], []

    async def go():
        for i, prompt in enumerate(turns):
            tokens, _, _ = await collect(
                engine, f"ref{i}", history + prompt, max_tokens=max_tokens, ignore_eos=True
            )
            outputs.append(tokens)
            history.extend(prompt + tokens)

    asyncio.run(go())
    return outputs


def assert_clean(engine):
    """After the scenario's sessions closed: no KV or row held, no leak failure."""
    deadline = time.monotonic() + 5
    while (engine.status().sessions_open or not wait_idle(engine, 0.1)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert engine.status().kv_used_tokens == 0, engine.status()
    time.sleep(0.1)  # the idle check of this idle period has run
    assert metric_value(engine, "specd_sessions_open") == 0
    assert metric_value(engine, "specd_session_kv_tokens") == 0
    assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
    assert metric_value(engine, "specd_leak_checks_total", mode="idle", result="ok") > 0
    assert engine.status().healthy, engine.status().last_error
    assert engine.req_pool.num_free == engine.req_pool.num_rows


def test_kv_inheritance_over_three_turns(engine):
    turns = random_prompts(3, 300, seed=11, lo=5, hi=15)
    expected = expected_chain(engine, turns)
    sid = engine.open_session()

    async def go():
        return [await turn(engine, sid, f"t{i}", p) for i, p in enumerate(turns)]

    results = asyncio.run(go())
    assert [r[0] for r in results] == expected
    history = 0
    for i, (prompt, (tokens, _, last)) in enumerate(zip(turns, results, strict=True)):
        # previous prompts + completions; the first turn's prompt the reference computed
        # is lent by the prefix cache
        reused = lent(engine, len(prompt) - 1) if i == 0 else history
        assert last.usage.cached_tokens == reused
        assert last.usage.prompt_tokens == history + len(prompt)
        history += len(prompt) + len(tokens)
    assert wait_idle(engine)
    assert engine.status().sessions_open == 1
    assert engine.status().session_kv_tokens >= history - 1
    engine.close_session(sid)
    assert_clean(engine)


def test_six_sessions_five_turns_concurrently_twice(engine):
    chains = [random_prompts(5, 300, seed=100 + s, lo=3, hi=9) for s in range(6)]
    expected = [expected_chain(engine, chain) for chain in chains]

    async def one_session(s, chain):
        sid = engine.open_session()
        outs = []
        for i, prompt in enumerate(chain):
            tokens, _, last = await turn(engine, sid, f"s{s}t{i}", prompt)
            assert last.finish_reason is FinishReason.LENGTH, last.error
            outs.append(tokens)
        engine.close_session(sid)
        return outs

    async def go():
        return await asyncio.gather(*(one_session(s, c) for s, c in enumerate(chains)))

    for _ in range(2):
        assert asyncio.run(go()) == expected
        assert_clean(engine)


async def abort_after_first_token(engine, sid, rid, prompt):
    """Start a long turn and leave after its first tokens (the engine aborts it)."""
    stream = engine.generate(
        GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=200, ignore_eos=True), sid)
    )
    async for delta in stream:
        if delta.token_ids:
            break
    await stream.aclose()


def test_mid_turn_abort_rolls_back_and_the_next_turn_reuses_kv(engine):
    turns = random_prompts(3, 300, seed=21, lo=5, hi=12)
    expected = expected_chain(engine, [turns[0], turns[2]])
    sid = engine.open_session()

    async def go():
        first = await turn(engine, sid, "a0", turns[0])
        await abort_after_first_token(engine, sid, "a1", turns[1])
        return first, await turn(engine, sid, "a2", turns[2])

    first, after = asyncio.run(go())
    assert [first[0], after[0]] == expected
    assert after[2].usage.cached_tokens == len(turns[0]) + len(first[0])
    engine.close_session(sid)
    assert_clean(engine)


def test_first_turn_abort_then_recovery(engine):
    turns = random_prompts(2, 300, seed=31, lo=5, hi=12)
    expected = expected_chain(engine, [turns[1]])
    sid = engine.open_session()

    async def go():
        await abort_after_first_token(engine, sid, "f0", turns[0])
        return await turn(engine, sid, "f1", turns[1])

    tokens, _, last = asyncio.run(go())
    assert [tokens] == expected
    assert last.usage.cached_tokens == lent(engine, len(turns[1]) - 1)  # the reference's
    engine.close_session(sid)
    assert_clean(engine)


def test_over_length_turn_is_refused_and_the_session_survives(engine):
    turns = random_prompts(2, 300, seed=41, lo=5, hi=12)
    expected = expected_chain(engine, turns)
    too_long = random_prompts(1, 300, seed=42, lo=300, hi=300)[0]  # context is 256
    sid = engine.open_session()

    async def go():
        first = await turn(engine, sid, "o0", turns[0])
        refused = await turn(engine, sid, "o1", too_long)
        return first, refused, await turn(engine, sid, "o2", turns[1])

    first, refused, after = asyncio.run(go())
    assert refused[2].error_code == 400 and "context length" in refused[2].error
    assert [first[0], after[0]] == expected
    assert after[2].usage.cached_tokens == len(turns[0]) + len(first[0]) > 0
    engine.close_session(sid)
    assert_clean(engine)


def test_turn_that_runs_out_of_context_is_rolled_back(engine):
    """A turn that stops at the context length (not max_tokens) does not join the
    history: the next turn continues from the turn before it, reusing its KV."""
    first_prompt, last_prompt = random_prompts(2, 300, seed=51, lo=5, hi=12)
    filler = random_prompts(1, 300, seed=52, lo=200, hi=200)[0]
    expected = expected_chain(engine, [first_prompt, last_prompt])
    sid = engine.open_session()

    async def go():
        first = await turn(engine, sid, "c0", first_prompt)
        full = await turn(engine, sid, "c1", filler, max_tokens=200)
        return first, full, await turn(engine, sid, "c2", last_prompt)

    first, full, after = asyncio.run(go())
    assert full[2].finish_reason is FinishReason.LENGTH
    assert full[2].usage.prompt_tokens + len(full[0]) == 256
    assert [first[0], after[0]] == expected
    assert after[2].usage.cached_tokens == len(first_prompt) + len(first[0])
    engine.close_session(sid)
    assert_clean(engine)


def test_bad_session_calls(engine):
    sid = engine.open_session()

    async def go():
        unknown = await turn(engine, "no-such-session", "b0", [5, 6, 7])
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        slow = engine.generate(GenerateRequest("b1", (5, 6, 7), params, sid))
        await anext(slow)  # its first token is out: the turn is in flight for 199 more
        busy = await turn(engine, sid, "b2", [8, 9])
        async for _ in slow:
            pass
        engine.close_session(sid)
        closed = await turn(engine, sid, "b3", [8, 9])
        return unknown, busy, closed

    unknown, busy, closed = asyncio.run(go())
    assert unknown[2].error_code == 404
    assert busy[2].error_code == 409 and "in flight" in busy[2].error
    assert closed[2].error_code == 410
    with pytest.raises(Exception, match="was closed") as err:
        engine.close_session(sid)
    assert err.value.code == 410
    assert_clean(engine)


@pytest.mark.parametrize(
    ("config", "pool"),
    [
        ("plain", 320),
        ("chain-overlap", 384),
        ("tree-overlap-page16", 768),
        ("chain-deferred-overlap", 384),
    ],
)
def test_retraction_under_a_small_pool_keeps_sessions_exact(models, config, pool):
    """Page 16, a pool too small for every session at once: idle sessions' KV is
    evicted (history kept), running turns are retracted (their session KV given back
    too), resume, and every output stays exact."""
    chains = [random_prompts(2, 300, seed=200 + s, lo=60, hi=80) for s in range(3)]
    reference = session_engine(models, CONFIGS["plain"])
    try:
        expected = [expected_chain(reference, chain, max_tokens=40) for chain in chains]
    finally:
        reference.shutdown()
    engine = session_engine(models, CONFIGS[config], kvCache={"pageSize": 16, "maxTokens": pool})

    async def one_session(s, chain):
        sid = engine.open_session()
        outs = [(await turn(engine, sid, f"r{s}t{i}", p, 40))[0] for i, p in enumerate(chain)]
        engine.close_session(sid)
        return outs

    async def go():
        return await asyncio.gather(*(one_session(s, c) for s, c in enumerate(chains)))

    try:
        assert asyncio.run(go()) == expected
        assert metric_value(engine, "specd_retractions_total") > 0
        assert metric_value(engine, "specd_session_kv_evictions_total") > 0
        assert_clean(engine)
    finally:
        engine.shutdown()


def test_idle_sessions_expire(models):
    engine = session_engine(models, CONFIGS["plain"], sessions={"timeoutSeconds": 0.3})
    try:
        sid = engine.open_session()
        asyncio.run(turn(engine, sid, "e0", [5, 6, 7, 8]))
        assert wait_idle(engine) and engine.status().session_kv_tokens > 0
        time.sleep(1.6)
        _, _, last = asyncio.run(turn(engine, sid, "e1", [9]))
        assert last.error_code == 410 and "expired" in last.error
        assert_clean(engine)
    finally:
        engine.shutdown()


def test_sessions_disabled(models):
    engine = start_engine(models[0])
    try:
        with pytest.raises(Exception, match="spec.sessions.enabled") as err:
            engine.open_session()
        assert err.value.code == 400
        _, _, last = asyncio.run(turn(engine, "x", "d0", [5, 6]))
        assert last.error_code == 400 and "session_id" in last.error
    finally:
        engine.shutdown()


def test_plain_session_turns_match_transformers(models):
    """The reference chain itself is checked against transformers once."""
    engine = session_engine(models, CONFIGS["plain"])
    turns = random_prompts(2, 300, seed=61, lo=5, hi=10)
    try:
        sid = engine.open_session()

        async def go():
            return [await turn(engine, sid, f"h{i}", p) for i, p in enumerate(turns)]

        first, second = asyncio.run(go())
    finally:
        engine.shutdown()
    assert [first[0]] == hf_greedy(models[0], [turns[0]], MAX_NEW)
    assert [second[0]] == hf_greedy(models[0], [turns[0] + first[0] + turns[1]], MAX_NEW)


# -- sessions and the prefix cache ------------------------------------------------------


def lent(engine, tokens: int) -> int:
    """How much of ``tokens`` cached tokens the prefix cache lends: whole pages."""
    return tokens - tokens % engine.kv.page_size


def session_pages(engine, history: int) -> int:
    """Pages an idle session of ``history`` tokens holds (all but the last token's KV)."""
    page = engine.kv.page_size
    return -(-(history - 1) // page)


def test_sessions_share_a_system_prompt_through_the_prefix_cache(engine, models):
    """Three sessions open with the same 37-token system prompt.  The first computes it;
    the others' first turns borrow its whole pages from the prefix cache (the first
    session's saved turn put them there), idle sessions hold each shared page once, and
    every turn stays exact.  Closed, the sessions leave their conversations cached for
    plain requests."""
    system = random_prompts(1, 300, seed=71, lo=37, hi=37)[0]
    questions = random_prompts(3, 300, seed=72, lo=5, hi=9)
    for k, q in enumerate(questions[1:], 1):  # each parts from the others right after it
        q[0] = (questions[0][0] + k - 3) % 297 + 3
    followups = random_prompts(3, 300, seed=73, lo=3, hi=6)
    chains = [[system + q, f] for q, f in zip(questions, followups, strict=True)]
    sids = [engine.open_session() for _ in chains]

    async def first_turn(s):
        return await turn(engine, sids[s], f"sp{s}t0", chains[s][0])

    async def go():
        first = [await first_turn(0)]
        first += await asyncio.gather(first_turn(1), first_turn(2))
        assert wait_idle(engine)
        held = engine.status().session_kv_tokens
        second = [
            await turn(engine, sid, f"sp{s}t1", chain[1])
            for s, (sid, chain) in enumerate(zip(sids, chains, strict=True))
        ]
        return first, held, second

    first, held, second = asyncio.run(go())
    shared = lent(engine, len(system))
    assert [r[2].usage.cached_tokens for r in first] == [0, shared, shared]
    histories = [len(c[0]) + len(r[0]) for c, r in zip(chains, first, strict=True)]
    shared_pages = shared // engine.kv.page_size
    own_pages = sum(session_pages(engine, h) - shared_pages for h in histories)
    assert held == (shared_pages + own_pages) * engine.kv.page_size
    for history, (_, _, last) in zip(histories, second, strict=True):
        assert last.usage.cached_tokens == history
    for sid in sids:
        engine.close_session(sid)
    assert_clean(engine)

    conversation = chains[0][0] + first[0][0] + chains[0][1] + second[0][0]
    _, _, again = asyncio.run(turn(engine, None, "sp-after", conversation + [7]))
    assert again.usage.cached_tokens == lent(engine, len(conversation) - 1)
    reference = session_engine(models, CONFIGS["plain"], kvCache={"prefixCache": False})
    try:
        for chain, r1, r2 in zip(chains, first, second, strict=True):
            assert expected_chain(reference, chain) == [r1[0], r2[0]]
    finally:
        reference.shutdown()


def test_an_evicted_session_borrows_its_history_back(models):
    """Page 16, a small pool: a long plain request evicts an idle session's KV, which
    stays in the prefix cache but for the pages the request needed; the session's next
    turn borrows the rest back (before sessions used the cache it prefilled it all) and
    stays exact."""
    chain = random_prompts(2, 300, seed=81, lo=60, hi=60)
    filler = random_prompts(1, 300, seed=82, lo=150, hi=150)[0]
    engine = session_engine(models, CONFIGS["plain"], kvCache={"pageSize": 16, "maxTokens": 256})
    try:
        sid = engine.open_session()

        async def go():
            first = await turn(engine, sid, "ev0", chain[0])
            await turn(engine, None, "filler", filler, 40)
            return first, await turn(engine, sid, "ev1", chain[1])

        first, (tokens, _, last) = asyncio.run(go())
        history = len(chain[0]) + len(first[0])
        assert metric_value(engine, "specd_session_kv_evictions_total") >= 1
        assert 0 < last.usage.cached_tokens < history
        assert last.usage.cached_tokens % 16 == 0
        engine.close_session(sid)
        assert_clean(engine)
    finally:
        engine.shutdown()
    reference = session_engine(models, CONFIGS["plain"])
    try:
        assert expected_chain(reference, chain) == [first[0], tokens]
    finally:
        reference.shutdown()


# -- fault toggles: each seed bug makes the session matrix's leak check fail -------------


@pytest.fixture
def toggle(monkeypatch):
    def set_toggle(name):
        monkeypatch.setenv("SPECD_DEBUG_REVERT", name)
        reverted_behaviours.cache_clear()

    yield set_toggle
    monkeypatch.delenv("SPECD_DEBUG_REVERT", raising=False)
    reverted_behaviours.cache_clear()


def run_sessions(engine, chains, max_tokens=MAX_NEW):
    async def one_session(s, chain):
        sid = engine.open_session()
        for i, prompt in enumerate(chain):
            await turn(engine, sid, f"x{s}t{i}", prompt, max_tokens)
        engine.close_session(sid)

    async def go():
        await asyncio.gather(*(one_session(s, c) for s, c in enumerate(chains)))

    asyncio.run(go())


def leak_failures(engine):
    return metric_value(engine, "specd_leak_checks_total", result="fail")


@pytest.mark.parametrize("toggle_name", ["bonus-preclaim", "row-headroom"])
def test_fault_toggles_fail_the_session_leak_check(models, toggle, toggle_name):
    """A session whose second turn runs to the context length, under overlapped tree
    speculation.  Without the toggle it passes (the matrix above); with it a leak check
    fails: the bonus slot is counted late (committed one short while a verify is in
    flight), or a row narrower than committed + reserve is caught before any write."""
    long_prompt, short_prompt = random_prompts(2, 300, seed=301, lo=200, hi=200)
    chain = [long_prompt, short_prompt[:20]]
    config = CONFIGS["tree-overlap-page16"] | {"kvCache": {"pageSize": 1}}
    clean = session_engine(models, config)
    try:
        run_sessions(clean, [chain], max_tokens=100)
        assert leak_failures(clean) == 0
        assert_clean(clean)
    finally:
        clean.shutdown()
    toggle(toggle_name)
    engine = session_engine(models, config)
    try:
        run_sessions(engine, [chain], max_tokens=100)
        assert leak_failures(engine) >= 1
    finally:
        engine.shutdown()


def test_reserve_single_toggle_fails_the_session_leak_check(toggle):
    """Overlap runs a verify ahead of the committed lengths only when drafts are
    accepted, so this uses the shipped trained pair on Python source (which its draft
    predicts well): clean with the 2x reserve; with a single reserve a verify would
    write past its allocation, which the write-bounds check stops and counts as a
    req_to_token leak-check failure."""
    target, draft = DEMO_MODELS / "demo-target", DEMO_MODELS / "demo-eagle"
    tokens = (
        Tokenizer.from_file(str(target / "tokenizer.json"))
        .encode(inspect.getsource(json.decoder))
        .ids
    )
    chains = [
        [tokens[s * 200 : s * 200 + 40], tokens[s * 200 + 40 : s * 200 + 60]] for s in range(2)
    ]
    pair = (str(target), str(draft))
    spec = {
        "speculative": {"numSteps": 5, "topk": 1, "numDraftTokens": 6},
        "scheduler": {"overlap": True},
    }
    clean = session_engine(pair, spec)
    try:
        run_sessions(clean, chains, max_tokens=40)
        assert metric_value(clean, "specd_spec_accepted_tokens_total") > 0
        assert leak_failures(clean) == 0
        assert_clean(clean)
    finally:
        clean.shutdown()
    toggle("reserve-single")
    engine = session_engine(pair, spec)
    try:
        run_sessions(engine, chains, max_tokens=40)
        assert (
            metric_value(engine, "specd_leak_checks_total", pool="req_to_token", result="fail") >= 1
        )
    finally:
        engine.shutdown()


# -- moves between engines (a retired replica's idle sessions) ---------------------------

MOVED_TURNS = random_prompts(3, 300, seed=23, lo=5, hi=15)


def two_turns_then_leave(source, sid):
    """Run the first two turns on ``source``, then export the session."""

    async def go():
        for i, prompt in enumerate(MOVED_TURNS[:2]):
            await turn(source, sid, f"t{i}", prompt)
        return await source.export_session(sid)

    return asyncio.run(go())


def third_turn(engine, sid):
    return asyncio.run(turn(engine, sid, "t2", MOVED_TURNS[2]))


@pytest.mark.parametrize("config", ["plain", "tree-overlap-page16", "ngram-tree-overlap-page16"])
def test_a_session_moves_with_its_kv_and_continues_exactly(models, config):
    """Two turns on one engine, a move, the third turn on another engine (another page
    size): the same tokens as without sessions, with the whole history reused as KV."""
    source = session_engine(models, CONFIGS[config])
    dest = session_engine(models, CONFIGS[config], kvCache={"pageSize": 8})
    try:
        expected = expected_chain(source, MOVED_TURNS)
        sid = source.open_session()
        snapshot = two_turns_then_leave(source, sid)
        history = sum(len(p) for p in MOVED_TURNS[:2]) + 2 * len(expected[0])
        assert len(snapshot.history) == history and snapshot.kv
        assert asyncio.run(dest.import_session(snapshot)) is True

        tokens, _, last = third_turn(dest, sid)
        assert tokens == expected[2]
        assert last.usage.cached_tokens == history
        assert metric_value(dest, "specd_session_arrivals_total", carried="kv") == 1
        with pytest.raises(SessionError, match="moved to another replica") as gone:
            source.close_session(sid)
        assert gone.value.code == 410
        dest.close_session(sid)
        assert_clean(source)
        assert_clean(dest)
    finally:
        source.shutdown()
        dest.shutdown()


def test_kv_computed_otherwise_stays_behind_and_the_history_moves(models):
    """A destination without the source's draft (another KV layout) takes the history
    only: the next turn prefills it (cached 0) and continues exactly."""
    source = session_engine(models, CONFIGS["chain-overlap"])
    dest = session_engine(models, CONFIGS["plain"])
    try:
        expected = expected_chain(source, MOVED_TURNS)  # (on dest, it would be cached)
        sid = source.open_session()
        snapshot = two_turns_then_leave(source, sid)
        assert asyncio.run(dest.import_session(snapshot)) is False
        tokens, _, last = third_turn(dest, sid)
        assert tokens == expected[2] and last.usage.cached_tokens == 0
        assert last.usage.prompt_tokens == len(snapshot.history) + len(MOVED_TURNS[2])
        dest.close_session(sid)
        assert_clean(dest)
    finally:
        source.shutdown()
        dest.shutdown()


def test_a_destination_short_of_kv_takes_the_history_only(models):
    source = session_engine(models, CONFIGS["plain"])
    dest = session_engine(models, CONFIGS["plain"], kvCache={"maxTokens": 32, "pageSize": 16})
    try:
        sid = source.open_session()
        snapshot = two_turns_then_leave(source, sid)
        assert len(snapshot.history) > 32
        assert asyncio.run(dest.import_session(snapshot)) is False
        assert dest.status().kv_used_tokens == 0
        assert metric_value(dest, "specd_session_arrivals_total", carried="history") == 1
        dest.close_session(sid)
        assert_clean(dest)
    finally:
        source.shutdown()
        dest.shutdown()


def test_refused_moves_leave_the_destination_untouched(models, tmp_path):
    """Each refusal names why; the destination holds nothing after it, and the same
    snapshot still moves to a replica that can take it."""
    source = session_engine(models, CONFIGS["plain"])
    other_vocab = make_tiny_checkpoint(tmp_path / "other")
    refusing = {
        "sessions are disabled": (session_engine(models, {}, sessions={"enabled": False}), 400),
        "sessions are open": (session_engine(models, {}, sessions={"maxSessions": 1}), 429),
        "this replica reads": (session_engine((str(other_vocab), None), {}), 409),
        "no room in the context length": (
            session_engine(models, {}, model={"contextLength": 32}),
            409,
        ),
    }
    full = refusing["sessions are open"][0]
    full.open_session()
    try:
        sid = source.open_session()
        snapshot = two_turns_then_leave(source, sid)
        for needle, (engine, code) in refusing.items():
            with pytest.raises(SessionError, match=needle) as refused:
                asyncio.run(engine.import_session(snapshot))
            assert refused.value.code == code
            assert engine.status().kv_used_tokens == 0
            assert not engine.sessions.holds(sid)
        with pytest.raises(SessionError) as twice:
            asyncio.run(source.export_session(sid))
        assert twice.value.code == 410
        with pytest.raises(SessionError) as unknown:
            asyncio.run(source.export_session("0" * 32))
        assert unknown.value.code == 404
        assert asyncio.run(source.import_session(snapshot)) is True  # back home
        assert third_turn(source, sid)[2].usage.cached_tokens == len(snapshot.history)
        source.close_session(sid)
        assert_clean(source)
    finally:
        source.shutdown()
        for engine, _ in refusing.values():
            engine.shutdown()
