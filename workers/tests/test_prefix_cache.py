"""Prefix cache: the page trie (match, insert, borrow, LRU eviction), its place in the
KV bookkeeping and leak checks, and whole engines whose requests share prefixes:
greedy output still equals ``transformers`` token for token (plain, overlap, chain,
paged tree), the hits show in usage and metrics, and a small pool evicts cleanly."""

from __future__ import annotations

import asyncio
import random

import pytest

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    demo_prompts,
    hf_greedy,
    metric_value,
    request_held_tokens,
    run_all,
    start_engine,
    start_spec_engine,
    wait_idle,
)
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.block_keys import next_key
from specd.workers.mem_cache.kv_manager import KVManager, RequestKV
from specd.workers.mem_cache.leak_check import token_pool_balance
from specd.workers.mem_cache.prefix_cache import PrefixCache
from specd.workers.mem_cache.req_to_token import ReqToTokenPool
from specd.workers.pool.prefix_affinity import (
    CacheShape,
    PrefixAffinity,
    PromptBlocks,
    block_keys,
)
from specd.workers.scheduler.prefix_sharing import shared_prefix_len
from specd.workers.types import GenerateRequest, SamplingParams

# -- the trie --------------------------------------------------------------------


def cache_with_pages(num_pages=16, page_size=2) -> tuple[PrefixCache, PagedTokenAllocator]:
    allocator = PagedTokenAllocator(num_pages, page_size)
    return PrefixCache(allocator), allocator


def test_match_finds_the_longest_run_of_whole_cached_pages():
    cache, allocator = cache_with_pages()
    pages = allocator.alloc_pages(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], pages) == []
    assert cache.match([1, 2, 3, 4, 5, 6, 7]).pages == pages
    assert cache.match([1, 2, 3, 4, 5]).pages == pages[:2]  # the partial page is not a hit
    assert cache.match([1, 2, 9, 4]).pages == pages[:1]
    assert len(cache.match([2, 1])) == 0
    assert cache.evictable_tokens == 6 and cache.protected_tokens == 0
    cache.check_integrity()


def test_insert_hands_back_pages_whose_tokens_are_cached_already():
    cache, allocator = cache_with_pages()
    first, second = allocator.alloc_pages(2), allocator.alloc_pages(3)
    cache.insert([1, 2, 3, 4], first)
    duplicates = cache.insert([1, 2, 3, 4, 7, 8], second)
    assert duplicates == second[:2]  # the trie keeps its own copy of [1 2][3 4]
    assert cache.match([1, 2, 3, 4, 7, 8]).pages == first + second[2:]
    assert cache.num_pages == 3
    with pytest.raises(ValueError, match="2 pages for 6 tokens"):
        cache.insert([1, 2, 3, 4, 5, 6], first)


def test_eviction_reports_the_key_of_each_block_ending_page():
    """Pages that end a block (here 2 pages) carry the chained key of every token above
    them, computed on insertion; evicting them reports it, leaves first."""
    allocator = PagedTokenAllocator(num_pages=6, page_size=2)
    evicted = []
    cache = PrefixCache(allocator, evicted.append, block_tokens=4)
    pages = allocator.alloc_pages(4)
    cache.insert([1, 1, 2, 2, 3, 3, 4, 4], pages)
    cache.insert([1, 1, 2, 2, 5, 5], [*pages[:2], *allocator.alloc_pages(1)])  # shares block 0
    assert cache.evict(5) == 5
    first = next_key(0, [1, 1, 2, 2])
    assert evicted == [next_key(first, [3, 3, 4, 4]), first]


def test_eviction_takes_least_recently_used_leaves_and_spares_borrowed_pages():
    cache, allocator = cache_with_pages(num_pages=6)
    a, b, c = allocator.alloc_pages(2), allocator.alloc_pages(1), allocator.alloc_pages(2)
    cache.insert([1, 1, 2, 2], a)  # [1 1] -> [2 2]
    cache.insert([1, 1, 3, 3], [a[0], *b])  # [1 1] -> [3 3] (shares the first page)
    cache.insert([5, 5, 6, 6], c)
    borrowed = cache.match([5, 5, 6, 6])  # used last, and now borrowed
    cache.lock(borrowed)
    cache.match([1, 1, 3, 3])  # more recent than [2 2]
    assert allocator.num_free_pages == 1
    assert cache.evict(1) == 1
    assert len(cache.match([1, 1, 2, 2])) == 1  # the LRU leaf went first
    assert cache.evict(10) == 2  # [3 3], then its parent [1 1] once a leaf
    assert cache.pages() == c and allocator.num_free_pages == 4
    assert cache.protected_tokens == 4 and cache.evictable_tokens == 0
    cache.unlock(borrowed)
    assert cache.evict(10) == 2 and allocator.num_free_pages == 6
    cache.check_integrity()


