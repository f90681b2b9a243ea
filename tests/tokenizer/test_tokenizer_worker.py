"""The tokenizer/detokenizer worker over real ZMQ pipes (in this process, no spawn): acknowledgements
with prompt token counts, rejections, aborts, detokenized replies, malformed messages."""

from __future__ import annotations

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BaseBackendMsg,
    BaseFrontendMsg,
    BaseTokenizerMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    ErrorMsg,
    TokenizeMsg,
    UserMsg,
)
from minisgl.tokenizer.server import TokenizerWorker, TokenizerWorkerConfig
from minisgl.tokenizer.tokenize import FILL_CONTEXT, ModelLimits
from minisgl.utils import ZmqPullQueue, ZmqPushQueue

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer():
    from minisgl.models import resolve_model_path
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(resolve_model_path(None))


@pytest.fixture
def pipes(ipc_dir, tokenizer):
    """The worker (role "both") with the API server's and the scheduler's ends of its pipes."""
    addr = {k: f"ipc://{ipc_dir}/{k}" for k in ("tok", "detok", "backend", "frontend")}
    api_out = ZmqPushQueue(addr["tok"], create=True, encoder=BaseTokenizerMsg.encoder)
    sched_out = ZmqPushQueue(addr["detok"], create=True, encoder=BaseTokenizerMsg.encoder)
    sched_in = ZmqPullQueue(addr["backend"], create=True, decoder=BaseBackendMsg.decoder)
    api_in = ZmqPullQueue(addr["frontend"], create=True, decoder=BaseFrontendMsg.decoder)
    cfg = TokenizerWorkerConfig(
        model_path="unused",
        role="both",
        tokenizer_addr=addr["tok"],
        detokenizer_addr=addr["detok"],
        backend_addr=addr["backend"],
        frontend_addr=addr["frontend"],
    )
    worker = TokenizerWorker(cfg, tokenizer, ModelLimits(max_seq_len=64, vocab_size=len(tokenizer)))
    yield worker, api_out, sched_out, sched_in, api_in
    worker.close()
    for q in (api_out, sched_out, sched_in, api_in):
        q.stop()


def replies(q: ZmqPullQueue) -> list:
    assert q.poll(5.0)
    msg = q.get()
    return msg.data if isinstance(msg, BatchFrontendMsg) else [msg]


def step(worker: TokenizerWorker) -> None:
    worker.handle(worker.receive())


def test_tokenize_ack_then_detokenize(pipes, tokenizer) -> None:
    worker, api_out, sched_out, sched_in, api_in = pipes
    chat = [{"role": "user", "content": "Hi"}]
    api_out.put(TokenizeMsg(uid=7, text=chat, sampling_params=SamplingParams(max_tokens=FILL_CONTEXT)))
    step(worker)
    [ack] = replies(api_in)
    user_msg = sched_in.get()
    assert isinstance(user_msg, UserMsg) and user_msg.uid == 7 and user_msg.input_ids.dtype == torch.int32
    assert ack.uid == 7 and not ack.finished and ack.prompt_tokens == len(user_msg.input_ids) > 3
    assert user_msg.sampling_params.max_tokens == 64 - ack.prompt_tokens  # the rest of the context
    ids = tokenizer.encode("你好 🎉", add_special_tokens=False) + [tokenizer.eos_token_id]
    msgs = [DetokenizeMsg(7, t, False) for t in ids[:-1]] + [DetokenizeMsg(7, ids[-1], True, "stop")]
    sched_out.put(BatchTokenizerMsg(data=msgs))
    step(worker)
    got = replies(api_in)
    assert "".join(r.incremental_output for r in got) == "你好 🎉"
    assert got[-1].finished and got[-1].finish_reason == "stop" and got[-1].completion_tokens == len(ids)


