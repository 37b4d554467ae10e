"""Tool calls: ``tool_choice`` ``"required"`` or a named function becomes a grammar over
the tools' schemas; an engine's constrained output reads back as OpenAI ``tool_calls``
whose arguments validate; a stream holds a calling choice's text and sends each call
whole; bad tool requests are refused naming ``tool_choice``."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from specd.workers.openai_protocol import ChatCompletionRequest, ChatFormat, ChoiceResult
from specd.workers.testing import DEMO_TARGET, collect, demo_prompts, start_engine
from specd.workers.tool_calls import ToolCallReader

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "now"}},
]
CHAT = dict(model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS)


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(**CHAT, **extra)


@pytest.fixture(scope="module")
def engine():
    engine = start_engine(DEMO_TARGET)
    yield engine
    engine.shutdown()


def _generate(engine, request: ChatCompletionRequest) -> tuple[str, str]:
    params = request.sampling_params(96)
    _, text, last = asyncio.run(collect(engine, "t", demo_prompts(1, 40)[0], **_fields(params)))
    return text, last.finish_reason.value


def _fields(params) -> dict:
    return {f: getattr(params, f) for f in params.__slots__}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_name_a_tool_and_validate(engine, parallel):
    request = _request(tool_choice="required", parallel_tool_calls=parallel)
    text, finish = _generate(engine, request)
    assert finish == "stop"
    calls = ToolCallReader("required").calls(text)
    assert calls and (parallel or len(calls) == 1)
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


@pytest.mark.parametrize(
    "extra,message",
    [
        ({}, '"auto" (the default with tools) is not supported'),
        ({"tool_choice": "auto"}, '"auto" (the default with tools) is not supported'),
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
