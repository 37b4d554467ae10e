"""The gateway over real HTTP and a real local Ray: 2 engine actors of a tiny checkpoint.

One Ray cluster and one gateway (uvicorn in a thread, free loopback port) are shared by
the module.  The `specd serve` smoke test comes first and runs before that cluster
exists, because it starts its own local Ray the way a user would (one cluster at a time
on a small machine).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import signal
import stat
import threading
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from specd.devtools.testing import (
    DEMO_TARGET,
    in_loop,
    running_gateway,
    specd_serve,
    with_thinking_tags,
)
from specd.devtools.tiny_checkpoint import SPECIAL_TOKENS, make_tiny_checkpoint
from specd.devtools.tiny_draft import make_tiny_eagle
from specd.workers.config import spec_for_model
from specd.workers.contracts import AdminStatus, GatewayHealth
from specd.workers.gateway.api_keys import ApiKeys
from specd.workers.pool.controller import PoolController
from specd.workers.runner.thinking_gate import thinking_tag_ids
from specd.workers.types import GenerateRequest, SamplingParams

MODEL = "tiny"
CONTEXT = 2048  # long enough for streams that outlive an actor kill
GREEDY = {"temperature": 0, "max_tokens": 24}
# float32 log-probs of one request sent twice round differently: the second may start
# on its cached prefix (its prefill runs in other shapes; measured up to 1.3e-6) or land
# on the other replica, whose CPU linear layouts (timed at load, see cpu_linear.py) may
# sum in another order (measured 1.9e-5 with a busy CPU)
REPEAT_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(
        make_tiny_checkpoint(tmp_path_factory.mktemp("gw-tiny"), max_position_embeddings=CONTEXT)
    )


def _wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# -- `specd serve` as a user runs it (its own local Ray; before the module cluster) --------


@pytest.mark.slow  # in CI's second pass: keeps the default suite under 15 minutes
def test_serve_cli_smoke(model_dir, tmp_path):
    """`specd serve` of a speculative deployment (tiny EAGLE tree, overlap on).  Without
    SPECD_ADMIN_TOKEN it writes a random admin token to a 0600 file under the user's state
    folder and says where; ``POST /admin/release`` needs that token."""
    draft = make_tiny_eagle(tmp_path / "draft", model_dir)
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: smoke}\n"
        f"spec:\n  model: {{path: {model_dir}, name: {MODEL}}}\n  replicas: 1\n  resources: {{cpu: 0.5}}\n"
        f"  draft: {{path: {draft}}}\n  speculative: {{numSteps: 2, topk: 2, numDraftTokens: 4}}\n"
        "  kvCache: {pageSize: 4}\n  scheduler: {overlap: true}\n"
        "  samplingDefaults: {temperature: 0}\n"
    )
    token_file = tmp_path / "state" / "specd" / "admin-token"
    with specd_serve(spec_file, "smoke", tmp_path / "state") as served:
        url, lines = served.url, served.lines
        _wait_for(
            lambda: any(f"curl {url}/v1/completions" in ln for ln in lines), 5, "the example curl"
        )
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        r = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello", **GREEDY}, timeout=30
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == GREEDY["max_tokens"]
        assert (
            usage["spec_verify_steps"] + usage["spec_accepted_tokens"] == GREEDY["max_tokens"] - 1
        )
        # no temperature in the request: the spec's default (greedy), not OpenAI's 1.0
        unset = {"model": MODEL, "prompt": "Hello", "max_tokens": GREEDY["max_tokens"]}
        by_default = httpx.post(f"{url}/v1/completions", json=unset, timeout=30).json()
        assert by_default["choices"][0]["text"] == r.json()["choices"][0]["text"]
        actors = httpx.get(f"{url}/admin/status", timeout=10).json()["actors"]
        assert [a["sampling_defaults"] for a in actors] == [{"temperature": 0}]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]
        text = client.completions.create(model=MODEL, prompt="Hello", **GREEDY).choices[0].text
        assert text == r.json()["choices"][0]["text"]
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, **GREEDY
        )
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
        assert f"specd: admin token written to {token_file}" in "".join(lines)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert token not in "".join(lines)  # where it is, not what it is
        release = f"{url}/admin/release"
        assert httpx.post(release, json={}, timeout=10).status_code == 401
        with_token = {"Authorization": f"Bearer {token}"}
        assert httpx.post(release, headers=with_token, timeout=10).status_code == 415
        released = httpx.post(release, json={}, headers=with_token, timeout=60)
        assert released.status_code == 200 and len(released.json()["released"]) == 1
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(timeout=60) == 0, served.output
    assert "Traceback" not in served.output, served.output


# -- the module's cluster and gateway ---------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-test", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def gateway(serve_gateway, model_dir):
    spec = spec_for_model(model_dir, replicas=2, model={"name": MODEL}, resources={"cpu": 0.5})
    return serve_gateway(spec, "gwtest")


@pytest.fixture()
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        yield client


def sse_events(lines) -> list:
    """Parsed ``data:`` payloads up to and including ``[DONE]`` (as the string)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream(http: httpx.Client, path: str, body: dict) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def but_cached(usage: dict) -> dict:
    """``usage`` without ``prompt_tokens_details``: a repeated request may start on its
    prompt's cached prefix, by as much as the replica serving it holds."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def chunk_text(event: dict) -> str:
    choice = event["choices"][0]
    return choice["text"] if "text" in choice else choice["delta"].get("content", "")


ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": "Hello, how are"}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}]}),
}


@pytest.mark.parametrize("path,body", ENDPOINTS.values(), ids=ENDPOINTS.keys())
def test_stream_matches_non_stream(http, path, body):
    body = {"model": MODEL, **body, **GREEDY}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    full = r.json()
    choice = full["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] + GREEDY["max_tokens"]
    cached = full["usage"]["prompt_tokens_details"]["cached_tokens"]  # an earlier test's
    assert 0 <= cached < full["usage"]["prompt_tokens"]
    assert {"spec_verify_steps", "spec_accepted_tokens"} <= set(full["usage"])

    events = stream(http, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert "".join(chunk_text(e) for e in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert but_cached(usage_chunk["usage"]) == but_cached(full["usage"])
    assert len({e["id"] for e in events[:-1]}) == 1
    if "messages" in body:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_openai_client(gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]

    done = client.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    assert (
        done.choices[0].finish_reason == "length"
        and done.usage.completion_tokens == GREEDY["max_tokens"]
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="Hello", stream=True, **GREEDY)
    )
    assert streamed == done.choices[0].text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert chat.choices[0].message.role == "assistant"
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    ):
        pieces += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage.completion_tokens == GREEDY["max_tokens"]

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    several = client.chat.completions.create(model=MODEL, messages=messages, n=2, **GREEDY)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].message.content == several.choices[1].message.content  # greedy
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, n=33)
    assert err.value.body["param"] == "n"


CHOICE = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
}


class Pick(pydantic.BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


def test_structured_output_through_the_openai_client(gateway):
    """A JSON schema (chat, streamed too) and a regex (completions' extra body) shape
    even a random model's output, which then ends with a stop."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": CHOICE}}
    messages = [{"role": "user", "content": "Pick a color."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, temperature=0, max_tokens=96
    )
    assert chat.choices[0].finish_reason == "stop"
    answer = json.loads(chat.choices[0].message.content)
    assert set(answer) == {"ok", "color"} and answer["color"] in ("red", "green", "blue")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format=fmt,
            temperature=0,
            max_tokens=96,
            stream=True,
        )
    )
    assert streamed == chat.choices[0].message.content
    parsed = client.chat.completions.parse(  # the SDK's helper: a pydantic model's strict schema
        model=MODEL, messages=messages, response_format=Pick, temperature=0, max_tokens=96
    )
    assert isinstance(parsed.choices[0].message.parsed, Pick)
    done = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=32,
        temperature=1.0,
        seed=3,
        extra_body={"regex": "(yes|no)!"},
    )
    assert done.choices[0].finish_reason == "stop" and done.choices[0].text in ("yes!", "no!")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Lima"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
        },
    },
}


