"""The tokenizer's cost per request (issue 9, finding 5): a prompt is tokenized once whatever its `n`,
and a text too long for the context by its length alone is refused without being tokenized. The
length bound must never refuse a request that fits: checked on random texts with the embedded
model's tokenizer and a SentencePiece-style one, and refused for tokenizers where it cannot hold."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg
from minisgl.tokenizer.length_bound import LengthBound
from minisgl.tokenizer.tokenize import FILL_CONTEXT, ModelLimits, RequestRejected, TokenizeManager


@pytest.fixture(scope="module")
def tokenizer():
    from minisgl.models import resolve_model_path
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(resolve_model_path(None, require_weights=False))


class CountingTokenizer:
    """The real tokenizer, counting the characters it was asked to tokenize."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.chars = 0
        self.calls = 0
        self.backend_tokenizer = inner.backend_tokenizer
        self.chat_template = inner.chat_template

    def encode(self, text: str, **kw) -> list[int]:
        self.calls += 1
        self.chars += len(text)
        return self.inner.encode(text, **kw)

    def apply_chat_template(self, *a, **kw):
        return self.inner.apply_chat_template(*a, **kw)


def manager(tokenizer, max_seq_len: int = 8192) -> tuple[TokenizeManager, CountingTokenizer]:
    counting = CountingTokenizer(tokenizer)
    return TokenizeManager(
        counting, ModelLimits(max_seq_len=max_seq_len, vocab_size=len(tokenizer))
    ), counting


def test_n_choices_tokenize_once_and_fan_out(tokenizer) -> None:
    m, counting = manager(tokenizer)
    text = "The quick brown fox. " * 300
    msgs = m.prepare(
        TokenizeMsg(uid=10, text=text, sampling_params=SamplingParams(max_tokens=4, seed=7), n=64)
    )
    assert counting.calls == 1
    assert [u.uid for u in msgs] == list(range(10, 74))
    assert [u.sampling_params.seed for u in msgs] == list(range(7, 71))  # choice i: seed + i
    assert all(u.input_ids is msgs[0].input_ids for u in msgs)  # one tensor for all
    for bad_n in (0, 65, 10**9):
        with pytest.raises(RequestRejected, match="n must be"):
            m.prepare(TokenizeMsg(uid=1, text="x", sampling_params=SamplingParams(), n=bad_n))


def test_a_megabyte_prompt_is_refused_without_being_tokenized(tokenizer) -> None:
    m, counting = manager(tokenizer)
    huge = "Lorem ipsum dolor sit amet. " * 40_000  # 1.1 MB, about 250,000 tokens
    for params, completion in (
        (SamplingParams(max_tokens=FILL_CONTEXT), 1),
        (SamplingParams(max_tokens=16), 16),
    ):
        expected = (
            f"maximum context length is 8192 tokens. However, you requested at least .* {completion} in"
        )
        with pytest.raises(RequestRejected, match=expected):
            m.prepare(TokenizeMsg(uid=1, text=huge, sampling_params=params, n=64))
    chat = [{"role": "user", "content": huge}]
    with pytest.raises(RequestRejected, match="at least"):
        m.prepare(TokenizeMsg(uid=2, text=chat, sampling_params=SamplingParams(max_tokens=FILL_CONTEXT)))
    assert counting.chars == 0


def test_a_long_prompt_that_fits_is_not_refused_by_the_bound(tokenizer) -> None:
    """Whitespace runs are what one token covers most of: 8,000 tokens of them are still served."""
    m, _ = manager(tokenizer)
    text = ("\n" + " " * 80) * 4000  # 324 KB, 8,000 tokens, more than max_seq_len characters
    n_tokens = len(tokenizer.encode(text))
    assert len(text) > 8192 > n_tokens
    [msg] = m.prepare(
        TokenizeMsg(uid=1, text=text, sampling_params=SamplingParams(max_tokens=8192 - n_tokens))
    )
    assert len(msg.input_ids) == n_tokens


