"""The HTTP request bodies (OpenAI-compatible, plus the chapters' native `/generate`).

Pydantic checks types and ranges, so every malformed request becomes a 400 before anything is sent
to a worker. Checks that need the tokenizer (prompt length against the context, token ids against
the vocabulary) happen in the tokenizer worker, which answers with an error reply (also a 400).

JSON schemas (`response_format`, tool parameters) are checked here only for their size and shape
(`minisgl.grammar.check_schema`, linear and bounded): compiling one can take seconds, so it happens
in the scheduler's grammar threads, whose refusal comes back as a 400 naming the request's field
(`grammar_field`).

Integers are strict (`true`, `"5"` and `5.0` are not integers: `"prompt": [true, false]` is not a
list of token ids). Text must be valid Unicode: JSON may spell a lone surrogate (`"\\ud800"`), which
no UTF-8 pipe can carry, so a body holding one anywhere is refused before any field is read. OpenAI
fields that would change the output but are not implemented are refused by name, not ignored
(tests/entrypoints/test_openai_fields.py walks every field of the openai package's request types).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from minisgl.core import MAX_LOGPROBS, SamplingParams
from minisgl.entrypoints.openai import tools as tool_calls
from minisgl.entrypoints.openai.extensions.peer_fields import check_peer_fields
from minisgl.entrypoints.openai.extensions.structured import StructuredFields
from minisgl.grammar import JSON_OBJECT_SCHEMA, GrammarError, check_schema, json_schema_grammar
from minisgl.tokenizer.tokenize import FILL_CONTEXT, MAX_CHOICES, TEMPLATE_ARGUMENTS

_INT32 = 2**31 - 1  # bounds keep every number encodable (msgpack) and meaningful downstream
_SEED = 2**63 - 1 - MAX_CHOICES  # seed + choice index stays an int64
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(data: object) -> str | None:
    """Where in a decoded JSON value (keys included) a string holds a lone surrogate, e.g.
    "messages[0].content"; None if nowhere. Iterative (JSON nesting depth is the client's choice)
    and quick over long lists of numbers (token ids)."""
    stack: list[tuple[object, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return _json_path(path)
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and _has_surrogate(k):
                    return f"a key in {_json_path(path)}"
                if isinstance(v, (str, dict, list)):
                    stack.append((v, (*path, str(k))))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))
    return None


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _json_path(path: tuple[str | int, ...]) -> str:
    out = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return out or "the body"


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Request(_Body):
    """A whole request body (not a part of one)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: object) -> object:
        where = lone_surrogate_at(data)
        if where is not None:
            raise ValueError(f"{where}: text must be valid Unicode (it holds a lone UTF-16 surrogate)")
        return data


