"""The sharded model's decode step at tensor 1 and tensor 2 on CPU (gloo), in one run.

Each configuration runs in fresh processes (``specd.devtools.tp_ranks``): the target is
loaded at its tensor size, ``--batch`` requests are prefilled, then ``--steps`` greedy
decode steps are timed (the forward over paged KV, the logits and their gather).  Every
configuration's greedy tokens must equal tensor 1's.

    python benchmarks/bench_tensor_parallel.py [--model examples/models/demo-target]
        [--batch 1 8 32] [--steps 32]

Printed: ms per decode step, and each configuration's tokens/s as a ratio to tensor 1
with the same number of cores.  On a 2-core machine tensor 2 (one thread per rank) can at
best match tensor 1 with two threads: the collectives (two all-reduces per layer and a
logits gather per step) are its cost, and the gain of splitting a model shows only where
each rank has a device of its own (GPUs, NCCL).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specd.devtools.paged_runner import PagedRunner
from specd.devtools.testing import DEMO_TARGET
from specd.devtools.tp_ranks import run_on_ranks
from specd.workers.model.config import load_model_config
from specd.workers.model.loader import load_model
from specd.workers.model.parallel import TpGroup


@torch.no_grad()
def decode_steps(tp: TpGroup, path: str, batch: int, steps: int, threads: int) -> dict:
    """Per-step seconds of ``steps`` greedy decode steps of ``batch`` requests."""
    torch.set_num_threads(threads)
    model, config = load_model(path, dtype="float32", tp=tp)
    page = 16
    pages = batch * (-(-(16 + steps + 1) // page)) + 1
    runner = PagedRunner(model, page, num_pages=pages, shuffle=False, num_rows=batch)
    rows = list(range(batch))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (16,), generator=g).tolist() for _ in rows]
    logits = runner.extend(rows, prompts)[15::16]  # each prompt's last token
    tokens: list[list[int]] = [[] for _ in rows]
    times = []
    for _ in range(steps):
        next_ids = logits.argmax(-1).tolist()
        for seq, token in zip(tokens, next_ids, strict=True):
            seq.append(token)
        start = time.perf_counter()
        logits = runner.extend(rows, [[t] for t in next_ids])
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[2:]), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_TARGET)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    config = load_model_config(args.model)
    print(
        f"{args.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads, float32, {torch.get_num_threads()} cores seen"
    )
    runs = [("tensor 1, 1 thread", 1, 1), ("tensor 1, 2 threads", 1, 2), ("tensor 2", 2, 1)]
    print(f"{'batch':>5}  " + "  ".join(f"{name:>20}" for name, _, _ in runs) + "  tp2/tp1@2thr")
    for batch in args.batch:
        results = []
        for _, size, threads in runs:
            ranks = run_on_ranks(size, decode_steps, args.model, batch, args.steps, threads)
            if ranks[0]["tokens"] != (results[0]["tokens"] if results else ranks[0]["tokens"]):
                raise SystemExit(f"batch {batch}: tensor {size}'s greedy tokens differ")
            results.append(ranks[0])
        cells = [f"{r['step_s'] * 1e3:17.2f} ms" for r in results]
        ratio = results[1]["step_s"] / results[2]["step_s"]
        print(f"{batch:>5}  " + "  ".join(f"{c:>20}" for c in cells) + f"  {ratio:11.2f}x")


if __name__ == "__main__":
    main()
