"""Speculative decoding at a forced acceptance on a Llama-3.1-8B shape, per attention backend.

An 8B-shape Llama (Llama-3.1-8B dims, llama3 rope) with random weights and an EAGLE-3-shape
head (one layer, same attention dims, draft vocab 32000, fusing three target layers): only
config.json files and an offline WordLevel tokenizer are written to a temp dir, nothing is
downloaded.  Engines run in-process, one at a time, with the benchmark-only knobs
(``specd.workers.bench_knobs``): ``dummy_weights`` (random weights made on the
device, seconds for 8B) and ``force_accept_len`` (each verify accepts a drawn number of
drafts along the first-child chain, mean tokens per verify incl. the bonus = --accept-len).

Per backend and batch: tokens/s without and with speculation (untimed warm-up, then
--repeats timed runs of --new-tokens per request with ignore_eos, medians), the speedup
(goal >= 2.36x at batch 1 with accept len 4: SGLang's published EAGLE-3 ratio on an
H100) and the measured accept length (from usage).  Plain decode at batch 1 against the
weight-read floor: target weight bytes one decode step reads / device memory bandwidth
measured by a large device-to-device copy (goal: within 1.2x of the floor).
``--elementwise eager`` keeps RMSNorm, SiLU-and-mul and RoPE as eager ops on CUDA (the
``eager_elementwise`` knob): the A/B of their one-launch Triton kernels.
``--dtype fp8`` makes the target an FP8 checkpoint in the published block-wise layout
(``quantization_config`` fp8, ``weight_block_size`` [128, 128]; bf16 activations,
embeddings, norms and LM head): the decoder's linears are read as one byte per weight
plus their block scales, so the weight-read floor drops to about 55% of bf16's at the
8B shape (the LM head and the draft stay bf16).  Run it beside ``--dtype bfloat16`` on
the same machine to compare decode steps.

    python benchmarks/bench_gpu.py [--shape 8b|tiny] [--device cuda|cpu] [--backends torch ...]
        [--batch 1 32] [--accept-len 4] [--steps 3 --topk 1 --draft-tokens 4]
        [--new-tokens 128] [--prompt-len 128] [--repeats 3] [--overlap on|off]
        [--elementwise fused|eager] [--dtype bfloat16|fp8] [--spec on|off] [--json OUT.json]

Tokens/s include each run's prefill (one --prompt-len prompt per request); ms/token is
decode only (first to last token of a request).  On a tree (--topk > 1) the forced walk
is clamped to the first-child chain's depth, so the measured accept length may fall
short of --accept-len; the table shows it.  A failing backend is reported and skipped;
--json is rewritten after every backend, so a run cut short keeps what it measured.

Budget: the default 8b run should take one to two minutes per backend on one H100, well
under 10 minutes in all (estimated, not yet measured on a GPU: two engines per backend of
~17 GB each, initialised in seconds, KV pool sized to the largest batch through
kvCache.maxTokens; eager decode at this size is bound by ~10-15 ms of host work per step
at batch 1, ~50 ms at batch 32, judging by a 32-layer model of tiny width on CPU).  CPU
smoke run, seconds: ``--shape tiny --device cpu --batch 1 2 --new-tokens 8``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specd.kernels import available_backends
from specd.kernels.registry import missing_backends
from specd.workers.bench_knobs import BenchKnobs
from specd.workers.config import spec_for_model
from specd.workers.engine.engine import Engine
from specd.workers.mem_cache.sizing import SpecShape, row_width
from specd.workers.model.config import load_model_config
from specd.workers.model.llama import LlamaForCausalLM
from specd.workers.types import GenerateRequest, SamplingParams

SPEEDUP_GOAL = 2.36  # SGLang's EAGLE-3 speedup on an H100 at batch 1, accept length ~4
FLOOR_GOAL = 1.2  # plain decode step / weight-read floor
BOS, EOS, UNK = "<s>", "</s>", "<unk>"


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    rope_theta: float
    llama3_rope: bool
    max_positions: int


SHAPES = {
    "8b": Shape(4096, 32, 32, 8, 128, 14336, 128256, 32000, 500000.0, True, 131072),
    "tiny": Shape(128, 8, 4, 2, 32, 256, 1024, 256, 10000.0, False, 4096),
}


@dataclass(frozen=True)
class Timing:
    """One engine at one batch size: medians over the timed runs."""

    tok_s: float  # output tokens / wall time, prefill included
    ms_per_token: float  # per request: (last token - first token) / (tokens - 1)
    accept_len: float | None  # tokens per verify incl. the bonus (None: plain decode)
    host_share: float  # the engine loop's time outside the model
    retractions: int
    wall_ms: float = 0.0  # a run: the first request sent to the last finished
    busy_ms: float = 0.0  # of which the engine loop ran steps (host + model), mean
    last_first_token_ms: float = 0.0  # the batch's latest first token, from the start


# -- checkpoint folders (config only) -------------------------------------------------
FP8_BLOCK = [128, 128]  # the published block-wise FP8 layout (Qwen, DeepSeek)


def model_dtype(dtype: str) -> str:
    """The activation dtype: ``fp8`` checkpoints compute in bfloat16."""
    return "bfloat16" if dtype == "fp8" else dtype


def target_config(shape: Shape, dtype: str) -> dict:
    """``dtype`` ``fp8``: a bf16 checkpoint whose decoder linears are block-wise FP8."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": model_dtype(dtype),
    }
    if dtype == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": FP8_BLOCK,
        }
    if shape.llama3_rope:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return config


