"""EngineOptions: what one rank's engine is built from, validated once when constructed.

The first link of the configuration chain: `SchedulerConfig` (minisgl.scheduler.config) extends it
with the scheduler's fields, and `minisgl serve`'s `ServerArgs` derives the scheduler configs. Here
too: turning "auto" into a device and a dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.distributed import DistributedInfo

ENGINES = ("model", "dummy")
QUANTIZATIONS = (None, "fp8")  # see minisgl.models.quant
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model's dtype
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineOptions:
    # An engine can be built around a model in hand (tests do), so these three have defaults here;
    # SchedulerConfig, which loads the model, declares them again without.
    model_path: str = ""
    tp_info: DistributedInfo = DistributedInfo(0, 1)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    engine: str = "model"  # "model": load the weights; "dummy": no model (tests, IO demos)
    dummy_weights: bool = False  # random weights of the model's shape (no weight files read)
    dummy_step_ms: float = 0.0  # the dummy engine sleeps this long per step (a model's step time)
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # KV pool size; None: from kv_cache_memory or gpu_memory_fraction
    kv_cache_memory: int | None = None  # bytes for the KV pool
    gpu_memory_fraction: float = 0.85
    max_running_requests: int = 256
    max_seq_len: int | None = None  # None: the model's context length
    seed: int = 42  # the engine's sampling seed for requests that give none
    attention_backend: str = "auto"  # see minisgl.attention.ATTENTION_BACKENDS
    ops_backend: str = "auto"  # see minisgl.backends.BACKENDS
    cuda_graph_max_bs: int = 256  # decode batches up to this size replay CUDA graphs; 0: none
    quantization: str | None = None  # "fp8": quantize a 16/32-bit checkpoint's projections at load
    kv_cache_dtype: str = "auto"  # "fp8_e4m3": the KV pool in fp8 (scales from the checkpoint or 1)

    def __post_init__(self) -> None:
        """Raise TypeError or ValueError naming the first bad field."""
        if not isinstance(self.tp_info, DistributedInfo):
            raise TypeError(f"tp_info must be a DistributedInfo, got {type(self.tp_info).__name__}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be fp8 or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.num_pages is not None and self.kv_cache_memory is not None:
            raise ValueError("num_pages and kv_cache_memory both size the KV pool: give one of them")
        _at_least(self, 1, "page_size", "max_running_requests")
        _at_least(self, 1, "num_pages", "kv_cache_memory", optional=True)
        _at_least(self, 2, "max_seq_len", optional=True)  # a prompt token and an output token
        _at_least(self, 0, "cuda_graph_max_bs")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if not 0.0 <= self.dummy_step_ms <= 60_000.0:
            raise ValueError(f"dummy_step_ms must be in [0, 60000], got {self.dummy_step_ms}")


def _at_least(config: object, low: int, *names: str, optional: bool = False) -> None:
    """Each named field is >= low (or None, when optional)."""
    for name in names:
        value = getattr(config, name)
        if value is None and optional:
            continue
        if value is None or value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def resolve_device(device: str) -> str:
    """ "auto": cuda when a GPU is present, else cpu; anything else as given."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """ "auto" (or None): float32 on the CPU, bfloat16 on a GPU; else the named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {sorted(DTYPES)})")
    return DTYPES[dtype]