def test_tool_calls_through_the_openai_client(gateway):
    """``required`` and a named function come back as the SDK's tool calls (streamed
    too: the SDK reassembles them), and the call goes back as a turn of the chat."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    ask = dict(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=160)
    done = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
    assert done.choices[0].finish_reason == "tool_calls"
    calls = done.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert json.loads(calls[0].function.arguments)["city"] in ("Oslo", "Lima")
    named = {"type": "function", "function": {"name": "get_weather"}}
    one = client.chat.completions.create(**ask, tool_choice=named)
    assert one.choices[0].finish_reason == "stop"
    [call] = one.choices[0].message.tool_calls
    streamed = [
        d.tool_calls
        for chunk in client.chat.completions.create(**ask, tool_choice=named, stream=True)
        for d in [chunk.choices[0].delta]
        if d.tool_calls
    ]
    assert [[c.function.arguments for c in s] for s in streamed] == [[call.function.arguments]]
    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 C"},
    ]
    reply = client.chat.completions.create(
        **{**ask, "messages": follow_up, "max_tokens": 8}, tool_choice="none"
    )
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_tokenize_counts_what_a_request_would_send(http):
    """/tokenize gives the ids (and count) a completion or a chat request sends the
    model: the same count as that request's usage; /detokenize inverts it."""
    prompt = {"model": MODEL, "prompt": "Hello, how are"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
    for path, body in ((CMPL, prompt), (CHAT, chat)):
        got = http.post("/tokenize", json=body).json()
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] == CONTEXT
        sent = http.post(path, json={**body, **GREEDY}).json()["usage"]["prompt_tokens"]
        assert got["count"] == sent
    tokens = http.post("/tokenize", json=prompt).json()["tokens"]
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert text.endswith("Hello, how are") and text.startswith("<s>")  # special tokens kept
    for path, body, param in (
        ("/tokenize", {**prompt, "messages": chat["messages"]}, "messages"),
        ("/tokenize", {"model": MODEL}, "messages"),
        ("/detokenize", {"model": MODEL, "tokens": [10**6]}, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, "model"),
    ):
        r = http.post(path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


SAMPLED = {"temperature": 1.0, "max_tokens": 12, "seed": 40}


def test_n_choices_are_seeded_requests_of_their_own(http):
    """``n``: choice i is what one request with ``seed + i`` gives; the response holds
    them by index, usage counts the prompt once and every choice's tokens; a stream
    interleaves the choices' chunks by index and adds up to the same."""
    body = {"model": MODEL, "prompt": "Hello, how are", "n": 3, **SAMPLED}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    full = r.json()
    texts = [c["text"] for c in full["choices"]]
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert len(set(texts)) > 1  # seeds 40, 41, 42 draw differently
    for i, text in enumerate(texts):
        one = {**body, "n": 1, "seed": SAMPLED["seed"] + i}
        alone = http.post("/v1/completions", json=one).json()
        assert alone["choices"][0]["text"] == text
    assert full["usage"]["completion_tokens"] == 3 * SAMPLED["max_tokens"]
    assert full["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]

    events = stream(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and but_cached(events[-2]["usage"]) == but_cached(full["usage"])
    by_index = {i: "" for i in range(3)}
    for event in events[:-2]:
        [choice] = event["choices"]
        by_index[choice["index"]] += choice["text"]
    assert list(by_index.values()) == texts

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2, **SAMPLED}
    openings = [
        e
        for e in stream(http, "/v1/chat/completions", chat)[:-1]
        if "role" in e["choices"][0]["delta"]
    ]
    assert sorted(e["choices"][0]["index"] for e in openings) == [0, 1]


def test_penalties_min_tokens_and_logit_bias_reach_the_engine(http):
    """OpenAI's ``presence_penalty`` / ``frequency_penalty`` / ``logit_bias`` and vLLM's
    ``repetition_penalty`` / ``min_p`` / ``min_tokens`` are served: a +100 bias makes
    greedy pick its token every time, penalties change what greedy repeats."""
    prompt = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello, how are"}).json()
    favoured = max(prompt["tokens"])
    body = {"model": MODEL, "prompt": "Hello, how are", **GREEDY, "ignore_eos": True}
    biased = http.post("/v1/completions", json={**body, "logit_bias": {str(favoured): 100}})
    assert biased.status_code == 200, biased.text
    want = http.post("/detokenize", json={"model": MODEL, "tokens": [favoured] * 24}).json()
    assert biased.json()["choices"][0]["text"] == want["prompt"]

    def distinct_tokens(extra: dict) -> int:
        r = http.post("/v1/completions", json={**body, "logprobs": 0, **extra})
        assert r.status_code == 200, r.text
        return len(set(r.json()["choices"][0]["logprobs"]["tokens"]))

    plain = distinct_tokens({})
    assert distinct_tokens({"frequency_penalty": 2, "presence_penalty": 2}) > plain
    assert distinct_tokens({"repetition_penalty": 3.0, "min_p": 0.1, "min_tokens": 4}) > plain


def test_completion_logprobs(http):
    """``logprobs: n`` on /v1/completions: OpenAI's parallel lists, one entry per token;
    each top_logprobs entry holds the top n and the chosen token; greedy picks the top
    one; a token holding part of a character shows as ``bytes:\\x..``; the stream's
    pieces add up to the whole response's."""
    body = {"model": MODEL, "prompt": "Hello, how are", "logprobs": 3, **GREEDY}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    full, text = r.json()["choices"][0]["logprobs"], r.json()["choices"][0]["text"]
    n = GREEDY["max_tokens"]
    assert len(full["tokens"]) == len(full["token_logprobs"]) == len(full["top_logprobs"]) == n
    assert full["text_offset"][0] == 0
    for i, (token, value, top) in enumerate(
        zip(full["tokens"], full["token_logprobs"], full["top_logprobs"], strict=True)
    ):
        assert value <= 0 and len(top) == 3 and top[token] == value
        assert value == max(top.values())  # greedy: the most likely token
        if not token.startswith("bytes:") and token not in SPECIAL_TOKENS:  # (not in the text)
            assert text[full["text_offset"][i] :].startswith(token)

    chunks = stream(http, "/v1/completions", body)[:-1]
    pieces = [c["choices"][0]["logprobs"] for c in chunks]
    joined = {key: [v for p in pieces for v in p[key]] for key in full}
    assert joined["tokens"] == full["tokens"] and joined["text_offset"] == full["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(full["token_logprobs"], abs=REPEAT_ATOL)
    for got, want in zip(joined["top_logprobs"], full["top_logprobs"], strict=True):
        assert got == pytest.approx(want, abs=REPEAT_ATOL)
    assert (
        http.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0][
            "logprobs"
        ]
        is None
    )


def test_echo_scores_the_prompt(http):
    """``echo`` with ``logprobs`` and ``max_tokens: 1``, as lm-evaluation-harness scores
    a text: the prompt leads the text and the token lists, its first token without a
    log-prob; the generated token's log-prob equals the one without echo; the stream
    adds up to the same; ``echo`` alone just leads with the prompt."""
    prompt = "Hello, how are"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, **GREEDY}
    body["max_tokens"] = 1
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
    assert len(lp["tokens"]) == usage["prompt_tokens"] + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])
    plain = http.post("/v1/completions", json={**body, "echo": False}).json()["choices"][0]
    assert plain["logprobs"]["token_logprobs"] == pytest.approx(
        lp["token_logprobs"][-1:], abs=REPEAT_ATOL
    )
    assert choice["text"] == prompt + plain["text"]

    chunks = stream(http, "/v1/completions", body)[:-1]
    assert "".join(chunk_text(c) for c in chunks) == choice["text"]
    joined = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert joined[0] is None
    assert joined[1:] == pytest.approx(lp["token_logprobs"][1:], abs=REPEAT_ATOL)

    by_ids = {**body, "prompt": [5, 6, 7], "logprobs": None}
    echoed = http.post("/v1/completions", json=by_ids).json()["choices"][0]
    alone = http.post("/v1/completions", json={**by_ids, "echo": False}).json()["choices"][0]
    assert echoed["logprobs"] is None and echoed["text"].endswith(alone["text"])
    assert len(echoed["text"]) > len(alone["text"])  # the decoded prompt leads


