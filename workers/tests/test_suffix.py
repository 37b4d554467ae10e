"""SUFFIX drafting: the output cache (counts, proposals, bounds, eviction, memory, per-key
isolation) and the engine with it (isolation between API keys end to end).  Losslessness
is in test_ngram.py, which runs its engine matrix for NGRAM and SUFFIX alike."""

from __future__ import annotations

import asyncio
import random
import tracemalloc

import pytest

from specd.devtools.testing import DEMO_TARGET, collect, demo_prompts, start_engine
from specd.workers.config import ConfigError, parse_deployment
from specd.workers.speculative.suffix import SuffixCache, SuffixIndex
from specd.workers.types import GenerateRequest, SamplingParams


def propose(index, history, steps=4, topk=1, nodes=4, min_prob=0.1, factor=4.0):
    p = index.propose(tuple(history), steps, topk, nodes, min_prob, factor)
    return p.tokens, p.parents, round(p.score, 3)


def test_the_index_counts_what_followed_each_context():
    index = SuffixIndex(max_depth=3)
    index.insert((1, 2, 3, 4))
    index.insert((1, 2, 3, 5))
    index.insert((9, 2, 3, 4))
    # after "1 2 3": 4 once, 5 once; after "2 3": 4 twice, 5 once
    assert propose(index, [7, 1, 2, 3], nodes=1) == ([4], [-1], 0.5)
    assert propose(index, [7, 2, 3], nodes=1) == ([4], [-1], 0.667)
    assert index.longest_context((8, 1, 2, 3)) == (1, 2, 3)
    assert index.longest_context((8, 8)) == ()
    assert propose(index, [8, 8]) == ([], [], 0.0)


def test_a_proposal_grows_best_first_and_stops_at_the_least_probability():
    index = SuffixIndex(max_depth=4)
    for _ in range(3):
        index.insert((1, 2, 3, 4, 5))
    index.insert((1, 2, 7, 8, 9))
    # after "1 2": 3 (3/4), 7 (1/4); then 4, 5 certain after "... 3"
    assert propose(index, [1, 2], topk=2, nodes=5, min_prob=0.2) == (
        [3, 4, 5, 7, 8],
        [-1, 0, 1, -1, 3],
        0.75 * 3 + 0.25 * 2,
    )
    # the 1/4 branch is below 0.3: not proposed
    assert propose(index, [1, 2], topk=2, nodes=6, min_prob=0.3)[0] == [3, 4, 5]
    assert propose(index, [1, 2], topk=1, nodes=6, min_prob=0.2)[0] == [3, 4, 5]


def test_the_depth_follows_the_match_length():
    index = SuffixIndex(max_depth=4)
    index.insert((1, 2, 3, 4, 5, 6, 7, 8))
    # a 1-token match ("8" is unseen as context; "2" matched alone) drafts 1 deep at
    # factor 1, a 2-token match 2 deep
    assert propose(index, [9, 2], factor=1.0)[0] == [3]
    assert propose(index, [1, 2], factor=1.0)[0] == [3, 4]
    assert propose(index, [1, 2], factor=1.0, steps=1)[0] == [3]


def test_eviction_takes_the_oldest_outputs_counts_back_out():
    cache = SuffixCache(max_depth=2, max_tokens=10, share=True)
    cache.insert(None, (1, 2, 3, 4), ())
    cache.insert(None, (5, 6, 7, 8), ())
    assert propose(cache.index_of(None), [1, 2])[0] == [3, 4]
    cache.insert(None, (9, 10, 11), ())  # 11 tokens: the oldest goes
    assert cache.tokens == 7
    assert propose(cache.index_of(None), [1, 2])[0] == []
    assert propose(cache.index_of(None), [5, 6])[0] == [7, 8]
    cache.insert(None, tuple(range(100, 120)), ())  # longer than the bound: not stored
    assert cache.tokens == 7


def test_a_lead_gives_context_but_is_not_proposed():
    cache = SuffixCache(max_depth=3, max_tokens=100, share=True)
    cache.insert(None, (7, 8), lead=(1, 2, 3))
    index = cache.index_of(None)
    assert propose(index, [1, 2, 3])[0] == [7, 8]
    assert propose(index, [1, 2])[0] == []  # "3" after "1 2" is the prompt's, not counted


