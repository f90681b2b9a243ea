"""What vLLM's and SGLang's own OpenAI-server test suites expect and minisgl did differently (issue
25; benchmarks/peer_tests/ runs those suites against a real server): one test per difference found
there. In-process app, fake workers (test_api_app.py)."""

from __future__ import annotations

import pytest
import test_api_app
from test_api_app import FakeWorkers, anyio_backend, assert_openai_error, chat_body, sse_events  # noqa: F401

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]
api = test_api_app.api


async def test_completions_default_to_16_tokens_and_chat_to_the_context(api) -> None:
    """OpenAI's legacy completions API (and vLLM's and SGLang's) stops at 16 tokens when max_tokens
    is not given; chat fills what the context leaves."""
    assert (await api.post("/v1/completions", json={"prompt": "hi"})).status_code == 200
    assert api.workers.received[-1].sampling_params.max_tokens == 16
    await api.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40})
    assert api.workers.received[-1].sampling_params.max_tokens == 40
    await api.post("/v1/chat/completions", json=chat_body())
    assert api.workers.received[-1].sampling_params.max_tokens == -1  # FILL_CONTEXT


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "words"),
    [
        (list(range(70)), 1, "is longer than the model's context length"),  # SGLang's test's words
        ([1, 2, 3], 62, "Requested token count exceeds the model's maximum context"),  # likewise
    ],
)
def test_context_errors_carry_openais_and_sglangs_words(
    prompt: list[int], max_tokens: int, words: str
) -> None:
    from minisgl.core import RequestRejected, SamplingParams, check_request

    with pytest.raises(RequestRejected) as e:
        check_request(prompt, SamplingParams(max_tokens=max_tokens), vocab_size=100, max_seq_len=64)
    assert "This model's maximum context length is 64 tokens. However, you requested" in str(e.value)
    assert words in str(e.value)


async def test_tool_errors_in_sglangs_words(api) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = chat_body(tools=[tool], tool_choice={"type": "function", "function": {"name": "nope"}})
    err = assert_openai_error(await api.post("/v1/chat/completions", json=body), 400)
    assert "Tool 'nope' not found in tools list" in err["message"]
    bad = {"type": "function", "function": {"name": "g", "parameters": {"type": "unknown_type"}}}
    body = chat_body(tools=[bad], tool_choice="auto")
    err = assert_openai_error(await api.post("/v1/chat/completions", json=body), 400)
    assert "invalid 'parameters' schema" in err["message"] and "unknown_type" in err["message"]
    assert err["param"] == "tools.0.function.parameters" and not api.workers.received


async def test_every_bad_logit_bias_key_is_named(api) -> None:
    err = assert_openai_error(
        await api.post("/v1/chat/completions", json=chat_body(logit_bias={"bad1": 50.0, "bad2": 20.0})), 400
    )
    assert "'bad1'" in err["message"] and "'bad2'" in err["message"] and "logit_bias" in err["message"]


async def test_a_range_error_names_pydantics_error_type(api) -> None:
    """vLLM's test_long_seed (and its clients) read pydantic's error type from the message."""
    err = assert_openai_error(await api.post("/v1/chat/completions", json=chat_body(seed=2**64)), 400, "seed")
    assert "[type=less_than_equal]" in err["message"]
    err = assert_openai_error(await api.post("/v1/chat/completions", json=chat_body(n=0)), 400, "n")
    assert "[type=greater_than_equal]" in err["message"]
    err = assert_openai_error(await api.post("/v1/chat/completions", json=chat_body(n=1, top_k=0)), 400)
    assert "[type=" not in err["message"]  # our own checks say what they mean


async def test_responses_unknown_previous_response_is_400_and_usage_has_sglangs_names(api) -> None:
    body = {"model": "smol", "input": "Hi", "previous_response_id": "bad"}
    err = assert_openai_error(await api.post("/v1/responses", json=body), 400, "previous_response_id")
    assert err["code"] == "previous_response_not_found"  # OpenAI's; a GET of it stays a 404
    assert_openai_error(await api.get("/v1/responses/bad"), 404, "response_id")
    r = await api.post("/v1/responses", json={"model": "smol", "input": "a b"})
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        usage["input_tokens"],
        usage["output_tokens"],
    )


async def test_responses_honour_the_penalties(api) -> None:
    body = {"model": "smol", "input": "a b", "frequency_penalty": 1.0, "presence_penalty": -0.5}
    assert (await api.post("/v1/responses", json=body)).status_code == 200
    params = api.workers.received[-1].sampling_params
    assert (params.frequency_penalty, params.presence_penalty) == (1.0, -0.5)
    err = assert_openai_error(
        await api.post("/v1/responses", json={**body, "frequency_penalty": 3}), 400, "frequency_penalty"
    )
    assert "frequency_penalty" in err["message"]


async def test_vllms_optional_fields_are_null_unless_asked_for(api) -> None:
    """vLLM's clients read prompt_logprobs, prompt_token_ids and token_ids as attributes of the
    openai client's objects: present (null) in every non-streamed answer, as vLLM sends them."""
    chat = (await api.post("/v1/chat/completions", json=chat_body())).json()
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert chat["choices"][0]["token_ids"] is None
    chat = (await api.post("/v1/chat/completions", json=chat_body(return_token_ids=True))).json()
    assert chat["prompt_token_ids"] is not None and chat["choices"][0]["token_ids"] is not None
    [choice] = (await api.post("/v1/completions", json={"prompt": "a b"})).json()["choices"]
    assert (
        choice["prompt_logprobs"] is None
        and choice["prompt_token_ids"] is None
        and choice["token_ids"] is None
    )
    body = {"prompt": "a b", "return_token_ids": True}
    [choice] = (await api.post("/v1/completions", json=body)).json()["choices"]
    assert choice["prompt_token_ids"] is not None and choice["token_ids"] is not None
    events = sse_events((await api.post("/v1/chat/completions", json=chat_body(stream=True))).text)
    assert not any("prompt_token_ids" in e or "prompt_logprobs" in e for e in events)  # streamed: absent


async def test_responses_take_tool_choice_auto_without_tools(api) -> None:
    """ "auto" is the Responses API's default tool_choice (the answer echoes it), so a client may send it
    with no tools, as SGLang's tests do; "required" or a named function without tools stays a 400."""
    for choice in ("auto", "none"):
        r = await api.post("/v1/responses", json={"model": "smol", "input": "a b", "tool_choice": choice})
        assert r.status_code == 200, r.text
        assert r.json()["tool_choice"] == choice
    body = {"model": "smol", "input": "a b", "tool_choice": "required"}
    assert_openai_error(await api.post("/v1/responses", json=body), 400)
