"""Messages of every class, with values at msgpack's format boundaries, for the golden-bytes test.

tests/message/data/codec_golden.json holds the bytes that the codec before issue 13 (two code generators,
main at commit 8779c94) wrote for each of them; `test_codec.py` checks that today's codec writes the
same. It was made by running this file against that commit's package:

    python tests/message/codec_corpus.py > tests/message/data/codec_golden.json

Since then SamplingParams gained `grammar` and TokenizeMsg `tools` (structured output and tools):
the 107 entries that carry them were rewritten by the same command on today's package, where
`golden()` first checks each message's bytes against msgpack of its reference `encoder()` dict.
Issue 24 took the per-token messages' rare fields off a plain token's bytes (DetokenizeMsg and
UserReply leave out what holds its default, the rare fields grouped in an optional `extra`): the 80
entries that carry one of the two were rewritten the same way, and two entries were added. Issue 25
gave SamplingParams `embed` (an embedding request), the reasoning token ids and return_token_ids,
and TokenizeMsg the request's chat template and template variables: the 107 entries that carry
SamplingParams were rewritten the same way, and no other entry changed (the per-token messages'
new rare fields, `embedding` among them, stay off their bytes at their defaults).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import msgpack
import torch

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeExtra,
    DetokenizeMsg,
    ErrorMsg,
    ExitMsg,
    LoadMsg,
    LoadReply,
    TokenizeMsg,
    UserMsg,
    UserReply,
    UserReplyExtra,
)

# where msgpack switches between formats: fixint/uint8/16/32/64, negative fixint/int8/16/32/64
INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]
INTS += [-1, -32, -33, -128, -129, -(2**15), -(2**15) - 1, -(2**31), -(2**31) - 1, -(2**63)]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1e-300, 1e300, math.inf, -math.inf, math.nan]
# fixstr (< 32 bytes), str8, str16, str32; multi-byte UTF-8 counts bytes, not characters
STRINGS = ["", "a" * 31, "b" * 32, "c" * 255, "d" * 256, "é" * 40_000, "你好", "\U0001f600" * 9]
LENGTHS = [0, 15, 16, 300]  # fixarray, array16


def _tensors() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool):
        out[str(dtype)] = (
            (torch.arange(-5, 6) % 2 == 0) if dtype is torch.bool else torch.arange(-5, 6).to(dtype)
        )
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        out[str(dtype)] = torch.linspace(-3, 3, 7).to(dtype)
    out["0-d"] = torch.tensor(7, dtype=torch.int32)
    out["empty"] = torch.zeros(0, dtype=torch.int32)
    out["2-D"] = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    out["3-D empty"] = torch.zeros(2, 0, 3, dtype=torch.float32)
    out["transposed"] = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()
    out["bin16"] = torch.arange(100, dtype=torch.int32)  # 400 bytes
    out["bin32"] = torch.arange(20_000, dtype=torch.int32)  # 80,000 bytes
    return out


def _params() -> dict[str, SamplingParams]:
    out = {"default": SamplingParams(), "chapter": SamplingParams(temperature=0.6, max_tokens=64)}
    for i, v in enumerate(FLOATS):
        out[f"temperature {i}"] = SamplingParams(temperature=v, top_p=v)
    for v in INTS:
        out[f"ints {v}"] = SamplingParams(top_k=v, max_tokens=v, seed=v, ignore_eos=v % 2 == 1)
    for n in LENGTHS:
        out[f"stop ids {n}"] = SamplingParams(stop_token_ids=list(range(n)))
    out["penalties"] = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        repetition_penalty=1.2,
        logit_bias={0: -100.0, 7: 0.0, 2**31: 5.5},
        min_tokens=3,
        logprobs=5,
        prompt_logprobs=0,
    )
    return out


def corpus() -> dict[str, Any]:
    """name -> message; the names are stable (they key the golden file)."""
    msgs: dict[str, Any] = {}
    params = _params()
    for name, sp in params.items():
        msgs[f"TokenizeMsg sp {name}"] = TokenizeMsg(1, "hi", sp)
        msgs[f"UserMsg sp {name}"] = UserMsg(2, torch.tensor([1, 2], dtype=torch.int32), sp)
    for name, t in _tensors().items():
        msgs[f"UserMsg tensor {name}"] = UserMsg(3, t, params["chapter"])
    for i, s in enumerate(STRINGS):
        msgs[f"TokenizeMsg text {i}"] = TokenizeMsg(4, s, params["default"], n=3)
        msgs[f"UserReply text {i}"] = UserReply(5, s, i % 2 == 0, "stop", 1, 2, s, UserReplyExtra(3))
        msgs[f"ErrorMsg {i}"] = ErrorMsg(6, s)
        msgs[f"DetokenizeMsg reason {i}"] = DetokenizeMsg(7, 8, True, s, DetokenizeExtra(9))
    msgs["TokenizeMsg chat"] = TokenizeMsg(
        8, [{"role": "user", "content": "你好"}, {"role": "system", "content": ""}], params["default"]
    )
    msgs["TokenizeMsg ids"] = TokenizeMsg(9, [0, 1, 2**31, 2**63 - 1], params["default"])
    msgs["TokenizeMsg empty ids"] = TokenizeMsg(10, [], params["default"])
    for v in INTS:
        msgs[f"ints {v}"] = BatchTokenizerMsg(
            [DetokenizeMsg(v, v, False, "", DetokenizeExtra(v)), AbortMsg(v)]
        )
        msgs[f"AbortBackendMsg {v}"] = AbortBackendMsg(v)
        msgs[f"UserReply ints {v}"] = UserReply(v, "", False, "", v, v, "", UserReplyExtra(v))
    msgs["ExitMsg"] = ExitMsg()
    for n in LENGTHS:
        msgs[f"BatchTokenizerMsg {n}"] = BatchTokenizerMsg(
            [DetokenizeMsg(i, 1000 + 37 * i, i % 9 == 0, "stop" if i % 9 == 0 else "") for i in range(n)]
        )
        msgs[f"BatchFrontendMsg {n}"] = BatchFrontendMsg(
            [UserReply(i, "x" * i, i % 2 == 0) for i in range(n)]
        )
        msgs[f"BatchBackendMsg {n}"] = BatchBackendMsg([AbortBackendMsg(i) for i in range(n)])
    msgs["BatchBackendMsg mixed"] = BatchBackendMsg(
        [
            UserMsg(1, torch.tensor([5, 6], dtype=torch.int32), params["chapter"]),
            AbortBackendMsg(1),
            ExitMsg(),
        ]
    )
    msgs["BatchBackendMsg nested"] = BatchBackendMsg(
        [BatchBackendMsg([ExitMsg(), BatchBackendMsg([])]), AbortBackendMsg(2)]
    )
    msgs["BatchTokenizerMsg mixed"] = BatchTokenizerMsg(
        [TokenizeMsg(1, "a", params["default"]), DetokenizeMsg(1, 2, False), AbortMsg(1), ErrorMsg(1, "e")]
    )
    msgs["BatchFrontendMsg nested"] = BatchFrontendMsg([BatchFrontendMsg([UserReply(1, "a", True)])])
    msgs.update(_since_logprobs())
    return msgs


def _since_logprobs() -> dict[str, Any]:
    """The fields and classes added with logprobs, penalties and data parallelism (main 8779c94)."""
    msgs: dict[str, Any] = {}
    for i, v in enumerate(FLOATS):
        extra = DetokenizeExtra(logprob=v, top_logprobs=[v, -v])
        msgs[f"DetokenizeMsg logprob {i}"] = DetokenizeMsg(1, 2, False, extra=extra)
    msgs["DetokenizeMsg prompt logprobs"] = DetokenizeMsg(
        1,
        2,
        True,
        "stop",
        DetokenizeExtra(
            3,
            13,
            -0.25,
            [4, 5],
            [-0.5, -2.5],
            [6, 7, 8],
            [-1.0, -2.0],
            [[9], [10, 11]],
            [[-0.75], [-1.5, -3.0]],
        ),
    )
    msgs["UserReply logprobs"] = UserReply(
        1,
        "ab",
        False,
        "",
        1,
        2,
        "",
        UserReplyExtra(
            0,
            13,
            "prompt",
            [b"a", b"\xff"],
            [-0.5],
            [[b"a", b"b"]],
            [[-0.5, -1.0]],
            [b"x", b""],
            [-2.0],
            [[b""]],
            [[0.0]],
        ),
    )
    # Per-token messages leave out what holds its default (issue 24), an extra of defaults included.
    msgs["DetokenizeMsg extra of defaults"] = DetokenizeMsg(1, 2, False, extra=DetokenizeExtra())
    msgs["UserReply extra of defaults"] = UserReply(1, "a", False, extra=UserReplyExtra())
    msgs["TokenizeMsg flags"] = TokenizeMsg(1, "hi", SamplingParams(), 2, 3, False, True, True)
    for v in INTS:
        msgs[f"LoadMsg {v}"] = LoadMsg(v, v, v)
        msgs[f"LoadReply {v}"] = LoadReply(v, v, v)
        msgs[f"AbortMsg replica {v}"] = AbortMsg(1, v)
    msgs["BatchFrontendMsg load"] = BatchFrontendMsg([LoadReply(0, 1, 2), UserReply(1, "a", True)])
    return msgs


def fingerprint(raw: bytes) -> str:
    """The bytes in hex, or their length and SHA-256 when they are long (the golden file stays small)."""
    if len(raw) <= 2048:
        return raw.hex()
    return f"{len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}"


def golden() -> dict[str, str]:
    """name -> fingerprint of the message's bytes (checked equal to `msgpack.packb(msg.encoder())` first)."""
    out = {}
    for name, msg in corpus().items():
        raw = msg.to_bytes()
        assert raw == msgpack.packb(msg.encoder(), use_bin_type=True), name
        out[name] = fingerprint(raw)
    return out


if __name__ == "__main__":
    print(json.dumps(golden(), indent=1, sort_keys=True))
