"""`minisgl serve`: start every process, serve HTTP, supervise, stop cleanly.

    launcher (this process): FastAPI on uvicorn + the FrontendManager's ZMQ pipes
      ├── scheduler rank 0 .. tp-1        (minisgl.scheduler.run_scheduler)
      └── tokenizer+detokenizer           (--num-tokenizer 0), or
          tokenizer-0 .. N-1 + detokenizer (--num-tokenizer N)

Start-up: the model is resolved once here (a GGUF is converted once), the HTTP port is bound
(so /health answers 503 "starting" at once), then all children start together. The schedulers'
ready report gives the context length and vocabulary size, which are handed to the tokenizer
workers before they report ready. A child that fails, dies or is silent past --startup-timeout
stops the start-up with a message naming it.

Serving: /health is 200. If any child dies, /health turns 503, in-flight requests finish with
"abort", and the server exits (code 1). SIGINT/SIGTERM stop it the same way (code 0). On every exit
all children are stopped (SIGTERM, then SIGKILL) and the private ipc directory is removed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from minisgl.message import BaseFrontendMsg, BaseTokenizerMsg
from minisgl.tokenizer.server import TokenizerWorkerConfig, run_tokenizer_worker
from minisgl.utils.handshake import send_status
from minisgl.utils.logger import init_logger

from .api_server import ServerState, create_app
from .args import ServerArgs
from .frontend import FrontendManager
from .metrics import ServerMetrics
from .processes import Child, ProcessGroup, StartupError

logger = init_logger("minisgl.launcher")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def bind_http(host: str, port: int) -> socket.socket:
    """Bind the HTTP port before anything starts, so a busy port is a clear, early error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class Launcher:
    """One server's processes, pipes and HTTP front end."""

    def __init__(self, args: ServerArgs, model_dir: Path) -> None:
        from . import configs

        self.args = args
        self.model_dir = model_dir
        self.device = resolve_device(args.device)
        self.sched_configs = configs.build(args, model_dir, self.device)
        self.addrs = configs.addresses(self.sched_configs[0])
        self.group = ProcessGroup()
        self.stop_requested = False
        self.exit_code = 0

    # ---- children --------------------------------------------------------------------------------

    def _spawn_schedulers(self) -> list[Child]:
        from minisgl.scheduler import run_scheduler

        size = len(self.sched_configs)
        return [
            self.group.spawn(
                f"scheduler rank {c.tp_info.rank}" if size > 1 else "scheduler", run_scheduler, c
            )
            for c in self.sched_configs
        ]

    def _worker_configs(self) -> list[TokenizerWorkerConfig]:
        common = dict(
            model_path=str(self.model_dir),
            tokenizer_addr=self.addrs.tokenizer,
            detokenizer_addr=self.addrs.detokenizer,
            backend_addr=self.addrs.backend,
            frontend_addr=self.addrs.frontend,
        )
        n = self.args.num_tokenizer
        if n == 0:
            return [TokenizerWorkerConfig(role="both", **common)]
        workers = [TokenizerWorkerConfig(role="tokenizer", index=i, **common) for i in range(n)]
        return [*workers, TokenizerWorkerConfig(role="detokenizer", **common)]

    def _spawn_workers(self) -> list[Child]:
        return [self.group.spawn(c.name, run_tokenizer_worker, c) for c in self._worker_configs()]

    async def start_children(self) -> dict[str, Any]:
        """Start everything; return scheduler rank 0's info once every child is ready."""
        schedulers = self._spawn_schedulers()
        workers = self._spawn_workers()
        timeout = self.args.startup_timeout
        await self.group.wait_ready(schedulers, timeout, lambda: self.stop_requested)
        info = schedulers[0].info
        limits = {"max_seq_len": int(info["max_seq_len"]), "vocab_size": int(info["vocab_size"])}
        for w in workers:
            try:
                send_status(w.conn, "start", limits)
            except (BrokenPipeError, OSError):
                raise StartupError(f"{w.name} {w.describe_exit()} during start-up") from None
        await self.group.wait_ready(workers, timeout, lambda: self.stop_requested)
        return info

    # ---- serving ---------------------------------------------------------------------------------

    async def run(self, sock: socket.socket) -> int:
        import uvicorn

        from minisgl.utils import ZmqAsyncPullQueue, ZmqAsyncPushQueue

        to_tokenizer = ZmqAsyncPushQueue(self.addrs.tokenizer, create=True, encoder=BaseTokenizerMsg.encoder)
        from_workers = ZmqAsyncPullQueue(self.addrs.frontend, create=True, decoder=BaseFrontendMsg.decoder)
        manager = FrontendManager(to_tokenizer.put, ServerMetrics(), self.args.max_queued_requests)
        manager.start(from_workers.get)
        aliases = {str(self.model_dir)} | ({self.args.model} if self.args.model else set())
        state = ServerState(
            manager,
            self.args.model_name,
            aliases,
            max_request_bytes=self.args.max_request_bytes,
            tokenize_timeout=self.args.tokenize_timeout,
        )
        config = uvicorn.Config(
            create_app(state),
            access_log=self.args.log_level == "debug",
            timeout_graceful_shutdown=3,
            lifespan="off",
        )
        server = uvicorn.Server(config)
        self._install_signal_handlers(server)
        serve_task = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
        try:
            await self._start_up(state, serve_task)
            if state.status == "serving":
                await self._supervise(state, manager, server, serve_task)
        finally:
            state.status = "stopping"
            manager.finish_all("abort")
            server.should_exit = True
            await asyncio.wait({serve_task}, timeout=5)
            await manager.stop()
            to_tokenizer.stop()
            from_workers.stop()
        return self.exit_code

    async def _start_up(self, state: ServerState, serve_task: asyncio.Task) -> None:
        start = asyncio.create_task(self.start_children())
        done, _ = await asyncio.wait({start, serve_task}, return_when=asyncio.FIRST_COMPLETED)
        if start not in done:  # stopped (a signal) during start-up
            self.stop_requested = True
            await asyncio.wait({start})
            if not start.cancelled() and start.exception() is None:
                return
        try:
            info = start.result()
        except StartupError as e:
            if not self.stop_requested:
                print(f"minisgl: start-up failed: {e}", file=sys.stderr, flush=True)
                self.exit_code = 1
            state.status = "unhealthy"
            state.detail = str(e)
            return
        if self.stop_requested or serve_task.done():
            return
        state.max_seq_len = int(info["max_seq_len"])
        state.status = "serving"
        print(
            f"minisgl: serving {self.args.model_name!r} at {self.args.url} "
            f"(OpenAI-compatible API at {self.args.url}/v1, device {self.device})",
            flush=True,
        )

    async def _supervise(
        self, state: ServerState, manager: FrontendManager, server: Any, serve_task: asyncio.Task
    ) -> None:
        while not serve_task.done():
            dead = self.group.first_dead()
            if dead is not None:
                msg = f"{dead.name} {dead.describe_exit()}; shutting the server down"
                print(f"minisgl: {msg}", file=sys.stderr, flush=True)
                state.status, state.detail = "unhealthy", msg
                manager.finish_all("abort")
                self.exit_code = 1
                await asyncio.wait({serve_task}, timeout=self.args.unhealthy_grace)
                server.should_exit = True
                return
            await asyncio.wait({serve_task}, timeout=0.2)

    def _install_signal_handlers(self, server: Any) -> None:
        """Our handlers stay in place after uvicorn restores them and re-raises what it caught."""

        def on_signal(signum: int, _frame: Any) -> None:
            self.stop_requested = True
            server.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    def shutdown(self) -> None:
        from . import configs

        self.group.shutdown()
        configs.cleanup(self.sched_configs[0])


def _configure_logging(level: str) -> None:
    """The launcher and (through the environment) every child log at `level` to stderr."""
    os.environ["MINISGL_LOG_LEVEL"] = level.upper()
    init_logger("minisgl").setLevel(level.upper())


def serve(args: ServerArgs) -> int:
    """Run a server until it is stopped; return the process exit code."""
    _configure_logging(args.log_level)
    from minisgl.models import resolve_model_path

    try:
        needs_weights = args.engine == "model" and not args.dummy_weights
        model_dir = resolve_model_path(args.model, require_weights=needs_weights)
    except Exception as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 2
    try:
        sock = bind_http(args.host, args.port)
    except StartupError as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 2
    launcher = Launcher(args, model_dir)
    try:
        return asyncio.run(launcher.run(sock))
    finally:
        launcher.shutdown()
        sock.close()
