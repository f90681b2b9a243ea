"""Logprobs, penalties, biases and the smaller OpenAI fields against the real server and the
embedded model (CPU), through the official `openai` client where it has the field: logprobs match a
log-softmax of the logits that transformers computes on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from test_server import ServerProcess, openai_client, served

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
N = 4


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from served(
        "--max-seq-len", "512", "--served-model-name", "smol", "--log-level", "info", "--dtype", "float32"
    )


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai_client(server)


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    """transformers on the same weights: the prompt's ids + N greedy tokens, and the log-softmax of
    the logits at every position (row p: the distribution of token p + 1)."""
    from minisgl.models import resolve_model_path
    from minisgl.models.reference import transformers_model
    from minisgl.utils.hf import load_tokenizer

    path = resolve_model_path(None)
    ids = list(load_tokenizer(path).encode(PROMPT))
    hf = transformers_model(path)
    with torch.inference_mode():
        for _ in range(N):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    del hf
    return ids, lp


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "smol", **body}, timeout=120)


def test_completion_logprobs_match_the_model(client, reference) -> None:
    ids, lp = reference
    p = len(ids) - N
    r = client.completions.create(model="smol", prompt=ids[:p], max_tokens=N, temperature=0, logprobs=5)
    got = r.choices[0].logprobs
    assert len(got.tokens) == N
    for i in range(N):
        row = lp[p - 1 + i]
        assert got.token_logprobs[i] == pytest.approx(float(row[ids[p + i]]), abs=2e-3)
        values = list(got.top_logprobs[i].values())
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(row.topk(len(values)).values.tolist(), abs=2e-3)
        assert got.top_logprobs[i][got.tokens[i]] == got.token_logprobs[i]  # greedy: the top one
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(N)]
    assert "".join(got.tokens) == r.choices[0].text


def test_logprobs_of_a_sampled_token_that_is_not_the_most_likely(client, reference) -> None:
    """Sampling (temperature 1) with a bias that forces a token far from the most likely one: the
    logprob reported is the raw log-softmax at the sampled token, not at the top one (the tests
    above sample greedily, where the two agree), in the completions and in the chat shape."""
    ids, lp = reference
    p = len(ids) - N
    row, forced = lp[p - 1], 1234
    assert int(row.argmax()) != forced and float(row.max() - row[forced]) > 1.0
    kw = dict(model="smol", max_tokens=1, temperature=1.0, seed=1, logit_bias={str(forced): 100})
    got = client.completions.create(**kw, prompt=ids[:p], logprobs=3).choices[0].logprobs
    assert got.token_logprobs[0] == pytest.approx(float(row[forced]), abs=2e-3)
    top = got.top_logprobs[0]  # the 3 most likely, and the sampled token (as vLLM gives them)
    assert top[got.tokens[0]] == pytest.approx(float(row[forced]), abs=2e-3)
    others = [v for t, v in top.items() if t != got.tokens[0]]
    assert others == pytest.approx(row.topk(3).values.tolist(), abs=2e-3)
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(**kw, messages=messages, logprobs=True, top_logprobs=1)
    [token] = chat.choices[0].logprobs.content
    assert token.token == got.tokens[0]  # the forced token here too
    assert token.logprob < token.top_logprobs[0].logprob - 1.0  # its own value, not the top one's


def test_echo_gives_the_prompt_and_its_logprobs(client, reference) -> None:
    ids, lp = reference
    p = len(ids) - N
    r = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True
    )
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    got = c.logprobs
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert len(got.tokens) == p + 2 and "".join(got.tokens[:p]) == PROMPT
    for j in range(1, p + 2):
        assert got.token_logprobs[j] == pytest.approx(float(lp[j - 1, ids[j]]), abs=2e-3)
    plain = client.completions.create(model="smol", prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None


def test_chat_logprobs_streamed_and_not(client) -> None:
    kw = dict(model="smol", messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0)
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3).choices[0]
    content = full.logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == full.message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True
        )
    streamed = [
        t
        for chunk in client.chat.completions.create(**kw, logprobs=True, top_logprobs=3, stream=True)
        for c in chunk.choices
        if c.logprobs
        for t in c.logprobs.content
    ]
    # The same tokens; the values within float32 noise (the second request reads its prompt's K/V
    # from the prefix cache, computed in another batch shape).
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-3)
    assert client.chat.completions.create(**kw).choices[0].logprobs is None


def test_zero_penalties_keep_greedy_output(client) -> None:
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    zero = client.completions.create(
        **kw,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logit_bias={"5": 0},
        extra_body={"repetition_penalty": 1.0},
    )
    assert zero.choices[0].text == plain  # the zero bias takes the penalty path: still the same tokens


def test_frequency_penalty_stops_repetition(client) -> None:
    kw = dict(model="smol", prompt="1 1 1 1 1 1 1 1 1 1", max_tokens=12, temperature=0, logprobs=0)

    def top_count(**extra: object) -> int:
        tokens = client.completions.create(**kw, **extra).choices[0].logprobs.tokens
        return max(tokens.count(t) for t in tokens)

    base = top_count()
    assert base >= 6  # the model repeats " 1"
    assert top_count(frequency_penalty=2.0) <= min(3, base - 3)
    assert top_count(extra_body={"repetition_penalty": 3.0}) <= min(3, base - 3)


def test_logit_bias_forces_and_bans(client, reference) -> None:
    ids, _ = reference
    kw = dict(model="smol", prompt=PROMPT, max_tokens=5, logprobs=0)
    forced = client.completions.create(**kw, temperature=1.0, seed=1, logit_bias={"1234": 100})
    tokens = forced.choices[0].logprobs.tokens
    greedy = client.completions.create(**kw, temperature=0).choices[0].logprobs.tokens
    assert len(set(tokens)) == 1 and tokens[0] not in greedy
    p = len(ids) - N
    banned = client.completions.create(**kw, temperature=0, logit_bias={str(ids[p]): -100})
    assert banned.choices[0].logprobs.tokens[0] != greedy[0]


def test_logit_bias_beyond_the_vocabulary_is_400(server) -> None:
    r = _post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"10000000": 1}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


def test_min_tokens_delays_the_end(client) -> None:
    question = "What is the capital of France? Answer in one sentence."
    kw = dict(model="smol", messages=[{"role": "user", "content": question}], max_tokens=60, temperature=0)
    short = client.chat.completions.create(**kw)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(**kw, extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5


def test_stop_reason_names_the_string_or_token(client) -> None:
    kw = dict(model="smol", prompt=PROMPT, max_tokens=8, temperature=0)
    r = client.completions.create(**kw, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "Paris"
    plain = client.completions.create(**kw)
    assert plain.choices[0].model_extra["stop_reason"] is None


def test_stop_token_id_is_the_stop_reason(server, reference) -> None:
    ids, _ = reference
    p = len(ids) - N
    r = _post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [ids[p + 1]]},
    )
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == ids[p + 1]


def test_chat_template_options_and_custom_roles(client) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    base = client.chat.completions.create(model="smol", messages=msgs, max_tokens=1).usage.prompt_tokens
    no_prompt = client.chat.completions.create(
        model="smol", messages=msgs, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert no_prompt.usage.prompt_tokens < base
    cont = client.chat.completions.create(
        model="smol",
        messages=[*msgs, {"role": "assistant", "content": "The capital of France is"}],
        max_tokens=3,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert "Paris" in cont.choices[0].message.content
    custom = client.chat.completions.create(
        model="smol", messages=[{"role": "narrator", "content": "Hi"}], max_tokens=2
    )
    assert custom.choices[0].message.content


def test_models_by_id_and_stream_option_rules(client, server) -> None:
    assert client.models.retrieve("smol").id == "smol"
    assert httpx.get(server.url + "/v1/models/other").status_code == 404
    r = _post(server, "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]


def test_continuous_usage_stats(client) -> None:
    chunks = list(
        client.completions.create(
            model="smol",
            prompt=PROMPT,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 3 and chunks[-1].usage.total_tokens == 8
