"""Cache-aware routing's index (`prefix_affinity`) and the pool's `route` over replicas
that report a prefix cache.  Pure: no Ray cluster (replicas without actors), no HTTP."""

from __future__ import annotations

import random

import pytest

from specd.devtools.status_docs import replica_info, replica_status
from specd.workers.config import spec_for_model
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.block_keys import EvictedBlocks
from specd.workers.mem_cache.prefix_cache import PrefixCache
from specd.workers.pool.controller import PoolController
from specd.workers.pool.prefix_affinity import (
    CacheShape,
    PrefixAffinity,
    PromptBlocks,
    block_keys,
)
from specd.workers.pool.replica import Replica, ReplicaState

SHAPE = CacheShape(page_size=1, capacity_tokens=4096)  # blocks of 16 tokens


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


@pytest.mark.parametrize("page_size,block", [(1, 16), (4, 16), (5, 20), (16, 16), (32, 32)])
def test_a_block_is_the_least_whole_number_of_pages_of_16_tokens(page_size, block):
    assert CacheShape(page_size, 1024).block_tokens == block


@pytest.mark.parametrize("length,blocks", [(0, 0), (1, 0), (16, 0), (17, 1), (33, 2), (48, 2)])
def test_the_block_holding_the_last_prompt_token_is_never_keyed(length, blocks):
    assert len(block_keys(tokens(length, 0), 16)) == blocks


def test_a_key_covers_every_token_before_it():
    base = tokens(80, 1)
    changed = [*base[:20], base[20] + 1, *base[21:]]  # a token of block 1 differs
    a, b = block_keys(base, 16), block_keys(changed, 16)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:], strict=True))
    assert block_keys(base[:50], 16) == a[:3]  # a prefix of the prompt: a prefix of its keys


def test_predicted_hits_follow_what_was_sent_where():
    index = PrefixAffinity()
    system = tokens(64, 2)
    index.record("r0", PromptBlocks([*system, *tokens(10, 3)]), SHAPE)
    shapes = {"r0": SHAPE, "r1": SHAPE, "off": None}
    assert index.predicted_hits(PromptBlocks([*system, *tokens(30, 4)]), shapes) == {
        "r0": 64,
        "r1": 0,
        "off": 0,
    }
    diverging = [*system[:40], 7777, *system[41:]]  # blocks 0 and 1 still match
    assert index.predicted_hits(PromptBlocks(diverging), shapes)["r0"] == 32
    # a replica with another page size keys its own blocks
    index.record("r1", PromptBlocks(system + [1]), CacheShape(page_size=32, capacity_tokens=4096))
    hit = index.predicted_hits(PromptBlocks(system + [2]), {"r1": CacheShape(32, 4096)})
    assert hit == {"r1": 64}


def test_a_replica_without_prefix_cache_is_never_credited():
    index = PrefixAffinity()
    index.record("r0", PromptBlocks(tokens(100, 5)), None)
    assert index.predicted_hits(PromptBlocks(tokens(100, 5)), {"r0": SHAPE}) == {"r0": 0}
    assert index.tracked_tokens("r0", SHAPE) == 0


def test_the_record_is_bounded_by_the_pool_and_loses_deepest_blocks_first():
    index, small = PrefixAffinity(), CacheShape(page_size=16, capacity_tokens=48)  # 3 blocks
    a, b = PromptBlocks(tokens(33, 6)), PromptBlocks(tokens(33, 7))  # two blocks each
    index.record("r0", a, small)
    index.record("r0", b, small)  # 4 blocks on record: a's deepest goes
    assert index.tracked_tokens("r0", small) == 48
    assert index.predicted_hits(a, {"r0": small}) == {"r0": 16}
    assert index.predicted_hits(b, {"r0": small}) == {"r0": 32}
    index.record("r0", a, small)  # a again: its blocks are the newest now
    assert index.predicted_hits(a, {"r0": small}) == {"r0": 32}
    assert index.predicted_hits(b, {"r0": small}) == {"r0": 16}
    index.forget("r0")
    assert index.predicted_hits(a, {"r0": small}) == {"r0": 0}


# -- the pool's route over replicas that never run -------------------------------------


def pool_of(names, model_dir, **routing) -> PoolController:
    spec = spec_for_model(model_dir, replicas=len(names), routing=routing)
    pool = PoolController(spec, actor_factory=None)
    for name in names:
        replica = Replica(name, f"actor-{name}", None, spec.config_hash(), ReplicaState.READY)
        replica.info = replica_info(name, spec.config_hash())  # a prefix cache of page 1
        pool._replicas[name] = replica
    return pool


@pytest.fixture()
def model_dir(tmp_path) -> str:
    return str(tmp_path)  # the spec is validated, never loaded


