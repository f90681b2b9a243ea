"""Every field of OpenAI's chat-completion, completion and Responses request types (as the installed
`openai` package declares them) is either supported or refused with a 400 that names it; none is
ignored.

The field lists come from `openai.types.chat.completion_create_params`,
`openai.types.completion_create_params` and `openai.types.responses.response_create_params`; a field this table does not know fails the test, so a new
OpenAI field gets classified here when the test dependency is upgraded. Run against the in-process
app with fake workers (no model)."""

from __future__ import annotations

import pytest
import test_api_app
from test_api_app import anyio_backend, assert_openai_error  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]
api = test_api_app.api  # the in-process app fixture

# A value that asks for the field's effect (not "off").
CHAT_VALUES: dict[str, object] = {
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 1.0},
    "logprobs": True,
    "max_completion_tokens": 3,
    "max_tokens": 3,
    "metadata": {"k": "v"},
    "n": 2,
    "parallel_tool_calls": True,
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "prompt_cache_options": {"ttl": "5m"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "s",
    "seed": 3,
    "service_tier": "auto",
    "stop": ["x"],
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "u",
    "modalities": ["text", "audio"],
    "store": True,
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [{"name": "f"}],
    "moderation": {"policy": {"input": {"mode": "block"}}},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "response_format": {"type": "json_object"},
    "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "verbosity": "high",
    "web_search_options": {},
}
COMPLETION_VALUES: dict[str, object] = {
    "best_of": 3,
    "echo": True,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 1.0},
    "logprobs": 2,
    "max_tokens": 3,
    "n": 2,
    "presence_penalty": 0.5,
    "seed": 3,
    "stop": ["x"],
    "stream_options": {"include_usage": True},
    "suffix": "and then",
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "u",
}
RESPONSES_VALUES: dict[str, object] = {
    "access_programs": {"cyber": "standard"},
    "background": True,
    "background_options": {"completion_window": "2h"},
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "conversation": "conv_1",
    "image": {"context_compression": "enabled"},
    "include": ["message.output_text.logprobs"],
    "instructions": "be brief",
    "max_output_tokens": 3,
    "max_tool_calls": 2,
    "metadata": {"k": "v"},
    "moderation": {"model": "omni-moderation-latest"},
    "parallel_tool_calls": False,
    "previous_response_id": "resp_1",
    "prompt": {"id": "pmpt_1"},
    "prompt_cache_key": "k",
    "prompt_cache_options": {"ttl": "30m"},
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "low"},
    "safety_identifier": "s",
    "service_tier": "auto",
    "store": True,
    "stream_options": {"include_obfuscation": False},
    "temperature": 0.5,
    "text": {"format": {"type": "json_object"}},
    "tool_choice": "required",
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "truncation": "auto",
    "user": "u",
}
# Refused (a 400 naming the field) when asked for; everything else in the tables is supported, or
# accepted without effect because it cannot change the output (user, metadata, service_tier, ...;
# the Responses' max_tool_calls, which counts built-in tool calls, and this server has none).
# reasoning_effort goes to the chat template (the tokenizer refuses it for one that takes none);
# store and previous_response_id use the server's kept responses.
REFUSED = {
    "access_programs",
    "audio",
    "background",
    "background_options",
    "best_of",
    "context_management",
    "conversation",
    "image",
    "prompt",
    "reasoning",
    "truncation",
    "modalities",
    "moderation",
    "prediction",
    "suffix",
    "verbosity",
    "web_search_options",
}
NEEDS = {
    "top_logprobs": {"logprobs": True},
    "stream_options": {"stream": True},
    "tool_choice": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "function_call": {"functions": [{"name": "f"}]},
}
RESPONSES_NEEDS = {"tool_choice": {"tools": RESPONSES_VALUES["tools"]}, "stream_options": {"stream": True}}
BASE = {
    "messages": {"messages": [{"role": "user", "content": "hi"}]},
    "prompt": {"prompt": "hi"},
    "input": {"input": "hi"},
}


_BASE_OF = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input"}


def _fields(module: object) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__)  # type: ignore[attr-defined]


def _cases() -> list[tuple[str, str, object]]:
    from openai.types import completion_create_params as text
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    out = []
    for path, fields, values, base in (
        ("/v1/chat/completions", _fields(chat), CHAT_VALUES, "messages"),
        ("/v1/completions", _fields(text), COMPLETION_VALUES, "prompt"),
        ("/v1/responses", set(responses.ResponseCreateParamsBase.__annotations__), RESPONSES_VALUES, "input"),
    ):
        for name in sorted(fields - {"model", base}):
            out.append((path, name, values.get(name, KeyError)))
    return out


@pytest.mark.parametrize(("path", "field", "value"), _cases())
async def test_every_openai_field_is_supported_or_refused_by_name(
    api, path: str, field: str, value: object
) -> None:
    assert value is not KeyError, f"{field} of {path}: a new OpenAI field; classify it in this test"
    base, needs = BASE[_BASE_OF[path]], RESPONSES_NEEDS if path == "/v1/responses" else NEEDS
    body = {"model": "smol", **base, **needs.get(field, {}), field: value}
    r = await api.post(path, json=body)
    if field == "previous_response_id":  # kept responses are looked up: this one is not there
        err = assert_openai_error(r, 400, field)
        assert "resp_1" in err["message"] and not api.workers.received
    elif field in REFUSED or (field == "store" and path != "/v1/responses"):  # chat keeps nothing
        err = assert_openai_error(r, 400)
        assert field in err["message"] and (err["param"] in (None, field)), err
        assert not api.workers.received
    else:
        assert r.status_code == 200, f"{field}: {r.text}"
