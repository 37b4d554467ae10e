"""Logits processors (``logit_bias``, ``min_tokens``, repetition / frequency / presence
penalties) and min-p, against ``transformers``: greedy output equals its greedy output
under the same processors token for token, in plain decode, overlap, speculative chains
and paged trees, with requests that ask for nothing sharing the batch; a verify's tree
rows are processed as plain decode would process them after each node's path."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    collect,
    demo_prompts,
    metric_value,
    request_held_tokens,
    run_all,
    start_engine,
    start_spec_engine,
)
from specd.workers.requests.request import Req
from specd.workers.runner.logits_processors import (
    LogitsProcessors,
    check_processor_params,
    path_counts,
    processes_logits,
)
from specd.workers.runner.sampling import filtered_probs
from specd.workers.speculative.tree import build_tree, expand_step, first_step
from specd.workers.types import FinishReason, InvalidRequest, SamplingParams

NEW_TOKENS = 24
EOS = 1  # the demo target's


class OutputPenalties(LogitsProcessor):
    """OpenAI's frequency / presence penalties, recounted from the whole output each step."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, out, torch.ones_like(out, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def peer_processors(prompt_len: int, p: SamplingParams) -> LogitsProcessorList:
    """``transformers`` processors doing what ``p`` asks, in the engine's order."""
    procs = []
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias]))
    if p.min_tokens:
        held = list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, held))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.frequency_penalty or p.presence_penalty:
        procs.append(OutputPenalties(prompt_len, p.frequency_penalty, p.presence_penalty))
    return LogitsProcessorList(procs)


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)


def peer_greedy(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    """transformers' greedy output under ``p``'s processors, ending at a stop token id."""
    ids = torch.tensor([prompt])
    stops = list(p.stop_token_ids)
    gen = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=p.max_tokens,
        logits_processor=peer_processors(len(prompt), p),
        eos_token_id=stops or None,
        pad_token_id=0,
    )
    out = gen[0, len(prompt) :].tolist()
    ends = [i for i, t in enumerate(out) if t in stops]
    return out[: ends[0] + 1] if ends else out


# -- the rules, row by row ------------------------------------------------------


def _req(prompt=(5, 6, 7), output=(), **params) -> Req:
    req = Req("r", list(prompt), SamplingParams(max_tokens=64, **params))
    req.output_ids = list(output)
    return req


PROCESSED = dict(
    repetition_penalty=1.7,
    frequency_penalty=0.8,
    presence_penalty=-0.5,
    logit_bias=((3, 4.0), (9, -2.5)),
    min_tokens=5,
    stop_token_ids=(11,),
)