def test_chat_logprobs_through_the_openai_client(gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == GREEDY["max_tokens"]
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert (entry.token, entry.logprob) == (
            entry.top_logprobs[0].token,
            entry.top_logprobs[0].logprob,
        )
    # the tokens' exact bytes add up to the text, characters split across tokens included
    text = b"".join(bytes(e.bytes) for e in content).decode(errors="replace")
    assert text == chat.choices[0].message.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, logprobs=True, top_logprobs=2, stream=True, **GREEDY
        )
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    for got, want in zip(streamed, content, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=REPEAT_ATOL)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
    plain = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, **GREEDY)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * len(content)
    assert (
        client.chat.completions.create(model=MODEL, messages=messages, **GREEDY).choices[0].logprobs
        is None
    )


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
A = {"model": MODEL, "prompt": "x"}
M = {"model": MODEL}
LONG = [5] * CONTEXT

BAD_INPUTS = {
    "malformed json": (CMPL, "{not json", 400, None),
    "not an object": (CMPL, [1, 2], 400, None),
    "missing prompt": (CMPL, M, 400, "prompt"),
    "missing model": (CMPL, {"prompt": "x"}, 400, "model"),
    "prompt wrong type": (CMPL, {**A, "prompt": 7}, 400, "prompt"),
    "two prompts": (CMPL, {**A, "prompt": ["a", "b"]}, 400, "prompt"),
    "max_tokens 0": (CMPL, {**A, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens string": (CMPL, {**A, "max_tokens": "many"}, 400, "max_tokens"),
    "n=33": (CMPL, {**A, "n": 33}, 400, "n"),
    "n=0": (CMPL, {**A, "n": 0}, 400, "n"),
    "n=2 in a session": (CMPL, {**A, "n": 2, "session_id": "x.y"}, 400, "n"),
    "temperature -1": (CMPL, {**A, "temperature": -1}, 400, "temperature"),
    "top_p 0": (CMPL, {**A, "top_p": 0}, 400, "top_p"),
    "five stops": (CMPL, {**A, "stop": list("abcde")}, 400, "stop"),
    "logprobs 21": (CMPL, {**A, "logprobs": 21}, 400, "logprobs"),
    "logprobs negative": (CMPL, {**A, "logprobs": -1}, 400, "logprobs"),
    "echo with logprobs in a session": (
        CMPL,
        {**A, "echo": True, "logprobs": 1, "session_id": "x.y"},
        400,
        "logprobs",
    ),
    "top_logprobs without logprobs": (
        CHAT,
        {**M, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    "top_logprobs 21": (
        CHAT,
        {**M, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    "presence_penalty 3": (CMPL, {**A, "presence_penalty": 3}, 400, "presence_penalty"),
    "frequency_penalty -3": (CMPL, {**A, "frequency_penalty": -3}, 400, "frequency_penalty"),
    "repetition_penalty 0": (CMPL, {**A, "repetition_penalty": 0}, 400, "repetition_penalty"),
    "min_p 2": (CMPL, {**A, "min_p": 2}, 400, "min_p"),
    "min_tokens > max_tokens": (CMPL, {**A, "min_tokens": 9, "max_tokens": 8}, 400, "min_tokens"),
    "logit_bias key not an id": (CMPL, {**A, "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    "logit_bias 101": (CMPL, {**A, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    "logit_bias out of vocab": (CMPL, {**A, "logit_bias": {"1000000": 1}}, 400, "logit_bias"),
    "wrong model": (CMPL, {**A, "model": "gpt-4"}, 404, "model"),
    "prompt too long": (CMPL, {**A, "prompt": LONG}, 400, "prompt"),
    "prompt too long, stream": (CMPL, {**A, "prompt": LONG, "stream": True}, 400, "prompt"),
    "token id out of vocab": (CMPL, {**A, "prompt": [10**6]}, 400, "prompt"),
    "empty messages": (CHAT, {**M, "messages": []}, 400, "messages"),
    "no role": (CHAT, {**M, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    "image content": (
        CHAT,
        {**M, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    "unknown path": ("/v1/embeddings", {**M, "input": "x"}, 404, None),
    "bad json schema": (
        CHAT,
        {
            **M,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no"}}},
        },
        400,
        "response_format.json_schema.schema",
    ),
    "response_format xml": (
        CMPL,
        {**A, "response_format": {"type": "xml"}},
        400,
        "response_format.type",
    ),
    "bad regex": (CMPL, {**A, "regex": "(a"}, 400, "regex"),
    "two output constraints": (CMPL, {**A, "regex": "a", "ebnf": 'root ::= "a"'}, 400, None),
    "grammar with ignore_eos": (CMPL, {**A, "regex": "a+", "ignore_eos": True}, 400, "ignore_eos"),
    "tools with auto": (
        CHAT,
        {
            **M,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        400,
        "tool_choice",
    ),
    "tool_choice naming no tool": (
        CHAT,
        {
            **M,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
    ),
    "session_id, sessions disabled": (CMPL, {**A, "session_id": "x.y"}, 400, "session_id"),
    "priority under fcfs": (CMPL, {**A, "priority": 1}, 400, "priority"),
    "template kwargs the server sets": (
        CHAT,
        {
            **M,
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"add_generation_prompt": False},
        },
        400,
        "chat_template_kwargs",
    ),
    "priority not an int": (CMPL, {**A, "priority": "high"}, 400, "priority"),
    "speculative not a bool": (CMPL, {**A, "speculative": "maybe"}, 400, "speculative"),
    "chat session_id, sessions disabled": (
        CHAT,
        {**M, "messages": [{"role": "user", "content": "x"}], "session_id": "x.y"},
        400,
        "session_id",
    ),
}


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_an_openai_error(http, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"] and error["type"] and error["code"] == status
    if param:
        assert param in error["message"]


@pytest.mark.parametrize("method,path", [("POST", "/v1/sessions"), ("DELETE", "/v1/sessions/x.y")])
def test_session_routes_refused_when_sessions_are_disabled(http, method, path):
    r = http.request(method, path)
    assert r.status_code == 400, r.text
    assert "spec.sessions.enabled" in r.json()["error"]["message"]


def test_unknown_fields_are_ignored(http):
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "vendor_field": {"a": 1}},
    )
    assert r.status_code == 200, r.text


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == CONTEXT
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json()["ready_replicas"] == 2


def test_admin_status_lists_ready_actors(http):
    status = http.get("/admin/status").json()
    assert status["desired_replicas"] == status["ready_replicas"] == 2 and status["converged"]
    actors = status["actors"]
    assert [a["state"] for a in actors] == ["ready", "ready"]
    assert len({a["name"] for a in actors}) == 2
    for actor in actors:
        assert actor["config_hash"] == status["config_hash"]
        assert actor["load"]["healthy"] is True and actor["load"]["replica"] == actor["name"]
        assert {"running", "queued", "queued_tokens", "kv_usage"} <= set(actor["load"])
    # the real engines' statuses, through their actors and the pool: the typed contract
    # the operator parses the document with, field for field
    typed = AdminStatus.model_validate(status)
    assert typed.model_dump(mode="json") == status
    assert all(a.load is not None and a.load.healthy for a in typed.actors)
    health = GatewayHealth.model_validate(http.get("/health").json())
    assert health.status == "ok" and health.reason is None


def metric_families(http) -> dict:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    lines = r.text.splitlines()
    for kind in ("HELP", "TYPE"):  # merged by name: each family described once
        names = [ln.split()[2] for ln in lines if ln.startswith(f"# {kind} ")]
        assert len(names) == len(set(names)), f"duplicate # {kind}"
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def test_metrics_merge_every_replica(http, gateway):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    families = metric_families(http)
    replicas = {r.name for r in gateway.pool.ready()}
    for name in (
        "specd_requests_running",
        "specd_kv_tokens_total",
        "specd_time_to_first_token_seconds",
    ):
        assert {s.labels["replica"] for s in families[name].samples} == replicas, name
    codes = {
        s.labels["code"]
        for s in families["specd_gateway_requests"].samples
        if s.name.endswith("_total")
    }
    assert "200" in codes
    states = {s.labels["state"]: s.value for s in families["specd_gateway_replicas"].samples}
    assert states["ready"] == 2


def test_cache_aware_routing_follows_the_cached_prefix(http, gateway):
    """A prompt goes to the replica holding its prefix even while that replica is the
    busier one (a least-load router would pick the idle one, which never saw it)."""
    pool = gateway.pool
    before = pool.routed_by_reason()
    shared = [(7 * i) % 300 + 20 for i in range(96)]

    def ask(tail: list[int], **extra) -> dict:
        body = {"model": MODEL, "prompt": [*shared, *tail], **GREEDY, "max_tokens": 4, **extra}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]

    assert ask([1, 2])["prompt_tokens_details"]["cached_tokens"] == 0  # nobody has it yet
    out: dict = {}
    body = {"prompt": [*shared, 3], "max_tokens": 400, "stream_options": {"include_usage": True}}
    busy = threading.Thread(target=_long_stream, args=(gateway.url, out, "x", body), daemon=True)
    busy.start()
    _wait_for(lambda: out.get("x:started"), 30, "the long stream to start")
    assert sorted(r.inflight for r in pool.ready()) == [0, 1]
    assert ask([4, 5])["prompt_tokens_details"]["cached_tokens"] >= 80  # same replica
    busy.join(timeout=120)
    usage = out["x"][-2]["usage"]  # the stream too had gone where the prefix was
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 80, usage
    assert pool.routed_by_reason()["prefix"] - before.get("prefix", 0) == 2
    routing = http.get("/admin/status").json()["routing"]
    assert routing["policy"] == "cacheAware" and routing["routed"]["prefix"] >= 2
    routed = metric_families(http)["specd_gateway_routed_requests"].samples
    assert {s.labels["reason"] for s in routed} >= {"prefix", "load"}
    assert {s.labels["replica"] for s in routed} <= {r.name for r in pool.ready()}


def test_a_routing_change_applies_without_rolling_a_replica(http, gateway):
    pool = gateway.pool
    old, names = pool.spec, {r.name for r in pool.ready()}
    new = old.model_copy(update={"routing": old.routing.model_copy(update={"policy": "leastLoad"})})
    try:
        in_loop(gateway, pool.update_spec, new)
        assert http.get("/admin/status").json()["routing"]["policy"] == "leastLoad"
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **GREEDY})
        assert reply.status_code == 200
        assert pool.converged() and {r.name for r in pool.ready()} == names  # nothing rolled
    finally:
        in_loop(gateway, pool.update_spec, old)


def test_auto_tool_choice_follows_the_configured_parser_without_a_roll(gateway):
    """``spec.toolCalls.parser`` set live: ``auto`` (the SDK's default with tools) is
    served, a model that opens no call answers in text, streamed alike; nothing rolls."""
    pool = gateway.pool
    old, names = pool.spec, {r.name for r in pool.ready()}
    new = old.model_copy(
        update={"tool_calls": old.tool_calls.model_copy(update={"parser": "hermes"})}
    )
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=16,
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**ask)
    assert (
        err.value.body["param"] == "tool_choice"
        and "spec.toolCalls.parser" in err.value.body["message"]
    )
    try:
        in_loop(gateway, pool.update_spec, new)
        done = client.chat.completions.create(**ask)
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**ask, stream=True)
        )
        assert pool.converged() and {r.name for r in pool.ready()} == names  # nothing rolled
    finally:
        in_loop(gateway, pool.update_spec, old)
    message = done.choices[0].message
    if message.tool_calls:  # a random model may open a call: it is then a valid one
        assert all(c.function.name == "get_weather" for c in message.tool_calls)
        assert done.choices[0].finish_reason == "tool_calls"
    else:
        assert message.content == streamed and done.choices[0].finish_reason == "length"


def test_reasoning_parser_set_live_splits_chat_output(gateway):
    """``spec.reasoning.parser`` set live (nothing rolls): deepseek_r1 thinks first, so a
    random model's output that never closes its thinking is all ``reasoning_content``,
    streamed alike; a request held to a grammar cannot think with this tokenizer (no
    single-token <think>), so its JSON is content; qwen3 without a <think> opening
    leaves it all content."""
    pool = gateway.pool
    old, names = pool.spec, {r.name for r in pool.ready()}
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], **GREEDY)

    def parser(name):
        return old.model_copy(
            update={"reasoning": old.reasoning.model_copy(update={"parser": name})}
        )

    plain = client.chat.completions.create(**ask).choices[0].message.content
    try:
        in_loop(gateway, pool.update_spec, parser("deepseek_r1"))
        message = client.chat.completions.create(**ask).choices[0].message
        assert message.content is None and message.reasoning_content == plain
        streamed = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True)]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in streamed) == plain
        assert not any(d.content for d in streamed)
        held = client.chat.completions.create(**ask, response_format={"type": "json_object"})
        assert held.choices[0].message.content and not getattr(
            held.choices[0].message, "reasoning_content", None
        )
        in_loop(gateway, pool.update_spec, parser("qwen3"))
        message = client.chat.completions.create(**ask).choices[0].message
        assert message.content == plain and not getattr(message, "reasoning_content", None)
        assert pool.converged() and {r.name for r in pool.ready()} == names  # nothing rolled
    finally:
        in_loop(gateway, pool.update_spec, old)


@pytest.mark.slow
def test_structured_output_waits_for_the_thinking(serve_gateway, tmp_path_factory):
    """A tokenizer with single-token <think> and </think> (the demo target, two entries
    renamed): under deepseek_r1 a request held to a schema thinks first, unguided (its
    reasoning is the free request's), and only its answer follows the schema; a bias on
    </think> ends the thinking at once, and the answer validates, streamed alike."""
    folder = with_thinking_tags(DEMO_TARGET, tmp_path_factory.mktemp("gw-thinker"))
    spec = spec_for_model(
        str(folder), model={"name": "thinker"}, resources={"cpu": 0.5},
        reasoning={"parser": "deepseek_r1"},
    )  # fmt: skip
    gw = serve_gateway(spec, "gwthink")
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
    schema = {
        "type": "object",
        "properties": {"mood": {"enum": ["calm", "busy"]}, "ok": {"type": "boolean"}},
        "required": ["mood", "ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": schema}}
    ask = dict(model="thinker", messages=[{"role": "user", "content": "How are you?"}])
    ask |= {"temperature": 0, "max_tokens": 48}
    free = client.chat.completions.create(**ask).choices[0].message
    held = client.chat.completions.create(**ask, response_format=fmt).choices[0].message
    thought = getattr(held, "reasoning_content", None)
    assert thought and thought == getattr(free, "reasoning_content", None)
    if held.content is not None:  # the demo model closed its thinking by itself
        jsonschema.validate(json.loads(held.content), schema)
    end = str(thinking_tag_ids(AutoTokenizer.from_pretrained(folder))[1])  # </think>
    quick = dict(**ask, response_format=fmt, logit_bias={end: 30})
    answered = client.chat.completions.create(**quick).choices[0].message
    assert not getattr(answered, "reasoning_content", None)
    jsonschema.validate(json.loads(answered.content), schema)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**quick, stream=True)]
    assert "".join(d.content or "" for d in deltas if d) == answered.content


