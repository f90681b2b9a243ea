"""The tokenizer / detokenizer worker process.

Roles (the launcher picks them from --num-tokenizer):
  - "tokenizer": pulls TokenizeMsg/AbortMsg from the API server; pushes UserMsg/AbortBackendMsg to
    scheduler rank 0 and, to the API server, an acknowledgement `UserReply("", finished=False,
    prompt_tokens=n)` or a rejection `UserReply("", finished=True, finish_reason="error", error=...)`.
    Several of these share the API server's PUSH socket, which deals requests round robin.
  - "detokenizer": pulls DetokenizeMsg/ErrorMsg from the scheduler; pushes UserReply text deltas,
    each with the request's completion token count so far, to the API server.
  - "both" (--num-tokenizer 0): one process does both, pulling from the two pipes.

Data parallelism (--dp M): a TokenizeMsg / AbortMsg names its replica; the tokenizer sends the
UserMsg / AbortBackendMsg to that replica's rank 0, and the detokenizer pulls from every replica and
forwards their LoadMsg as LoadReply to the API server (the router's input).

Every socket of a worker connects (the API server and the scheduler bind), so workers may start in
any order; the one exception is a replica on another machine (--nnodes): its links are `tcp://`
endpoints on node 0, which the worker binds and the remote scheduler connects to. A message that does not decode, or a request that cannot be served, is logged or
answered and dropped; the worker never dies of bad input.

Start-up handshake on the multiprocessing Connection: the worker loads its tokenizer and builds the
tables that need no limits (`WorkerTables`: the length bound, the detokenizer's byte tables; about
0.3 s that overlap the scheduler's start-up), then waits for ("start", ModelLimits fields as a dict) from the launcher (who learns them from the scheduler's
ready report), answers ("ready", {"name": ...}) and serves until SIGTERM. A failure before that is
reported as ("error", message).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Literal, TypeVar

import zmq

from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BaseBackendMsg,
    BaseFrontendMsg,
    BaseTokenizerMsg,
    BatchBackendMsg,
    BatchFrontendMsg,
    DetokenizeMsg,
    ErrorMsg,
    LoadMsg,
    LoadReply,
    ReplyReasoning,
    TokenizeMsg,
    UserReply,
    UserReplyExtra,
)
from minisgl.utils.batch import one_or_batch, unbatch
from minisgl.utils.handshake import recv_status, send_status
from minisgl.utils.host import release_free_memory
from minisgl.utils.logger import init_logger
from minisgl.utils.signals import raise_exit

from .detokenize import DetokenizeManager
from .length_bound import LengthBound
from .reasoning import ReasoningFormat
from .tokenize import MAX_CHOICES, ModelLimits, RequestRejected, TokenizeManager

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from minisgl.utils import ZmqPushQueue

logger = init_logger("minisgl.tokenizer")

M = TypeVar("M", BaseFrontendMsg, BaseBackendMsg)  # what a worker sends: to the API server, or to a scheduler

Role = Literal["tokenizer", "detokenizer", "both"]


@dataclass(frozen=True)
class TokenizerWorkerConfig:
    """Where one worker reads and writes. All addresses are connected to, never bound."""

    model_path: str
    role: Role
    tokenizer_addr: str  # API server -> tokenizers (PUSH binds there)
    detokenizer_addr: str  # scheduler rank 0 -> detokenizer (PUSH binds there)
    backend_addr: str  # -> scheduler rank 0 (PULL binds there)
    frontend_addr: str  # -> API server (PULL binds there)
    index: int = 0
    max_batch: int = 256
    reasoning_parser: str = "auto"  # --reasoning-parser (see reasoning.py)
    # --dp: replicas 1..M-1's rank-0 input and reply pipes (backend_addr / detokenizer_addr are
    # replica 0's); tcp:// ones (a replica on another machine) are bound here rather than connected.
    more_backend_addrs: tuple[str, ...] = ()
    more_detokenizer_addrs: tuple[str, ...] = ()

    @property
    def backend_addrs(self) -> tuple[str, ...]:
        """Every replica's input, by replica index."""
        return (self.backend_addr, *self.more_backend_addrs)

    @property
    def detokenizer_addrs(self) -> tuple[str, ...]:
        """Every replica's reply pipe (one tcp endpoint may serve several remote replicas)."""
        return tuple(dict.fromkeys((self.detokenizer_addr, *self.more_detokenizer_addrs)))

    @property
    def name(self) -> str:
        if self.role == "both":
            return "tokenizer+detokenizer"
        return f"tokenizer-{self.index}" if self.role == "tokenizer" else "detokenizer"

    @property
    def tokenizes(self) -> bool:
        return self.role in ("tokenizer", "both")

    @property
    def detokenizes(self) -> bool:
        return self.role in ("detokenizer", "both")