def test_eviction_follows_the_lru_rule_through_random_use():
    """Random inserts, matches, borrows and evictions on a page-size-1 trie: each page
    the heap evicts is a least recently used unborrowed leaf, as a walk of the whole
    trie would pick, and the heap stays within its bound."""
    rng = random.Random(7)
    cache, allocator = cache_with_pages(num_pages=400, page_size=1)
    borrowed = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            tokens = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
            pages = allocator.alloc_pages(len(tokens))
            if pages is not None:
                allocator.free(cache.insert(tokens, pages))
        elif op < 0.6:
            prefix = cache.match([rng.randrange(4) for _ in range(8)])
            if prefix and rng.random() < 0.5:
                cache.lock(prefix)
                borrowed.append(prefix)
        elif op < 0.75 and borrowed:
            cache.unlock(borrowed.pop(rng.randrange(len(borrowed))))
        else:
            eligible = {
                (n.last_used, n.page) for n in cache._nodes() if not n.children and not n.lock_ref
            }
            before = set(cache.pages())
            if cache.evict(1):
                (gone,) = before - set(cache.pages())
                oldest = min(used for used, _ in eligible)
                assert (oldest, gone) in eligible  # a least recently used leaf
            else:
                assert not eligible
        assert len(cache._evictable) <= 2 * cache.num_pages + 65
        cache.check_integrity()


def test_a_prefix_matched_again_and_again_keeps_the_heap_bounded():
    """Each match offers its last page anew; the stale entries are dropped by a rebuild
    once they make the heap twice the trie, and eviction order survives it."""
    cache, allocator = cache_with_pages(num_pages=8, page_size=1)
    cache.insert([1, 2], allocator.alloc_pages(2))
    cache.insert([3, 4], allocator.alloc_pages(2))
    for _ in range(500):
        cache.match([1, 2])
        assert len(cache._evictable) <= 2 * cache.num_pages + 65
    cache.check_integrity()
    assert cache.evict(2) == 2  # [3 4] was used least recently: its leaf, then its root
    assert len(cache.match([1, 2])) == 2 and not cache.match([3, 4])


def test_the_integrity_check_sees_an_evictable_page_missing_from_the_heap():
    cache, allocator = cache_with_pages()
    cache.insert([1, 1, 2, 2], allocator.alloc_pages(2))
    cache.check_integrity()
    cache._evictable.clear()
    with pytest.raises(AssertionError, match="not in the heap"):
        cache.check_integrity()


def test_unbalanced_unlock_is_caught():
    cache, allocator = cache_with_pages()
    cache.insert([1, 2], allocator.alloc_pages(1))
    prefix = cache.match([1, 2])
    with pytest.raises(AssertionError, match="unlocked more often than locked"):
        cache.unlock(prefix)


# -- in the KV bookkeeping -----------------------------------------------------------


def manager_with_cache(pages=8, page_size=2, rows=3, width=24) -> KVManager:
    allocator = PagedTokenAllocator(pages, page_size)
    return KVManager(ReqToTokenPool(rows, width), allocator, cache=PrefixCache(allocator))


def balance(m: KVManager, *holders: RequestKV):
    return token_pool_balance(m.allocator, list(holders), [], m.cache)


