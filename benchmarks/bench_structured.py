"""Structured output with speculative decoding: guided drafts vs unguided vs no speculation.

Every request asks for JSON following one schema (greedy, each to its own end).  Three
specd engines on the demo pair, in one process, interleaved repeats, medians printed as
ratios:

* ``plain``: no speculation, the target's rows masked by the grammar;
* ``unguided``: EAGLE drafts made without the grammar (what a verify-only integration
  does), masked at verify;
* ``guided``: the drafts masked by the grammar too (``speculative/guided_draft.py``).

All three must emit the same tokens (the grammar and the target decide, not the draft).
Also prints tokens per verify (bonus included) and the share of outputs that parse and
validate against the schema.

    python benchmarks/bench_structured.py [--target examples/models/demo-target]
        [--draft examples/models/demo-eagle] [--batch 1 8] [--max-tokens 96] [--repeats 3]
        [--steps 5] [--topk 1] [--draft-tokens 6]   (the demo's chain; --topk 4 for a tree)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import jsonschema

from specd.workers.config import spec_for_model
from specd.workers.engine.bench_knobs import BenchKnobs
from specd.workers.engine.engine import Engine
from specd.workers.engine.types import GenerateRequest, Grammar, SamplingParams
from specd.workers.testing import DEMO_EAGLE, DEMO_TARGET, demo_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "function": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["method", "function", "class"]},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "returns_value": {"type": "boolean"},
    },
    "required": ["function", "kind", "arguments", "returns_value"],
}
GRAMMAR = Grammar("json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema")


def start(target: str, draft: str | None, args, knobs: BenchKnobs = BenchKnobs()) -> Engine:
    fields = {"model": {"dtype": "float32"}, "kvCache": {"pageSize": 16}}
    if draft is not None:
        fields["draft"] = {"path": draft}
        fields["speculative"] = {
            "numSteps": args.steps,
            "topk": args.topk,
            "numDraftTokens": args.draft_tokens,
        }
    engine = Engine(spec_for_model(target, **fields), device="cpu", knobs=knobs)
    engine.start()
    return engine


def run_round(engine: Engine, prompts, max_tokens: int, tag: str):
    """-> (seconds, outputs, texts, verify steps, accepted drafts)."""
    params = SamplingParams(max_tokens=max_tokens, grammar=GRAMMAR)

    async def one(i, prompt):
        tokens, text, usage = [], "", None
        request = GenerateRequest(f"{tag}{i}", tuple(prompt), params)
        async for delta in engine.generate(request):
            tokens += delta.token_ids
            text += delta.text
            usage = delta.usage or usage
        return tokens, text, usage

    async def go():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    t0 = time.perf_counter()
    got = asyncio.run(go())
    seconds = time.perf_counter() - t0
    steps = sum(u.spec_verify_steps for *_, u in got)
    accepted = sum(u.spec_accepted_tokens for *_, u in got)
    return seconds, [g[0] for g in got], [g[1] for g in got], steps, accepted


def valid_share(texts) -> float:
    ok = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok / len(texts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO_TARGET))
    ap.add_argument("--draft", default=str(DEMO_EAGLE))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, default=6)
    args = ap.parse_args(argv)

    engines = {
        "plain": start(args.target, None, args),
        "unguided": start(args.target, args.draft, args, BenchKnobs(unguided_drafts=True)),
        "guided": start(args.target, args.draft, args),
    }
    try:
        for batch in args.batch:
            prompts = demo_prompts(batch, 48)
            for name, engine in engines.items():  # warm-up, untimed (compiles the grammar)
                run_round(engine, prompts[:1], 8, f"w{name}{batch}-")
            times = {name: [] for name in engines}
            last = {}
            for rep in range(args.repeats):
                order = list(engines) if rep % 2 == 0 else list(reversed(engines))
                for name in order:
                    got = run_round(
                        engines[name], prompts, args.max_tokens, f"{name}{batch}-{rep}-"
                    )
                    times[name].append(got[0])
                    last[name] = got
            tokens = sum(len(o) for o in last["plain"][1])
            print(f"\n## batch {batch}: {tokens} output tokens per run, {args.repeats} repeats")
            medians = {name: statistics.median(ts) for name, ts in times.items()}
            for name, (_, outputs, texts, steps, accepted) in last.items():
                same = sum(o == p for o, p in zip(outputs, last["plain"][1], strict=True))
                per_verify = f"{(steps + accepted) / steps:.2f}" if steps else "-"
                print(
                    f"  {name:9s} median {medians[name]:6.3f}s {tokens / medians[name]:7.1f} tok/s"
                    f"  tokens/verify {per_verify:>5s}  same as plain {same}/{batch}"
                    f"  valid JSON {valid_share(texts):.0%}"
                )
            print(f"  guided vs unguided: {medians['unguided'] / medians['guided']:.2f}x")
            print(f"  guided vs plain:    {medians['plain'] / medians['guided']:.2f}x")
            print(f"  unguided vs plain:  {medians['plain'] / medians['unguided']:.2f}x")
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
