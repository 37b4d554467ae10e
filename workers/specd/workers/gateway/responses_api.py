"""OpenAI's Responses API (``POST /v1/responses``) over the chat pipeline.

A request becomes a chat completion request (`to_chat`): ``instructions`` the system
message, ``input`` (a string, or message, ``function_call`` and
``function_call_output`` items) the messages, flat function ``tools`` chat tools,
``text.format`` the ``response_format``, ``max_output_tokens`` the token limit.  The
chat answer then becomes a response (`response_object`: ``reasoning``, ``message`` and
``function_call`` output items), and a chat stream becomes Responses events
(`ResponseEvents`: ``response.created`` ... ``response.output_text.delta`` ...
``response.completed``).  Stored responses (``store``, the default) are kept in the
gateway's memory (`ResponseStore`, the newest `MAX_STORED`): ``GET`` and ``DELETE
/v1/responses/{id}`` read and drop them, and ``previous_response_id`` continues one
(its conversation is sent again; the prefix cache and cache-aware routing find its KV).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specd.workers.runner.logprobs import MAX_TOP_LOGPROBS

MAX_STORED = 4096  # responses kept for GET and previous_response_id (oldest go first)
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (the fields specd serves; others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: int = 0  # extension, as on chat completions
    speculative: bool = True  # extension, as on chat completions


class InvalidItem(ValueError):
    """A request field specd cannot turn into chat: ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat messages (consecutive function calls join one assistant turn)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        if not isinstance(item, dict):
            raise InvalidItem(f"input[{i}]", "must be an object (a message or an item)")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text_of(item, i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":  # earlier reasoning is not sent back to the model
            raise InvalidItem(
                f"input[{i}].type",
                f"{kind!r} is not served (message, function_call, function_call_output)",
            )
    return messages


def _text_of(item: dict[str, Any], i: int) -> str:
    content = item.get("content")
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise InvalidItem(f"input[{i}].content", "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidItem(
                f"input[{i}].content[{j}].type", f"{kind!r} is not served (text only)"
            )
        texts.append(part.get("text", ""))
    return "".join(texts)


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request body for ``body`` after ``history`` (the messages of
    the response it continues)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": system + history + input_messages(body),
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
        "priority": body.priority,
        "speculative": body.speculative,
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    optional = {
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
    }
    chat |= {k: v for k, v in optional.items() if v is not None}
    if body.top_logprobs is not None:
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs}
    if body.tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    if isinstance(body.tool_choice, dict):
        chat["tool_choice"] = {
            "type": "function",
            "function": {"name": body.tool_choice.get("name")},
        }
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if (fmt := (body.text or {}).get("format")) is not None:
        chat["response_format"] = _response_format(fmt)
    return chat


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidItem(f"tools[{i}].type", f"{tool.get('type')!r} is not served (function)")
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in fields if k in tool}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