def eagle3_config(shape: Shape, dtype: str) -> dict:
    """An EAGLE-3 head for the target: one layer, same attention dims, reduced vocab."""
    return {
        **target_config(shape, model_dtype(dtype)),
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": shape.draft_vocab,
    }


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer covering every id (``t<i>``), built offline."""
    vocab = {BOS: 0, EOS: 1, UNK: 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    fast.save_pretrained(folder)


def write_folders(root: Path, shape: Shape, dtype: str) -> tuple[Path, Path]:
    """(target folder, EAGLE-3 folder): config.json (+ tokenizer for the target), no weights."""
    target, draft = root / "target", root / "eagle3"
    for folder, config in ((target, target_config), (draft, eagle3_config)):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config(shape, dtype), indent=2))
    write_tokenizer(target, shape.vocab)
    return target, draft


# -- the floor ---------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def seconds(fn, device: str) -> float:
    """Wall time of ``fn()`` on ``device`` (CUDA events on a GPU)."""
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure_bandwidth(device: str, repeats: int = 10) -> float:
    """Bytes/s of a large device copy (bytes read + written), median of ``repeats``."""
    nbytes = (1 << 30) if device.startswith("cuda") else (1 << 28)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    sync(device)
    times = [seconds(functools.partial(dst.copy_, src), device) for _ in range(repeats)]
    return 2 * nbytes / statistics.median(times)


def decode_weight_bytes(target: Path, dtype: str) -> int:
    """Target weight bytes one decode step reads: every tensor but the embedding table
    (a step reads only its own rows; a tied lm_head still counts once).  ``fp8``: decoder
    linears at one byte per weight plus a float32 scale per 128x128 block."""
    with torch.device("meta"):
        model = LlamaForCausalLM(load_model_config(target))
    wide = torch.empty((), dtype=getattr(torch, model_dtype(dtype))).element_size()
    read: dict[int, int] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name == "model.embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue
        if dtype == "fp8" and name.startswith("model.layers.") and t.dim() == 2:
            blocks = -(-t.shape[0] // FP8_BLOCK[0]) * -(-t.shape[1] // FP8_BLOCK[1])
            read[id(t)] = t.numel() + 4 * blocks
        else:
            read[id(t)] = t.numel() * wide
    return sum(read.values())


# -- engines -----------------------------------------------------------------------------
def engine_settings(args, draft: Path | None, backend: str) -> tuple[dict, BenchKnobs]:
    """The SDD spec fields (less ``model.path``) and benchmark knobs of the engine this
    benchmark times: plain when ``draft`` is None."""
    max_batch = max(args.batch)
    context = args.prompt_len + args.new_tokens + args.page_size
    shape = SpecShape(args.steps, args.topk, args.draft_tokens) if draft else None
    fields = dict(
        model={"dtype": model_dtype(args.dtype), "contextLength": context},
        kvCache={
            "pageSize": args.page_size,
            "maxTokens": max_batch * row_width(context, shape, args.page_size),
        },
        maxRunningRequests=max_batch,
        attentionBackend=backend,
        cudaGraph={"enabled": args.graphs == "on", "maxBatchSize": max_batch},
        # every prompt in one prefill chunk: decode timing starts with no prefill pending
        scheduler={
            "overlap": args.overlap == "on",
            "chunkedPrefillSize": max_batch * args.prompt_len,
        },
    )
    if draft is not None:
        fields["draft"] = {"path": str(draft), "algorithm": "EAGLE3"}
        fields["speculative"] = {
            "numSteps": args.steps,
            "topk": args.topk,
            "numDraftTokens": args.draft_tokens,
            # every batch speculates: this times the verify path at a chosen acceptance
            # (whether speculating pays per batch is bench_spec.py's question)
            "policy": {"costModel": {"enabled": False}},
        }
    knobs = BenchKnobs(
        dummy_weights=True,
        force_accept_len=args.accept_len if draft else None,
        eager_elementwise=args.elementwise == "eager",
    )
    return fields, knobs


def make_engine(args, target: Path, draft: Path | None, backend: str) -> Engine:
    fields, knobs = engine_settings(args, draft, backend)
    engine = Engine(spec_for_model(str(target), **fields), device=args.device, knobs=knobs)
    engine.start()
    return engine


def release_device_memory() -> None:
    """After an engine is shut down and dropped: give its memory back before the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


