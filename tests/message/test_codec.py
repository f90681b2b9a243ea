"""The message codec: round trips, the bytes of the codec before issue 13, tensors, interop with the
chapter's serializer, strict errors."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import chapter_serializer
import msgpack
import pytest
import torch
from chapter_serializer import ChapterDetokenizeMsg, ChapterUserReply
from codec_corpus import corpus, fingerprint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BaseBackendMsg,
    BaseFrontendMsg,
    BaseTokenizerMsg,
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeExtra,
    DetokenizeMsg,
    ErrorMsg,
    ExitMsg,
    MessageDecodeError,
    TokenizeMsg,
    UserMsg,
    UserReply,
    UserReplyExtra,
    backend,
    codec,
    frontend,
    tokenizer,
)

BASES = (BaseTokenizerMsg, BaseBackendMsg, BaseFrontendMsg)


# -- the chapter-style generic serializer (interop partner): tests/chapter_serializer.py -------------

chapter_serialize = chapter_serializer.to_tagged
chapter_deserialize = chapter_serializer.from_tagged

CHAPTER_MAP = {
    name: getattr(mod, name)
    for mod in (tokenizer, backend, frontend)
    for name in dir(mod)
    if name.endswith(("Msg", "Reply", "Extra"))
}
CHAPTER_MAP["SamplingParams"] = SamplingParams


def lean(value: Any) -> Any:
    """The chapter's dict of a message, less the fields that hold their default in the classes that
    leave those off the wire (`omit_defaults`): what our codec writes."""
    if isinstance(value, list):
        return [lean(v) for v in value]
    if not isinstance(value, dict):
        return value
    cls = CHAPTER_MAP.get(value.get("__type__"))
    defaults = {}
    if cls is not None and getattr(cls, "omit_defaults", False):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name] = f.default_factory()
    return {
        k: lean(v)
        for k, v in value.items()
        if not (k in defaults and type(v) is type(defaults[k]) and v == defaults[k])
    }


def chapter_bytes(msg: Any) -> bytes:
    """What the chapter's serializer writes for `msg`, less the defaults we leave out."""
    return msgpack.packb(lean(chapter_serialize(msg)), use_bin_type=True)


# -- equality that understands tensors ------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def sp(**kw: Any) -> SamplingParams:
    return SamplingParams(**kw)


def user(uid: int, ids: list[int]) -> UserMsg:
    return UserMsg(uid=uid, input_ids=torch.tensor(ids, dtype=torch.int32), sampling_params=sp(max_tokens=8))


EXAMPLES: list[tuple[Any, Any]] = [
    (BaseTokenizerMsg, TokenizeMsg(1, "hello", sp())),
    (BaseTokenizerMsg, TokenizeMsg(2, [{"role": "user", "content": "你好"}], sp(temperature=0.7, top_k=5))),
    (BaseTokenizerMsg, TokenizeMsg(3, [1, 2, 3], sp(stop_token_ids=[7, 8], seed=123))),
    (BaseTokenizerMsg, TokenizeMsg(4, [], sp())),
    (BaseTokenizerMsg, DetokenizeMsg(5, 42, True, "stop")),
    (BaseTokenizerMsg, DetokenizeMsg(6, 0, False)),
    (BaseTokenizerMsg, DetokenizeMsg(6, 3, True, "stop", DetokenizeExtra(5, 3, -0.5, [3, 4], [-0.5, -2.0]))),
    (BaseTokenizerMsg, AbortMsg(7)),
    (BaseTokenizerMsg, ErrorMsg(8, "prompt too long")),
    (
        BaseTokenizerMsg,
        BatchTokenizerMsg([DetokenizeMsg(i, i * 3, i == 2) for i in range(3)] + [ErrorMsg(9, "x")]),
    ),
    (BaseTokenizerMsg, BatchTokenizerMsg([])),
    (BaseBackendMsg, user(10, [9707, 11, 1879])),
    (BaseBackendMsg, user(11, [])),
    (BaseBackendMsg, AbortBackendMsg(12)),
    (BaseBackendMsg, ExitMsg()),
    (BaseBackendMsg, BatchBackendMsg([user(13, [1]), AbortBackendMsg(13), ExitMsg()])),
    (BaseBackendMsg, BatchBackendMsg([BatchBackendMsg([ExitMsg(), user(14, [2, 3])]), AbortBackendMsg(1)])),
    (BaseFrontendMsg, UserReply(15, "Hello", False)),
    (BaseFrontendMsg, UserReply(16, "", True, "length", 3, 4, "")),
    (BaseFrontendMsg, UserReply(16, "a", True, "stop", 0, 4, "", UserReplyExtra(2, 7, "p", [b"a"], [-1.0]))),
    (BaseFrontendMsg, BatchFrontendMsg([UserReply(i, "é" * i, i == 1) for i in range(2)])),
]


