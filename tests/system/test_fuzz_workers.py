"""Fuzzing the tokenizer/detokenizer worker process (issue 9's reliability suite): generated frames on
its two inputs — the tokenizer's (from the API server) and the detokenizer's (from the scheduler).
Both of the worker's input sockets connect, so the test binds them (as the API server and the
scheduler do) and drains the worker's outputs meanwhile. The worker must log and drop what it cannot
decode, answer what it can, stay up, and then serve a normal request on each input."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzing import byte_mutants, frame
from minisgl.core import SamplingParams
from minisgl.message import (
    BaseBackendMsg,
    BaseFrontendMsg,
    BaseTokenizerMsg,
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    TokenizeMsg,
    UserMsg,
    UserReply,
)
from minisgl.tokenizer.server import TokenizerWorkerConfig, run_tokenizer_worker
from minisgl.utils.handshake import recv_status, send_status

pytestmark = pytest.mark.timeout(600)

SENTINEL = 2**63 + 12_345  # uids of the normal requests sent after the fuzz


class Drain(threading.Thread):
    """Reads what the worker sends to the scheduler and the API server, keeping what decodes."""

    def __init__(self, ctx: zmq.Context, addrs: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.socks = {}
        for name, group in (("backend", BaseBackendMsg), ("frontend", BaseFrontendMsg)):
            s = ctx.socket(zmq.PULL)
            s.bind(addrs[name])
            self.socks[name] = (s, group)
        self.got: list[Any] = []
        self.stopping = False

    def run(self) -> None:
        poller = zmq.Poller()
        for s, _ in self.socks.values():
            poller.register(s, zmq.POLLIN)
        while not self.stopping:
            for s, group in self.socks.values():
                while s.poll(0):
                    msg = group.from_bytes(s.recv())  # the worker's own output must always decode
                    self.got += msg.data if isinstance(msg, (BatchBackendMsg, BatchFrontendMsg)) else [msg]
            poller.poll(50)

    def wait_for(self, pred, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [m for m in list(self.got) if pred(m)]
            if hits:
                return hits
            time.sleep(0.05)
        raise AssertionError("the worker did not answer the normal request")

    def close(self) -> None:
        self.stopping = True
        self.join(5)
        for s, _ in self.socks.values():
            s.close(linger=0)


class Worker:
    """A real worker process (role "both") wired to sockets this test binds."""

    def __init__(self, ipc_dir: Path) -> None:
        from minisgl.models import resolve_model_path

        addrs = {k: f"ipc://{ipc_dir}/{k}" for k in ("tokenizer", "detokenizer", "backend", "frontend")}
        self.ctx = zmq.Context()
        self.inputs = {}
        for name in ("tokenizer", "detokenizer"):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDTIMEO, 30_000)
            s.bind(addrs[name])
            self.inputs[name] = s
        self.drain = Drain(self.ctx, addrs)
        self.drain.start()
        cfg = TokenizerWorkerConfig(
            model_path=str(resolve_model_path(None, require_weights=False)),
            role="both",
            tokenizer_addr=addrs["tokenizer"],
            detokenizer_addr=addrs["detokenizer"],
            backend_addr=addrs["backend"],
            frontend_addr=addrs["frontend"],
        )
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_tokenizer_worker, args=(cfg, child), daemon=True)
        self.proc.start()
        send_status(self.conn, "start", {"max_seq_len": 256, "vocab_size": 49152})
        assert self.conn.poll(120), "the worker did not report"
        assert recv_status(self.conn)[0] == "ready"
        self.checks = 0

    def send(self, name: str, raw: bytes) -> None:
        self.inputs[name].send(raw)

    def assert_serving(self) -> None:
        assert self.proc.is_alive(), f"the worker died (exit code {self.proc.exitcode})"
        self.checks += 1
        uid = SENTINEL + 2 * self.checks
        msg = TokenizeMsg(uid=uid, text="Hello there", sampling_params=SamplingParams(max_tokens=4))
        self.send("tokenizer", BaseTokenizerMsg.to_bytes(msg))
        self.drain.wait_for(lambda m: isinstance(m, UserMsg) and m.uid == uid)
        [ack] = self.drain.wait_for(lambda m: isinstance(m, UserReply) and m.uid == uid)
        assert not ack.finished and ack.prompt_tokens == 2
        ids = [19556, 17]  # "Hello!" in the embedded model's vocabulary
        msgs = [DetokenizeMsg(uid + 1, ids[0], False), DetokenizeMsg(uid + 1, ids[1], True, "stop")]
        self.send("detokenizer", BaseTokenizerMsg.to_bytes(BatchTokenizerMsg(data=msgs)))
        self.drain.wait_for(lambda m: isinstance(m, UserReply) and m.uid == uid + 1 and m.finished)
        replies = [m for m in self.drain.got if isinstance(m, UserReply) and m.uid == uid + 1]
        assert "".join(m.incremental_output for m in replies) == "Hello!"
        assert replies[-1].finish_reason == "stop"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(10)
        self.drain.close()
        for s in self.inputs.values():
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
def worker(ipc_dir: Path) -> Iterator[Worker]:
    w = Worker(ipc_dir)
    yield w
    w.close()


def fuzz(worker: Worker, name: str, examples: int, fuzz_report, what: str) -> None:
    """Send `examples` generated frames to input `name`, each followed by 3 byte-level mutants."""
    sent = [0, 0]

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(raw=frame("tokenizer"), rnd=st.randoms(use_true_random=False))
    def one(raw: bytes, rnd: random.Random) -> None:
        worker.send(name, raw)
        sent[0] += 1
        for m in byte_mutants(raw, rnd, 3):
            worker.send(name, m)
            sent[1] += 1

    one()
    worker.assert_serving()
    fuzz_report(f"frames, {what}: generated", sent[0])
    fuzz_report(f"frames, {what}: byte mutants of them", sent[1])


def test_fuzz_tokenizer_and_detokenizer_inputs(worker: Worker, fuzz_report) -> None:
    worker.assert_serving()
    fuzz(worker, "tokenizer", 300, fuzz_report, "tokenizer input (worker process)")
    fuzz(worker, "detokenizer", 300, fuzz_report, "detokenizer input (worker process)")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_worker_inputs_long(worker: Worker, fuzz_report) -> None:
    fuzz(worker, "tokenizer", 10_000, fuzz_report, "tokenizer input (worker process), slow run")
    fuzz(worker, "detokenizer", 10_000, fuzz_report, "detokenizer input (worker process), slow run")
