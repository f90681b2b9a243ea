"""A tool call, and the parsers that find calls in a model's text: "hermes"
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) and "llama3_json" (JSON `{"name": ...,
"parameters": ...}`, optionally after `<|python_tag|>`, several separated by ";"), and the JSON
array of a "required" answer."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_PARSERS = ("hermes", "llama3_json")
JSONObject = dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def delta(self, index: int) -> JSONObject:
        """The whole call as one streamed `tool_calls` delta."""
        return {
            "index": index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def message(self) -> JSONObject:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call_of(obj: object, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(content before the first call, the calls); text without a well-formed call is all content."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        try:
            call = _call_of(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return text[:start].rstrip(), calls


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """Calls when the whole text is JSON call objects (after an optional <|python_tag|>), separated
    by ";"; otherwise all content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_of(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return "", calls


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a "required" answer (a JSON array the grammar enforced); [] if it was cut short."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    calls = [_call_of(x, "parameters") for x in items] if isinstance(items, list) else []
    return [c for c in calls if c is not None]


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
# Where a call may begin in a free ("auto") answer: text from there on is held back while streaming.
MARKERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{")}
