"""Structured output: a verify masks each tree node as plain decode would after the
node's path; greedy engines (plain, overlap, chains, paged trees) emit what
``transformers`` emits under xgrammar's own logits processor, token for token; sampled
trees always end in text the grammar accepts; guided drafting makes even a random draft
(EAGLE and EAGLE-3) accept the grammar's forced tokens; bad grammars and options are
refused naming their field."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

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
from specd.devtools.tiny_draft import make_tiny_eagle3
from specd.workers.gateway.protocol import ChatCompletionRequest, CompletionRequest
from specd.workers.runner.structured_output import Grammars, check_grammar_params
from specd.workers.speculative.guided_draft import DraftGuide, mask_logprobs
from specd.workers.speculative.tree import StepOut
from specd.workers.types import FinishReason, Grammar, InvalidRequest, SamplingParams

EOS = 1  # the demo target's
VOCAB = 8192
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["list", "dict", "str"]},
    },
    "required": ["name", "ok", "kind"],
}
JSON_SCHEMA = Grammar("json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema")
ANSWER = r"(yes|no|maybe), [0-9]{1,3}"


@pytest.fixture(scope="module")
def grammars():
    return Grammars(AutoTokenizer.from_pretrained(DEMO_TARGET), VOCAB, [EOS])


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = (bitmask[row, :, None] >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()[:VOCAB]).flatten().tolist())


def _tokens(text: str) -> list[int]:
    return AutoTokenizer.from_pretrained(DEMO_TARGET).encode(text, add_special_tokens=False)


# -- the masks, row by row ----------------------------------------------------------


def test_a_tree_node_is_masked_as_plain_decode_after_its_path(grammars):
    """Node i's row allows what a matcher fed the path root..i allows; a node its parent
    refuses leaves its subtree open; the matcher ends where it started."""
    [yes], [no], [comma], [x] = (_tokens(t) for t in ("yes", "no", ",", "x"))
    #        root  yes  no   x   ,(yes) x(yes)  ,(x)  EOS(no)
    tokens = [42, yes, no, x, comma, x, comma, EOS]
    parents = [-1, 0, 0, 0, 1, 1, 3, 2]
    params = SamplingParams(max_tokens=8, grammar=Grammar("regex", ANSWER))
    state = grammars.state_for(params)
    before = state.new_bitmask(1)
    state.fill_row(before, 0)
    bitmask = state.new_bitmask(len(tokens))
    state.fill_tree(bitmask, tokens, parents)
    for node in range(len(tokens)):
        path, at = [], node
        while at > 0:
            path.insert(0, tokens[at])
            at = parents[at]
        fresh = grammars.state_for(params)
        reachable = all(fresh.matcher.accept_token(t) for t in path)
        if node in (3, 5, 6, 7):  # "x" refused, and below it; EOS before the number
            assert not reachable and _allowed(bitmask, node) == set(range(VOCAB)), node
            continue
        assert reachable, node
        want = fresh.new_bitmask(1)
        fresh.fill_row(want, 0)
        assert torch.equal(bitmask[node], want[0]), node
    assert _allowed(bitmask, 4) - {EOS} and EOS not in _allowed(bitmask, 4)
    after = state.new_bitmask(1)
    state.fill_row(after, 0)
    assert torch.equal(after, before)


def test_rows_the_draft_loop_filled_are_reused_by_the_verify_and_dropped_on_advance(grammars):
    """A tree filled after the draft loop's paths (cache hits) equals one filled fresh;
    emitting a token drops the kept rows (they were relative to the old state)."""
    [yes], [no], [comma], [x] = (_tokens(t) for t in ("yes", "no", ",", "x"))
    tokens, parents = [42, yes, no, x, comma, comma], [-1, 0, 0, 0, 1, 2]
    params = SamplingParams(grammar=Grammar("regex", ANSWER))
    warm, cold = grammars.state_for(params), grammars.state_for(params)
    warm.fill_paths(warm.new_bitmask(3), [[yes], [no], [x]])
    assert set(warm._rows) == {(yes,), (no,)}  # the refused "x" is not kept
    got, want = warm.new_bitmask(len(tokens)), cold.new_bitmask(len(tokens))
    warm.fill_tree(got, tokens, parents)
    cold.fill_tree(want, tokens, parents)
    assert torch.equal(got, want)
    warm.advance([yes])
    assert not warm._rows
    row = warm.new_bitmask(1)
    warm.fill_row(row, 0)
    assert _allowed(row, 0) == _allowed_after(grammars, params, [yes])


def test_a_stop_token_ends_the_matcher_and_later_tokens_are_ignored(grammars):
    state = grammars.state_for(SamplingParams(grammar=Grammar("regex", "(yes|no)")))
    state.advance([*_tokens("no"), EOS, 77])
    assert state.matcher.is_terminated()
    bitmask = state.new_bitmask(1)
    state.fill_row(bitmask, 0)  # left open
    assert _allowed(bitmask, 0) == set(range(VOCAB))
    fresh = grammars.state_for(SamplingParams(grammar=Grammar("regex", "(yes|no)")))
    with pytest.raises(RuntimeError, match="refused emitted token"):
        fresh.advance(_tokens("maybe"))


def test_guided_draft_rows_allow_what_the_grammar_allows_after_each_path(grammars):
    """Roots are masked at the emitted state, children after their kept paths, and the
    masked log-probs are renormalized: a forced token's is 0 (drafted with certainty)."""
    [yes], [no], [comma], [x] = (_tokens(t) for t in ("yes", "no", ",", "x"))
    params = SamplingParams(grammar=Grammar("regex", ANSWER))
    free = SamplingParams()
    reqs = [_req_with(grammars, params), _req_with(grammars, free)]
    guide = DraftGuide.for_batch(reqs, None)
    logprobs = torch.log_softmax(torch.randn(2, VOCAB), -1)
    roots = guide.roots(logprobs)
    assert torch.equal(roots[1], logprobs[1])  # unconstrained
    assert set(torch.nonzero(roots[0].isfinite()).flatten().tolist()) == _allowed_after(
        grammars, params, []
    )
    guide.kept(StepOut(torch.tensor([[yes, x], [5, 6]]), torch.zeros(2, 2), torch.full((2, 2), -1)))
    child = guide.children(torch.log_softmax(torch.randn(2, 2, VOCAB), -1))
    assert child[0, 0].isfinite().nonzero().flatten().tolist() == [comma]  # forced
    assert child[0, 0, comma].item() == pytest.approx(0.0, abs=1e-6)
    assert child[0, 1].isfinite().all()  # "x" is refused: the row stays open
    guide.kept(
        StepOut(
            torch.tensor([[comma, no], [5, 6]]), torch.zeros(2, 2), torch.tensor([[0, 1], [0, 0]])
        )
    )
    assert guide.paths[0] == [[yes, comma], [x, no]]
    assert torch.equal(
        mask_logprobs(logprobs[:1], torch.zeros(1, VOCAB, dtype=torch.bool)), logprobs[:1]
    )


