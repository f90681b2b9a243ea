"""From `minisgl serve` options to one `SchedulerConfig` per tensor-parallel rank.

Every option the scheduler takes is validated by SchedulerConfig itself (and EngineOptions below
it), once; `ServerArgs.check` derives a config to report a bad one by its flag. Every process of the
server takes its pipe addresses from these configs (`zmq_*_addr`, one private ipc directory).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisgl.launch.args import ServerArgs

if TYPE_CHECKING:
    from minisgl.launch.nodes import TcpPlan
    from minisgl.scheduler.config import SchedulerConfig

# The prefill budget (prompt tokens per scheduler step) when --max-prefill-tokens is not given, on the
# CPU. A step cannot be interrupted, so it is how long an abort or a new request may have to wait:
# 256 tokens keep a prefill step of the embedded model on a small CPU short (a chunk at the end of a
# long prompt, whose attention spans the whole prefix, takes longer). GPUs keep SchedulerConfig's.
CPU_MAX_PREFILL_TOKENS = 256
# The options that default differently on the CPU when left unset (--help shows both defaults).
CPU_DEFAULTS = {"max_prefill_tokens": CPU_MAX_PREFILL_TOKENS}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1e3,
    "KB": 1e3,
    "KIB": 2**10,
    "M": 1e6,
    "MB": 1e6,
    "MIB": 2**20,
    "G": 1e9,
    "GB": 1e9,
    "GIB": 2**30,
    "T": 1e12,
    "TB": 1e12,
    "TIB": 2**40,
}


def parse_size(text: str, option: str = "--kv-cache-memory") -> int:
    """'512MiB', '2GiB', '1.5GB', '1000000' -> bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"{option}: cannot read {text!r} as a size (e.g. 512MiB, 2GiB)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{option} must be positive, got {text!r}")
    return size


def format_size(size: int) -> str:
    """Bytes as `parse_size` reads them back: 8388608 -> '8MiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def scheduler_config(args: ServerArgs, model_dir: Path, device: str) -> SchedulerConfig:
    """Rank 0's config. The options left unset (None) keep SchedulerConfig's defaults, but for
    CPU_DEFAULTS on the CPU; the engine's options pass through under their own names."""
    from minisgl.distributed import DistributedInfo
    from minisgl.engine.options import resolve_dtype, resolve_native
    from minisgl.scheduler.config import SchedulerConfig

    options: dict[str, Any] = dict(CPU_DEFAULTS) if device == "cpu" else {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.metadata.get("config") and value is not None:
            options[f.name] = value
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = parse_size(args.kv_cache_memory)
    if args.disable_overlap:
        options["overlap_schedule"] = False
    return SchedulerConfig(
        model_path=str(model_dir),
        tp_info=DistributedInfo(0, args.tp),
        dtype=resolve_dtype(args.dtype, device),
        native_weights=resolve_native(args.dtype, device),
        device=device,
        **options,
    )


def build(
    args: ServerArgs, model_dir: Path, device: str, plan: TcpPlan | None = None
) -> list[SchedulerConfig]:
    """One SchedulerConfig per rank of every replica on this machine (replica-major), sharing one
    ipc suffix (hence one directory); on one machine each replica's ranks meet on their own
    torch.distributed rendezvous, on several (`plan`) on node 0's store (`nodes.py`). Rank i of
    this machine reports its progress in slot i of the machine's progress board."""
    from minisgl.utils.host import find_free_port

    base = dataclasses.replace(scheduler_config(args, model_dir, device), report_load=True)
    if plan is not None:
        from minisgl.launch.nodes import node_configs

        configs = node_configs(base, args, plan)
    else:
        configs = []
        for replica in range(args.dp):
            addr = f"tcp://127.0.0.1:{find_free_port()}" if args.tp > 1 else ""
            configs += replica_configs(dataclasses.replace(base, replica=replica, dist_init_addr=addr), args)
    return [dataclasses.replace(c, progress_slot=i) for i, c in enumerate(configs)]


def replica_configs(base: SchedulerConfig, args: ServerArgs) -> list[SchedulerConfig]:
    """The tp ranks of `base.replica`; each rank's GPU is its global rank's place on its machine."""
    from minisgl.distributed import DistributedInfo

    first = base.replica * args.tp
    return [
        dataclasses.replace(
            base, tp_info=DistributedInfo(k, args.tp), device_index=(first + k) % args.ranks_per_node
        )
        for k in range(args.tp)
    ]


def rank_name(config: SchedulerConfig, args: ServerArgs) -> str:
    """How the launcher names a scheduler process in its messages."""
    name = "scheduler"
    if args.dp > 1:
        name += f" replica {config.replica}"
    if args.tp > 1:
        name += f" rank {config.tp_info.rank}"
    return name
