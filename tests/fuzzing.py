"""Hypothesis strategies for the reliability fuzz tests (issue 9): HTTP bodies for the API and raw
frames for every internal socket. Not a test module; imported by the fuzz tests (tests/entrypoints/test_fuzz_http.py, tests/system/test_fuzz_*.py).

HTTP bodies mix valid requests with fields replaced by junk (wrong types, NaN, huge numbers, lone
surrogates, nested containers), arbitrary JSON, and bytes that are not JSON at all. Frames mix
random bytes, msgpack of arbitrary shapes, unknown message types, valid messages with one field
broken, and valid messages with values no client would send (uids at msgpack's limits, token ids
outside the vocabulary, NaN sampling parameters, empty or float tensors).
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
from hypothesis import strategies as st

# ---- values -------------------------------------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "x\udfff", "\udc00a\ud83d", "ok\ud834\udd1e\ud800"])
TEXT = st.one_of(st.text(max_size=30), SURROGATES, st.sampled_from(["", " ", "\x00", "🎉" * 3, "é"]))
INT = st.one_of(
    st.integers(-3, 70),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
BIG_INT = st.one_of(INT, st.sampled_from([10**30, -(10**30), 2**64, 2**100]))
FLOAT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-40, 1e-320, 5e-324, 1e-5, 1e308, 1.0, 2.0]),
)
JSON_LEAF = st.one_of(st.none(), st.booleans(), BIG_INT, FLOAT, TEXT)
JSON_ANY = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(TEXT, inner, max_size=5)),
    max_leaves=15,
)
MSGPACK_LEAF = st.one_of(st.none(), st.booleans(), INT, FLOAT, TEXT, st.binary(max_size=24))
MSGPACK_ANY = st.recursive(
    MSGPACK_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(TEXT, st.integers(0, 5), st.binary(max_size=4)), inner, max_size=5),
    ),
    max_leaves=15,
)

# ---- HTTP bodies ----------------------------------------------------------------------------------

CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
COMPLETION = {"model": "smol", "prompt": "once upon", "max_tokens": 4}
GENERATE = {"prompt": "hello", "max_tokens": 4}
RESPONSES = {"model": "smol", "input": "hi there", "max_output_tokens": 4}
EMBEDDINGS = {"model": "smol", "input": ["hi there", "and more"]}
_ITEM = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]),
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]),
        "content": st.one_of(TEXT, JSON_ANY),
        "call_id": TEXT,
        "name": TEXT,
        "arguments": TEXT,
        "output": st.one_of(TEXT, JSON_ANY),
    }
)
_ROLES = st.sampled_from(["user", "system", "assistant", "developer", "tool", "wizard", ""])
_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT})
_SMALL = st.integers(-2, 6)
PLAUSIBLE = {  # per field: values of about the right type, often valid
    "model": st.one_of(st.just("smol"), TEXT),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": _ROLES, "content": st.one_of(TEXT, st.none(), st.lists(_PART, max_size=2))}
        ),
        max_size=3,
    ),
    "prompt": st.one_of(
        TEXT,
        st.lists(TEXT, max_size=3),
        st.lists(st.integers(-1, 60_000), max_size=5),
        st.lists(st.lists(st.integers(0, 60_000), max_size=3), max_size=3),
    ),
    "max_tokens": st.one_of(st.none(), st.integers(-1, 20)),
    "max_completion_tokens": st.one_of(st.none(), st.integers(-1, 20)),
    "temperature": st.one_of(st.floats(0, 2), FLOAT),
    "top_p": st.one_of(st.floats(0, 1), FLOAT),
    "top_k": st.integers(-2, 100),
    "n": _SMALL,
    "stop": st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": st.lists(st.integers(-1, 60_000), max_size=3),
    "seed": st.one_of(st.none(), INT),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "presence_penalty": st.one_of(st.just(0), FLOAT),
    "frequency_penalty": st.one_of(st.just(0.0), FLOAT),
    "logprobs": st.one_of(st.none(), st.booleans(), _SMALL),
    "logit_bias": st.one_of(st.none(), st.just({}), st.dictionaries(TEXT, FLOAT, max_size=2)),
    "tools": st.one_of(st.none(), st.just([]), JSON_ANY),
    "tool_choice": st.sampled_from([None, "none", "auto", "required"]),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
    "echo": st.booleans(),
    "user": TEXT,
    "input": st.one_of(TEXT, st.lists(_ITEM, max_size=3), JSON_ANY),
    "instructions": st.one_of(st.none(), TEXT),
    "max_output_tokens": st.one_of(st.none(), st.integers(-1, 20)),
    "text": st.one_of(
        st.none(),
        st.fixed_dictionaries({"format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {}])}),
        JSON_ANY,
    ),
    "include": st.one_of(
        st.none(), st.lists(st.sampled_from(["message.output_text.logprobs", "x"]), max_size=2)
    ),
    "top_logprobs": st.one_of(st.none(), _SMALL),
    "encoding_format": st.sampled_from([None, "float", "base64", "int8"]),
    "dimensions": st.one_of(st.none(), _SMALL, INT),
}
FIELDS = sorted(PLAUSIBLE)
JUNK = st.one_of(
    JSON_ANY,
    st.lists(BIG_INT, max_size=6),
    st.lists(st.fixed_dictionaries({"role": TEXT, "content": JSON_ANY}), max_size=3),
    st.sampled_from([{"include_usage": True}, [{"type": "text", "text": "a"}], [True, False], "stop"]),
)


_BASES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSES,
    "/v1/embeddings": EMBEDDINGS,
    "/generate": GENERATE,
}


@st.composite
def request_body(draw: st.DrawFn, path: str = "/v1/completions") -> dict:
    """A valid body for `path` (now and then another endpoint's) with a few fields changed: to
    plausible values (often still valid), to junk of any type, or removed."""
    base = dict(
        _BASES.get(path, CHAT) if draw(st.integers(0, 9)) else draw(st.sampled_from(list(_BASES.values())))
    )
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(FIELDS))
        how = draw(st.integers(0, 9))
        if how == 0:
            base.pop(name, None)
        elif how <= 2:
            base[name] = draw(JUNK)
        else:
            base[name] = draw(PLAUSIBLE[name])
    return base


@st.composite
def http_request(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(method, path, body bytes)."""
    path = draw(st.sampled_from([*_BASES] * 6 + ["/v1/models", "/x"]))
    method = "POST" if draw(st.integers(0, 19)) else draw(st.sampled_from(["GET", "PUT", "DELETE"]))
    kind = draw(st.sampled_from(["body"] * 8 + ["json", "bytes", "truncated", "cesu"]))
    if kind == "bytes":
        return method, path, draw(st.binary(max_size=64))
    obj = draw(request_body(path)) if kind != "json" else draw(JSON_ANY)
    text = json.dumps(obj, allow_nan=True, ensure_ascii=kind != "cesu")
    raw = text.encode("utf-8", "surrogatepass")  # "cesu": surrogates as (invalid) UTF-8 bytes
    if kind == "truncated":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    return method, path, raw


def is_openai_error(status: int, body: bytes) -> bool:
    """A 4xx whose body is {"error": {"message", "type", "param", "code"}} with a message."""
    if not 400 <= status < 500:
        return False
    err = json.loads(body).get("error")
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])