@pytest.mark.parametrize("base,msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip_every_message(base: Any, msg: Any) -> None:
    raw = msg.to_bytes()
    assert raw == msgpack.packb(msg.encoder(), use_bin_type=True)
    assert base.encoder(msg) == msg.encoder()
    back = base.from_bytes(raw)
    assert same(back, msg)
    assert same(base.decoder(msgpack.unpackb(raw, raw=False)), msg)


GOLDEN = json.loads((Path(__file__).parent / "data" / "codec_golden.json").read_text())
CORPUS = corpus()


def test_golden_corpus_is_complete() -> None:
    assert sorted(CORPUS) == sorted(GOLDEN)
    seen = {type(m).__name__ for m in CORPUS.values()}
    seen |= {type(x).__name__ for m in CORPUS.values() for x in getattr(m, "data", [])}
    assert seen >= {cls.__name__ for base in BASES for cls in base._group.classes.values()}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_bytes_equal_those_of_the_codec_before(name: str) -> None:
    """Byte for byte what the two-generator codec (main at 8779c94) wrote, through both entry points."""
    msg = CORPUS[name]
    raw = msg.to_bytes()
    assert fingerprint(raw) == GOLDEN[name]
    assert raw == msgpack.packb(msg.encoder(), use_bin_type=True)
    base = next(b for b in BASES if isinstance(msg, b))
    assert base.from_bytes(raw).to_bytes() == raw  # and back (NaN != NaN, so compared as bytes)
    if all(t.dim() == 1 and t.dtype != torch.bfloat16 for t in _tensors_in(msg)):  # what the chapter sends
        assert chapter_bytes(msg) == raw


def _tensors_in(msg: Any) -> list[torch.Tensor]:
    if isinstance(msg, torch.Tensor):
        return [msg]
    if isinstance(msg, list):
        return [t for m in msg for t in _tensors_in(m)]
    if hasattr(msg, "__dataclass_fields__"):
        return [t for f in msg.__dataclass_fields__ for t in _tensors_in(getattr(msg, f))]
    return []


def test_encoder_is_the_chapter_dict() -> None:
    msg = BatchBackendMsg(data=[user(7, [9707, 11, 1879])])
    d = msg.encoder()
    assert list(d) == ["__type__", "data"]
    inner = d["data"][0]
    assert list(inner) == ["__type__", "uid", "input_ids", "sampling_params"]
    assert inner["input_ids"] == {
        "__type__": "Tensor",
        "buffer": b"\xeb%\x00\x00\x0b\x00\x00\x00W\x07\x00\x00",
        "dtype": "torch.int32",
    }
    assert list(inner["sampling_params"])[:6] == [
        "__type__",
        "temperature",
        "top_k",
        "top_p",
        "ignore_eos",
        "max_tokens",
    ]
    assert d == chapter_serialize(msg)


# -- tensors -----------------------------------------------------------------------------------------

DTYPES = [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.bool]
SHAPES = [(), (0,), (1,), (5,), (2, 3), (3, 0), (2, 3, 4), (1, 1, 1, 2)]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 1000)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = make_tensor(dtype, shape)
    msg = UserMsg(uid=1, input_ids=t, sampling_params=sp())
    d = msg.encoder()["input_ids"]
    assert ("shape" in d) == (len(shape) != 1)
    back = BaseBackendMsg.from_bytes(msg.to_bytes()).input_ids
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    back.add_(1) if dtype is not torch.bool else back.logical_not_()  # owns writable memory


