"""The scheduler: turns a stream of backend messages into batches for the engine, and tokens into replies.

One loop iteration (`sync_step`): take the messages that arrived (blocking only when there is no
work), run one batch — a prefill batch if any prefill can run (chunked under `max_prefill_tokens`),
otherwise one decode step of every running request in uid order — and send that step's replies.

Overlap scheduling (`overlap_step`, on by default on a GPU): the loop launches step N+1 before it
waits for step N's tokens, so the host prepares the next batch while the device computes. A request
whose token is still on the device is `pending`: its value is in step N's StepOutput (`_in_flight`),
which the launch of step N+1 gets and feeds it from, on the device; the results are processed one
step late. A request that will reach max_tokens with its
pending token is left out of the next step; one that stops on an EOS id, or is aborted, is known only
when its token arrives, so the step launched meanwhile computes one token for it that is dropped.
Launching a step (`_on_launch`) and taking its tokens (`_on_result`) are the same two functions in
both.

A request's `status` (core.ReqStatus) is the place it sits in: WAITING or RETRACTED in the prefill
queue, PREFILLING (pages held, chunks to run), DECODING, FINISHED; `check_integrity` verifies it.

Everything is deterministic (no clocks, no set or dict iteration order, no rank-dependent state), so
every tensor-parallel rank, fed the same messages, makes the same decisions and KV placements.

Prefix caching (`cache.py`, `--cache-type radix`, the default): a request borrows the KV pages of the
longest cached prefix of its tokens and prefills only the rest; the whole pages each returned step
computed enter the cache, so requests sharing a prefix share its pages while they run and after.

Pool pressure: a request is admitted only when pages for the uncached rest of its prompt are
available (free, or cached and unpinned: those are evicted, least recently used first) plus one page
of headroom per running request. If a running request still cannot get a page for its next token,
even by eviction, the newest request holding pages is retracted — its pages freed, itself requeued at the front of the
queue to be recomputed later (tokens already sent stay sent) — and no new request is admitted until
some request finishes, so admission and retraction cannot chase each other. The oldest request always
progresses (the context limit makes every single request fit in the pool), so nothing deadlocks.

Replies (lists of tokenizer-group messages, one `send_result` per step):
- `DetokenizeMsg(uid, token, finished, finish_reason)` per new token; finish_reason "stop" (an EOS id
  unless ignore_eos, or a stop token), "length" (max_tokens), "" while running; its `extra` (the
  prefix-cache usage on the first token, the stop token id, logprobs) only on a token that has one;
- on abort: `DetokenizeMsg(uid, next_token=-1, finished=True, finish_reason="abort")` (-1: no token);
- on rejection (bad or too long input, a grammar that does not compile): `ErrorMsg(uid, why)`;
- a request whose grammar fails while sampling (llguidance's limits): `ErrorMsg(uid, why)` too, which
  ends it with finish_reason "error" after the tokens sent so far.

Structured output: a request with a grammar waits in `GrammarWait` while its grammar compiles on
the compiler's threads (`grammar_wait.py`), then joins the prefill queue; the step never compiles.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minisgl.core import (
    Batch,
    Req,
    ReqStatus,
    RequestRejected,
    SamplingParams,
    TokenLogprobs,
    check_request,
    reasoning_end,
)
from minisgl.engine import EngineProtocol, StepOutput, create_engine
from minisgl.engine.step import StepLogprobLists
from minisgl.grammar import GRAMMAR_REFUSED
from minisgl.kvcache import KVIntegrityError, create_prefix_cache
from minisgl.message import (
    AbortBackendMsg,
    BaseBackendMsg,
    BaseTokenizerMsg,
    DetokenizeExtra,
    DetokenizeMsg,
    ErrorMsg,
    ExitMsg,
    LoadMsg,
    UserMsg,
)
from minisgl.utils.host import release_free_memory

from .cache import CacheManager
from .config import SchedulerConfig
from .decode import DecodeManager
from .grammar_wait import GrammarWait
from .io import SchedulerIOMixin
from .prefill import PrefillManager

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

_GRAMMAR_POLL_S = 0.005  # how long an idle step waits for a grammar compile before looking again
_REMEMBERED_UIDS = 4096  # aborts for not-yet-seen uids, and recently finished uids, kept this long


class Scheduler(SchedulerIOMixin):
    def __init__(
        self,
        config: SchedulerConfig,
        tp_cpu_group: ProcessGroup | None = None,
        engine: EngineProtocol | None = None,
    ) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.engine = engine if engine is not None else create_engine(config)
        self.table = self.engine.page_table
        self.max_seq_len: int = self.engine.max_seq_len
        self.vocab_size: int = self.engine.vocab_size
        self.eos_ids: frozenset[int] = frozenset(self.engine.eos_token_ids)
        self.cache = CacheManager(self.table, create_prefix_cache(config.cache_type, self.table.page_size))
        self.prefill = PrefillManager(self.cache, config.max_prefill_tokens)
        self.decode = DecodeManager()
        self._pending_aborts: OrderedDict[int, None] = OrderedDict()  # aborts that beat their request
        self._recent_done: OrderedDict[int, None] = OrderedDict()
        self._admit_counter = 0
        self._under_pressure = False  # set by a retraction; cleared when a request frees its pages
        self._idle_logged = False
        self._exit = False
        self.num_retractions = 0  # observability (and tests): how often the pool forced a retraction
        self.num_prefill_tokens = 0  # tokens fed by prefill steps (a cached prefix is not fed)
        self._replies: list[BaseTokenizerMsg] = []
        self.overlap = _overlap_enabled(config, self.engine)
        self._in_flight: StepOutput | None = None  # overlap: the step launched last (its tokens pending)
        self._reported_load = (0, 0)  # (running, waiting) as last sent in a LoadMsg
        super().__init__(config, tp_cpu_group)
        self.grammar_wait: GrammarWait | None = None  # None: the engine has no grammars (dummy)
        if self.engine.grammars is not None:
            group = tp_cpu_group if config.tp_info.size > 1 else None
            self.grammar_wait = GrammarWait(self.engine.grammars, tp_group=group)

    # -- public ---------------------------------------------------------------------------------------
    def info(self) -> dict[str, int | str | list[int]]:
        """What the launcher and the tokenizer need to know (sent with "ready")."""
        return {
            "max_seq_len": self.max_seq_len,
            "vocab_size": self.vocab_size,
            "num_pages": self.table.allocator.num_pages,
            "page_size": self.table.page_size,
            "eos_token_ids": sorted(self.eos_ids),
            "max_running_requests": self.config.max_running_requests,
            "max_prefill_tokens": self.prefill.max_prefill_tokens,
            "cache_type": self.config.cache_type,
        }

    def run_forever(self, on_round: Callable[[bool], None] | None = None) -> None:
        """Step until an ExitMsg; `on_round(busy)` after every round (the launcher's progress watch:
        busy means the next round will not wait for messages)."""
        while not self._exit:
            self.step()
            if on_round is not None:
                on_round(self.has_work() or self._in_flight is not None)

    def step(self) -> None:
        """One iteration of the loop this scheduler runs (overlapped or not)."""
        (self.overlap_step if self.overlap else self.sync_step)()

    def sync_step(self) -> None:
        """One iteration: messages in, at most one batch run, that step's replies out."""
        self._take_messages(blocking=not self.has_work())
        batch = self._schedule()
        if batch is not None:
            self._idle_logged = False
            out = self.engine.launch(batch)
            self._on_launch(batch)
            self._on_result(batch, out.tolist(), out.logprobs(), out.pooled())
        else:
            self._wait_for_grammars()
        self._send_replies()

    def overlap_step(self) -> None:
        """One iteration: messages in, the next batch launched, the previous batch's tokens taken (the
        only wait), their replies out."""
        self._take_messages(blocking=not self.has_work() and self._in_flight is None)
        batch = self._schedule()
        launched, done = None, self._in_flight
        if batch is not None:
            self._idle_logged = False
            launched = self.engine.launch(batch, pending=done)  # feeds the tokens `done` sampled
            self._on_launch(batch)
        if done is not None:
            self._on_result(done.batch, done.tolist(), done.logprobs(), done.pooled())
        elif launched is None:
            self._wait_for_grammars()
        self._in_flight = launched
        self._send_replies()

    def _wait_for_grammars(self) -> None:
        """Nothing ran this step: if requests wait for their grammars, give the compiles a moment
        rather than spin (messages are taken again right after)."""
        if self.grammar_wait is not None:
            self.grammar_wait.pause(_GRAMMAR_POLL_S)

    def _take_messages(self, blocking: bool) -> None:
        for msg in self.receive_msg(blocking=blocking):
            self._handle(msg)

    def _send_replies(self) -> None:
        if self.config.report_load:
            self._report_load()
        if self._replies:
            replies, self._replies = self._replies, []
            self.send_result(replies)

    def load(self) -> tuple[int, int]:
        """(running, waiting): requests prefilling or decoding, and requests waiting for pages."""
        waiting = len(self.prefill.waiting) + self._num_compiling()
        return len(self.decode) + len(self.prefill) - len(self.prefill.waiting), waiting

    def _num_compiling(self) -> int:
        return len(self.grammar_wait) if self.grammar_wait is not None else 0

    def _report_load(self) -> None:
        """A LoadMsg rides with this step's replies when the counts changed (the --dp router's input;
        a step that changes nothing sends nothing)."""
        load = self.load()
        if load != self._reported_load:
            self._reported_load = load
            self._replies.append(LoadMsg(self.config.replica, *load))

    def has_work(self) -> bool:
        return len(self.prefill) > 0 or len(self.decode) > 0 or self._num_compiling() > 0

    def run_when_idle(self) -> None:
        """Called before blocking for messages: log the idle state once and check the KV pool."""
        if not self._idle_logged:
            alloc, stats = self.table.allocator, self.cache.stats
            logger.info(
                "scheduler idle: %d running, %d waiting, pages free %d/%d, cached %d; "
                "prompt tokens from the cache %d/%d",
                len(self.decode),
                len(self.prefill),
                alloc.num_free,
                alloc.num_pages,
                self.cache.prefix.num_pages,
                stats.cached_tokens,
                stats.prompt_tokens,
            )
            self._idle_logged = True
            release_free_memory()  # once per idle spell: a few ms, off any request's path
        self.check_integrity()

    def check_integrity(self) -> None:
        """Every request's status is the place it sits in, every KV page is free, owned by exactly one
        live request, or held by the prefix cache, and the cache's references are the live requests'
        (raises KVIntegrityError)."""
        places = [
            (self.prefill.waiting, (ReqStatus.WAITING, ReqStatus.RETRACTED)),
            (self.prefill.prefilling, (ReqStatus.PREFILLING,)),
            (self.decode.ordered(), (ReqStatus.DECODING,)),
        ]
        for reqs, statuses in places:
            for r in reqs:
                if r.status not in statuses or r.holds_pages != (r.table_row >= 0):
                    raise KVIntegrityError(
                        f"request {r.uid} is {r.status.value} with page-table row {r.table_row}"
                    )
        live = self.prefill.prefilling + self.decode.ordered()
        self.cache.check_integrity(live)

    # -- messages -------------------------------------------------------------------------------------
    def _handle(self, msg: BaseBackendMsg) -> None:
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
            if self._is_live(uid):
                raise RequestRejected(f"request id {uid} is already in use")
            token_ids = _token_list(msg.input_ids)
            self._check_request(token_ids, msg.sampling_params)
            req = Req(uid=uid, token_ids=token_ids, sampling_params=msg.sampling_params)
            self._queue(req)
        except RequestRejected as e:
            self._reject(uid, str(e))
        except Exception as e:  # a malformed field: reject it, never crash
            self._reject(uid, f"malformed request: {e}")

    def _reject(self, uid: int, why: str) -> None:
        logger.info("scheduler: rejected request %d: %s", uid, why)
        self._replies.append(ErrorMsg(uid, why))

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """RequestRejected if the request cannot run on this model (the offline LLM's checked already)."""
        check_request(token_ids, params, self.vocab_size, self.max_seq_len)

    def _queue(self, req: Req) -> None:
        """Into the prefill queue, or, with a grammar, to wait for its compile first."""
        grammar = req.sampling_params.grammar
        if req.sampling_params.embed and self.engine.pooling is None:
            raise RequestRejected("embeddings need a model (not --engine dummy)")
        if self.config.task == "embed" and not req.sampling_params.embed:
            raise RequestRejected(
                "this server runs an embedding model (--task embed): it serves only embeddings"
            )
        if grammar is None:
            self.prefill.add(req)
        elif self.grammar_wait is None:
            raise RequestRejected("structured output needs a model (not --engine dummy)")
        else:
            self.grammar_wait.add(req, grammar)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the prefill queue; those whose grammar failed are refused."""
        if self.grammar_wait is None or not self.grammar_wait.waiting:
            return
        ready, refused = self.grammar_wait.take_finished()
        for req in ready:
            self.prefill.add(req)
        for req, why in refused:
            self._reject(req.uid, why)
            req.move_to(ReqStatus.FINISHED)
            _remember(self._recent_done, req.uid)

    def _is_live(self, uid: int) -> bool:
        if uid in self.decode.running or (self.grammar_wait is not None and self.grammar_wait.holds(uid)):
            return True
        return any(r.uid == uid for r in self.prefill.prefilling) or any(
            r.uid == uid for r in self.prefill.waiting
        )

    def _on_abort(self, uid: int) -> None:
        compiling = self.grammar_wait.remove(uid) if self.grammar_wait is not None else None
        if compiling is not None:
            logger.info("scheduler: aborted request %d while its grammar compiled", uid)
            compiling.move_to(ReqStatus.FINISHED)
            self._replies.append(DetokenizeMsg(uid, -1, True, "abort"))
            _remember(self._recent_done, uid)
            return
        req = self.decode.remove(uid) or self.prefill.remove(uid)
        if req is not None:
            self._release(req)
            logger.info("scheduler: aborted request %d (%d tokens generated)", uid, req.output_len)
            extra = (
                DetokenizeExtra(cached_tokens=req.cached_prompt_len) if req.cached_prompt_len > 0 else None
            )
            self._replies.append(DetokenizeMsg(uid, -1, True, "abort", extra))
        elif uid not in self._recent_done:  # its UserMsg may still be on its way: remember briefly
            _remember(self._pending_aborts, uid)

    # -- scheduling -----------------------------------------------------------------------------------
    def _schedule(self) -> Batch | None:
        self._admit_compiled()
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
        """Give every running request room for its next token, retracting the newest holders if needed.
        A request whose pending token ends it (max_tokens, context) sits this step out."""
        reqs = [r for r in self.decode.ordered() if not self._ends_with_pending(r)]
        for r in reqs:
            while r.holds_pages and not self.cache.grow(r, r.cached_len + 1):
                self._retract(self._newest_holder())
        return [r for r in reqs if r.holds_pages]

    def _ends_with_pending(self, req: Req) -> bool:
        return req.pending > 0 and (
            req.sampling_params.embed  # its answer is in flight: it never decodes
            or req.decoding_output_len >= req.sampling_params.max_tokens
            or req.seq_len + req.pending >= self.max_seq_len
        )

    def _newest_holder(self) -> Req:
        holders = list(self.decode.running.values()) + self.prefill.prefilling
        return max(holders, key=lambda r: r.admit_seq)

    def _retract(self, req: Req) -> None:
        """Free `req`'s pages and requeue it at the front; its tokens so far are recomputed later
        (what it computed stays in the prefix cache, unpinned, until evicted)."""
        if req.status is ReqStatus.DECODING:
            self.decode.remove(req.uid)
        else:
            self.prefill.prefilling.remove(req)
        req.move_to(ReqStatus.RETRACTED)
        self.cache.release(req)
        req.cached_len, req.kv_ready_len, req.admit_seq = 0, 0, -1
        req.pooled = None  # an embedding request pools its prompt again
        self.prefill.add(req, front=True)
        self._under_pressure = True
        self.num_retractions += 1
        logger.info(
            "scheduler: KV pool full, retracted request %d (%d tokens to recompute)", req.uid, req.seq_len
        )

    def _num_holding(self) -> int:
        return len(self.decode) + len(self.prefill.prefilling)

    # -- results --------------------------------------------------------------------------------------
    def _on_launch(self, batch: Batch) -> None:
        """A step was launched: its tokens' K/V are in the pool, its samples are pending, and requests
        whose prefill ended decode from now on."""
        if not batch.is_decode:
            self.num_prefill_tokens += batch.num_tokens
        for req, n, samples, embedded in zip(
            batch.reqs, batch.extend_lens, batch.sample_mask, batch.embed_done, strict=True
        ):
            req.cached_len += n
            if samples or embedded:  # a token, or an embedding request's answer, is pending
                req.pending += 1
                if not batch.is_decode:
                    self.prefill.done(req)
                    req.move_to(ReqStatus.DECODING)
                    self.decode.add(req)

    def _on_result(
        self,
        batch: Batch,
        tokens: list[int],
        logprobs: StepLogprobLists | None = None,
        pooled: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """A step's sampled tokens arrived: append them, cache the prefixes it computed (prefill
        steps; decoded pages are cached at release), reply, and end the requests that finished.
        `pooled`: the embedding requests' pooled hidden states of the step (uid -> (H,))."""
        sampled_lp, prompt_lp = logprobs or ({}, {})
        sampled = iter(tokens)
        rows = zip(batch.reqs, batch.kv_ends, batch.sample_mask, batch.embed_done, strict=True)
        for req, end, samples, embedded in rows:
            token = next(sampled) if samples else -1
            req.pending -= samples or embedded
            if req.finished:  # aborted or stopped while this step ran: its token is dropped
                continue
            if req.sampling_params.embed:
                self._on_pooled(req, (pooled or {}).get(req.uid), end, embedded)
                continue
            if req.uid in prompt_lp:
                _add_prompt_logprobs(req, *prompt_lp[req.uid])
            if samples:
                req.token_ids.append(token)
            if req.holds_pages:  # not retracted meanwhile: the step's K/V are in its pages
                req.kv_ready_len = end
                if not batch.is_decode:
                    self.cache.cache_prefix(req)
            if not samples:
                continue
            self._reply(req, token, sampled_lp.get(req.uid))

    def _on_pooled(self, req: Req, part: torch.Tensor | None, end: int, done: bool) -> None:
        """An embedding request's share of a step: added to its pooled state (dropped if it was
        retracted meanwhile: it computes its prompt again); the step that ends its prompt answers it
        and frees its pages (they are not cached)."""
        if not req.holds_pages:
            return
        req.kv_ready_len = end
        if part is not None:
            req.pooled = part if req.pooled is None else req.pooled + part
        if not done:
            return
        if req.pooled is None:  # (the engine pools every chunk that ends a prompt)
            self._replies.append(ErrorMsg(req.uid, "the engine returned no hidden state for the embedding"))
        else:
            vector = req.pooled / req.prompt_len if self.engine.pooling == "mean" else req.pooled
            extra = DetokenizeExtra(embedding=vector.to(torch.float32).numpy().tobytes())
            self._replies.append(DetokenizeMsg(req.uid, -1, True, "stop", extra))
        self.decode.remove(req.uid)
        self._release(req)

    def _reply(self, req: Req, token: int, logprobs: TokenLogprobs | None) -> None:
        """The DetokenizeMsg of `req`'s new `token` (ending it if it finished)."""
        reason = self._finish_reason(req, token)
        if reason == "error":
            self._fail_grammar(req)
            return
        self._replies.append(
            DetokenizeMsg(req.uid, token, bool(reason), reason, _extra(req, token, reason, logprobs))
        )
        if reason:
            if req.status is ReqStatus.DECODING:
                self.decode.remove(req.uid)
            else:  # retracted meanwhile: it waits in the queue
                self.prefill.remove(req.uid)
            self._release(req)

    def _fail_grammar(self, req: Req) -> None:
        """`req`'s matcher failed while sampling: end it with an error after what it sent."""
        assert req.grammar is not None
        why = req.grammar.error
        logger.warning(
            "scheduler: request %d: its grammar failed after %d tokens: %s", req.uid, req.output_len, why
        )
        self._replies.append(ErrorMsg(req.uid, f"{GRAMMAR_REFUSED}: the output cannot follow it: {why}"))
        if req.status is ReqStatus.DECODING:
            self.decode.remove(req.uid)
        else:  # retracted meanwhile: it waits in the queue
            self.prefill.remove(req.uid)
        self._release(req)

    def _finish_reason(self, req: Req, token: int) -> str:
        """ "stop", "length", "error" (the grammar failed: its mask then allows only EOS), or ""."""
        params = req.sampling_params
        if req.grammar is not None:
            req.grammar.advance(req.output_ids)
            if req.grammar.error:
                return "error"
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if req.grammar is not None and req.grammar.is_done:  # complete: only EOS may follow
            return "stop"
        if req.output_len >= params.max_tokens or req.seq_len >= self.max_seq_len:
            return "length"
        return ""

    def _release(self, req: Req) -> None:
        """Free a finished or aborted request's pages at once, its computed prefix cached (a step still
        in flight may write its last K/V into them: device work runs in order, so a later owner's
        writes come after)."""
        req.move_to(ReqStatus.FINISHED)
        if self.cache.release(req):
            self._under_pressure = False
        _remember(self._recent_done, req.uid)


