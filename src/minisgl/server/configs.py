"""From `minisgl serve` options to one `SchedulerConfig` per tensor-parallel rank, and the pipe
addresses every process of the server derives from them (all in one private ipc directory)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .args import ServerArgs

# The prefill budget (prompt tokens per scheduler step) when --max-prefill-tokens is not given, on the
# CPU. A step cannot be interrupted, so it is how long an abort or a new request may have to wait:
# SmolLM2-135M float32 prefills about 500 tokens/s on the 2-core test box when it is otherwise idle,
# so 256 tokens keep a step near half a second (a chunk at the end of an 8k-token prompt, whose
# attention spans the whole prefix, near a second). GPUs keep SchedulerConfig's default (4096).
CPU_MAX_PREFILL_TOKENS = 256

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


@dataclass(frozen=True)
class Addresses:
    """Every pipe of one server."""

    tokenizer: str  # API server PUSH (binds) -> tokenizers PULL
    frontend: str  # tokenizers / detokenizer PUSH -> API server PULL (binds)
    backend: str  # tokenizers PUSH -> scheduler rank 0 PULL (binds)
    detokenizer: str  # scheduler rank 0 PUSH (binds) -> detokenizer PULL


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


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_dtype(dtype: str, device: str) -> Any:
    import torch

    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def build(args: ServerArgs, model_dir: Path, device: str) -> list[Any]:
    """One SchedulerConfig per rank, sharing one ipc suffix (hence one directory)."""
    import dataclasses

    from minisgl.distributed import DistributedInfo
    from minisgl.scheduler.config import SchedulerConfig

    options: dict[str, Any] = {
        k: getattr(args, k)
        for k in (
            "max_running_requests",
            "max_prefill_tokens",
            "num_pages",
            "page_size",
            "max_seq_len",
            "cuda_graph_max_bs",
        )
        if getattr(args, k) is not None
    }
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = parse_size(args.kv_cache_memory)
    if args.max_prefill_tokens is None and device == "cpu":
        options["max_prefill_tokens"] = CPU_MAX_PREFILL_TOKENS
    rank0 = SchedulerConfig(
        model_path=str(model_dir),
        tp_info=DistributedInfo(0, args.tp),
        dtype=resolve_dtype(args.dtype, device),
        device=device,
        engine=args.engine,
        dummy_weights=args.dummy_weights,
        dummy_step_ms=args.dummy_step_ms,
        seed=args.seed,
        attention_backend=args.attention_backend,
        overlap_schedule=False if args.disable_overlap else None,
        cache_type=args.cache_type,
        dist_init_addr=f"tcp://127.0.0.1:{free_tcp_port()}" if args.tp > 1 else "",
        **options,
    )
    return [dataclasses.replace(rank0, tp_info=DistributedInfo(r, args.tp)) for r in range(args.tp)]


def addresses(config: Any) -> Addresses:
    return Addresses(
        tokenizer=config.zmq_tokenizer_addr,
        frontend=config.zmq_frontend_addr,
        backend=config.zmq_backend_addr,
        detokenizer=config.zmq_detokenizer_addr,
    )


def cleanup(config: Any) -> None:
    config.remove_ipc_dir()
