"""From an HTTP body to what the scheduler receives, field by field (issue 13, mutation testing): the
API server's TokenizeMsg (through the wire format, fake workers behind the app) and then the
tokenizer's UserMsg for each choice, defaults included. Also the stop matcher's held-back text: a
stream that ends on what looks like the start of a stop string still delivers it."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from test_api_app import FakeWorkers, sse_events

from minisgl.core import SamplingParams
from minisgl.entrypoints.openai.app import create_app
from minisgl.entrypoints.openai.state import ServerState
from minisgl.frontend.manager import FrontendManager
from minisgl.message import BaseBackendMsg, TokenizeMsg, UserMsg
from minisgl.tokenizer.tokenize import ModelLimits, TokenizeManager

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]

MAX_SEQ_LEN = 2048


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class WordTokenizer:
    """One token per word (its length); a chat template that writes "role: content" lines."""

    chat_template = "role: content"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@pytest.fixture(scope="module")
def tokenize_manager() -> TokenizeManager:
    return TokenizeManager(WordTokenizer(), ModelLimits(max_seq_len=MAX_SEQ_LEN, vocab_size=100))


@pytest.fixture
async def api():
    workers = FakeWorkers()
    manager = FrontendManager(workers.send, max_queued_requests=16)
    manager.start(workers.recv)
    state = ServerState(manager, "smol", set(), max_seq_len=MAX_SEQ_LEN, status="serving")
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        client.workers = workers
        yield client
    await manager.stop()


CHAT = {"messages": [{"role": "user", "content": "hello there"}]}
TEXT = {"prompt": "hello there"}
OPENAI_DEFAULTS = SamplingParams(
    temperature=1.0, top_k=-1, top_p=1.0, ignore_eos=False, max_tokens=-1, stop_token_ids=[], seed=None
)
ALL_FIELDS = {
    "temperature": 0.25,
    "top_k": 7,
    "top_p": 0.5,
    "ignore_eos": True,
    "max_tokens": 9,
    "stop_token_ids": [13, 2],
    "seed": 41,
    "n": 3,
}
ALL_PARAMS = SamplingParams(
    temperature=0.25, top_k=7, top_p=0.5, ignore_eos=True, max_tokens=9, stop_token_ids=[13, 2], seed=41
)


async def sent(api: httpx.AsyncClient, path: str, body: dict) -> TokenizeMsg:
    r = await api.post(path, json=body)
    assert r.status_code == 200, r.text
    [msg] = api.workers.received
    return msg


def scheduled(manager: TokenizeManager, msg: TokenizeMsg) -> list[SamplingParams]:
    """The SamplingParams of the UserMsgs the tokenizer makes of `msg`, as the scheduler decodes them."""
    users = manager.prepare(msg)
    decoded = [BaseBackendMsg.from_bytes(u.to_bytes()) for u in users]
    assert all(isinstance(u, UserMsg) for u in decoded)
    assert [u.uid for u in decoded] == [msg.uid + i for i in range(msg.n)]
    return [u.sampling_params for u in decoded]


@pytest.mark.parametrize(("path", "prompt"), [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)])
async def test_openai_defaults(api, tokenize_manager, path: str, prompt: dict) -> None:
    msg = await sent(api, path, prompt)
    # completions default to 16 tokens (OpenAI's legacy default, vLLM's and SGLang's); chat fills the context
    default = 16 if path == "/v1/completions" else -1
    assert msg.sampling_params == dataclasses.replace(OPENAI_DEFAULTS, max_tokens=default) and msg.n == 1
    [params] = scheduled(tokenize_manager, msg)
    prompt_len = len(tokenize_manager.token_ids(msg.text))
    max_tokens = 16 if path == "/v1/completions" else MAX_SEQ_LEN - prompt_len
    assert params == SamplingParams(
        temperature=1.0, top_k=-1, top_p=1.0, ignore_eos=False, max_tokens=max_tokens
    )


@pytest.mark.parametrize(("path", "prompt"), [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)])
async def test_every_openai_field_reaches_the_scheduler(
    api, tokenize_manager, path: str, prompt: dict
) -> None:
    msg = await sent(api, path, {**prompt, **ALL_FIELDS, "stop": ["zz"]})
    assert msg.sampling_params == ALL_PARAMS and msg.n == 3
    choices = scheduled(tokenize_manager, msg)
    assert choices == [
        SamplingParams(**{**vars(ALL_PARAMS), "seed": 41 + i}) for i in range(3)
    ]  # choice i samples with seed + i, everything else as sent


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_completion_tokens": 5}, {"max_tokens": 5}),
        ({"max_completion_tokens": 5, "max_tokens": 8}, {"max_tokens": 5}),  # the newer name wins
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"top_k": -1, "top_p": 1}, {}),
        ({"seed": -3}, {"seed": -3}),
        ({"seed": 0}, {"seed": 0}),
        ({"stop_token_ids": []}, {}),
        ({"ignore_eos": False}, {}),
    ],
)
async def test_single_fields(api, body: dict, expected: dict) -> None:
    msg = await sent(api, "/v1/chat/completions", {**CHAT, **body})
    assert msg.sampling_params == SamplingParams(**{**vars(OPENAI_DEFAULTS), **expected})


async def test_native_generate_defaults_and_fields(api, tokenize_manager) -> None:
    """The chapters' /generate: greedy and 128 tokens unless told otherwise."""
    msg = await sent(api, "/generate", {"prompt": "hi", "stream": False})
    assert msg.sampling_params == SamplingParams(temperature=0.0, max_tokens=128) and msg.n == 1
    assert scheduled(tokenize_manager, msg) == [SamplingParams(temperature=0.0, max_tokens=128)]
    api.workers.received.clear()
    body = {
        "prompt": [5, 6],
        "max_tokens": 3,
        "ignore_eos": True,
        "temperature": 0.5,
        "top_k": 4,
        "top_p": 0.7,
    }
    msg = await sent(api, "/generate", {**body, "stream": False})
    assert msg.text == [5, 6]
    want = SamplingParams(temperature=0.5, top_k=4, top_p=0.7, ignore_eos=True, max_tokens=3)
    assert msg.sampling_params == want
    assert scheduled(tokenize_manager, msg) == [want]