def _extra(req: Req, token: int, reason: str, logprobs: TokenLogprobs | None) -> DetokenizeExtra | None:
    """The rare fields of the reply with `req`'s new `token`; None for a plain token (most of them):
    the prefix-cache usage and the prompt logprobs come with the first token, the stop token id with
    the last, the token's logprobs if asked for."""
    params = req.sampling_params
    first = req.output_len == 1
    stop_token = reason == "stop" and token in params.stop_token_ids
    wants_prompt_lp = first and params.prompt_logprobs is not None
    reasons = bool(reason) and params.reasoning_end_id >= 0
    rare = logprobs is not None or stop_token or wants_prompt_lp or reasons or params.return_token_ids
    if not (rare or (first and req.cached_prompt_len > 0)):
        return None
    extra = DetokenizeExtra(
        cached_tokens=max(req.cached_prompt_len, 0) if first else 0, return_token=params.return_token_ids
    )
    if reasons:
        end = reasoning_end(req.output_ids, params.reasoning_start_id, params.reasoning_end_id)
        extra.reasoning_tokens = req.output_len if end is None else end
    if stop_token:
        extra.stop_token_id = token
    if logprobs is not None:
        extra.logprob, extra.top_ids, extra.top_logprobs = (
            logprobs.logprobs[0],
            logprobs.top_ids[0],
            logprobs.top_logprobs[0],
        )
    if wants_prompt_lp:
        lp = req.prompt_logprobs or TokenLogprobs()
        extra.prompt_ids = req.token_ids[: req.prompt_len]
        extra.prompt_logprobs, extra.prompt_top_ids, extra.prompt_top_logprobs = (
            lp.logprobs,
            lp.top_ids,
            lp.top_logprobs,
        )
    return extra


def _add_prompt_logprobs(req: Req, start: int, lp: TokenLogprobs) -> None:
    """Logprobs of prompt tokens start + 1 .. from a prefill step; those known already are skipped
    (a retracted request computes its prompt again)."""
    if req.prompt_logprobs is None:
        req.prompt_logprobs = TokenLogprobs()
    skip = len(req.prompt_logprobs) - start
    if skip >= 0:
        req.prompt_logprobs.extend(lp, skip)


def _overlap_enabled(config: SchedulerConfig, engine: EngineProtocol) -> bool:
    """`config.overlap_schedule`: None = on when the engine runs on a GPU (on a CPU a step returns
    only once computed, so there is nothing to overlap: the dummy engine's steps run on the CPU)."""
    choice = config.overlap_schedule
    return engine.device.type == "cuda" if choice is None else choice


def _token_list(ids: torch.Tensor | list[int]) -> list[int]:
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
