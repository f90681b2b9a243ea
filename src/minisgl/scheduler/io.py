"""The scheduler's IO: `receive_msg(blocking)` and `send_result(reply)`, one rank or many.

Every tensor-parallel rank runs the same deterministic scheduler, so every rank must see the same
messages in the same rounds. Only rank 0 reads the tokenizer's queue; it forwards each message's raw
bytes to the other ranks over XPUB/SUB and broadcasts each round's count on the gloo CPU group:

    tokenizer ──PUSH/PULL──> rank 0 ──put_raw (XPUB)──> SUB on ranks 1..N-1
                               │  count: dist.broadcast(src=0, tp_cpu_group)
                               └──PUSH──> detokenizer   (only rank 0 replies)

A round: `blocking=True` (the scheduler has no work) calls `run_when_idle()`, waits for one
message, then drains what has already arrived without waiting; `blocking=False` only drains. The
`blocking` flag derives from scheduler state, which is identical on every rank, so the ranks make
the same sequence of calls. Bytes that do not decode are logged and dropped by rank 0 *before*
forwarding or counting, so no rank ever sees them and the ranks cannot diverge. A received
`BatchBackendMsg` is flattened: `receive_msg` returns its members, in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import torch
import zmq

from minisgl.message import BaseBackendMsg, BaseTokenizerMsg, BatchTokenizerMsg, MessageDecodeError
from minisgl.utils import ZmqPubQueue, ZmqPullQueue, ZmqPushQueue, ZmqSubQueue, init_logger
from minisgl.utils.batch import one_or_batch, unbatch
from minisgl.utils.mp import PEER_SEND_TIMEOUT_S

from .config import SchedulerConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = init_logger(__name__)

Queue = TypeVar("Queue", ZmqPullQueue, ZmqPushQueue, ZmqPubQueue, ZmqSubQueue)


class SchedulerIOMixin:
    """Chooses the receive/send functions once, at construction. The subclass provides
    `run_when_idle()` and, for offline mode, `offline_receive_msg` / `offline_send_result`."""

    subscriber_timeout_s: float = 120.0  # rank 0 waits this long for the other ranks to subscribe

    def __init__(self, config: SchedulerConfig, tp_cpu_group: ProcessGroup | None) -> None:
        self.tp_cpu_group = tp_cpu_group
        self._io_queues: list[ZmqPullQueue | ZmqPushQueue | ZmqPubQueue | ZmqSubQueue] = []
        if config.offline_mode:  # the offline LLM class does its own IO: no sockets at all
            self.receive_msg = self._recv_msg_offline
            self.send_result = self.offline_send_result
            return
        try:
            self._open_queues(config)
        except BaseException:
            self.stop_io()
            raise

    def _open_queues(self, config: SchedulerConfig) -> None:
        tp_info = config.tp_info
        recv, send = self._recv_msg_single_rank, self._reply_tokenizer_rank0
        if tp_info.is_primary():
            self._recv_from_tokenizer = self._keep(
                ZmqPullQueue(config.zmq_backend_addr, create=True, decoder=BaseBackendMsg.decoder)
            )
            for addr in config.backend_tcp_addrs:  # tokenizers on node 0 (this replica is elsewhere)
                self._recv_from_tokenizer.socket.connect(addr)
            self._send_into_tokenizer = self._keep(
                ZmqPushQueue(
                    config.zmq_detokenizer_addr,
                    create=config.backend_create_detokenizer_link,
                    encoder=BaseTokenizerMsg.encoder,
                    send_timeout_s=PEER_SEND_TIMEOUT_S,  # a dead detokenizer must not hang this rank
                )
            )
        if tp_info.size > 1:
            if tp_info.is_primary():
                recv = self._recv_msg_multi_rank0
                self._send_into_ranks = self._keep(
                    ZmqPubQueue(self._broadcast_addr(config), create=True, encoder=BaseBackendMsg.encoder)
                )
                if config.broadcast_over_tcp:
                    self._share_endpoint(self._send_into_ranks.socket.getsockopt_string(zmq.LAST_ENDPOINT))
                # Until every other rank has subscribed, a broadcast could be dropped for one of them,
                # which would then wait forever for it: wait for all subscriptions, with a deadline.
                try:
                    self._send_into_ranks.wait_for_subscribers(
                        tp_info.size - 1, timeout=self.subscriber_timeout_s
                    )
                except TimeoutError as e:
                    raise TimeoutError(f"scheduler rank 0: not every rank subscribed: {e}") from None
            else:
                recv, send = self._recv_msg_multi_rank1, self._reply_tokenizer_rank1
                addr = (
                    self._share_endpoint("")
                    if config.broadcast_over_tcp
                    else config.zmq_scheduler_broadcast_addr
                )
                self._recv_from_rank0 = self._keep(
                    ZmqSubQueue(addr, create=False, decoder=BaseBackendMsg.decoder)
                )
        self.receive_msg = recv
        self.send_result = send

    @staticmethod
    def _broadcast_addr(config: SchedulerConfig) -> str:
        """ipc on one machine; a group spanning machines: tcp on this machine's address facing node 0
        (a port the OS picks; the other ranks learn it from `_share_endpoint`)."""
        if not config.broadcast_over_tcp:
            return config.zmq_scheduler_broadcast_addr
        from minisgl.utils.host import ip_facing

        host = config.dist_init_addr.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        ip = ip_facing(host)
        return f"tcp://[{ip}]:*" if ":" in ip else f"tcp://{ip}:*"

    def _share_endpoint(self, endpoint: str) -> str:
        """Rank 0's broadcast endpoint to every rank, over the gloo group (bytes in a tensor: no pickle)."""
        import torch.distributed as dist

        buf = torch.zeros(256, dtype=torch.uint8)
        raw = endpoint.encode()
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.tp_cpu_group)
        return bytes(buf.tolist()).rstrip(b"\0").decode()

    def _keep(self, queue: Queue) -> Queue:
        self._io_queues.append(queue)
        return queue

    # -- hooks of the subclass ---------------------------------------------------------------------
    def run_when_idle(self) -> None:
        """Called before blocking for messages (e.g. a KV-pool integrity check)."""

    def offline_receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        raise NotImplementedError("offline mode needs the subclass's offline_receive_msg")

    def offline_send_result(self, reply: list[BaseTokenizerMsg]) -> None:
        raise NotImplementedError("offline mode needs the subclass's offline_send_result")

    def interrupt_sends(self) -> None:
        """The process is stopping: sends stop waiting for peers (thread-safe; e.g. a SIGTERM watch)."""
        for q in getattr(self, "_io_queues", []):
            if hasattr(q, "interrupt"):
                q.interrupt()

    def stop_io(self) -> None:
        """Close every socket this mixin opened (linger 0: never hangs). Safe to call twice."""
        queues, self._io_queues = getattr(self, "_io_queues", []), []
        for q in queues:
            try:
                q.stop()
            except Exception:
                logger.exception("closing %s", getattr(q, "addr", q))

    # -- receiving ---------------------------------------------------------------------------------
    def _recv_msg_offline(self, blocking: bool = False) -> list[BaseBackendMsg]:
        return unbatch(self.offline_receive_msg(blocking))

    def _decode_or_drop(self, raw: bytes) -> BaseBackendMsg | None:
        try:
            return self._recv_from_tokenizer.decode(raw)
        except MessageDecodeError as e:
            logger.warning("dropped a malformed message from the tokenizer (%d bytes): %s", len(raw), e)
            return None

    def _get_first_valid(self) -> tuple[bytes, BaseBackendMsg]:
        """Block until a message that decodes arrives (malformed ones are logged and dropped)."""
        while True:
            raw = self._recv_from_tokenizer.get_raw()
            msg = self._decode_or_drop(raw)
            if msg is not None:
                return raw, msg

    def _drain_valid(self) -> tuple[list[bytes], list[BaseBackendMsg]]:
        """What has already arrived, without waiting; only messages that decode."""
        raws: list[bytes] = []
        msgs: list[BaseBackendMsg] = []
        queue = self._recv_from_tokenizer
        while not queue.empty():
            raw = queue.get_raw()
            msg = self._decode_or_drop(raw)
            if msg is not None:
                raws.append(raw)
                msgs.append(msg)
        return raws, msgs

    def _recv_msg_single_rank(self, blocking: bool = False) -> list[BaseBackendMsg]:
        msgs: list[BaseBackendMsg] = []
        if blocking:  # no work: wait for the first message
            self.run_when_idle()
            msgs.append(self._get_first_valid()[1])
        msgs += self._drain_valid()[1]  # then take what has arrived, without waiting
        return unbatch(msgs)

    def _recv_msg_multi_rank0(self, blocking: bool = False) -> list[BaseBackendMsg]:
        import torch.distributed as dist

        msgs: list[BaseBackendMsg] = []
        if blocking:
            self.run_when_idle()
            raw, msg = self._get_first_valid()
            self._send_into_ranks.put_raw(raw)  # forwarded at once: the other ranks wait for it
            msgs.append(msg)
        raws, drained = self._drain_valid()
        count = torch.tensor(len(raws), dtype=torch.int64)
        dist.broadcast(count, src=0, group=self.tp_cpu_group)  # how many the other ranks must take
        for raw in raws:
            self._send_into_ranks.put_raw(raw)  # the same bytes: no re-encoding, no drift
        return unbatch(msgs + drained)

    def _recv_msg_multi_rank1(self, blocking: bool = False) -> list[BaseBackendMsg]:
        import torch.distributed as dist

        msgs: list[BaseBackendMsg] = []
        if blocking:
            self.run_when_idle()
            msgs += self._get_from_rank0()
        count = torch.tensor(-1, dtype=torch.int64)
        dist.broadcast(count, src=0, group=self.tp_cpu_group)
        for _ in range(int(count)):
            msgs += self._get_from_rank0()
        return unbatch(msgs)

    def _get_from_rank0(self) -> list[BaseBackendMsg]:
        raw = self._recv_from_rank0.get_raw()
        try:
            return [self._recv_from_rank0.decode(raw)]
        except MessageDecodeError as e:  # rank 0 decoded these very bytes: only version skew gets here
            logger.error("dropped a forwarded message rank 0 could decode but this rank cannot: %s", e)
            return []

    # -- replying ----------------------------------------------------------------------------------
    def _reply_tokenizer_rank0(self, reply: list[BaseTokenizerMsg]) -> None:
        if reply:
            self._send_into_tokenizer.put(one_or_batch(list(reply), BatchTokenizerMsg))

    def _reply_tokenizer_rank1(self, reply: list[BaseTokenizerMsg]) -> None:
        """Other ranks sampled the same tokens: rank 0's reply is enough."""
