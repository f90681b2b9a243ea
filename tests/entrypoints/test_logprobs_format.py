"""The two OpenAI logprobs shapes (server/logprobs_format.py) from the token bytes and values the
workers send: each token reports its own logprob (not its top alternative's), bytes are exact while
the text of a split character is U+FFFD, -inf becomes -9999, offsets run on across chunks, and the
echoed prompt comes first with a null first entry."""

from __future__ import annotations

from minisgl.entrypoints.openai.logprobs_format import ChatLogprobs, CompletionLogprobs
from minisgl.frontend.chunk import Chunk, TokenLogprob

# A sampled token that is not the most likely one: its own value differs from its top alternative's.
SAMPLED = TokenLogprob(b" Paris", -2.5, [(b" the", -0.25), (b" Paris", -2.5)])
EURO = "€".encode()  # 3 bytes, split over two tokens below


def _chunk(logprobs: list[TokenLogprob], prompt: list[TokenLogprob] | None = None) -> Chunk:
    text = b"".join(e.token for e in logprobs).decode("utf-8", errors="replace")
    return Chunk(text, None, 1, len(logprobs), logprobs=logprobs, prompt_logprobs=prompt)


def test_chat_reports_each_tokens_own_logprob_and_its_alternatives() -> None:
    out = ChatLogprobs().of([SAMPLED])
    assert out == {
        "content": [
            {
                "token": " Paris",
                "logprob": -2.5,
                "bytes": list(b" Paris"),
                "top_logprobs": [
                    {"token": " the", "logprob": -0.25, "bytes": list(b" the")},
                    {"token": " Paris", "logprob": -2.5, "bytes": list(b" Paris")},
                ],
            }
        ],
        "refusal": None,
    }


def test_chat_split_characters_infinities_and_nothing() -> None:
    out = ChatLogprobs().of([TokenLogprob(EURO[:2], float("-inf")), TokenLogprob(EURO[2:], -1.0)])
    assert out is not None
    first, second = out["content"]
    assert first["token"] == "\ufffd" and first["bytes"] == list(EURO[:2]) and first["logprob"] == -9999.0
    assert bytes(first["bytes"] + second["bytes"]).decode() == "€" and second["top_logprobs"] == []
    assert ChatLogprobs().of([]) is None


def test_completions_report_each_tokens_own_logprob_and_offsets_across_chunks() -> None:
    fmt = CompletionLogprobs()
    a = fmt.of(_chunk([SAMPLED]))
    b = fmt.of(_chunk([TokenLogprob(b" is", -0.5, [(b" is", -0.5)])]))
    assert a == {
        "tokens": [" Paris"],
        "token_logprobs": [-2.5],
        "top_logprobs": [{" the": -0.25, " Paris": -2.5}],
        "text_offset": [0],
    }
    assert b is not None and b["text_offset"] == [len(" Paris")] and b["token_logprobs"] == [-0.5]
    assert fmt.of(_chunk([])) is None


def test_completions_echo_the_prompt_first_with_a_null_first_entry() -> None:
    prompt = [TokenLogprob(b"The", None), TokenLogprob(b" capital", -7.0, [(b" first", -1.0)])]
    out = CompletionLogprobs().of_all(
        [_chunk([SAMPLED], prompt), _chunk([TokenLogprob(b"!", float("-inf"))])]
    )
    assert out == {
        "tokens": ["The", " capital", " Paris", "!"],
        "token_logprobs": [None, -7.0, -2.5, -9999.0],
        # each token's alternatives include the token itself (vLLM's: logprobs 0 still shows it)
        "top_logprobs": [
            None,
            {" capital": -7.0, " first": -1.0},
            {" Paris": -2.5, " the": -0.25},
            {"!": -9999.0},
        ],
        "text_offset": [0, 3, 11, 17],
    }
