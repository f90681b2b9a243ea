"""ZMQ queues over ipc: order, no loss, async, pub/sub slow joiners, raw forwarding, limits."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.message import (
    BaseBackendMsg,
    BaseTokenizerMsg,
    DetokenizeMsg,
    ExitMsg,
    MessageDecodeError,
    TokenizeMsg,
    UserMsg,
)
from minisgl.utils import (
    ZmqAsyncPullQueue,
    ZmqAsyncPushQueue,
    ZmqPubQueue,
    ZmqPullQueue,
    ZmqPushQueue,
    ZmqSubQueue,
)
from minisgl.utils.mp import IPC_PATH_MAX, check_addr

pytestmark = pytest.mark.timeout(60)


def test_push_pull_over_ipc(ipc_dir: Path) -> None:
    addr = f"ipc://{ipc_dir}/q"
    pull = ZmqPullQueue(addr, create=True, decoder=BaseTokenizerMsg.decoder)
    push = ZmqPushQueue(addr, create=False, encoder=BaseTokenizerMsg.encoder)
    msgs = [
        TokenizeMsg(uid=1, text=[{"role": "user", "content": "你好"}], sampling_params=SamplingParams()),
        DetokenizeMsg(uid=1, next_token=42, finished=True),
    ]
    t = threading.Thread(target=lambda: [push.put(m) for m in msgs])
    t.start()
    got = [pull.get(), pull.get()]
    t.join()
    assert got == msgs and pull.empty()
    push.stop()
    pull.stop()


def test_ten_thousand_in_order_nothing_lost(ipc_dir: Path) -> None:
    addr = f"ipc://{ipc_dir}/many"
    pull = ZmqPullQueue(addr, create=True, decoder=BaseTokenizerMsg.decoder)
    push = ZmqPushQueue(addr, create=False, encoder=BaseTokenizerMsg.encoder)
    n = 10_000
    t = threading.Thread(target=lambda: [push.put(DetokenizeMsg(i, i * 7, i % 100 == 0)) for i in range(n)])
    t.start()
    got = [pull.get() for _ in range(n)]
    t.join()
    assert [m.uid for m in got] == list(range(n))
    assert all(m.next_token == 7 * m.uid for m in got)
    assert pull.empty()
    push.stop()
    pull.stop()


def test_chapter_style_functions_work_too(ipc_dir: Path) -> None:
    """A plain encoder/decoder function (not a group's) goes through msgpack the chapter's way."""
    addr = f"ipc://{ipc_dir}/plain"
    pull = ZmqPullQueue(addr, create=True, decoder=lambda d: d)
    push = ZmqPushQueue(addr, create=False, encoder=lambda obj: {"v": obj})
    push.put([1, 2])
    assert pull.get() == {"v": [1, 2]}
    push.put_raw(b"\xc1")
    with pytest.raises(MessageDecodeError):
        pull.get()
    push.stop()
    pull.stop()


def test_malformed_message_raises_and_next_one_arrives(ipc_dir: Path) -> None:
    addr = f"ipc://{ipc_dir}/bad"
    pull = ZmqPullQueue(addr, create=True, decoder=BaseBackendMsg.decoder)
    push = ZmqPushQueue(addr, create=False, encoder=BaseBackendMsg.encoder)
    push.put_raw(b"garbage")
    push.put_raw(msgpack.packb({"__type__": "Evil"}))
    push.put(ExitMsg())
    for _ in range(2):
        with pytest.raises(MessageDecodeError):
            pull.get()
    assert pull.get() == ExitMsg()
    push.stop()
    pull.stop()


def test_empty_does_not_block(ipc_dir: Path) -> None:
    pull = ZmqPullQueue(f"ipc://{ipc_dir}/e", create=True, decoder=BaseBackendMsg.decoder)
    start = time.monotonic()
    assert all(pull.empty() for _ in range(100))
    assert time.monotonic() - start < 5
    pull.stop()


def test_async_push_pull(ipc_dir: Path) -> None:
    addr = f"ipc://{ipc_dir}/aq"

    async def main() -> list[int]:
        pull = ZmqAsyncPullQueue(addr, create=True, decoder=BaseTokenizerMsg.decoder)
        push = ZmqAsyncPushQueue(addr, create=False, encoder=BaseTokenizerMsg.encoder)
        assert pull.empty()

        async def send() -> None:
            for i in range(200):
                await push.put(DetokenizeMsg(i, i, False))
            await push.put_raw(b"not msgpack")
            await push.put(DetokenizeMsg(999, 0, True))

        sender = asyncio.create_task(send())
        got = [(await pull.get()).uid for _ in range(200)]
        with pytest.raises(MessageDecodeError):
            await pull.get()
        got.append((await pull.get()).uid)
        await sender
        push.stop()
        pull.stop()
        return got

    assert asyncio.run(asyncio.wait_for(main(), 30)) == [*range(200), 999]


def test_pub_sub_two_subscribers_first_message_not_lost(ipc_dir: Path) -> None:
    """The slow-joiner trap: publish right after wait_for_subscribers; both must get message one."""
    for attempt in range(5):  # several fresh sockets: a race would show up at least once
        addr = f"ipc://{ipc_dir}/ps{attempt}"
        pub = ZmqPubQueue(addr, create=True, encoder=BaseBackendMsg.encoder)
        subs = [ZmqSubQueue(addr, create=False, decoder=BaseBackendMsg.decoder) for _ in range(2)]
        pub.wait_for_subscribers(2, timeout=10)
        first = UserMsg(
            uid=attempt, input_ids=torch.tensor([1, 2], dtype=torch.int32), sampling_params=SamplingParams()
        )
        pub.put(first)
        pub.put(ExitMsg())
        for s in subs:
            assert s.poll(10), "a subscriber missed the first message"
            got = s.get()
            assert got.uid == attempt and torch.equal(got.input_ids, first.input_ids)
            assert s.get() == ExitMsg()
        for q in [pub, *subs]:
            q.stop()


def test_wait_for_subscribers_times_out(ipc_dir: Path) -> None:
    pub = ZmqPubQueue(f"ipc://{ipc_dir}/lonely", create=True, encoder=BaseBackendMsg.encoder)
    sub = ZmqSubQueue(f"ipc://{ipc_dir}/lonely", create=False, decoder=BaseBackendMsg.decoder)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="1 of 2 subscriber"):
        pub.wait_for_subscribers(2, timeout=0.5)
    assert 0.4 < time.monotonic() - start < 10
    sub.stop()
    pub.stop()


def test_raw_forwarding_is_byte_identical(ipc_dir: Path) -> None:
    pull = ZmqPullQueue(f"ipc://{ipc_dir}/in", create=True, decoder=BaseBackendMsg.decoder)
    push = ZmqPushQueue(f"ipc://{ipc_dir}/in", create=False, encoder=BaseBackendMsg.encoder)
    pub = ZmqPubQueue(f"ipc://{ipc_dir}/out", create=True, encoder=BaseBackendMsg.encoder)
    sub = ZmqSubQueue(f"ipc://{ipc_dir}/out", create=False, decoder=BaseBackendMsg.decoder)
    pub.wait_for_subscribers(1, timeout=10)
    msg = UserMsg(
        uid=3, input_ids=torch.arange(50, dtype=torch.int32), sampling_params=SamplingParams(top_k=4)
    )
    sent = msg.to_bytes()
    push.put(msg)
    raw = pull.get_raw()
    assert raw == sent
    pub.put_raw(raw)
    forwarded = sub.get_raw()
    assert forwarded == sent
    assert torch.equal(sub.decode(forwarded).input_ids, msg.input_ids)
    for q in (pull, push, pub, sub):
        q.stop()


def test_overlong_ipc_path_refused_before_zmq(ipc_dir: Path) -> None:
    long_path = f"{ipc_dir}/" + "x" * (IPC_PATH_MAX + 1 - len(str(ipc_dir)))
    with pytest.raises(ValueError, match="longer than"):
        ZmqPullQueue(f"ipc://{long_path}", create=True, decoder=BaseBackendMsg.decoder)
    with pytest.raises(ValueError, match="longer than"):
        ZmqPubQueue(f"ipc://{long_path}", create=True, encoder=BaseBackendMsg.encoder)
    ok = f"{ipc_dir}/" + "y" * (IPC_PATH_MAX - 1 - len(str(ipc_dir)))
    assert len(ok) == IPC_PATH_MAX
    q = ZmqPullQueue(f"ipc://{ok}", create=True, decoder=BaseBackendMsg.decoder)  # exactly at the limit: fine
    q.stop()
    with pytest.raises(ValueError):
        check_addr("/tmp/no-scheme")


def test_stop_never_hangs_with_unsent_messages(ipc_dir: Path) -> None:
    push = ZmqPushQueue(f"ipc://{ipc_dir}/nobody", create=False, encoder=BaseBackendMsg.encoder)
    for _ in range(10):
        push.put(ExitMsg())  # queued: nobody is listening
    start = time.monotonic()
    push.stop()
    push.stop()  # idempotent
    assert time.monotonic() - start < 5


def test_group_base_class_accepted_as_codec(ipc_dir: Path) -> None:
    """The group base class (not only its encoder/decoder functions) selects the bytes path."""
    addr = f"ipc://{ipc_dir}/cls"
    pull = ZmqPullQueue(addr, create=True, decoder=BaseBackendMsg)
    push = ZmqPushQueue(addr, create=False, encoder=BaseBackendMsg)
    push.put(ExitMsg())
    assert pull.get() == ExitMsg()
    with pytest.raises(TypeError, match="not a registered backend message"):
        push.put(DetokenizeMsg(1, 2, False))  # a tokenizer message on a backend queue
    push.stop()
    pull.stop()