async def _one(engine: Engine, rid: str, prompt: list[int], new_tokens: int):
    """-> (first token time, last token time, tokens, usage)."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    first, count, usage = None, 0, None
    async for delta in engine.generate(GenerateRequest(rid, tuple(prompt), params)):
        if delta.error:
            raise RuntimeError(f"{rid}: {delta.error}")
        if delta.token_ids and first is None:
            first = time.perf_counter()
        count += len(delta.token_ids)
        usage = delta.usage or usage
    return first, time.perf_counter(), count, usage


def run_once(engine: Engine, prompts: list[list[int]], new_tokens: int, args, tag: str):
    """All prompts at once -> (wall seconds, per-request results), each request's times
    counted from the start."""

    async def all_():
        runs = (_one(engine, f"{tag}-{i}", p, new_tokens) for i, p in enumerate(prompts))
        async with asyncio.timeout(args.run_timeout):
            return await asyncio.gather(*runs)

    sync(args.device)
    t0 = time.perf_counter()
    results = asyncio.run(all_())
    sync(args.device)
    return time.perf_counter() - t0, [(first - t0, end - t0, n, u) for first, end, n, u in results]


def warm_up_tokens(args) -> int:
    """Output tokens per request of the untimed run before a batch's timed ones."""
    return min(args.new_tokens, 16)


def accept_length(verify_steps: int, accepted: int) -> float | None:
    """Mean tokens per verify, the bonus included (None: no verify)."""
    return (verify_steps + accepted) / verify_steps if verify_steps else None


def time_batch(engine: Engine, prompts: list[list[int]], args, tag: str) -> Timing:
    run_once(engine, prompts, warm_up_tokens(args), args, f"{tag}-warm")
    before = dict(engine.step_seconds)
    walls, per_token, firsts, steps, accepted = [], [], [], 0, 0
    for rep in range(args.repeats):
        wall, results = run_once(engine, prompts, args.new_tokens, args, f"{tag}-{rep}")
        walls.append(wall)
        firsts.append(max(first for first, *_ in results))
        for first, end, count, usage in results:
            per_token.append((end - first) / max(count - 1, 1))
            steps += usage.spec_verify_steps
            accepted += usage.spec_accepted_tokens
    host = engine.step_seconds["host"] - before["host"]
    model = engine.step_seconds["model"] - before["model"]
    return Timing(
        tok_s=len(prompts) * args.new_tokens / statistics.median(walls),
        ms_per_token=1e3 * statistics.median(per_token),
        accept_len=accept_length(steps, accepted),
        host_share=host / max(host + model, 1e-9),
        retractions=engine.status().retractions,
        wall_ms=1e3 * statistics.median(walls),
        busy_ms=1e3 * (host + model) / args.repeats,
        last_first_token_ms=1e3 * statistics.median(firsts),
    )


