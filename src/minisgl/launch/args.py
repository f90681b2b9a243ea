"""`minisgl serve` options: the `ServerArgs` dataclass and the argparse parser built from its fields.

Every option is written once, as a field. The server's own options (`flag`) carry their default and
help here. The engine's and the scheduler's (`engine_flag`) are None here, "unset": the scheduler
config then keeps its own default, and `--help` shows that default and its help, read from
`SchedulerConfig`'s fields when help is asked for (reading them imports torch, which building the
parser must not: `minisgl --help` and `minisgl chat` start at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisgl.launch import lws
from minisgl.utils.options import check_choices, shown_default

if TYPE_CHECKING:
    from minisgl.models.hub import HubOptions

DEFAULT_PORT = 1919
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"

# The groups of `minisgl serve --help`, in order: what each option configures.
MODEL, ENGINE, SCHEDULER, SERVER, NODES, LOGGING = (
    "model",
    "engine",
    "scheduler",
    "server (HTTP)",
    "several machines",
    "logging",
)
GROUPS = (MODEL, ENGINE, SCHEDULER, SERVER, NODES, LOGGING)


def flag(
    default: Any,
    help: str,
    group: str,
    *,
    unset: str = "",
    exclusive: str = "",
    size: bool = False,
    **argparse_kwargs: Any,
) -> Any:
    """A server option: its default and help, its --help group, and for argparse: whether it is a
    size ("8MiB"), the mutually exclusive set it belongs to, extras (metavar, choices)."""
    meta = {"help": help, "group": group, "unset": unset, "exclusive": exclusive, "size": size}
    meta |= {"choices": tuple(argparse_kwargs.get("choices", ())), "argparse": argparse_kwargs}
    return dataclasses.field(default=default, metadata=meta)


def engine_flag(group: str, *, exclusive: str = "", **argparse_kwargs: Any) -> Any:
    """An option of the scheduler's config (the same name): None keeps that config's default."""
    meta = {"group": group, "config": True, "exclusive": exclusive, "argparse": argparse_kwargs}
    return dataclasses.field(default=None, metadata=meta)


@dataclass(frozen=True)
class ServerArgs:
    """Everything the launcher needs. A field without a group is not a flag."""

    # -- model
    model: str | None = flag(
        None,
        "a Hugging Face model directory, a .gguf file, or a Hugging Face id (ORG/NAME; ORG/NAME:QUANT "
        "for one file of a GGUF repo), taken from the Hugging Face cache or downloaded into it",
        MODEL,
        unset=f"the embedded {EMBEDDED_MODEL_NAME}",
    )
    revision: str | None = flag(
        None, "with a model id: the branch, tag or commit to fetch", MODEL, unset="main", metavar="REV"
    )
    download_dir: str | None = flag(
        None,
        "with a model id: the Hugging Face cache directory to look in and download into",
        MODEL,
        unset="HF_HUB_CACHE, or HF_HOME/hub",
        metavar="DIR",
    )
    gguf_file: str | None = flag(
        None,
        "with the id of a GGUF repo: the file to serve (instead of ORG/NAME:QUANT)",
        MODEL,
        unset="from :QUANT",
        metavar="FILE",
    )
    served_model_name: str | None = flag(
        None, 'the name clients give as "model"', MODEL, unset="--model as given"
    )
    dtype: str = flag(
        "auto",
        "weights and activations (auto: bfloat16 on a GPU; on the CPU float32 activations with the weights "
        "kept in the checkpoint's format, GGUF blocks or 16-bit floats, and a float16 KV cache; float32 on "
        "the CPU: everything in float32, the reference)",
        MODEL,
        choices=("auto", "float32", "float16", "bfloat16"),  # a test holds them to engine.options.DTYPES
    )
    tool_call_parser: str = flag(
        "auto",
        "the format of the model's tool calls (auto: from the chat template; hermes for a template "
        "without tool support, whose tools then go into a system prompt)",
        MODEL,
        choices=("auto", "hermes", "llama3_json"),
    )
    task: str | None = engine_flag(MODEL, metavar="TASK")
    reasoning_parser: str = flag(
        "auto",
        "the format of a reasoning model's thinking, which goes to reasoning_content (auto: from the "
        "chat template and the tokenizer's <think> tokens; none: the thinking stays in the content)",
        MODEL,
        choices=("auto", "qwen3", "deepseek_r1", "none"),
    )
    trust_request_chat_template: bool = flag(
        False,
        "let requests bring their own chat_template (a Jinja program run by the tokenizer worker)",
        MODEL,
    )
    quantization: str | None = engine_flag(MODEL, metavar="METHOD")
    kv_cache_dtype: str | None = engine_flag(MODEL, metavar="DTYPE")
    dummy_weights: bool | None = engine_flag(MODEL)
    # -- engine
    device: str = flag(
        "auto", "auto: cuda when a GPU is present, else cpu", ENGINE, choices=("auto", "cpu", "cuda")
    )
    tp: int = flag(
        1, "tensor-parallel ranks (one scheduler process each; gloo on the CPU)", ENGINE, metavar="N"
    )
    dp: int = flag(
        1,
        "data-parallel replicas of the engine (each of `tp` ranks) behind one API server; each request "
        "goes to the replica with the fewest running + waiting requests",
        ENGINE,
        metavar="M",
    )
    engine: str | None = engine_flag(ENGINE, metavar="NAME")
    dummy_step_ms: float | None = engine_flag(ENGINE, metavar="MS")
    num_pages: int | None = engine_flag(ENGINE, metavar="N", exclusive="kv size")
    kv_cache_memory: str | None = flag(
        None,
        "KV cache size in memory, e.g. 512MiB or 2GiB",
        ENGINE,
        unset="see `num_pages`",
        metavar="SIZE",
        exclusive="kv size",
    )
    page_size: int | None = engine_flag(ENGINE, metavar="N")
    max_seq_len: int | None = engine_flag(ENGINE, metavar="N")
    attention_backend: str | None = engine_flag(ENGINE, metavar="NAME")
    cuda_graph_max_bs: int | None = engine_flag(ENGINE, metavar="N")
    seed: int | None = engine_flag(ENGINE, metavar="N")
    # -- scheduler
    max_running_requests: int | None = engine_flag(SCHEDULER, metavar="N")
    max_prefill_tokens: int | None = engine_flag(SCHEDULER, metavar="N")
    cache_type: str | None = engine_flag(SCHEDULER, metavar="TYPE")
    disable_overlap: bool = flag(
        False, "wait for each step's tokens before preparing the next (overlap is on on a GPU)", SCHEDULER
    )
    # -- server (HTTP)
    host: str = flag("127.0.0.1", "HTTP bind address (127.0.0.1: this machine only)", SERVER)
    port: int = flag(DEFAULT_PORT, "HTTP port", SERVER)
    num_tokenizer: int = flag(
        0, "tokenizer processes; 0: one process tokenizes and detokenizes", SERVER, metavar="N"
    )
    frontend_nice: int | None = flag(
        None,
        "niceness of the HTTP server and tokenizer processes (0-19); on the CPU they then run in the "
        "compute threads' gaps instead of preempting them",
        SERVER,
        unset="19 on the CPU, else 0",
        metavar="N",
    )
    max_queued_requests: int | None = flag(
        None, "requests in flight beyond which new ones get 503", SERVER, unset="unlimited", metavar="N"
    )
    max_request_bytes: int = flag(
        8 * 2**20,
        "largest HTTP request body, e.g. 8MiB or 1000000; larger ones get 413",
        SERVER,
        metavar="SIZE",
        size=True,
    )
    tokenize_timeout: float = flag(
        60.0, "how long a request waits for the tokenizer's verdict before a 503", SERVER, metavar="SECONDS"
    )
    startup_timeout: float = flag(
        600.0, "how long each process may take to report ready", SERVER, metavar="SECONDS"
    )
    # 8 s fits in `docker stop`'s default 10 s grace with room for the processes to stop; raise it
    # together with the orchestrator's (docker stop -t, terminationGracePeriodSeconds, TimeoutStopSec).
    shutdown_timeout: float = flag(
        8.0,
        "on SIGTERM/SIGINT, how long requests in flight may finish before they are aborted (the "
        "default fits docker stop's 10 s grace; a second signal aborts at once)",
        SERVER,
        metavar="SECONDS",
    )
    request_timeout: float | None = flag(
        None,
        'a request still running this long after it arrived ends with finish_reason "abort" (the '
        "text so far is kept) and is dropped by the scheduler",
        SERVER,
        unset="no deadline",
        metavar="SECONDS",
    )
    max_connections: int | None = flag(
        None,
        "HTTP connections open at once (idle keep-alive ones count); a request on one more gets 503 "
        "and its connection is closed, GET /health is still answered; 0: no cap",
        SERVER,
        unset="the open-file limit less 64",
        metavar="N",
    )
    read_timeout: float = flag(
        30.0,
        "a client must send a request's headers within this long, and then its body within as long "
        "again, or its connection is closed (idle keep-alive: uvicorn's 5 s)",
        SERVER,
        metavar="SECONDS",
    )
    stall_timeout: float = flag(
        60.0,
        '/health says 503 "stalled", naming the rank, while a scheduler rank with work has not come '
        "round its loop for this long; 0: off",
        SERVER,
        metavar="SECONDS",
    )
    watchdog_timeout: float = flag(
        300.0,
        "a scheduler rank with work that has not come round its loop for this long has its threads' "
        'stacks logged, requests in flight end with "abort" and the server exits 1 (SGLang\'s '
        "default); 0: off",
        SERVER,
        metavar="SECONDS",
    )
    # -- several machines
    nnodes: int = flag(
        1, "machines the `dp` x `tp` ranks run on (contiguously, by node rank)", NODES, metavar="N"
    )
    node_rank: int = flag(
        0,
        "this machine's index; node 0 serves HTTP and runs the tokenizer and detokenizer, node K runs "
        "ranks K x (dp x tp / nnodes) onwards",
        NODES,
        metavar="K",
    )
    dist_init_addr: str | None = flag(
        None,
        "an address of node 0 that every node can reach (needed with `nnodes` > 1); node 0 binds it "
        "(and its other tcp endpoints) on HOST only, the others connect",
        NODES,
        metavar="HOST:PORT",
    )
    # -- logging
    log_level: str = flag(
        "info",
        "the least severe messages logged, by minisgl's processes and by uvicorn (access lines at debug)",
        LOGGING,
        choices=("debug", "info", "warning", "error"),
    )
    # not flags
    unhealthy_grace: float = 1.0  # how long /health reports 503 after a worker died, before exiting

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model is not None else EMBEDDED_MODEL_NAME

    @property
    def hub(self) -> HubOptions:
        """How a model id is fetched (--revision, --download-dir, --gguf-file)."""
        from minisgl.models.hub import HubOptions

        return HubOptions(self.revision, self.download_dir, self.gguf_file)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def check(self) -> None:
        """Raise ValueError naming the first bad option by its flag. The options the scheduler takes
        are checked where they are defined, by deriving the scheduler's config (no model is read)."""
        check_choices(self)
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.dp < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp}")
        self._check_nodes()
        if self.num_tokenizer < 0:
            raise ValueError(f"--num-tokenizer must be >= 0, got {self.num_tokenizer}")
        if self.frontend_nice is not None and not 0 <= self.frontend_nice <= 19:
            raise ValueError(f"--frontend-nice must be in 0..19, got {self.frontend_nice}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.startup_timeout <= 0:
            raise ValueError("--startup-timeout must be > 0")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if not self.tokenize_timeout > 0:
            raise ValueError(f"--tokenize-timeout must be > 0, got {self.tokenize_timeout}")
        if not self.shutdown_timeout >= 0:  # also refuses NaN
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        self._check_limits()
        from minisgl.engine.options import resolve_device
        from minisgl.launch.configs import scheduler_config
        from minisgl.scheduler.config import SchedulerConfig

        try:
            scheduler_config(self, Path(self.model or ""), resolve_device(self.device))
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


# -- the parser ------------------------------------------------------------------------------------


def flag_fields() -> list[dataclasses.Field[Any]]:
    """The ServerArgs fields that are flags, in --help's order within each group."""
    return [f for f in fields(ServerArgs) if "group" in f.metadata]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `minisgl serve`, grouped by what it configures. Give the parser
    `formatter_class=HelpFormatter`, which fills in the engine's options when help is shown."""
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    hints = typing.get_type_hints(ServerArgs)
    for f in flag_fields():
        group: Any = groups[f.metadata["group"]]
        if key := f.metadata["exclusive"]:
            if key not in exclusive:
                exclusive[key] = group.add_mutually_exclusive_group()
            group = exclusive[key]
        group.add_argument(_flag(f.name), **_argparse_kwargs(f, hints[f.name]), **f.metadata["argparse"])
        if f.name == "engine":
            group.add_argument(
                "--dummy-engine",
                dest="engine",
                action="store_const",
                const="dummy",
                help="same as --engine dummy",
            )


def _argparse_kwargs(f: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    """How argparse reads the field: type (from its annotation), default and help."""
    kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    # None: "not given", for the options LeaderWorkerSet's variables may stand in for (lws.py).
    kwargs: dict[str, Any] = {"default": None if f.name in lws.FIELDS else f.default}
    if kind is bool:
        kwargs["action"] = "store_const"
        kwargs["const"] = True
    elif f.metadata.get("size"):
        kwargs["type"] = _size
    else:
        kwargs["type"] = kind
    # An engine option's help is filled in by HelpFormatter (it needs SchedulerConfig, hence torch).
    kwargs["help"] = "" if f.metadata.get("config") else _help_text(f.metadata["help"], _shown(f))
    return kwargs


def _shown(f: dataclasses.Field[Any]) -> str:
    if f.metadata.get("size") and isinstance(f.default, int):
        from minisgl.launch.configs import format_size

        return format_size(f.default)
    return shown_default(f)


def _help_text(help: str, default: str, choices: tuple[str, ...] = ()) -> str:
    """`help` with `name` references as flags, the choices and the default; escaped for argparse."""
    names = {f.name for f in flag_fields()}
    text = f"{help}; one of {', '.join(choices)}" if choices else help
    text = f"{text} (default: {default})"
    return re.sub(r"`([a-z_]+)`", lambda m: _flag(m[1]) if m[1] in names else m[1], text).replace("%", "%%")


def engine_help(name: str) -> str:
    """The --help text of an engine option: the help and default of SchedulerConfig's field `name`."""
    from minisgl.launch.configs import CPU_DEFAULTS
    from minisgl.scheduler.config import SchedulerConfig

    f = next(f for f in fields(SchedulerConfig) if f.name == name)
    default = shown_default(f)
    if name in CPU_DEFAULTS:
        default = f"{CPU_DEFAULTS[name]} on the CPU, {default} on a GPU"
    return _help_text(f.metadata["help"], default, f.metadata.get("choices", ()))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Fills in the help of the engine's options as help is formatted, not when the parser is built."""

    def add_argument(self, action: argparse.Action) -> None:
        if not action.help and action.dest in {f.name for f in flag_fields() if f.metadata.get("config")}:
            action.help = engine_help(action.dest)
        super().add_argument(action)


def _size(text: str) -> int:
    from minisgl.launch.configs import parse_size

    try:
        return parse_size(text, "--max-request-bytes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def args_from_namespace(ns: argparse.Namespace, env: typing.Mapping[str, str] | None = None) -> ServerArgs:
    """The checked ServerArgs of parsed flags; the several-machines options not given are taken from
    LeaderWorkerSet's variables in `env` (os.environ) when set."""
    known = {f.name for f in fields(ServerArgs)}
    values = {k: v for k, v in vars(ns).items() if k in known and k not in lws.FIELDS}
    given = {k: v for k, v in vars(ns).items() if k in lws.FIELDS and v is not None}
    values |= lws.from_env(given, os.environ if env is None else env)
    args = ServerArgs(**values)
    args.check()
    return args
