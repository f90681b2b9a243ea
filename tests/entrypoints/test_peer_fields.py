"""Every request field that vLLM or SGLang documents for chat and completions, beyond OpenAI's, is
honoured or refused with a 400 that names it; none is accepted and ignored.

The lists are the request models' fields, copied by hand:
- vLLM v0.10.2, vllm/entrypoints/openai/protocol.py: ChatCompletionRequest and CompletionRequest
  (the release with both the `guided_*` fields, deprecated there, and `structured_outputs`);
- vLLM main (2026), vllm/entrypoints/openai/chat_completion/protocol.py and completion/protocol.py:
  the fields added since (the `guided_*` ones were removed in v0.12);
- SGLang main at 004c82e (2026), python/sglang/srt/entrypoints/openai/protocol.py:
  ChatCompletionRequest and CompletionRequest.
A field of the lists that minisgl has not classified fails the test. An honoured field must change
what reaches the workers or what the answer says (the request sent with and without it differ), so
"honoured" cannot hide an ignored field. Run against the in-process app with fake workers."""

from __future__ import annotations

import logging

import pytest
import test_api_app
from test_api_app import anyio_backend, assert_openai_error  # noqa: F401 (a fixture)

from minisgl.entrypoints.openai.extensions.peer_fields import ENDPOINT_REFUSED, NO_EFFECT, REFUSED
from minisgl.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]
api = test_api_app.api  # the in-process app fixture

_VLLM_SAMPLING = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
}  # fmt: skip
_VLLM_STRUCTURED = {
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern",
}  # fmt: skip
_VLLM_EXTRA = {
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids",
    "cache_salt", "kv_transfer_params", "vllm_xargs", "add_special_tokens", "response_format",
}  # fmt: skip
VLLM_CHAT = (
    _VLLM_SAMPLING
    | _VLLM_STRUCTURED
    | _VLLM_EXTRA
    | {"reasoning_effort", "include_reasoning", "best_of", "bad_words", "echo", "add_generation_prompt"}
    | {"continue_final_message", "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs"}
)
VLLM_COMPLETION = _VLLM_SAMPLING | _VLLM_STRUCTURED | _VLLM_EXTRA | {"prompt_embeds"}
VLLM_MAIN_CHAT = {
    "thinking_token_budget", "watermarking", "truncation_side", "logprob_token_ids", "media_io_kwargs",
    "session_id", "routed_experts_prompt_start", "return_token_offsets", "return_prompt_text",
    "return_mm_kwargs", "ec_transfer_params", "repetition_detection", "stream_interval",
}  # fmt: skip
VLLM_MAIN_COMPLETION = VLLM_MAIN_CHAT - {"thinking_token_budget", "media_io_kwargs"}
_SGLANG_COMMON = {
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_cached_tokens_details", "return_token_ids", "top_k", "min_p", "min_tokens", "regex",
    "ebnf", "repetition_penalty", "stop_token_ids", "stop_regex", "no_stop_trim", "ignore_eos",
    "skip_special_tokens", "lora_path", "session_id", "session_params", "images_config",
    "custom_logit_processor", "custom_params", "rid", "extra_key", "cache_salt", "ngram_corpus_id",
    "priority", "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
    "disagg_prefill_dp_rank", "data_parallel_rank",
}  # fmt: skip
SGLANG_CHAT = _SGLANG_COMMON | {
    "return_prompt_token_ids", "return_meta_info", "reasoning_effort", "task", "continue_final_message",
    "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "max_dynamic_patch",
    "min_dynamic_patch", "use_audio_in_video", "input_ids",
}  # fmt: skip
SGLANG_COMPLETION = _SGLANG_COMMON | {"json_schema", "response_format", "custom_labels"}

