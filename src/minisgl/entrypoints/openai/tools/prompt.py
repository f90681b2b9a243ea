"""The prompt side of tool calling: the chat template (does it render tools? which parser fits
its format?) and, for templates without tool support, the tools in a Hermes-style system prompt."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minisgl.entrypoints.openai.tools.calls import TOOL_PARSERS, JSONObject

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