_RESPONSES_END = (
    b"event: response.completed\n",
    b"event: response.incomplete\n",
    b"event: response.failed\n",
    b"event: error\n",
)


def check_http_response(status: int, headers: Any, body: bytes) -> None:
    """Every response to anything is a 2xx or an OpenAI-shaped 4xx; a stream ends with [DONE] (the
    Responses API's with its last event)."""
    assert status < 500, (status, body[:500])
    if status >= 400:
        assert is_openai_error(status, body), (status, body[:500])
    elif headers.get("content-type", "").startswith("text/event-stream"):
        last = body[body.rstrip(b"\n").rfind(b"\n\n") + 2 :]
        assert body.endswith(b"data: [DONE]\n\n") or last.startswith(_RESPONSES_END), body[-300:]
    else:
        json.loads(body)


# ---- socket frames --------------------------------------------------------------------------------

_SP_FIELDS = {
    "temperature": FLOAT,
    "top_k": INT,
    "top_p": FLOAT,
    "ignore_eos": st.booleans(),
    "max_tokens": st.one_of(st.integers(-2, 40), INT),
    "stop_token_ids": st.lists(INT, max_size=3),
    "seed": st.one_of(st.none(), INT),
}
SAMPLING = st.fixed_dictionaries({"__type__": st.just("SamplingParams"), **_SP_FIELDS})
_DTYPES = [
    "torch.int32",
    "torch.int64",
    "torch.int16",
    "torch.uint8",
    "torch.bool",
    "torch.float32",
    "torch.bfloat16",
]


@st.composite
def tensor_map(draw: st.DrawFn) -> dict:
    """A Tensor map: usually well formed (token ids, maybe outside the vocabulary), sometimes not."""
    dtype = draw(st.sampled_from([*_DTYPES, "torch.int32", "torch.int32", "torch.complex64", "int", ""]))
    width = {"torch.int64": 8, "torch.int16": 2, "torch.uint8": 1, "torch.bool": 1, "torch.bfloat16": 2}.get(
        dtype, 4
    )
    n = draw(st.integers(0, 12))
    if dtype == "torch.int32" and draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, 60_000), min_size=n, max_size=n))
        buf = b"".join(i.to_bytes(4, "little") for i in ids)
    else:
        buf = draw(st.binary(min_size=n * width, max_size=n * width + draw(st.integers(0, 1))))
    out: dict[str, Any] = {"__type__": "Tensor", "buffer": buf, "dtype": dtype}
    if draw(st.integers(0, 4)) == 0:
        out["shape"] = draw(st.lists(st.integers(-1, 12), max_size=3))
    return out


