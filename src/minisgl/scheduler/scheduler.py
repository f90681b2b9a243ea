"""The scheduler: turns a stream of backend messages into batches for the engine, and tokens into replies.

One loop iteration (`normal_loop`): take the messages that arrived (blocking only when there is no
work), run one batch — a prefill batch if any prefill can run (chunked under `max_prefill_tokens`),
otherwise one decode step of every running request in uid order — and send that step's replies.

Everything is deterministic (no clocks, no set or dict iteration order, no rank-dependent state), so
every tensor-parallel rank, fed the same messages, makes the same decisions and KV placements.

Pool pressure: a request is admitted only when pages for its whole prompt are free (plus one page of
headroom per running request). If a running request still cannot get a page for its next token, the
newest request holding pages is retracted — its pages freed, itself requeued at the front of the
queue to be recomputed later (tokens already sent stay sent) — and no new request is admitted until
some request finishes, so admission and retraction cannot chase each other. The oldest request always
progresses (the context limit makes every single request fit in the pool), so nothing deadlocks.

Replies (lists of tokenizer-group messages, one `send_result` per step):
- `DetokenizeMsg(uid, token, finished, finish_reason)` per new token; finish_reason "stop" (an EOS id
  unless ignore_eos, or a stop token), "length" (max_tokens), "" while running;
- on abort: `DetokenizeMsg(uid, next_token=-1, finished=True, finish_reason="abort")` (-1: no token);
- on rejection (bad or too long input): `ErrorMsg(uid, why)`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine import DummyEngine, Engine, create_engine
from minisgl.message import (
    AbortBackendMsg,
    BaseTokenizerMsg,
    BatchBackendMsg,
    DetokenizeMsg,
    ErrorMsg,
    ExitMsg,
    UserMsg,
)

from .decode import DecodeManager
from .io import SchedulerIOMixin
from .prefill import PrefillManager

logger = logging.getLogger(__name__)

_REMEMBERED_UIDS = 4096  # aborts for not-yet-seen uids, and recently finished uids, kept this long


class Scheduler(SchedulerIOMixin):
    def __init__(
        self, config: Any, tp_cpu_group: Any = None, engine: Engine | DummyEngine | None = None
    ) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.engine = engine if engine is not None else create_engine(config)
        self.table = self.engine.page_table
        self.max_seq_len: int = self.engine.max_seq_len
        self.vocab_size: int = self.engine.vocab_size
        self.eos_ids: frozenset[int] = frozenset(self.engine.eos_token_ids)
        self.prefill = PrefillManager(self.table, config.max_prefill_tokens)
        self.decode = DecodeManager()
        self._pending_aborts: OrderedDict[int, None] = OrderedDict()  # aborts that beat their request
        self._recent_done: OrderedDict[int, None] = OrderedDict()
        self._admit_counter = 0
        self._under_pressure = False  # set by a retraction; cleared when a request frees its pages
        self._idle_logged = False
        self._exit = False
        self.num_retractions = 0  # observability (and tests): how often the pool forced a retraction
        self._replies: list[BaseTokenizerMsg] = []
        super().__init__(config, tp_cpu_group)

    # -- public ---------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """What the launcher and the tokenizer need to know (sent with "ready")."""
        return {
            "max_seq_len": self.max_seq_len,
            "vocab_size": self.vocab_size,
            "num_pages": self.table.allocator.num_pages,
            "page_size": self.table.page_size,
            "eos_token_ids": sorted(self.eos_ids),
            "max_running_requests": self.config.max_running_requests,
            "max_prefill_tokens": self.prefill.max_prefill_tokens,
        }

    def run_forever(self) -> None:
        while not self._exit:
            self.normal_loop()

    def normal_loop(self) -> None:
        """One iteration: messages in, at most one batch run, that step's replies out."""
        blocking = not self.has_work()
        msgs = self.receive_msg(blocking=blocking)
        for msg in _flatten(msgs):
            self._handle(msg)
        batch = self._schedule()
        if batch is not None:
            self._idle_logged = False
            tokens = self.engine.forward_batch(batch)
            self._process(batch, tokens)
        if self._replies:
            replies, self._replies = self._replies, []
            self.send_result(replies)

    def has_work(self) -> bool:
        return len(self.prefill) > 0 or len(self.decode) > 0

    def run_when_idle(self) -> None:
        """Called before blocking for messages: log the idle state once and check the KV pool."""
        if not self._idle_logged:
            alloc = self.table.allocator
            logger.info(
                "scheduler idle: %d running, %d waiting, pages free %d/%d",
                len(self.decode),
                len(self.prefill),
                alloc.num_free,
                alloc.num_pages,
            )
            self._idle_logged = True
        self.check_integrity()

    def check_integrity(self) -> None:
        """Every KV page is free or owned by exactly one live request (raises KVIntegrityError)."""
        live = {r.uid for r in self.prefill.prefilling} | set(self.decode.running)
        self.table.check_integrity(live)

    # -- messages -------------------------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        if isinstance(msg, UserMsg):
            self._on_user(msg)
        elif isinstance(msg, AbortBackendMsg):
            self._on_abort(msg.uid)
        elif isinstance(msg, ExitMsg):
            logger.info("scheduler: exit requested")
            self._exit = True
        else:
            logger.error("scheduler: dropped a message of unexpected type %s", type(msg).__name__)

    def _on_user(self, msg: UserMsg) -> None:
        uid = msg.uid
        if uid in self._pending_aborts:
            del self._pending_aborts[uid]
            self._replies.append(DetokenizeMsg(uid, -1, True, "abort"))
            return
        try:
            token_ids = _token_list(msg.input_ids)
            error = self._check_request(uid, token_ids, msg.sampling_params)
        except Exception as e:  # a malformed field: reject it, never crash
            error = f"malformed request: {e}"
        if error:
            logger.info("scheduler: rejected request %d: %s", uid, error)
            self._replies.append(ErrorMsg(uid, error))
            return
        self.prefill.add(Req(uid=uid, token_ids=token_ids, sampling_params=msg.sampling_params))

    def _check_request(self, uid: int, token_ids: list[int], params: SamplingParams) -> str:
        """Why request `uid` cannot run, or "" if it can."""
        if not isinstance(params, SamplingParams):
            return "sampling_params is missing or malformed"
        if self._is_live(uid):
            return f"request id {uid} is already in use"
        if not token_ids:
            return "the prompt is empty"
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token ids out of the vocabulary (size {self.vocab_size}): {bad[:5]}"
        try:
            params.validate(self.vocab_size)
        except (ValueError, TypeError) as e:
            return str(e)
        total = len(token_ids) + params.max_tokens
        if total > self.max_seq_len:
            return (
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total} "
                f"tokens, more than the context length of {self.max_seq_len} tokens"
            )
        return ""

    def _is_live(self, uid: int) -> bool:
        if uid in self.decode.running:
            return True
        return any(r.uid == uid for r in self.prefill.prefilling) or any(
            r.uid == uid for r in self.prefill.waiting
        )

    def _on_abort(self, uid: int) -> None:
        req = self.decode.remove(uid) or self.prefill.remove(uid)
        if req is not None:
            self._release(req)
            logger.info("scheduler: aborted request %d (%d tokens generated)", uid, req.output_len)
            self._replies.append(DetokenizeMsg(uid, -1, True, "abort"))
        elif uid not in self._recent_done:  # its UserMsg may still be on its way: remember briefly
            _remember(self._pending_aborts, uid)

    # -- scheduling -----------------------------------------------------------------------------------
    def _schedule(self) -> Batch | None:
        admit = not self._under_pressure or self._num_holding() == 0
        batch = self.prefill.schedule(reserve_pages=len(self.decode), admit=admit)
        if batch is not None:
            for r in batch.reqs:
                if r.admit_seq < 0:
                    r.admit_seq = self._admit_counter
                    self._admit_counter += 1
            return batch
        return self.decode.batch(self._grow_for_decode())

    def _grow_for_decode(self) -> list[Req]:
        """Give every running request room for its next token, retracting the newest holders if needed."""
        reqs = self.decode.ordered()
        for r in reqs:
            while r.table_row >= 0 and not self.table.reserve(r.table_row, r.seq_len):
                self._retract(self._newest_holder())
        return [r for r in reqs if r.table_row >= 0]

    def _newest_holder(self) -> Req:
        holders = list(self.decode.running.values()) + self.prefill.prefilling
        return max(holders, key=lambda r: r.admit_seq)

    def _retract(self, req: Req) -> None:
        """Free `req`'s pages and requeue it at the front; its tokens so far are recomputed later."""
        if self.decode.remove(req.uid) is None:
            self.prefill.prefilling.remove(req)
        self.table.free_row(req.table_row)
        req.table_row, req.cached_len, req.admit_seq = -1, 0, -1
        self.prefill.add(req, front=True)
        self._under_pressure = True
        self.num_retractions += 1
        logger.info(
            "scheduler: KV pool full, retracted request %d (%d tokens to recompute)", req.uid, req.seq_len
        )

    def _num_holding(self) -> int:
        return len(self.decode) + len(self.prefill.prefilling)

    # -- results --------------------------------------------------------------------------------------
    def _process(self, batch: Batch, tokens: list[int]) -> None:
        sampled = iter(tokens)
        for req, n, samples in zip(batch.reqs, batch.extend_lens, batch.sample_mask, strict=True):
            req.cached_len += n
            if not samples:
                continue
            token = next(sampled)
            if not batch.is_decode:
                self.prefill.done(req)
                self.decode.add(req)
            req.token_ids.append(token)
            reason = self._finish_reason(req, token)
            self._replies.append(DetokenizeMsg(req.uid, token, bool(reason), reason))
            if reason:
                self.decode.remove(req.uid)
                self._release(req)

    def _finish_reason(self, req: Req, token: int) -> str:
        params = req.sampling_params
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if req.output_len >= params.max_tokens or req.seq_len >= self.max_seq_len:
            return "length"
        return ""

    def _release(self, req: Req) -> None:
        """Free a finished or aborted request's pages at once."""
        if req.table_row >= 0:
            self.table.free_row(req.table_row)
            req.table_row = -1
            self._under_pressure = False
        _remember(self._recent_done, req.uid)

    # -- offline mode hooks (the LLM class overrides them) -------------------------------------------
    def offline_receive_msg(self, blocking: bool = False) -> list[Any]:
        raise NotImplementedError("offline mode needs a subclass (minisgl.LLM) to feed messages")

    def offline_send_result(self, reply: list[BaseTokenizerMsg]) -> None:
        raise NotImplementedError("offline mode needs a subclass (minisgl.LLM) to take results")


def _flatten(msgs: list[Any]) -> list[Any]:
    out: list[Any] = []
    for m in msgs:
        if isinstance(m, BatchBackendMsg):
            out.extend(_flatten(list(m.data)))
        else:
            out.append(m)
    return out


def _token_list(ids: Any) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise ValueError(
                f"input_ids must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}"
            )
        return ids.tolist()
    return [int(t) for t in ids]


def _remember(d: OrderedDict[int, None], uid: int) -> None:
    d[uid] = None
    d.move_to_end(uid)
    while len(d) > _REMEMBERED_UIDS:
        d.popitem(last=False)
