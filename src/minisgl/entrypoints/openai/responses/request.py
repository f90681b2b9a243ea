"""The request of OpenAI's Responses API (`POST /v1/responses`), checked and mapped onto a chat
completion request: the input items become chat messages, the flat function tools chat's tools,
`text.format` chat's `response_format`, `max_output_tokens` chat's `max_completion_tokens`. The
prompt, the sampling parameters, the tool grammars and the parsing of calls are then the chat path's
(`ChatCompletionRequest`); an error that chat's checks find is reported in the Responses' names.

Responses are kept in memory (`store`, `previous_response_id`: store.py); what needs more state
(`conversation`, `background: true`, `prompt`, item references) is refused by name, as are built-in
tools, `reasoning`, and images, files or audio in the input. Fields that cannot change the output
(`user`, `metadata`, `service_tier`, ..., and `max_tool_calls`, which counts built-in tool calls)
are accepted without effect.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from minisgl.core import MAX_LOGPROBS
from minisgl.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    StreamOptions,
    _Body,
    _Request,
    refuse_unless_off,
)

JSONObject = dict[str, Any]

# Refused unless absent or "off" (the value, or one of the values, given here).
_OFF: dict[str, tuple[object, ...]] = {
    "access_programs": (None,),
    "background": (None, False),
    "background_options": (None,),
    "context_management": (None, []),
    "conversation": (None,),
    "image": (None,),
    "moderation": (None,),
    "prompt": (None,),
    "reasoning": (None,),
    "truncation": (None, "disabled"),
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value this server has
_TEXT_PARTS = ("input_text", "output_text")


class ContentPart(_Body):
    """A part of a message's content: text (images, files and audio are refused)."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type not in _TEXT_PARTS:
            raise ValueError(
                f"content of type {self.type!r} is not supported (text only: input_text or output_text)"
            )
        if self.text is None:
            raise ValueError(f"an {self.type} part needs text")
        return self


Content = str | list[ContentPart]


def _present(fields: JSONObject) -> JSONObject:
    """The fields that are set (None: left out of the chat request)."""
    return {k: v for k, v in fields.items() if v is not None}


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "".join(p.text or "" for p in content)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_Body):
    """A call the model made earlier (an assistant's tool call in chat's terms)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    """The result of a call (a tool message in chat's terms)."""

    type: Literal["function_call_output"]
    call_id: str
    output: Content


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEMS: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def _item(i: int, raw: object) -> InputItem:
    if not isinstance(raw, dict):
        raise ValueError(f"item {i} is not an object")
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(
            f"item {i} has type {kind!r}, which this server does not support "
            f"(it takes {', '.join(_ITEMS)}; item references are not resolved)"
        )
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"item {i}: {_error_text(e, lambda loc: '.'.join(map(str, loc)))}") from None


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[JSONObject]:
    """The conversation in chat's terms: the instructions as a first system message, developer
    messages as system ones, function calls as the tool_calls of an assistant message (consecutive
    calls, and calls right after an assistant message, in one message), their outputs as tool
    messages."""
    out: list[JSONObject] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def _check_call_outputs(items: list[InputItem]) -> None:
    """Each function_call_output answers a function_call item before it (by call_id)."""
    calls: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            raise ValueError(
                f"input[{i}].call_id: {item.call_id[:64]!r} is not the call_id of an earlier "
                "function_call item (in the input, or in the response of previous_response_id)"
            )


class FunctionTool(_Body):
    """A tool in the Responses' flat shape; only function tools."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _function(self) -> FunctionTool:
        if self.type != "function":
            raise ValueError(
                f"tools of type {self.type!r} are not supported (function tools only: built-in tools "
                "such as web_search or file_search are not)"
            )
        if self.name is None:
            raise ValueError("a function tool needs a name")
        return self

    def chat_tool(self) -> JSONObject:
        fn = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }
        return {"type": "function", "function": _present(fn)}

    def echo(self) -> JSONObject:
        return {
            **self.model_dump(include={"type", "name", "description", "parameters"}),
            "strict": self.strict,
        }


class ToolChoiceFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """`{type: text}`, `{type: json_object}` or `{type: json_schema, name, schema, strict}`."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self

    def response_format(self) -> JSONObject:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {
            "name": self.name,
            "description": self.description,
            "schema": self.json_schema,
            "strict": self.strict,
        }
        return {"type": "json_schema", "json_schema": _present(spec)}


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Any = None  # refused unless null

    _off = field_validator("verbosity")(refuse_unless_off({"verbosity": (None,)}))