def _req_with(grammars, params: SamplingParams):
    from specd.workers.requests.request import Req

    return Req("r", [5], params, grammar=grammars.state_for(params) if params.grammar else None)


def _allowed_after(grammars, params: SamplingParams, path: list[int]) -> set[int]:
    state = grammars.state_for(params)
    state.advance(path)
    bitmask = state.new_bitmask(1)
    state.fill_row(bitmask, 0)
    return _allowed(bitmask, 0)


# -- refusals -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "grammar,message",
    [
        (
            Grammar("json_schema", '{"type": "objectx"}', "response_format.json_schema.schema"),
            r'^response_format\.json_schema\.schema: Unsupported type "objectx"',
        ),
        (Grammar("regex", "(a", "regex"), r"^regex: Regex parsing error at position 3"),
        (Grammar("ebnf", "root ::= foo", "ebnf"), r'^ebnf: .*Rule "foo" is not defined'),
    ],
)
def test_a_bad_grammar_is_refused_naming_its_field(grammars, grammar, message):
    with pytest.raises(InvalidRequest, match=message):
        grammars.state_for(SamplingParams(grammar=grammar))


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(ignore_eos=True), r"^ignore_eos: cannot be combined with regex"),
        (dict(min_tokens=3), r"^min_tokens: cannot be combined with regex"),
    ],
)
def test_options_that_hold_back_the_end_are_refused(params, message):
    with pytest.raises(InvalidRequest, match=message):
        check_grammar_params(SamplingParams(grammar=Grammar("regex", "a+", "regex"), **params))
    check_grammar_params(SamplingParams(**params))  # fine without a grammar