# OpenAI fields that minisgl does not implement: refused by name unless absent or "off" (the tool
# fields only on /v1/completions: chat supports them). Fields that cannot change the output (`user`,
# `metadata`, `service_tier`, `safety_identifier`, `prompt_cache_key`, `prompt_cache_options`,
# `prompt_cache_retention`, `parallel_tool_calls`: calls may always be parallel) are accepted and
# have no effect.
_NOT_IMPLEMENTED_OFF: dict[str, tuple[object, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "moderation": (None,),
    "store": (None, False),
    "suffix": (None, ""),
}
# Refused on /v1/completions only (chat supports the tool fields; suffix is a completions field).
_COMPLETION_ONLY = ("tools", "tool_choice", "functions", "function_call", "suffix")
_NO_EFFECT = (
    "user",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "parallel_tool_calls",
)
# The accepted range of a logit_bias value (OpenAI's).
_MAX_BIAS = 100.0


def refuse_unless_off(table: dict[str, tuple[object, ...]]) -> Any:
    """A field validator that refuses a field of `table` unless its value is one of its "off" values
    (same type too: `0` is not `False`)."""

    def check(value: object, info: ValidationInfo) -> object:
        off = table[info.field_name or ""]
        if not any(value == o and type(value) is type(o) for o in off):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    return check


_refuse_unless_off = refuse_unless_off(_NOT_IMPLEMENTED_OFF)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (vLLM's option)
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks: not needed here, no effect


class TextPart(_Body):
    type: Literal["text"]
    text: str


_FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


def _grammar_of(schema: dict[str, Any] | bool) -> str:
    """The grammar text of a schema whose size and shape pass (it is compiled by the scheduler)."""
    _check_schema(schema)
    return json_schema_grammar(schema, check=False)


def _check_schema(schema: dict[str, Any] | bool, what: str = "JSON schema") -> None:
    try:
        check_schema(schema)
    except GrammarError as e:
        raise ValueError(f"invalid {what}: {e}") from None


class JsonSchemaSpec(_Body):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: Annotated[str, Field(pattern=_FUNCTION_NAME)]
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Body):
    """`{"type": "text"}`, `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`; the JSON ones are enforced while sampling."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    _grammar: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _compile(self) -> ResponseFormat:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("json_schema is required with type json_schema")
            schema = self.json_schema.json_schema
            self._grammar = _grammar_of({} if schema is None else schema)
        elif self.type == "json_object":
            self._grammar = _grammar_of(JSON_OBJECT_SCHEMA)
        return self

    @property
    def grammar(self) -> str | None:
        return self._grammar


class FunctionSpec(_Body):
    name: Annotated[str, Field(pattern=_FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            _check_schema(v, "'parameters' schema")  # SGLang's words, which its clients match on
        return v


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class MessageFunctionCall(_Body):
    name: str
    arguments: str


class MessageToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(_Body):
    # Any role the chat template renders (it refuses the ones it does not know).
    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    function_call: MessageFunctionCall | None = None  # the legacy form of one call

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template takes it (only the fields that are set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        calls = list(self.tool_calls or [])
        if self.function_call is not None:
            calls.append(MessageToolCall(id="call_0", function=self.function_call))
        if calls:
            out["tool_calls"] = [c.model_dump() for c in calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class SamplingRequest(_Request, StructuredFields):
    """Fields shared by both OpenAI endpoints (and vLLM's and SGLang's that both have: the
    structured-output ones in structured.py, the rest classified in peer_fields.py)."""

    endpoint: ClassVar[str] = ""  # "chat" or "completions": where an extra field's "off" may differ
    # max_tokens when the request gives none: chat fills the context; completions stop at 16, the
    # default of OpenAI's legacy completions API (and of vLLM's and SGLang's).
    default_max_tokens: ClassVar[int] = FILL_CONTEXT
    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=_INT32)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=_INT32)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(le=_INT32)] = -1
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=_INT32)]] | None = None
    seed: Annotated[StrictInt, Field(ge=-_SEED, le=_SEED)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = 1.0
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-_MAX_BIAS, le=_MAX_BIAS)]] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=_INT32)] = 0
    response_format: ResponseFormat | None = None
    # vLLM's (SGLang's no_stop_trim): a matched stop string ends the output rather than being cut.
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None  # OpenAI's (completions) and vLLM's (chat)
    # vLLM's request_id (SGLang's rid): the answer's id is made from it.
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    rid: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # vLLM's and SGLang's: the answer has the token ids too (choices' token_ids, prompt_token_ids).
    return_token_ids: bool | None = None
    # These take any JSON value, and refuse it below unless absent or "off".
    moderation: Any = None
    store: Any = None

    _off = field_validator(
        *[f for f in _NOT_IMPLEMENTED_OFF if f not in _COMPLETION_ONLY], check_fields=False
    )(_refuse_unless_off)

    @model_validator(mode="before")
    @classmethod
    def _peer_fields(cls, data: object) -> object:
        """vLLM's and SGLang's fields this server refuses: a 400 naming the first one asked for."""
        if isinstance(data, dict):
            check_peer_fields(data, cls.endpoint, [*cls.model_fields, *_NO_EFFECT])
        return data

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingRequest:
        c = self.constraint
        if c is not None and self.response_format is not None and self.response_format.grammar:
            raise ValueError(f"give response_format or {c.field}, not both")
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = [k for k in v or {} if not k.isascii() or not k.isdigit() or int(k) > _INT32]
        if bad:  # every one named, so that a client fixes them at once (vLLM's test asks for it)
            shown = ", ".join(repr(k[:40]) for k in bad[:10])
            raise ValueError(f"keys must be token ids, got {shown} (the tokenizer checks the vocabulary)")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported unless it equals n")
        return self

    @property
    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self) -> SamplingParams:
        """The scheduler's sampling parameters of choice 0 (the tokenizer gives choice i seed + i)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or self.default_max_tokens
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            logprobs=self.token_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            grammar=self.output_grammar,
            return_token_ids=self.returns_prompt_ids,
        )

    @property
    def output_grammar(self) -> str | None:
        """The grammar sampling keeps to (response_format's or a structured-output field's; chat:
        or the forced tool choice's)."""
        if self.constraint is not None:
            return self.constraint.grammar
        return self.response_format.grammar if self.response_format is not None else None

    @property
    def grammar_field(self) -> str:
        """The request field the output grammar comes from (named when the scheduler refuses it)."""
        return self.constraint.field if self.constraint is not None else "response_format"

    @property
    def returns_prompt_ids(self) -> bool:
        """The answer has the prompt's token ids (and, with return_token_ids, the output's)."""
        return bool(self.return_token_ids)

    @property
    def include_stop_str(self) -> bool:
        """A matched stop string stays at the end of the output."""
        return self.include_stop_str_in_output or self.no_stop_trim

    @property
    def id_suffix(self) -> str:
        """What the answer's id is made of: the client's request_id (or rid), else random."""
        return self.request_id or self.rid or uuid.uuid4().hex

    @property
    def token_logprobs(self) -> int | None:
        """Top alternatives per generated token (None: no logprobs)."""
        return None

    @property
    def prompt_logprobs(self) -> int | None:
        return None


