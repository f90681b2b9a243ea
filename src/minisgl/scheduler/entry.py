"""The scheduler process's entry point (started by the launcher, one per tensor-parallel rank).

Importing it needs no torch: the launcher names `run_scheduler` as its children's target."""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from minisgl.utils.handshake import send_status
from minisgl.utils.signals import dump_stacks_on_signal

from .config import SchedulerConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .scheduler import Scheduler

logger = logging.getLogger(__name__)

_KEEP_ALIVE: list[socket.socket] = []


def init_distributed(config: SchedulerConfig) -> ProcessGroup | None:
    """Join the tensor-parallel group when there is more than one rank; return the CPU (gloo) group.

    Tensors travel on the default group (NCCL between GPUs, gloo on the CPU); the scheduler's small
    control messages (message counts) always go over a gloo group.
    """
    from minisgl.distributed import init_process_groups

    tp = config.tp_info
    on_gpu = str(config.device).startswith("cuda")
    if on_gpu:  # this rank's GPU on its machine (replicas and ranks of one machine take one each)
        import torch

        torch.cuda.set_device(config.device_index)
    if tp.size == 1:
        return None
    return init_process_groups(
        tp,
        config.dist_init_addr,
        backend="nccl" if on_gpu else "gloo",
        store_prefix=config.dist_store_prefix or None,
    )


def run_scheduler(config: SchedulerConfig, ready_conn: Connection) -> None:
    """Build the scheduler, report ("ready", info) or ("error", why) on `ready_conn`, then serve until
    an ExitMsg or SIGTERM."""
    from .scheduler import Scheduler

    try:
        group = init_distributed(config)
        scheduler = Scheduler(config, group)
    except Exception as e:
        logger.exception("scheduler rank %d failed to start", config.tp_info.rank)
        send_status(ready_conn, "error", f"{type(e).__name__}: {e}")
        return
    rank = config.tp_info.rank
    try:
        _exit_on_sigterm(config, scheduler)
        dump_stacks_on_signal()
        on_round = _progress_beat(config)
        info = scheduler.info()
        send_status(ready_conn, "ready", info)
        logger.info("scheduler rank %d ready: %s", rank, info)
        scheduler.run_forever(on_round)
        logger.info("scheduler rank %d: stopping", rank)
    except KeyboardInterrupt:
        logger.info("scheduler rank %d: interrupted", rank)
    finally:
        scheduler.stop_io()
        from minisgl.distributed import destroy_process_groups

        destroy_process_groups()


def _progress_beat(config: SchedulerConfig) -> Callable[[bool], None] | None:
    """What tells the launcher's watchdog that this rank's loop came round (None: no launcher)."""
    if config.progress_slot < 0:
        return None
    from minisgl.utils.progress import ProgressBeat, ProgressBoard

    return ProgressBeat(ProgressBoard.open(config.ipc_dir), config.progress_slot).beat


def _exit_on_sigterm(config: SchedulerConfig, scheduler: Scheduler) -> None:
    """Turn SIGTERM into an ExitMsg sent to rank 0's own input.

    A Python signal handler only runs in the main thread between bytecodes, so it cannot wake a
    main thread blocked in a ZMQ receive (and the signal may land on another thread). Instead the
    C-level handler writes to a wakeup fd that a small thread watches; that thread pushes an ExitMsg
    into rank 0's backend queue. Rank 0 forwards it to every rank like any message, so all ranks
    leave their loop in the same round and close their sockets. The thread first tells the
    scheduler's sends to stop waiting: a send to a detokenizer that already exited would otherwise
    wait for it (up to its timeout) before the loop could read the ExitMsg.
    """
    import threading

    from minisgl.message import BaseBackendMsg, ExitMsg
    from minisgl.utils import ZmqPushQueue

    reader, writer = socket.socketpair()
    writer.setblocking(False)
    _KEEP_ALIVE.extend((reader, writer))  # the fds must outlive this function
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # replaces "terminate at once"
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            data = reader.recv(64)
            if not data:
                return
            if signal.SIGTERM in data:
                logger.info(
                    "scheduler rank %d: SIGTERM, asking the scheduler loop to exit", config.tp_info.rank
                )
                scheduler.interrupt_sends()  # first: the loop must not wait in a send to read the exit
                push = ZmqPushQueue(config.zmq_backend_addr, create=False, encoder=BaseBackendMsg.encoder)
                try:
                    push.put(ExitMsg())
                finally:
                    push.stop(linger_ms=2000)  # a fresh connect may not be up yet: let it deliver
                return

    threading.Thread(target=watch, name="sigterm-watch", daemon=True).start()