@dataclass
class WorkerTables:
    """What a worker derives from its tokenizer alone, built before the model's limits are known."""

    bound: LengthBound | None  # the tokenizer's length bound (tokenizing role)
    reasoning: ReasoningFormat | None
    detokenize: DetokenizeManager | None  # (detokenizing role)

    @classmethod
    def of(cls, config: TokenizerWorkerConfig, tokenizer: PreTrainedTokenizerBase) -> WorkerTables:
        tokenizes = config.tokenizes
        return cls(
            LengthBound.of(tokenizer) if tokenizes else None,
            ReasoningFormat.of(tokenizer, config.reasoning_parser) if tokenizes else None,
            DetokenizeManager(tokenizer) if config.detokenizes else None,
        )


class TokenizerWorker:
    """The worker's state and loop; built inside the child process."""

    def __init__(
        self,
        config: TokenizerWorkerConfig,
        tokenizer: PreTrainedTokenizerBase,
        limits: ModelLimits,
        tables: WorkerTables | None = None,
    ) -> None:
        from minisgl.utils import ZmqPullQueue, ZmqPushQueue
        from minisgl.utils.mp import PEER_SEND_TIMEOUT_S as timeout

        self.config = config
        tables = tables or WorkerTables.of(config, tokenizer)
        self.tokenize = (
            TokenizeManager(tokenizer, limits, tables.reasoning, bound=tables.bound)
            if config.tokenizes
            else None
        )
        self.detokenize = tables.detokenize
        self.pulls = []
        if config.tokenizes:
            self.pulls.append(
                ZmqPullQueue(config.tokenizer_addr, create=False, decoder=BaseTokenizerMsg.decoder)
            )
        if config.detokenizes:
            self.pulls.extend(
                ZmqPullQueue(addr, create=_binds(addr), decoder=BaseTokenizerMsg.decoder)
                for addr in config.detokenizer_addrs
            )
        # Timed sends: a peer that died must not hang this worker (what is dropped is logged once).
        self.to_frontend: ZmqPushQueue[BaseFrontendMsg] = ZmqPushQueue(
            config.frontend_addr, create=False, encoder=BaseFrontendMsg.encoder, send_timeout_s=timeout
        )
        self.to_backends: list[ZmqPushQueue[BaseBackendMsg]] = (
            [
                ZmqPushQueue(
                    addr, create=_binds(addr), encoder=BaseBackendMsg.encoder, send_timeout_s=timeout
                )
                for addr in config.backend_addrs
            ]
            if config.tokenizes
            else []
        )
        self.poller = zmq.Poller()
        for q in self.pulls:
            self.poller.register(q.socket, zmq.POLLIN)

    def close(self) -> None:
        for q in [*self.pulls, self.to_frontend, *self.to_backends]:
            q.stop()

    def receive(self) -> list[BaseTokenizerMsg]:
        """Block until something arrives, then take up to max_batch messages without waiting."""
        msgs: list[BaseTokenizerMsg] = []
        while not msgs:
            self.poller.poll()
            for q in self.pulls:
                while len(msgs) < self.config.max_batch and not q.empty():
                    try:
                        msgs.extend(unbatch([q.get()]))
                    except Exception as e:  # a malformed message: log it and go on
                        logger.warning("%s: dropped a malformed message: %s", self.config.name, e)
        return msgs

    def handle(self, msgs: list[BaseTokenizerMsg]) -> None:
        to_frontend: list[BaseFrontendMsg] = []
        to_backend: list[list[BaseBackendMsg]] = [[] for _ in self.to_backends]  # per replica
        for msg in msgs:
            if isinstance(msg, TokenizeMsg) and self.tokenize is not None:
                to_frontend.extend(self._tokenize(msg, to_backend))
            elif isinstance(msg, AbortMsg) and self.tokenize is not None:
                if self._has_replica(msg.replica):
                    to_backend[msg.replica].append(AbortBackendMsg(uid=msg.uid))
            elif isinstance(msg, DetokenizeMsg) and self.detokenize is not None:
                to_frontend.append(self._detokenize(msg))
            elif isinstance(msg, ErrorMsg) and self.detokenize is not None:
                to_frontend.append(self.detokenize.reject(msg))
            elif isinstance(msg, LoadMsg) and self.detokenize is not None:
                to_frontend.append(LoadReply(msg.replica, msg.running, msg.waiting))
            else:
                logger.warning("%s: dropped an unexpected %s", self.config.name, type(msg).__name__)
        # Acknowledgements go out before the requests reach the scheduler, so the API server sees a
        # request's prompt token count before its first token.
        if to_frontend:
            self._send(self.to_frontend, to_frontend, BatchFrontendMsg)
        for queue, batch in zip(self.to_backends, to_backend, strict=True):
            if batch:
                self._send(queue, batch, BatchBackendMsg)

    def _has_replica(self, replica: int) -> bool:
        if 0 <= replica < len(self.to_backends):
            return True
        logger.warning(
            "%s: dropped a message for replica %d (there are %d)",
            self.config.name,
            replica,
            len(self.to_backends),
        )
        return False

    def _send(self, queue: ZmqPushQueue[M], msgs: list[M], batch_cls: type[M]) -> None:
        """Send `msgs` as one batch; if that cannot be encoded (e.g. a uid from a malformed message
        beyond what msgpack holds), send each alone and drop, logged, only those that fail."""
        try:
            queue.put(one_or_batch(msgs, batch_cls))
            return
        except (ValueError, TypeError, OverflowError) as e:
            if len(msgs) == 1:
                logger.warning(
                    "%s: dropped a %s that cannot be sent: %s", self.config.name, type(msgs[0]).__name__, e
                )
                return
        for m in msgs:
            self._send(queue, [m], batch_cls)

    def _tokenize(self, msg: TokenizeMsg, to_backend: list[list[BaseBackendMsg]]) -> list[UserReply]:
        """One reply per choice: an acknowledgement with the prompt's token count, or the error."""
        assert self.tokenize is not None
        if not 0 <= msg.replica < len(to_backend):
            return self._reject(msg, f"no replica {msg.replica} (there are {len(to_backend)})")
        try:
            user_msgs, reasoning = self.tokenize.prepare_chat(msg)
        except RequestRejected as e:
            return self._reject(msg, str(e))
        except Exception as e:  # a bug or a tokenizer failure must not take the worker down
            logger.exception("%s: cannot tokenize request %d", self.config.name, msg.uid)
            return self._reject(msg, f"cannot tokenize the prompt: {type(e).__name__}: {e}")
        to_backend[msg.replica].extend(user_msgs)
        ids = user_msgs[0].input_ids.tolist() if msg.echo or msg.sampling_params.return_token_ids else []
        echo = self.tokenize.echo_text(msg, ids) if msg.echo else ""
        prompt_ids = ids if msg.sampling_params.return_token_ids else []
        extra = (
            UserReplyExtra(
                prompt_text=echo,
                reasoning=ReplyReasoning(mode=reasoning) if reasoning else None,
                token_ids=prompt_ids,
            )
            if echo or reasoning or prompt_ids
            else None
        )
        return [
            UserReply(
                uid=m.uid, incremental_output="", finished=False, prompt_tokens=len(m.input_ids), extra=extra
            )
            for m in user_msgs
        ]

    @staticmethod
    def _reject(msg: TokenizeMsg, error: str) -> list[UserReply]:
        n = msg.n if 1 <= msg.n <= MAX_CHOICES else 1
        return [
            UserReply(
                uid=msg.uid + i, incremental_output="", finished=True, finish_reason="error", error=error
            )
            for i in range(n)
        ]

    def _detokenize(self, msg: DetokenizeMsg) -> UserReply:
        assert self.detokenize is not None
        try:
            return self.detokenize.detokenize(msg)
        except Exception as e:  # e.g. a token id the tokenizer does not know
            logger.exception("%s: cannot detokenize a token of request %d", self.config.name, msg.uid)
            self.detokenize.states.pop(msg.uid, None)
            return UserReply(
                uid=msg.uid,
                incremental_output="",
                finished=True,
                finish_reason="error",
                error=f"cannot detokenize: {type(e).__name__}: {e}",
            )

    def serve_forever(self) -> None:
        while True:
            self.handle(self.receive())


