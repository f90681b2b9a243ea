"""The scheduler process's entry point (started by the launcher, one per tensor-parallel rank)."""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch

logger = logging.getLogger(__name__)


def init_distributed(config: Any) -> Any:
    """Join the tensor-parallel group when there is more than one rank; return the CPU (gloo) group.

    Tensors travel on the default group (NCCL between GPUs, gloo on the CPU); the scheduler's small
    control messages (message counts) always go over a gloo group.
    """
    from minisgl.distributed import init_process_groups, set_tp_info

    tp = config.tp_info
    set_tp_info(tp)
    if tp.size == 1:
        return None
    on_gpu = str(config.device).startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(tp.rank)
    return init_process_groups(tp, config.dist_init_addr, backend="nccl" if on_gpu else "gloo")


def run_scheduler(config: Any, ready_conn: Any) -> None:
    """Build the scheduler, report ("ready", info) or ("error", why) on `ready_conn`, then serve until
    an ExitMsg or SIGTERM."""
    from .scheduler import Scheduler

    try:
        group = init_distributed(config)
        scheduler = Scheduler(config, group)
    except Exception as e:
        logger.exception("scheduler rank %d failed to start", config.tp_info.rank)
        ready_conn.send(("error", f"{type(e).__name__}: {e}"))
        return

    def _on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _on_sigterm)
    ready_conn.send(("ready", scheduler.info()))
    logger.info("scheduler rank %d ready: %s", config.tp_info.rank, scheduler.info())
    try:
        scheduler.run_forever()
    except (SystemExit, KeyboardInterrupt):
        logger.info("scheduler rank %d: stopping", config.tp_info.rank)
    finally:
        _close_sockets(scheduler)
        from minisgl.distributed import destroy_process_groups

        destroy_process_groups()


def _close_sockets(scheduler: Any) -> None:
    """Stop every ZMQ queue the IO mixin opened (it names them `_send_*` / `_recv_*`)."""
    stop = getattr(scheduler, "stop_io", None)
    if callable(stop):
        stop()
        return
    for name, value in vars(scheduler).items():
        if name.startswith(("_send_", "_recv_")) and hasattr(value, "stop"):
            try:
                value.stop()
            except Exception:
                logger.exception("closing %s", name)
