"""Where served time goes: CPU per streamed token in each process of `specd serve`.

Starts ``specd serve SPEC`` (its own local Ray), streams ``--requests`` completions at
each ``--concurrency`` with ``ignore_eos`` from an asyncio client in this process, and
prints for each run the streamed tokens/s and the CPU milliseconds per streamed token
spent by the gateway process, the engine actor(s), the rest of Ray, and this client
(from /proc, so Linux only).  With ``--py-spy DIR`` (py-spy installed) it also records a
flame graph of the gateway and of each engine actor during each run.

    python benchmarks/profile_serving.py [--spec FILE.yaml] [--concurrency 1 64] \
        [--requests 128] [--max-tokens 200] [--py-spy /tmp/prof] [--null-model] \
        [--burst N] [--burst-rounds 5]

Without ``--spec`` it serves a tiny random checkpoint (context 4096), whose engine
costs little, so the numbers are mostly the serving path's; ``--null-model`` serves the
benchmark-only null model instead of its forward (``BenchKnobs.null_model``, through
``SPECD_BENCH_KNOBS``), so the engine actor's CPU is its bookkeeping alone.  ``--slow-reader TOKENS``
runs each load again beside one client that stops reading a long stream, and prints the
other streams' ITL with it (the stalled stream is cut off by
``spec.gateway.maxStreamBacklog``).  ``--source DIR`` serves another
checkout's specd (e.g. a ``git worktree`` of an older commit) for a before/after.
``--burst N`` then sends N requests at once, ``--burst-rounds`` times on one warm
client, and prints each round's first-token latencies (median, max) and the time until
the last one finished: how fast a burst gets through the gateway to the engine (with
``--max-tokens 1`` and ``--null-model``, the CPU per streamed token is per request).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from proc_cpu import cpu_seconds, pids_cpu_seconds, specd_roles

from specd.devtools.testing import stalled_stream
from specd.workers.bench_knobs import BenchKnobs

TINY_SPEC = """\
apiVersion: specd.dev/v1alpha1
kind: SpecDecodeDeployment
metadata:
  name: tiny
spec:
  model: {{path: {model}, name: tiny, dtype: float32}}
  replicas: 1
  resources: {{gpus: 0, cpu: 1}}
  kvCache: {{pageSize: 16, maxTokens: 65536}}
  maxRunningRequests: 256
"""


def cpu_by_role(roles: dict[str, list[int]]) -> dict[str, float]:
    out = {role: pids_cpu_seconds(pids) for role, pids in roles.items()}
    out["client"] = cpu_seconds(os.getpid())
    return out


def completion_body(model: str, max_tokens: int) -> dict:
    """The streamed completion every load sends (usage in its last chunk)."""
    return {
        "model": model,
        "prompt": "The serving path of a speculative decoder",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }


async def stream_load(
    url: str, model: str, concurrency: int, requests: int, max_tokens: int
) -> tuple[int, float, list[float]]:
    """Streamed tokens (as the final usage counts them), wall seconds and the gaps
    between a stream's chunks, of ``requests`` completions."""
    body = completion_body(model, max_tokens)
    limits = httpx.Limits(max_connections=concurrency + 4)
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> int:
            tokens, last = 0, None
            async with gate, client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk["choices"]:
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
            return tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(requests)))
        return sum(counts), time.perf_counter() - started, gaps