CHAT = dict(model="m", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "body,grammar",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA},
                }
            },
            Grammar("json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema"),
        ),
        (
            {"response_format": {"type": "json_object"}},
            Grammar("json_object", "", "response_format"),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"regex": "a+"}, Grammar("regex", "a+", "regex")),
        ({"ebnf": 'root ::= "a"'}, Grammar("ebnf", 'root ::= "a"', "ebnf")),
    ],
)
def test_requests_ask_for_a_grammar_on_both_endpoints(body, grammar):
    chat = ChatCompletionRequest(**CHAT, **body).sampling_params(16)
    completion = CompletionRequest(model="m", prompt="hi", **body).sampling_params(16)
    assert chat.grammar == completion.grammar == grammar


@pytest.mark.parametrize(
    "body,message",
    [
        (
            {"response_format": {"type": "json_object"}, "regex": "a"},
            "send one output constraint, not response_format and regex",
        ),
        ({"response_format": {"type": "json_schema"}}, 'send json_schema (with its "schema")'),
        ({"response_format": {"type": "xml"}}, "'json_schema' or 'structural_tag'"),
    ],
)
def test_a_bad_response_format_is_refused(body, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ChatCompletionRequest(**CHAT, **body)


# -- whole engines against transformers + xgrammar -------------------------------------


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)


def peer_greedy(
    hf, grammars, prompt: list[int], grammar: Grammar, max_tokens: int, eos: int = EOS
) -> list[int]:
    """transformers' greedy output under xgrammar's own logits processor, to EOS."""
    ids = torch.tensor([prompt])
    processor = xgr.contrib.hf.LogitsProcessor(grammars.compile(grammar))
    gen = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        logits_processor=[processor],
        eos_token_id=eos,
        pad_token_id=0,
    )
    return gen[0, len(prompt) :].tolist()


MAX_TOKENS = 48
ENGINES = {
    "plain overlap": lambda: start_engine(DEMO_TARGET, scheduler={"overlap": True}),
    "chain": lambda: start_spec_engine(DEMO_TARGET, DEMO_EAGLE, steps=3),
    "paged tree overlap": lambda: start_spec_engine(
        DEMO_TARGET, DEMO_EAGLE, page_size=16, steps=3, topk=4, overlap=True
    ),
    "ngram paged tree overlap": lambda: start_engine(
        DEMO_TARGET,
        kvCache={"pageSize": 16},
        scheduler={"overlap": True},
        draft={"algorithm": "NGRAM"},
        speculative={"numSteps": 3, "topk": 4, "numDraftTokens": 8},
    ),
    "suffix chain": lambda: start_engine(
        DEMO_TARGET,
        draft={"algorithm": "SUFFIX"},
        speculative={"numSteps": 3, "topk": 1, "numDraftTokens": 4},
    ),
    "hybrid chain": lambda: start_engine(  # the EAGLE head, or SUFFIX's tree above 0
        DEMO_TARGET,
        draft={"path": DEMO_EAGLE},
        speculative={
            "numSteps": 3,
            "topk": 1,
            "numDraftTokens": 4,
            "suffix": {"hybridThreshold": 0},
        },
    ),
    # four at once run plain, the draft deferred; three catch up and speculate
    "chain deferred": lambda: start_spec_engine(
        DEMO_TARGET, DEMO_EAGLE, steps=3, policy={"maxBatchForSpec": 3}
    ),
}


@pytest.fixture(scope="module")
def expected(hf, grammars):
    """Prompts, grammars (one request unconstrained, sharing the batch) and the peer's
    outputs; the JSON ones must validate, or the test proves nothing."""
    prompts = demo_prompts(4, 40)
    asked = [JSON_SCHEMA, Grammar("regex", ANSWER), Grammar("json_object"), None]
    outputs = []
    for prompt, grammar in zip(prompts, asked, strict=True):
        if grammar is None:
            outputs.append(None)
            continue
        out = peer_greedy(hf, grammars, prompt, grammar, MAX_TOKENS)
        assert out[-1] == EOS, "the peer must finish inside the token budget"
        outputs.append(out)
    text = AutoTokenizer.from_pretrained(DEMO_TARGET).decode(outputs[0][:-1])
    jsonschema.validate(json.loads(text), SCHEMA)
    return prompts, asked, outputs


def run_constrained(engine, prompts, asked, max_tokens=MAX_TOKENS):
    """Every prompt at once, each with its grammar (None: free) -> (tokens, text, last)."""

    async def go():
        return await asyncio.gather(
            *(
                collect(engine, f"r{i}", p, max_tokens=max_tokens, grammar=g)
                for i, (p, g) in enumerate(zip(prompts, asked, strict=True))
            )
        )

    return asyncio.run(go())


