"""EngineOptions: what one rank's engine is built from, validated once when constructed.

The first link of the configuration chain: `SchedulerConfig` (minisgl.scheduler.config) extends it
with the scheduler's fields, and `minisgl serve`'s `ServerArgs` derives the scheduler configs. Here
too: turning "auto" into a device and a dtype. Importing it needs no torch (the API server builds
the scheduler configs and stays free of it): `dtype` is held by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.backends import BACKENDS
from minisgl.distributed import DistributedInfo
from minisgl.utils.options import check_choices, option

if TYPE_CHECKING:
    import torch

ENGINES = ("model", "dummy")
TASKS = ("generate", "embed")
QUANTIZATIONS = (None, "fp8", "fp8_lm_head")  # see minisgl.checkpoint.fp8
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model's dtype
DTYPES = ("float32", "float16", "bfloat16")  # the activations' dtypes, by their torch names


@dataclass(frozen=True)
class EngineOptions:
    """Each option's default and help are written once, here (`option`); `minisgl serve --help`
    shows them from here."""

    # An engine can be built around a model in hand (tests do), so these three have defaults here;
    # SchedulerConfig, which loads the model, declares them again without.
    model_path: str = ""
    tp_info: DistributedInfo = DistributedInfo(0, 1)
    dtype: str | torch.dtype = "float32"  # a torch.dtype is kept by its name (see `torch_dtype`)
    device: str = "cpu"
    native_weights: bool = option(
        False,
        "the CPU's default (`dtype` auto): matrices stay in the checkpoint's format (GGUF blocks, 16-bit "
        "floats) and the KV pool is float16, activations in `dtype`; off: everything in `dtype`",
    )
    engine: str = option(
        "model",
        "model: load the weights and run the model; dummy: a scheduler that emits tokens without a "
        "model (measures the serving layers)",
        choices=ENGINES,
    )
    task: str = option(
        "generate",
        "generate: text generation (and embeddings of the model's hidden states); embed: an embedding "
        "model (e.g. Qwen3-Embedding): loaded without its LM head, it serves only /v1/embeddings",
        choices=TASKS,
    )
    dummy_weights: bool = option(False, "random weights of the model's shape (no weight file is read)")
    dummy_step_ms: float = option(
        0.0, "with `engine` dummy: sleep this long in every step, standing in for a model's step time"
    )
    page_size: int = option(16, "tokens per KV page")
    num_pages: int | None = option(
        None,
        "KV cache size in pages",
        unset="from `kv_cache_memory`, else a fraction of free GPU memory (on the CPU 1 GiB, at most "
        "a quarter of free RAM)",
    )
    kv_cache_memory: int | None = option(None, "KV cache size in bytes", unset="see `num_pages`")
    gpu_memory_fraction: float = option(0.85, "share of free GPU memory for the KV cache when unsized")
    max_running_requests: int = option(256, "requests decoded together at most")
    max_seq_len: int | None = option(
        None, "context length (prompt + output) per request", unset="the model's"
    )
    seed: int = option(42, "sampling seed of requests that give none")
    attention_backend: str = option(
        "auto",
        "auto: triton on CUDA, the C kernels on the CPU; torch: the plain reference",
        choices=ATTENTION_BACKENDS,
    )
    ops_backend: str = option(
        "auto", "the linear/norm/rotary ops: auto picks by device; torch: the reference", choices=BACKENDS
    )
    cuda_graph_max_bs: int = option(
        256, "decode batches up to this size replay CUDA graphs captured at start; 0: none"
    )
    quantization: str | None = option(
        None,
        "fp8: quantize a 16/32-bit checkpoint's projections to fp8 as it loads (one scale per output "
        "channel, activations per token); fp8 checkpoints (quantization_config) load as published "
        "without it; fp8_lm_head: the same and the LM head too (per vocab row; opt-in, see docs)",
        unset="none",
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's dtype (auto: the model's); fp8_e4m3 halves its bytes, with K/V scales from the "
        "checkpoint where it has them, else 1.0",
        choices=KV_CACHE_DTYPES,
    )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activations' dtype (`dtype`) as a torch.dtype."""
        import torch

        return getattr(torch, str(self.dtype))

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's dtype: fp8 with `kv_cache_dtype` fp8_e4m3; float16 with native weights on the
        CPU (half of float32); else `dtype`."""
        import torch

        if self.kv_cache_dtype == "fp8_e4m3":
            return torch.float8_e4m3fn
        return torch.float16 if self.native_weights and self.device == "cpu" else self.torch_dtype

    def __post_init__(self) -> None:
        """Raise TypeError or ValueError naming the first bad field."""
        if not isinstance(self.tp_info, DistributedInfo):
            raise TypeError(f"tp_info must be a DistributedInfo, got {type(self.tp_info).__name__}")
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        check_choices(self)
        if self.native_weights and self.device != "cpu":
            raise ValueError(f"native_weights runs on the CPU, not on {self.device}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be fp8, fp8_lm_head or None, got {self.quantization!r}")
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


def _dtype_name(dtype: object) -> str:
    """A torch.dtype or its name -> the name ("float32"); TypeError for anything else."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    is_dtype = isinstance(dtype, str) or type(dtype).__name__ == "dtype"
    if not is_dtype or name not in DTYPES:
        raise TypeError(f"dtype must be a torch.dtype or one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU build ("2.5.1+cpu"), read without importing torch."""
    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return False


def resolve_device(device: str) -> str:
    """ "auto": cuda when a GPU is present, else cpu; anything else as given, once it is usable (a
    ValueError says why CUDA is not). A CPU build of torch is told without importing it."""
    if device == "cpu" or (device == "auto" and _cpu_only_torch()):
        return "cpu"
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: {_why_no_cuda()}")
    return device


def _why_no_cuda() -> str:
    import torch

    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU build; `make TORCH=torch setup` installs pip's "
            "default build instead, which has CUDA on Linux"
        )
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU (CUDA_VISIBLE_DEVICES, driver?)"
    )


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> str:
    """ "auto" (or None): float32 on the CPU (the activations; see `resolve_native` for the weights),
    bfloat16 on a GPU; else the named dtype (a torch.dtype gives its name)."""
    if dtype is None or dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {sorted(DTYPES)})")
    return _dtype_name(dtype)


def resolve_native(dtype: str | torch.dtype | None, device: str) -> bool:
    """Whether the weights keep their checkpoint's format: on the CPU when no dtype is named (auto)."""
    return device == "cpu" and (dtype is None or dtype == "auto")
