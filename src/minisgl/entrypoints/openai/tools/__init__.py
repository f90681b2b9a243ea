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

from minisgl.entrypoints.openai.tools.calls import (
    TOOL_PARSERS,
    ToolCall,
    parse_hermes,
    parse_llama3_json,
    parse_required,
)
from minisgl.entrypoints.openai.tools.grammars import named_grammar, required_grammar, required_schema
from minisgl.entrypoints.openai.tools.output import RequiredCalls, ToolOutput
from minisgl.entrypoints.openai.tools.prompt import (
    ToolFormat,
    choose_parser,
    fallback_messages,
    read_chat_template,
    template_takes_tools,
)

__all__ = [
    "TOOL_PARSERS",
    "RequiredCalls",
    "ToolCall",
    "ToolFormat",
    "ToolOutput",
    "choose_parser",
    "fallback_messages",
    "named_grammar",
    "parse_hermes",
    "parse_llama3_json",
    "parse_required",
    "read_chat_template",
    "required_grammar",
    "required_schema",
    "template_takes_tools",
]
