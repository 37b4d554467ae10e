"""The prefix cache on a shared system prompt: specd with ``kvCache.prefixCache`` on vs
off, in one process, interleaved repeats, medians printed as ratios.

Each round sends ``--requests`` prompts at once, all opening with the same
``--prefix-len`` tokens and ending with ``--suffix-len`` of their own, greedy, fixed
output length; the cache-on engine has served one request with the prefix before
(a warm system prompt).  Outputs must be identical with the cache on and off.  With
``--sessions`` each prompt is the first turn of its own streaming session, and the KV
the idle sessions then hold is reported too.

    python benchmarks/bench_prefix_cache.py [--target examples/models/demo-target]
        [--prefix-len 768] [--suffix-len 16] [--requests 8] [--new-tokens 16]
        [--draft examples/models/demo-eagle] [--sessions]

``--evictions`` times the trie alone instead: a pool of each ``--pool-tokens`` size
filled with cached 128-token prompts at ``--page-size``, then one-page evictions, as a
full pool's decode steps make them (microseconds each).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from specd.devtools.testing import DEMO_TARGET, demo_prompts, start_engine, wait_idle
from specd.workers.mem_cache.allocator import PagedTokenAllocator
from specd.workers.mem_cache.prefix_cache import PrefixCache
from specd.workers.types import GenerateRequest, SamplingParams


async def _timed(engine, rid: str, prompt: list[int], new_tokens: int, session: str | None):
    """-> (tokens, seconds to the first token, cached prompt tokens)."""
    start, first, tokens, last = time.perf_counter(), None, [], None
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    async for delta in engine.generate(GenerateRequest(rid, tuple(prompt), params, session)):
        if first is None and delta.token_ids:
            first = time.perf_counter() - start
        tokens += delta.token_ids
        last = delta
    return tokens, first, last.usage.cached_tokens


def run_round(engine, prompts, new_tokens: int, tag: str, sessions: bool = False):
    """One round of ``prompts`` at once -> (results, seconds, KV slots the idle
    sessions hold after it: 0 without ``sessions``)."""
    sids = [engine.open_session() if sessions else None for _ in prompts]

    async def go():
        return await asyncio.gather(
            *(
                _timed(engine, f"{tag}{i}", p, new_tokens, sid)
                for i, (p, sid) in enumerate(zip(prompts, sids, strict=True))
            )
        )

    start = time.perf_counter()
    results = asyncio.run(go())
    seconds = time.perf_counter() - start
    held = 0
    if sessions:
        assert wait_idle(engine), "the engine did not go idle"
        held = engine.status().session_kv_tokens
        for sid in sids:
            engine.close_session(sid)
    return results, seconds, held


def time_evictions(pool_tokens: int, page_size: int, evictions: int = 2000) -> None:
    """A pool full of cached prompts, then ``evictions`` one-page evictions each
    followed by the allocation that needed it; prints microseconds per eviction."""
    allocator = PagedTokenAllocator(pool_tokens // page_size, page_size)
    cache = PrefixCache(allocator)
    rng = random.Random(0)
    pages_per_prompt = 128 // page_size
    while allocator.num_free_pages >= pages_per_prompt:
        tokens = [rng.randrange(8192) for _ in range(pages_per_prompt * page_size)]
        cache.insert(tokens, allocator.alloc_pages(pages_per_prompt))
    cached, start = cache.num_pages, time.perf_counter()
    for _ in range(evictions):
        cache.evict(1)
        allocator.alloc_pages(1)
    per = (time.perf_counter() - start) / evictions * 1e6
    print(
        f"pool {pool_tokens} tokens, page {page_size}: {cached} cached pages, {per:.1f} us per eviction"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEMO_TARGET)
    ap.add_argument("--draft", help="an EAGLE draft folder: speculative engines")
    ap.add_argument("--prefix-len", type=int, default=768)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--sessions", action="store_true", help="each prompt opens its own streaming session"
    )
    ap.add_argument("--evictions", action="store_true", help="time the trie's evictions alone")
    ap.add_argument("--pool-tokens", type=int, nargs="+", default=[32768, 262144])
    args = ap.parse_args()
    if args.evictions:
        for tokens in args.pool_tokens:
            time_evictions(tokens, args.page_size)
        return

    text = demo_prompts(1, args.prefix_len + args.requests * args.suffix_len)[0]
    prefix, rest = text[: args.prefix_len], text[args.prefix_len :]
    prompts = [
        prefix + rest[i * args.suffix_len : (i + 1) * args.suffix_len] for i in range(args.requests)
    ]
    spec = {"kvCache": {"pageSize": args.page_size}, "maxRunningRequests": args.requests}
    if args.sessions:
        spec["sessions"] = {"enabled": True, "maxSessions": args.requests}
    if args.draft:
        spec["draft"] = {"path": args.draft}
        spec["speculative"] = {"numSteps": 3, "topk": 1, "numDraftTokens": 4}
    engines = {
        "cache off": start_engine(
            args.target, **{**spec, "kvCache": {**spec["kvCache"], "prefixCache": False}}
        ),
        "cache on": start_engine(args.target, **spec),
    }
    try:
        warm = prefix + rest[-args.suffix_len :]
        for engine in engines.values():
            run_round(engine, [warm], args.new_tokens, "warm", args.sessions)
        ttft = {name: [] for name in engines}
        wall = {name: [] for name in engines}
        outputs, cached, held = {}, {}, {}
        for r in range(args.repeats):
            for name, engine in engines.items():
                results, seconds, held[name] = run_round(
                    engine, prompts, args.new_tokens, f"r{r}-", args.sessions
                )
                outputs[name] = [t for t, _, _ in results]
                cached[name] = sum(c for _, _, c in results)
                ttft[name].append(statistics.mean(f for _, f, _ in results))
                wall[name].append(seconds)
        assert outputs["cache on"] == outputs["cache off"], "outputs differ with the cache"
    finally:
        for engine in engines.values():
            engine.shutdown()

    print(
        f"{args.requests} requests, shared prefix {args.prefix_len} + {args.suffix_len} own "
        f"tokens, {args.new_tokens} new, page {args.page_size}"
        + (", speculative" if args.draft else "")
        + (", each the first turn of a session" if args.sessions else "")
    )
    for name in engines:
        print(
            f"  {name:9s}  mean TTFT {statistics.median(ttft[name]) * 1e3:7.1f} ms   "
            f"round {statistics.median(wall[name]) * 1e3:7.1f} ms   "
            f"cached prompt tokens {cached[name]}"
            + (f"   KV held by the idle sessions {held[name]}" if args.sessions else "")
        )
    off, on = (statistics.median(ttft[n]) for n in engines)
    woff, won = (statistics.median(wall[n]) for n in engines)
    print(f"  cache on vs off: TTFT {off / on:.2f}x faster, round {woff / won:.2f}x faster")


if __name__ == "__main__":
    main()
