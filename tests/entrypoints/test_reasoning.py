"""Reasoning models: the tokenizer's verdict on where an answer starts, the split of the answer into
reasoning and content (streamed in any pieces or not), the grammar held back until the reasoning
ends (in the engine: the matcher starts at the end-of-think token), and a real server with a tiny
random Qwen3 whose tokenizer has <think> tokens, through the openai client.

A random model writes no reasoning of its own; logit_bias makes it open and close one, so that the
grammar's start is visible: with the gate, `<think>` is allowed as the first token under a JSON
schema and `</think>` right after it (no JSON grammar allows either); without it neither could be."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_api_app import FakeWorkers, anyio_backend, assert_openai_error, sse_events  # noqa: F401
from test_models_support import save_tiny_hf_model
from test_server import ServerProcess, openai_client, served

from minisgl.core import reasoning_end
from minisgl.entrypoints.openai.extensions.reasoning import ReasoningSplit
from minisgl.message import ReplyReasoning, TokenizeMsg, UserReply, UserReplyExtra
from minisgl.tokenizer.reasoning import ReasoningFormat

pytestmark = [pytest.mark.timeout(180)]

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].split('</think>')[-1] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].split('</think>')[-1] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
EFFORT_TEMPLATE = QWEN3_TEMPLATE.replace(
    "<|im_start|>assistant\n", "<|im_start|>assistant\n{{ reasoning_effort }}"
)


def save_think_tokenizer(out: Path, template: str) -> Any:
    """A byte-level BPE tokenizer (llguidance reads it) with Qwen's turn markers (special) and the
    <think> markers (added, not special: they stay in the decoded text, as Qwen3's do)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tokens = [table[b] for b in range(256)] + ["</s>", "<s>"]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = template
    fast.save_pretrained(str(out))
    return fast


def tiny_qwen3(out: Path, template: str = QWEN3_TEMPLATE) -> Path:
    """A tiny random Qwen3 checkpoint with the think tokenizer (vocab: its 262 tokens)."""
    ids = dict(bos_token_id=257, eos_token_id=259)
    save_tiny_hf_model(
        "Qwen3ForCausalLM", out, True, vocab=262, head_dim=16, max_position_embeddings=1024, **ids
    )
    save_think_tokenizer(out, template)
    return out


# ---- where an answer starts -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def think_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return save_think_tokenizer(tmp_path_factory.mktemp("tok"), QWEN3_TEMPLATE)


def _prompt(tok: Any, template: str, **variables: Any) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
        chat_template=template,
        **variables,
    )
    return list(tok.encode(text, add_special_tokens=False))


def test_the_format_and_where_an_answer_starts(think_tok: Any) -> None:
    fmt = ReasoningFormat.of(think_tok, "auto")
    assert fmt is not None and fmt.name == "qwen3"
    assert (fmt.start_id, fmt.end_id) == (
        think_tok.convert_tokens_to_ids("<think>"),
        think_tok.convert_tokens_to_ids("</think>"),
    )
    assert fmt.mode(think_tok, _prompt(think_tok, QWEN3_TEMPLATE)) == "optional"
    assert fmt.mode(think_tok, _prompt(think_tok, QWEN3_TEMPLATE, enable_thinking=False)) == "off"
    assert fmt.mode(think_tok, _prompt(think_tok, R1_TEMPLATE)) == "inside"
    assert fmt.token_ids("optional") == (fmt.start_id, fmt.end_id)
    assert fmt.token_ids("inside") == (-1, fmt.end_id) and fmt.token_ids("off") == (-1, -1)
    assert ReasoningFormat.of(think_tok, "none") is None
    think_tok.chat_template = R1_TEMPLATE
    try:
        r1 = ReasoningFormat.of(think_tok, "auto")
        assert r1 is not None and r1.name == "deepseek_r1"
        assert r1.mode(think_tok, _prompt(think_tok, QWEN3_TEMPLATE)) == "inside"  # R1 always thinks
    finally:
        think_tok.chat_template = QWEN3_TEMPLATE