def test_tensor_non_contiguous_is_sent_in_c_order() -> None:
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()
    back = BaseBackendMsg.from_bytes(UserMsg(1, t, sp()).to_bytes()).input_ids
    assert torch.equal(back, t)


# -- interop with the chapter's serializer -------------------------------------------------------------

INTEROP = [(b, m) for b, m in EXAMPLES if not isinstance(m, UserMsg) and not isinstance(m, BatchBackendMsg)]
INTEROP += [
    (BaseBackendMsg, BatchBackendMsg([user(1, [5, 6]), ExitMsg()])),
    (BaseBackendMsg, user(2, [1, 2, 3])),
]


@pytest.mark.parametrize("base,msg", INTEROP, ids=lambda x: type(x).__name__)
def test_chapter_bytes_decode_here(base: Any, msg: Any) -> None:
    raw = msgpack.packb(chapter_serialize(msg), use_bin_type=True)  # every field, defaults too
    assert same(base.from_bytes(raw), msg)
    assert chapter_bytes(msg) == msg.to_bytes()  # and ours are the same, less the defaults


@pytest.mark.parametrize("uid", [0, 127, 65536, 2**32 - 1, 2**63 - 1])
@pytest.mark.parametrize("token", [0, 200, 151_935])
@pytest.mark.parametrize("finished", [False, True])
def test_a_plain_token_is_the_chapters_message(uid: int, token: int, finished: bool) -> None:
    """A token without rare fields has exactly the bytes the chapter's serializer writes for the
    chapter's three-field DetokenizeMsg (at most 60 of them for a uid below 2**32), both ways."""
    ours, theirs = DetokenizeMsg(uid, token, finished), ChapterDetokenizeMsg(uid, token, finished)
    raw = ours.to_bytes()
    assert raw == chapter_serializer.pack(theirs)
    assert uid >= 2**32 or len(raw) <= 60
    assert BaseTokenizerMsg.from_bytes(raw) == ours
    assert chapter_serializer.unpack({"DetokenizeMsg": ChapterDetokenizeMsg}, raw) == theirs
    text = "é" * (token % 40)
    reply, chapter_reply = UserReply(uid, text, finished), ChapterUserReply(uid, text, finished)
    assert reply.to_bytes() == chapter_serializer.pack(chapter_reply)
    assert BaseFrontendMsg.from_bytes(reply.to_bytes()) == reply


def test_rare_fields_travel_in_extra_only_when_set() -> None:
    assert "extra" not in DetokenizeMsg(1, 2, True, "stop").encoder()
    msg = DetokenizeMsg(1, 2, True, "stop", DetokenizeExtra(cached_tokens=48))
    assert msg.encoder()["extra"] == {"__type__": "DetokenizeExtra", "cached_tokens": 48}
    assert BaseTokenizerMsg.from_bytes(msg.to_bytes()) == msg
    reply = UserReply(1, "", False, prompt_tokens=3, extra=UserReplyExtra(prompt_text="hi"))
    assert reply.encoder() == {
        "__type__": "UserReply",
        "uid": 1,
        "incremental_output": "",
        "finished": False,
        "prompt_tokens": 3,
        "extra": {"__type__": "UserReplyExtra", "prompt_text": "hi"},
    }


