"""specd's engine (no speculation) against peers on the same checkpoint.

Greedy, token-id prompts, fixed output length.  Every engine runs in its own worker
process (bench_worker.py); runs are interleaved repeat by repeat, medians are
printed as ratios measured in this run, and every run checks that outputs are
token-identical to transformers at batch 1.

    python benchmarks/bench_engine.py --model examples/models/demo-target \\
        [--batch 1 32] [--new-tokens 64] [--repeats 3] [--vllm-python .venv-vllm/bin/python]
    python benchmarks/bench_engine.py --moe [--batch 1 32]

``--moe`` benchmarks a mixture-of-experts target instead: a random Qwen3-MoE checkpoint
(``MOE_SHAPE``: 4 layers of 32 experts, 4 active per token, Qwen3-30B-A3B's ratios at a
CPU-sized width) written offline by ``specd.devtools.tiny_checkpoint`` to a temp folder.

Peers: ``transformers`` ``generate`` on one padded batch and one request at a time
(``transformers-seq``: a server without continuous batching), and, with
``--vllm-python``, vLLM's CPU build from its own virtualenv, its model threads on every
core as specd's (``vllm_env``); with ``--torch-attention``, specd itself on the torch
reference attention (``specd-torch``) beside its default (the C kernel on CPU).  Also
prints the host (scheduler) share of specd's step time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = str(Path(__file__).with_name("bench_worker.py"))


def vllm_env() -> dict[str, str]:
    """vLLM's CPU build, offline; its model threads on every core (as specd's engine and
    the demo SDD's ``resources.cpu``) unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise:
    by default vLLM keeps one core for its scheduler process, one thread of two on a
    2-core VM (there, 929 tok/s at batch 32 on both cores against 756 on one)."""
    every_core = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    return {**every_core, **os.environ, "VLLM_TARGET_DEVICE": "cpu", **offline}


# Qwen3-30B-A3B's layout (experts per token 8 of 128, head_dim 128) at a width a 2-core
# CPU decodes in milliseconds: 32 experts, 4 per token, one dense layer
MOE_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_experts=32,
    num_experts_per_tok=4,
    mlp_only_layers=[3],
    max_position_embeddings=1024,
)


def write_moe_checkpoint(folder: Path) -> str:
    """A random Qwen3-MoE checkpoint of ``MOE_SHAPE`` (with a tokenizer) in ``folder``."""
    from specd.devtools.tiny_checkpoint import make_tiny_checkpoint

    return str(make_tiny_checkpoint(folder, variant="qwen3-moe", **MOE_SHAPE))


def make_prompts(n: int, vocab: int, seed: int, lo: int = 16, hi: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class LineWorker:
    """A process answering one JSON request per line with one JSON reply per line, after
    a first ``{"ready": true}`` line (stderr dropped)."""

    def __init__(self, cmd: list[str], name: str, env: dict[str, str] | None = None):
        self.name = name
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._read()  # {"ready": true}

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name} worker exited with {self.proc.wait()}")

    def request(self, body: dict) -> dict:
        self.proc.stdin.write(json.dumps(body) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


class Worker(LineWorker):
    """One engine in a subprocess (bench_worker.py), answering timed generation requests."""

    def __init__(
        self,
        engine: str,
        python: str,
        model: str,
        dtype: str,
        max_batch: int,
        name: str | None = None,
        spec: str | None = None,
        env: dict[str, str] | None = None,
    ):
        """``env``: the subprocess's environment (default: this one's; vLLM's own)."""
        cmd = [
            python,
            WORKER,
            "--engine",
            engine,
            "--model",
            model,
            "--dtype",
            dtype,
            "--max-batch",
            str(max_batch),
        ] + (["--spec", spec] if spec else [])
        super().__init__(cmd, name or engine, env or (vllm_env() if engine == "vllm" else None))
        self.engine = engine

    def run(self, prompts: list[list[int]], new_tokens: int, in_flight: int | None = None) -> dict:
        """Generate; ``in_flight`` (specd): at most that many requests at a time."""
        held = {"in_flight": in_flight} if in_flight else {}
        return self.request({"prompts": prompts, "new_tokens": new_tokens, **held})


def bench_batch(workers, prompts, new_tokens, repeats, reference):
    for w in workers:  # warm-up, untimed
        w.run(prompts[:2], 4)
    times = {w.name: [] for w in workers}
    outputs, host = {}, None
    for rep in range(repeats):  # interleaved: each repeat runs every engine once
        for w in workers if rep % 2 == 0 else reversed(workers):
            reply = w.run(prompts, new_tokens)
            times[w.name].append(reply["seconds"])
            outputs[w.name] = reply["outputs"]
            host = reply["host_share"] if w.name == "specd" else host
    tokens = len(prompts) * new_tokens
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"\n## batch {len(prompts)}: {tokens} output tokens per run, {repeats} repeats")
    for name, med in medians.items():
        same = sum(o == r for o, r in zip(outputs[name], reference, strict=True))
        print(
            f"  {name:16s} median {med:7.3f}s {tokens / med:8.1f} tok/s   "
            f"token-identical to transformers batch 1: {same}/{len(prompts)}"
        )
    for name, med in medians.items():
        if name != "specd":
            print(f"  specd vs {name}: {med / medians['specd']:.2f}x")
    print(f"  specd host (scheduler, bookkeeping) share of step time: {host:.1%}")
    return medians


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/models/demo-target")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu installed")
    ap.add_argument("--moe", action="store_true", help="a random Qwen3-MoE target (MOE_SHAPE)")
    ap.add_argument(
        "--torch-attention", action="store_true",
        help="also run specd on attentionBackend torch (the reference) as a peer",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.moe:
        with tempfile.TemporaryDirectory(prefix="specd-moe-") as tmp:
            args.model = write_moe_checkpoint(Path(tmp) / "qwen3-moe")
            return run(args)
    return run(args)


def run(args) -> None:
    with open(Path(args.model) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    max_batch = max(args.batch)
    names = ["specd", "transformers", "transformers-seq"] + (["vllm"] if args.vllm_python else [])
    workers = {
        n: Worker(
            n,
            args.vllm_python if n == "vllm" else sys.executable,
            args.model,
            args.dtype,
            max_batch,
        )
        for n in names
    }
    if args.torch_attention:
        workers["specd-torch"] = Worker(
            "specd", sys.executable, args.model, args.dtype, max_batch, name="specd-torch",
            spec=json.dumps({"attentionBackend": "torch"}),
        )  # fmt: skip
    print(f"# specd engine benchmark: {args.model} ({args.dtype}), one process per engine")
    try:
        for batch in args.batch:
            prompts = make_prompts(batch, vocab, seed=batch)
            reference = workers["transformers-seq"].run(prompts, args.new_tokens)["outputs"]
            chosen = [w for n, w in workers.items() if batch > 1 or n != "transformers-seq"]
            bench_batch(chosen, prompts, args.new_tokens, args.repeats, reference)
    finally:
        for w in workers.values():
            w.close()


if __name__ == "__main__":
    sys.exit(main())
