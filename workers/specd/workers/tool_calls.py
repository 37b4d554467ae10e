"""Tool calls on chat completions: ``tools`` with ``tool_choice`` ``"required"`` or a named
function, made by structured output, so any model calls them in valid JSON.

* A named function (``{"type": "function", "function": {"name": ...}}``): the output is
  that function's arguments, held to its ``parameters`` schema.
* ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, each
  one of the tools with its own schema (one item when ``parallel_tool_calls`` is false);
  the shape vLLM uses for the same choice.
* ``"none"``: plain text, the tools still shown to the chat template.

The gateway turns the output back into OpenAI's ``tool_calls`` (``ToolCallReader``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from specd.workers.engine.types import Grammar

# OpenAI: "omitting parameters defines a function with an empty parameter list"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def with_id(self) -> ToolCall:
        return ToolCall(self.name, self.arguments, f"call_{uuid.uuid4().hex[:24]}")


def tool_grammar(
    tools: dict[str, dict[str, Any]], choice: str | None, parallel: bool
) -> Grammar | None:
    """The grammar that makes the output a call: ``tools`` maps each function's name to
    its parameters schema; ``choice`` is ``"required"``, a function's name, or None
    (``"none"``: free text)."""
    if choice is None:
        return None
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
    ``tool_grammar``); an output cut short (``max_tokens``) is left as text."""

    def __init__(self, choice: str):
        self.choice = choice

    def calls(self, text: str) -> list[ToolCall] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.choice != "required":
            return [ToolCall(self.choice, json.dumps(value)).with_id()]
        return [ToolCall(c["name"], json.dumps(c["parameters"])).with_id() for c in value]

    def finish_reason(self, finish: str) -> str:
        """OpenAI's: ``tool_calls`` when the model chose to call, ``stop`` when the
        request named the function."""
        return "tool_calls" if self.choice == "required" and finish == "stop" else finish