# A value that asks for the field's effect (not its "off" value).
VALUES: dict[str, object] = {
    "use_beam_search": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "length_penalty": 0.5,
    "stop_token_ids": [7], "include_stop_str_in_output": True, "no_stop_trim": True, "ignore_eos": True,
    "min_tokens": 2, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 16, "prompt_logprobs": 2, "allowed_token_ids": [1, 2], "bad_words": ["x"],
    "structured_outputs": {"choice": ["yes", "no"]}, "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+", "guided_choice": ["yes", "no"], "guided_grammar": 'root ::= "a" | "b"',
    "structural_tag": '{"structures": []}', "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ?", "priority": 3, "request_id": "abc123",
    "logits_processors": ["m.P"], "return_tokens_as_token_ids": True, "return_token_ids": True,
    "cache_salt": "salt", "kv_transfer_params": {"k": 1}, "vllm_xargs": {"k": 1},
    "add_special_tokens": "flip", "response_format": {"type": "json_object"}, "prompt_embeds": "AAAA",
    "reasoning_effort": "low", "include_reasoning": False, "best_of": 3, "echo": True,
    "add_generation_prompt": False, "continue_final_message": True, "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages[0]['content'] }}", "chat_template_kwargs": {"enable_thinking": False},
    "mm_processor_kwargs": {"k": 1}, "thinking_token_budget": 10, "watermarking": True,
    "truncation_side": "left", "logprob_token_ids": [1], "media_io_kwargs": {"image": {}},
    "session_id": "s", "routed_experts_prompt_start": 2, "return_token_offsets": True,
    "return_prompt_text": True, "return_mm_kwargs": False, "ec_transfer_params": {"k": 1},
    "repetition_detection": {"n": 3}, "stream_interval": 4, "return_hidden_states": True,
    "return_routed_experts": True, "routed_experts_start_len": 3, "return_cached_tokens_details": True,
    "regex": "[a-z]+", "ebnf": 'root ::= "a" | "b"', "stop_regex": "x+", "lora_path": "/l",
    "session_params": {"id": "s"}, "images_config": {"k": 1}, "custom_logit_processor": "p",
    "custom_params": {"k": 1}, "rid": "r1", "extra_key": "k", "ngram_corpus_id": "c",
    "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1, "routed_dp_rank": 0,
    "disagg_prefill_dp_rank": 0, "data_parallel_rank": 0, "return_prompt_token_ids": True,
    "return_meta_info": True, "task": "domain", "separate_reasoning": False, "stream_reasoning": False,
    "max_dynamic_patch": 4, "min_dynamic_patch": 1, "use_audio_in_video": True, "input_ids": [1, 2],
    "json_schema": '{"type": "object"}', "custom_labels": {"team": "a"},
}  # fmt: skip
# Honoured fields whose effect needs what fake workers cannot give (a reasoning model, an assistant
# message to continue); each is checked where named.
EFFECT_ELSEWHERE = {
    "include_reasoning": "test_reasoning.py",
    "separate_reasoning": "test_reasoning.py",
    "stream_reasoning": "test_reasoning.py",
    "reasoning_effort": "test_reasoning.py",
    "chat_template": "test_reasoning.py (with --trust-request-chat-template)",
    "echo": "test_peer_fields.py::test_chat_echo_continues_the_final_message",
    "continue_final_message": "test_peer_fields.py::test_chat_echo_continues_the_final_message",
}
# Honoured, but refused for the value asked here: say why.
REFUSED_HERE = {
    "best_of": "honoured only when it equals n",
    "chat_template": "honoured only with --trust-request-chat-template (tests/entrypoints/test_reasoning.py)",
}
# What an honoured field needs besides itself to show its effect.
WITH = {
    "include_stop_str_in_output": {"stop": ["there"]},
    "no_stop_trim": {"stop": ["there"]},
    "guided_whitespace_pattern": {"guided_json": {"type": "object"}},
}
BASE = {
    "/v1/chat/completions": {"model": "smol", "messages": [{"role": "user", "content": "hello there"}]},
    "/v1/completions": {"model": "smol", "prompt": "hello there"},
}
_MODEL = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
_ENDPOINT = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def _value(path: str, name: str) -> object:
    if name == "add_special_tokens":  # the opposite of each endpoint's default
        return path == "/v1/chat/completions"
    return VALUES[name]