@pytest.mark.parametrize("base,msg", INTEROP, ids=lambda x: type(x).__name__)
def test_our_bytes_decode_there(base: Any, msg: Any) -> None:
    back = chapter_deserialize(CHAPTER_MAP, msgpack.unpackb(msg.to_bytes(), raw=False))
    assert same(back, msg)


def test_chapter_sampling_params_without_our_extra_fields_decode() -> None:
    """The chapter's SamplingParams has five fields; ours adds fields with defaults, so they may be omitted."""
    raw = msgpack.packb(
        {
            "__type__": "UserMsg",
            "uid": 7,
            "input_ids": {"__type__": "Tensor", "buffer": b"\x01\x00\x00\x00", "dtype": "torch.int32"},
            "sampling_params": {
                "__type__": "SamplingParams",
                "temperature": 0.6,
                "top_k": -1,
                "top_p": 1.0,
                "ignore_eos": False,
                "max_tokens": 64,
            },
        },
        use_bin_type=True,
    )
    msg = BaseBackendMsg.from_bytes(raw)
    assert msg.sampling_params == SamplingParams(temperature=0.6, max_tokens=64)
    assert msg.input_ids.tolist() == [1]


def test_int_for_float_field_is_accepted_as_float() -> None:
    raw = msgpack.packb({"__type__": "SamplingParams", "temperature": 1}, use_bin_type=True)
    raw = msgpack.packb(
        {"__type__": "TokenizeMsg", "uid": 1, "text": "a", "sampling_params": msgpack.unpackb(raw)},
        use_bin_type=True,
    )
    got = BaseTokenizerMsg.from_bytes(raw).sampling_params.temperature
    assert got == 1.0 and type(got) is float


# -- errors -------------------------------------------------------------------------------------------

T_OK = {"__type__": "Tensor", "buffer": b"\x01\x00\x00\x00", "dtype": "torch.int32"}
SP_OK = {
    "__type__": "SamplingParams",
    "temperature": 0.0,
    "top_k": -1,
    "top_p": 1.0,
    "ignore_eos": False,
    "max_tokens": 4,
    "stop_token_ids": [],
    "seed": None,
}


_DETOK = {"__type__": "DetokenizeMsg", "uid": 1, "next_token": 2, "finished": True}


def user_dict(**over: Any) -> dict:
    d = {"__type__": "UserMsg", "uid": 1, "input_ids": dict(T_OK), "sampling_params": dict(SP_OK)}
    d.update(over)
    return d