# ---- text held back by the stop matcher is delivered when the stream ends ---------------------------
# The fake tokenizer answers "echo: <prompt> " word by word; the last words look like the start of
# the stop string "b STOP", so they are held back until the stream ends, then must be delivered.


async def test_held_back_text_is_flushed_at_the_end(api) -> None:
    body = {"prompt": "a b", "stop": ["b STOP"]}
    r = await api.post("/v1/completions", json=body)
    [choice] = r.json()["choices"]
    assert choice["text"] == "echo: a b " and choice["finish_reason"] == "stop"
    r = await api.post("/v1/completions", json={**body, "stream": True})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events) == "echo: a b "
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    r = await api.post("/v1/chat/completions", json={**CHAT, "stop": "there STOP", "max_tokens": 3})
    [choice] = r.json()["choices"]
    assert choice["message"]["content"] == "echo: hello there " and choice["finish_reason"] == "length"
    r = await api.post("/generate", json={"prompt": "a b", "stop": "b STOP"})
    assert "".join(e["text"] for e in sse_events(r.text)) == "echo: a b "


async def test_n_choices_without_a_seed(api, tokenize_manager) -> None:
    """No seed: every choice is scheduled with seed None (the engine's generator), none fails."""
    msg = await sent(api, "/v1/completions", {**TEXT, "n": 2, "temperature": 0.7, "max_tokens": 4})
    want = SamplingParams(temperature=0.7, max_tokens=4)
    assert msg.sampling_params == want and msg.n == 2
    assert scheduled(tokenize_manager, msg) == [want, want]


async def test_chat_content_forms_and_non_ascii_text_reach_the_tokenizer(api) -> None:
    """Content as text parts, as null, and text outside ASCII (not a lone surrogate) all pass."""
    messages = [
        {"role": "system", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "Grüß "}, {"type": "text", "text": "dich 🎉"}]},
    ]
    msg = await sent(api, "/v1/chat/completions", {"messages": messages})
    assert msg.text == [{"role": "system", "content": ""}, {"role": "user", "content": "Grüß dich 🎉"}]
