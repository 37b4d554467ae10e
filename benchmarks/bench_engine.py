"""specd's engine (no speculation) against peers on the same checkpoint.

Greedy, token-id prompts, fixed output length.  Engines run one after another,
repeated and interleaved; medians are printed as ratios measured in this run, and
every run checks that outputs are token-identical to transformers at batch 1.

    python benchmarks/bench_engine.py --model examples/models/demo-target \\
        [--batch 1 32] [--new-tokens 64] [--repeats 3] [--vllm-python .venv-vllm/bin/python]

Peers: ``transformers`` ``generate`` (always; batch > 1 uses one left-padded batch)
and, with ``--vllm-python``, vLLM's CPU build run by ``bench_vllm_worker.py`` in its
own virtualenv.  Also prints the host (scheduler) share of specd's step time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specd.workers.config import spec_for_model
from specd.workers.engine.engine import Engine
from specd.workers.engine.types import GenerateRequest, SamplingParams


def make_prompts(n: int, vocab: int, seed: int, lo: int = 16, hi: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class SpecdRunner:
    name = "specd"

    def __init__(self, model: str, dtype: str, max_running: int):
        spec = spec_for_model(model, model={"dtype": dtype}, maxRunningRequests=max(max_running, 1))
        self.engine = Engine(spec, device="cpu")
        self.engine.start()

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

        async def one(i, p):
            out = []
            async for d in self.engine.generate(GenerateRequest(f"b{i}", tuple(p), params)):
                out += d.token_ids
            return out

        async def all_():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        return asyncio.run(all_())

    def host_share(self) -> float:
        s = self.engine.step_seconds
        return s["host"] / max(s["host"] + s["model"], 1e-9)

    def close(self):
        self.engine.shutdown()


class TransformersRunner:
    """``generate`` on one left-padded static batch (how a script would batch)."""

    name = "transformers"

    def __init__(self, model: str, dtype: str):
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = self.model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[:, width:].tolist()

    def close(self):
        pass


class TransformersServingRunner(TransformersRunner):
    """``generate`` one request at a time: a server without continuous batching."""

    name = "transformers-seq"

    def __init__(self, base: TransformersRunner):
        self.model = base.model

    def run(self, prompts, new_tokens):
        return [super(TransformersServingRunner, self).run([p], new_tokens)[0] for p in prompts]


class VllmRunner:
    """Runs vLLM in its own virtualenv through bench_vllm_worker.py (one process per call)."""

    name = "vllm-cpu"

    def __init__(self, python: str, model: str, dtype: str):
        self.python, self.model, self.dtype = python, model, dtype
        self.worker = str(Path(__file__).with_name("bench_vllm_worker.py"))

    def run_timed(self, prompts, new_tokens, repeats):
        cmd = [
            self.python,
            self.worker,
            "--model",
            self.model,
            "--dtype",
            self.dtype,
            "--new-tokens",
            str(new_tokens),
            "--repeats",
            str(repeats),
        ]
        res = subprocess.run(
            cmd, input=json.dumps(prompts), capture_output=True, text=True, check=True
        )
        line = next(ln for ln in res.stdout.splitlines() if ln.startswith('{"seconds"'))
        result = json.loads(line)
        return result["seconds"], result["outputs"]


def timed(runner, prompts, new_tokens):
    t0 = time.perf_counter()
    out = runner.run(prompts, new_tokens)
    return time.perf_counter() - t0, out


def bench_batch(runners, vllm, prompts, new_tokens, repeats, reference):
    times = {r.name: [] for r in runners}
    outputs = {}
    for rep in range(repeats):  # interleaved: each repeat runs every engine once
        order = runners if rep % 2 == 0 else list(reversed(runners))
        for runner in order:
            seconds, out = timed(runner, prompts, new_tokens)
            times[runner.name].append(seconds)
            outputs[runner.name] = out
    if vllm is not None:
        times[vllm.name], outputs[vllm.name] = vllm.run_timed(prompts, new_tokens, repeats)
    tokens = len(prompts) * new_tokens
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"\n## batch {len(prompts)}: {tokens} output tokens per run, {repeats} repeats")
    for name, med in medians.items():
        same = sum(o == r for o, r in zip(outputs[name], reference, strict=True))
        print(
            f"  {name:14s} median {med:7.3f}s  {tokens / med:8.1f} tok/s  "
            f"token-identical to transformers batch 1: {same}/{len(prompts)}"
        )
    for name, med in medians.items():
        if name != "specd":
            print(f"  specd speed vs {name}: {med / medians['specd']:.2f}x")
    return medians


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/models/demo-target")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu installed")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    hf = TransformersRunner(args.model, args.dtype)
    vocab = hf.model.config.vocab_size
    specd = SpecdRunner(args.model, args.dtype, max(args.batch))
    vllm = VllmRunner(args.vllm_python, args.model, args.dtype) if args.vllm_python else None
    print(
        f"# specd engine benchmark: {args.model} ({args.dtype}), {torch.get_num_threads()} threads"
    )
    try:
        for batch in args.batch:
            prompts = make_prompts(batch, vocab, seed=batch)
            reference = [hf.run([p], args.new_tokens)[0] for p in prompts]
            runners = [specd, hf] + ([TransformersServingRunner(hf)] if batch > 1 else [])
            bench_batch(runners, vllm, prompts, args.new_tokens, args.repeats, reference)
        print(
            f"\nspecd host (scheduler + bookkeeping) share of step time: {specd.host_share():.1%}"
        )
    finally:
        specd.close()


if __name__ == "__main__":
    sys.exit(main())
