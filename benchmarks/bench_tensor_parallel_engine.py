"""A whole replica's tokens/s at tensor 1 and tensor 2 on CPU, in one run.

Each configuration is a real engine (``start_engine``): at tensor 2 this process is
rank 0 and rank 1 is a Ray actor, and rank 0 broadcasts every model call's inputs
(``engine/rank_group.py``) before running it.  ``--batch`` concurrent greedy requests
of ``--tokens`` new tokens each are timed end to end after a warm-up, plain and with the
demo EAGLE head; every configuration's tokens must equal tensor 1's.

    python benchmarks/bench_tensor_parallel_engine.py [--batch 1 8] [--tokens 64]

Printed: tokens/s and tensor 2's ratio to tensor 1.  On 2 cores the ceiling of that
ratio is about 1 (tensor 1 already uses both cores; tensor 2 adds per call a broadcast
and per layer two all-reduces between processes); the split pays where each rank has a
device of its own.
"""

from __future__ import annotations

import argparse
import time

import ray
import torch

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    demo_prompts,
    run_all,
    start_engine,
    start_spec_engine,
)


def tokens_per_second(tensor: int, spec: bool, batch: int, tokens: int) -> tuple[float, list]:
    """(tokens/s, outputs) of ``batch`` concurrent requests on a fresh engine."""
    parallelism = {"tensor": tensor}
    threads = torch.get_num_threads()  # rank 0 of tensor 2 sets its own (resources.cpu)
    if spec:
        engine = start_spec_engine(
            DEMO_TARGET, DEMO_EAGLE, page_size=16, steps=3, topk=1, parallelism=parallelism
        )
    else:
        engine = start_engine(
            DEMO_TARGET, kvCache={"pageSize": 16, "maxTokens": 8192}, parallelism=parallelism
        )
    prompts = demo_prompts(batch, 32)
    try:
        run_all(engine, prompts, max_tokens=8, ignore_eos=True)  # warm-up
        start = time.perf_counter()
        results = run_all(engine, prompts, max_tokens=tokens, ignore_eos=True)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
    return batch * tokens / seconds, [r[0] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    print(f"demo pair, float32, {torch.get_num_threads()} cores seen; tokens/s")
    print(f"{'mode':>6} {'batch':>5} {'tensor 1':>10} {'tensor 2':>10} {'tp2/tp1':>8}")
    for spec in (False, True):
        for batch in args.batch:
            one, expected = tokens_per_second(1, spec, batch, args.tokens)
            two, outputs = tokens_per_second(2, spec, batch, args.tokens)
            if outputs != expected:
                raise SystemExit(f"batch {batch}: tensor 2's greedy tokens differ")
            mode = "eagle" if spec else "plain"
            print(f"{mode:>6} {batch:>5} {one:10.1f} {two:10.1f} {two / one:7.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