def test_prompt_groups_stick_to_a_replica_and_spread_over_the_pool(model_dir):
    pool = pool_of(["r0", "r1"], model_dir)
    systems = [tokens(200, 10 + g) for g in range(4)]
    where = {}
    for turn in range(3):
        for g, system in enumerate(systems):
            replica = pool.route([*system, *tokens(20, 100 * turn + g)])
            assert where.setdefault(g, replica.name) == replica.name, (g, turn)
    assert sorted(where.values()) == ["r0", "r0", "r1", "r1"]  # distinct prefixes spread
    assert pool.routed_by_reason() == {"load": 4, "prefix": 8}
    assert pool.routed_hit_tokens.total() == 8 * 192  # 200 tokens: 12 whole blocks of 16
    assert pool.status().routing.routed == {"load": 4, "prefix": 8}


def test_a_busy_cached_replica_loses_the_prompt_to_the_least_loaded(model_dir):
    pool = pool_of(["r0", "r1"], model_dir, balanceAbsThreshold=4, balanceRelThreshold=2)
    system = tokens(200, 20)
    home = pool.route(system + [1])
    other = next(r for r in pool.ready() if r is not home)
    home.inflight, other.inflight = 5, 1  # 4 more: not over the absolute threshold
    assert pool.route(system + [2]) is home
    home.inflight = 6  # 5 more and 6x as many: too busy
    assert pool.route(system + [3]) is other
    # the prompt is on record there now too: equal hits go to the less loaded replica
    assert pool.route(system + [4]) is other
    assert pool.routed_by_reason() == {"load": 1, "prefix": 2, "balance": 1}
    assert pool.routed[home.name, "prefix"] == 1 and pool.routed[other.name, "prefix"] == 1


def test_least_load_policy_ignores_the_prefix_record(model_dir):
    pool = pool_of(["r0", "r1"], model_dir, policy="leastLoad")
    system = tokens(200, 30)
    first = pool.route(system + [1])
    first.inflight = 1
    assert pool.route(system + [2]) is not first
    assert not pool.routed and pool.affinity.tracked_tokens(first.name, SHAPE) == 0


def test_a_short_shared_head_is_below_the_cache_threshold(model_dir):
    pool = pool_of(["r0", "r1"], model_dir, cacheThreshold=0.5)
    head = tokens(40, 40)
    home = pool.route([*head, *tokens(100, 41)])
    home.inflight = 1
    # 32 of 140 tokens predicted cached: under half, so the least-loaded replica wins
    assert pool.route([*head, *tokens(100, 42)]) is not home
    assert pool.routed_by_reason() == {"load": 2}


def test_excluded_and_departed_replicas_are_not_routed_to(model_dir):
    pool = pool_of(["r0", "r1"], model_dir)
    system = tokens(200, 50)
    home = pool.route(system + [1])
    assert pool.route(system + [2], exclude={home.name}) is not home
    home.state = ReplicaState.DRAINING
    assert pool.route(system + [3]) is not home


def test_an_engine_reports_the_keys_of_blocks_whose_last_page_it_evicted():
    """The engine's trie keys a page that ends a block as the gateway keys the prompt;
    evicting it reports that key, other pages report none; the newest are kept."""
    prompt = tokens(40, 7)
    log = EvictedBlocks(page_size=4, keep=2)  # blocks of 16 tokens
    allocator = PagedTokenAllocator(num_pages=16, page_size=4)
    cache = PrefixCache(allocator, log.evicted, log.block_tokens)
    cache.insert(prompt, allocator.alloc_pages(10))
    assert cache.evict(10) == 10  # leaves first: pages ending at 40, 36, 32 (block 1) ...
    assert log.snapshot() == {"total": 2, "keys": block_keys(prompt, 16)[::-1]}
    cache.insert(prompt[:16], allocator.alloc_pages(4))
    cache.evict(4)
    assert log.snapshot()["total"] == 3 and len(log.snapshot()["keys"]) == 2  # newest kept


def evicted_status(replica: Replica, log: EvictedBlocks):
    """A probe's answer from ``replica`` whose prefix cache evicted what ``log`` holds."""
    prefix_cache = {"queried_tokens": 0, "hit_tokens": 0, "evicted_blocks": log.snapshot()}
    return replica_status(replica.name, replica.config_hash, prefix_cache=prefix_cache)


def test_a_probe_takes_evicted_blocks_off_the_replicas_record(model_dir):
    """After the engine reports evicting a prompt's blocks, the gateway no longer
    predicts a hit there: the prompt goes by load, and each report is taken once."""
    pool = pool_of(["r0", "r1"], model_dir)
    system = tokens(200, 30)
    home = pool.route(system + [1])
    assert pool.route(system + [2]) is home  # cached: prefix
    log = EvictedBlocks(page_size=1)
    for key in reversed(block_keys(system + [1], 16)):  # leaves first, as the trie evicts
        log.evicted(key)
    pool.note_status(home, evicted_status(home, log))
    assert pool.affinity.tracked_tokens(home.name, SHAPE) == 0  # its 12 blocks are gone
    home.inflight = 1  # busier: without the hit, the prompt goes by load
    assert pool.route(system + [3]) is not home
    assert pool.routed_by_reason() == {"load": 2, "prefix": 1}
    pool.note_status(home, evicted_status(home, log))  # seen