def test_bytes_the_tokenizer_drops_are_not_counted(tokenizer) -> None:
    """SmolLM2's vocabulary lacks 21 of the 256 byte-level characters (control characters among
    them): BPE silently drops those bytes, so they must not count towards the bound."""
    bound = LengthBound.of(tokenizer)
    assert bound is not None and 0x16 in bound.dropped and len(bound.dropped) == 21
    text = "\x16" * 50_000 + "Hello"
    assert bound.min_tokens(text) <= len(tokenizer.encode(text)) == 1
    m, _ = manager(tokenizer)
    [msg] = m.prepare(TokenizeMsg(uid=1, text=text, sampling_params=SamplingParams(max_tokens=4)))
    assert len(msg.input_ids) == 1


_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"]
_TEXT = st.lists(
    st.one_of(
        st.text(st.characters(exclude_categories=["Cs"]), max_size=40),
        st.sampled_from(_SPECIALS),
        st.builds(
            lambda c, k: c * k,
            st.sampled_from([" ", "\n", "\t", "a", "0", "é", "🎉", "—"]),
            st.integers(1, 300),
        ),
    ),
    max_size=12,
).map("".join)


@pytest.fixture(scope="module")
def embedded_bound(tokenizer) -> LengthBound:
    bound = LengthBound.of(tokenizer)
    assert bound is not None and bound.normalize is None
    return bound


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT)
def test_the_bound_never_exceeds_the_real_count_embedded(tokenizer, embedded_bound, text: str) -> None:
    assert embedded_bound.min_tokens(text) <= len(tokenizer.encode(text))


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A small BPE in the Llama-2/Mistral style: Prepend + Replace(" " -> "▁") normalizers, byte
    fallback, no pre-tokenizer; trained here on a few lines (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", *alphabet], initial_alphabet=["▁"]
    )
    lines = [
        "the quick brown fox jumps over the lazy dog " * 3,
        "hello world, " * 5,
        "    indented code\n" * 4,
    ]
    tok.train_from_iterator(lines * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT)
def test_the_bound_never_exceeds_the_real_count_sentencepiece(sentencepiece_like, text: str) -> None:
    bound = LengthBound.of(sentencepiece_like)  # a small vocabulary: cheap to build each time
    assert bound is not None and bound.normalize is not None
    assert bound.min_tokens(text) <= len(sentencepiece_like.encode(text, add_special_tokens=False))


def _edited(tokenizer, edit) -> object:
    """A tokenizer like `tokenizer` with its tokenizer.json edited by `edit(spec)`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    edit(spec)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def _set(path: list[str], value: object):
    def edit(spec: dict) -> None:
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (
            _set(["pre_tokenizer"], {"type": "WhitespaceSplit"}),
            "drops whitespace",
        ),
        (
            _set(
                ["pre_tokenizer"],
                {
                    "type": "Sequence",
                    "pretokenizers": [
                        {
                            "type": "ByteLevel",
                            "add_prefix_space": False,
                            "trim_offsets": True,
                            "use_regex": True,
                        },
                        {"type": "WhitespaceSplit"},
                    ],
                },
            ),
            "drops whitespace",
        ),
        (_set(["normalizer"], {"type": "Strip", "strip_left": True, "strip_right": True}), "strips"),
        (
            _set(["normalizer"], {"type": "Replace", "pattern": {"String": "  "}, "content": " "}),
            "multi-char",
        ),
        (
            _set(
                ["truncation"],
                {"direction": "Right", "max_length": 10, "strategy": "LongestFirst", "stride": 0},
            ),
            "truncates",
        ),
        (lambda spec: spec["added_tokens"][0].update(lstrip=True), "swallows spaces"),
        (_set(["model", "byte_fallback"], False), "an unknown character becomes one <unk>"),
        (lambda spec: spec["model"]["vocab"].pop("<0x16>"), "a byte token is missing"),
    ],
)
def test_no_bound_where_it_could_be_wrong(sentencepiece_like, edit, why: str) -> None:
    assert LengthBound.of(_edited(sentencepiece_like, lambda spec: None)) is not None  # unedited
    assert LengthBound.of(_edited(sentencepiece_like, edit)) is None, why


def test_no_bound_without_a_fast_tokenizer() -> None:
    assert LengthBound.of(object()) is None