@pytest.mark.parametrize("generated", [2, 5])
def test_a_row_is_processed_as_transformers_processes_it(generated):
    """Every rule at once on random logits, before and after ``min_tokens`` is reached."""
    g = torch.Generator().manual_seed(generated)
    prompt, output = [5, 6, 7, 6], torch.randint(0, 40, (generated,), generator=g).tolist()
    output[0] = 3  # a biased token that was also generated
    logits = torch.randn(1, 40, generator=g) * 3
    req = _req(prompt, output, **PROCESSED)
    got = LogitsProcessors([EOS]).apply(logits, [req])
    peer = peer_processors(len(prompt), req.params)
    expected = peer(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(got, expected, atol=1e-6)
    assert (got[0, [EOS, 11]] == float("-inf")).all() == (generated < 5)
    assert not torch.allclose(got, logits)


def test_a_request_that_asks_for_nothing_keeps_its_row_and_has_no_state():
    logits = torch.randn(2, 40)
    plain, processed = _req(), _req(**PROCESSED)
    got = LogitsProcessors([EOS]).apply(logits, [plain, processed])
    assert torch.equal(got[0], logits[0]) and not torch.equal(got[1], logits[1])
    assert plain.logits_state is None and not processes_logits(plain.params)
    assert LogitsProcessors([EOS]).apply(logits, [plain]).data_ptr() == logits.data_ptr()


def test_recorded_tokens_count_like_the_output_they_extend():
    """Counting as steps emit (one device id, then a verify's path) equals counting
    the output from scratch: the state stays current without the host's output list."""
    procs, logits = LogitsProcessors([EOS]), torch.randn(1, 40)
    live = _req(output=[4], **PROCESSED)
    procs.apply(logits, [live])
    procs.record([live], torch.tensor([7]))
    procs.record([live], [[7, 3, 12]])
    fresh = _req(output=[4, 7, 7, 3, 12], **PROCESSED)
    assert torch.equal(procs.apply(logits, [live]), procs.apply(logits, [fresh]))
    assert live.logits_state.generated == 5


def _random_tree(vocab: int, steps: int, topk: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    draft = lambda *shape: torch.log_softmax(torch.randn(*shape, vocab, generator=g), -1)  # noqa: E731
    step = first_step(draft(2), topk)
    out = [step]
    for _ in range(steps - 1):
        step = expand_step(step, draft(2, topk), topk)
        out.append(step)
    return build_tree(torch.tensor([3, 9]), out, tokens)


def test_path_counts_count_each_nodes_drafts_root_excluded():
    tree = _random_tree(vocab=6, steps=3, topk=2, tokens=6, seed=0)
    counts = path_counts(tree.tree_mask[0], tree.tokens[0], 6)
    parents = tree.parents[0].tolist()
    for i in range(tree.num_tokens):
        expected, node = torch.zeros(6), i
        while node > 0:  # walk to the root, counting every draft on the way
            expected[tree.tokens[0, node]] += 1
            node = parents[node]
        assert torch.equal(counts[i], expected), f"node {i}"


@pytest.mark.parametrize("steps,topk,tokens", [(4, 1, 5), (3, 3, 8)])
def test_a_tree_node_is_processed_as_plain_decode_after_its_path(steps, topk, tokens):
    """Node i of a verify gets the row plain decode would get with the path root..i
    appended to the output: the counts and ``min_tokens``' length include its drafts."""
    vocab = 16  # small, so drafts repeat tokens of the prompt, the output and each other
    tree = _random_tree(vocab, steps, topk, tokens, seed=tokens)
    logits = torch.randn(2, tokens, vocab, generator=torch.Generator().manual_seed(1)) * 3
    params = {**PROCESSED, "min_tokens": 4}
    reqs = [_req(output=[3, 3], **params), _req(output=[3, 5], temperature=1.0)]
    procs = LogitsProcessors([EOS])
    got = procs.apply_tree(logits, reqs, tree)
    assert torch.equal(got[1], logits[1])  # asks for nothing
    parents = tree.parents[0].tolist()
    for i in range(tokens):
        path, node = [], i
        while node > 0:
            path.insert(0, tree.tokens[0, node].item())
            node = parents[node]
        after = _req(output=[3, 3, *path], **params)
        expected = procs.apply(logits[0, i : i + 1], [after])[0]
        assert torch.allclose(got[0, i], expected, atol=1e-6), f"node {i}"


def test_min_p_keeps_what_transformers_keeps():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.7, min_p=0.2)
    probs = filtered_probs(logits, params)
    warped = MinPLogitsWarper(0.2)(None, logits / 0.7)
    assert torch.equal(probs > 0, warped > float("-inf"))
    assert torch.allclose(probs, torch.softmax(warped, -1), atol=1e-6)
    assert (probs == 0).any()


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty: must be in [0.01, 100]"),
        (dict(repetition_penalty=1e-300), "repetition_penalty: must be in [0.01, 100]"),
        (dict(repetition_penalty=1e3), "repetition_penalty: must be in [0.01, 100]"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty: must be in [0.01, 100]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty: must be in [-2, 2]"),
        (dict(logit_bias=((4, float("nan")),)), "logit_bias: bias nan of token 4"),
        (dict(frequency_penalty=2.5), "frequency_penalty: must be in [-2, 2]"),
        (dict(presence_penalty=-3.0), "presence_penalty: must be in [-2, 2]"),
        (dict(min_p=1.5), "min_p: must be in [0, 1]"),
        (dict(min_tokens=65), "min_tokens: must be in [0, max_tokens] (max_tokens is 64)"),
        (dict(logit_bias=((40, 1.0),)), "logit_bias: token id 40 is not in [0, 40)"),
        (dict(logit_bias=((4, 101.0),)), "logit_bias: bias 101.0 of token 4"),
        (dict(logit_bias=((4, 1.0), (4, 2.0))), "logit_bias: a token id is listed twice"),
    ],
)
def test_bad_values_name_their_field(params, message):
    with pytest.raises(InvalidRequest) as err:
        check_processor_params(SamplingParams(max_tokens=64, **params), vocab=40)
    assert message in str(err.value)