def test_a_released_request_leaves_its_final_pages_to_the_next_one():
    m = manager_with_cache()
    first = RequestKV()
    assert m.grow(first, 7)  # 4 pages; positions 0-4 final
    first.committed = 5
    m.release(first, [10, 11, 12, 13, 14])
    assert m.cache.num_pages == 2 and m.allocator.used_tokens == 4  # [10 11][12 13]
    assert balance(m).ok and balance(m).breakdown["cached"] == 4

    second = RequestKV()
    prefix = m.cache.match([10, 11, 12, 13, 99])
    assert m.borrow(second, prefix)
    assert second.committed == second.allocated == 4 and second.borrowed == 2
    assert m.slots(second, 0, 4).tolist() == [p * 2 + i for p in prefix.pages for i in (0, 1)]
    assert m.grow(second, 9)
    b = balance(m, second)
    assert b.ok and b.breakdown["protected"] == 4 and b.breakdown["requests"] == 6
    m.check_integrity()
    with pytest.raises(AssertionError, match="freeing borrowed cache pages"):
        m.free_tail(second, 1)
    second.committed = 8
    m.release(second, [10, 11, 12, 13, 99, 98, 97, 96])
    assert m.cache.num_pages == 4 and m.cache.protected_tokens == 0
    assert m.allocator.used_tokens == 8  # its fifth page (no final KV) went back
    assert balance(m).ok
    m.check_integrity()


def test_a_running_request_shares_its_prefill_and_adopts_an_equal_cached_copy():
    """After a prefill, a request's final pages go to the cache while it runs; a second
    request that computed the same tokens meanwhile is pointed at the cached pages and
    its own copies are freed."""
    m = manager_with_cache(pages=10)
    tokens = [7, 7, 8, 8, 9, 9, 5]
    a, b = RequestKV(), RequestKV()
    for kv in (a, b):
        m.grow(kv, 7)
        kv.committed = 7
    m.share_computed(a, tokens[:6])
    assert a.borrowed == 3 and m.cache.protected_tokens == 6
    own_b = list(b.pages[:3])
    m.share_computed(b, tokens[:6])
    assert b.pages[:3] == a.pages[:3] and b.borrowed == 3
    assert m.slots(b, 0, 6).tolist() == m.slots(a, 0, 6).tolist()
    assert not set(own_b) & set(m.allocator._owned)  # its copies went back to the pool
    assert balance(m, a, b).ok
    m.check_integrity()
    m.release(a, tokens[:6])
    m.release(b, tokens[:6])
    assert m.cache.num_pages == 3 and m.allocator.used_tokens == 6 and balance(m).ok
    m.check_integrity()


def test_the_integrity_check_counts_each_lock_against_a_live_borrower():
    """A cached page is locked once per live holder borrowing it (requests and idle
    sessions alike): a lock left behind (the page pinned for good) or one missing (the
    page evictable under its borrower) is caught, naming the page."""
    m = manager_with_cache()
    kv = RequestKV()
    m.grow(kv, 4)
    kv.committed = 4
    m.release(kv, [1, 2, 3, 4])
    first, second = RequestKV(), RequestKV()
    for holder in (first, second):
        assert m.borrow(holder, m.cache.match([1, 2, 3, 4, 5]))
    m.check_integrity()
    m.cache.lock(m.cache.match([1, 2]))  # nobody holds this one
    with pytest.raises(AssertionError, match=r"locked 3 times, borrowed by 2"):
        m.check_integrity()
    m.cache.unlock(m.cache.match([1, 2, 3, 4]))  # and now one borrower's page is unlocked
    with pytest.raises(AssertionError, match=r"locked 1 times, borrowed by 2"):
        m.check_integrity()
    m.cache.lock(m.cache.match([1, 2, 3, 4]))
    m.cache.unlock(m.cache.match([1, 2]))
    m.release(first)
    m.release(second)
    m.check_integrity()
    assert m.cache.protected_tokens == 0


def test_growing_evicts_cached_pages_when_the_pool_is_dry():
    m = manager_with_cache(pages=4)
    old = RequestKV()
    m.grow(old, 8)
    old.committed = 8
    m.release(old, list(range(9)))
    assert m.allocator.num_free_pages == 0 and m.available_tokens == 8
    new = RequestKV()
    assert m.grow(new, 5)  # three pages: the cache gives up its two least recent leaves...
    assert m.cache.num_pages == 1 and m.cache.match([0, 1, 2, 3]).pages == [0]
    borrower = RequestKV()
    assert m.borrow(borrower, m.cache.match([0, 1, 2]))
    assert not m.grow(RequestKV(), 2)  # ...but never a borrowed one
    assert balance(m, new, borrower).ok
    m.check_integrity()