def test_outputs_stay_with_their_api_key_unless_shared():
    isolated = SuffixCache(max_depth=3, max_tokens=100, share=False)
    isolated.insert("key-a", (1, 2, 3, 4), ())
    assert propose(isolated.index_of("key-a"), [1, 2])[0] == [3, 4]
    assert isolated.index_of("key-b") is None
    assert isolated.index_of(None) is None  # no key: the shared store, empty here
    shared = SuffixCache(max_depth=3, max_tokens=100, share=True)
    shared.insert("key-a", (1, 2, 3, 4), ())
    assert propose(shared.index_of("key-b"), [1, 2])[0] == [3, 4]


def test_memory_stays_bounded_over_a_long_run():
    """800 outputs of 100 tokens (80k tokens) through a 4k-token cache: the contexts and
    the bytes they take stop growing once the cache is full."""
    rng = random.Random(0)
    phrases = [tuple(rng.randrange(1000) for _ in range(12)) for _ in range(50)]
    cache = SuffixCache(max_depth=8, max_tokens=4096, share=False)
    tracemalloc.start()
    sizes = []
    for i in range(800):
        output = sum((rng.choice(phrases) for _ in range(9)), ())[:100]
        cache.insert(f"key-{i % 4}", output, ())
        assert cache.tokens <= 4096
        if i % 100 == 99:
            sizes.append((cache.contexts, tracemalloc.get_traced_memory()[0]))
    tracemalloc.stop()
    assert all(contexts <= 4096 * 8 for contexts, _ in sizes)
    full = [size for _, size in sizes[1:]]  # the cache fills within the first 100
    assert max(full) < 1.2 * min(full), sizes


BASE = {"model": {"path": "/m"}}


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"draft": {"algorithm": "NGRAM"}, "speculative": {"suffix": {}}},
            "spec.speculative.suffix: set for spec.draft.algorithm NGRAM",
        ),
        ({"draft": {"algorithm": "SUFFIX", "path": "/d"}}, "spec.draft.path: SUFFIX drafts"),
        (
            {"draft": {"algorithm": "SUFFIX"}, "speculative": {"suffix": {"maxCachedTokens": 8}}},
            "spec.speculative.suffix.maxCachedTokens",
        ),
        (
            {"draft": {"algorithm": "SUFFIX"}, "speculative": {"suffix": {"minTokenProb": 0}}},
            "spec.speculative.suffix.minTokenProb",
        ),
    ],
)
def test_bad_suffix_settings_are_refused_naming_the_field(fields, message):
    doc = {
        "apiVersion": "specd.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "x"},
        "spec": {**BASE, "speculative": {}, **fields},
    }
    with pytest.raises(ConfigError, match=message):
        parse_deployment(doc)


def suffix_engine(**suffix):
    return start_engine(
        DEMO_TARGET,
        kvCache={"pageSize": 16},
        draft={"algorithm": "SUFFIX"},
        speculative={"numSteps": 4, "topk": 1, "numDraftTokens": 5, "suffix": suffix},
        debug={"strictMemCheck": 1},
    )


async def accepted(engine, rid, prompt, owner):
    """Greedy tokens and drafts accepted of one request sent with ``owner``."""
    request = GenerateRequest(
        rid, tuple(prompt), SamplingParams(max_tokens=48, ignore_eos=True), owner=owner
    )
    tokens, last = [], None
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        last = delta
    return tokens, last.usage.spec_accepted_tokens


@pytest.mark.parametrize("share", [False, True])
def test_one_keys_outputs_draft_only_for_it_unless_shared(share):
    """Key A asks twice: its second request drafts from its first one's output.  Key B
    then asks the same: isolated, it drafts from its own tokens only, exactly as the
    first request did; shared, as A's second did."""
    prompt = demo_prompts(1, 48)[0]
    engine = suffix_engine(shareAcrossKeys=share)

    async def go():
        return [
            await accepted(engine, rid, prompt, owner)
            for rid, owner in (("a1", "key-a"), ("a2", "key-a"), ("b1", "key-b"))
        ]

    try:
        (t1, first), (t2, again), (t3, other) = asyncio.run(go())
    finally:
        engine.shutdown()
    assert t1 == t2 == t3
    assert again > first + 10  # the cached output is proposed and accepted
    assert other == (again if share else first)


def test_collect_without_owner_shares_the_store():
    """Requests without a key (no API keys configured) share one store."""
    prompt = demo_prompts(2, 48)[1]
    engine = suffix_engine()

    async def go():
        return [
            await collect(engine, f"r{i}", prompt, max_tokens=48, ignore_eos=True) for i in range(2)
        ]

    try:
        first, second = asyncio.run(go())
    finally:
        engine.shutdown()
    assert first[0] == second[0]
    assert second[2].usage.spec_accepted_tokens > first[2].usage.spec_accepted_tokens + 10