def aborts(http) -> float:
    return sum(s.value for s in metric_families(http)["specd_aborts"].samples)


def test_client_disconnect_aborts_in_engine(http, gateway):
    before = aborts(http)
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": CONTEXT - 16,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # the stream is closed after one event; the engine must abort, not finish ~2000 tokens
    _wait_for(lambda: aborts(http) >= before + 1, 20, "a streaming abort")

    body = {**body, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=1.0)
    _wait_for(lambda: aborts(http) >= before + 2, 20, "a non-streaming abort")

    for streaming in (True, False):  # n = 3: every choice's engine request is aborted
        base = aborts(http)
        several = {**body, "n": 3, "temperature": 1.0, "stream": streaming}
        if streaming:
            with http.stream("POST", "/v1/completions", json=several) as r:
                assert next(r.iter_lines()).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=several, timeout=1.0)
        _wait_for(lambda base=base: aborts(http) >= base + 3, 20, "three aborts")
    _wait_for(
        lambda: all(r.inflight == 0 for r in gateway.pool.ready()), 10, "no request in flight"
    )


async def test_pool_backs_off_a_replica_that_cannot_start(ray_cluster, tmp_path):
    """A model folder that breaks in the actor: reported, retried with backoff, no crash."""
    (tmp_path / "config.json").write_text("{}")
    spec = spec_for_model(str(tmp_path), replicas=1, resources={"cpu": 0.5})
    pool = PoolController(spec, name="broken", health_interval_s=0.2)
    await pool.start()
    try:
        for _ in range(300):
            if any(e.event == "dead" for e in pool.events):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        failures = [e for e in pool.events if e.event == "dead"]
        assert failures and "failed to start" in failures[0].detail, list(pool.events)
        assert len(failures) <= 2  # 2s backoff after the first failure
        assert pool.status().ready_replicas == 0 and pool.pick() is None
    finally:
        await pool.stop(drain_timeout_s=1)


