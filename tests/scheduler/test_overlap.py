"""Overlap scheduling (step N+1 launched before step N's tokens are taken) gives exactly the tokens
and finish reasons of the plain loop: stops, max_tokens, EOS, aborts mid-flight, retraction under a
tiny pool. On the CPU a step completes when launched, but the scheduler still runs one step late and
feeds pending tokens from the device-side tensor, so this is the same logic a GPU runs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_support import save_tiny_hf_model

from minisgl import LLM, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import create_engine
from minisgl.message import AbortBackendMsg, BaseTokenizerMsg, DetokenizeMsg, UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), False)


def _workload(seed: int, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 131) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 24),
            stop_token_ids=[rng.randrange(4, 131)] if rng.random() < 0.5 else [],
            ignore_eos=rng.random() < 0.5,
        )
        for _ in range(n)
    ]
    return prompts, params


def _generate(model_dir: Path, overlap: bool, prompts: Any, params: Any, **opts: Any) -> list[tuple]:
    llm = LLM(str(model_dir), device="cpu", overlap_schedule=overlap, **opts)
    assert llm.overlap is overlap
    outs = llm.generate(prompts, params)
    llm.check_integrity()
    assert llm.table.allocator.num_free + llm.cache.prefix.num_pages == llm.table.allocator.num_pages
    return [(o["token_ids"], o["finish_reason"]) for o in outs], llm.num_retractions


@pytest.mark.parametrize("seed", [0, 1])
def test_overlap_gives_the_plain_loops_tokens(model_dir: Path, seed: int) -> None:
    prompts, params = _workload(seed, 12)
    first, _ = _generate(model_dir, False, prompts, params, max_prefill_tokens=32)
    for i in range(0, len(params), 2):  # make every other request stop on a token it will produce
        toks = first[i][0]
        params[i].stop_token_ids = [toks[len(toks) // 2]]
    plain, _ = _generate(model_dir, False, prompts, params, max_prefill_tokens=32)
    over, _ = _generate(model_dir, True, prompts, params, max_prefill_tokens=32)
    assert over == plain
    assert {r for _, r in plain} >= {"length", "stop"}  # both kinds of ending were exercised


def test_overlap_with_retraction_in_a_tiny_pool(model_dir: Path) -> None:
    prompts, params = _workload(2, 10)
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in params]
    opts = dict(page_size=4, num_pages=24, max_prefill_tokens=16)
    plain, r_plain = _generate(model_dir, False, prompts, params, **opts)
    over, r_over = _generate(model_dir, True, prompts, params, **opts)
    assert over == plain
    assert r_plain > 0 and r_over > 0  # the pool really ran short


class _Harness(Scheduler):
    """An overlapped scheduler on the tiny model whose inbox and outbox are lists."""

    def __init__(self, model_dir: Path, overlap: bool) -> None:
        config = SchedulerConfig(
            model_path=str(model_dir), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
            offline_mode=True, overlap_schedule=overlap, num_pages=64, page_size=4,
        )  # fmt: skip
        self.inbox: list[Any] = []
        self.outbox: list[BaseTokenizerMsg] = []
        super().__init__(config, engine=create_engine(config))

    def offline_receive_msg(self, blocking: bool = False) -> list[Any]:
        msgs, self.inbox = self.inbox, []
        return msgs

    def offline_send_result(self, reply: list[BaseTokenizerMsg]) -> None:
        self.outbox.extend(reply)

    def tokens(self, uid: int) -> list[int]:
        return [m.next_token for m in self.outbox if isinstance(m, DetokenizeMsg) and m.uid == uid]


def test_abort_mid_flight_ends_at_once_and_frees_the_pages(model_dir: Path) -> None:
    runs = {}
    for overlap in (False, True):
        s = _Harness(model_dir, overlap)
        for uid in (1, 2, 3):
            s.inbox.append(
                UserMsg(uid, torch.tensor([5 + uid, 9, 30]), SamplingParams(max_tokens=12, ignore_eos=True))
            )
        for _ in range(4):
            s.step()
        s.inbox.append(AbortBackendMsg(2))
        s.step()
        ends = [m for m in s.outbox if isinstance(m, DetokenizeMsg) and m.uid == 2 and m.finished]
        assert [m.finish_reason for m in ends] == ["abort"]  # the abort is answered in that step
        sent = len(s.tokens(2))
        for _ in range(40):
            s.step()
        assert len(s.tokens(2)) == sent  # nothing for it after the abort (its in-flight token dropped)
        assert not s.has_work() and s._in_flight is None
        s.check_integrity()
        assert s.table.allocator.num_free + s.cache.prefix.num_pages == s.table.allocator.num_pages
        runs[overlap] = [s.tokens(1), s.tokens(3)]
        assert all(len(t) == 12 for t in runs[overlap])
    assert runs[True] == runs[False]
