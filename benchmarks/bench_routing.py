"""Cache-aware routing vs least-load routing on one pool of replicas, over real HTTP.

One gateway and ``--replicas`` engine actors on a local Ray.  Each round, ``--clients``
clients send ``--requests`` streaming completions; request i opens with the shared
prefix of group ``order[i]`` (``--groups`` groups of ``--prefix-len`` tokens, a
seeded random order) and ends with ``--suffix-len`` tokens of its own.  Each replica's
KV pool (``--kv-tokens``) holds only part of the groups' prefixes, as in a busy
deployment, so where a prompt goes decides whether its prefix is still cached.

The policy is switched live (``spec.routing`` rolls no replica); the two policies
alternate rounds, each round on fresh prefixes.  Printed per policy: the share of
prompt tokens served from the prefix cache, mean time to first token and requests/s,
then cache-aware over least-load as ratios.  With ``--sessions`` each request is the
first turn of a streaming session opened just before it (on the replica with the
fewest sessions; cache-aware routing then places it by its prompt) and kept open to the
round's end, when the KV the idle sessions hold is read.

    python benchmarks/bench_routing.py [--target examples/models/demo-target]
        [--replicas 2] [--groups 6] [--prefix-len 384] [--suffix-len 16]
        [--requests 48] [--clients 4] [--new-tokens 4] [--kv-tokens 2048] [--repeats 2]
        [--sessions]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
import ray

from specd.devtools.testing import DEMO_TARGET, running_gateway
from specd.workers.config import spec_for_model

POLICIES = ("cacheAware", "leastLoad")


async def _one(client: httpx.AsyncClient, prompt: list[int], new_tokens: int, sids=None):
    """-> (seconds to the first token, prompt tokens, cached prompt tokens); ``sids``: as
    the first turn of a new session, whose id goes there."""
    extra = {}
    if sids is not None:
        opened = await client.post("/v1/sessions")
        opened.raise_for_status()
        extra["session_id"] = opened.json()["id"]
        sids.append(extra["session_id"])
    body = {
        **extra,
        "model": "bench",
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, usage = time.perf_counter(), None, None
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if first is None and event["choices"] and event["choices"][0]["text"] is not None:
                first = time.perf_counter() - start
            usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return first, usage["prompt_tokens"], details.get("cached_tokens", 0)


async def _round(url: str, prompts: list[list[int]], clients: int, new_tokens: int, sessions):
    """-> (per request results, seconds, KV tokens the idle sessions hold at the end)."""
    queue = list(reversed(prompts))
    results, sids = [], [] if sessions else None

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            results.append(await _one(client, queue.pop(), new_tokens, sids))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        seconds = time.perf_counter() - start
        held = 0
        if sessions:
            await asyncio.sleep(1.5)  # a probe interval: loads catch up
            actors = (await client.get("/admin/status")).json()["actors"]
            held = sum(a["load"]["session_kv_tokens"] for a in actors if a["load"])
            for sid in sids:
                (await client.delete(f"/v1/sessions/{sid}")).raise_for_status()
        return results, seconds, held


def _set_policy(gw, policy: str) -> None:
    spec = gw.pool.spec
    new = spec.model_copy(update={"routing": spec.routing.model_copy(update={"policy": policy})})

    async def apply() -> None:
        gw.pool.update_spec(new)

    asyncio.run_coroutine_threadsafe(apply(), gw.loop).result(timeout=10)


def _workload(args, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, vocab) for _ in range(args.prefix_len)] for _ in range(args.groups)
    ]
    order = [i % args.groups for i in range(args.requests)]
    rng.shuffle(order)
    return [prefixes[g] + [rng.randrange(3, vocab) for _ in range(args.suffix_len)] for g in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEMO_TARGET)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=2048, help="each replica's KV pool")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sessions", action="store_true", help="first turns of new sessions")
    args = ap.parse_args()

    vocab = json.loads((Path(args.target) / "config.json").read_text())["vocab_size"]
    spec = spec_for_model(
        args.target,
        replicas=args.replicas,
        model={"name": "bench"},
        resources={"cpu": 1},
        kvCache={"pageSize": args.page_size, "maxTokens": args.kv_tokens},
        sessions={"enabled": args.sessions, "maxSessions": max(64, args.requests)},
    )
    stats = {p: {"ttft": [], "rps": [], "prompt": 0, "cached": 0, "held": []} for p in POLICIES}
    ray.init(num_cpus=args.replicas + 1, include_dashboard=False, log_to_driver=False)
    try:
        with running_gateway(spec, "bench-routing", ready_timeout_s=300) as gw:
            for r in range(args.repeats):
                order = POLICIES if r % 2 == 0 else POLICIES[::-1]
                for i, policy in enumerate(order):
                    _set_policy(gw, policy)
                    prompts = _workload(args, vocab, seed=2 * r + i)
                    results, seconds, held = asyncio.run(
                        _round(gw.url, prompts, args.clients, args.new_tokens, args.sessions)
                    )
                    s = stats[policy]
                    s["held"].append(held)
                    s["ttft"] += [first for first, _, _ in results]
                    s["rps"].append(len(results) / seconds)
                    s["prompt"] += sum(n for _, n, _ in results)
                    s["cached"] += sum(c for _, _, c in results)
            routed = gw.pool.routed_by_reason()
            placed = dict(gw.pool.session_directory.placements)
    finally:
        ray.shutdown()

    print(
        f"{args.replicas} replicas x {args.kv_tokens} KV tokens; {args.groups} prefix groups of "
        f"{args.prefix_len} + {args.suffix_len} own tokens; {args.requests} requests x "
        f"{args.repeats} rounds per policy, {args.clients} clients, {args.new_tokens} new"
        + ("; each the first turn of a new session" if args.sessions else "")
    )
    for policy in POLICIES:
        s = stats[policy]
        held = f"   sessions hold {statistics.median(s['held']):.0f} KV tokens" * args.sessions
        print(
            f"  {policy:10s}  prefix-cache hits {s['cached'] / s['prompt']:6.1%}   "
            f"mean TTFT {statistics.mean(s['ttft']) * 1e3:7.1f} ms   "
            f"{statistics.median(s['rps']):6.2f} req/s{held}"
        )
    aware, least = stats["cacheAware"], stats["leastLoad"]
    print(
        f"  cacheAware vs leastLoad: TTFT "
        f"{statistics.mean(least['ttft']) / statistics.mean(aware['ttft']):.2f}x faster, "
        f"throughput {statistics.median(aware['rps']) / statistics.median(least['rps']):.2f}x"
        f"; cache-aware decisions {routed}"
        + (f"; first-turn placements {placed}" if args.sessions else "")
    )


if __name__ == "__main__":
    main()
