"""Where a plain decode step's time goes: device kernel time per step, by kernel family,
against the step's wall time and the weight-read floor (the 8B shape of bench_gpu.py,
random weights, nothing downloaded).

Two profiled runs of the same prompts differ only in the number of new tokens (``--short``
and ``--long``); their difference is pure decode, so prefill and warm-up drop out:
per step = (long - short) / (long tokens - short tokens).  Kernel families are read off
kernel names (GEMM, attention, fused elementwise, sampling, copies, other); the table
names the heaviest kernels.  On CPU there are no kernels: only the wall time is measured
(a smoke run).

    python benchmarks/profile_decode.py [--backend triton] [--batch 1] [--graphs on|off]
        [--overlap on|off] [--short 16 --long 80] [--shape 8b|tiny] [--device cuda|cpu]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402  (a sibling script, not a package)

FAMILIES = (  # first match wins; read off kernel names of cuBLAS, Triton, flashinfer, torch
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|matmul|splitk"),
    ("attention", r"attention|attn|prefill|extend|decode|flashinfer|paged"),
    ("elementwise", r"rms|norm|silu|rotary|rope|act_and_mul"),
    ("sampling", r"argmax|argsort|topk|sort|softmax|reduce|max_|cumsum"),
    ("copies", r"copy|memcpy|memset|index|scatter|gather|cat|fill|move_kv|req_to_token"),
)
TOP_KERNELS = 12


def family(kernel: str) -> str:
    """The family of FAMILIES whose pattern the kernel's name matches first, or "other"."""
    low = kernel.lower()
    return next((name for name, pattern in FAMILIES if re.search(pattern, low)), "other")


def kernel_seconds(prof) -> dict[str, tuple[float, int]]:
    """Device kernel name -> (seconds, launches) in ``prof``."""
    out = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        us = evt.self_cuda_time_total if us is None else us
        if evt.device_type == torch.autograd.DeviceType.CUDA and us > 0:
            out[evt.key] = (us / 1e6, evt.count)
    return out


def profiled_run(engine, prompts, new_tokens: int, args, tag: str):
    """-> (kernel seconds by name, wall seconds) of one run of ``prompts``; CUPTI sees the
    kernels of every thread, the engine loop's and graph replays' included (on CPU: no
    kernels, only the wall time)."""
    if not args.device.startswith("cuda"):
        return {}, bench_gpu.run_once(engine, prompts, new_tokens, args, tag)[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall, _ = bench_gpu.run_once(engine, prompts, new_tokens, args, tag)
    return kernel_seconds(prof), wall


def per_step(short: dict, long: dict, steps: int) -> dict[str, tuple[float, float]]:
    """name -> (ms per decode step, launches per step) from the two runs' difference."""
    out = {}
    for name in long.keys() | short.keys():
        (s_long, n_long), (s_short, n_short) = long.get(name, (0, 0)), short.get(name, (0, 0))
        out[name] = (1e3 * (s_long - s_short) / steps, (n_long - n_short) / steps)
    return out


def report(args, floor_ms: float, kernels: dict, wall_ms: float) -> dict:
    families = defaultdict(float)
    for name, (ms, _) in kernels.items():
        families[family(name)] += ms
    busy = sum(families.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {
        "backend": args.backends[0],
        "batch": args.batch[0],
        "graphs": args.graphs,
        "overlap": args.overlap,
        "wall_ms_per_step": wall_ms,
        "kernel_ms_per_step": busy,
        "floor_ms": floor_ms,
        "families_ms": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": n, "ms": ms, "launches": c} for n, (ms, c) in top],
    }


def print_report(r: dict) -> None:
    print(
        f"# {r['backend']} batch {r['batch']}, graphs {r['graphs']}, overlap {r['overlap']}: "
        f"wall {r['wall_ms_per_step']:.2f} ms/step, kernels {r['kernel_ms_per_step']:.2f} "
        f"ms/step, weight-read floor {r['floor_ms']:.2f} ms"
    )
    for name, ms in r["families_ms"].items():
        print(f"  {name:12s} {ms:7.3f} ms/step  ({ms / max(r['wall_ms_per_step'], 1e-9):.0%})")
    print("| kernel | ms/step | launches/step |\n| --- | --- | --- |")
    for k in r["top_kernels"]:
        print(f"| {k['name'][:90]} | {k['ms']:.3f} | {k['launches']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=None, help="default: the first of bench_gpu's")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--graphs", choices=("on", "off"), default="on")
    ap.add_argument("--overlap", choices=("on", "off"), default="off")
    ap.add_argument("--short", type=int, default=16, help="new tokens of the short run")
    ap.add_argument("--long", type=int, default=80, help="new tokens of the long run")
    ap.add_argument("--shape", choices=bench_gpu.SHAPES, default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path)
    own = ap.parse_args(argv)
    if own.long <= own.short:
        ap.error("--long must be more new tokens than --short")
    args = bench_gpu.parse_args(
        ["--shape", own.shape, "--device", own.device, "--batch", str(own.batch),
         "--graphs", own.graphs, "--overlap", own.overlap, "--new-tokens", str(own.long)]
        + (["--backends", own.backend] if own.backend else [])
    )  # fmt: skip
    args.backends = args.backends[:1]
    with tempfile.TemporaryDirectory(prefix="specd-profile-") as tmp:
        target, _ = bench_gpu.write_folders(Path(tmp), bench_gpu.SHAPES[args.shape], args.dtype)
        weight_bytes = bench_gpu.decode_weight_bytes(target, args.dtype)
        floor_ms = 1e3 * weight_bytes / bench_gpu.measure_bandwidth(args.device)
        engine = bench_gpu.make_engine(args, target, None, args.backends[0])
        try:
            prompts = bench_gpu.make_prompts(
                own.batch, args.prompt_len, engine.model_config.vocab_size
            )
            bench_gpu.run_once(engine, prompts, own.short, args, "warm")
            short, short_wall = profiled_run(engine, prompts, own.short, args, "short")
            long, long_wall = profiled_run(engine, prompts, own.long, args, "long")
        finally:
            engine.shutdown()
    steps = own.long - own.short
    r = report(args, floor_ms, per_step(short, long, steps), 1e3 * (long_wall - short_wall) / steps)
    print_report(r)
    if own.json:
        own.json.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