class ChatCompletionRequest(SamplingRequest):
    endpoint: ClassVar[str] = "chat"
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the answer starts with the final message it continues
    return_prompt_token_ids: bool = False  # SGLang's: the answer has the prompt's token ids
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[FunctionSpec] | None = None  # the legacy form of tools
    function_call: Literal["none", "auto"] | FunctionName | None = None  # ... and of tool_choice
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # The chat template: the request's own (with --trust-request-chat-template) and more variables
    # (vLLM's chat_template_kwargs and documents; reasoning_effort goes to templates that take one).
    chat_template: Annotated[str, Field(min_length=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # A reasoning model's reasoning: returned (vLLM's include_reasoning), split from the content at
    # all (SGLang's separate_reasoning), streamed as it comes or in one piece (stream_reasoning).
    include_reasoning: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @model_validator(mode="after")
    def _chat_options(self) -> ChatCompletionRequest:
        reserved = sorted((TEMPLATE_ARGUMENTS | {"documents"}) & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is not a template variable")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            raise ValueError("continue_final_message cannot be combined with add_generation_prompt: true")
        self._check_tools()
        self._check_tool_results()
        return self

    def _check_tool_results(self) -> None:
        """Each tool message answers a call an earlier assistant message made (by its id)."""
        ids: set[str] = set()
        for i, m in enumerate(self.messages):
            ids.update(c.id for c in m.tool_calls or [])
            if m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in ids:
                raise ValueError(
                    f"messages[{i}].tool_call_id: {m.tool_call_id[:64]!r} is not the id of a tool call "
                    "of an earlier assistant message"
                )

    def _check_tools(self) -> None:
        if self.tools and self.functions:
            raise ValueError("give tools or functions (the legacy form), not both")
        names = [t.function.name for t in self.tool_list]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tools: the function names must be unique, {dup[0]!r} is not")
        field = self._choice_field
        explicit = self.tool_choice if self.tool_choice is not None else self.function_call
        if explicit not in (None, "none") and not names:
            raise ValueError(f"{field} needs {'functions' if field == 'function_call' else 'tools'}")
        mode, forced = self.tool_mode, self.forced_function
        if forced is not None and forced not in names:
            raise ValueError(f"{field}: Tool {forced!r} not found in tools list")  # SGLang's words
        if self.response_format is not None and self.response_format.grammar and mode != "none":
            raise ValueError("response_format json_object / json_schema cannot be combined with tools")
        if self.constraint is not None and mode != "none":
            raise ValueError(f"{self.constraint.field} cannot be combined with tools")
        try:
            if mode == "required":
                self._tool_grammar = tool_calls.required_grammar(self.tool_dicts)
            elif forced is not None:
                [tool] = [t for t in self.tool_dicts if t["function"]["name"] == forced]
                self._tool_grammar = tool_calls.named_grammar(tool)
        except GrammarError as e:
            raise ValueError(f"{field}: {e}") from None

    _tool_grammar: str | None = PrivateAttr(None)

    @property
    def _choice_field(self) -> str:
        """ "function_call" when the request uses the legacy fields, else "tool_choice"."""
        legacy = self.tool_choice is None and (self.function_call is not None or bool(self.functions))
        return "function_call" if legacy else "tool_choice"

    @property
    def tool_list(self) -> list[ToolSpec]:
        """The tools (legacy `functions` as tools)."""
        if self.functions:
            return [ToolSpec(type="function", function=f) for f in self.functions]
        return list(self.tools or [])

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tool_list]

    @property
    def legacy_functions(self) -> bool:
        """The request used `functions`: the answer has `function_call` rather than `tool_calls`."""
        return bool(self.functions)

    @property
    def tool_mode(self) -> str:
        """ "none" (no tools, or tool_choice none), "auto", "required", or "function" (one function
        is forced: `forced_function`). A mode is never a function's name: a function may be named
        "auto" or "none"."""
        if not self.tool_list:
            return "none"
        choice = self.tool_choice if self.tool_choice is not None else self.function_call
        if choice is None:
            return "auto"
        return choice if isinstance(choice, str) else "function"

    @property
    def forced_function(self) -> str | None:
        """The name of the function tool_choice (or function_call) forces; None if none is forced."""
        choice = self.tool_choice if self.tool_choice is not None else self.function_call
        if not self.tool_list or choice is None or isinstance(choice, str):
            return None
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice.name

    @property
    def output_grammar(self) -> str | None:
        return self._tool_grammar or super().output_grammar

    @property
    def grammar_field(self) -> str:
        return self._choice_field if self._tool_grammar else "response_format"

    @property
    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def returns_prompt_ids(self) -> bool:
        return bool(self.return_token_ids or self.return_prompt_token_ids)

    @property
    def generation_prompt(self) -> bool:
        """Whether the prompt ends with the assistant's turn opened: add_generation_prompt, which
        continue_final_message turns off unless it was given (vLLM wants it false, SGLang not)."""
        return self.add_generation_prompt and not self.continue_final_message

    @property
    def echo_text(self) -> str:
        """What the answer starts with: with echo, the final message when the answer continues it
        (an assistant's, with continue_final_message), as vLLM does; else ""."""
        last = self.messages[-1]
        return last.text() if self.echo and self.continue_final_message and last.role == "assistant" else ""

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def template_kwargs(self) -> str:
        """The variables the chat template gets besides the messages and tools, as JSON ("" none)."""
        out = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            out["documents"] = self.documents
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return json.dumps(out, ensure_ascii=False) if out else ""


TokenId = Annotated[StrictInt, Field(ge=-_INT32, le=_INT32)]  # the tokenizer checks the vocabulary
Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingRequest):
    endpoint: ClassVar[str] = "completions"
    default_max_tokens: ClassVar[int] = 16
    prompt: Prompt
    echo: bool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: Any = None
    tools: Any = None  # chat only
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    _suffix_off = field_validator(*_COMPLETION_ONLY)(_refuse_unless_off)

    @property
    def token_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and (len(v) == 0 or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("the prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class GenerateRequest(_Request, StructuredFields):
    """The chapters' native endpoint: a prompt, a token budget, and streamed text (and SGLang's
    regex / json_schema / ebnf, or vLLM's guided_* fields, held to by a grammar)."""

    prompt: str | list[TokenId]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=_INT32)] = 128
    ignore_eos: bool = False
    temperature: Annotated[float, Field(ge=0.0)] = 0.0
    top_k: Annotated[StrictInt, Field(le=_INT32)] = -1
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: str | list[str] | None = None
    stream: bool = True

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: object) -> object:
        if isinstance(data, dict) and "sampling_params" in data:  # SGLang's /generate nests them
            raise ValueError(
                "sampling_params is not supported: /generate takes its fields at the top level (max_tokens, "
                "temperature, top_k, top_p, stop, ignore_eos, and regex, json_schema or ebnf)"
            )
        return data

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            ignore_eos=self.ignore_eos,
            max_tokens=self.max_tokens,
            grammar=self.constraint.grammar if self.constraint is not None else None,
        )

    @property
    def grammar_field(self) -> str | None:
        return self.constraint.field if self.constraint is not None else None

    @property
    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)
