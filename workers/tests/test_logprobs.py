"""Log-probs of generated tokens (``SamplingParams.logprobs``) against the float32
``transformers`` peer, teacher-forced on each run's own text: plain decode, overlap,
CUDA-graph-shaped batches of mixed requests, and speculative chains and paged trees
(where accepted drafts take their log-probs from the verify's tree rows)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from specd.devtools.greedy_judge import GreedyJudge
from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    demo_prompts,
    metric_value,
    random_prompts,
    start_engine,
)
from specd.kernels import available_backends
from specd.workers.model.tokenizer import load_tokenizer
from specd.workers.requests.request import Req
from specd.workers.runner.logprobs import MAX_TOP_LOGPROBS, logprob_tensors, prompt_targets
from specd.workers.types import GenerateRequest, InvalidRequest, SamplingParams

NEW_TOKENS = 24
ATOL = 2e-4  # float32 engine vs float32 transformers (other kernels, other batch shapes)
# bf16 logits stray from float32 by at most 0.10 on the demo target (greedy_judge.py); a
# log-prob adds the log-sum-exp's error, which is of the same size
BF16_LOGPROB_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def peer():
    return GreedyJudge(DEMO_TARGET)


async def _collect(engine, rid, prompt, params):
    tokens, logprobs, last, prompt_logprobs = [], [], None, []
    async for delta in engine.generate(GenerateRequest(rid, tuple(prompt), params)):
        if delta.prompt_logprobs is not None:
            assert not prompt_logprobs, "the prompt's log-probs come once"
            prompt_logprobs = delta.prompt_logprobs
        tokens += delta.token_ids
        if delta.logprobs is not None:
            assert len(delta.logprobs) == len(delta.token_ids), "one log-prob per token"
            logprobs += delta.logprobs
        last = delta
    if params.prompt_logprobs is None:
        assert prompt_logprobs == []
        return tokens, (logprobs if params.logprobs is not None else None), last
    return tokens, logprobs, last, prompt_logprobs


def run_with_logprobs(engine, prompts, params_list):
    async def go():
        return await asyncio.gather(
            *(
                _collect(engine, f"r{i}", p, params)
                for i, (p, params) in enumerate(zip(prompts, params_list, strict=True))
            )
        )

    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


def check_against_peer(peer, prompt, tokens, logprobs, width, atol=ATOL):
    """Each token's log-prob, and the top ``width``, equal the peer's raw distribution."""
    assert len(logprobs) == len(tokens)
    expected = torch.log_softmax(peer.logits(prompt, tokens), dim=-1)
    for i, (token, got) in enumerate(zip(tokens, logprobs, strict=True)):
        assert got.logprob == pytest.approx(expected[i, token].item(), abs=atol), f"token {i}"
        assert len(got.top) == width
        top_ids = [t for t, _ in got.top]
        for token_id, value in got.top:
            assert value == pytest.approx(expected[i, token_id].item(), abs=atol)
        values = [v for _, v in got.top]
        assert values == sorted(values, reverse=True)
        if width:  # the most likely ids: nothing left out beats the last one kept
            rest = expected[i].clone()
            rest[top_ids] = float("-inf")
            assert rest.max().item() <= values[-1] + atol


def mixed_params(temperature=0.0):
    """Three requests in one batch: top 5, the chosen token only, and no log-probs."""
    common = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": temperature, "seed": 7}
    return [
        SamplingParams(logprobs=5, **common),
        SamplingParams(logprobs=0, **common),
        SamplingParams(**common),
    ]


SPEC_LAYOUTS = {
    "plain": {},
    "plain-overlap": {"scheduler": {"overlap": True}},
    "chain": {"speculative": {"numSteps": 4, "topk": 1, "numDraftTokens": 5}},
    "paged-tree-overlap": {
        "kvCache": {"pageSize": 16, "maxTokens": 4096},
        "scheduler": {"overlap": True},
        "speculative": {"numSteps": 3, "topk": 4, "numDraftTokens": 8},
    },
}


def check_layout(peer, layout, temperature, atol=ATOL, device="cpu", **extra):
    """Three mixed requests on an engine of ``layout`` (+ ``extra``), checked against
    ``peer``; a speculative layout must really accept drafts."""
    spec = {**SPEC_LAYOUTS[layout], **extra}
    if "speculative" in spec:
        spec["draft"] = {"path": DEMO_EAGLE}
    engine = start_engine(DEMO_TARGET, device=device, debug={"strictMemCheck": 1}, **spec)
    prompts = demo_prompts(3, 32)
    results = run_with_logprobs(engine, prompts, mixed_params(temperature))
    for (tokens, logprobs, _), prompt, width in zip(results, prompts, (5, 0), strict=False):
        assert len(tokens) == NEW_TOKENS
        check_against_peer(peer, prompt, tokens, logprobs, width, atol)
    assert results[2][1] is None
    if "speculative" in spec:
        assert metric_value(engine, "specd_spec_accepted_tokens_total") > 10


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("layout", list(SPEC_LAYOUTS))
def test_logprobs_are_the_targets_raw_distribution(peer, layout, temperature):
    """Greedy and sampled, plain and speculative: every token's log-prob and top-5 are
    the float32 peer's ``log_softmax`` after the same text (not the draft's, not the
    temperature-scaled one); a request that did not ask gets none."""
    check_layout(peer, layout, temperature)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("triton", "flashinfer"))
@pytest.mark.parametrize("layout", ("plain-overlap", "paged-tree-overlap"))
def test_cuda_backends_give_the_targets_logprobs(backend, layout):
    """On each CUDA backend with graphs: float32 where it computes in float32, else
    bf16 held to ``BF16_LOGPROB_TOLERANCE`` of the float32 peer."""
    caps = available_backends().get(backend)
    if caps is None:
        pytest.fail(f"{backend} is not installed on this CUDA machine (scripts/gpu_check.sh)")
    dtype = "float32" if torch.float32 in caps.dtypes else "bfloat16"
    atol = ATOL * 5 if dtype == "float32" else BF16_LOGPROB_TOLERANCE
    check_layout(
        GreedyJudge(DEMO_TARGET, "cuda"),
        layout,
        0.0,
        atol,
        device="cuda",
        attentionBackend=backend,
        cudaGraph={"maxBatchSize": 4},
        model={"dtype": dtype},
    )


@pytest.mark.slow
def test_graph_batches_carry_logprobs(pair):
    """Decode batches replayed in graph buckets (Triton, interpreted on CPU; 3 requests in
    the bucket of 4) give the same log-probs (tiny model: the interpreter is slow)."""
    engine = start_engine(
        pair[0],
        kvCache={"pageSize": 4, "maxTokens": 4096},
        attentionBackend="triton",
        cudaGraph={"maxBatchSize": 4},
    )
    prompts = random_prompts(3, 300, seed=5)
    params = [dataclasses.replace(p, max_tokens=8) for p in mixed_params(1.0)]
    results = run_with_logprobs(engine, prompts, params)
    assert engine.graphs.replays >= 7
    tiny_peer = GreedyJudge(pair[0])
    for (tokens, logprobs, _), prompt, width in zip(results, prompts, (5, 0), strict=False):
        check_against_peer(tiny_peer, prompt, tokens, logprobs, width)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_prompt_logprobs_score_every_chunk_once(peer, speculative):
    """``prompt_logprobs`` (the gateway's ``echo``): prompt token i's log-prob is the
    peer's after tokens 0..i-1, the first token has none; prompts of 40 and 9 tokens
    prefill in chunks of 16 (rows ending a chunk predict the next chunk's first token)."""
    spec = {"scheduler": {"chunkedPrefillSize": 16}}
    if speculative:
        spec["draft"] = {"path": DEMO_EAGLE}
        spec["speculative"] = {"numSteps": 3, "topk": 1, "numDraftTokens": 4}
    engine = start_engine(DEMO_TARGET, debug={"strictMemCheck": 1}, **spec)
    prompts = [demo_prompts(1, 40)[0], demo_prompts(2, 9)[1]]
    scoring = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2, logprobs=0)
    results = run_with_logprobs(
        engine, prompts + prompts[:1], [scoring, scoring, mixed_params()[2]]
    )
    for (tokens, logprobs, _, prompt_logprobs), prompt in zip(results, prompts, strict=False):
        assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
        check_against_peer(peer, prompt[:1], prompt[1:], list(prompt_logprobs[1:]), 2)
        check_against_peer(peer, prompt, tokens, logprobs, 0)
    assert len(results[2]) == 3  # asked for nothing: no prompt log-probs


def test_prompt_targets_skip_rows_scored_before_a_retraction():
    """A request re-prefilled after a retraction (prompt + output) scores no prompt
    token twice and never scores its output as prompt."""
    req = Req("r", list(range(10, 20)), SamplingParams(prompt_logprobs=0))
    other = Req("o", [1, 2, 3], SamplingParams())
    assert prompt_targets([other, req], [0, 0], [3, 6]) == [(1, 3 + p, 11 + p) for p in range(6)]
    req.prompt_logprobs = [None] * 6  # rows 0..5 scored, then retracted
    req.output_ids = [7, 8]
    assert prompt_targets([req], [0], [12]) == [(0, p, 11 + p) for p in range(6, 9)]


def test_stop_string_cuts_tokens_and_logprobs_together():
    """A stop string completed inside a verify's accepted tokens drops the tokens after
    it, and their log-probs with them."""
    engine = start_engine(
        DEMO_TARGET,
        draft={"path": DEMO_EAGLE},
        speculative={"numSteps": 5, "topk": 1, "numDraftTokens": 6},
    )
    prompt = demo_prompts(1, 32)[0]
    free = start_engine(DEMO_TARGET)
    [(tokens, _, _)] = run_with_logprobs(
        free, [prompt], [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)]
    )
    text = load_tokenizer(DEMO_TARGET).decode(tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, stop=(stop,), logprobs=1)
    [(cut, logprobs, last)] = run_with_logprobs(engine, [prompt], [params])
    assert last.finish_reason.value == "stop"
    assert 0 < len(cut) < NEW_TOKENS
    assert len(logprobs) == len(cut) == last.usage.completion_tokens