def _cases() -> list[tuple[str, str, str]]:
    lists = [
        ("/v1/chat/completions", "vLLM v0.10.2", VLLM_CHAT),
        ("/v1/chat/completions", "vLLM main", VLLM_MAIN_CHAT),
        ("/v1/chat/completions", "SGLang", SGLANG_CHAT),
        ("/v1/completions", "vLLM v0.10.2", VLLM_COMPLETION),
        ("/v1/completions", "vLLM main", VLLM_MAIN_COMPLETION),
        ("/v1/completions", "SGLang", SGLANG_COMPLETION),
    ]
    return [(path, source, name) for path, source, names in lists for name in sorted(names)]


def _refusal(path: str, name: str) -> object:
    return ENDPOINT_REFUSED[_ENDPOINT[path]].get(name) or REFUSED.get(name)


def _sent(api) -> list[dict]:
    """What reached the fake tokenizer, as comparable data."""
    return [{**m.encoder(), "uid": 0} for m in api.workers.received]


def _answer(r, name: str) -> dict:
    """The answer without what differs between any two (its time, and its random id unless the
    field names it)."""
    body = r.json()
    body.pop("created", None)
    if name not in ("request_id", "rid"):
        body.pop("id", None)
    return body


@pytest.mark.parametrize(("path", "source", "name"), _cases())
async def test_every_vllm_and_sglang_field_is_honoured_or_refused(
    api, path: str, source: str, name: str
) -> None:
    model = _MODEL[path]
    refused = _refusal(path, name) is not None
    honoured = name in model.model_fields
    assert refused or honoured or name in NO_EFFECT, f"{source}'s {name} on {path}: classify it"
    assert name in VALUES or name == "add_special_tokens", f"{name}: give a value that asks for its effect"
    body = {**BASE[path], **WITH.get(name, {}), name: _value(path, name)}
    if refused or name in REFUSED_HERE:
        err = assert_openai_error(await api.post(path, json=body), 400)
        assert name in err["message"] and "not supported" in err["message"], err
        assert not api.workers.received
        return
    r = await api.post(path, json=body)
    assert r.status_code == 200, f"{name}: {r.text}"
    if name in NO_EFFECT or name in EFFECT_ELSEWHERE:
        return
    with_field, sent = _answer(r, name), _sent(api)
    api.workers.received.clear()
    r0 = await api.post(path, json={**BASE[path], **WITH.get(name, {})})
    assert r0.status_code == 200, r0.text
    assert (with_field, sent) != (_answer(r0, name), _sent(api)), f"{name} changed nothing: it is ignored"


async def test_refused_fields_at_their_off_value_are_accepted(api) -> None:
    for name, refusal in REFUSED.items():
        for off in refusal.off:
            r = await api.post("/v1/completions", json={**BASE["/v1/completions"], name: off})
            assert r.status_code == 200, f"{name}={off!r}: {r.text}"


async def test_unknown_fields_are_accepted_and_logged_once(api, caplog) -> None:
    caplog.set_level(logging.WARNING, "minisgl.server")
    for _ in range(2):
        r = await api.post(
            "/v1/chat/completions", json={**BASE["/v1/chat/completions"], "no_engine_knows_this": 1}
        )
        assert r.status_code == 200, r.text
    logged = [rec for rec in caplog.records if "no_engine_knows_this" in rec.getMessage()]
    assert len(logged) == 1


async def test_chat_echo_continues_the_final_message(api) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {"model": "smol", "messages": messages, "continue_final_message": True, "echo": True}
    r = await api.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [msg] = api.workers.received
    assert msg.continue_final_message and not msg.add_generation_prompt  # SGLang's way: no flag needed
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("Once upon") and content != "Once upon"
    r = await api.post("/v1/chat/completions", json={**body, "stream": True})
    events = test_api_app.sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Once upon"}
    both = {**body, "add_generation_prompt": True}
    assert_openai_error(await api.post("/v1/chat/completions", json=both), 400)
