"""Structured output with speculative decoding: guided drafts vs unguided vs no speculation,
and ``transformers`` ``generate`` with xgrammar's own logits processor as the peer.

Every request asks for JSON following one schema (greedy, each to its own end).  Each
contender runs in a worker process of its own (CPU torch keeps one thread team per
calling thread: engines sharing a process measured at half speed), rounds interleaved,
medians printed as ratios:

* ``plain``: specd without speculation, the target's rows masked by the grammar;
* ``unguided``: specd with EAGLE drafts made without the grammar (what a verify-only
  integration does), masked at verify;
* ``guided``: specd with the drafts masked by the grammar too
  (``speculative/guided_draft.py``);
* ``transformers``: one left-padded batch through ``generate`` with
  ``xgrammar.contrib.hf.LogitsProcessor`` (the peer).

All four must emit the same tokens (the grammar and the target decide, not the draft).
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
import sys
import time

import jsonschema
from bench_engine import LineWorker
from bench_worker import left_padded

from specd.devtools.testing import DEMO_EAGLE, DEMO_TARGET, demo_prompts

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
CONTENDERS = ("plain", "unguided", "guided", "transformers")


class SpecdContender:
    """A specd engine (in its worker process), all of a round's requests at once."""

    def __init__(self, kind: str, args):
        from specd.workers.bench_knobs import BenchKnobs
        from specd.workers.config import spec_for_model
        from specd.workers.engine.engine import Engine
        from specd.workers.types import Grammar

        fields = {"model": {"dtype": "float32"}, "kvCache": {"pageSize": 16}}
        if kind != "plain":
            fields["draft"] = {"path": args.draft}
            fields["speculative"] = {
                "numSteps": args.steps,
                "topk": args.topk,
                "numDraftTokens": args.draft_tokens,
                # every batch speculates: the A/B is guided against unguided drafts
                "policy": {"costModel": {"enabled": False}},
            }
        knobs = BenchKnobs(unguided_drafts=kind == "unguided")
        self.engine = Engine(spec_for_model(args.target, **fields), device="cpu", knobs=knobs)
        self.engine.start()
        self.grammar = Grammar("json_schema", json.dumps(SCHEMA), "response_format")
        self.rounds = 0

    def run(self, prompts, max_tokens: int) -> dict:
        from specd.workers.types import GenerateRequest, SamplingParams

        params = SamplingParams(max_tokens=max_tokens, grammar=self.grammar)
        self.rounds += 1

        async def one(i, prompt):
            tokens, text, usage = [], "", None
            request = GenerateRequest(f"r{self.rounds}-{i}", tuple(prompt), params)
            async for delta in self.engine.generate(request):
                tokens += delta.token_ids
                text += delta.text
                usage = delta.usage or usage
            return tokens, text, usage

        async def go():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        t0 = time.perf_counter()
        got = asyncio.run(go())
        return {
            "seconds": time.perf_counter() - t0,
            "outputs": [g[0] for g in got],
            "texts": [g[1] for g in got],
            "steps": sum(u.spec_verify_steps for *_, u in got),
            "accepted": sum(u.spec_accepted_tokens for *_, u in got),
        }


class TransformersContender:
    """``generate`` on one left-padded batch under xgrammar's HF logits processor."""

    def __init__(self, kind: str, args):
        import torch
        import xgrammar as xgr
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.xgr = torch, xgr
        self.tok = AutoTokenizer.from_pretrained(args.target)
        self.model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        self.eos = self.tok.eos_token_id
        vocab = self.model.config.vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            self.tok, vocab_size=vocab, stop_token_ids=[self.eos]
        )
        self.compiler = xgr.GrammarCompiler(info)

    def run(self, prompts, max_tokens: int) -> dict:
        torch, eos = self.torch, self.eos
        ids, mask = left_padded(torch, prompts, eos)
        width = ids.shape[1]
        t0 = time.perf_counter()
        grammar = self.compiler.compile_json_schema(SCHEMA, any_whitespace=False)  # as specd
        processor = self.xgr.contrib.hf.LogitsProcessor([grammar] * len(prompts))
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                logits_processor=[processor],
                eos_token_id=eos,
                pad_token_id=eos,
            )
        seconds = time.perf_counter() - t0
        outputs = [r[: r.index(eos) + 1] if eos in r else r for r in out[:, width:].tolist()]
        texts = [self.tok.decode(o, skip_special_tokens=True) for o in outputs]
        return {"seconds": seconds, "outputs": outputs, "texts": texts, "steps": 0, "accepted": 0}


def worker(kind: str, args) -> None:
    """A contender's process: one JSON request per line in, one reply per line out."""
    contender = (TransformersContender if kind == "transformers" else SpecdContender)(kind, args)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            print(json.dumps(contender.run(req["prompts"], req["max_tokens"])), flush=True)
    finally:
        if isinstance(contender, SpecdContender):
            contender.engine.shutdown()


class Worker(LineWorker):
    """A contender in its own process (this file with ``--worker``)."""

    def __init__(self, kind: str, argv: list[str]):
        super().__init__([sys.executable, __file__, *argv, "--worker", kind], kind)

    def run(self, prompts, max_tokens: int) -> dict:
        return self.request({"prompts": prompts, "max_tokens": max_tokens})


def valid_share(texts) -> float:
    ok = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok / len(texts)


def report(batch: int, repeats: int, times: dict, last: dict) -> None:
    tokens = sum(len(o) for o in last["plain"]["outputs"])
    print(f"\n## batch {batch}: {tokens} output tokens per run, {repeats} repeats")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, reply in last.items():
        same = sum(o == p for o, p in zip(reply["outputs"], last["plain"]["outputs"], strict=True))
        steps = reply["steps"]
        per_verify = f"{(steps + reply['accepted']) / steps:.2f}" if steps else "-"
        print(
            f"  {name:12s} median {medians[name]:6.3f}s {tokens / medians[name]:7.1f} tok/s"
            f"  tokens/verify {per_verify:>5s}  same as plain {same}/{batch}"
            f"  valid JSON {valid_share(reply['texts']):.0%}"
        )
    for a, b in [
        ("guided", "transformers"),
        ("plain", "transformers"),
        ("guided", "unguided"),
        ("guided", "plain"),
        ("unguided", "plain"),
    ]:
        print(f"  {a} vs {b}: {medians[b] / medians[a]:.2f}x")


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
    ap.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args)

    model_argv = [
        *("--target", args.target, "--draft", args.draft, "--steps", str(args.steps)),
        *("--topk", str(args.topk), "--draft-tokens", str(args.draft_tokens)),
    ]
    workers = {kind: Worker(kind, model_argv) for kind in CONTENDERS}
    try:
        for batch in args.batch:
            prompts = demo_prompts(batch, 48)
            for w in workers.values():  # warm-up, untimed (compiles the grammar)
                w.run(prompts[:1], 8)
            times, last = {kind: [] for kind in workers}, {}
            for rep in range(args.repeats):
                order = list(workers) if rep % 2 == 0 else list(reversed(workers))
                for kind in order:
                    last[kind] = workers[kind].run(prompts, args.max_tokens)
                    times[kind].append(last[kind]["seconds"])
            report(batch, args.repeats, times, last)
    finally:
        for w in workers.values():
            w.close()


if __name__ == "__main__":
    main()