def _msg(name: str, **fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"__type__": st.just(name), **fields})


CHAT_MSGS = st.lists(st.fixed_dictionaries({"role": TEXT, "content": TEXT}), max_size=3)
OUTSIDE_API_UIDS = st.integers(2**40, 2**64 - 1)  # uids an API server in a test never hands out


def group_messages(group: str, uids: st.SearchStrategy[int] = INT) -> st.SearchStrategy[dict]:
    """Well-typed message maps of `group` (what its receiver decodes), with odd values."""
    if group == "tokenizer":
        return st.one_of(
            _msg("TokenizeMsg", uid=uids, text=st.one_of(TEXT, CHAT_MSGS, st.lists(INT, max_size=5)), sampling_params=SAMPLING, n=st.one_of(st.integers(-1, 70), INT)),
            _msg("DetokenizeMsg", uid=uids, next_token=st.one_of(st.integers(-2, 60_000), INT), finished=st.booleans(), finish_reason=TEXT),
            _msg("AbortMsg", uid=uids),
            _msg("ErrorMsg", uid=uids, message=TEXT),
        )  # fmt: skip
    if group == "backend":  # ExitMsg is the scheduler's legitimate stop command: never sent
        return st.one_of(
            _msg("UserMsg", uid=uids, input_ids=tensor_map(), sampling_params=SAMPLING),
            _msg("AbortBackendMsg", uid=uids),
        )
    return _msg(
        "UserReply",
        uid=uids,
        incremental_output=TEXT,
        finished=st.booleans(),
        finish_reason=TEXT,
        prompt_tokens=INT,
        completion_tokens=INT,
        error=TEXT,
    )


BATCH = {"tokenizer": "BatchTokenizerMsg", "backend": "BatchBackendMsg", "frontend": "BatchFrontendMsg"}
NAMES = {
    "tokenizer": ["TokenizeMsg", "DetokenizeMsg", "AbortMsg", "ErrorMsg"],
    "backend": ["UserMsg", "AbortBackendMsg"],
    "frontend": ["UserReply"],
}


@st.composite
def mutated(draw: st.DrawFn, msgs: st.SearchStrategy[dict], names: list[str]) -> Any:
    """A message map with one thing wrong: a field of the wrong type, missing or extra, or its type."""
    d = dict(draw(msgs))
    field = draw(st.sampled_from(sorted(d)))
    how = draw(st.sampled_from(["value", "value", "drop", "extra", "type"]))
    if how == "value":
        d[field] = draw(MSGPACK_ANY)
    elif how == "drop":
        del d[field]
    elif how == "extra":
        d[draw(TEXT)] = draw(MSGPACK_ANY)
    else:
        d["__type__"] = draw(
            st.one_of(st.sampled_from([*names, "SamplingParams", "Tensor", "Batch"]), MSGPACK_ANY)
        )
    return d


@st.composite
def frame(draw: st.DrawFn, group: str, uids: st.SearchStrategy[int] = INT) -> bytes:
    """One frame for a socket whose receiver decodes `group` messages; well-typed messages take
    their uids from `uids`."""
    msgs, batch, names = group_messages(group, uids), BATCH[group], NAMES[group]
    kind = draw(
        st.sampled_from(["bytes", "msgpack", "unknown", "mutated", "mutated", "valid", "valid", "batch"])
    )
    if kind == "bytes":
        return draw(st.binary(max_size=80))
    if kind == "msgpack":
        obj = draw(MSGPACK_ANY)
    elif kind == "unknown":
        obj = {"__type__": draw(st.one_of(TEXT, MSGPACK_ANY)), "uid": draw(INT)}
    elif kind == "mutated":
        obj = draw(mutated(msgs, names))
    elif kind == "valid":
        obj = draw(msgs)
    else:
        obj = {"__type__": batch, "data": draw(st.lists(st.one_of(msgs, mutated(msgs, names)), max_size=5))}
    return msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")


def byte_mutants(raw: bytes, rnd: Any, count: int) -> list[bytes]:
    """`count` cheap byte-level variants of a frame (a flipped, inserted or dropped byte, a cut, a
    repeated slice): they reach the msgpack parser's corners that whole values do not."""
    out = []
    for _ in range(count):
        b = bytearray(raw)
        how = rnd.randrange(5)
        i = rnd.randrange(len(b) + 1)
        if how == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rnd.randrange(8)
        elif how == 1:
            b.insert(i, rnd.randrange(256))
        elif how == 2 and b:
            del b[min(i, len(b) - 1)]
        elif how == 3:
            del b[i:]
        else:
            b[i:i] = b[rnd.randrange(i + 1) : i]
        out.append(bytes(b))
    return out
