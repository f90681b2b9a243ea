"""One choice's text turned into content and tool calls as it streams (`ToolOutput`), the calls of
a "required" answer streamed as they are written (`RequiredCalls`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from minisgl.entrypoints.openai.tools.calls import (
    MARKERS,
    PARSERS,
    JSONObject,
    ToolCall,
    is_json,
    parse_required,
)

# ---- one choice's output --------------------------------------------------------------------------

# A call of a "required" answer up to its arguments: `[{"name": "f", "parameters": ` (or `}, {` after
# the call before), in the order the grammar writes the keys.
_REQUIRED_HEAD = re.compile(r'\s*\}?\s*[\[,]\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"parameters"\s*:\s*')


@dataclass
class RequiredCalls:
    """The calls of a "required" answer as they are written: each call's head once its name is
    complete, then its arguments (the JSON text of `parameters`) in pieces as they come."""

    ids: list[str] = field(default_factory=list)
    _pos: int = 0  # where the scan goes on in the answer
    _args: bool = False  # inside a call's arguments
    _began: bool = False  # ... and past their first character
    _depth: int = 0
    _string: bool = False
    _escape: bool = False

    def feed(self, text: str) -> list[JSONObject]:
        """The deltas of the answer so far (`text`: all of it) not sent yet."""
        out: list[JSONObject] = []
        while True:
            if not self._args:
                m = _REQUIRED_HEAD.match(text, self._pos)
                if m is None:
                    return out
                self._pos, self._args, self._began = m.end(), True, False
                self.ids.append(ToolCall("", "").id)
                head = {"index": len(self.ids) - 1, "id": self.ids[-1], "type": "function"}
                out.append({"tool_calls": [{**head, "function": {"name": m.group(1), "arguments": ""}}]})
            while not self._began and self._pos < len(text) and text[self._pos].isspace():
                self._pos += 1
            start = self._pos
            ended = self._scan(text)
            if self._pos > start:
                piece = {"index": len(self.ids) - 1, "function": {"arguments": text[start : self._pos]}}
                out.append({"tool_calls": [piece]})
            if not ended:
                return out
            self._args = False

    def _scan(self, text: str) -> bool:
        """Move through the arguments' JSON value; True once it ended."""
        while self._pos < len(text):
            c = text[self._pos]
            if not self._began:
                self._began, self._depth, self._string = True, 0, c == '"'
                self._depth = 1 if c in "{[" else 0
            elif self._string:
                self._string = self._escape or c != '"'
                self._escape = not self._escape and c == "\\"
                if not self._string and self._depth == 0:
                    self._pos += 1
                    return True
            elif c == '"':
                self._string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]" or (self._depth == 0 and (c == "," or c.isspace())):
                if self._depth == 0:  # a number, true, false or null ended before this character
                    return True
                self._depth -= 1
                if self._depth == 0:
                    self._pos += 1
                    return True
            self._pos += 1
        return False


@dataclass
class ToolOutput:
    """One choice's text turned into content and tool calls, as it streams: `feed` returns the
    deltas that can be sent now, `finish` the rest and the finish reason."""

    mode: str  # "auto", "required" or "function" (the one named `function` is forced)
    parser: str = "hermes"
    function: str = ""
    _held: str = ""
    _calling: bool = False
    _sent_head: bool = False
    _call_id: str = field(default_factory=lambda: ToolCall("", "").id)
    _required: RequiredCalls = field(default_factory=RequiredCalls)
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""

    @property
    def named(self) -> bool:
        return self.mode == "function"

    def feed(self, text: str) -> list[JSONObject]:
        if self.named:  # the text is the arguments: streamed as they come
            head = [] if self._sent_head else [self._head()]
            self._sent_head = True
            self._held += text
            return head + ([{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else [])
        self._held += text
        if self.mode == "required":  # the calls, streamed as they are written
            return self._required.feed(self._held)
        if self._calling:
            return []
        start = self._marker_start(self._held)
        if start is not None:  # a call may begin here: hold back from it on
            out, self._held, self._calling = self._held[:start], self._held[start:], True
        else:
            keep = self._partial_marker(self._held)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        self.content += out
        return [{"content": out}] if out else []

    def finish(self, finish_reason: str) -> tuple[list[JSONObject], str]:
        """The remaining deltas and the choice's finish reason ("tool_calls" when calls were made and
        the model stopped by itself)."""
        held, self._held = self._held, ""
        if self.named:
            deltas = [] if self._sent_head else [self._head()]
            if finish_reason == "length" and not is_json(held):  # cut short: no call (what was
                self.content += held  # streamed of it is all there is; finish_reason says why)
                return deltas, finish_reason
            self.calls = [ToolCall(self.function, held, self._call_id)]
        else:
            if self.mode == "required":  # an answer cut short is no call: its text is the content
                return self._finish_required(held, finish_reason)
            else:
                content, self.calls = PARSERS[self.parser](held)
            self.content += content
            deltas = [{"content": content}] if content else []
            if self.calls:
                deltas.append({"tool_calls": [c.delta(i) for i, c in enumerate(self.calls)]})
        return deltas, ("tool_calls" if self.calls and finish_reason == "stop" else finish_reason)

    def _finish_required(self, held: str, finish_reason: str) -> tuple[list[JSONObject], str]:
        """The calls of a "required" answer (those streamed keep their ids); cut short, none: its
        text is the content (not streamed again: what was streamed of the calls is all there is)."""
        ids = self._required.ids
        calls = parse_required(held)
        self.calls = [
            ToolCall(c.name, c.arguments, ids[i]) if i < len(ids) else c for i, c in enumerate(calls)
        ]
        if not self.calls:
            self.content += held
            return ([] if ids else [{"content": held}] if held else []), finish_reason
        rest = [c.delta(i) for i, c in enumerate(self.calls) if i >= len(ids)]
        return ([{"tool_calls": rest}] if rest else []), (
            "tool_calls" if finish_reason == "stop" else finish_reason
        )

    def _head(self) -> JSONObject:
        call = {"index": 0, "id": self._call_id, "type": "function"}
        return {"tool_calls": [{**call, "function": {"name": self.function, "arguments": ""}}]}

    def _marker_start(self, text: str) -> int | None:
        if self.parser == "llama3_json":  # a call is the whole answer: it starts the text
            if self.content:
                return None
            stripped = text.lstrip()
            hit = any(stripped.startswith(m) for m in MARKERS["llama3_json"])
            return len(text) - len(stripped) if hit else None
        at = text.find("<tool_call>")
        return at if at >= 0 else None

    def _partial_marker(self, text: str) -> int:
        """How many trailing characters of `text` could begin a marker (held back)."""
        if self.parser == "llama3_json":
            if self.content:
                return 0
            return len(text) if not text.strip() or "<|python_tag|>".startswith(text.strip()) else 0
        for n in range(min(len(text), len("<tool_call>") - 1), 0, -1):
            if "<tool_call>".startswith(text[-n:]):
                return n
        return 0
