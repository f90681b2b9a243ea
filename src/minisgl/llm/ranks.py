"""`LLM(model, tp=N)`, N > 1: N scheduler processes and the offline API in the caller's process.

Every rank, rank 0 included, is a child process running the server's own scheduler entry
(`run_scheduler`), so the caller never joins torch.distributed and never waits inside a collective:
it pushes `UserMsg`s to rank 0's input and pulls rank 0's replies, as the tokenizer and detokenizer
of a server do, over ipc sockets in a private directory. While it waits it watches the ranks: one
that dies (or fails to start) raises `RankFailed` naming it, and every rank is stopped.

`close()`, leaving a `with` block, the object being collected, and the interpreter exiting
(a `weakref.finalize`) all stop the ranks; if the caller's process is killed outright, the ranks
notice (the launcher's lifeline, `server/child.py`) and stop on their own. Ranks are started with the
spawn method: a script that creates one needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from minisgl.distributed import DistributedInfo, HostedStore, host_store
from minisgl.engine.options import resolve_device, resolve_dtype, resolve_native
from minisgl.launch.processes import ProcessGroup, StartupError
from minisgl.message import BaseBackendMsg, BaseTokenizerMsg, BatchBackendMsg, MessageDecodeError
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils import ZmqPullQueue, ZmqPushQueue
from minisgl.utils.batch import unbatch
from minisgl.utils.host import find_free_port
from minisgl.utils.logger import init_logger

from .api import OfflineAPI, check_options, pop_hub_options

logger = init_logger(__name__)

_POLL_S = 0.1  # how often a waiting caller looks at the ranks' health


class RankFailed(RuntimeError):
    """A rank of a MultiRankLLM failed to start or died; the message names it. The LLM is closed."""


class MultiRankLLM(OfflineAPI):
    """What `LLM(model, tp=N)` returns for N > 1 (see the module docstring)."""

    def __init__(
        self, model: str | None = None, tp: int = 2, startup_timeout: float = 600.0, **options: Any
    ) -> None:
        from minisgl.models import resolve_model_path

        self._init_api()
        self.closed = True
        device = resolve_device(str(options.pop("device", "auto")))
        native = resolve_native(options.get("dtype"), device)
        dtype = resolve_dtype(options.pop("dtype", None), device)
        hub = pop_hub_options(options)
        model_dir = resolve_model_path(
            model, require_weights=not options.get("dummy_weights", False), hub=hub
        )
        check_options(options)
        self._load_text(model_dir)
        self._store = host_store("127.0.0.1", find_free_port())
        rank0 = SchedulerConfig(
            model_path=str(model_dir),
            tp_info=DistributedInfo(0, tp),
            dtype=dtype,
            native_weights=native,
            device=device,
            dist_init_addr=f"tcp://127.0.0.1:{self._store.sock.getsockname()[1]}",
            dist_store_prefix="llm/",
            **options,
        )
        self.config = rank0
        self._group = ProcessGroup(str(rank0.ipc_dir))
        self._queues: list[ZmqPushQueue | ZmqPullQueue] = []
        self._finalizer = weakref.finalize(self, _stop, self._group, self._queues, self._store, rank0)
        self.closed = False
        try:
            self._start(rank0, startup_timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, rank0: SchedulerConfig, timeout: float) -> None:
        from minisgl.scheduler import run_scheduler

        tp = rank0.tp_info.size
        ranks = [
            self._group.spawn(
                f"LLM rank {k}",
                run_scheduler,
                dataclasses.replace(rank0, tp_info=DistributedInfo(k, tp), device_index=k),
            )
            for k in range(tp)
        ]
        # Connect first: rank 0 binds both ends, and a push connected early is delivered once it does.
        self._to_rank0: ZmqPushQueue = ZmqPushQueue(
            rank0.zmq_backend_addr, create=False, encoder=BaseBackendMsg.encoder
        )
        self._queues.append(self._to_rank0)
        self._from_rank0: ZmqPullQueue = ZmqPullQueue(
            rank0.zmq_detokenizer_addr, create=False, decoder=BaseTokenizerMsg.decoder
        )
        self._queues.append(self._from_rank0)
        try:
            self._group.wait_ready_blocking(ranks, timeout)
        except StartupError as e:
            raise RankFailed(str(e)) from None
        info = ranks[0].info
        self.max_seq_len = int(info["max_seq_len"])
        self.vocab_size = int(info["vocab_size"])
        self.eos_ids = frozenset(int(t) for t in info["eos_token_ids"])
        self.pids = [r.process.pid for r in ranks]

    # -- OfflineAPI ------------------------------------------------------------------------------------
    def _submit(self, msgs: list[BaseBackendMsg]) -> None:
        self._check_open()
        self._to_rank0.put(msgs[0] if len(msgs) == 1 else BatchBackendMsg(data=msgs))

    def _advance(self) -> None:
        """Take what rank 0 sent (waiting up to _POLL_S for something); between waits, check the ranks."""
        self._check_open()
        if not self._from_rank0.poll(_POLL_S):
            self._check_ranks()
            return
        while not self._from_rank0.empty():
            try:
                msgs = unbatch([self._from_rank0.get()])
            except MessageDecodeError as e:  # only version skew could get here
                logger.error("dropped a reply of rank 0 that does not decode: %s", e)
                continue
            for msg in msgs:
                self._record(msg)

    def _abandon(self, uids: list[int]) -> None:
        if not self.closed:
            super()._abandon(uids)

    def _check_ranks(self) -> None:
        dead = self._group.first_dead()
        if dead is not None:
            self.close()
            raise RankFailed(f"{dead.name} {dead.describe_exit()}; every rank of this LLM is stopped")

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM is closed")

    def close(self) -> None:
        """Stop every rank (SIGTERM: they leave their loop together; SIGKILL after 5 s)."""
        self.closed = True
        self._finalizer()


def _stop(
    group: ProcessGroup,
    queues: list[ZmqPushQueue | ZmqPullQueue],
    store: HostedStore,
    config: SchedulerConfig,
) -> None:
    """Everything `close()` and the finalizer release; refers to no MultiRankLLM (a finalizer must not)."""
    for q in queues:
        q.stop()
    group.shutdown()
    store.close()
    config.remove_ipc_dir()
