"""The Responses API (``/v1/responses``) through the `openai` client, over the chat
pipeline of a real gateway: text, instructions and previous_response_id against chat
completions of the same conversation, streaming events, function calls and their
outputs, stored responses, and refusals naming the Responses field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import ray

from specd.devtools.testing import running_gateway
from specd.devtools.tiny_checkpoint import make_tiny_checkpoint
from specd.workers.config import spec_for_model
from specd.workers.gateway.api_keys import ApiKeys

MODEL = "tiny"
GREEDY = {"temperature": 0, "max_output_tokens": 12}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Lima"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("responses-tiny"))
    spec = spec_for_model(str(model), replicas=1, model={"name": MODEL}, resources={"cpu": 0.5})
    ray.init(num_cpus=2, include_dashboard=False, namespace="specd-test-responses")
    try:
        with running_gateway(spec, "responses") as gw:
            yield gw
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)


def chat_text(client, messages) -> str:
    done = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_completion_tokens=12
    )
    return done.choices[0].message.content


def test_text_instructions_and_a_continued_conversation_match_chat(client):
    first = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.output_text == chat_text(client, [{"role": "user", "content": "Hello"}])
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 12 and first.usage.input_tokens > 0

    second = client.responses.create(
        model=MODEL, input="More", instructions="Be brief", previous_response_id=first.id, **GREEDY
    )
    conversation = [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"},
    ]
    assert second.output_text == chat_text(client, conversation)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the conversation's KV


def test_streaming_events_add_up_to_the_response(client):
    whole = client.responses.create(model=MODEL, input="Stream me", **GREEDY)
    events = list(client.responses.create(model=MODEL, input="Stream me", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    for kind in ("output_item.added", "content_part.added", "output_text.done", "output_item.done"):
        assert f"response.{kind}" in kinds
    # a streamed response is stored too, and continues like any other
    follow = client.responses.create(
        model=MODEL, input="Next", previous_response_id=events[-1].response.id, **GREEDY
    )
    assert follow.status == "incomplete"


def test_function_calls_and_their_outputs(client):
    called = client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_output_tokens=160,
    )  # fmt: skip
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and called.status == "completed"
    assert all(json.loads(c.arguments)["city"] in ("Oslo", "Lima") for c in calls)
    answer = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER], tool_choice="none",
        **GREEDY,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "12 C"}
               for c in calls],
    )  # fmt: skip
    assert answer.output_text and answer.status == "incomplete"
    streamed = list(
        client.responses.create(
            model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_output_tokens=160, stream=True,
        )
    )  # fmt: skip
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]


def test_stored_responses_can_be_read_and_deleted(client, gateway):
    made = client.responses.create(model=MODEL, input="Keep me", **GREEDY)
    assert client.responses.retrieve(made.id).output_text == made.output_text
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    unstored = client.responses.create(model=MODEL, input="Forget me", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id, **GREEDY)
    assert err.value.body["param"] == "previous_response_id"


def test_a_stored_response_belongs_to_the_api_key_that_made_it(gateway):
    """With API keys a stored response is its maker's: another key reading, deleting or
    continuing it gets the 404 of an unknown id, and the maker goes on."""
    keys = ApiKeys(("key-a", "key-b"))
    with running_gateway(gateway.spec, "responseskeyed", api_keys=keys) as keyed:
        a, b = (
            openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key, max_retries=0)
            for key in ("key-a", "key-b")
        )
        made = a.responses.create(model=MODEL, input="Mine", **GREEDY)
        unknown = f"resp_{'0' * 32}"

        def refusal(call, rid: str) -> dict:
            with pytest.raises(openai.NotFoundError) as err:
                call(rid)
            return json.loads(json.dumps(err.value.body).replace(rid, "<id>"))

        for call in (
            b.responses.retrieve,
            b.responses.delete,
            lambda rid: b.responses.create(
                model=MODEL, input="x", previous_response_id=rid, **GREEDY
            ),
        ):
            assert refusal(call, made.id) == refusal(call, unknown)
        assert a.responses.retrieve(made.id).output_text == made.output_text
        after = a.responses.create(
            model=MODEL, input="more", previous_response_id=made.id, **GREEDY
        )
        assert after.status in ("completed", "incomplete")
        a.responses.delete(made.id)
        assert refusal(a.responses.retrieve, made.id) == refusal(a.responses.retrieve, unknown)


BAD = {
    "image input": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
    ),
    "hosted tool": ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    "unknown item": ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    "bad role": ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    "bad role after instructions": (
        {
            "instructions": "Be brief",
            "input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}],
        },
        "input[1].role",
    ),
    "bad limit": ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    "schema format without schema": (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
        "text.format.schema",
    ),
    "content that is not text": ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    "an item that is not one": ({"input": ["hello"]}, "input[0]"),
}


@pytest.mark.parametrize(("extra", "param"), BAD.values(), ids=BAD.keys())
def test_what_cannot_be_served_is_refused_naming_the_field(gateway, extra, param):
    r = httpx.post(f"{gateway.url}/v1/responses", json={"model": MODEL, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def _translated(chat_chunks: list[dict | str]) -> list[dict]:
    """A chat stream's SSE (dicts as data events, strings as raw data) through
    `ResponseEvents` -> the Responses events' payloads."""
    import asyncio

    from specd.workers.gateway.responses_api import ResponseEvents, ResponsesRequest

    async def chat():
        for chunk in chat_chunks:
            yield f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"

    async def run():
        body = ResponsesRequest(model=MODEL, input="x")
        return [e async for e in ResponseEvents("resp_1", body, 0).translate(chat())]

    events = asyncio.run(run())
    assert all(e.startswith("event: ") for e in events)
    return [json.loads(e.split("data: ", 1)[1]) for e in events]


def delta(finish=None, **fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}


def test_a_stream_with_reasoning_text_and_a_call_keeps_openais_order():
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}  # fmt: skip
    events = _translated([
        delta(reasoning_content="hm"), delta(reasoning_content="m"), delta(content="Hi"),
        delta("tool_calls", tool_calls=[call]),
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}},
        "[DONE]",
    ])  # fmt: skip
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "hmm"
    assert final["usage"]["total_tokens"] == 7 and final["status"] == "completed"


def test_a_failed_stream_ends_with_response_failed():
    error = {"error": {"message": "replica lost", "type": "internal_error", "code": 500}}
    events = _translated([delta(content="Hi"), error, "[DONE]"])
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