def time_engine(args, target: Path, draft: Path | None, backend: str) -> dict[int, Timing]:
    """One engine (plain when ``draft`` is None), every batch size; shut down after."""
    tag = f"{backend}-{'spec' if draft else 'plain'}"
    t0 = time.perf_counter()
    engine = make_engine(args, target, draft, backend)
    graphs = engine.status().cuda_graphs.model_dump()
    progress(
        f"[{tag}] engine ready in {time.perf_counter() - t0:.1f} s; CUDA graphs "
        f"{graphs['mode']} ({graphs.get('reason') or graphs.get('capture_seconds')})"
    )
    try:
        vocab, timings = engine.model_config.vocab_size, {}
        for batch in args.batch:
            prompts = make_prompts(batch, args.prompt_len, vocab)
            timings[batch] = t = time_batch(engine, prompts, args, f"{tag}-b{batch}")
            accept = f", accept len {t.accept_len:.2f}" if t.accept_len else ""
            progress(
                f"[{tag}] batch {batch}: {t.tok_s:.1f} tok/s, {t.ms_per_token:.2f} ms/token"
                f"{accept}, host share {t.host_share:.0%}, retractions {t.retractions}"
            )
        return timings
    finally:
        engine.shutdown()


def run_backend(args, target: Path, draft: Path, backend: str) -> list[dict]:
    """Plain, then (unless ``--spec off``) speculative engine on ``backend``, each freed
    before the next."""
    plain = time_engine(args, target, None, backend)
    release_device_memory()
    spec = time_engine(args, target, draft, backend) if args.spec == "on" else {}
    release_device_memory()
    return [
        {
            "backend": backend,
            "batch": batch,
            "plain_tok_s": plain[batch].tok_s,
            "spec_tok_s": spec[batch].tok_s if spec else None,
            "speedup": spec[batch].tok_s / plain[batch].tok_s if spec else None,
            "accept_len": spec[batch].accept_len if spec else None,
            "plain": asdict(plain[batch]),
            "spec": asdict(spec[batch]) if spec else None,
        }
        for batch in args.batch
    ]


def progress(line: str) -> None:
    print(line, flush=True)


# -- report ------------------------------------------------------------------------------
def number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[dict]) -> None:
    print(
        "| backend | batch | plain tok/s | spec tok/s | speedup | accept len "
        "| plain ms/token | spec ms/token | host share plain / spec |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        p, s = r["plain"], r["spec"] or {}
        print(
            f"| {r['backend']} | {r['batch']} | {r['plain_tok_s']:.1f} "
            f"| {number(r['spec_tok_s'], '.1f')} | {number(r['speedup'], '.2f')}"
            f"{'' if r['speedup'] is None else 'x'} "
            f"| {accept_text(r)} | {p['ms_per_token']:.2f} "
            f"| {number(s.get('ms_per_token'), '.2f')} | {p['host_share']:.0%} / "
            f"{number(s.get('host_share'), '.0%')} |"
        )


def goals(rows: list[dict], floor_ms: float, accept_len: float) -> list[dict]:
    """Per backend, from its batch-1 row: plain decode step vs the floor, and the
    speculation speedup (judged only at accept len 4, the goal's setting)."""
    return [
        {
            "backend": r["backend"],
            "decode_step_ms": r["plain"]["ms_per_token"],
            "floor_ms": floor_ms,
            "floor_ratio": r["plain"]["ms_per_token"] / floor_ms,
            "floor_goal_met": r["plain"]["ms_per_token"] / floor_ms <= FLOOR_GOAL,
            "speedup": r["speedup"],
            "accept_len": r["accept_len"],
            "speedup_goal_met": (
                r["speedup"] >= SPEEDUP_GOAL
                if accept_len == 4 and r["speedup"] is not None
                else None
            ),
        }
        for r in rows
        if r["batch"] == 1
    ]


def accept_text(row: dict) -> str:
    """The measured accept length, or "-" when the spec engine verified nothing."""
    return "-" if row["accept_len"] is None else f"{row['accept_len']:.2f}"


def print_goals(goal_rows: list[dict]) -> None:
    for g in goal_rows:
        print(
            f"{g['backend']}: decode step {g['decode_step_ms']:.2f} ms, floor "
            f"{g['floor_ms']:.2f} ms, ratio {g['floor_ratio']:.2f} (goal <= {FLOOR_GOAL})"
        )
        if g["speedup"] is not None:
            print(
                f"{g['backend']}: speculation {g['speedup']:.2f}x at batch 1, accept len "
                f"{accept_text(g)} (goal >= {SPEEDUP_GOAL} at accept len 4)"
            )


# -- main --------------------------------------------------------------------------------
def default_backends(device: str, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Every registered backend that runs on ``device`` in ``dtype`` with heads of
    ``head_dim`` (flashinfer: 64, 128 or 256; the tiny shape's are 32)."""
    kind = device.split(":")[0]
    return [
        name
        for name, caps in available_backends().items()
        if kind in caps.devices and dtype in caps.dtypes and caps.runs_head_dims([head_dim])
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="8b")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "fp8"),
        help="default: bfloat16 on cuda, float32 on cpu; fp8: block-wise FP8 target weights",
    )
    ap.add_argument("--backends", nargs="+", help="default: every backend on the device")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--accept-len", type=float, default=4.0, help="tokens per verify incl. bonus")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--graphs", choices=("on", "off"), default="on", help="spec.cudaGraph.enabled")
    ap.add_argument(
        "--overlap", choices=("on", "off"), default="off", help="spec.scheduler.overlap"
    )
    ap.add_argument(
        "--elementwise",
        choices=("fused", "eager"),
        default="fused",
        help="RMSNorm / SiLU-and-mul / RoPE: one Triton launch each on CUDA, or eager ops",
    )
    ap.add_argument("--spec", choices=("on", "off"), default="on", help="off: plain decode only")
    ap.add_argument("--run-timeout", type=float, default=120, help="seconds per timed run")
    ap.add_argument("--json", type=Path, help="write every number here (after each backend)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.backends = args.backends or default_backends(
        args.device, getattr(torch, model_dtype(args.dtype)), SHAPES[args.shape].head_dim
    )
    if args.accept_len - 1 > args.steps:
        progress(f"# note: accept len {args.accept_len} > steps + 1: clamped to {args.steps + 1}")
    return args


