"""One engine in its own process, timing generations for bench_engine.py.

Each engine gets a process of its own so that no two torch thread pools share the
cores (CPU torch runs one OpenMP team per calling thread; two teams halve matmul
speed on small machines).  vLLM runs this file with its own virtualenv's python.

Protocol (one JSON object per line): the worker prints ``{"ready": true}`` once the
model is loaded; for each request ``{"prompts": [[ids...], ...], "new_tokens": N}``
it generates N greedy tokens for every prompt and prints ``{"seconds": wall_time,
"outputs": [[ids...], ...], "host_share": float | null}``.  specd also takes
``"in_flight": C``: at most C requests at a time, the next starting as one ends (a
served load's steady batch, as ``vllm bench serve --max-concurrency``).

    python bench_worker.py --engine specd|transformers|transformers-seq|transformers-pld|vllm \
        --model DIR [--spec JSON]
"""

import argparse
import asyncio
import json
import sys
import time


class Specd:
    """specd's engine, in-process (no Ray), all requests submitted at once."""

    def __init__(self, model, dtype, max_batch, spec=None):
        from specd.workers.config import spec_for_model
        from specd.workers.engine.engine import Engine

        extra = json.loads(spec) if spec else {}
        spec = spec_for_model(model, model={"dtype": dtype}, maxRunningRequests=max_batch, **extra)
        self.engine = Engine(spec, device="cpu")
        self.engine.start()
        self.verify_steps = self.accepted = 0

    def generate(self, prompts, n, in_flight=None):
        from specd.workers.types import GenerateRequest, SamplingParams

        params = SamplingParams(max_tokens=n, ignore_eos=True)

        async def one(i, p, slots):
            out = []
            async with slots:
                request = GenerateRequest(f"b{i}", tuple(p), params)
                async for d in self.engine.generate(request):
                    out += d.token_ids
                    if d.finished and d.usage is not None:
                        self.verify_steps += d.usage.spec_verify_steps
                        self.accepted += d.usage.spec_accepted_tokens
            return out

        async def all_():
            slots = asyncio.Semaphore(in_flight or len(prompts))
            return await asyncio.gather(*(one(i, p, slots) for i, p in enumerate(prompts)))

        return asyncio.run(all_())

    def host_share(self):
        s = self.engine.step_seconds
        return s["host"] / max(s["host"] + s["model"], 1e-9)

    def stats(self):
        """Mean tokens per verify (accepted drafts + bonus), their share by draft
        position, and the mean requests per verify step; None without speculation."""
        from specd.devtools.testing import metric_value

        if not self.verify_steps:
            return None
        by_position = {}
        for family in self.engine.metrics.registry.collect():
            if family.name == "specd_spec_accepted_by_position":
                for sample in family.samples:
                    by_position[int(sample.labels["position"])] = sample.value
        steps = self.verify_steps
        verifies = metric_value(self.engine, "specd_engine_steps_total", kind="verify")
        return {
            "accept_len": (steps + self.accepted) / steps,
            "per_position": [
                by_position.get(i, 0.0) / steps for i in range(1, 1 + max(by_position, default=0))
            ],
            "verify_batch": (
                metric_value(self.engine, "specd_engine_step_requests_total", kind="verify")
                / verifies
            ),
        }


def left_padded(torch, prompts, pad: int):
    """(ids, attention mask) [n, longest]: the prompts left-padded with ``pad``."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


class Transformers:
    """``generate`` on one left-padded static batch (how a script batches)."""

    def __init__(self, model, dtype, max_batch):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def generate(self, prompts, n):
        torch = self.torch
        ids, mask = left_padded(torch, prompts, 0)
        width = ids.shape[1]
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, width:].tolist()

    def host_share(self):
        return None

    def stats(self):
        return None


class TransformersSequential(Transformers):
    """``generate`` one request at a time: a server without continuous batching."""

    def generate(self, prompts, n):
        return [super(TransformersSequential, self).generate([p], n)[0] for p in prompts]


class TransformersPromptLookup(Transformers):
    """transformers' assisted generation with prompt-lookup (n-gram) drafts, one request
    at a time (assisted generation takes batch 1); no draft model needed."""

    def generate(self, prompts, n):
        torch = self.torch
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            with torch.inference_mode():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    eos_token_id=None,
                    pad_token_id=0,
                    prompt_lookup_num_tokens=5,
                )
            outs.append(out[0, len(p) :].tolist())
        return outs


class Vllm:
    """vLLM's offline ``LLM``; with ``spec`` (specd's draft/speculative fields) its EAGLE
    speculative decoding with the same draft folder and chain length."""

    def __init__(self, model, dtype, max_batch, spec=None):
        from vllm import LLM

        with open(f"{model}/config.json") as f:
            max_len = json.load(f)["max_position_embeddings"]
        extra = {}
        if spec:
            fields = json.loads(spec)
            extra["speculative_config"] = {
                "method": "eagle",
                "model": fields["draft"]["path"],
                "num_speculative_tokens": fields["speculative"]["numSteps"],
            }
        self.llm = LLM(
            **extra,
            model=model,
            dtype=dtype,
            max_model_len=max_len,
            enforce_eager=True,
            gpu_memory_utilization=0.3,  # on CPU: share of node memory for the KV cache
            max_num_seqs=max_batch,
            seed=0,
        )

    def generate(self, prompts, n):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        results = self.llm.generate(inputs, params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in results]

    def host_share(self):
        return None

    def stats(self):
        return None


ENGINES = {
    "specd": Specd,
    "transformers": Transformers,
    "transformers-seq": TransformersSequential,
    "transformers-pld": TransformersPromptLookup,
    "vllm": Vllm,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=ENGINES, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--spec", help="specd only: JSON of extra spec fields (draft, speculative)")
    args = ap.parse_args()
    extra = {"spec": args.spec} if args.spec else {}
    engine = ENGINES[args.engine](args.model, args.dtype, args.max_batch, **extra)
    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        held = {"in_flight": req["in_flight"]} if req.get("in_flight") else {}
        outputs = engine.generate(req["prompts"], req["new_tokens"], **held)
        seconds = time.perf_counter() - t0
        reply = {
            "seconds": seconds,
            "outputs": outputs,
            "host_share": engine.host_share(),
            "stats": engine.stats(),
        }
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
