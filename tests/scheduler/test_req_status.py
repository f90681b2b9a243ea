"""A request's status (`Req.status`): the transitions it may take, the ones it refuses, and the
statuses a request really passes through in the scheduler (dummy engine: no model); the engine
interface both engines implement, and overlap scheduling on the dummy engine."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from test_models_support import save_tiny_hf_model
from test_scheduler import Harness

from minisgl.core import IllegalTransition, Req, ReqStatus, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import DummyEngine, EngineOptions, EngineProtocol, create_engine
from minisgl.message import AbortBackendMsg
from minisgl.scheduler.config import SchedulerConfig

W, P, D, R, F = (
    ReqStatus.WAITING,
    ReqStatus.PREFILLING,
    ReqStatus.DECODING,
    ReqStatus.RETRACTED,
    ReqStatus.FINISHED,
)
LEGAL = {(W, P), (W, F), (P, D), (P, R), (P, F), (D, R), (D, F), (R, P), (R, F)}


def _req(status: ReqStatus) -> Req:
    req = Req(uid=7, token_ids=[1, 2], sampling_params=SamplingParams())
    req.status = status
    return req


@pytest.mark.parametrize(("a", "b"), list(itertools.product(ReqStatus, repeat=2)), ids=str)
def test_transitions_are_the_table(a: ReqStatus, b: ReqStatus) -> None:
    req = _req(a)
    if (a, b) in LEGAL:
        req.move_to(b)
        assert req.status is b
    else:
        with pytest.raises(IllegalTransition, match=f"request 7: {a.value} -> {b.value} is not a transition"):
            req.move_to(b)
        assert req.status is a  # unchanged


def test_a_new_request_waits_and_flags_follow_the_status() -> None:
    req = Req(uid=1, token_ids=[1], sampling_params=SamplingParams())
    assert req.status is W and not req.finished and not req.holds_pages
    for status, holds in [(P, True), (D, True), (R, False), (P, True), (F, False)]:
        req.move_to(status)
        assert req.holds_pages is holds and req.finished is (status is F)


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[ReqStatus]]:
    """uid -> every status its request had, in order (each `move_to` recorded)."""
    seen: dict[int, list[ReqStatus]] = {}
    real = Req.move_to

    def move_to(self: Req, status: ReqStatus) -> None:
        real(self, status)
        seen.setdefault(self.uid, [W]).append(status)

    monkeypatch.setattr(Req, "move_to", move_to)
    return seen


class Checked(Harness):
    """The harness, checking after every step that each status is the place its request sits in."""

    def run(self) -> None:
        for _ in range(10_000):
            self.step()
            self.check_integrity()
            if not self.has_work() and not self.inbox and self._in_flight is None:
                return
        raise AssertionError("the scheduler did not finish its work")


def test_a_chunked_prefill_passes_through_prefilling(paths: dict[int, list[ReqStatus]]) -> None:
    s = Checked(max_prefill_tokens=4)
    s.submit(1, list(range(1, 11)), max_tokens=3)  # three chunks: 4, 4, 2 tokens
    s.submit(2, [1, 2], max_tokens=3)  # waits for the budget, then one chunk
    s.run()
    assert paths == {1: [W, P, D, F], 2: [W, P, D, F]}


def test_an_aborted_waiting_request_finishes_from_waiting(paths: dict[int, list[ReqStatus]]) -> None:
    s = Checked(max_running_requests=1)
    s.submit(1, [1, 2], max_tokens=5)
    s.submit(2, [1, 2], max_tokens=5)  # no table row for it yet
    s.step()
    s.inbox.append(AbortBackendMsg(2))
    s.run()
    assert paths == {1: [W, P, D, F], 2: [W, F]}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_full_pool_retracts_and_readmits(paths: dict[int, list[ReqStatus]], overlap: bool) -> None:
    s = Checked(num_pages=12, max_prefill_tokens=5, overlap_schedule=overlap)
    for uid in range(5):
        s.submit(uid, [7] * (10 + uid), max_tokens=30)
    s.run()
    assert s.num_retractions == sum(path.count(R) for path in paths.values()) > 0
    for path in paths.values():
        assert path[:2] == [W, P] and path[-1] is F
        for i in [i for i, st in enumerate(path) if st is R]:  # readmitted (or its last token ended it)
            assert path[i + 1] in (P, F)
    for uid in range(5):
        assert len(s.tokens(uid)) == 30


def test_overlap_on_the_dummy_engine_gives_the_plain_loops_tokens() -> None:
    """With overlap the dummy engine reads each pending token from the step before (as the real
    engine takes it on the device): the same tokens and finish reasons as the plain loop."""
    outs = []
    for overlap in (False, True):
        s = Checked(overlap_schedule=overlap, max_prefill_tokens=8)
        assert s.overlap is overlap
        for uid in range(6):
            s.submit(uid, [3 + uid] * (2 + 3 * uid), max_tokens=4 + uid)
        s.run()
        outs.append(sorted((m.uid, m.next_token, m.finish_reason) for m in s.outbox))
    assert outs[0] == outs[1] and len(outs[0]) == sum(4 + uid for uid in range(6))


def test_both_engines_implement_the_interface(tmp_path: Path) -> None:
    dummy = DummyEngine(EngineOptions(num_pages=8))
    assert isinstance(dummy, EngineProtocol) and dummy.grammars is None
    model = save_tiny_hf_model("LlamaForCausalLM", tmp_path, False)
    config = SchedulerConfig(str(model), DistributedInfo(0, 1), torch.float32, device="cpu", num_pages=16)
    engine = create_engine(config)
    assert isinstance(engine, EngineProtocol) and engine.grammars is not None
