"""Reasoning parsers (`reasoning`): a thinking block split from the answer, whole and
streamed in any chunking; their place in chat responses beside tool calls; and
``chat_template_kwargs`` reaching the template."""

from __future__ import annotations

import random

import pydantic
import pytest

from specd.workers.gateway.protocol import ChatCompletionRequest, ChatFormat, ChoiceResult
from specd.workers.gateway.reasoning import PARSERS, ReasoningStream
from specd.workers.model.tokenizer import apply_chat_template, load_tokenizer

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]
OPENED = "<|im_start|>assistant\n<think>\n"  # a template that opens the thinking block

CASES = [
    # parser, prompt tail, output, (reasoning, content)
    (R1, "", "<think>\nstep 1</think>\n\nThe answer", ("\nstep 1", "\n\nThe answer")),
    (R1, OPENED, "step 1</think>The answer", ("step 1", "The answer")),
    (R1, "", "thinking that never ends", ("thinking that never ends", None)),
    (R1, "", "</think>only the answer", (None, "only the answer")),
    (QWEN3, "", "<think>why</think>Because.", ("why", "Because.")),
    (QWEN3, "", "  <think>why</think>Because.", ("why", "Because.")),
    (QWEN3, "", "No thinking today.", (None, "No thinking today.")),
    (QWEN3, "", "<thinking is not a tag", (None, "<thinking is not a tag")),
    (QWEN3, OPENED, "why</think>Because.", ("why", "Because.")),
    (QWEN3, "", "<think>unfinished", ("unfinished", None)),
    (QWEN3, "", "<think>a</think>b</think>c", ("a", "b</think>c")),
]


@pytest.mark.parametrize(("parser", "tail", "text", "parts"), CASES)
def test_whole_outputs_split_into_reasoning_and_content(parser, tail, text, parts):
    assert parser.split(text, tail) == parts


@pytest.mark.parametrize(("parser", "tail", "text", "parts"), CASES)
def test_any_chunking_streams_the_same_split(parser, tail, text, parts):
    """Tags cut anywhere between chunks (one character at a time included) are held
    until they are whole; the streamed pieces add up to the whole split."""
    rng = random.Random(len(text))
    for trial in range(20):
        cuts = sorted({0, len(text), *(rng.randrange(len(text) + 1) for _ in range(trial % 6))})
        chunks = [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        if trial == 0:
            chunks = list(text)
        stream, reasoning, content = ReasoningStream(parser, tail), "", ""
        for chunk in chunks:
            r, c = stream.feed(chunk)
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert (reasoning + r or None, content + c or None) == parts, chunks


def test_chat_responses_put_the_reasoning_beside_content_and_tool_calls():
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text = f"<think>I should call it</think>\n{call}"
    fmt = ChatFormat("auto", "hermes", QWEN3, "")
    response = fmt.response("r", "m", [ChoiceResult(0, text, "stop", None)], None)
    message = response.choices[0].message
    assert message.reasoning_content == "I should call it" and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["f"]
    assert response.choices[0].finish_reason == "tool_calls"

    streamed = ChatFormat("auto", "hermes", QWEN3, "")
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    chunks = [
        streamed.chunk("r", "m", 0, piece, "stop" if i == len(pieces) - 1 else None, None)
        for i, piece in enumerate(pieces)
    ]
    deltas = [c.choices[0].delta for c in chunks if c is not None]
    assert "".join(d.reasoning_content or "" for d in deltas) == "I should call it"
    assert "".join(d.content or "" for d in deltas).strip() == ""  # the newline before the call
    assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["f"]
    plain = ChatFormat().response("r", "m", [ChoiceResult(0, text, "stop", None)], None)
    assert plain.choices[0].message.reasoning_content is None  # no parser: all content
    assert "reasoning_content" not in plain.choices[0].message.model_dump_json()


def test_chat_template_kwargs_reach_the_template(tiny_models):
    tok = load_tokenizer(tiny_models("gqa"))
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    plain = tok.decode(apply_chat_template(tok, messages))
    off = tok.decode(apply_chat_template(tok, messages, None, {"enable_thinking": False}))
    assert not plain.endswith("<nothink>") and off.endswith("<nothink>")


def test_chat_template_kwargs_cannot_set_the_servers_arguments():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(pydantic.ValidationError, match="add_generation_prompt, tokenize"):
        ChatCompletionRequest(
            **body, chat_template_kwargs={"tokenize": True, "add_generation_prompt": False}
        )
    ok = ChatCompletionRequest(**body, chat_template_kwargs={"enable_thinking": False})
    assert ok.chat_template_kwargs == {"enable_thinking": False}