def header(args, report: dict) -> None:
    print(f"# {args.shape} target ({args.dtype}) + EAGLE-3 head on {report['device']}")
    print(
        f"# backends {args.backends}; steps {args.steps} topk {args.topk} draft tokens "
        f"{args.draft_tokens}; forced accept len {args.accept_len}; prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {args.repeats} repeats, CUDA graphs {args.graphs}, "
        f"overlap {args.overlap}, elementwise {args.elementwise}"
    )
    for name, why in missing_backends().items():
        print(f"# {name} is not installed here: {why}")
    print(
        f"# memory bandwidth {report['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s; a decode step "
        f"reads {report['weight_bytes'] / 1e9:.3f} GB of weights; floor "
        f"{report['floor_ms']:.3f} ms",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    on_cuda = args.device.startswith("cuda")
    report = {
        "device": torch.cuda.get_device_name(args.device) if on_cuda else "cpu",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shape": asdict(SHAPES[args.shape]),
        "bandwidth_bytes_per_s": measure_bandwidth(args.device),
        "rows": [],
        "goals": [],
        "errors": {},
    }
    with tempfile.TemporaryDirectory(prefix="specd-bench-") as tmp:
        target, draft = write_folders(Path(tmp), SHAPES[args.shape], args.dtype)
        report["weight_bytes"] = decode_weight_bytes(target, args.dtype)
        report["floor_ms"] = 1e3 * report["weight_bytes"] / report["bandwidth_bytes_per_s"]
        header(args, report)
        for backend in args.backends:
            try:
                report["rows"] += run_backend(args, target, draft, backend)
            except Exception as err:  # one failing backend must not lose the others' numbers
                traceback.print_exc()
                report["errors"][backend] = f"{type(err).__name__}: {err}"
            release_device_memory()  # here, once the traceback's frames are gone
            report["goals"] = goals(report["rows"], report["floor_ms"], args.accept_len)
            report["seconds"] = time.perf_counter() - started
            if args.json:
                args.json.write_text(json.dumps(report, indent=2))
    print_table(report["rows"])
    print_goals(report["goals"])
    print(f"# total {report['seconds']:.0f} s; errors: {report['errors'] or 'none'}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