@pytest.mark.slow  # in CI's second pass: keeps the default suite under 15 minutes
async def test_replacement_controller_adopts_running_actors(ray_cluster, model_dir):
    """A gateway that goes away leaves its detached engine actors running; the next
    controller of the same deployment adopts them by name instead of starting new ones,
    and requests on them still work."""
    spec = spec_for_model(model_dir, replicas=1, model={"name": MODEL}, resources={"cpu": 0.5})
    first = PoolController(spec, name="adopt", health_interval_s=0.2)
    await first.start()
    second = PoolController(spec, name="adopt", health_interval_s=0.2)
    try:
        assert await first.wait_converged(90)
        [old] = first.ready()
        await first.detach()  # the old gateway is gone; its actor is not
        await second.start()
        assert await second.wait_converged(30)
        [adopted] = second.ready()
        assert (adopted.name, adopted.actor_name) == (old.name, old.actor_name)
        assert [e.event for e in second.events] == ["adopted"]
        request = GenerateRequest("adopted", (5, 6, 7), SamplingParams(max_tokens=4))
        deltas = [d async for d in second.stream(adopted, request)]
        assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == 4
    finally:
        await second.stop(drain_timeout_s=1)
        await first.stop(drain_timeout_s=1)
    assert not [n for n in ray.util.list_named_actors() if n.startswith("specd-adopt-")]


