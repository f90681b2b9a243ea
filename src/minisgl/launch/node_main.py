"""`minisgl serve --node-rank K` (K > 0): this machine's ranks only, watched together with the others
through node 0's store (`nodes.py`). Exit 0 when node 0 stops cleanly, 1 when any rank or node fails,
also when one of this machine's ranks has work and no progress past --watchdog-timeout
(`watchdog.py`: its stacks are logged here, and node 0 is told)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType

from minisgl.launch import watchdog
from minisgl.launch.args import ServerArgs
from minisgl.launch.processes import ProcessGroup, StartupError
from minisgl.utils.progress import ProgressBoard

_POLL_S = 0.1


class NodeRunner:
    def __init__(self, args: ServerArgs, model_dir: Path) -> None:
        from minisgl.engine.options import resolve_device
        from minisgl.launch import configs
        from minisgl.launch.nodes import NodeLink, TcpPlan

        self.args = args
        self.stop_signal = False
        timeout = args.startup_timeout
        self.link = NodeLink.connect(args, timeout)
        plan = TcpPlan.from_json(self.link.store.get("addrs").decode())  # waits for node 0 to post it
        self.configs = configs.build(args, model_dir, resolve_device(args.device), plan)
        self.group = ProcessGroup(str(self.configs[0].ipc_dir))
        self.watchdog: watchdog.Watchdog | None = None

    def start(self) -> None:
        from minisgl.launch.configs import rank_name
        from minisgl.scheduler import run_scheduler

        board = ProgressBoard.create(self.configs[0].ipc_dir, len(self.configs))
        children = [self.group.spawn(rank_name(c, self.args), run_scheduler, c) for c in self.configs]
        deadline = time.monotonic() + self.args.startup_timeout
        pending = list(children)
        while pending := self.group._still_pending(pending, deadline, self.args.startup_timeout, self._stop):
            self._raise_problem()
            time.sleep(_POLL_S)
        self.link.set(f"node{self.args.node_rank}/ready", "1")
        args = self.args
        self.watchdog = watchdog.watch_schedulers(
            board, children, self.configs, args.stall_timeout, args.watchdog_timeout
        )

    def _stop(self) -> bool:
        return self.stop_signal

    def _raise_problem(self) -> None:
        self.link.beat()
        problem = self.link.problem()
        if problem is not None:
            raise StartupError(problem)

    def supervise(self) -> int:
        """Until a signal, a dead child, or another node's failure or stop; the exit code."""
        while not self.stop_signal:
            dead = self.group.first_dead()
            self.link.beat()
            problem = self.link.problem()
            # Node 0's stop first: a rank of a group spanning the nodes ends when its peers on node 0
            # do, which is no failure once node 0 has said it is stopping.
            if problem is not None and problem.startswith("node 0 stopped"):
                print(f"minisgl: {problem}; stopping this node", file=sys.stderr, flush=True)
                return 0
            if dead is not None:
                return self._fail(f"{dead.name} {dead.describe_exit()}")
            if problem is not None:
                return self._fail(problem, tell=False)
            expired = self._expired()
            if expired is not None:
                return self._fail(expired)
            time.sleep(_POLL_S)
        self.link.set(f"node{self.args.node_rank}/failed", "stopped by a signal")
        return 0

    def _expired(self) -> str | None:
        """A rank past --watchdog-timeout (its stacks logged); stalls only go to this node's log."""
        if self.watchdog is None or not self.watchdog.enabled:
            return None
        _, expired = self.watchdog.poll()
        if not expired:
            return None
        msg = watchdog.give_up(expired, self.args.watchdog_timeout, f"node {self.args.node_rank}: ")
        time.sleep(watchdog.DUMP_WAIT_S)
        return msg

    def _fail(self, why: str, tell: bool = True) -> int:
        where = f"node {self.args.node_rank}"
        print(f"minisgl: {where}: {why}; shutting this node down", file=sys.stderr, flush=True)
        if tell:
            self.link.set(f"node{self.args.node_rank}/failed", why)
        return 1

    def shutdown(self) -> None:
        self.group.shutdown()
        self.configs[0].remove_ipc_dir()


def run_node(args: ServerArgs, model_dir: Path) -> int:
    runner: NodeRunner | None = None

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if runner is not None:
            runner.stop_signal = True

    try:
        runner = NodeRunner(args, model_dir)
    except (RuntimeError, ValueError) as e:  # the store unreachable (DistNetworkError is a RuntimeError)
        print(
            f"minisgl: node {args.node_rank}: cannot join node 0 at {args.dist_init_addr}: {e}",
            file=sys.stderr,
        )
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        runner.start()
        print(f"minisgl: node {args.node_rank}: {len(runner.configs)} rank(s) ready", flush=True)
        return runner.supervise()
    except StartupError as e:
        if runner.stop_signal:
            return 0
        return runner._fail(f"start-up failed: {e}", tell="node " not in str(e))
    except RuntimeError as e:  # the store is gone: node 0 died
        print(f"minisgl: node {args.node_rank}: lost node 0 ({e}); shutting this node down", file=sys.stderr)
        return 1
    finally:
        runner.shutdown()
