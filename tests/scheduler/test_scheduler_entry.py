"""`run_scheduler` as its own process: ready info, replies over ZMQ, rejection, abort, exit, SIGTERM."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.message import (
    AbortBackendMsg,
    BaseBackendMsg,
    BaseTokenizerMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    ErrorMsg,
    ExitMsg,
    UserMsg,
)
from minisgl.scheduler import run_scheduler
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils import ZmqPullQueue, ZmqPushQueue
from minisgl.utils.handshake import recv_status

pytestmark = pytest.mark.timeout(120)


def _config(**kw: object) -> SchedulerConfig:
    return SchedulerConfig(
        model_path="/nonexistent/model",
        tp_info=DistributedInfo(0, 1),
        dtype=torch.float32,
        engine="dummy",
        page_size=4,
        num_pages=256,
        max_seq_len=64,
        **kw,  # type: ignore[arg-type]
    )


def _start(config: SchedulerConfig) -> tuple[mp.process.BaseProcess, dict]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_scheduler, args=(config, child), daemon=True)
    proc.start()
    assert parent.poll(60), "the scheduler did not report in time"
    status, info = recv_status(parent)
    assert status == "ready", info
    return proc, info


def _replies(pull: ZmqPullQueue, until_finished: set[int]) -> list[BaseTokenizerMsg]:
    out: list[BaseTokenizerMsg] = []
    pending = set(until_finished)
    while pending:
        msg = pull.get()
        msgs = msg.data if isinstance(msg, BatchTokenizerMsg) else [msg]
        for m in msgs:
            out.append(m)
            if isinstance(m, ErrorMsg) or (isinstance(m, DetokenizeMsg) and m.finished):
                pending.discard(m.uid)
    return out


def test_scheduler_process_serves_rejects_aborts_and_exits(
    ipc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINISGL_IPC_ROOT", str(ipc_dir))
    config = _config()
    proc, info = _start(config)
    push = ZmqPushQueue(config.zmq_backend_addr, create=False, encoder=BaseBackendMsg.encoder)
    pull = ZmqPullQueue(config.zmq_detokenizer_addr, create=False, decoder=BaseTokenizerMsg.decoder)
    try:
        assert info["max_seq_len"] == 64 and info["num_pages"] == 256 and info["page_size"] == 4
        assert info["vocab_size"] > 0 and "eos_token_ids" in info
        ids = torch.tensor([1, 2, 3], dtype=torch.int32)
        push.put(UserMsg(1, ids, SamplingParams(max_tokens=5)))
        push.put(UserMsg(2, ids, SamplingParams(max_tokens=62)))  # 3 + 62 > 64
        push.put(UserMsg(3, ids, SamplingParams(max_tokens=60)))
        push.put(AbortBackendMsg(3))
        got = _replies(pull, {1, 2, 3})
        assert [m.next_token for m in got if m.uid == 1 and isinstance(m, DetokenizeMsg)].__len__() == 5
        err = [m for m in got if isinstance(m, ErrorMsg)]
        assert [m.uid for m in err] == [2] and "maximum context length is 64 tokens" in err[0].message
        last3 = [m for m in got if m.uid == 3][-1]
        assert isinstance(last3, DetokenizeMsg) and last3.finish_reason == "abort"
        push.put(ExitMsg())
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        push.stop()
        pull.stop()
        if proc.is_alive():
            proc.kill()
        config.remove_ipc_dir()


def test_scheduler_process_stops_on_sigterm_and_reports_start_errors(
    ipc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINISGL_IPC_ROOT", str(ipc_dir))
    config = _config()
    proc, _ = _start(config)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        config.remove_ipc_dir()
    bad = SchedulerConfig(model_path="/nonexistent/model", tp_info=DistributedInfo(0, 1), dtype=torch.float32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=run_scheduler, args=(bad, child), daemon=True)
    p.start()
    assert parent.poll(60)
    status, why = recv_status(parent)
    p.join(30)
    assert status == "error" and "nonexistent" in why