def _binds(addr: str) -> bool:
    """A worker binds only the tcp endpoints of replicas on other machines (see the module docstring)."""
    return addr.startswith("tcp://")


def run_tokenizer_worker(config: TokenizerWorkerConfig, conn: Connection) -> None:
    """Process entry of one tokenizer / detokenizer worker (see the module docstring)."""
    signal.signal(signal.SIGTERM, raise_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the launcher decides
    worker: TokenizerWorker | None = None
    try:
        from .fast import load_fast_tokenizer  # no transformers tokenizer classes: no torch here

        tokenizer = load_fast_tokenizer(config.model_path)
        tables = WorkerTables.of(config, tokenizer)  # while the scheduler starts
        kind, payload = recv_status(conn)
        if kind != "start":
            raise RuntimeError(f"expected the start message from the launcher, got {kind!r}")
        worker = TokenizerWorker(config, tokenizer, ModelLimits(**payload), tables)
        release_free_memory()  # what reading tokenizer.json left free in the C heap: ~17 MiB of RSS
        send_status(conn, "ready", {"name": config.name})
    except (SystemExit, EOFError):
        return
    except Exception as e:
        logger.exception("%s failed to start", config.name)
        try:
            send_status(conn, "error", f"{config.name}: {type(e).__name__}: {e}")
        except (BrokenPipeError, OSError):
            pass
        return
    try:
        worker.serve_forever()
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the close short
        worker.close()
