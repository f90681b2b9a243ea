"""`minisgl serve`: start every process, serve HTTP, supervise, stop cleanly.

    launcher (this process): FastAPI on uvicorn + the FrontendManager's ZMQ pipes
      ├── scheduler rank 0 .. tp-1        (minisgl.scheduler.run_scheduler)
      └── tokenizer+detokenizer           (--num-tokenizer 0), or
          tokenizer-0 .. N-1 + detokenizer (--num-tokenizer N)

Start-up: the model is resolved once here (a GGUF is converted once), the HTTP port is bound
(a busy port fails at once), then all children start together, and this process (torch-free) imports
the HTTP stack while they boot: /health answers 503 "starting" from then on. The schedulers'
ready report gives the context length and vocabulary size, which are handed to the tokenizer
workers before they report ready. A child that fails, dies or is silent past --startup-timeout
stops the start-up with a message naming it.

Serving: /health is 200. If any child dies, /health turns 503, in-flight requests finish with
"abort", and the server exits (code 1). The same when a scheduler rank with work makes no progress
for --watchdog-timeout seconds (its threads' stacks are logged first); /health says 503 "stalled"
while one has made none for --stall-timeout seconds (`watchdog.py`). HTTP connections are bounded
in number and in the time they may take to send a request (`entrypoints/openai/connections.py`).

Stopping: SIGTERM or SIGINT to the launcher (docker stop, systemd, Ctrl-C) drains: /health says 503
"stopping", new requests get 503, requests in flight may finish for up to --shutdown-timeout
seconds, then what remains ends with finish_reason "abort" (streams still end with `data: [DONE]`,
non-streaming clients get their JSON). A second signal aborts at once. Exit code 0, also when the
signal reached the whole process group and the children stopped on their own. On every exit all
children are stopped (SIGTERM, then SIGKILL) and the private ipc directory is removed; if the
launcher itself is killed, the children notice and stop on their own (`child.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from minisgl.launch import watchdog
from minisgl.launch.args import ServerArgs
from minisgl.launch.processes import Child, ProcessGroup, StartupError
from minisgl.models.pooling import read_pooling
from minisgl.tokenizer.server import Role, TokenizerWorkerConfig, run_tokenizer_worker
from minisgl.utils.handshake import send_status
from minisgl.utils.host import keep_to_few_cpus, lower_priority, release_free_memory
from minisgl.utils.logger import init_logger
from minisgl.utils.profiling import maybe_profile
from minisgl.utils.progress import ProgressBoard
from minisgl.utils.signals import raise_exit

if TYPE_CHECKING:
    import uvicorn

    from minisgl.distributed import HostedStore
    from minisgl.entrypoints.openai.state import ServerState
    from minisgl.frontend.manager import FrontendManager
    from minisgl.launch.nodes import NodeLink, TcpPlan
    from minisgl.launch.warm import WarmStart

logger = init_logger("minisgl.launcher")

# --frontend-nice's default on the CPU (docs/benchmarks.md: one stream over HTTP on 2 cores).
FRONTEND_NICE_ON_CPU = 19


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

    def __init__(self, args: ServerArgs, model_dir: Path, warm: WarmStart | None = None) -> None:
        from minisgl.engine.options import resolve_device
        from minisgl.launch import configs

        self.args = args
        self.model_dir = model_dir
        self.warm = warm
        self.device = resolve_device(args.device)
        self.link, self.store, self.plan = _join_nodes(args)
        self.sched_configs = configs.build(args, model_dir, self.device, self.plan)
        self.addrs = self.sched_configs[0]  # every pipe's address: its zmq_*_addr properties
        self.group = ProcessGroup(str(self.sched_configs[0].ipc_dir))  # the last child out removes it
        self.stop_requested = False
        self.abort_now = False  # a second signal: abort what is in flight without waiting
        self.exit_code = 0
        self.detail = ""  # why the server stopped, when it failed (told to the other nodes)
        # The scheduler ranks' progress (utils/progress.py), in the ipc directory the configs made.
        self.board = ProgressBoard.create(self.addrs.ipc_dir, len(self.sched_configs))
        self.schedulers: list[Child] = []
        self.workers: list[Child] = []
        self.give_back_cpus: Callable[[], None] = lambda: None
        self.watchdog: watchdog.Watchdog | None = None  # once every child is ready

    # ---- children --------------------------------------------------------------------------------

    def _spawn_schedulers(self) -> list[Child]:
        from minisgl.launch.configs import rank_name
        from minisgl.scheduler import run_scheduler

        self.schedulers = [
            self.group.spawn(rank_name(c, self.args), run_scheduler, c, warm=self.warm if i == 0 else None)
            for i, c in enumerate(self.sched_configs)
        ]
        return self.schedulers

    def _worker_configs(self) -> list[TokenizerWorkerConfig]:
        rank0s = {c.replica: c for c in self.sched_configs if c.tp_info.is_primary()}  # on this node
        remote = self.plan.backend if self.plan is not None else {}
        detok = [c.zmq_detokenizer_addr for c in rank0s.values()]
        detok += [self.plan.detokenizer] if remote and self.plan is not None else []

        def config(role: Role, index: int = 0) -> TokenizerWorkerConfig:
            backends = [
                remote[r][index] if r in remote else rank0s[r].zmq_backend_addr for r in range(self.args.dp)
            ]
            return TokenizerWorkerConfig(
                model_path=str(self.model_dir),
                role=role,
                tokenizer_addr=self.addrs.zmq_tokenizer_addr,
                detokenizer_addr=detok[0],
                backend_addr=backends[0],
                frontend_addr=self.addrs.zmq_frontend_addr,
                index=index,
                reasoning_parser=self.args.reasoning_parser,
                more_backend_addrs=tuple(backends[1:]),
                more_detokenizer_addrs=tuple(detok[1:]),
            )

        n = self.args.num_tokenizer
        if n == 0:
            return [config("both")]
        return [*(config("tokenizer", i) for i in range(n)), config("detokenizer")]

    def _spawn_workers(self) -> list[Child]:
        return [self.group.spawn(c.name, run_tokenizer_worker, c) for c in self._worker_configs()]

    def spawn_children(self) -> None:
        """Start every child (before the HTTP stack's import, which their start-up overlaps); until
        they are ready this process and the tokenizer workers keep to a CPU each (`keep_to_few_cpus`)."""
        self._spawn_schedulers()
        self.workers = self._spawn_workers()
        self.give_back_cpus = keep_to_few_cpus(self._front_end_pids())

    def _front_end_pids(self) -> list[int]:
        """This process (0) and the tokenizer workers: the processes that serve HTTP, not the model."""
        return [0, *(w.process.pid or 0 for w in self.workers)]

    async def start_children(self) -> dict[str, Any]:
        """Return scheduler rank 0's info once every child (started by `spawn_children`) is ready."""
        schedulers, workers = self.schedulers, self.workers
        timeout = self.args.startup_timeout
        await self.group.wait_ready(schedulers, timeout, lambda: self.stop_requested)
        await self._wait_other_nodes(timeout)
        info = schedulers[0].info
        limits = {"max_seq_len": int(info["max_seq_len"]), "vocab_size": int(info["vocab_size"])}
        for w in workers:
            try:
                send_status(w.conn, "start", limits)
            except (BrokenPipeError, OSError):
                raise StartupError(f"{w.name} {w.describe_exit()} during start-up") from None
        await self.group.wait_ready(workers, timeout, lambda: self.stop_requested)
        return info

    async def _wait_other_nodes(self, timeout: float) -> None:
        """--nnodes: until every other node reported its ranks ready (or one failed)."""
        deadline = time.monotonic() + timeout
        while self.link is not None and not self.link.all_ready():
            problem = self.link.problem()
            if problem is not None:
                raise StartupError(problem)
            if time.monotonic() > deadline:
                raise StartupError(f"not every node reported ready within {timeout:g} s")
            if self.stop_requested:
                raise StartupError("start-up interrupted")
            self.link.beat()
            await asyncio.sleep(0.1)

    def _first_failure(self) -> str | None:
        """A child of this node that died, or a problem another node reported."""
        dead = self.group.first_dead()
        if dead is not None:
            return f"{dead.name} {dead.describe_exit()}"
        if self.link is not None:
            self.link.beat()
            return self.link.problem()
        return None

    # ---- serving ---------------------------------------------------------------------------------

    async def run(self, sock: socket.socket) -> int:
        import uvicorn

        from minisgl.entrypoints.openai.app import create_app
        from minisgl.entrypoints.openai.connections import (
            EveryInterval,
            default_max_connections,
            guarded_h11,
            log_accept_errors,
        )
        from minisgl.entrypoints.openai.state import ServerState
        from minisgl.entrypoints.openai.tools import ToolFormat
        from minisgl.frontend.manager import FrontendManager
        from minisgl.frontend.metrics import ServerMetrics
        from minisgl.frontend.router import ReplicaRouter
        from minisgl.message import BaseFrontendMsg, BaseTokenizerMsg
        from minisgl.utils import ZmqAsyncPullQueue, ZmqAsyncPushQueue
        from minisgl.utils.mp import PEER_SEND_TIMEOUT_S

        to_tokenizer = ZmqAsyncPushQueue(
            self.addrs.zmq_tokenizer_addr,
            create=True,
            encoder=BaseTokenizerMsg.encoder,
            send_timeout_s=PEER_SEND_TIMEOUT_S,
        )
        from_workers = ZmqAsyncPullQueue(
            self.addrs.zmq_frontend_addr, create=True, decoder=BaseFrontendMsg.decoder
        )
        manager = FrontendManager(
            to_tokenizer.put,
            ServerMetrics(),
            self.args.max_queued_requests,
            ReplicaRouter(self.args.dp),
            self.args.request_timeout,
        )
        manager.start(from_workers.get)
        aliases = {str(self.model_dir)} | ({self.args.model} if self.args.model else set())
        state = ServerState(
            manager,
            self.args.model_name,
            aliases,
            max_request_bytes=self.args.max_request_bytes,
            tokenize_timeout=self.args.tokenize_timeout,
            tools=ToolFormat.of(self.model_dir, self.args.tool_call_parser),
            pooling=read_pooling(self.model_dir, strict=False),
            trust_request_chat_template=self.args.trust_request_chat_template,
            root=self.args.model or "",  # the model as named (vLLM's root); else the served name
        )
        max_connections = self.args.max_connections
        log_accept_errors(asyncio.get_running_loop())
        config = uvicorn.Config(
            create_app(state),
            log_level=self.args.log_level,  # uvicorn's own loggers follow --log-level
            http=guarded_h11(
                default_max_connections() if max_connections is None else max_connections,
                self.args.read_timeout,
                EveryInterval(logging.INFO),
            ),
            access_log=self.args.log_level == "debug",
            timeout_graceful_shutdown=3,
            lifespan="off",
        )
        server = _uvicorn_server(config, self.request_stop)
        self._install_signal_handlers()
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
        self.give_back_cpus()
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
                self.exit_code, self.detail = 1, f"start-up failed: {e}"
            state.status = "unhealthy"
            state.detail = str(e)
            return
        if self.stop_requested or serve_task.done():
            return
        state.max_seq_len = int(info["max_seq_len"])
        args = self.args
        self.watchdog = watchdog.watch_schedulers(
            self.board, self.schedulers, self.sched_configs, args.stall_timeout, args.watchdog_timeout
        )
        state.status = "serving"
        self._yield_to_compute()
        release_free_memory()  # start-up's garbage in the C heap, before the first request
        print(
            f"minisgl: serving {self.args.model_name!r} at {self.args.url} "
            f"(OpenAI-compatible API at {self.args.url}/v1, device {self.device})",
            flush=True,
        )

    def _yield_to_compute(self) -> None:
        """On the CPU the engine's OpenMP threads take every core, and a decode step is nearly two
        hundred parallel regions that each wait for their slowest thread: an HTTP server or
        detokenizer that wakes per token and preempts one of them stalls the whole team. Niced (after the
        schedulers started, so they keep their priority), these processes run in the step's
        single-threaded gaps instead; they still get their share when the engine is never idle."""
        nice = self.args.frontend_nice
        if nice is None:
            nice = FRONTEND_NICE_ON_CPU if self.device == "cpu" else 0
        if nice > 0:
            lower_priority(self._front_end_pids(), nice)
            logger.info("HTTP server and tokenizer processes at niceness %d (--frontend-nice)", nice)

    async def _supervise(
        self, state: ServerState, manager: FrontendManager, server: uvicorn.Server, serve_task: asyncio.Task
    ) -> None:
        while not serve_task.done():
            if self.stop_requested:
                await self._drain(state, manager)
                server.should_exit = True
                return
            failure = self._first_failure() or await self._check_progress(state, manager)
            if failure is not None and not self.stop_requested:  # a signal to the whole group: no failure
                msg = f"{failure}; shutting the server down"
                print(f"minisgl: {msg}", file=sys.stderr, flush=True)
                state.status, state.detail = "unhealthy", msg
                manager.finish_all("abort")
                self.exit_code, self.detail = 1, msg
                await asyncio.wait({serve_task}, timeout=self.args.unhealthy_grace)
                server.should_exit = True
                return
            await asyncio.wait({serve_task}, timeout=0.1)

    async def _check_progress(self, state: ServerState, manager: FrontendManager) -> str | None:
        """/health's "stalled"; a failure once a rank is past --watchdog-timeout (stacks logged)."""
        if self.watchdog is None or not self.watchdog.enabled:
            return None
        stalled, expired = self.watchdog.poll(manager.first_accepted_after)
        state.stalled = "; ".join(s.describe() for s in stalled)
        if not expired:
            return None
        msg = watchdog.give_up(expired, self.args.watchdog_timeout)
        await asyncio.sleep(watchdog.DUMP_WAIT_S)
        return msg

    async def _drain(self, state: ServerState, manager: FrontendManager) -> None:
        """Refuse new requests, let those in flight finish (up to --shutdown-timeout), abort the rest,
        and give their handlers a moment to send their last bytes."""
        state.status, state.detail = "stopping", "the server is shutting down"
        timeout = self.args.shutdown_timeout
        if manager.streams:
            print(
                f"minisgl: stopping: waiting up to {timeout:g} s for {len(manager.streams)} request(s) "
                "in flight (signal again to abort them now)",
                file=sys.stderr,
                flush=True,
            )
        deadline = time.monotonic() + timeout
        while manager.streams and time.monotonic() < deadline and not self._must_abort():
            await asyncio.sleep(0.05)
        if manager.streams:
            print(
                f"minisgl: stopping: aborting {len(manager.streams)} request(s)", file=sys.stderr, flush=True
            )
            manager.finish_all("abort")
        deadline = time.monotonic() + _LAST_BYTES_S
        while manager.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def _must_abort(self) -> bool:
        """True when waiting is pointless: a second signal, or a child is gone (it cannot answer)."""
        return self.abort_now or self.group.first_dead() is not None

    def request_stop(self) -> None:
        """A signal handler (main thread): the first SIGTERM/SIGINT drains, a second aborts now."""
        if self.stop_requested:
            self.abort_now = True
        self.stop_requested = True

    def _install_signal_handlers(self) -> None:
        """For the moments uvicorn's capture (see `_uvicorn_server`) is not in place."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda _signum, _frame: self.request_stop())

    def shutdown(self) -> None:
        if self.link is not None:  # tell the other nodes, and give them a moment to read it
            try:
                self.link.set("failed" if self.exit_code else "stop", self.detail or "the server stopped")
            except RuntimeError:
                pass
        self.group.shutdown()
        self.sched_configs[0].remove_ipc_dir()
        if self.store is not None:
            time.sleep(1.0)
            self.store.close()


_LAST_BYTES_S = 2.0  # after the drain, how long handlers get to write their last events


def _uvicorn_server(config: uvicorn.Config, on_signal: Callable[[], None]) -> uvicorn.Server:
    """A uvicorn server whose SIGINT/SIGTERM handler calls `on_signal` instead of stopping at once
    (uvicorn's own handler would cut every stream and answer waiting requests with a plain 500)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:  # noqa: ARG002
            on_signal()

    return DrainingServer(config)


def _join_nodes(args: ServerArgs) -> tuple[NodeLink | None, HostedStore | None, TcpPlan | None]:
    """--nnodes > 1 on node 0: host the store on --dist-init-addr's host only, publish the tcp plan."""
    if args.nnodes == 1:
        return None, None, None
    from minisgl.distributed import host_store
    from minisgl.launch.args import split_host_port
    from minisgl.launch.nodes import NodeLink, make_plan

    host, port = split_host_port(args.dist_init_addr or "")
    try:
        store = host_store(host, port, timeout_s=args.startup_timeout)
    except (OSError, RuntimeError) as e:
        raise StartupError(f"cannot host the rendezvous on {host}:{port} (--dist-init-addr): {e}") from None
    link = NodeLink(store.store, args)
    plan = make_plan(args)
    link.set("addrs", plan.to_json())
    return link, store, plan


def _configure_logging(level: str) -> None:
    """The launcher and (through the environment) every child log at `level` to stderr."""
    os.environ["MINISGL_LOG_LEVEL"] = level.upper()
    init_logger("minisgl").setLevel(level.upper())


def serve(args: ServerArgs, warm: WarmStart | None = None) -> int:
    """Run a server until it is stopped; return the exit code. `warm`: scheduler rank 0's (warm.py)."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # until the launcher installs its own
        signal.signal(sig, raise_exit)  # nothing is running yet that needs draining
    _configure_logging(args.log_level)
    from minisgl.models import resolve_model_path

    try:
        needs_weights = args.engine != "dummy" and not args.dummy_weights
        model_dir = resolve_model_path(args.model, require_weights=needs_weights, hub=args.hub)
    except Exception as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 2
    if args.node_rank > 0:  # ranks only: no HTTP, no tokenizer
        from minisgl.launch.node_main import run_node

        return run_node(args, model_dir)
    try:
        sock = bind_http(args.host, args.port)
    except StartupError as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 2
    try:
        launcher = Launcher(args, model_dir, warm)
    except StartupError as e:
        print(f"minisgl: {e}", file=sys.stderr)
        sock.close()
        return 2
    try:
        launcher.spawn_children()
        with maybe_profile("launcher"):
            return asyncio.run(launcher.run(sock))
    finally:
        launcher.shutdown()
        sock.close()