BAD: list[tuple[str, Any, Any, str]] = [
    ("unknown type", BaseBackendMsg, {"__type__": "Evil", "x": 1}, "unknown backend message type 'Evil'"),
    (
        "other group's type",
        BaseBackendMsg,
        {"__type__": "DetokenizeMsg", "uid": 1, "next_token": 2, "finished": False},
        "unknown backend message type 'DetokenizeMsg'",
    ),
    ("SamplingParams at top", BaseBackendMsg, dict(SP_OK), "unknown backend message type 'SamplingParams'"),
    ("Tensor at top", BaseBackendMsg, dict(T_OK), "unknown backend message type 'Tensor'"),
    ("no __type__", BaseBackendMsg, {"uid": 1}, "missing '__type__'"),
    ("__type__ not str", BaseBackendMsg, {"__type__": 3}, "unknown backend message type 3"),
    ("top-level list", BaseBackendMsg, [1, 2], "expected a map, got list"),
    ("top-level int", BaseTokenizerMsg, 5, "expected a map, got int"),
    (
        "missing field",
        BaseBackendMsg,
        {"__type__": "AbortBackendMsg"},
        "AbortBackendMsg: missing required field 'uid'",
    ),
    ("extra field", BaseBackendMsg, {"__type__": "ExitMsg", "now": True}, "ExitMsg: unexpected field"),
    (
        "wrong int",
        BaseBackendMsg,
        {"__type__": "AbortBackendMsg", "uid": "1"},
        r"AbortBackendMsg\.uid: expected int",
    ),
    (
        "bool is not int",
        BaseBackendMsg,
        {"__type__": "AbortBackendMsg", "uid": True},
        r"\.uid: expected int, got bool",
    ),
    (
        "float is not int",
        BaseTokenizerMsg,
        {"__type__": "AbortMsg", "uid": 1.0},
        r"AbortMsg\.uid: expected int",
    ),
    (
        "wrong bool",
        BaseTokenizerMsg,
        {"__type__": "DetokenizeMsg", "uid": 1, "next_token": 2, "finished": 1},
        r"DetokenizeMsg\.finished: expected bool",
    ),
    (
        "extra wrong field type",
        BaseTokenizerMsg,
        {**_DETOK, "extra": {"__type__": "DetokenizeExtra", "logprob": "x"}},
        r"DetokenizeMsg\.extra\.logprob: expected float \| None, got str",
    ),
    (
        "extra unknown field",
        BaseTokenizerMsg,
        {**_DETOK, "extra": {"__type__": "DetokenizeExtra", "logprobs": [1.0]}},
        r"DetokenizeMsg\.extra: unexpected field\(s\) 'logprobs'",
    ),
    (
        "extra not a map",
        BaseTokenizerMsg,
        {**_DETOK, "extra": [1]},
        r"DetokenizeMsg\.extra: expected a map, got list",
    ),
    (
        "extra of another class",
        BaseFrontendMsg,
        {
            "__type__": "UserReply",
            "uid": 1,
            "incremental_output": "",
            "finished": True,
            "extra": {"__type__": "DetokenizeExtra"},
        },
        r"UserReply\.extra: expected __type__ 'UserReplyExtra', got 'DetokenizeExtra'",
    ),
    (
        "extra at top",
        BaseTokenizerMsg,
        {"__type__": "DetokenizeExtra"},
        r"unknown tokenizer message type 'DetokenizeExtra'",
    ),
    (
        "rare field outside extra",
        BaseTokenizerMsg,
        {**_DETOK, "cached_tokens": 3},
        r"DetokenizeMsg: unexpected field\(s\) 'cached_tokens'",
    ),
    (
        "bytes for str",
        BaseFrontendMsg,
        {"__type__": "UserReply", "uid": 1, "incremental_output": b"hi", "finished": False},
        r"UserReply\.incremental_output: expected str",
    ),
    (
        "sp wrong type",
        BaseBackendMsg,
        user_dict(sampling_params={**SP_OK, "top_k": "5"}),
        r"UserMsg\.sampling_params\.top_k: expected int",
    ),
    (
        "sp extra field",
        BaseBackendMsg,
        user_dict(sampling_params={**SP_OK, "beam": 4}),
        r"UserMsg\.sampling_params: unexpected field\(s\) 'beam'",
    ),
    (
        "sp nested list",
        BaseBackendMsg,
        user_dict(sampling_params={**SP_OK, "stop_token_ids": [1, "2"]}),
        r"UserMsg\.sampling_params\.stop_token_ids\[1\]: expected int",
    ),
    (
        "sp no __type__",
        BaseBackendMsg,
        user_dict(sampling_params={k: v for k, v in SP_OK.items() if k != "__type__"}),
        r"UserMsg\.sampling_params: missing '__type__'",
    ),
    (
        "sp as message",
        BaseBackendMsg,
        user_dict(sampling_params={"__type__": "ExitMsg"}),
        r"UserMsg\.sampling_params: expected __type__ 'SamplingParams'|UserMsg\.sampling_params",
    ),
    (
        "seed str",
        BaseBackendMsg,
        user_dict(sampling_params={**SP_OK, "seed": "x"}),
        r"sampling_params\.seed: expected int \| None",
    ),
    (
        "tensor bad dtype",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "dtype": "torch.complex64"}),
        r"UserMsg\.input_ids: unsupported tensor dtype 'torch.complex64'",
    ),
    (
        "tensor dtype not str",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "dtype": 3}),
        r"'dtype' must be a str",
    ),
    (
        "tensor buffer str",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "buffer": "abcd"}),
        r"'buffer' must be bytes",
    ),
    (
        "tensor ragged buffer",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "buffer": b"\x01\x02\x03"}),
        r"buffer of 3 bytes is not a whole number",
    ),
    (
        "tensor shape mismatch",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "shape": [2, 2]}),
        r"holds 4 bytes but shape \[2, 2\]",
    ),
    (
        "tensor negative shape",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "shape": [-1]}),
        r"non-negative ints",
    ),
    (
        "tensor empty, too big for numpy",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "buffer": b"", "shape": [0, 2**63]}),
        r"UserMsg\.input_ids: shape \[0, 9223372036854775808\]",
    ),
    (
        "tensor shape None",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "shape": None}),
        r"'shape' must be a list",
    ),
    (
        "tensor extra key",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "stride": [1]}),
        r"input_ids: bad Tensor map",
    ),
    (
        "tensor wrong tag",
        BaseBackendMsg,
        user_dict(input_ids={**T_OK, "__type__": "Tensr"}),
        r"expected a Tensor",
    ),
    ("tensor as list", BaseBackendMsg, user_dict(input_ids=[1, 2]), r"input_ids: expected a Tensor map"),
    (
        "batch member bad",
        BaseBackendMsg,
        {"__type__": "BatchBackendMsg", "data": [{"__type__": "ExitMsg"}, {"__type__": "AbortBackendMsg"}]},
        r"BatchBackendMsg\.data\[1\]: missing required field 'uid'",
    ),
    (
        "batch member foreign",
        BaseTokenizerMsg,
        {"__type__": "BatchTokenizerMsg", "data": [{"__type__": "UserMsg"}]},
        r"BatchTokenizerMsg\.data\[0\]: unknown tokenizer message type 'UserMsg'",
    ),
    (
        "batch data not list",
        BaseFrontendMsg,
        {"__type__": "BatchFrontendMsg", "data": {}},
        r"data: expected a list",
    ),
    (
        "text wrong",
        BaseTokenizerMsg,
        {"__type__": "TokenizeMsg", "uid": 1, "text": [1, "a"], "sampling_params": SP_OK},
        r"TokenizeMsg\.text: expected str \| ",
    ),
    (
        "chat wrong",
        BaseTokenizerMsg,
        {"__type__": "TokenizeMsg", "uid": 1, "text": [{"role": 1}], "sampling_params": SP_OK},
        r"TokenizeMsg\.text: expected",
    ),
]