def test_the_leak_check_sees_a_cached_page_also_held_by_a_request():
    m = manager_with_cache()
    kv = RequestKV()
    m.grow(kv, 4)
    kv.committed = 4
    m.release(kv, [1, 2, 3, 4])
    stray = RequestKV(row=0, pages=[m.cache.pages()[0]], committed=2, allocated=2)
    m._live[0] = stray  # a bug that hands out a cached page as a request's own
    assert not balance(m, stray).ok
    with pytest.raises(AssertionError, match="held by two"):
        m.check_integrity()


# -- whole engines ---------------------------------------------------------------------

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    """Four prompts opening with the same 37 tokens (a system prompt), then their own,
    and their peer outputs."""
    text = demo_prompts(5, 48)
    prompts = [text[0][:37] + text[i][: 5 + 3 * i] for i in range(1, 5)]
    return prompts, hf_greedy(DEMO_TARGET, prompts, NEW_TOKENS)


ENGINES = {
    "plain P1": lambda: start_engine(DEMO_TARGET, debug={"strictMemCheck": 1}),
    "plain P4 overlap": lambda: start_engine(
        DEMO_TARGET,
        kvCache={"pageSize": 4},
        scheduler={"overlap": True, "chunkedPrefillSize": 16},
        debug={"strictMemCheck": 1},
    ),
    "chain P1": lambda: start_spec_engine(DEMO_TARGET, DEMO_EAGLE, steps=3),
    "paged tree P16 overlap": lambda: start_spec_engine(
        DEMO_TARGET, DEMO_EAGLE, page_size=16, steps=3, topk=4, overlap=True
    ),
}