# -- whole engines against transformers -----------------------------------------

REPEAT = SamplingParams(
    max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3, logit_bias=((298, -3.0),)
)
SPREAD = SamplingParams(
    max_tokens=NEW_TOKENS, ignore_eos=True, frequency_penalty=0.6, presence_penalty=0.4
)
PLAIN = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(hf):
    """Prompts, per-request params (processed and not, in one batch) and the peer's
    greedy outputs; the processors must change them, or the test proves nothing."""
    prompts = demo_prompts(4, 40)
    params = [REPEAT, SPREAD, PLAIN, REPEAT]
    outputs = [peer_greedy(hf, p, q) for p, q in zip(prompts, params, strict=True)]
    unprocessed = [peer_greedy(hf, p, PLAIN) for p in prompts]
    assert all(o != u for o, u, q in zip(outputs, unprocessed, params, strict=True) if q != PLAIN)
    return prompts, params, outputs


ENGINES = {
    "plain": lambda: start_engine(DEMO_TARGET, kvCache={"pageSize": 1}),
    "plain overlap": lambda: start_engine(DEMO_TARGET, scheduler={"overlap": True}),
    "chain": lambda: start_spec_engine(DEMO_TARGET, DEMO_EAGLE, steps=3),
    "paged tree overlap": lambda: start_spec_engine(
        DEMO_TARGET, DEMO_EAGLE, page_size=16, steps=3, topk=4, overlap=True
    ),
}


def run_mixed(engine, prompts, params):
    """Every prompt at once, each with its own params -> (tokens, last delta) each."""

    async def go():
        return await asyncio.gather(
            *(
                collect(engine, f"r{i}", p, **dataclasses.asdict(q))
                for i, (p, q) in enumerate(zip(prompts, params, strict=True))
            )
        )

    return [(r[0], r[2]) for r in asyncio.run(go())]


@pytest.mark.parametrize("kind", ENGINES)
def test_greedy_with_processors_equals_transformers(kind, expected):
    prompts, params, outputs = expected
    engine = ENGINES[kind]()
    try:
        got = run_mixed(engine, prompts, params)
        assert [g[0] for g in got] == outputs
        assert engine.status().healthy, engine.status().last_error
        if kind not in ("plain", "plain overlap"):
            assert metric_value(engine, "specd_spec_accepted_tokens_total") > 10
    finally:
        engine.shutdown()
    assert request_held_tokens(engine) == 0


@pytest.mark.parametrize("kind", ["plain overlap", "paged tree overlap"])
def test_min_tokens_holds_back_a_stop_token_until_reached(kind, hf):
    """A stop token id the unconstrained output reaches early is held back until
    ``min_tokens``; then the output ends on it where transformers' does."""
    prompt = demo_prompts(1, 40)[0]
    unconstrained = peer_greedy(hf, prompt, SPREAD)
    stop = unconstrained[2]
    params = SamplingParams(
        max_tokens=NEW_TOKENS,
        ignore_eos=True,
        frequency_penalty=0.6,
        presence_penalty=0.4,
        stop_token_ids=(stop,),
        min_tokens=8,
    )
    want = peer_greedy(hf, prompt, params)
    assert stop not in want[:8] and len(want) > 8
    engine = ENGINES[kind]()
    try:
        (tokens, last), (plain_tokens, _) = run_mixed(engine, [prompt, prompt], [params, PLAIN])
    finally:
        engine.shutdown()
    assert tokens == want
    assert plain_tokens == peer_greedy(hf, prompt, PLAIN)
    assert last.finish_reason is (FinishReason.STOP if want[-1] == stop else FinishReason.LENGTH)