class ResponsesRequest(_Request):
    """The body of POST /v1/responses; `chat` is the same request in chat's terms."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's and SGLang's sampling extras on this endpoint, honoured as on chat
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    include: list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None  # calls may always be parallel
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    max_tool_calls: Annotated[StrictInt, Field(ge=0)] | None = None  # counts built-in tools: none here
    # These take any JSON value, and refuse it below unless absent or "off".
    access_programs: Any = None
    background: Any = None
    background_options: Any = None
    context_management: Any = None
    conversation: Any = None
    image: Any = None
    moderation: Any = None
    prompt: Any = None
    reasoning: Any = None
    truncation: Any = None
    # Kept state (store.py): this response is kept unless store is false (OpenAI's default: kept);
    # previous_response_id continues the conversation of a kept one.
    store: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    _off = field_validator(*_OFF)(refuse_unless_off(_OFF))
    _items: list[InputItem] = PrivateAttr(default_factory=list)
    _chat: ChatCompletionRequest | None = PrivateAttr(None)

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, v: object) -> object:
        if not isinstance(v, (str, list)):
            raise ValueError("the input must be a string or a list of items")
        return [_item(i, x) for i, x in enumerate(v)] if isinstance(v, list) else v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, v: object) -> object:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(
                f"type {v.get('type')!r} is not supported (the choices are none, auto, required, or "
                '{"type": "function", "name": a function\'s name}: built-in tools are not supported)'
            )
        if isinstance(v, dict) and not isinstance(v.get("name"), str):
            raise ValueError("a function choice needs the function's name")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if name != LOGPROBS_INCLUDE:
                raise ValueError(f"{name!r} is not supported (only {LOGPROBS_INCLUDE!r} is)")
        return v

    @model_validator(mode="after")
    def _as_chat(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        self._items = (
            [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        )
        if not self._items and not self.instructions and self.previous_response_id is None:
            raise ValueError("input: the input is empty")
        if self.previous_response_id is None:  # else the route builds it, with the kept items
            self._chat = self._chat_of(self._items)
        return self

    def chat_after(self, history: list[JSONObject]) -> ChatCompletionRequest:
        """The chat request of this one continuing `history` (a kept response's items); ValueError
        in the Responses' words if they do not make a valid request together."""
        self._chat = self._chat_of([_item(i, x) for i, x in enumerate(history)] + self._items)
        return self._chat

    def input_items(self) -> list[JSONObject]:
        """This request's input as items (what a kept response's conversation holds of it)."""
        return [item.model_dump(exclude_none=True) for item in self._items]

    def _chat_of(self, items: list[InputItem]) -> ChatCompletionRequest:
        _check_call_outputs(items)
        try:
            chat = ChatCompletionRequest.model_validate(self._chat_body(items))
        except ValidationError as e:
            raise ValueError(_error_text(e, _responses_path)) from None
        if self.logprobs and chat.tool_mode != "none":
            raise ValueError(f"top_logprobs and include {LOGPROBS_INCLUDE!r} cannot be combined with tools")
        return chat

    def _chat_body(self, items: list[InputItem]) -> JSONObject:
        choice = self.tool_choice
        if choice in ("auto", "none") and not self.tools:
            choice = None  # the Responses API's default ("auto"), so valid without tools, unlike chat
        body: JSONObject = {
            "model": self.model,
            "messages": chat_messages(self.instructions, items),
            "max_completion_tokens": self.max_output_tokens,
            "stream": bool(self.stream),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "tools": [t.chat_tool() for t in self.tools or []] or None,
            "tool_choice": {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, ToolChoiceFunction)
            else choice,
            "response_format": self.text.format.response_format() if self.text and self.text.format else None,
        }
        if self.logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return _present(body)

    @property
    def chat(self) -> ChatCompletionRequest:
        assert self._chat is not None  # set by validation, or by chat_after
        return self._chat

    @property
    def stores(self) -> bool:
        """The response is kept (OpenAI's default)."""
        return self.store is not False

    @property
    def grammar_field(self) -> str:
        """The field the output grammar comes from, in the Responses API's terms."""
        return "text.format" if self.chat.grammar_field == "response_format" else "tool_choice"

    @property
    def logprobs(self) -> bool:
        """Logprobs of the output text (asked for by `include` or `top_logprobs`)."""
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None

    def echo(self) -> JSONObject:
        """The request's settings as the response object repeats them."""
        choice = self.tool_choice
        text_format = self.text.format if self.text and self.text.format else TextFormat(type="text")
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata or {},
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs,
            "tool_choice": choice.model_dump()
            if isinstance(choice, ToolChoiceFunction)
            else choice or "auto",
            "tools": [t.echo() for t in self.tools or []],
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)},
            "truncation": "disabled",
            "user": self.user,
            "background": False,
            "previous_response_id": self.previous_response_id,
            "reasoning": None,
            "store": self.stores,
        }


def _error_text(e: ValidationError, path: Callable[[tuple[int | str, ...]], str]) -> str:
    """The first error of `e` as "where: what", where given by `path` of the error's location
    (without pydantic's names of union members); a failed check of ours before a type mismatch."""
    errors = e.errors()
    first = next((x for x in errors if x["type"] == "value_error"), errors[0])
    where = path(tuple(p for p in first["loc"] if isinstance(p, int) or not _UNION_TAG.search(p)))
    return f"{where + ': ' if where else ''}{_message(first['msg'])}"


_UNION_TAG = re.compile(r"^(str|int|float|bool|.*\[.*|[A-Z]\w*)$")


def _message(msg: str) -> str:
    """Chat's words for a field, in the Responses' words."""
    return msg.removeprefix("Value error, ").replace("response_format", "text.format")


def _responses_path(loc: tuple[int | str, ...]) -> str:
    """Where a chat field came from in the Responses request."""
    path = ".".join(str(p) for p in loc)
    for chat, ours in (
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
        ("messages", "input"),
    ):
        if path.startswith(chat):
            return ours + path[len(chat) :]
    if path.startswith("tools."):
        return path.replace(".function.", ".", 1)
    return path