@pytest.mark.parametrize("name,base,data,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_named_error(name: str, base: Any, data: Any, match: str) -> None:
    with pytest.raises(MessageDecodeError, match=match):
        base.decoder(data)
    with pytest.raises(MessageDecodeError, match=match):
        base.from_bytes(msgpack.packb(data, use_bin_type=True))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x81",
        b"\x82\xa8__type__",
        b"\xc1",
        b"\xff\xff\xff",
        b"not msgpack at all",
        msgpack.packb({"__type__": "ExitMsg"}) + b"\x00",
        b"\x81\xa8__type__\xa4\xff\xfe\xfd\xfc",
    ],
    ids=["empty", "truncated-map", "truncated-key", "reserved-byte", "ints", "text", "trailing", "bad-utf8"],
)
def test_bad_bytes_raise_named_error(raw: bytes) -> None:
    with pytest.raises(MessageDecodeError):
        BaseBackendMsg.from_bytes(raw)


def test_truncations_of_a_real_message_all_raise() -> None:
    raw = BatchBackendMsg([user(1, [1, 2, 3]), AbortBackendMsg(2)]).to_bytes()
    for n in range(len(raw)):
        with pytest.raises(MessageDecodeError):
            BaseBackendMsg.from_bytes(raw[:n])


def test_not_bytes_raises_decode_error() -> None:
    with pytest.raises(MessageDecodeError):
        BaseBackendMsg.from_bytes(12345)  # type: ignore[arg-type]


