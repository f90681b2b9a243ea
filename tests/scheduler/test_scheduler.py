"""The scheduler's bookkeeping with the dummy engine (no model): replies, finish reasons, aborts,
rejections, page waits, retraction, idle logging and the KV integrity check."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.kvcache import KVIntegrityError
from minisgl.message import (
    AbortBackendMsg,
    BaseTokenizerMsg,
    BatchBackendMsg,
    DetokenizeMsg,
    ErrorMsg,
    ExitMsg,
    UserMsg,
)
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler

VOCAB = 32000  # the dummy engine's vocabulary when the model path has no config.json


class Harness(Scheduler):
    """A scheduler in offline mode whose inbox and outbox are plain lists."""

    def __init__(self, **cfg: Any) -> None:
        config = SchedulerConfig(
            model_path="/nonexistent/model",
            tp_info=DistributedInfo(0, 1),
            dtype=torch.float32,
            engine="dummy",
            offline_mode=True,
            **{"page_size": 4, "num_pages": 64, "max_seq_len": 128, **cfg},
        )
        self.inbox: list[Any] = []
        self.outbox: list[BaseTokenizerMsg] = []
        super().__init__(config)

    def offline_receive_msg(self, blocking: bool = False) -> list[Any]:
        if blocking:
            self.run_when_idle()
        msgs, self.inbox = self.inbox, []
        return msgs

    def offline_send_result(self, reply: list[BaseTokenizerMsg]) -> None:
        self.outbox.extend(reply)

    def submit(self, uid: int, ids: list[int], **params: Any) -> None:
        self.inbox.append(UserMsg(uid, torch.tensor(ids, dtype=torch.int32), SamplingParams(**params)))

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        self.sync_step()
        for _ in range(max_steps):
            if not self.has_work() and not self.inbox:
                return
            self.sync_step()
        raise AssertionError("the scheduler did not finish its work")

    def tokens(self, uid: int) -> list[int]:
        return [m.next_token for m in self.outbox if isinstance(m, DetokenizeMsg) and m.uid == uid]

    def last(self, uid: int) -> BaseTokenizerMsg:
        return [m for m in self.outbox if m.uid == uid][-1]


def _request_pages(s: Scheduler) -> int:
    """Pages requests hold (neither free nor held by the prefix cache)."""
    alloc = s.table.allocator
    return alloc.num_pages - alloc.num_free - s.cache.prefix.num_pages


def _all_free(s: Scheduler) -> bool:
    return _request_pages(s) == 0


def test_requests_finish_on_length_and_stop_tokens() -> None:
    s = Harness()
    s.submit(1, [5, 6, 7], max_tokens=6)
    s.run_until_idle()
    ref = s.tokens(1)
    assert len(ref) == 6 and s.last(1).finish_reason == "length"
    assert [m.finished for m in s.outbox] == [False] * 5 + [True]
    s.submit(2, [5, 6, 7], max_tokens=6, stop_token_ids=[ref[2]])
    s.run_until_idle()
    assert s.tokens(2) == ref[:3] and s.last(2).finish_reason == "stop"
    assert _all_free(s)


def test_batched_and_flattened_messages_decode_in_uid_order() -> None:
    s = Harness()
    msgs = [
        UserMsg(uid, torch.tensor([1, 2, 3 + uid], dtype=torch.int32), SamplingParams(max_tokens=4))
        for uid in (9, 3, 5)
    ]
    s.inbox.append(BatchBackendMsg(data=msgs))
    s.run_until_idle()
    decode_steps = [m.uid for m in s.outbox if isinstance(m, DetokenizeMsg)][3:]  # after the prefill step
    assert decode_steps == [3, 5, 9] * 3


def test_rejections_reply_with_the_reason_and_never_crash() -> None:
    s = Harness()
    s.submit(1, [])
    s.submit(2, [1, VOCAB])
    s.submit(3, [1, 2], max_tokens=0)
    s.submit(4, list(range(100)), max_tokens=29)  # 129 > max_seq_len 128
    s.submit(5, [1, 2], temperature=-1.0)
    s.inbox.append(UserMsg(6, torch.tensor([1.5]), SamplingParams()))  # float ids
    s.run_until_idle()
    errors = {m.uid: m.message for m in s.outbox if isinstance(m, ErrorMsg)}
    assert set(errors) == {1, 2, 3, 4, 5, 6}
    assert "empty" in errors[1]
    assert "out of vocabulary" in errors[2] and str(VOCAB) in errors[2]
    assert "max_tokens" in errors[3]
    assert "maximum context length is 128 tokens" in errors[4] and "129" in errors[4]
    assert "temperature" in errors[5]
    assert "integer" in errors[6]
    s.submit(7, list(range(100)), max_tokens=28)  # exactly 128: accepted
    s.run_until_idle()
    assert len(s.tokens(7)) == 28
    assert _all_free(s)


def test_duplicate_live_uid_is_rejected() -> None:
    s = Harness()
    s.submit(1, [1, 2], max_tokens=50)
    s.sync_step()
    s.submit(1, [3, 4])
    s.sync_step()
    errors = [m.message for m in s.outbox if isinstance(m, ErrorMsg)]
    assert len(errors) == 1 and "already in use" in errors[0]
    s.run_until_idle()
    assert len(s.tokens(1)) == 50


def _pinned_pages(s: Scheduler) -> int:
    """Pages requests use (their own, or cached ones they pin): neither free nor evictable."""
    alloc = s.table.allocator
    return alloc.num_pages - alloc.num_free - s.cache.prefix.num_evictable


@pytest.mark.parametrize("cache_type", ["naive", "radix"])
def test_abort_frees_pages_at_once(cache_type: str) -> None:
    s = Harness(cache_type=cache_type)
    s.submit(1, list(range(1, 30)), max_tokens=50)
    s.submit(2, [1, 2, 3], max_tokens=50)
    for _ in range(4):
        s.sync_step()
    held = _pinned_pages(s)
    assert held > 0
    s.inbox.append(AbortBackendMsg(1))
    s.sync_step()
    assert s.last(1) == DetokenizeMsg(1, -1, True, "abort")
    # uid 1's 29+ tokens: freed (naive) or left cached but unpinned (radix)
    assert held - _pinned_pages(s) >= 8
    s.check_integrity()
    s.run_until_idle()
    assert len(s.tokens(2)) == 50 and _all_free(s)


def test_abort_of_a_waiting_request_and_of_one_not_yet_seen() -> None:
    s = Harness(max_running_requests=1)
    s.submit(1, [1, 2], max_tokens=20)
    s.submit(2, [1, 2], max_tokens=20)  # waits for a table row
    s.sync_step()
    s.inbox.append(AbortBackendMsg(2))
    s.inbox.append(AbortBackendMsg(3))  # before its request
    s.sync_step()
    assert s.last(2).finish_reason == "abort"
    s.submit(3, [1, 2], max_tokens=5)  # arrives late: aborted on arrival
    s.run_until_idle()
    assert s.tokens(3) == [-1] and s.last(3).finish_reason == "abort"
    assert len(s.tokens(1)) == 20 and _all_free(s)
    s.inbox.append(AbortBackendMsg(1))  # finished already: ignored, no reply
    n = len(s.outbox)
    s.run_until_idle()
    assert len(s.outbox) == n


def test_small_pool_waits_and_retracts_but_finishes_everything() -> None:
    s = Harness(num_pages=12, max_prefill_tokens=5)  # 48 token slots
    for uid in range(5):
        s.submit(uid, [7] * (10 + uid), max_tokens=30)
    s.run_until_idle()
    for uid in range(5):
        assert len(s.tokens(uid)) == 30 and s.last(uid).finish_reason == "length"
    assert s.prefill.num_page_waits > 0 and s.num_retractions > 0
    assert _all_free(s)


def test_idle_logs_once_and_integrity_check_catches_a_leak(caplog: pytest.LogCaptureFixture) -> None:
    s = Harness()
    with caplog.at_level(logging.INFO, logger="minisgl.scheduler.scheduler"):
        s.submit(1, [1, 2], max_tokens=3)
        s.run_until_idle()  # idle at the start (the message is not received yet), then busy
        s.sync_step()  # blocks (offline: returns nothing) -> idle again: one line
        s.sync_step()  # still idle: no further line
    idle = [r.getMessage() for r in caplog.records if "scheduler idle" in r.getMessage()]
    # 2 prompt + 3 output tokens: K/V for 4, one whole page of 4, which stays cached
    assert idle == [
        "scheduler idle: 0 running, 0 waiting, pages free 64/64, cached 0; prompt tokens from the cache 0/0",
        "scheduler idle: 0 running, 0 waiting, pages free 63/64, cached 1; prompt tokens from the cache 0/2",
    ]
    s.run_when_idle()  # a clean pool passes
    [leaked] = s.table.allocator.alloc(1)  # a page owned by nobody
    with pytest.raises(KVIntegrityError, match=f"page {leaked} is allocated but owned by 0 request"):
        s.run_when_idle()


def test_exit_message_stops_the_loop() -> None:
    s = Harness()
    s.submit(1, [1, 2], max_tokens=3)
    s.inbox.append(ExitMsg())
    s.run_forever()  # returns after the ExitMsg step
    assert s.tokens(1)[:1]  # the request got its first token in that step


def test_ready_info() -> None:
    info = Harness().info()
    assert info["max_seq_len"] == 128 and info["num_pages"] == 64 and info["page_size"] == 4
    assert info["vocab_size"] == VOCAB and info["eos_token_ids"] == []
