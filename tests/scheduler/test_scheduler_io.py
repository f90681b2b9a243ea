"""SchedulerIOMixin: one rank in-process; 2 and 4 real ranks (spawn, gloo) under bursty traffic."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo, destroy_process_groups, init_process_groups
from minisgl.message import (
    AbortBackendMsg,
    BaseBackendMsg,
    BaseTokenizerMsg,
    BatchBackendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    ExitMsg,
    UserMsg,
)
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import SchedulerIOMixin
from minisgl.utils import ZmqPullQueue, ZmqPushQueue
from minisgl.utils.host import find_free_port


class Recorder(SchedulerIOMixin):
    """The IO part of a scheduler alone; counts run_when_idle calls."""

    def __init__(self, config: SchedulerConfig, group: Any = None, timeout: float = 60.0) -> None:
        self.subscriber_timeout_s = timeout
        self.idle_calls = 0
        self.events: list[str] = []
        self.offline_inbox: list[BaseBackendMsg] = []
        self.offline_sent: list[Any] = []
        super().__init__(config, group)

    def run_when_idle(self) -> None:
        self.idle_calls += 1
        self.events.append("idle")

    def offline_receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        msgs, self.offline_inbox = self.offline_inbox, []
        return msgs

    def offline_send_result(self, reply: list[Any]) -> None:
        self.offline_sent.append(list(reply))


@pytest.fixture(autouse=True)
def ipc_root(ipc_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINISGL_IPC_ROOT", str(ipc_dir))  # inherited by spawned ranks
    return ipc_dir


def config_for(rank: int, size: int, suffix: str | None = None, **kw: Any) -> SchedulerConfig:
    extra = {"_unique_suffix": suffix} if suffix else {}
    return SchedulerConfig(
        model_path="unused", tp_info=DistributedInfo(rank, size), dtype=torch.float32, **extra, **kw
    )


def user(uid: int) -> UserMsg:
    return UserMsg(
        uid=uid, input_ids=torch.tensor([uid % 1000, 1], dtype=torch.int32), sampling_params=SamplingParams()
    )


def uid_of(msg: BaseBackendMsg) -> int:
    return -1 if isinstance(msg, ExitMsg) else msg.uid


# -- one rank, in this process ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_offline_mode_bypasses_zmq(ipc_root: Path) -> None:
    config = config_for(0, 1, offline_mode=True)
    io = Recorder(config)
    assert io._io_queues == [] and not any(ipc_root.iterdir())  # no socket, not even a directory
    io.offline_inbox = [user(1)]
    assert [m.uid for m in io.receive_msg(blocking=True)] == [1]
    io.send_result([DetokenizeMsg(1, 5, True)])
    assert io.offline_sent == [[DetokenizeMsg(1, 5, True)]]
    io.stop_io()


@pytest.mark.timeout(60)
def test_single_rank_receive_and_reply() -> None:
    config = config_for(0, 1)
    io = Recorder(config)
    push = ZmqPushQueue(config.zmq_backend_addr, create=False, encoder=BaseBackendMsg.encoder)
    detok = ZmqPullQueue(config.zmq_detokenizer_addr, create=False, decoder=BaseTokenizerMsg.decoder)
    try:
        assert io.receive_msg(blocking=False) == [] and io.idle_calls == 0  # non-blocking: nothing, no wait

        threading.Timer(0.3, lambda: push.put(user(1))).start()
        got = io.receive_msg(blocking=True)  # idle hook first, then waits for the first message
        assert io.idle_calls == 1 and [m.uid for m in got] == [1]

        push.put_raw(b"\xc1 junk")  # malformed: logged and dropped
        push.put(BatchBackendMsg([user(2), AbortBackendMsg(2)]))
        push.put(user(3))
        time.sleep(0.3)
        got = io.receive_msg(blocking=True)
        assert [(type(m).__name__, m.uid) for m in got] == [
            ("UserMsg", 2),
            ("AbortBackendMsg", 2),
            ("UserMsg", 3),
        ]

        io.send_result([])
        io.send_result([DetokenizeMsg(1, 10, False)])
        io.send_result([DetokenizeMsg(2, 11, False), DetokenizeMsg(3, 12, True, "stop")])
        assert detok.get() == DetokenizeMsg(1, 10, False)
        assert detok.get() == BatchTokenizerMsg(
            [DetokenizeMsg(2, 11, False), DetokenizeMsg(3, 12, True, "stop")]
        )
        time.sleep(0.1)
        assert detok.empty()
    finally:
        for q in (push, detok):
            q.stop()
        io.stop_io()
        io.stop_io()
        config.remove_ipc_dir()


@pytest.mark.timeout(60)
def test_subscriber_wait_times_out_when_a_rank_never_starts() -> None:
    config = config_for(0, 2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="not every rank subscribed: .*0 of 1 subscriber"):
        Recorder(config, group=None, timeout=0.5)
    assert time.monotonic() - start < 20
    io = Recorder(config_for(0, 1, suffix=config._unique_suffix))  # the failed start closed its sockets
    io.stop_io()
    config.remove_ipc_dir()


# -- real ranks ----------------------------------------------------------------------------------------


def rank_worker(rank: int, size: int, suffix: str, port: int, out: Any) -> None:
    """One scheduler rank: rounds of receive_msg (blocking and not, by round number), replies, until Exit."""
    import torch.distributed as dist

    try:
        tp = DistributedInfo(rank, size)
        group = init_process_groups(tp, f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=60)
        io = Recorder(config_for(rank, size, suffix), group)
        dist.barrier(group=group)
        out.put(("ready", rank, None))
        rounds: list[list[int]] = []
        r = 0
        while True:
            blocking = r % 3 != 2  # the same on every rank: a function of the round number only
            msgs = io.receive_msg(blocking=blocking)
            rounds.append([uid_of(m) for m in msgs])
            replies = [
                DetokenizeMsg(rank * 1_000_000 + m.uid, 0, False) for m in msgs if isinstance(m, UserMsg)
            ]
            io.send_result(replies)
            if any(isinstance(m, ExitMsg) for m in msgs):
                break
            if not msgs and not blocking:
                time.sleep(0.002)  # an empty non-blocking round: don't spin the shared CPUs
            r += 1
        out.put(("done", rank, (rounds, io.idle_calls)))
        dist.barrier(group=group)
        io.stop_io()
        destroy_process_groups()
    except BaseException as e:  # report, so the test fails with a reason instead of a timeout
        out.put(("error", rank, repr(e)))
        raise


def tokenizer_traffic(
    push: ZmqPushQueue, n_msgs: int, seed: int, replied: Callable[[], int]
) -> tuple[list[int], int, set[int]]:
    """Send n_msgs uids in random bursts with random pauses, some in batches, malformed bytes between;
    then a few alone, each once rank 0 has answered every UserMsg so far (`replied()` counts its
    answers) and a moment has passed: one round in three does not block, so one of them finds nothing
    however busy the machine (in the bursts, slow ranks may always find something)."""
    rng = random.Random(seed)
    expected: list[int] = []
    aborted: set[int] = set()
    malformed = 0
    uid = 0
    users = 0  # UserMsgs sent: rank 0 answers each once
    while uid < n_msgs:
        for _ in range(rng.randint(1, 40)):
            kind = rng.random()
            if kind < 0.05:
                push.put_raw(
                    rng.choice(
                        [
                            b"\xc1",
                            b"garbage",
                            msgpack.packb({"__type__": "Evil"}),
                            msgpack.packb({"__type__": "UserMsg", "uid": "x"}),
                        ]
                    )
                )
                malformed += 1
            elif kind < 0.2:
                k = rng.randint(2, 4)
                push.put(BatchBackendMsg([user(uid + i) for i in range(k)]))
                expected += range(uid, uid + k)
                uid += k
                users += k
            elif kind < 0.25:
                push.put(AbortBackendMsg(uid))
                expected.append(uid)
                aborted.add(uid)
                uid += 1
            else:
                push.put(user(uid))
                expected.append(uid)
                uid += 1
                users += 1
        time.sleep(rng.choice([0, 0, 0.001, 0.005, 0.02]))
    for _ in range(3):
        deadline = time.monotonic() + 60
        while replied() < users and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        push.put(user(uid))
        expected.append(uid)
        uid += 1
        users += 1
    push.put_raw(b"\x92\x01")  # malformed right before the last message: the next one still arrives
    malformed += 1
    push.put(ExitMsg())
    return [*expected, -1], malformed, aborted


def _flat(replies: list[Any]) -> list[Any]:
    """The DetokenizeMsgs of the replies (a batch is several)."""
    return [m for r in list(replies) for m in (r.data if isinstance(r, BatchTokenizerMsg) else [r])]


def run_ranks(size: int, n_msgs: int, seed: int) -> None:
    ctx = mp.get_context("spawn")
    config = config_for(0, size)
    out = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(target=rank_worker, args=(r, size, config._unique_suffix, port, out), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    push = detok = None
    try:
        for _ in range(size):
            kind, rank, info = out.get(timeout=120)
            assert kind == "ready", f"rank {rank}: {info}"
        detok = ZmqPullQueue(config.zmq_detokenizer_addr, create=False, decoder=BaseTokenizerMsg.decoder)
        replies: list[Any] = []
        stop = threading.Event()

        def drain() -> None:
            while not stop.is_set():
                if detok.poll(0.05):
                    replies.append(detok.get())

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        push = ZmqPushQueue(config.zmq_backend_addr, create=False, encoder=BaseBackendMsg.encoder)
        expected, malformed, aborted = tokenizer_traffic(push, n_msgs, seed, lambda: len(_flat(replies)))

        results = {}
        for _ in range(size):
            kind, rank, info = out.get(timeout=120)
            assert kind == "done", f"rank {rank}: {info}"
            results[rank] = info
        time.sleep(0.3)
        stop.set()
        drainer.join()

        rounds0, idle0 = results[0]
        for rank in range(1, size):  # the same messages, in the same rounds, on every rank
            assert results[rank][0] == rounds0, f"rank {rank} diverged from rank 0"
            assert results[rank][1] == idle0
        assert [u for rnd in rounds0 for u in rnd] == expected  # nothing lost, malformed ones dropped
        assert malformed > 1 and idle0 > 0
        assert any(len(rnd) > 1 for rnd in rounds0) and any(rnd == [] for rnd in rounds0)

        # only rank 0 replied, once per UserMsg, batched when a round had several
        flat = _flat(replies)
        assert all(m.uid < 1_000_000 for m in flat), "a rank other than 0 sent replies"
        assert sorted(m.uid for m in flat) == [u for u in expected if u >= 0 and u not in aborted]
        assert any(isinstance(r, BatchTokenizerMsg) for r in replies)
    finally:
        for q in (push, detok):
            if q is not None:
                q.stop()
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        config.remove_ipc_dir()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size,n_msgs", [(2, 1500), (4, 800)])
def test_ranks_receive_identical_sequences(size: int, n_msgs: int) -> None:
    run_ranks(size, n_msgs, seed=size)