@pytest.mark.parametrize("kind", ["plain overlap", "paged tree overlap"])
def test_sampled_requests_never_draw_a_token_biased_away(kind):
    """Sampling (the tree's speculative sampling included) draws from the processed
    distribution: tokens biased by -100 never appear, the rest still vary by seed."""
    prompts = demo_prompts(4, 40)
    engine = ENGINES[kind]()
    try:
        free = run_all(
            engine, prompts, max_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, seed=5
        )
        common = sorted(
            {t for r in free for t in r[0]}, key=lambda t: -sum(r[0].count(t) for r in free)
        )
        banned = tuple((t, -100.0) for t in common[:3])
        results = run_all(
            engine,
            prompts,
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            temperature=1.0,
            seed=5,
            logit_bias=banned,
        )
        assert engine.status().healthy, engine.status().last_error
    finally:
        engine.shutdown()
    drawn = {t for r in results for t in r[0]}
    assert drawn and not drawn & {t for t, _ in banned}
    assert len({tuple(r[0]) for r in results}) == len(prompts)


def check_near_greedy(hf, prompt, params: SamplingParams, tokens, tolerance: float) -> None:
    """Each token is within ``tolerance`` of the best processed logit of the float32
    peer, teacher-forced on the run's own output (bf16 runs part from float32 at near
    ties, and then follow their own text)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1]
    procs = peer_processors(len(prompt), params)
    for i, token in enumerate(tokens):
        row = procs(ids[:, : len(prompt) + i], logits[i : i + 1].clone())[0]
        assert row.max() - row[token] <= tolerance, f"token {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("triton", "flashinfer"))
@pytest.mark.parametrize("layout", ("plain overlap", "paged tree overlap"))
def test_cuda_backends_apply_processors_with_graphs(backend, layout, expected, hf):
    """Each CUDA backend with graphs (decode buckets, captured draft and verify):
    float32 equals the peer token for token, bf16 stays near its greedy choice."""
    from specd.kernels import available_backends

    caps = available_backends().get(backend)
    if caps is None:
        pytest.fail(f"{backend} is not installed on this CUDA machine (scripts/gpu_check.sh)")
    dtype = "float32" if torch.float32 in caps.dtypes else "bfloat16"
    spec = dict(
        device="cuda",
        attentionBackend=backend,
        cudaGraph={"maxBatchSize": 4},
        model={"dtype": dtype},
        scheduler={"overlap": True, "chunkedPrefillSize": 16},
    )
    if layout == "plain overlap":
        engine = start_engine(DEMO_TARGET, **spec)
    else:
        engine = start_engine(
            DEMO_TARGET,
            kvCache={"pageSize": 16, "maxTokens": 4096},
            draft={"path": DEMO_EAGLE},
            speculative={"numSteps": 3, "topk": 4, "numDraftTokens": 8},
            debug={"strictMemCheck": 1},
            **spec,
        )
    prompts, params, outputs = expected
    try:
        got = [g[0] for g in run_mixed(engine, prompts, params)]
        assert engine.status().healthy, engine.status().last_error
    finally:
        engine.shutdown()
    if dtype == "float32":
        assert got == outputs
        return
    for prompt, p, tokens in zip(prompts, params, got, strict=True):
        check_near_greedy(hf, prompt, p, tokens, 0.25)  # bf16 logits: greedy_judge.py


def test_the_near_greedy_check_can_fail(expected, hf):
    """The bf16 check above refuses the unprocessed greedy output of a processed request."""
    prompts, params, _ = expected
    unprocessed = peer_greedy(hf, prompts[0], PLAIN)
    check_near_greedy(hf, prompts[0], PLAIN, unprocessed, 0.0)
    with pytest.raises(AssertionError):
        check_near_greedy(hf, prompts[0], params[0], unprocessed, 0.25)
