"""`minisgl serve` options: the `ServerArgs` dataclass and its argparse parser."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_PORT = 1919
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServerArgs:
    """Everything the launcher needs. `None` means "the scheduler decides" (from the model, the
    memory, or SchedulerConfig's default: each default is written once, there)."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    device: str = "auto"
    tp: int = 1
    dp: int = 1  # data-parallel replicas, each of `tp` ranks, behind this one API server
    nnodes: int = 1  # machines the dp * tp ranks are spread over (contiguously, by node rank)
    node_rank: int = 0  # this machine's place; node 0 runs the API server, tokenizer and detokenizer
    dist_init_addr: str | None = None  # HOST:PORT on node 0 (--nnodes > 1): every node meets there
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    num_tokenizer: int = 0
    max_running_requests: int | None = None
    max_prefill_tokens: int | None = None
    num_pages: int | None = None
    kv_cache_memory: str | None = None
    page_size: int | None = None
    max_seq_len: int | None = None
    max_queued_requests: int | None = None
    max_request_bytes: int = 8 * 2**20  # HTTP bodies over this get 413
    tokenize_timeout: float = 60.0  # how long a request waits for the tokenizer's verdict
    engine: str = "model"
    dummy_weights: bool = False
    dummy_step_ms: float = 0.0
    served_model_name: str | None = None
    tool_call_parser: str = (
        "auto"  # how tool calls are recognised: auto (from the chat template), hermes, llama3_json
    )
    seed: int | None = None
    attention_backend: str = "auto"
    cuda_graph_max_bs: int | None = None
    disable_overlap: bool = False
    cache_type: str = "radix"
    log_level: str = "info"
    startup_timeout: float = 600.0
    # SIGTERM/SIGINT: how long requests in flight may finish before they are aborted. 8 s fits in
    # `docker stop`'s default 10 s grace with room for the processes to stop; raise it together with
    # the orchestrator's (docker stop -t, terminationGracePeriodSeconds, systemd's TimeoutStopSec).
    shutdown_timeout: float = 8.0
    unhealthy_grace: float = 1.0  # how long /health reports 503 after a worker died, before exiting
    # A scheduler rank with work and no loop round for this long: /health 503 "stalled" (0: off) ...
    stall_timeout: float = 60.0
    # ... and for this long: its stacks are logged and the server exits 1 (0: off; SGLang's default).
    watchdog_timeout: float = 300.0
    request_timeout: float | None = None  # seconds from arrival to finish_reason "abort" (None: none)
    max_connections: int | None = None  # None: the open-file limit less 64; 0: no cap
    read_timeout: float = 30.0  # for a request's headers, and again for its body

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model is not None else EMBEDDED_MODEL_NAME

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def check(self) -> None:
        """Raise ValueError naming the first bad option by its flag. The options the scheduler takes
        are checked where they are defined, by deriving the scheduler's config (no model is read)."""
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.dp < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp}")
        self._check_nodes()
        if self.num_tokenizer < 0:
            raise ValueError(f"--num-tokenizer must be >= 0, got {self.num_tokenizer}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.startup_timeout <= 0:
            raise ValueError("--startup-timeout must be > 0")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if not self.tokenize_timeout > 0:
            raise ValueError(f"--tokenize-timeout must be > 0, got {self.tokenize_timeout}")
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json"):
            raise ValueError(
                f"--tool-call-parser must be auto, hermes or llama3_json, got {self.tool_call_parser!r}"
            )
        if not self.shutdown_timeout >= 0:  # also refuses NaN
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        self._check_limits()
        from minisgl.launch.configs import scheduler_config
        from minisgl.scheduler.config import SchedulerConfig

        try:
            scheduler_config(self, Path(self.model or ""), "cpu")
        except ValueError as e:  # name the fields as flags: "max_seq_len" -> "--max-seq-len"
            names = {f.name for f in fields(SchedulerConfig)}
            flags = re.sub(
                r"\b[a-z_]+\b", lambda m: _flag(m.group()) if m.group() in names else m.group(), str(e)
            )
            raise ValueError(flags) from None

    def _check_limits(self) -> None:
        for flag, value in (
            ("--stall-timeout", self.stall_timeout),
            ("--watchdog-timeout", self.watchdog_timeout),
        ):
            if not 0 <= value < float("inf"):
                raise ValueError(f"{flag} must be >= 0 (0: off), got {value}")
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout}")
        if self.max_connections is not None and self.max_connections < 0:
            raise ValueError(f"--max-connections must be >= 0 (0: no cap), got {self.max_connections}")
        if not 0 < self.read_timeout < float("inf"):
            raise ValueError(f"--read-timeout must be > 0, got {self.read_timeout}")

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if (self.dp * self.tp) % self.nnodes:
            raise ValueError(
                f"--dp x --tp ({self.dp * self.tp} ranks) must divide evenly over --nnodes {self.nnodes}"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (an address of node 0)")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr)

    @property
    def ranks_per_node(self) -> int:
        return self.dp * self.tp // self.nnodes


def split_host_port(addr: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); ValueError naming --dist-init-addr otherwise."""
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must look like HOST:PORT, got {addr!r}")
    return host, int(port)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        help="a Hugging Face model directory or a .gguf file (default: the embedded "
        f"{EMBEDDED_MODEL_NAME}); nothing is downloaded",
    )
    g.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model as given)")
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights and activations (auto: bfloat16 on GPU, float32 on CPU)",
    )
    g.add_argument(
        "--quantization",
        choices=["fp8"],
        help="fp8: quantize a 16/32-bit checkpoint's projections to fp8 as it loads (one scale per "
        "output channel, activations per token); fp8 checkpoints (quantization_config) load as "
        "published without it",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=["auto", "fp8_e4m3"],
        help="the KV cache's dtype (auto: the model's); fp8_e4m3 halves its bytes, with K/V scales "
        "from the checkpoint where it has them, else 1.0",
    )
    g.add_argument(
        "--tool-call-parser",
        default=d.tool_call_parser,
        choices=["auto", "hermes", "llama3_json"],
        help="the format of the model's tool calls (auto: from the chat template; hermes for a template "
        "without tool support, whose tools then go into a system prompt)",
    )
    g.add_argument(
        "--engine",
        default=d.engine,
        choices=["model", "dummy"],
        help="dummy: a scheduler that emits tokens without running a model (measures the serving layers)",
    )
    g.add_argument(
        "--dummy-engine", dest="engine", action="store_const", const="dummy", help="same as --engine dummy"
    )
    g.add_argument(
        "--dummy-weights", action="store_true", help="random weights instead of loading the checkpoint"
    )
    g.add_argument(
        "--dummy-step-ms",
        type=float,
        default=d.dummy_step_ms,
        help="--engine dummy: sleep this long in every step, standing in for a model's step time "
        "(default %(default)s: as fast as the host goes)",
    )

    g = p.add_argument_group("server")
    g.add_argument(
        "--host", default=d.host, help="HTTP bind address (default %(default)s: this machine only)"
    )
    g.add_argument("--port", type=int, default=d.port, help="HTTP port (default %(default)s)")
    g.add_argument(
        "--num-tokenizer",
        type=int,
        default=d.num_tokenizer,
        metavar="N",
        help="tokenizer processes; 0 = one process tokenizes and detokenizes (default)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        metavar="N",
        help="requests in flight beyond which new ones get 503 (default: unlimited)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=_size,
        default=d.max_request_bytes,
        metavar="SIZE",
        help="largest HTTP request body, e.g. 8MiB or 1000000; larger ones get 413 (default 8MiB)",
    )
    g.add_argument(
        "--tokenize-timeout",
        type=float,
        default=d.tokenize_timeout,
        metavar="SECONDS",
        help="how long a request waits for the tokenizer's verdict before a 503 (default %(default)s)",
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        default=d.startup_timeout,
        metavar="SECONDS",
        help="how long each process may take to report ready (default %(default)s)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests in flight may finish before they are aborted "
        "(default %(default)s: fits docker stop's 10 s grace; a second signal aborts at once)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        metavar="SECONDS",
        help='a request still running this long after it arrived ends with finish_reason "abort" '
        "(the text so far is kept) and is dropped by the scheduler (default: no deadline)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="HTTP connections open at once (idle keep-alive ones count); a request on one more gets "
        "503 and its connection is closed, GET /health is still answered (default: the open-file "
        "limit less 64; 0: no cap)",
    )
    g.add_argument(
        "--read-timeout",
        type=float,
        default=d.read_timeout,
        metavar="SECONDS",
        help="a client must send a request's headers within this long, and then its body within as "
        "long again, or its connection is closed (default %(default)s; idle keep-alive: uvicorn's 5 s)",
    )
    g.add_argument(
        "--stall-timeout",
        type=float,
        default=d.stall_timeout,
        metavar="SECONDS",
        help='/health says 503 "stalled", naming the rank, while a scheduler rank with work has not '
        "come round its loop for this long (default %(default)s; 0: off)",
    )
    g.add_argument(
        "--watchdog-timeout",
        type=float,
        default=d.watchdog_timeout,
        metavar="SECONDS",
        help="a scheduler rank with work that has not come round its loop for this long has its "
        'threads\' stacks logged, requests in flight end with "abort" and the server exits 1 '
        "(default %(default)s; 0: off)",
    )
    g.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])

    g = p.add_argument_group("engine")
    g.add_argument(
        "--device",
        default=d.device,
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda when a GPU is present, else cpu",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=d.tp,
        metavar="N",
        help="tensor-parallel ranks (one scheduler process each; gloo on CPU)",
    )
    g.add_argument(
        "--dp",
        type=int,
        default=d.dp,
        metavar="M",
        help="data-parallel replicas of the engine (each of --tp ranks) behind one API server; each request "
        "goes to the replica with the fewest running + waiting requests",
    )

    g = p.add_argument_group("several machines")
    g.add_argument(
        "--nnodes", type=int, default=d.nnodes, metavar="N", help="machines the --dp x --tp ranks run on"
    )
    g.add_argument(
        "--node-rank",
        type=int,
        default=d.node_rank,
        metavar="K",
        help="this machine's index; node 0 serves HTTP and runs the tokenizer and detokenizer, it and "
        "every other node run ranks K x (dp x tp / nnodes) onwards",
    )
    g.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        help="an address of node 0 that every node can reach; node 0 binds it (and its other tcp "
        "endpoints) on HOST only, the others connect",
    )
    g.add_argument("--max-running-requests", type=int, metavar="N", help="requests decoded together at most")
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        metavar="N",
        help="prompt tokens per prefill step at most; a step is what an abort or a new request may "
        "wait for (default: 256 on the CPU, about half a second for the embedded model; 4096 on a GPU)",
    )
    g.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        help="context length (prompt + output) per request (default: the model's)",
    )
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-pages", type=int, metavar="N", help="KV cache size in pages")
    kv.add_argument("--kv-cache-memory", metavar="SIZE", help="KV cache size in memory, e.g. 512MiB or 2GiB")
    g.add_argument("--page-size", type=int, metavar="N", help="tokens per KV page")
    g.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=["auto", "torch", "cpu", "triton"],
        help="auto: triton on CUDA, the C kernels on the CPU; torch: the plain reference",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        metavar="N",
        help="decode batches up to N replay CUDA graphs captured at start (default 256; 0: off)",
    )
    g.add_argument(
        "--disable-overlap",
        action="store_true",
        help="wait for each step's tokens before preparing the next (overlap is on by default on a GPU)",
    )
    g.add_argument(
        "--cache-type",
        default=d.cache_type,
        choices=["radix", "naive"],
        help="prefix cache: radix reuses the KV of cached prompt prefixes (shared system prompts, chat "
        "history); naive prefills every prompt whole (default %(default)s)",
    )
    g.add_argument(
        "--seed", type=int, help="sampling seed of requests that give none (default: EngineOptions.seed)"
    )


def _size(text: str) -> int:
    from minisgl.launch.configs import parse_size

    try:
        return parse_size(text, "--max-request-bytes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    known = {f.name for f in fields(ServerArgs)}
    values = {k: v for k, v in vars(ns).items() if k in known}
    args = ServerArgs(**values)
    args.check()
    return args