def test_error_is_a_value_error() -> None:
    assert issubclass(MessageDecodeError, ValueError)


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    raw = b"\x82\xa8__type__\xafBatchBackendMsg\xa4data\x91" * 3000 + b"\x81\xa8__type__\xa7ExitMsg"
    with pytest.raises(MessageDecodeError):
        BaseBackendMsg.from_bytes(raw)


def test_unsendable_values_raise_type_error() -> None:
    with pytest.raises(TypeError, match="complex"):
        UserMsg(1, torch.zeros(2, dtype=torch.complex64), sp()).to_bytes()
    with pytest.raises(TypeError):
        BatchBackendMsg([DetokenizeMsg(1, 2, False)]).to_bytes()  # a tokenizer message in a backend batch


# -- property tests ------------------------------------------------------------------------------------

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_only_ever_raise_decode_error(raw: bytes) -> None:
    for base in BASES:
        try:
            base.from_bytes(raw)
        except MessageDecodeError:
            pass


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_names = st.sampled_from(
    [
        "UserMsg",
        "ExitMsg",
        "AbortBackendMsg",
        "BatchBackendMsg",
        "Tensor",
        "SamplingParams",
        "DetokenizeMsg",
        "uid",
        "data",
    ]
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["__type__", "uid", "data", "input_ids", "sampling_params", "x"]),
        st.one_of(_values, _names),
        max_size=5,
    )
)
def test_random_maps_only_ever_raise_decode_error(data: dict) -> None:
    raw = msgpack.packb(data, use_bin_type=True)
    for base in BASES:
        try:
            msg = base.from_bytes(raw)
        except MessageDecodeError:
            continue
        assert isinstance(msg, base)


_detok = st.builds(
    DetokenizeMsg,
    st.integers(0, 2**63 - 1),
    st.integers(-(2**31), 2**31),
    st.booleans(),
    st.sampled_from(["", "stop", "length", "abort"]),
)
_tok = st.builds(
    TokenizeMsg,
    st.integers(0, 2**40),
    st.one_of(
        st.text(max_size=20),
        st.lists(st.integers(0, 2**31), max_size=5),
        st.lists(st.dictionaries(st.sampled_from(["role", "content"]), st.text(max_size=5)), max_size=2),
    ),
    st.builds(
        SamplingParams,
        st.floats(0, 2, allow_nan=False),
        st.integers(-1, 100),
        st.floats(0.01, 1),
        st.booleans(),
        st.integers(1, 10**6),
        st.lists(st.integers(0, 2**20), max_size=3),
        st.one_of(st.none(), st.integers(0, 2**32)),
    ),
)
_tok_msgs = st.one_of(
    _detok,
    _tok,
    st.builds(AbortMsg, st.integers(0, 2**50)),
    st.builds(ErrorMsg, st.integers(0, 9), st.text(max_size=30)),
)


@FUZZ
@given(st.lists(_tok_msgs, max_size=6))
def test_random_messages_round_trip_byte_exact(msgs: list) -> None:
    batch = BatchTokenizerMsg(msgs)
    raw = batch.to_bytes()
    assert raw == msgpack.packb(batch.encoder(), use_bin_type=True)
    assert raw == chapter_bytes(batch)
    assert BaseTokenizerMsg.from_bytes(raw) == batch
    for m in msgs:
        assert BaseTokenizerMsg.from_bytes(m.to_bytes()) == m


_field_values = st.one_of(
    _values,
    _names,
    st.just(T_OK),
    st.just({**T_OK, "shape": [1]}),
    st.just(SP_OK),
    st.just({**SP_OK, "temperature": 1}),
    st.just({"__type__": "ExitMsg"}),
    st.just({"__type__": "AbortBackendMsg", "uid": 3}),
    st.lists(st.just({"__type__": "ExitMsg"}), max_size=2),
)