def test_the_workers_tokenizer(tmp_path: Path) -> None:
    """The tokenizer workers' own FastTokenizer (no transformers classes): the same format, marker
    ids and verdicts, and a request's own chat template."""
    from minisgl.tokenizer.fast import FastTokenizer

    save_think_tokenizer(tmp_path, QWEN3_TEMPLATE)
    tok = FastTokenizer.from_dir(tmp_path)
    fmt = ReasoningFormat.of(tok, "auto")  # type: ignore[arg-type]
    assert fmt is not None and (fmt.name, fmt.start_id, fmt.end_id) == ("qwen3", 260, 261)
    chat = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, chat_template=R1_TEMPLATE)
    assert isinstance(text, str) and text.endswith("assistant\n<think>\n")
    assert fmt.mode(tok, tok.encode(text, add_special_tokens=False)) == "inside"  # type: ignore[arg-type]
    off = tok.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=False)
    assert fmt.mode(tok, tok.encode(str(off), add_special_tokens=False)) == "off"  # type: ignore[arg-type]


def test_a_model_without_think_tokens_has_no_format(tmp_path: Path) -> None:
    from test_models_support import save_tiny_tokenizer
    from transformers import AutoTokenizer

    save_tiny_tokenizer(tmp_path, 131)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ReasoningFormat.of(tok, "auto") is None
    with pytest.raises(ValueError, match="no <think>"):
        ReasoningFormat.of(tok, "qwen3")


def test_reasoning_end() -> None:
    S, E = 10, 11
    assert reasoning_end([1, 2], -1, -1) == 0  # no reasoning at all
    assert reasoning_end([], S, E) is None and reasoning_end([5, E], S, E) == 0  # optional: absent
    assert reasoning_end([S, 5, 6], S, E) is None and reasoning_end([S, 5, E, 7], S, E) == 3
    assert reasoning_end([5, 6], -1, E) is None and reasoning_end([5, E, 7], -1, E) == 2  # inside


# ---- the split ------------------------------------------------------------------------------------

SPLITS = [
    ("optional", "<think>\nplan it\n</think>\n\nThe answer.", "plan it", "The answer."),
    ("optional", "The answer, no thinking.", "", "The answer, no thinking."),
    ("optional", "  <thinking is a word", "", "  <thinking is a word"),
    ("inside", "plan\n</think>\n\nyes", "plan", "yes"),
    ("inside", "<think>plan</think>yes", "plan", "yes"),  # a model that writes <think> anyway
    ("inside", "cut short by max_tok", "cut short by max_tok", ""),
    ("off", "<think>not parsed</think>", "", "<think>not parsed</think>"),
    ("", "plain <think> text", "", "plain <think> text"),
    ("optional", "<think>a <tool_call>{}</tool_call></think>b", "a <tool_call>{}</tool_call>", "b"),
]


