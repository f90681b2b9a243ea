"""The pieces of structured output and tool calling without a server: grammars and their bitmasks
against the embedded model's tokenizer, the engine's masking of grammar rows, the scheduler's
handling of grammars that do not compile, and the tool-call parsers, prompts and streaming."""

from __future__ import annotations

import json

import pytest
import torch

from minisgl.entrypoints.openai.tools import (
    ToolFormat,
    ToolOutput,
    choose_parser,
    fallback_messages,
    parse_hermes,
    parse_llama3_json,
    parse_required,
    required_schema,
)
from minisgl.grammar import (
    GRAMMAR_REFUSED,
    GrammarCompiler,
    GrammarError,
    apply_bitmask,
    json_schema_grammar,
    lark_grammar,
)

pytestmark = pytest.mark.timeout(120)

DIGITS = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    from minisgl.models import resolve_model_path

    return GrammarCompiler(str(resolve_model_path(None)), 49152, [2])


@pytest.fixture(scope="module")
def tokenizer():
    from minisgl.models import resolve_model_path
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(resolve_model_path(None))


def _allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(G, V) bool, bit by bit (the reference for apply_bitmask)."""
    bits = (mask.unsqueeze(-1).to(torch.int64) >> torch.arange(32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab] == 1


def test_invalid_schemas_raise_with_the_reason() -> None:
    with pytest.raises(GrammarError, match="Invalid type"):
        json_schema_grammar({"type": "nonsense"})
    with pytest.raises(GrammarError, match="regex"):
        json_schema_grammar({"type": "string", "pattern": "("})
    with pytest.raises(GrammarError):
        lark_grammar("start: undefined_rule")
    assert json_schema_grammar(DIGITS)


def test_matcher_allows_exactly_the_schema_and_stops_when_complete(compiler, tokenizer) -> None:
    g = compiler.compile(json_schema_grammar(DIGITS))
    text = '{"n": 42}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    for k in range(len(ids)):
        mask = compiler.fill_masks([g])
        allowed = _allowed(mask, 49152)[0]
        assert allowed[ids[k]], (k, tokenizer.decode(ids[: k + 1]))
        assert not g.is_done
        g.advance(ids[: k + 1])
    assert g.is_done and not g.error
    assert _allowed(compiler.fill_masks([g]), 49152)[0].nonzero().flatten().tolist() == [2]  # EOS only
    # A letter where the integer goes is not allowed
    g2 = compiler.compile(json_schema_grammar(DIGITS))
    prefix = tokenizer.encode('{"n": ', add_special_tokens=False)
    g2.advance(prefix)
    allowed = _allowed(compiler.fill_masks([g2]), 49152)[0]
    assert not allowed[tokenizer.encode("x", add_special_tokens=False)[0]]
    assert allowed[tokenizer.encode("7", add_special_tokens=False)[0]]


def test_advance_feeds_each_token_once(compiler, tokenizer) -> None:
    g = compiler.compile(json_schema_grammar(DIGITS))
    ids = tokenizer.encode('{"n": 1}', add_special_tokens=False)
    g.advance(ids[:2])
    g.advance(ids[:2])  # nothing new
    g.advance(ids)
    assert g.consumed == len(ids) and g.is_done and not g.error


def test_apply_bitmask_matches_the_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    rows = torch.tensor([4, 0, 2])
    out = logits.clone()
    apply_bitmask(out, mask, rows)
    allowed = _allowed(mask, vocab)
    for i, r in enumerate(rows.tolist()):
        assert torch.equal(out[r], torch.where(allowed[i], logits[r], float("-inf")))
    for r in (1, 3):  # rows without a mask are untouched
        assert torch.equal(out[r], logits[r])
    whole = logits[:3].clone()
    apply_bitmask(whole, mask)
    assert torch.equal(whole, torch.where(allowed, logits[:3], float("-inf")))


def test_the_llm_keeps_to_the_grammar_beside_free_requests() -> None:
    """One batch, greedy: a request with a schema gives valid JSON, the one without gives the same
    tokens as alone (the mask is applied to its own row only)."""
    from minisgl import LLM, SamplingParams

    llm = LLM(device="cpu", max_seq_len=256)
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(["Tell me a joke."], free)[0]["token_ids"]
    held = SamplingParams(temperature=0, max_tokens=40, grammar=json_schema_grammar(DIGITS))
    both = llm.generate(["Tell me a joke.", "A number as JSON:"], [free, held])
    assert both[0]["token_ids"] == alone
    assert both[1]["finish_reason"] == "stop", (both[1]["text"], both[1]["token_ids"])
    assert json.loads(both[1]["text"])["n"] is not None
    # a grammar that does not compile is refused, and the LLM goes on
    bad = SamplingParams(max_tokens=2, grammar='{"grammars": [{"lark_grammar": "start: nope"}]}')
    [out] = llm.generate(["x"], bad)
    assert out["finish_reason"] == "error" and out["error"].startswith(GRAMMAR_REFUSED)
    assert llm.generate(["x"], SamplingParams(temperature=0, max_tokens=2))[0]["token_ids"]


# ---- tools ----------------------------------------------------------------------------------------


def test_hermes_parser() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    _, [cut] = parse_hermes('<tool_call>{"name": "f", "arguments": {"a": 2}}')  # no closing tag
    assert cut.name == "f" and json.loads(cut.arguments) == {"a": 2}


def test_llama3_json_parser() -> None:
    _, calls = parse_llama3_json(
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert parse_llama3_json("Paris is sunny.") == ("Paris is sunny.", [])
    assert parse_llama3_json('{"not": "a call"}') == ('{"not": "a call"}', [])


def test_required_schema_and_parser() -> None:
    import jsonschema

    tools = [
        {"type": "function", "function": {"name": "f", "parameters": DIGITS}},
        {"type": "function", "function": {"name": "g"}},
    ]
    schema = required_schema(tools)
    good = [{"name": "f", "parameters": {"n": 1}}, {"name": "g", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"n": "x"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert [c.name for c in parse_required(json.dumps(good))] == ["f", "g"]
    assert parse_required('[{"name": "f", "param') == []


def test_parser_choice_from_the_template() -> None:
    assert choose_parser("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert choose_parser("<|python_tag|>{{ tools }}") == "llama3_json"
    assert choose_parser("") == "hermes"
    assert choose_parser("<tool_call>", "llama3_json") == "llama3_json"
    with pytest.raises(ValueError, match="tool-call-parser"):
        choose_parser("", "xml")


def test_fallback_prompt_carries_tools_calls_and_results() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c"},
    ]
    out = fallback_messages(history, tools, "hermes")
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in out)
    assert out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert '"get_weather"' in out[0]["content"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        == out[2]["content"]
    )
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # a template with tool support gets the structured messages and the tools
    wire, tools_json = ToolFormat("hermes", in_template=True).prompt(history, tools)
    assert json.loads(tools_json) == tools and json.loads(wire[2]["tool_calls"])[0]["id"] == "c"
    assert ToolFormat().prompt(history[:2], []) == (history[:2], "")


def _stream(out: ToolOutput, pieces: list[str], finish: str = "stop") -> tuple[list[dict], str]:
    deltas = [d for p in pieces for d in out.feed(p)]
    more, reason = out.finish(finish)
    return deltas + more, reason


def test_auto_stream_sends_content_and_holds_calls() -> None:
    pieces = ["Sure", ". <tool", "_call>\n", '{"name": "f", "arguments": {"a": 1}}', "\n</tool_call>"]
    deltas, reason = _stream(ToolOutput("auto"), pieces)
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == "Sure." and "<tool" not in content
    [calls] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'} and calls[0]["id"]
    assert reason == "tool_calls"
    # a "<" that does not begin a call is sent once it is clear
    deltas, reason = _stream(ToolOutput("auto"), ["1 <", " 2"])
    assert "".join(d.get("content", "") for d in deltas) == "1 < 2" and reason == "stop"


def test_named_stream_sends_the_name_then_the_arguments() -> None:
    out = ToolOutput("function", function="f")
    deltas, reason = _stream(out, ['{"a"', ": 1}"])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas)
    assert args == '{"a": 1}' and reason == "tool_calls"
    assert [(c.name, c.arguments, c.id) for c in out.calls] == [
        ("f", '{"a": 1}', deltas[0]["tool_calls"][0]["id"])
    ]
    _, reason = _stream(ToolOutput("function", function="f"), ['{"a"'], "length")
    assert reason == "length"


def test_required_stream_sends_each_call_as_it_is_written() -> None:
    text = json.dumps([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}])
    out = ToolOutput("required")
    deltas, reason = _stream(out, [text[i : i + 5] for i in range(0, len(text), 5)])
    assert reason == "tool_calls" and all("content" not in d for d in deltas)
    calls = [c for d in deltas for c in d["tool_calls"]]
    heads = [c for c in calls if "id" in c]
    assert [(c["index"], c["function"]["name"]) for c in heads] == [(0, "f"), (1, "g")]
    args = ["".join(c["function"]["arguments"] for c in calls if c["index"] == i) for i in (0, 1)]
    assert args == ['{"a": 1}', "{}"] and len([c for c in calls if c["index"] == 0]) > 2
    assert [(c.name, c.id) for c in out.calls] == [(h["function"]["name"], h["id"]) for h in heads]
    # cut short: what was streamed of the calls is all there is, and no call is made
    cut = ToolOutput("required")
    deltas, reason = _stream(cut, [text[:34]], "length")  # the head and part of the arguments
    assert reason == "length" and not cut.calls and all("content" not in d for d in deltas)


def test_one_compile_serves_every_request_with_that_grammar(compiler, tokenizer) -> None:
    """The cache: the same grammar text compiles once (the `n` choices of a request, a schema sent
    again), and each request gets its own matcher."""
    before = compiler.num_compiles
    grammar = json_schema_grammar({**DIGITS, "title": "cached"})
    futures = [compiler.submit(grammar) for _ in range(16)]
    assert all(f is futures[0] for f in futures) and compiler.num_compiles == before + 1
    a, b = (compiler.matcher(f) for f in futures[:2])
    a.advance(tokenizer.encode('{"n": 1}', add_special_tokens=False))
    assert a.is_done and not b.is_done and b.consumed == 0  # copies: one's progress is not the other's
    compiler.compile(json_schema_grammar({**DIGITS, "title": "another"}))  # other text: compiled
    assert compiler.num_compiles == before + 2


def test_a_grammar_that_breaks_while_sampling_ends_the_llms_request_with_an_error() -> None:
    """3,000 optional properties compile, then the step after "{" needs more than llguidance's
    50,000 Earley items: the request ends with "error" and the reason, not a truncated "stop"."""
    from minisgl import LLM, SamplingParams

    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
    llm = LLM(device="cpu", max_seq_len=256)
    held = SamplingParams(temperature=0, max_tokens=20, grammar=json_schema_grammar(schema, check=False))
    free = SamplingParams(temperature=0, max_tokens=5)
    broken, other = llm.generate(["JSON:", "Hello"], [held, free])
    assert broken["finish_reason"] == "error" and "Too many items" in broken["error"]
    assert broken["error"].startswith(GRAMMAR_REFUSED) and len(broken["error"]) < 400
    assert broken["text"].startswith("{")
    assert other["finish_reason"] == "length" and len(other["token_ids"]) == 5


@pytest.mark.slow
def test_tp3_gives_tp1s_tokens_with_grammars() -> None:
    """Three ranks compile on their own threads and admit each grammar request in the same step, so
    tp=3 gives tp=1's tokens for a mix of grammar and free requests (the embedded model's 9 heads)."""
    from minisgl import LLM, SamplingParams

    prompts = ["A number as JSON:", "Tell me a joke.", "Another number:", "Hi"]
    held = SamplingParams(temperature=0, max_tokens=16, grammar=json_schema_grammar(DIGITS))
    free = SamplingParams(temperature=0, max_tokens=8)
    params = [held, free, held, free]
    expected = [r["token_ids"] for r in LLM(device="cpu", max_seq_len=256).generate(prompts, params)]
    with LLM(device="cpu", max_seq_len=256, tp=3) as llm:
        assert [r["token_ids"] for r in llm.generate(prompts, params)] == expected
