"""Tool calls: ``tool_choice`` ``"required"`` or a named function becomes a grammar over
the tools' schemas; an engine's constrained output reads back as OpenAI ``tool_calls``
whose arguments validate; ``"auto"``'s structural tag holds a call the model opens in
its family's format (hermes, llama3_json) and leaves other text free, and the call is
parsed out of the text; a stream holds a calling choice's text from where a call opens
and sends each call whole; bad tool requests are refused naming ``tool_choice``."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from specd.devtools.testing import DEMO_TARGET, collect, demo_prompts, start_engine
from specd.workers.gateway.protocol import (
    ChatCompletionRequest,
    ChatFormat,
    ChatMessage,
    ChoiceResult,
)
from specd.workers.gateway.tool_calls import CALL_FORMATS, ToolCallReader
from specd.workers.model.tokenizer import apply_chat_template
from specd.workers.types import SamplingParams

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "now"}},
]
CHAT = dict(
    model="m",
    messages=[{"role": "user", "content": "Weather in Oslo?"}],
    tools=TOOLS,
    temperature=0,
)


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(**CHAT, **extra)


@pytest.fixture(scope="module")
def engine():
    engine = start_engine(DEMO_TARGET)
    yield engine
    engine.shutdown()


def _generate(engine, request: ChatCompletionRequest, parser=None) -> tuple[str, str]:
    params = request.sampling_params(96, tool_parser=parser)
    _, text, last = asyncio.run(collect(engine, "t", demo_prompts(1, 40)[0], **_fields(params)))
    return text, last.finish_reason.value


def _fields(params) -> dict:
    return {f: getattr(params, f) for f in params.__slots__}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_name_a_tool_and_validate(engine, parallel):
    request = _request(tool_choice="required", parallel_tool_calls=parallel)
    text, finish = _generate(engine, request)
    assert finish == "stop"
    content, calls, _ = ToolCallReader("required").message(text, finish)
    assert content is None and calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.name in ("get_weather", "get_time") and call.id.startswith("call_")
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER)
        else:
            assert json.loads(call.arguments) == {}  # no parameters: no arguments
    response = ChatFormat("required").response(
        "r", "m", [ChoiceResult(0, text, finish, None)], None
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == [c.name for c in calls]


def test_a_named_function_gets_its_arguments(engine):
    request = _request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    text, finish = _generate(engine, request)
    jsonschema.validate(json.loads(text), WEATHER)
    fmt = ChatFormat(request.tool_choice_name())
    choice = fmt.response("r", "m", [ChoiceResult(0, text, finish, None)], None).choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's, for a named function
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(
        call.function.arguments
    ) == json.loads(text)


def test_a_stream_holds_the_call_and_sends_it_whole():
    fmt = ChatFormat("get_weather")
    assert fmt.chunk("r", "m", 0, '{"city": ', None, None) is None
    assert fmt.chunk("r", "m", 1, "[", None, None) is None  # choices are held apart
    last = fmt.chunk("r", "m", 0, '"Oslo", "celsius": true}', "stop", None)
    [call] = last.choices[0].delta.tool_calls
    assert call.index == 0 and json.loads(call.function.arguments) == {
        "city": "Oslo",
        "celsius": True,
    }
    assert last.choices[0].delta.content is None and last.choices[0].finish_reason == "stop"
    cut = ChatFormat("required").chunk("r", "m", 0, '[{"name": "get_', "length", None)
    assert (
        cut.choices[0].delta.content == '[{"name": "get_'
        and cut.choices[0].finish_reason == "length"
    )
    plain = ChatFormat().chunk("r", "m", 0, "hi", None, None)
    assert plain.choices[0].delta.content == "hi"


def test_the_tools_and_earlier_calls_are_rendered_by_a_template_that_reads_them():
    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    tok.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "<{{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}{{ m.content }}"
        "{% endfor %}"
    )
    request = ChatCompletionRequest(
        **{**CHAT, "tool_choice": "none"},
    )
    request.messages.append(
        ChatMessage(
            role="assistant",
            tool_calls=[
                {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        )
    )
    ids = apply_chat_template(tok, request.chat_messages(), request.template_tools())
    text = tok.decode(ids)
    assert text.startswith("[get_weather][get_time]") and "<get_weather Oslo>" in text


def test_earlier_calls_reach_the_chat_template_as_objects():
    request = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        ],
        tools=TOOLS,
        tool_choice="none",
    )
    messages = request.chat_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"}
    assert request.sampling_params(8).grammar is None
    assert [t["function"]["name"] for t in request.template_tools()] == ["get_weather", "get_time"]


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "celsius": true}}'


@pytest.mark.parametrize(
    "parser,text,content,names",
    [
        ("hermes", f"Checking.{HERMES_CALL}", "Checking.", ["get_weather"]),
        (
            "hermes",
            f"{HERMES_CALL}\n{HERMES_CALL.replace('Oslo', 'Lima')}",
            None,
            ["get_weather"] * 2,
        ),
        ("hermes", 'Hi <tool_call>{"name": broken', 'Hi <tool_call>{"name": broken', []),
        ("hermes", "No call needed.", "No call needed.", []),
        ("llama3_json", LLAMA_CALL, None, ["get_weather"]),
        (
            "llama3_json",
            f'{LLAMA_CALL}; {{"name": "get_time", "parameters": {{}}}}',
            None,
            ["get_weather", "get_time"],
        ),
        ("llama3_json", "It is cold.", "It is cold.", []),
    ],
)
def test_auto_reads_calls_in_the_model_familys_format(parser, text, content, names):
    got_content, calls, finish = ToolCallReader("auto", parser).message(text, "stop")
    assert got_content == content and [c.name for c in calls] == names
    assert finish == ("tool_calls" if names else "stop")
    if names:
        assert json.loads(calls[0].arguments) in ({"city": "Oslo", "celsius": True}, {})


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_auto_grammar_holds_an_opened_call_to_a_tool(engine, parser):
    """Free text passes (an engine's greedy output under it is its free output), a call
    in the family's format passes, a call to no tool or with bad arguments does not."""
    grammars = engine.grammars
    params = _request(tool_choice="auto").sampling_params(96, tool_parser=parser)

    def accepts(text: str) -> bool:
        return grammars.state_for(params).matcher.accept_string(text)

    call = HERMES_CALL if parser == "hermes" else LLAMA_CALL
    assert accepts(f"Let me look that up. {call}")
    assert not accepts(call.replace("get_weather", "get_stock"))
    assert not accepts(call.replace('"celsius": true', '"celsius": 3'))
    free, _ = _generate(engine, _request(tool_choice="none"))
    constrained, _ = _generate(engine, _request(tool_choice="auto"), parser)
    assert constrained == free and CALL_FORMATS[parser].trigger not in free


def test_an_auto_stream_sends_text_until_a_call_opens():
    fmt = ChatFormat("auto", "hermes")
    first = fmt.chunk("r", "m", 0, "Checking <tool", None, None)
    assert first.choices[0].delta.content == "Checking "  # "<tool" might open a call
    assert fmt.chunk("r", "m", 0, '_call>\n{"name": "get_weather", ', None, None) is None
    rest = HERMES_CALL[len('<tool_call>\n{"name": "get_weather", ') :]
    last = fmt.chunk("r", "m", 0, rest, "stop", None)
    [call] = last.choices[0].delta.tool_calls
    assert call.function.name == "get_weather" and last.choices[0].finish_reason == "tool_calls"
    plain = ChatFormat("auto", "hermes")
    assert plain.chunk("r", "m", 0, "a < b", None, None).choices[0].delta.content == "a < b"


def test_a_structural_tag_response_format_is_compiled(engine):
    tag = CALL_FORMATS["hermes"].structural_tag({"get_weather": WEATHER})
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], response_format=tag
    )
    params = request.sampling_params(8)
    assert (
        params.grammar.kind == "structural_tag" and params.grammar.field == "response_format.format"
    )
    assert engine.grammars.state_for(params).matcher.accept_string(f"ok {HERMES_CALL}")
    with pytest.raises(ValueError, match='send format exactly when type is "structural_tag"'):
        ChatCompletionRequest(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "structural_tag"},
        )
    assert isinstance(SamplingParams(grammar=params.grammar).grammar.source, str)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not one",
        ),
        ({"tool_choice": "required", "regex": "a+"}, "a tool call is the output's constraint"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "two tools share a name"),
        ({"tools": None, "tool_choice": "required"}, "needs tools to choose from"),
    ],
)
def test_bad_tool_requests_name_tool_choice(extra, message):
    with pytest.raises(ValueError, match="tool_choice") as err:
        ChatCompletionRequest(**{**CHAT, **extra})
    assert message in str(err.value)
    assert _request().tool_choice_name() == "auto"  # OpenAI's default with tools