def check_follows_grammars(got, json_mode_may_run_on: bool = False) -> None:
    """The ``expected`` requests' texts: the schema, the regex, JSON mode, each ended by
    EOS (JSON mode is unbounded: another model's text may run past the budget)."""
    assert all(last.finish_reason is FinishReason.STOP for *_, last in got[:2])
    jsonschema.validate(json.loads(got[0][1]), SCHEMA)
    assert re.fullmatch(ANSWER, got[1][1])
    if json_mode_may_run_on and got[2][2].finish_reason is FinishReason.LENGTH:
        return
    assert got[2][2].finish_reason is FinishReason.STOP
    assert isinstance(json.loads(got[2][1]), dict)


@pytest.mark.parametrize("kind", ENGINES)
def test_greedy_structured_output_equals_transformers(kind, expected):
    prompts, asked, outputs = expected
    engine = ENGINES[kind]()
    try:
        got = run_constrained(engine, prompts, asked)
        free = run_all(engine, prompts[-1:], max_tokens=MAX_TOKENS)[0]
        assert engine.status().healthy, engine.status().last_error
        if kind != "plain overlap":
            assert metric_value(engine, "specd_spec_accepted_tokens_total") > 10
        if kind == "hybrid chain":  # the free rerun drafts from the first run's outputs
            assert metric_value(engine, "specd_spec_hybrid_suffix_trees_total") > 0
    finally:
        engine.shutdown()
    assert request_held_tokens(engine) == 0
    assert [g[0] for g in got[:3]] == outputs[:3]
    check_follows_grammars(got)
    assert got[3][0] == free[0]  # the unconstrained neighbour is untouched


def test_a_retracted_constrained_request_resumes_exactly(expected):
    """A pool too small for the batch retracts requests; each one's matcher stays with
    its kept output, so the re-prefilled request goes on as if never retracted."""
    prompts, asked, outputs = expected
    engine = start_engine(
        DEMO_TARGET,
        kvCache={"pageSize": 4, "maxTokens": 192},
        scheduler={"chunkedPrefillSize": 64},
        draft={"path": DEMO_EAGLE},
        speculative={"numSteps": 3, "topk": 4, "numDraftTokens": 8},
        debug={"strictMemCheck": 1},
    )
    try:
        got = run_constrained(engine, prompts, asked)
        assert metric_value(engine, "specd_retractions_total") > 0
        assert engine.status().healthy, engine.status().last_error
    finally:
        engine.shutdown()
    assert [g[0] for g in got[:3]] == outputs[:3]
    check_follows_grammars(got)
    assert request_held_tokens(engine) == 0


def test_a_session_turn_can_be_constrained_and_the_next_one_free():
    """A grammar holds its own turn only: the next turn reads the constrained answer
    from the session's KV and goes on as one request over the whole history would
    (computed whole: no prefix cache lends it the session's pages)."""
    engine = start_engine(DEMO_TARGET, sessions={"enabled": True}, kvCache={"prefixCache": False})
    first, second = demo_prompts(2, 24)
    try:
        sid = engine.open_session()

        async def turns():
            a = await collect(
                engine, "t0", first, sid, max_tokens=MAX_TOKENS, grammar=Grammar("regex", ANSWER)
            )
            b = await collect(engine, "t1", second, sid, max_tokens=8, ignore_eos=True)
            return a, b

        (answer, text, last), (follow, _, _) = asyncio.run(turns())
        whole = first + answer + second
        [(alone, _, _)] = run_all(engine, [whole], max_tokens=8, ignore_eos=True)
        engine.close_session(sid)
    finally:
        engine.shutdown()
    assert re.fullmatch(ANSWER, text) and last.finish_reason is FinishReason.STOP
    assert follow == alone


def test_sampled_trees_always_end_in_text_the_grammar_accepts():
    """Tree speculative sampling draws from the masked distribution: every seed ends in
    a match, and the seeds do not all agree."""
    engine = ENGINES["paged tree overlap"]()
    try:
        outs = [
            run_all(
                engine,
                demo_prompts(3, 40),
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=seed,
                grammar=Grammar("regex", ANSWER),
            )
            for seed in (1, 2)
        ]
    finally:
        engine.shutdown()
    texts = [text for run in outs for _, text, _ in run]
    assert all(last.finish_reason is FinishReason.STOP for run in outs for *_, last in run)
    assert all(re.fullmatch(ANSWER, t) for t in texts), texts
    assert len(set(texts)) > 1
    assert request_held_tokens(engine) == 0