async def burst_rounds(
    url: str, model: str, size: int, rounds: int, max_tokens: int
) -> list[tuple[float, float, float]]:
    """Per round of ``size`` streamed requests sent at once: (median first-token ms,
    max first-token ms, ms until the last finished), all on one warm client."""
    body = completion_body(model, max_tokens)
    limits = httpx.Limits(max_connections=size + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(started: float) -> tuple[float, float]:
            first = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - started
            return first or 0.0, time.perf_counter() - started

        await asyncio.gather(*(one(time.perf_counter()) for _ in range(size)))  # connect
        out = []
        for _ in range(rounds):
            started = time.perf_counter()
            done = await asyncio.gather(*(one(started) for _ in range(size)))
            firsts = [first for first, _ in done]
            out.append(
                (
                    statistics.median(firsts) * 1e3,
                    max(firsts) * 1e3,
                    max(end for _, end in done) * 1e3,
                )
            )
        return out


def stalled_body(model: str, args: argparse.Namespace) -> dict:
    """A long streamed chat completion with big chunks (two choices, 20 top log-probs)
    for a stalled reader."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "stalled"}],
        "max_tokens": args.slow_reader,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "n": 2,
        "stream": True,
    }


def beside_one_long_stream(
    url: str, model: str, args: argparse.Namespace, concurrency: int, *, read: bool
) -> float:
    """The load's median ITL (ms) while one more client streams `stalled_body`, reading
    it (the same engine and gateway work) or not (a stalled reader, cut off)."""
    sock = stalled_stream(url, "/v1/chat/completions", stalled_body(model, args))

    def drain() -> None:
        with contextlib.suppress(OSError):
            while sock.recv(1 << 16):
                pass

    reader = threading.Thread(target=drain, daemon=True)
    if read:
        reader.start()
    try:
        _, _, gaps = asyncio.run(
            stream_load(url, model, concurrency, args.requests, args.max_tokens)
        )
    finally:
        sock.close()
    return statistics.median(gaps) * 1e3


def start_serve(
    spec: Path, source: str | None, port: int, null_model: bool = False
) -> subprocess.Popen:
    env = {**os.environ, **BenchKnobs(null_model=null_model).as_env()}
    if source:
        roots = [f"{source}/{p}" for p in ("workers", "kernels", "operator")]
        env["PYTHONPATH"] = os.pathsep.join(roots)
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "specd.workers.cli", "serve", str(spec), "--port", str(port)]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_ready(proc: subprocess.Popen, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if " ready " in line and " on http" in line:
            return line.rsplit(" on ", 1)[1].strip()
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"specd serve did not become ready (exit {proc.poll()})")


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, help="a SpecDecodeDeployment file (default: tiny)")
    ap.add_argument("--source", help="serve this checkout's specd instead of the installed one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--port", type=int, default=8173)
    ap.add_argument("--py-spy", type=Path, help="record py-spy flame graphs into this folder")
    ap.add_argument(
        "--py-spy-format",
        choices=("flamegraph", "raw"),
        default="flamegraph",
        help="raw: collapsed stacks (one line per stack), for scripts",
    )
    ap.add_argument(
        "--slow-reader",
        type=int,
        metavar="TOKENS",
        help="run each load again beside one client that asks for TOKENS and reads nothing, "
        "and print the other streams' ITL with it",
    )
    ap.add_argument("--burst", type=int, metavar="N", help="then N requests at once, per round")
    ap.add_argument("--burst-rounds", type=int, default=5)
    ap.add_argument(
        "--null-model",
        action="store_true",
        help="serve the null model (no forward; plain decoding only) instead of the model's",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = args.spec
        if spec is None:
            from specd.devtools.tiny_checkpoint import make_tiny_checkpoint

            model = make_tiny_checkpoint(Path(tmp) / "tiny", max_position_embeddings=4096)
            spec = Path(tmp) / "tiny.yaml"
            spec.write_text(TINY_SPEC.format(model=model))
        proc = start_serve(spec, args.source, args.port, args.null_model)
        try:
            url = wait_ready(proc)
            model = model_name(url)
            asyncio.run(stream_load(url, model, 4, 8, 16))  # warm up
            if args.null_model:
                print("# engine: the null model (SPECD_BENCH_KNOBS null_model: no forward)")
            print(
                f"{'conc':>4} {'tok/s':>7} {'ITL ms':>7} | "
                "CPU ms per streamed token: gateway engine ray client"
            )
            for concurrency in args.concurrency:
                roles = specd_roles(proc.pid)
                spies = []
                if args.py_spy:
                    args.py_spy.mkdir(parents=True, exist_ok=True)
                    for role in ("gateway", "engine"):
                        for pid in roles[role]:
                            suffix = "svg" if args.py_spy_format == "flamegraph" else "txt"
                            out = args.py_spy / f"{role}-{pid}-c{concurrency}.{suffix}"
                            spies.append(
                                subprocess.Popen(
                                    [
                                        "py-spy",
                                        "record",
                                        "-p",
                                        str(pid),
                                        "-o",
                                        str(out),
                                        "-r",
                                        "50",
                                        "--threads",
                                        "-f",
                                        args.py_spy_format,
                                    ],
                                    stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL,
                                )
                            )
                before = cpu_by_role(roles)
                tokens, seconds, gaps = asyncio.run(
                    stream_load(url, model, concurrency, args.requests, args.max_tokens)
                )
                after = cpu_by_role(roles)
                for spy in spies:
                    spy.send_signal(2)
                    spy.wait(timeout=60)
                per_token = {k: (after[k] - before[k]) * 1e3 / max(tokens, 1) for k in after}
                itl = statistics.median(gaps) * 1e3 if gaps else float("nan")  # 1 token: none
                shares = " ".join(
                    f"{per_token[k]:.3f}" for k in ("gateway", "engine", "ray", "client")
                )
                print(f"{concurrency:>4} {tokens / seconds:>7.0f} {itl:>7.1f} | {shares}")
                if args.slow_reader:
                    reading = beside_one_long_stream(url, model, args, concurrency, read=True)
                    stalled = beside_one_long_stream(url, model, args, concurrency, read=False)
                    print(
                        f"{concurrency:>4} beside one long stream: ITL median {reading:.1f} ms "
                        f"when its client reads, {stalled:.1f} ms when it stalls "
                        f"({stalled / reading:.2f}x)"
                    )
            if args.burst:
                rounds = asyncio.run(
                    burst_rounds(url, model, args.burst, args.burst_rounds, args.max_tokens)
                )
                for median_first, max_first, last in rounds:
                    print(
                        f"burst of {args.burst}: first token median {median_first:.1f} ms, "
                        f"max {max_first:.1f} ms; all finished in {last:.1f} ms"
                    )
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