@pytest.mark.parametrize("kind", ENGINES)
def test_shared_prefixes_hit_the_cache_and_stay_exact(kind, shared_prefix_prompts):
    """One request alone, then all four at once, then all four again: later requests
    start on the cached system prompt (and the repeats on their whole prompt), output
    equals the peer's, usage and metrics count the same hits, strict leak checks pass."""
    prompts, expected = shared_prefix_prompts
    engine = ENGINES[kind]()
    page = engine.allocator.page_size
    try:
        first = run_all(engine, prompts[:1], max_tokens=NEW_TOKENS, ignore_eos=True)
        assert [r[0] for r in first] == expected[:1]
        assert first[0][2].usage.cached_tokens == 0
        for _ in range(2):
            results = run_all(engine, prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert [r[0] for r in results] == expected
        usages = [r[2].usage for r in results]
        # the repeat finds each whole prompt but its last token, in whole pages
        assert [u.cached_tokens for u in usages] == [(len(p) - 1) // page * page for p in prompts]
        hits = metric_value(engine, "specd_prefix_cache_hit_tokens_total")
        assert hits >= sum(u.cached_tokens for u in usages) + 37 // page * page * 3
        assert metric_value(engine, "specd_prefix_cache_queried_tokens_total") > hits
        assert wait_idle(engine)
        assert engine.status().healthy, engine.status().last_error
        assert metric_value(engine, "specd_leak_checks_total", result="fail") == 0
        assert engine.status().kv_cached_tokens > 0 and request_held_tokens(engine) == 0
    finally:
        engine.shutdown()
    engine.kv.check_integrity()


def test_a_small_pool_evicts_the_cache_and_stays_exact(shared_prefix_prompts):
    """A pool that holds about two requests: the cache is evicted (least recent first)
    and requests retract, with output still the peer's and no page lost."""
    prompts, expected = shared_prefix_prompts
    engine = start_engine(
        DEMO_TARGET, kvCache={"pageSize": 4, "maxTokens": 112}, debug={"strictMemCheck": 1}
    )
    try:
        for _ in range(3):
            results = run_all(engine, prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert [r[0] for r in results] == expected
        assert metric_value(engine, "specd_prefix_cache_hit_tokens_total") > 0
        assert metric_value(engine, "specd_retractions_total") > 0
        assert wait_idle(engine)
        assert engine.status().healthy, engine.status().last_error
        assert request_held_tokens(engine) == 0
    finally:
        engine.shutdown()
    engine.kv.check_integrity()


def test_the_gateway_learns_which_blocks_an_engine_evicted():
    """An engine whose small pool evicts an earlier prompt's pages reports those blocks
    in its status, keyed as the gateway keyed the prompt: the record forgets them."""
    first, *others = demo_prompts(4, 96)
    engine = start_engine(DEMO_TARGET, kvCache={"pageSize": 4, "maxTokens": 224})
    shape = CacheShape.of(engine.prefix_cache_shape())
    record = PrefixAffinity()
    try:
        run_all(engine, [first], max_tokens=4, ignore_eos=True)
        record.record("r0", PromptBlocks(first), shape)
        assert record.predicted_hits(PromptBlocks(first), {"r0": shape}) == {"r0": 80}
        for prompt in others:  # one at a time: each one's pages push older ones out
            run_all(engine, [prompt], max_tokens=4, ignore_eos=True)
        evicted = engine.status().prefix_cache.evicted_blocks
    finally:
        engine.shutdown()
    assert set(block_keys(first, shape.block_tokens)) <= set(evicted.keys)
    record.discard("r0", evicted.keys)
    assert record.predicted_hits(PromptBlocks(first), {"r0": shape}) == {"r0": 0}


def test_prompt_scoring_and_a_disabled_cache_compute_every_prompt_token(shared_prefix_prompts):
    """``prompt_logprobs`` needs every prompt row, so it never borrows; with
    ``kvCache.prefixCache: false`` nothing is kept at all."""
    prompts, expected = shared_prefix_prompts
    engine = start_engine(DEMO_TARGET)
    try:
        run_all(engine, prompts[:1], max_tokens=NEW_TOKENS, ignore_eos=True)
        scored = run_all(
            engine, prompts[:1], max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0
        )
        assert scored[0][0] == expected[0] and scored[0][2].usage.cached_tokens == 0
        assert metric_value(engine, "specd_prefix_cache_hit_tokens_total") == 0
    finally:
        engine.shutdown()
    engine = start_engine(DEMO_TARGET, kvCache={"prefixCache": False})
    try:
        for _ in range(2):
            results = run_all(engine, prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert [r[0] for r in results] == expected
            assert all(r[2].usage.cached_tokens == 0 for r in results)
        assert engine.kv.cache is None and engine.status().kv_cached_tokens == 0
        assert wait_idle(engine) and engine.allocator.used_tokens == 0
    finally:
        engine.shutdown()


def test_a_repeated_prompt_finds_all_but_its_last_token(shared_prefix_prompts):
    """Page size 1: the repeat borrows every prompt token but the last."""
    prompts, _ = shared_prefix_prompts
    engine = start_engine(DEMO_TARGET)

    async def go():
        _, one = await _collect(engine, "a", prompts[0])
        _, two = await _collect(engine, "b", prompts[0])
        return one, two

    try:
        one, two = asyncio.run(go())
    finally:
        engine.shutdown()
    assert one.cached_tokens == 0 and two.cached_tokens == len(prompts[0]) - 1
    assert two.prompt_tokens == one.prompt_tokens


@pytest.mark.parametrize("kind", ["plain P4 overlap", "chain P1"])
def test_the_next_turn_of_a_conversation_finds_the_last_answer(kind, shared_prefix_prompts):
    """Chat without sessions: turn 2 sends turn 1's prompt and answer and a question;
    it borrows every token of turn 1 whose KV was final (all but the answer's last,
    in whole pages), and its output is still the peer's."""
    prompts, first_answers = shared_prefix_prompts
    follow_up = demo_prompts(6, 48)[5][:7]
    turns = [p + a + follow_up for p, a in zip(prompts[:2], first_answers[:2], strict=True)]
    expected = hf_greedy(DEMO_TARGET, turns, NEW_TOKENS)
    engine = ENGINES[kind]()
    page = engine.allocator.page_size
    try:
        first = run_all(engine, prompts[:2], max_tokens=NEW_TOKENS, ignore_eos=True)
        assert [r[0] for r in first] == first_answers[:2]
        second = run_all(engine, turns, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert [r[0] for r in second] == expected
        final = [len(p) + NEW_TOKENS - 1 for p in prompts[:2]]
        assert [r[2].usage.cached_tokens for r in second] == [n // page * page for n in final]
        assert engine.status().healthy, engine.status().last_error
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["plain P4 overlap", "chain P1"])
def test_a_request_starts_on_the_prefill_of_one_still_running(kind, shared_prefix_prompts):
    """The cache takes a request's prompt pages once its prefill is done: a request
    arriving while the first still decodes starts on them."""
    prompts, expected = shared_prefix_prompts
    engine = ENGINES[kind]()
    page = engine.allocator.page_size
    long = SamplingParams(max_tokens=10 * NEW_TOKENS, ignore_eos=True)

    async def go():
        first = engine.generate(GenerateRequest("a", tuple(prompts[0]), long))
        tokens = list((await anext(first)).token_ids)  # its prefill is done
        second = asyncio.create_task(_collect(engine, "b", prompts[1]))
        async for delta in first:
            tokens += delta.token_ids
            if second.done():
                break  # (leaving aborts it)
        assert second.done(), "the first request ended before the second: nothing shown"
        return tokens, second.result()

    try:
        tokens, (second_tokens, usage) = asyncio.run(go())
        assert engine.status().healthy, engine.status().last_error
    finally:
        engine.shutdown()
    assert [tokens[:NEW_TOKENS], second_tokens] == expected[:2]
    assert usage.cached_tokens == 37 // page * page


@pytest.mark.parametrize("kind", ["plain P4 overlap", "chain P1"])
def test_requests_arriving_together_compute_a_shared_prompt_once(kind, shared_prefix_prompts):
    """On a cold cache, four requests at once, two with the same prompt and all with
    the same 37-token system prompt: the first computes the shared pages, the others
    wait for them (the identical prompt until the whole prefill is done) and borrow
    them; output is still the peer's."""
    prompts, expected = shared_prefix_prompts
    engine = ENGINES[kind]()
    page = engine.allocator.page_size
    batch = [prompts[0], prompts[0], prompts[1], prompts[2]]
    try:
        results = run_all(engine, batch, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert [r[0] for r in results] == [expected[0], *expected[:3]]
        assert wait_idle(engine) and request_held_tokens(engine) == 0
        assert engine.status().healthy, engine.status().last_error
    finally:
        engine.shutdown()
    cached = [r[2].usage.cached_tokens for r in results]
    assert cached[:2] == [0, (len(prompts[0]) - 1) // page * page]
    assert all(c >= 37 // page * page for c in cached[2:]), cached


def test_a_short_shared_head_and_prompt_scoring_do_not_wait(shared_prefix_prompts):
    """Below `MIN_SHARED_PREFILL_TOKENS` in common, or scoring its prompt (it never
    borrows), a request is admitted with the first one and computes its own prompt."""
    prompts, _ = shared_prefix_prompts
    short_head = [prompts[0][:20] + prompts[1][37:], prompts[0]]
    engine = start_engine(DEMO_TARGET)
    try:
        heads = run_all(engine, short_head, max_tokens=4, ignore_eos=True)
        unseen = prompts[2][::-1]
        scoring = [(unseen, {}), (unseen, {"prompt_logprobs": 0})]
        scored = asyncio.run(
            _together(engine, [(f"s{i}", p, params) for i, (p, params) in enumerate(scoring)])
        )
    finally:
        engine.shutdown()
    assert [r[2].usage.cached_tokens for r in heads] == [0, 0]
    assert [usage.cached_tokens for usage in scored] == [0, 0]


@pytest.mark.parametrize("split", [0, 1, 63, 64, 65, 130, 200])
def test_shared_prefix_len_across_strides(split):
    a = list(range(200))
    b = a[:split] + [-1] + a[split + 1 :]
    assert shared_prefix_len(a, b) == shared_prefix_len(b, a) == split
    assert shared_prefix_len(a, a[:split]) == split


async def _together(engine, requests):
    """Submit ``(rid, prompt, extra params)`` at once -> each one's usage."""

    async def one(rid, prompt, extra):
        params = SamplingParams(max_tokens=4, ignore_eos=True, **extra)
        async for delta in engine.generate(GenerateRequest(rid, tuple(prompt), params)):
            last = delta
        return last.usage

    return await asyncio.gather(*(one(*r) for r in requests))


async def _collect(engine, rid, prompt):
    tokens, last = [], None
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    async for delta in engine.generate(GenerateRequest(rid, tuple(prompt), params)):
        tokens += delta.token_ids
        last = delta
    return tokens, last.usage