@pytest.mark.parametrize(("mode", "text", "reasoning", "content"), SPLITS)
def test_split_is_the_same_in_any_pieces(mode: str, text: str, reasoning: str, content: str) -> None:
    cuts = [[text]] + [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        split, r, c = ReasoningSplit(), "", ""
        for p in pieces:
            dr, dc = split.feed(p, mode)
            r, c = r + dr, c + dc
        dr, dc = split.finish()
        assert (r + dr, c + dc) == (reasoning, content), pieces
        assert (split.reasoning, split.content) == (reasoning, content)


# ---- the grammar gate (real llguidance, no model) -------------------------------------------------


def test_grammar_starts_after_the_reasoning(tmp_path: Path) -> None:
    from minisgl.grammar import GrammarCompiler, json_schema_grammar

    tok = save_think_tokenizer(tmp_path, QWEN3_TEMPLATE)
    S, E = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    brace = tok.encode("{", add_special_tokens=False)[0]
    letter = tok.encode("x", add_special_tokens=False)[0]
    compiler = GrammarCompiler(str(tmp_path), len(tok), [tok.convert_tokens_to_ids("<|im_end|>")], workers=1)
    try:
        text = json_schema_grammar({"type": "object"})

        def allowed(g: Any, t: int) -> bool:
            mask = compiler.fill_masks([g])
            return bool((int(mask[0, t // 32]) >> (t % 32)) & 1)

        optional = compiler.compile(text, (S, E))
        optional.advance([])
        assert optional.constrains and allowed(optional, S) and allowed(optional, brace)
        assert not allowed(optional, letter) and not allowed(optional, E)
        optional.advance([S, letter])
        assert not optional.constrains and not optional.is_done  # thinking: free
        optional.advance([S, letter, E])
        assert optional.constrains and allowed(optional, brace) and not allowed(optional, S)
        optional.advance([S, letter, E, brace])
        assert optional.consumed == 4 and not optional.matcher.is_error()

        absent = compiler.compile(text, (S, E))
        absent.advance([brace])  # the first token was the grammar's: no reasoning, held from 0
        assert absent.constrains and absent.start == 0 and not absent.matcher.is_error()

        inside = compiler.compile(text, (-1, E))
        inside.advance([])
        assert not inside.constrains  # the prompt opened the reasoning
        inside.advance([letter, E])
        assert inside.constrains and inside.start == 2

        plain = compiler.compile(text)
        plain.advance([])
        assert plain.constrains and not allowed(plain, S)
    finally:
        compiler.close()


# ---- the API with fake workers ---------------------------------------------------------------------


class ScriptedWorkers(FakeWorkers):
    """The user's message is "MODE|TEXT": acknowledged with that reasoning mode, answered with TEXT
    in pieces of 3 characters, the last reply saying 5 reasoning tokens."""

    async def run(self, m: TokenizeMsg, uid: int) -> None:
        mode, text = m.text[-1]["content"].split("|", 1)  # type: ignore[index]
        self.out.put_nowait(
            UserReply(
                uid, "", False, prompt_tokens=4, extra=UserReplyExtra(reasoning=ReplyReasoning(mode=mode))
            )
        )
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        for k, piece in enumerate(pieces, 1):
            await asyncio.sleep(0)
            last = k == len(pieces)
            extra = UserReplyExtra(reasoning=ReplyReasoning(tokens=5)) if last else None
            self.out.put_nowait(
                UserReply(uid, piece, last, "stop" if last else "", completion_tokens=k, extra=extra)
            )


@pytest.fixture
async def api():
    import httpx

    from minisgl.entrypoints.openai.app import create_app
    from minisgl.entrypoints.openai.state import ServerState
    from minisgl.frontend.manager import FrontendManager

    workers = ScriptedWorkers()
    manager = FrontendManager(workers.send)
    manager.start(workers.recv)
    app = create_app(ServerState(manager, "smol", max_seq_len=2048, status="serving"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        client.workers = workers  # type: ignore[attr-defined]
        yield client
    await manager.stop()


def _chat(text: str, **kw: Any) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": text}], **kw}


THOUGHT = "optional|<think>\nfirst, think\n</think>\n\nHello!"


@pytest.mark.anyio
async def test_reasoning_content_in_the_message(api) -> None:
    r = await api.post("/v1/chat/completions", json=_chat(THOUGHT))
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"], msg["reasoning"]) == (
        "Hello!",
        "first, think",
        "first, think",
    )
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    r = await api.post("/v1/chat/completions", json=_chat("off|Hello!"))
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "Hello!" and msg["reasoning_content"] is None


@pytest.mark.anyio
async def test_reasoning_streamed(api) -> None:
    r = await api.post(
        "/v1/chat/completions", json=_chat(THOUGHT, stream=True, stream_options={"include_usage": True})
    )
    events = sse_events(r.text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "first, think"
    assert "".join(d.get("reasoning", "") for d in deltas) == "first, think"
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    assert all(d.get("content") is not None for d in deltas[:1])  # the role chunk: "" not null
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    whole = await api.post("/v1/chat/completions", json=_chat(THOUGHT, stream=True, stream_reasoning=False))
    pieces = [
        d["reasoning_content"]
        for e in sse_events(whole.text)
        for d in [e["choices"][0]["delta"]]
        if "reasoning_content" in d
    ]
    assert pieces == ["first, think"]  # SGLang's stream_reasoning: false: in one piece


@pytest.mark.anyio
async def test_reasoning_left_out_or_kept_in_the_content(api) -> None:
    r = await api.post("/v1/chat/completions", json=_chat(THOUGHT, include_reasoning=False))
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "Hello!" and "reasoning_content" not in msg
    r = await api.post("/v1/chat/completions", json=_chat(THOUGHT, separate_reasoning=False))
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == THOUGHT.split("|", 1)[1] and "reasoning_content" not in msg


@pytest.mark.anyio
async def test_a_tool_call_inside_the_reasoning_is_not_a_call(api) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = 'optional|<think><tool_call>{"name": "f", "arguments": {}}</tool_call></think>No call.'
    r = await api.post("/v1/chat/completions", json=_chat(text, tools=tools))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "No call." and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop" and "<tool_call>" in choice["message"]["reasoning_content"]
    text = 'optional|<think>plan</think><tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    r = await api.post("/v1/chat/completions", json=_chat(text, tools=tools))
    choice = r.json()["choices"][0]
    assert (
        choice["finish_reason"] == "tool_calls"
        and choice["message"]["tool_calls"][0]["function"]["name"] == "f"
    )


@pytest.mark.anyio
async def test_responses_reasoning_item(api) -> None:
    r = await api.post("/v1/responses", json={"model": "smol", "input": THOUGHT})
    out = r.json()["output"]
    assert [i["type"] for i in out] == ["reasoning", "message"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "first, think"}]
    assert out[1]["content"][0]["text"] == "Hello!"
    assert r.json()["usage"]["output_tokens_details"] == {"reasoning_tokens": 5}
    r = await api.post("/v1/responses", json={"model": "smol", "input": THOUGHT, "stream": True})
    kinds = [json.loads(ln[6:])["type"] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.reasoning_text.done")
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


@pytest.mark.anyio
async def test_template_variables_reach_the_tokenizer(api) -> None:
    body = _chat(
        "off|x",
        chat_template_kwargs={"enable_thinking": False},
        reasoning_effort="low",
        documents=[{"t": "d"}],
    )
    assert (await api.post("/v1/chat/completions", json=body)).status_code == 200
    sent = json.loads(api.workers.received[-1].template_kwargs)
    assert sent == {"enable_thinking": False, "reasoning_effort": "low", "documents": [{"t": "d"}]}
    bad = _chat("off|x", chat_template_kwargs={"tokenize": True})
    assert_openai_error(await api.post("/v1/chat/completions", json=bad), 400)
    own = _chat("off|x", chat_template="{{ 'x' }}")
    err = assert_openai_error(await api.post("/v1/chat/completions", json=own), 400, "chat_template")
    assert "--trust-request-chat-template" in err["message"]


# ---- a real server with a tiny Qwen3 ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = tiny_qwen3(tmp_path_factory.mktemp("qwen3"))
    tok = json.loads((model / "tokenizer.json").read_text())
    assert {t["content"]: t["id"] for t in tok["added_tokens"]}["<think>"] == 260  # BIAS's ids
    yield from served(
        "--model",
        str(model),
        "--max-seq-len",
        "1024",  # the tools' system prompt is ~700 byte tokens
        "--served-model-name",
        "tiny",
        "--trust-request-chat-template",
    )


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai_client(server)


CHOICE = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "y"]}},
    "required": ["a"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "c", "schema": CHOICE}}
# <think> (260) strongly, </think> (261) more: only the gate lets the two through a JSON grammar.
BIAS = {"260": 90, "261": 100}


def test_the_grammar_applies_after_the_reasoning(client) -> None:
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=40)
    r = client.chat.completions.create(**kw, response_format=FORMAT, logit_bias=BIAS)
    msg = r.choices[0].message
    assert json.loads(msg.content) in ({"a": "x"}, {"a": "y"}), msg.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 2  # <think></think>
    assert msg.model_extra["reasoning_content"] is None  # an empty reasoning
    stream = client.chat.completions.create(**kw, response_format=FORMAT, logit_bias=BIAS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == msg.content
    # Thinking off (Qwen3's enable_thinking): the grammar holds from the first token, no <think>.
    off = client.chat.completions.create(
        **kw,
        response_format=FORMAT,
        logit_bias=BIAS,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert json.loads(off.choices[0].message.content) in ({"a": "x"}, {"a": "y"})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_forced_tool_call_after_the_reasoning(client) -> None:
    tool = {"type": "function", "function": {"name": "pick", "parameters": CHOICE}}
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=60,
        tools=[tool], tool_choice={"type": "function", "function": {"name": "pick"}}, logit_bias=BIAS,
    )  # fmt: skip
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "pick" and json.loads(call.function.arguments) in ({"a": "x"}, {"a": "y"})
    assert r.usage.completion_tokens_details.reasoning_tokens == 2


def test_guided_choice_after_the_reasoning(client) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=20,
        logit_bias=BIAS, extra_body={"guided_choice": ["left", "right"]},
    )  # fmt: skip
    assert r.choices[0].message.content in ("left", "right")


def test_reasoning_effort_and_a_request_template(client) -> None:
    import openai

    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(**kw, reasoning_effort="low")  # the model's template takes none
    r = client.chat.completions.create(
        **kw, reasoning_effort="low", extra_body={"chat_template": EFFORT_TEMPLATE}
    )
    plain = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens + len("low")  # one token per byte


def test_token_ids_through_the_workers(client) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=5,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert len(r.model_extra["prompt_token_ids"]) == r.usage.prompt_tokens
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens and all(0 <= t < 262 for t in ids)