@pytest.mark.slow  # in CI's second pass: keeps the default suite under 15 minutes
def test_pod_gateway_leaves_its_actors_to_the_next_one_and_release_kills_them(
    ray_cluster, model_dir
):
    """`specd gateway` (a Kubernetes pod) detaches when it stops, so the next pod adopts
    the warm actors; ``POST /admin/release`` (the operator's delete finalizer) needs the
    admin token and a JSON body, refuses any browser Origin even with the token, drains
    and kills them, and the pool starts no new ones."""
    spec = spec_for_model(model_dir, replicas=1, model={"name": MODEL}, resources={"cpu": 0.5})
    pod = {"on_stop": "detach", "admin_token": "s3cret"}
    body = {"model": MODEL, "prompt": "Hello", **GREEDY}
    with running_gateway(spec, "podgw", **pod) as first:
        [old] = first.pool.ready()
    assert old.actor_name in ray.util.list_named_actors()  # the pod went, its actor did not
    with (
        running_gateway(spec, "podgw", **pod) as second,
        httpx.Client(base_url=second.url, timeout=60) as http,
    ):
        [adopted] = second.pool.ready()
        assert adopted.actor_name == old.actor_name
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/admin/release", json={}).status_code == 401
        wrong = {"Authorization": "Bearer guess"}
        assert http.post("/admin/release", json={}, headers=wrong).status_code == 401
        token = {"Authorization": "Bearer s3cret"}
        browser = {**token, "Origin": "http://evil.example"}
        refused = http.post("/admin/release", json={}, headers=browser)
        assert refused.status_code == 403 and "Origin" in refused.json()["error"]["message"]
        assert http.get("/admin/status", headers={"Origin": "null"}).status_code == 403
        form = {**token, "Content-Type": "application/x-www-form-urlencoded"}
        assert http.post("/admin/release", content="a=1", headers=form).status_code == 415
        assert http.post("/admin/release", headers=token).status_code == 415
        assert http.get("/admin/status").json()["actors"]  # nothing released so far
        released = {"released": [adopted.name]}
        assert http.post("/admin/release", json={}, headers=token).json() == released
        assert http.post("/admin/release", json={}, headers=token).json() == released
        _wait_for(
            lambda: old.actor_name not in ray.util.list_named_actors(), 30, "the actor killed"
        )
        status = http.get("/admin/status").json()
        assert status["released"] is True and status["actors"] == []
        assert http.post("/v1/completions", json=body).status_code == 503
        time.sleep(1.0)  # several health intervals: the pool does not start a replacement
        assert not [n for n in ray.util.list_named_actors() if n.startswith("specd-podgw-")]