_VALID = {
    "UserMsg": user_dict(),
    "ExitMsg": {"__type__": "ExitMsg"},
    "AbortBackendMsg": {"__type__": "AbortBackendMsg", "uid": 3},
    "BatchBackendMsg": {"__type__": "BatchBackendMsg", "data": [user_dict(), {"__type__": "ExitMsg"}]},
}


@FUZZ
@given(
    st.sampled_from(sorted(_VALID)),
    st.dictionaries(
        st.sampled_from(["uid", "data", "input_ids", "sampling_params", "x", "__type__"]),
        _field_values,
        max_size=2,
    ),
    st.lists(st.sampled_from(["uid", "data", "input_ids", "sampling_params", "__type__"]), max_size=1),
)
def test_msgspec_and_the_error_walk_agree(name: str, over: dict, drop: list) -> None:
    """msgspec decides; the walk that writes the error text must find a fault exactly when msgspec
    rejects (otherwise the error would not name the field, or a valid message would be refused).

    Valid messages with up to two fields replaced by random values and maybe one removed."""
    data = {**_VALID[name], **over}
    for key in drop:
        data.pop(key, None)
    raw = msgpack.packb(data, use_bin_type=True)
    fault = BaseBackendMsg._group.explain(raw)
    try:
        msg = BaseBackendMsg.from_bytes(raw)
    except MessageDecodeError as e:
        assert fault is not None and str(e) == fault, (str(e), fault)
        return
    assert fault is None, fault
    assert isinstance(msg, BaseBackendMsg)
    assert same(BaseBackendMsg.from_bytes(msg.to_bytes()), msg)


def test_a_bug_in_the_decoder_raises_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fallback path: an error inside the codec is not turned into a slower retry or a None."""
    raw = user(3, [1, 2]).to_bytes()

    def broken(*values: Any) -> Any:
        raise KeyError("bug")

    monkeypatch.setattr(codec, "decode_tensor", broken)
    with pytest.raises(KeyError, match="bug"):
        BaseBackendMsg.from_bytes(raw)
    monkeypatch.undo()
    assert same(BaseBackendMsg.from_bytes(raw), user(3, [1, 2]))


@dataclass
class BaseClashMsg(codec.Message, group="clash"):
    pass


@dataclass
class ClashRecord:
    n: int


@dataclass
class ClashHolder(BaseClashMsg):
    inner: ClashRecord


ClashRecord.__name__ = "ClashHolder"  # a record with the name of one of its group's messages


def test_a_record_named_like_a_message_is_refused() -> None:
    """A dataclass in a field is tagged with its class name, so it must not be one of the group's."""
    with pytest.raises(TypeError, match="record 'ClashHolder' has the name of a clash message"):
        ClashHolder(ClashRecord(1)).to_bytes()


@pytest.mark.parametrize(
    "code,dtype", [("i", torch.int32), ("q", torch.int64), ("B", torch.uint8), ("f", torch.float32)]
)
def test_a_stdlib_array_travels_as_a_1d_tensor(code: str, dtype: torch.dtype) -> None:
    """The tokenizer workers send token ids as array("i") (neither torch nor numpy loaded there): it
    travels as the 1-D tensor of its type code's dtype, the same bytes a tensor of those values gives."""
    import array

    values = [3, 0, 255, 7]
    msg = UserMsg(uid=1, input_ids=array.array(code, values), sampling_params=sp())
    assert msg.to_bytes() == UserMsg(1, torch.tensor(values, dtype=dtype), sp()).to_bytes()
    back = BaseBackendMsg.from_bytes(msg.to_bytes()).input_ids
    assert back.dtype == dtype and back.tolist() == values
    with pytest.raises(TypeError, match="type code"):
        UserMsg(uid=1, input_ids=array.array("H", [1, 2]), sampling_params=sp()).to_bytes()
