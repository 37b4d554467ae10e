"""Priority scheduling under a backlog: ``scheduler.policy: priority`` vs ``fcfs``, in one
process, interleaved repeats, medians printed as ratios.

Each round floods an engine with ``--background`` long requests at once (more than
``--max-running`` can run), then, once they stream, sends ``--urgent`` short requests
``--urgent-every-ms`` apart.  Under ``fcfs`` every request has priority 0, so an urgent
request queues behind the backlog; under ``priority`` the backlog has priority 10 and
the urgent requests 0, so they preempt it.  Reported: the urgent requests' time to first
token and latency, and what the backlog pays (the round's length, its preemptions).
Greedy outputs must be identical under both policies.

    python benchmarks/bench_priority.py [--target examples/models/demo-target]
        [--background 16] [--urgent 4] [--max-running 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from specd.devtools.testing import DEMO_TARGET, demo_prompts, metric_value, start_engine
from specd.workers.types import GenerateRequest, SamplingParams


async def _timed(engine, rid: str, prompt: list[int], new_tokens: int, priority: int, started):
    """-> (tokens, seconds to the first token, seconds to the last)."""
    begin, first, tokens = time.perf_counter(), None, []
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    request = GenerateRequest(rid, tuple(prompt), params, priority=priority)
    async for delta in engine.generate(request):
        if first is None and delta.token_ids:
            first = time.perf_counter() - begin
            started.set()
        tokens += delta.token_ids
    return tokens, first, time.perf_counter() - begin


def run_round(engine, background, urgent, args, prioritized: bool):
    """One round -> (background results, urgent results, the round's seconds)."""
    low, high = (10, 0) if prioritized else (0, 0)

    async def go():
        started = asyncio.Event()
        flood = [
            asyncio.create_task(_timed(engine, f"bg{i}", p, args.background_tokens, low, started))
            for i, p in enumerate(background)
        ]
        await started.wait()
        urgent_tasks = []
        for i, p in enumerate(urgent):
            ignored = asyncio.Event()
            urgent_tasks.append(
                asyncio.create_task(_timed(engine, f"u{i}", p, args.urgent_tokens, high, ignored))
            )
            await asyncio.sleep(args.urgent_every_ms / 1000)
        return await asyncio.gather(*flood), await asyncio.gather(*urgent_tasks)

    begin = time.perf_counter()
    flood, rushed = asyncio.run(go())
    return flood, rushed, time.perf_counter() - begin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEMO_TARGET)
    ap.add_argument("--background", type=int, default=16)
    ap.add_argument("--background-len", type=int, default=128)
    ap.add_argument("--background-tokens", type=int, default=64)
    ap.add_argument("--urgent", type=int, default=4)
    ap.add_argument("--urgent-len", type=int, default=32)
    ap.add_argument("--urgent-tokens", type=int, default=16)
    ap.add_argument("--urgent-every-ms", type=float, default=200)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    texts = demo_prompts(args.background + args.urgent, args.background_len)
    background = texts[: args.background]
    urgent = [p[: args.urgent_len] for p in texts[args.background :]]  # no shared prefix
    engines = {
        policy: start_engine(
            args.target,
            maxRunningRequests=args.max_running,
            scheduler={"policy": policy},
        )
        for policy in ("fcfs", "priority")
    }
    rows: dict[str, list[tuple[float, float, float]]] = {p: [] for p in engines}
    outputs: dict[str, list] = {}
    try:
        for repeat in range(args.repeats):
            for policy, engine in engines.items():
                flood, rushed, seconds = run_round(
                    engine, background, urgent, args, policy == "priority"
                )
                tokens = [r[0] for r in flood + rushed]
                assert outputs.setdefault(policy, tokens) == tokens, "outputs changed"
                ttft = statistics.mean(r[1] for r in rushed)
                latency = statistics.mean(r[2] for r in rushed)
                rows[policy].append((ttft, latency, seconds))
                print(
                    f"repeat {repeat} {policy:8s} urgent TTFT {ttft * 1e3:7.1f} ms, "
                    f"urgent latency {latency * 1e3:7.1f} ms, round {seconds:6.2f} s"
                )
        assert outputs["fcfs"] == outputs["priority"], "outputs differ between the policies"
        preempted = metric_value(engines["priority"], "specd_preemptions_total")
        fcfs_preempted = metric_value(engines["fcfs"], "specd_preemptions_total")
    finally:
        for engine in engines.values():
            engine.shutdown()

    med = {p: [statistics.median(col) for col in zip(*r, strict=True)] for p, r in rows.items()}
    (f_ttft, f_lat, f_round), (p_ttft, p_lat, p_round) = med["fcfs"], med["priority"]
    print(
        f"\n{args.background} background x {args.background_tokens} tokens, {args.urgent} "
        f"urgent x {args.urgent_tokens}, maxRunningRequests {args.max_running}, "
        f"medians of {args.repeats}; outputs identical"
    )
    print(f"urgent TTFT     fcfs {f_ttft * 1e3:7.1f} ms  priority {p_ttft * 1e3:7.1f} ms  "
          f"{f_ttft / p_ttft:5.2f}x shorter")  # fmt: skip
    print(f"urgent latency  fcfs {f_lat * 1e3:7.1f} ms  priority {p_lat * 1e3:7.1f} ms  "
          f"{f_lat / p_lat:5.2f}x shorter")  # fmt: skip
    print(f"round           fcfs {f_round:7.2f} s   priority {p_round:7.2f} s   "
          f"{p_round / f_round:5.2f}x as long")  # fmt: skip
    print(f"preemptions     fcfs {fcfs_preempted:.0f}  priority {preempted:.0f} "
          f"(over {args.repeats} rounds)")  # fmt: skip


if __name__ == "__main__":
    main()
