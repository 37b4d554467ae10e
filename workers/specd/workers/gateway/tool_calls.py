"""Tool calls on chat completions, made by structured output so any model calls them in
valid JSON.

* A named function (``{"type": "function", "function": {"name": ...}}``): the output is
  that function's arguments, held to its ``parameters`` schema.
* ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, each
  one of the tools with its own schema (one item when ``parallel_tool_calls`` is false);
  the shape vLLM uses for the same choice.
* ``"auto"`` (with ``spec.toolCalls.parser``): free text in which the model may open a
  call in its family's format (``CALL_FORMATS``); an xgrammar structural tag lets the
  text run free until a call opens, then holds the call to a tool's name and schema.
* ``"none"``: plain text, the tools still shown to the chat template.

The gateway turns the output back into OpenAI's ``tool_calls`` (``ToolCallReader``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from specd.workers.types import Grammar

# OpenAI: "omitting parameters defines a function with an empty parameter list"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=_call_id)


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a model family writes a call in free text: ``open``, then a JSON object with
    ``name`` and ``args_key``, then ``close`` (``open`` empty: bare JSON)."""

    open: str
    close: str
    args_key: str

    @property
    def trigger(self) -> str:
        """What starts a call in the text."""
        return self.open or '{"name": '

    def structural_tag(self, tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """xgrammar's structural tag: free text, and any call held to its tool's schema."""
        gap = "\n" if self.open else ""
        tags = [
            {
                "type": "tag",
                "begin": f'{self.open}{gap}{{"name": "{name}", "{self.args_key}": ',
                "content": {"type": "json_schema", "json_schema": schema},
                "end": f"}}{gap}{self.close}",
            }
            for name, schema in tools.items()
        ]
        fmt = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags}
        return {"type": "structural_tag", "format": fmt}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside calls, stripped; None if nothing is left) and the calls."""
        decoder, calls, kept, pos = json.JSONDecoder(), [], [], 0
        while (start := text.find(self.trigger, pos)) >= 0:
            kept.append(text[pos:start])
            body = _skip_space(text, start + len(self.open))
            try:
                call, end = decoder.raw_decode(text, body)
            except ValueError:
                call, end = None, 0
            if not (
                isinstance(call, dict)
                and isinstance(call.get("name"), str)
                and isinstance(call.get(self.args_key), dict)
            ):
                pos = start
                break
            calls.append(ToolCall(call["name"], json.dumps(call[self.args_key])))
            pos = _skip_space(text, end)
            if self.close and text.startswith(self.close, pos):
                pos += len(self.close)
            while text.startswith(";", _skip_space(text, pos)):  # Llama's separator
                pos = _skip_space(text, pos) + 1
        kept.append(text[pos:])
        return "".join(kept).strip() or None, calls


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


CALL_FORMATS = {
    "hermes": CallFormat("<tool_call>", "</tool_call>", "arguments"),  # Qwen 2.5/3, Hermes
    "llama3_json": CallFormat("", "", "parameters"),  # Llama 3.1+ JSON tool calling
}


def tool_grammar(
    tools: dict[str, dict[str, Any]], choice: str | None, parallel: bool, parser: str | None
) -> Grammar | None:
    """The grammar for ``choice`` (``"required"``, ``"auto"``, a function's name, or
    None: free text) over ``tools`` (each function's name -> its parameters schema)."""
    if choice is None:
        return None
    if choice == "auto":
        return Grammar(
            "structural_tag", json.dumps(CALL_FORMATS[parser].structural_tag(tools)), "tools"
        )
    if choice != "required":
        return Grammar("json_schema", json.dumps(tools[choice]), "tool_choice")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
        }
        for name, schema in tools.items()
    ]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return Grammar("json_schema", json.dumps(array), "tools")


class ToolCallReader:
    """Reads one choice's output as the calls its grammar made (``choice`` as in
    ``tool_grammar``; ``parser``: the call format of ``"auto"``); an output cut short
    (``max_tokens``) is left as text."""

    def __init__(self, choice: str, parser: str | None = None):
        self.choice = choice
        self.format = CALL_FORMATS[parser] if choice == "auto" and parser else None

    def message(self, text: str, finish: str) -> tuple[str | None, list[ToolCall], str]:
        """(content, calls, finish reason) of a finished choice."""
        if finish != "stop":
            return text, [], finish
        if self.format is not None:
            content, calls = self.format.parse(text)
            return content, calls, "tool_calls" if calls else finish
        try:
            value = json.loads(text)
        except ValueError:
            return text, [], finish
        if self.choice != "required":  # OpenAI answers "stop" for a named function
            return None, [ToolCall(self.choice, json.dumps(value))], finish
        calls = [ToolCall(c["name"], json.dumps(c["parameters"])) for c in value]
        return None, calls, "tool_calls"

    def streamable(self, text: str) -> tuple[str, str]:
        """(text a stream may send now, text to hold): everything from where a call
        opens, or might be opening, is held; a forced call is held whole."""
        if self.format is None:
            return "", text
        trigger = self.format.trigger
        if (start := text.find(trigger)) >= 0:
            return text[:start], text[start:]
        for k in range(min(len(trigger) - 1, len(text)), 0, -1):
            if trigger.startswith(text[-k:]):
                return text[:-k], text[-k:]
        return text, ""
