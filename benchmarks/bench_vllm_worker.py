"""Time vLLM (CPU build) on token-id prompts; run inside vLLM's own virtualenv.

Reads a JSON list of token-id prompts on stdin and prints one JSON line
``{"seconds": [...], "outputs": [[...], ...]}``: one wall time per repeat of
generating ``--new-tokens`` greedy tokens for all prompts at once.  Called by
bench_engine.py; never imported by specd.
"""

import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    prompts = json.loads(sys.stdin.read())

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(f"{args.model}/config.json") as f:
        max_len = json.load(f)["max_position_embeddings"]
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=max_len,
        gpu_memory_utilization=0.3,  # on CPU: share of node memory for the KV cache
        enforce_eager=True,
        max_num_seqs=max(len(prompts), 1),
        seed=0,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:1], params, use_tqdm=False)  # warm-up
    seconds, outputs = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        results = llm.generate(inputs, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        outputs = [list(r.outputs[0].token_ids) for r in results]
    print(json.dumps({"seconds": seconds, "outputs": outputs}))


if __name__ == "__main__":
    main()