# -- the answer ------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id or _id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part] if text or status == "completed" else [],
    }


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {
        "type": "reasoning",
        "id": item_id or _id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(call: dict[str, Any], status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict]:
    """A chat answer's message as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    items += [call_item(call) for call in message.get("tool_calls") or []]
    return items


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def response_object(
    rid: str,
    body: ResponsesRequest,
    output: list[dict],
    finish: str | None,
    usage: dict[str, Any] | None,
    created: int,
    status: str | None = None,
) -> dict[str, Any]:
    """The Response (``status`` in_progress while streaming; else from ``finish``)."""
    incomplete = finish == "length"
    status = status or ("incomplete" if incomplete else "completed")
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}},
        "store": body.store,
        "metadata": body.metadata or {},
        "usage": usage_of(usage),
    }


def conversation_after(output: list[dict]) -> list[dict[str, Any]]:
    """The assistant turn ``output`` adds to a conversation (reasoning left out, as a
    chat history leaves it out)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


class ResponseStore:
    """Stored responses and their conversations (newest `MAX_STORED`, in memory), each
    with its owner (`ownership.Owners.of`: None without API keys).  Another owner finds
    nothing, exactly as for an unknown id."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict], str | None]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict], owner: str | None = None) -> None:
        self._items[response["id"]] = (response, conversation, owner)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, owner: str | None = None) -> tuple[dict, list[dict]] | None:
        item = self._items.get(rid)
        if item is None or item[2] != owner:
            return None
        return item[0], item[1]

    def delete(self, rid: str, owner: str | None = None) -> bool:
        if self.get(rid, owner) is None:
            return False
        del self._items[rid]
        return True


# -- streaming --------------------------------------------------------------------------


class ResponseEvents:
    """A chat stream's SSE events as Responses events, in order (``sequence_number``)."""

    def __init__(self, rid: str, body: ResponsesRequest, created: int):
        self.rid, self.body, self.created = rid, body, created
        self.output: list[dict] = []
        self._open: dict | None = None  # the item receiving deltas (reasoning or message)
        self._text = ""
        self._seq = 0
        self.finish: str | None = None
        self.usage: dict | None = None
        self.failed = False

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _response(self, status: str | None = None) -> dict:
        return response_object(
            self.rid, self.body, self.output, self.finish, self.usage, self.created, status
        )

    async def translate(self, chat_events: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        async for raw in chat_events:
            text = raw.decode() if isinstance(raw, bytes) else raw
            for line in text.splitlines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    for event in [] if self.failed else self._close():
                        yield event
                    yield self._ending()
                    continue
                for event in self._chunk(json.loads(data)):
                    yield event

    def _ending(self) -> str:
        """The last event: the whole response, failed, cut by the limit, or completed."""
        if self.failed:
            return self._event("response.failed", response=self._response("failed"))
        if self.finish == "length":
            return self._event("response.incomplete", response=self._response())
        return self._event("response.completed", response=self._response())

    def _chunk(self, chunk: dict) -> list[str]:
        if "error" in chunk:
            self.failed = True
            err = chunk["error"]
            return [self._event("error", code=str(err.get("code")), message=err.get("message"),
                                param=err.get("param"))]  # fmt: skip
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._close() + self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                events += self._close()
        return events

    def _text_delta(self, kind: str, text: str) -> list[str]:
        events = []
        if self._open is not None and self._open["type"] != kind:
            events += self._close()
        index = len(self.output)
        if self._open is None:
            item = reasoning_item("") if kind == "reasoning" else message_item("", "in_progress")
            if kind == "reasoning":
                item["content"] = []
            self._open, self._text = item, ""
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(self._event("response.content_part.added", item_id=item["id"],
                                          output_index=index, content_index=0, part=part))  # fmt: skip
        self._text += text
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=self._open["id"], output_index=index,
                                  content_index=0, delta=text, **extra))  # fmt: skip
        return events

    def _close(self) -> list[str]:
        """Finish the item receiving text: its done events; it joins the output."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = len(self.output), []
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            item = reasoning_item(self._text, item["id"])
            events.append(self._event("response.reasoning_text.done", **ids, text=self._text))
        else:
            item = message_item(self._text, "completed", item["id"])
            events.append(self._event("response.output_text.done", **ids, text=self._text,
                                      logprobs=[]))  # fmt: skip
            events.append(self._event("response.content_part.done", **ids,
                                      part=item["content"][0]))  # fmt: skip
        self.output.append(item)
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _call(self, call: dict) -> list[str]:
        index = len(self.output)
        pending = call_item(call, "in_progress") | {"arguments": ""}
        done = pending | {"arguments": call["function"]["arguments"], "status": "completed"}
        ids = {"item_id": pending["id"], "output_index": index}
        self.output.append(done)
        return [
            self._event("response.output_item.added", output_index=index, item=pending),
            self._event("response.function_call_arguments.delta", **ids, delta=done["arguments"]),
            self._event(
                "response.function_call_arguments.done", **ids, arguments=done["arguments"]
            ),
            self._event("response.output_item.done", output_index=index, item=done),
        ]


def created_now() -> int:
    return int(time.time())
