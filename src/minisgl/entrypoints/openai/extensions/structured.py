"""vLLM's and SGLang's structured-output fields, honoured through the same grammars as
`response_format` (llguidance, compiled by the scheduler's grammar threads):

- vLLM: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark or GBNF),
  `guided_whitespace_pattern` (up to v0.11), and `structured_outputs: {json, regex, choice, grammar,
  json_object, whitespace_pattern, disable_any_whitespace}` (v0.10.2 on);
- SGLang: `regex`, `ebnf` (GBNF) and `json_schema` (a schema as JSON text), on every endpoint.

One constraint per request: two of them, or one with `response_format` JSON or a forced tool
choice, is a 400 naming both. A grammar's text is made here (cheap); a grammar that does not compile
is refused by the scheduler, and the 400 names the field it came from (`Constraint.field`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from minisgl.grammar import (
    JSON_OBJECT_SCHEMA,
    JSON_WHITESPACE,
    SCHEMA_LIMITS,
    GrammarError,
    check_schema,
    json_schema_grammar,
    text_grammar,
)

Kind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """The output grammar of a request, and the request field it came from."""

    grammar: str
    field: str


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object (StructuredOutputsParams): one of json, regex, choice,
    grammar, json_object; unknown keys are refused (a misspelt constraint must not vanish)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # no effect: one grammar engine, nothing to fall back to
    disable_additional_properties: Literal[False] = False  # True is refused (not implemented)
    structural_tag: None = None  # refused (not implemented)


class StructuredFields(BaseModel):
    """The structured-output fields of vLLM and SGLang, shared by every endpoint's request."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    json_schema: dict[str, Any] | bool | str | None = None  # SGLang: a schema's JSON text
    _constraint: Constraint | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _structured(self) -> StructuredFields:
        self._constraint = self.peer_constraint()
        return self

    @property
    def constraint(self) -> Constraint | None:
        """The grammar these fields ask for, and the field it came from (None: none)."""
        return self._constraint

    def peer_constraint(self) -> Constraint | None:
        """The grammar these fields ask for (None: none); ValueError naming the field if bad."""
        asked = self._asked()
        if len(asked) > 1:
            names = " and ".join(f for f, _, _ in asked[:2])
            raise ValueError(f"give one structured-output constraint, not {names}")
        ws_field, whitespace = self._whitespace()
        if not asked:
            if ws_field:
                raise ValueError(
                    f"{ws_field} needs a JSON constraint (guided_json or structured_outputs.json)"
                )
            return None
        [(field, kind, value)] = asked
        if ws_field and kind != "json":
            raise ValueError(f"{ws_field} applies to JSON constraints only, not {field}")
        try:
            return Constraint(_grammar(kind, value, whitespace), field)
        except GrammarError as e:
            raise ValueError(f"{field}: {e}") from None

    def _asked(self) -> list[tuple[str, Kind, Any]]:
        so = self.structured_outputs
        given: list[tuple[str, Kind, Any]] = [
            ("guided_json", "json", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
            ("regex", "regex", self.regex),
            ("ebnf", "grammar", self.ebnf),
            ("json_schema", "json", self.json_schema),
        ]
        if so is not None:
            given += [
                ("structured_outputs.json", "json", so.json_),
                ("structured_outputs.regex", "regex", so.regex),
                ("structured_outputs.choice", "choice", so.choice),
                ("structured_outputs.grammar", "grammar", so.grammar),
                ("structured_outputs.json_object", "json", JSON_OBJECT_SCHEMA if so.json_object else None),
            ]
        return [g for g in given if g[2] is not None]

    def _whitespace(self) -> tuple[str, str | None]:
        """(the field that sets the JSON whitespace, or ""; the whitespace regex, None for none)."""
        so = self.structured_outputs
        if self.guided_whitespace_pattern is not None:
            return "guided_whitespace_pattern", self.guided_whitespace_pattern
        if so is not None and so.whitespace_pattern is not None:
            return "structured_outputs.whitespace_pattern", so.whitespace_pattern
        if so is not None and so.disable_any_whitespace:
            return "structured_outputs.disable_any_whitespace", None
        return "", JSON_WHITESPACE


def _grammar(kind: Kind, value: Any, whitespace: str | None) -> str:
    if kind == "json":
        schema = _schema(value)
        check_schema(schema)
        return json_schema_grammar(schema, check=False, whitespace=whitespace)
    if kind == "choice":
        if not value:
            raise GrammarError("give at least one choice")
        if len(json.dumps(value)) > SCHEMA_LIMITS.max_bytes:
            raise GrammarError(f"the choices are too long (at most {SCHEMA_LIMITS.max_bytes} bytes)")
    elif len(value) > SCHEMA_LIMITS.max_bytes:
        raise GrammarError(f"the {kind} is too long (at most {SCHEMA_LIMITS.max_bytes} bytes)")
    elif not value:
        raise GrammarError(f"the {kind} is empty")
    return text_grammar(kind, value)


def _schema(value: dict[str, Any] | bool | str) -> dict[str, Any] | bool:
    """A schema given as an object, or as its JSON text (vLLM and SGLang take both)."""
    if not isinstance(value, str):
        return value
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise GrammarError(f"not a JSON schema (the text is not JSON: {e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema is an object or a boolean")
    return schema