@pytest.mark.parametrize(
    ("text", "params", "reason"),
    [
        ("", SamplingParams(), "empty"),
        ([5, 10**9], SamplingParams(max_tokens=4), "out of vocabulary"),
        ("hello " * 80, SamplingParams(max_tokens=4), "maximum context length"),
        ("hello", SamplingParams(max_tokens=64), "maximum context length"),
        ("hello " * 70, SamplingParams(max_tokens=FILL_CONTEXT), "maximum context length"),
        ("hello", SamplingParams(top_p=0.0, max_tokens=4), "top_p"),
        ([{"role": "user"}], SamplingParams(max_tokens=4), "chat template"),
    ],
)
def test_rejections_reach_only_the_api_server(pipes, text, params, reason: str) -> None:
    worker, api_out, _, sched_in, api_in = pipes
    api_out.put(TokenizeMsg(uid=1, text=text, sampling_params=params))
    step(worker)
    [rej] = replies(api_in)
    assert rej.finished and rej.finish_reason == "error" and reason in rej.error
    assert not sched_in.poll(0.2)  # the scheduler never sees it


def test_abort_and_scheduler_error_and_garbage(pipes) -> None:
    worker, api_out, sched_out, sched_in, api_in = pipes
    api_out.put_raw(b"\x93not a message")
    api_out.put(AbortMsg(uid=3))
    step(worker)  # the garbage is logged and dropped; the abort goes through
    assert sched_in.get() == AbortBackendMsg(uid=3)
    sched_out.put(ErrorMsg(uid=4, message="no room"))
    sched_out.put(DetokenizeMsg(uid=5, next_token=-1, finished=True, finish_reason="abort"))
    got = []
    while len(got) < 2:
        step(worker)
        got += replies(api_in)
    assert (got[0].uid, got[0].finish_reason, got[0].error) == (4, "error", "no room")
    assert (got[1].uid, got[1].finish_reason, got[1].incremental_output) == (5, "abort", "")


def test_n_choices_get_one_ack_and_one_request_each(pipes) -> None:
    worker, api_out, _, sched_in, api_in = pipes
    api_out.put(TokenizeMsg(uid=20, text="Hello there", sampling_params=SamplingParams(max_tokens=4), n=3))
    step(worker)
    acks = replies(api_in)
    assert [(r.uid, r.finished, r.prompt_tokens > 0) for r in acks] == [
        (20, False, True),
        (21, False, True),
        (22, False, True),
    ]
    batch = sched_in.get()
    assert [m.uid for m in batch.data] == [20, 21, 22]
    api_out.put(TokenizeMsg(uid=30, text="", sampling_params=SamplingParams(max_tokens=4), n=2))
    step(worker)
    assert [(r.uid, r.finish_reason) for r in replies(api_in)] == [(30, "error"), (31, "error")]


def test_a_reply_that_cannot_be_encoded_is_dropped_alone(pipes) -> None:
    """uids near msgpack's limit (only a malformed message sends them): the choices whose uid
    overflows are dropped, logged; the rest, and the worker, go on."""
    worker, api_out, _, sched_in, api_in = pipes
    top = 2**64 - 1
    api_out.put(TokenizeMsg(uid=top - 1, text="Hi", sampling_params=SamplingParams(max_tokens=4), n=3))
    api_out.put(TokenizeMsg(uid=40, text="Hi", sampling_params=SamplingParams(max_tokens=4)))
    got = []
    for i in range(2):  # a step takes what has arrived: on a loaded box the second message may be later
        if i and not worker.poller.poll(10_000):  # nothing more came: no second step (it would block)
            break
        step(worker)
        while api_in.poll(0.5):
            msg = api_in.get()
            got += msg.data if isinstance(msg, BatchFrontendMsg) else [msg]
        if 40 in {r.uid for r in got}:
            break
    assert sorted(r.uid for r in got) == [40, top - 1, top]
    sent = []
    while sched_in.poll(0.5):
        msg = sched_in.get()
        sent += msg.data if hasattr(msg, "data") else [msg]
    assert sorted(m.uid for m in sent) == [40, top - 1, top]
