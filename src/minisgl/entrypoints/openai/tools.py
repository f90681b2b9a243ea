"""Tool calling: the prompt side (tools in the chat template, or in a Hermes-style system prompt for
templates without tool support), the grammars that enforce `tool_choice` "required" and a named
function, and the parsers that turn the model's text into OpenAI `tool_calls`.

`tool_choice` (as vLLM implements it):
- "none": tools are left out of the prompt and the output is plain text;
- "auto" (the default with tools): the model may answer or call tools in its own format, which the
  family's parser (`--tool-call-parser`, or chosen from the chat template) recognises;
- "required": the output is held by a grammar to a JSON array of one or more `{"name", "parameters"}`
  calls (parallel calls), each `parameters` valid for its function's schema;
- a named function: the output is held to that function's parameters schema, and is its arguments.

Parsers: "hermes" (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen, Hermes, and the
fallback prompt used for templates without tool support such as SmolLM2's) and "llama3_json"
(Llama 3's JSON `{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`, several
separated by ";").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl.grammar import check_schema, json_schema_grammar

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


# ---- the chat template ----------------------------------------------------------------------------


def read_chat_template(model_dir: str | Path) -> str:
    """The model's chat template as text (chat_template.jinja, or tokenizer_config.json's), "" if
    none; read from the files, without loading the tokenizer."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    try:
        template = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return ""
    if isinstance(template, list):  # named templates: the default one, else the first
        named = {t.get("name"): t.get("template", "") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), "")
    return template if isinstance(template, str) else ""


def template_takes_tools(template: str) -> bool:
    """Whether the template renders a `tools` list (else tools go into a system prompt here)."""
    return "tools" in template


def choose_parser(template: str, flag: str = "auto") -> str:
    """--tool-call-parser, or for "auto" the family the template's format belongs to."""
    if flag != "auto":
        if flag not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be auto or one of {TOOL_PARSERS}, got {flag!r}")
        return flag
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolFormat:
    """How this server's model takes tools: the parser of its calls, and whether its chat template
    renders tools itself (else they go into a Hermes-style system prompt, see fallback_messages)."""

    parser: str = "hermes"
    in_template: bool = False

    @classmethod
    def of(cls, model_dir: str | Path, flag: str = "auto") -> ToolFormat:
        template = read_chat_template(model_dir)
        return cls(choose_parser(template, flag), template_takes_tools(template))

    def prompt(self, messages: list[JSONObject], tools: list[JSONObject]) -> tuple[list[dict[str, str]], str]:
        """The chat prompt as the tokenizer takes it: messages whose values are strings (an
        assistant's tool_calls as JSON text), and the tools as a JSON list ("" for none)."""
        history_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if not self.in_template and (tools or history_calls):
            return fallback_messages(messages, tools, self.parser), ""
        wire = [{k: v if isinstance(v, str) else json.dumps(v) for k, v in m.items()} for m in messages]
        return wire, json.dumps(tools) if tools else ""


# ---- the prompt -----------------------------------------------------------------------------------

_HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available tools: "
    "<tools>\n{tools}\n</tools>\nFor each function call return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)
_LLAMA3_SYSTEM = (
    "You have access to the following functions:\n{tools}\nTo call a function, respond only with a JSON "
    'object of the form {{"name": <function-name>, "parameters": <args-dict>}}; separate several calls '
    'with ";". Otherwise answer normally.'
)


def fallback_messages(
    messages: list[JSONObject], tools: list[JSONObject], parser: str
) -> list[dict[str, str]]:
    """`messages` as plain {role, content} turns for a template without tool support: the tools
    described in the system prompt (the first system message, or a new one), assistant tool calls
    written in the parser's format, tool results as user turns in <tool_response> tags."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = [_call_text(c, parser) for c in m["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
            out.append({"role": m["role"], "content": content})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        template = _HERMES_SYSTEM if parser == "hermes" else _LLAMA3_SYSTEM
        text = template.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call_text(call: JSONObject, parser: str) -> str:
    fn = call.get("function", {})
    args = _arguments_value(fn.get("arguments", "{}"))
    if parser == "hermes":
        body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"
    return json.dumps({"name": fn.get("name"), "parameters": args}, ensure_ascii=False)


def _arguments_value(arguments: object) -> object:
    """OpenAI's arguments (JSON text) as the object templates expect; text that is not JSON as is."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---- grammars for forced choices ------------------------------------------------------------------


def _parameters(tool: JSONObject) -> JSONObject:
    return tool["function"].get("parameters") or {"type": "object"}


def named_grammar(tool: JSONObject) -> str:
    """The output is the arguments of this one function (the scheduler compiles the grammar)."""
    return json_schema_grammar(_parameters(tool), check=False)


def required_schema(tools: list[JSONObject]) -> JSONObject:
    """A JSON array of one or more calls, each `{"name": one of the tools, "parameters": ...}`. Each
    tool's parameters move inside this schema, so their local references (`#/$defs/...`, as pydantic
    writes them, or any `#...` pointer) are rewritten to point where the parameters now are."""
    one = len(tools) == 1
    calls = []
    for i, t in enumerate(tools):
        where = "#/items" if one else f"#/items/anyOf/{i}"
        params = _rebase_refs(_parameters(t), f"{where}/properties/parameters")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    return {"type": "array", "minItems": 1, "items": calls[0] if one else {"anyOf": calls}}


def _rebase_refs(node: object, base: str) -> object:
    """`node` with every local `$ref` ("#" + a JSON pointer) made relative to `base` instead of the root."""
    if isinstance(node, dict):
        return {
            k: base + v[1:]
            if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else _rebase_refs(v, base)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def required_grammar(tools: list[JSONObject]) -> str:
    """The grammar of "required" (GrammarError if the tools together are too large a schema)."""
    schema = required_schema(tools)
    check_schema(schema)
    return json_schema_grammar(schema, check=False)


# ---- parsers --------------------------------------------------------------------------------------

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


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
# Where a call may begin in a free ("auto") answer: text from there on is held back while streaming.
_MARKERS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{")}


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
            if finish_reason == "length" and not _is_json(held):  # cut short: no call (what was
                self.content += held  # streamed of it is all there is; finish_reason says why)
                return deltas, finish_reason
            self.calls = [ToolCall(self.function, held, self._call_id)]
        else:
            if self.mode == "required":  # an answer cut short is no call: its text is the content
                return self._finish_required(held, finish_reason)
            else:
                content, self.calls = _PARSERS[self.parser](held)
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
            hit = any(stripped.startswith(m) for m in _MARKERS["llama3_json"])
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