def test_logprobs_width_is_checked():
    engine = start_engine(DEMO_TARGET)
    try:
        for bad in (-1, MAX_TOP_LOGPROBS + 1):
            with pytest.raises(InvalidRequest, match=r"^logprobs: must be in \[0, 20\]"):
                engine.validate(GenerateRequest("x", (1, 2), SamplingParams(logprobs=bad)))
            with pytest.raises(InvalidRequest, match=r"^prompt_logprobs: must be in \[0, 20\]"):
                engine.validate(GenerateRequest("x", (1, 2), SamplingParams(prompt_logprobs=bad)))
        turn = GenerateRequest("x", (1, 2), SamplingParams(prompt_logprobs=1), session_id="s")
        with pytest.raises(InvalidRequest, match=r"^prompt_logprobs: a session turn"):
            engine.validate(turn)
    finally:
        engine.shutdown()


def test_logprob_tensors_of_paths_and_rows():
    """The one computation behind both: rows [n, V] and paths [m, L, V]."""
    logits = torch.randn(2, 3, 11)
    tokens = torch.tensor([[4, 0, 10], [1, 2, 3]])
    got = logprob_tensors(logits, tokens, 4)
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(got.chosen, expected.gather(-1, tokens[..., None])[..., 0])
    assert torch.equal(got.top_ids, expected.topk(4, -1).indices)
    flat = logprob_tensors(logits[:, 0], tokens[:, 0], 0)
    assert flat.top_ids.shape == (2, 0)
    rows = flat.token_logprobs([0, 0])
    assert [r[0].logprob for r in rows] == pytest.approx(
        expected[:, 0].gather(-1, tokens[:, :1])[:, 0].tolist()
    )
