"""A grammar that waits for the thinking to end (``engine/thinking_gate.py``): its phases
and rollbacks against a plain matcher of the same grammar, and whole engines (plain,
chain and tree speculation, overlap) whose output is a thinking block then JSON that
validates, token-identical across them, with strict leak checks."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from specd.devtools.testing import (
    DEMO_EAGLE,
    DEMO_TARGET,
    check_leak_free,
    run_all,
    start_engine,
    with_thinking_tags,
)
from specd.workers.runner.structured_output import Grammars
from specd.workers.runner.thinking_gate import thinking_tag_ids
from specd.workers.types import Grammar, InvalidRequest, SamplingParams

SCHEMA = {  # no free text: the answer ends within max_tokens, and holds no </think>
    "type": "object",
    "properties": {"mood": {"enum": ["calm", "busy", "tired"]}, "ok": {"type": "boolean"}},
    "required": ["mood", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The demo target with single-token <think> and </think>: (folder, tokenizer)."""
    folder = with_thinking_tags(DEMO_TARGET, tmp_path_factory.mktemp("thinker"))
    return str(folder), AutoTokenizer.from_pretrained(folder)


def grammar(thinking=None):
    return Grammar("json_schema", json.dumps(SCHEMA), "response_format", thinking)


def state(tokenizer, thinking=None, vocab=8192):
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    return grammars.state_for(SamplingParams(max_tokens=64, grammar=grammar(thinking)))


def row(st, path=()):
    """The tokens ``st`` allows after its emitted tokens and ``path``."""
    mask = st.new_bitmask(1)
    st.fill_paths(mask, [list(path)])
    return mask[0].clone()


def test_thinking_tags_are_found_only_as_single_tokens(thinker):
    folder, tokenizer = thinker
    assert thinking_tag_ids(tokenizer) == (8190, 8191)
    assert thinking_tag_ids(AutoTokenizer.from_pretrained(DEMO_TARGET)) is None
    with pytest.raises(InvalidRequest, match="response_format: .*no single-token <think>"):
        state(AutoTokenizer.from_pretrained(DEMO_TARGET), "first")


def test_the_grammar_holds_only_after_the_thinking_ends(thinker):
    _, tokenizer = thinker
    start, end = thinking_tag_ids(tokenizer)
    plain, gated = state(tokenizer), state(tokenizer, "first")
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    assert bool((row(gated) == -1).all())  # thinking: every token
    gated.advance(tokenizer.encode("let me see", add_special_tokens=False) + [start])
    assert bool((row(gated) == -1).all())
    # a verify's paths cross </think> and come back: rows as the plain matcher's
    paths = [[end], [end, brace]]
    mask = gated.new_bitmask(2)
    gated.fill_paths(mask, paths)
    assert torch.equal(mask[0], row(plain)) and torch.equal(mask[1], row(plain, [brace]))
    assert bool((row(gated) == -1).all())  # rolled back: still thinking
    gated.advance([end, brace])
    assert torch.equal(row(gated), row(plain, [brace]))
    with pytest.raises(RuntimeError, match="refused emitted token"):
        gated.advance([end])  # inside the answer </think> is just a refused token


def test_optional_thinking_is_decided_by_the_first_token(thinker):
    _, tokenizer = thinker
    start, end = thinking_tag_ids(tokenizer)
    plain = state(tokenizer)
    first = row(state(tokenizer, "optional"))
    opened = row(plain)
    opened[start >> 5] |= 1 << (start & 31)
    assert torch.equal(first, opened) and not torch.equal(first, row(plain))
    answering = state(tokenizer, "optional")
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    answering.advance([brace])  # no <think>: the answer began, <think> is refused now
    assert torch.equal(row(answering), row(plain, [brace]))
    thinking = state(tokenizer, "optional")
    thinking.advance([start])
    assert bool((row(thinking) == -1).all())
    thinking.advance([end])
    assert torch.equal(row(thinking), row(plain))


ENGINES = {
    "plain": {},
    "plain-overlap": {"scheduler": {"overlap": True}},
    "chain": {
        "draft": {"path": DEMO_EAGLE},
        "speculative": {"numSteps": 3, "topk": 1, "numDraftTokens": 4},
    },
    "paged-tree-overlap": {
        "draft": {"path": DEMO_EAGLE},
        "speculative": {"numSteps": 3, "topk": 4, "numDraftTokens": 8},
        "kvCache": {"pageSize": 16, "maxTokens": 4096},
        "scheduler": {"overlap": True},
    },
}


def thinking_outputs(folder, tokenizer, **spec):
    """Greedy outputs of two prompts: "first" (the bias makes the thinking end at once)
    and "optional" (the bias opens a thinking block, then ends it)."""
    start, end = thinking_tag_ids(tokenizer)
    prompts = [tokenizer.encode("Describe a person as JSON:", add_special_tokens=False)]
    engine = start_engine(folder, debug={"strictMemCheck": 1}, **spec)
    try:
        runs = [
            run_all(engine, prompts, max_tokens=48, grammar=grammar("first"),
                    logit_bias=((end, 30.0),)),
            run_all(engine, prompts, max_tokens=48, grammar=grammar("optional"),
                    logit_bias=((start, 30.0), (end, 60.0))),
        ]  # fmt: skip
        check_leak_free(engine)
    finally:
        engine.shutdown()
    return [run[0][0] for run in runs]


@pytest.mark.parametrize("engine", ENGINES)
def test_engines_think_then_answer_in_the_schema(thinker, engine):
    folder, tokenizer = thinker
    start, end = thinking_tag_ids(tokenizer)
    first, optional = thinking_outputs(folder, tokenizer, **ENGINES[engine])
    assert first[0] == end and optional[:2] == [start, end]
    for out in (first, optional):
        answer = tokenizer.decode(out[out.index(end) + 1 :], skip_special_tokens=True)
        jsonschema.validate(json.loads(answer), SCHEMA)
    if engine != "plain":
        assert [first, optional] == thinking_outputs(folder, tokenizer, **ENGINES["plain"])
