"""The grammars that enforce `tool_choice`: "required" (a JSON array of one or more calls) and a
named function (its arguments)."""

from __future__ import annotations

from minisgl.entrypoints.openai.tools.calls import JSONObject
from minisgl.grammar import check_schema, json_schema_grammar

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