FORCED = r"The answer is (yes|no)\."


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_guided_drafting_accepts_forced_tokens_even_from_a_random_draft(pair, algorithm, tmp_path):
    """A random draft accepts almost nothing, but guided by the grammar it drafts the
    forced literal with certainty: verify accepts it, and the output is the peer's.  The
    EAGLE-3 head's reduced vocabulary holds the literal's tokens (as a frequency-ranked
    one holds common text), at draft ids other than their target ids."""
    target, eagle, _ = pair
    tok = AutoTokenizer.from_pretrained(target)
    literal = tok.encode("The answer is yes.no", add_special_tokens=False)
    eagle3 = str(make_tiny_eagle3(tmp_path, target, keep_ids=[*literal, tok.eos_token_id]))
    grammars = Grammars(
        tok, AutoModelForCausalLM.from_pretrained(target).config.vocab_size, [tok.eos_token_id]
    )
    prompt = tok.encode("Structured output, please:", add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    grammar = Grammar("regex", FORCED)
    want = peer_greedy(hf, grammars, prompt, grammar, MAX_TOKENS, eos=tok.eos_token_id)
    engine = start_spec_engine(
        target,
        eagle if algorithm == "EAGLE" else eagle3,
        algorithm=algorithm,
        page_size=4,
        steps=3,
        topk=2,
    )
    try:
        [(tokens, text, last)] = run_all(engine, [prompt], max_tokens=MAX_TOKENS, grammar=grammar)
        accepted = metric_value(engine, "specd_spec_accepted_tokens_total")
    finally:
        engine.shutdown()
    assert tokens == want and re.fullmatch(FORCED, text)
    forced = len(tok.encode("The answer is ", add_special_tokens=False))
    assert accepted >= forced - 1, (accepted, forced)
    assert request_held_tokens(engine) == 0


def test_an_engine_refuses_a_bad_schema_with_a_400():
    engine = start_engine(DEMO_TARGET)
    bad = dataclasses.replace(JSON_SCHEMA, source='{"type": "objectx"}')
    try:
        _, _, last = asyncio.run(collect(engine, "bad", [5, 6, 7], grammar=bad))
        good = asyncio.run(
            collect(
                engine, "good", demo_prompts(1, 40)[0], max_tokens=MAX_TOKENS, grammar=JSON_SCHEMA
            )
        )
    finally:
        engine.shutdown()
    assert last.finish_reason is FinishReason.ERROR and last.error_code == 400
    assert last.error.startswith("response_format.json_schema.schema: Unsupported type")
    assert good[2].finish_reason is FinishReason.STOP


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("triton", "flashinfer"))
def test_cuda_backends_run_structured_output_with_graphs(backend, expected):
    """Each CUDA backend with graphs (guided batches draft eagerly beside captured
    verify): float32 equals the peer token for token; bf16 output still follows every
    grammar."""
    from specd.kernels import available_backends

    caps = available_backends().get(backend)
    if caps is None:
        pytest.fail(f"{backend} is not installed on this CUDA machine (scripts/gpu_check.sh)")
    dtype = "float32" if torch.float32 in caps.dtypes else "bfloat16"
    engine = start_engine(
        DEMO_TARGET,
        device="cuda",
        attentionBackend=backend,
        cudaGraph={"maxBatchSize": 4},
        model={"dtype": dtype},
        scheduler={"overlap": True, "chunkedPrefillSize": 16},
        kvCache={"pageSize": 16, "maxTokens": 4096},
        draft={"path": DEMO_EAGLE},
        speculative={"numSteps": 3, "topk": 4, "numDraftTokens": 8},
        debug={"strictMemCheck": 1},
    )
    prompts, asked, outputs = expected
    try:
        got = run_constrained(engine, prompts, asked, max_tokens=2 * MAX_TOKENS)
        assert engine.status().healthy, engine.status().last_error
        assert metric_value(engine, "specd_spec_accepted_tokens_total") > 10
    finally:
        engine.shutdown()
    assert request_held_tokens(engine) == 0
    if dtype == "float32":
        assert [g[0] for g in got[:3]] == outputs[:3]
    check_follows_grammars(got, json_mode_may_run_on=dtype != "float32")
