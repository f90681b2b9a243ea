"""GrammarWait across tensor-parallel ranks: compiles finish at different times on each rank, yet
every rank admits (or refuses) a request in the same step, agreed over a gloo group. Two real
processes, a fake compiler whose compiles take a time set per rank; no model."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from concurrent.futures import Future

import pytest

from minisgl.core import Req, SamplingParams
from minisgl.grammar import GrammarError
from minisgl.scheduler.grammar_wait import GrammarWait

pytestmark = pytest.mark.timeout(60)

# grammar -> (seconds to compile on rank 0, on rank 1, whether it fails on rank 1)
PLAN = {"fast-everywhere": (0.0, 0.0, False), "slow-on-1": (0.0, 0.4, False), "fails-on-1": (0.0, 0.1, True)}


class FakeCompiler:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def submit(self, grammar: str) -> Future:
        future: Future = Future()
        delay0, delay1, fails = PLAN.get(grammar, (0.0, 0.0, False))
        delay = delay1 if self.rank else delay0
        error = GrammarError("no") if fails and self.rank else None
        threading.Timer(
            delay, lambda: future.set_exception(error) if error else future.set_result(grammar)
        ).start()
        return future

    @staticmethod
    def matcher(future: Future, reasoning: tuple[int, int] = (-1, -1)) -> str:
        return future.result()


def _rank(rank: int, port: int, timeout_s: float, out: mp.Queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    wait = GrammarWait(FakeCompiler(rank), timeout_s=timeout_s, tp_group=dist.group.WORLD)  # type: ignore[arg-type]
    for uid, grammar in enumerate([*PLAN, "never"]):
        if grammar == "never":
            wait.compiler.submit = lambda _g: Future()  # type: ignore[method-assign]  # never done
        wait.add(Req(uid=uid, token_ids=[1], sampling_params=SamplingParams()), grammar)
    events: list[tuple[int, int, str]] = []
    step = 0
    while wait.waiting and step < 400:
        ready, refused = wait.take_finished()
        events += [(step, r.uid, "ready") for r in ready] + [(step, r.uid, "refused") for r, _ in refused]
        step += 1
        time.sleep(0.01)
    out.put((rank, events))
    dist.destroy_process_group()


def test_ranks_admit_and_refuse_in_the_same_step() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, 1.5, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=50) for _ in procs)
    for p in procs:
        p.join(10)
    assert results[0] == results[1]  # the same steps, the same verdicts
    by_uid = {uid: (step, what) for step, uid, what in results[0]}
    assert (
        by_uid[0][1] == "ready" and by_uid[1][1] == "ready" and by_uid[1][0] > by_uid[0][0]
    )  # waited for rank 1
    assert by_uid[2][1] == "refused"  # failed on rank 1 only: refused on both
    assert by_uid[3][1] == "refused" and by_uid[3][0] > by_uid[1][0]  # past its time limit