def test_api_keys_guard_the_openai_endpoints_and_rotate_live(ray_cluster, model_dir, tmp_path):
    """With API keys the /v1 paths and tokenize answer only a listed key (401 otherwise,
    OpenAI-shaped, counted); probes, metrics and status stay open; a key file's change
    applies to the next request; the OpenAI client sends its api_key as the bearer."""
    spec = spec_for_model(model_dir, replicas=1, model={"name": MODEL}, resources={"cpu": 0.5})
    key_file = tmp_path / "api-keys"
    key_file.write_text("first\n")
    keys = ApiKeys(("from-env",), path=str(key_file))
    body = {"model": MODEL, "prompt": "Hello", **GREEDY, "max_tokens": 2}
    with (
        running_gateway(spec, "keyed", api_keys=keys, admin_token="adm1n") as gw,
        httpx.Client(base_url=gw.url, timeout=60) as http,
    ):

        def status(path, key=None, method="GET", **kw):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return http.request(method, path, headers=headers, **kw).status_code

        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        error = refused.json()["error"]
        assert error["code"] == 401 and error["type"] == "authentication_error"
        assert error["message"].startswith("missing API key")
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer guess"})
        assert wrong.json()["error"]["message"].startswith("invalid API key")
        assert status("/tokenize", method="POST", json={"model": MODEL, "prompt": "x"}) == 401
        for key in ("first", "from-env"):
            assert status("/v1/completions", key, "POST", json=body) == 200
        for open_path in ("/health", "/version", "/metrics", "/admin/status"):
            assert status(open_path) == 200, open_path
        # the admin token is no API key, and an API key never authorizes /admin
        assert status("/v1/models", "adm1n") == 401
        assert status("/admin/release", "first", "POST", json={}) == 401
        assert http.get("/version").json() == {"version": importlib.metadata.version("specd")}

        key_file.write_text("first\nsecond\n")  # rotate: add, then drop the old key
        assert status("/v1/models", "second") == 200
        key_file.write_text("second\n")
        assert status("/v1/models", "first") == 401 and status("/v1/models", "second") == 200

        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="second")
        assert client.completions.create(**body).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key="first").models.list()
        counts = {
            (s.labels["code"], s.value)
            for f in text_string_to_metric_families(http.get("/metrics").text)
            for s in f.samples
            if s.name == "specd_gateway_requests_total" and s.labels["code"] == "401"
        }
        assert sum(v for _, v in counts) == 7


def test_rate_limits_per_api_key_apply_live(ray_cluster, model_dir):
    """``spec.auth.requestsPerMinute``: each key gets a burst of the limit, then OpenAI's
    429 with Retry-After (the OpenAI client raises RateLimitError), counted; another key
    and the open paths are not held back; a limit lifted live lets the key through."""
    auth = {"requestsPerMinute": 2}
    spec = spec_for_model(
        model_dir, replicas=1, model={"name": MODEL}, resources={"cpu": 0.5}, auth=auth
    )
    keys = ApiKeys(("a", "b"))
    with (
        running_gateway(spec, "limited", api_keys=keys) as gw,
        httpx.Client(base_url=gw.url, timeout=60) as http,
    ):

        def models(key):
            return http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})

        first, second, third = models("a"), models("a"), models("a")
        assert [r.status_code for r in (first, second, third)] == [200, 200, 429]
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second)] == ["1", "0"]
        assert 1 <= int(third.headers["retry-after"]) <= 30
        error = third.json()["error"]
        assert error["code"] == 429 and error["type"] == "rate_limit_exceeded"
        assert "spec.auth.requestsPerMinute" in error["message"]
        assert models("b").status_code == 200 and http.get("/health").status_code == 200
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key="a", max_retries=0).models.list()
        counted = [
            s.value
            for f in text_string_to_metric_families(http.get("/metrics").text)
            for s in f.samples
            if s.name == "specd_gateway_requests_total" and s.labels["code"] == "429"
        ]
        assert sum(counted) == 2
        lifted = gw.pool.spec.model_copy(
            update={"auth": gw.pool.spec.auth.model_copy(update={"requests_per_minute": None})}
        )
        in_loop(gw, gw.pool.update_spec, lifted)
        assert (
            models("a").status_code == 200
            and "x-ratelimit-limit-requests" not in models("a").headers
        )


@pytest.mark.slow
def test_suffix_drafts_for_a_key_only_from_its_own_outputs(ray_cluster, model_dir):
    """SUFFIX behind API keys: the gateway sends each request's key id to the engine.
    Key a's second identical request drafts from its first one's output; key b's drafts
    from its own tokens only, exactly as a's first did (greedy, one at a time).  The
    engine's acceptance counters, as /admin/status reports them, tell which."""
    speculative = {"numSteps": 4, "topk": 1, "numDraftTokens": 5}
    speculative["policy"] = {"costModel": {"enabled": False}}
    spec = spec_for_model(
        model_dir,
        replicas=1,
        model={"name": MODEL},
        resources={"cpu": 0.5},
        draft={"algorithm": "SUFFIX"},
        speculative=speculative,
    )
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 40, "temperature": 0}
    body["ignore_eos"] = True
    with (
        running_gateway(spec, "suffixkeys", api_keys=ApiKeys(("a", "b"))) as gw,
        httpx.Client(base_url=gw.url, timeout=60) as http,
    ):

        def totals() -> tuple[int, int]:
            [actor] = http.get("/admin/status").json()["actors"]
            spec_totals = actor["load"]["speculation"]
            return spec_totals["verify_steps"], spec_totals["accepted_tokens"]

        def accepted(key: str) -> tuple[list, int]:
            verifies, before = totals()
            reply = http.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert reply.status_code == 200, reply.text
            time.sleep(4.5)  # two health probes (every 2 s) after it finished
            after = _wait_for(lambda: (t := totals())[0] > verifies and t, 30, "the counters")
            return reply.json()["choices"][0]["text"], after[1] - before

        (text1, first), (text2, again), (text3, other) = (accepted(k) for k in "aab")
    assert text1 == text2 == text3
    assert again > first + 10
    assert other == first


# -- failures and updates (slow) ----------------------------------------------------------


def _long_stream(url: str, out: dict, key: str, extra: dict | None = None) -> None:
    """Stream a long greedy completion (``extra``: fields of the body to change); record
    the parsed events (or the exception)."""
    body = {
        "model": MODEL,
        "prompt": f"Stream {key}",
        "max_tokens": CONTEXT - 16,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        **(extra or {}),
    }
    try:
        with (
            httpx.Client(base_url=url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            events = []
            for line in r.iter_lines():
                events += sse_events([line])
                out.setdefault(f"{key}:started", True)
            out[key] = events
    except Exception as err:  # recorded for the assertion message
        out[key] = err


@pytest.mark.slow
def test_killed_actor_fails_its_requests_and_is_replaced(http, gateway):
    pool = gateway.pool
    out: dict = {}
    keys = ["a", "b", "c", "d"]
    threads = [
        threading.Thread(target=_long_stream, args=(gateway.url, out, k), daemon=True) for k in keys
    ]
    for key, thread in zip(keys, threads, strict=True):
        thread.start()
        _wait_for(lambda k=key: out.get(f"{k}:started"), 30, f"stream {key} to start")
    busy = {r.name: r.inflight for r in pool.ready()}
    assert sorted(busy.values()) == [2, 2], busy  # the router spread them
    victim = pool.ready()[0]
    ray.kill(ray.get_actor(victim.actor_name, namespace="specd-test"))
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a stream hung after the kill"

    results = [out[k] for k in keys]
    assert not [r for r in results if isinstance(r, Exception)], results
    failed = [r for r in results if any(isinstance(e, dict) and "error" in e for e in r)]
    finished = [r for r in results if r not in failed]
    assert len(failed) == 2 and len(finished) == 2, results
    for events in failed:
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
    for events in finished:
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"

    _wait_for(pool.converged, 60, "a replacement replica")
    names = {r.name for r in pool.ready()}
    assert victim.name not in names and len(names) == 2
    # the replacement carries its slot's restart count; the untouched replica has none
    assert sorted(a.restarts for a in pool.status().actors) == [0, victim.restarts + 1]
    assert (
        http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}
        ).status_code
        == 200
    )


@pytest.mark.slow
def test_rolling_update_and_scaling_drop_no_request(http, gateway):
    pool = gateway.pool
    old = pool.spec
    new = old.model_copy(update={"max_running_requests": old.max_running_requests + 1})
    assert new.config_hash() != old.config_hash()
    stop = threading.Event()
    statuses: list[int] = []

    def traffic() -> None:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            while not stop.is_set():
                r = client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "roll", "max_tokens": 32}
                )
                statuses.append(r.status_code)

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        in_loop(gateway, pool.update_spec, new)
        _wait_for(lambda: pool.converged() and pool.spec is new, 120, "the rolling update")
        assert {a["config_hash"] for a in http.get("/admin/status").json()["actors"]} == {
            new.config_hash()
        }

        in_loop(gateway, pool.update_spec, new.model_copy(update={"replicas": 1}))
        _wait_for(pool.converged, 60, "scale down to 1")
        assert len(pool.ready()) == 1
        in_loop(gateway, pool.update_spec, new)
        _wait_for(pool.converged, 60, "scale back up to 2")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert statuses and set(statuses) == {200}, statuses


def test_the_gateway_runs_on_uvloop_and_parses_http_with_httptools(gateway, http):
    """The serving path's C parts (gateway/event_loop.py, gateway/http_protocol.py):
    both are dependencies, so a fresh install serves with them (httptools with the
    gateway's bound on header bytes); a request is answered on that loop and parser."""
    import uvloop
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert isinstance(gateway.loop, uvloop.Loop)
    protocol = gateway._server.config.http_protocol_class
    assert issubclass(protocol, HttpToolsProtocol) and protocol.__name__ == "BoundedHttpTools"
    assert http.get("/health").status_code == 200
