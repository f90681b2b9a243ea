"""One rank's engine: the model, its paged KV pool, the ops and attention backends, the sampler and,
on CUDA, the decode CUDA graphs.

The scheduler hands over a `Batch` (requests and how many new tokens each feeds); the engine builds
every tensor (input ids, positions, KV slots, attention metadata), sets the forward context, runs the
model (or replays a CUDA graph of it), computes logits only for the rows that sample, and samples.

The backends are chosen once, here: the ops backend (`minisgl.backends`: torch reference, cpu, cuda)
is bound into every layer of the model, the attention backend (`minisgl.attention`) goes into the
forward context.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch

from minisgl.attention import AttnInput, create_attention_backend
from minisgl.backends import bind_ops, create_ops
from minisgl.core import Batch, Context, Req, set_global_ctx
from minisgl.grammar import GrammarCompiler, apply_bitmask
from minisgl.kvcache import KVPool, PageAllocator, PageTable, kv_bytes_per_page
from minisgl.kvcache.pool import FP8_KV
from minisgl.layers import AttentionLayer
from minisgl.utils.transfer import to_device

from .cpu_graph import CpuGraphRunner
from .cuda_graph import CudaGraphRunner
from .logprobs import LogprobTensors
from .options import EngineOptions
from .penalties import apply_penalties
from .sampler import Sampler
from .step import PooledRows, StepLogprobs, StepOutput

if TYPE_CHECKING:
    from minisgl.models import CausalLM, ModelConfig

logger = logging.getLogger(__name__)

_CPU_KV_BUDGET = 1 << 30  # bytes of KV cache on the CPU when no size is given (at most 1/4 of free RAM)


@dataclass
class EngineStats:
    """Cumulative wall-clock seconds and tokens of prefill and decode passes (for benchmarks: two
    `perf_counter` calls per batch). On a GPU the times include only what the host waited for."""

    prefill_s: float = 0.0
    prefill_tokens: int = 0
    prefill_batches: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0
    decode_batches: int = 0


def _limit_host_threads(device: torch.device) -> None:
    """On an accelerator the host only prepares each step's metadata: small CPU tensor ops, for which
    torch's thread pool (a thread per core, spinning between ops) costs far more than it gives: the
    scheduler process was seen keeping 9 cores of an H200 host busy while serving at concurrency 256.
    One thread, unless the user chose a number with OMP_NUM_THREADS."""
    if device.type != "cpu" and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() != 1:
        logger.info(
            "torch CPU threads %d -> 1 for this process (OMP_NUM_THREADS chooses)", torch.get_num_threads()
        )
        torch.set_num_threads(1)


class Engine:
    def __init__(self, model: CausalLM, model_config: ModelConfig, options: EngineOptions) -> None:
        self.options = options
        self.model = model
        self.model_config = model_config
        self.device = torch.device(options.device)
        self.dtype = options.torch_dtype
        self.kv_dtype = options.kv_dtype
        self.vocab_size: int = model_config.vocab_size
        self.eos_token_ids: list[int] = list(model_config.eos_token_ids)
        self.page_size = options.page_size
        num_kv_heads = getattr(model, "num_local_kv_heads", model_config.num_kv_heads)
        num_q_heads = getattr(model, "num_local_heads", model_config.num_heads)
        per_page = kv_bytes_per_page(
            model_config.num_layers, num_kv_heads, model_config.head_dim, self.page_size, self.kv_dtype
        )
        self.num_pages, sized_by = self._size_pool(per_page)
        context = options.max_seq_len or model_config.max_position_embeddings
        # The context limit: the model's (or the user's) and never more than the whole pool holds.
        self.max_seq_len = min(context, self.num_pages * self.page_size)
        self.pool = KVPool(
            model_config.num_layers,
            self.num_pages,
            self.page_size,
            num_kv_heads,
            model_config.head_dim,
            self.kv_dtype,
            self.device,
            scales=self._kv_scales(num_kv_heads) if self.kv_dtype == FP8_KV else None,
            value_dtype=self.dtype,
        )
        self.page_table = PageTable(
            PageAllocator(self.num_pages), self.page_size, options.max_running_requests, self.max_seq_len
        )
        self.ops = create_ops(options.ops_backend, self.device)
        bind_ops(model, self.ops)
        _limit_host_threads(self.device)
        self.attn_backend = create_attention_backend(
            options.attention_backend,
            self.pool,
            num_q_heads,
            num_kv_heads,
            model_config.head_dim,
            options.max_running_requests,
            self.page_table.max_pages_per_row,
            self.dtype,
        )
        self.sampler = Sampler(self.device, options.seed)
        self.grammars = GrammarCompiler(options.model_path, self.vocab_size, self.eos_token_ids)
        self.pooling: str | None = _pooling_mode(options)
        self.stats = EngineStats()
        logger.info(
            "KV pool: %d pages x %d tokens (%.1f MiB %s, %s), context limit %d tokens; ops %s, attention %s",
            self.num_pages,
            self.page_size,
            self.num_pages * per_page / 2**20,
            str(self.kv_dtype).removeprefix("torch."),
            sized_by,
            self.max_seq_len,
            self.ops.name,
            self.attn_backend.name,
        )
        self.graphs = self._capture_graphs()
        self._last_arrival = 0.0

    def _kv_scales(self, num_kv_heads: int) -> list[torch.Tensor]:
        """An fp8 KV pool's scales per layer, (2, Hkv): the checkpoint's where it has them, else 1
        (vLLM's and SGLang's default too: K/V of common models stay well inside fp8's +-448)."""
        n = self.model_config.num_layers
        given: list[torch.Tensor | None] = [
            m.kv_scale for m in self.model.modules() if isinstance(m, AttentionLayer)
        ]
        if len(given) != n:  # a model without minisgl's attention layers (tests' toy models)
            given = [None] * n
        ones = torch.ones(2, num_kv_heads, dtype=torch.float32)
        logger.info(
            "fp8 KV cache: scales from the checkpoint for %d of %d layers (1.0 for the rest)",
            sum(s is not None for s in given),
            n,
        )
        return [ones if s is None else s for s in given]

    def _capture_graphs(self) -> CudaGraphRunner | CpuGraphRunner | None:
        max_bs = min(self.options.cuda_graph_max_bs, self.options.max_running_requests)
        if self.options.task == "embed":  # prefill only: nothing decodes
            return None
        if self.device.type == "cpu" and max_bs >= 1 and self._cpu_graphs_apply():
            prepare = lambda: self.ops.prepare(True)  # noqa: E731
            return CpuGraphRunner(self._logits_of_all, max_bs, self.vocab_size, prepare)
        if self.device.type != "cuda" or max_bs < 1 or not self.attn_backend.supports_cuda_graph:
            return None
        runner = CudaGraphRunner(
            self._raw_logits_of_all, self.attn_backend, max_bs, self.device, lambda: self.ops.prepare(True)
        )
        with torch.inference_mode():
            runner.capture()
        return runner

    def _cpu_graphs_apply(self) -> bool:
        """Whether a CPU decode step is all recordable kernels: the cpu ops and attention backends
        with their kernels built, and every matrix a QuantizedWeight (the float32 path's matmuls are
        torch's)."""
        from minisgl.kernels import available
        from minisgl.kernels.quant import quant_available
        from minisgl.quant import QuantizedWeight

        static = getattr(self.attn_backend, "static_rows", 0)
        if self.ops.name != "cpu" or not available() or not quant_available() or static < 1:
            return False
        weights = [w for m in self.model.modules() if (w := getattr(m, "weight", None)) is not None]
        return all(
            isinstance(w, QuantizedWeight) or (isinstance(w, torch.Tensor) and w.dim() == 1) for w in weights
        )

    def _logits_of_all(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decode step's forward pass under the forward context: ids/positions (B,) -> (B, V) float32."""
        set_global_ctx(Context(attn_backend=self.attn_backend))
        try:
            return self.model.compute_logits(self.model.forward(input_ids, positions))
        finally:
            set_global_ctx(None)

    def _raw_logits_of_all(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`_logits_of_all` in the head's output dtype (bf16 for a bf16 model): the CUDA graphs'
        argmax reads half the bytes and no float32 copy is written (at batch 256 of the 8B shapes the
        cast and the argmax over float32 took ~175 us a step); `launch` casts when it samples."""
        compute = getattr(self.model, "compute_logits_raw", self.model.compute_logits)
        set_global_ctx(Context(attn_backend=self.attn_backend))
        try:
            return compute(self.model.forward(input_ids, positions))
        finally:
            set_global_ctx(None)

    def _size_pool(self, bytes_per_page: int) -> tuple[int, str]:
        """(pages, what sized them: the log line says which)."""
        opts = self.options
        if opts.num_pages is not None:
            return opts.num_pages, "num_pages"
        if opts.kv_cache_memory is not None:
            budget, why = opts.kv_cache_memory, "kv_cache_memory"
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * opts.gpu_memory_fraction)
            why = f"{opts.gpu_memory_fraction:g} of {free / 2**30:.1f} GiB free"
        else:
            available = psutil.virtual_memory().available
            budget = min(_CPU_KV_BUDGET, available // 4)
            why = f"default: {_CPU_KV_BUDGET / 2**30:g} GiB, at most 1/4 of {available / 2**30:.1f} GiB available"
        pages = budget // bytes_per_page
        if pages < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no page of {bytes_per_page} bytes")
        return int(pages), why

    # -- one forward pass ---------------------------------------------------------------------------------
    def forward_batch(self, batch: Batch) -> list[int]:
        """Run one batch; return the sampled token of each request whose chunk ends its tokens, in order."""
        return self.launch(batch).tolist()

    @torch.inference_mode()
    def launch(self, batch: Batch, pending: StepOutput | None = None) -> StepOutput:
        """Start one batch on the device and return at once (on a GPU the step runs asynchronously);
        `StepOutput.tolist()` waits for its sampled tokens. A request with a `pending` token feeds
        the token that `pending`, the step launched before, sampled for it, taken on the device
        (overlap scheduling)."""
        t0 = time.perf_counter()
        input_ids, positions, attn_input, sample_rows = self._prepare(batch)
        fed = self._pending_inputs(batch, pending)
        self.ops.prepare(batch.is_decode)
        self.attn_backend.prepare(attn_input)
        reqs = [r for r, s in zip(batch.reqs, batch.sample_mask, strict=True) if s]
        params = [r.sampling_params for r in reqs]
        tokens: torch.Tensor | None = None
        logits: torch.Tensor | None
        prompt_logits: torch.Tensor | None = None
        prompt_rows: list[tuple[Req, int, int]] = []
        pooled: PooledRows | None = None
        if batch.is_decode and self.graphs is not None and self.graphs.padded_size(len(batch.reqs)):
            logits, best = self.graphs.replay(torch.stack((input_ids, positions)), fed)  # (B, V), (B,)
            if all(p.is_greedy and not p.adjusts_logits for p in params):
                tokens = best  # the graph's argmax: no sampling kernels
            if tokens is None or any(p.logprobs is not None for p in params):
                logits = logits.float()  # (a CUDA graph's logits are the head's dtype)
        else:
            prompt_rows = self._prompt_logprob_rows(batch)
            logits, prompt_logits, pooled = self._forward_eager(
                batch, input_ids, positions, sample_rows, prompt_rows, fed
            )
        raw = logits
        if tokens is None and raw is not None:
            # Grammar rows: their bitmasks are computed now, while a GPU runs the forward pass.
            masks = self._grammar_masks(reqs, pending)
            logits = self._penalized(raw, reqs, pending)
            if masks is not None:
                logits = self._masked(logits, raw, reqs, *masks)
            tokens = self.sampler.sample(logits, params, [self._generator(r) for r in reqs])
        if tokens is None:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        logprobs = self._logprobs(raw, tokens, reqs, prompt_logits, prompt_rows)
        return StepOutput(tokens, batch, t0, logprobs, on_done=self._account, pooled=pooled)

    @torch.inference_mode()
    def forward_logits(self, batch: Batch) -> torch.Tensor:
        """Logits (T, V) float32 of every token the batch feeds, nothing sampled: scoring a given
        text, teacher forcing (`benchmarks/bench_fp8_accuracy.py`). Eager, the step's kernels; the
        caller advances `cached_len` as after a step."""
        input_ids, positions, attn_input, _ = self._prepare(batch)
        self.ops.prepare(batch.is_decode)
        self.attn_backend.prepare(attn_input)
        set_global_ctx(Context(attn_backend=self.attn_backend))
        try:
            hidden = self.model.forward(input_ids.to(self.device), positions.to(self.device))  # (T, H)
            return self.model.compute_logits(hidden)
        finally:
            set_global_ctx(None)

    def _grammar_masks(
        self, reqs: list[Req], pending: StepOutput | None
    ) -> tuple[list[int], torch.Tensor] | None:
        """(rows, their bitmasks (G, W) int32 on the CPU) for the rows a grammar holds now; None if
        none. A request's matcher is first fed its output so far, including its pending token
        (overlap scheduling: read once the step before is done); a reasoning model's output is held
        only once its reasoning ended (Grammar.constrains)."""
        rows, grammars = [], []
        for i, r in enumerate(reqs):
            if r.grammar is None:
                continue
            unseen = [pending.pending_token(r)] if r.pending and pending is not None else []
            r.grammar.advance(r.output_ids + unseen)
            if r.grammar.constrains:
                rows.append(i)
                grammars.append(r.grammar)
        if not rows:
            return None
        return rows, self.grammars.fill_masks(grammars)

    def _masked(
        self, logits: torch.Tensor, raw: torch.Tensor, reqs: list[Req], rows: list[int], mask: torch.Tensor
    ) -> torch.Tensor:
        """`logits` with the tokens each grammar row's matcher forbids at -inf (on a copy if
        `logits` is still the raw logits and a request wants logprobs, which are read from them)."""
        mask = mask.to(self.device, non_blocking=True)  # (G, W) int32
        if logits is raw and any(r.sampling_params.logprobs is not None for r in reqs):
            logits = logits.clone()
        apply_bitmask(
            logits, mask, None if len(rows) == len(reqs) else to_device(rows, self.device, torch.int64)
        )
        return logits

    def _penalized(self, logits: torch.Tensor, reqs: list[Req], pending: StepOutput | None) -> torch.Tensor:
        """`logits`, or a copy with the penalties and biases of the requests that have any."""
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        idx = to_device(rows, self.device, torch.int64)
        sub = apply_penalties(
            logits.index_select(0, idx),
            [reqs[i] for i in rows],
            self.eos_token_ids,
            self._unseen_tokens([reqs[i] for i in rows], pending),
        )
        return logits.index_copy_(0, idx, sub)

    def _unseen_tokens(self, reqs: list[Req], pending: StepOutput | None) -> torch.Tensor | None:
        """(n,) on the device: each request's pending token (overlap scheduling: sampled by the
        step before, not seen by the host yet), -1 for none; None when no request has one."""
        if pending is None or not any(r.pending for r in reqs):
            return None
        src = [pending.row_of(r) if r.pending else -1 for r in reqs]
        src_t = torch.tensor(src, dtype=torch.int64).to(self.device, non_blocking=True)
        return torch.where(src_t >= 0, pending.tokens[src_t.clamp(min=0)], -1)

    def _logprobs(
        self,
        raw: torch.Tensor | None,
        tokens: torch.Tensor,
        reqs: list[Req],
        prompt_logits: torch.Tensor | None,
        prompt_rows: list[tuple[Req, int, int]],
    ) -> StepLogprobs | None:
        """The logprobs the step's requests asked for, from the raw logits (still on the device)."""
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        sampled = None
        uids = [(reqs[i].uid, reqs[i].sampling_params.logprobs or 0) for i in rows]
        if rows and raw is not None:
            idx = to_device(rows, self.device, torch.int64)
            k = max(k for _, k in uids)
            sampled = LogprobTensors.of(raw.index_select(0, idx), tokens.index_select(0, idx), k)
        prompt = None
        groups = [(r.uid, start, n, r.sampling_params.prompt_logprobs or 0) for r, start, n in prompt_rows]
        if prompt_logits is not None and groups:
            targets = [t for r, start, n in prompt_rows for t in r.token_ids[start + 1 : start + 1 + n]]
            target_t = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
            prompt = LogprobTensors.of(prompt_logits, target_t, max(g[3] for g in groups))
        if sampled is None and prompt is None:
            return None
        return StepLogprobs(sampled, uids if sampled is not None else [], prompt, groups if prompt else [])

    def _prompt_logprob_rows(self, batch: Batch) -> list[tuple[Req, int, int]]:
        """(request, first position, count) of the prompt positions in a prefill batch whose logits
        give prompt logprobs: position p predicts prompt token p + 1."""
        if batch.is_decode:
            return []
        out = []
        for r, n in zip(batch.reqs, batch.extend_lens, strict=True):
            if r.wants_prompt_logprobs:
                end = min(r.cached_len + n, r.prompt_len - 1)
                if end > r.cached_len:
                    out.append((r, r.cached_len, end - r.cached_len))
        return out

    def _pending_inputs(
        self, batch: Batch, pending: StepOutput | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the batch, their input tokens on the device) for the requests whose input is
        their pending token, taken from `pending` (the step before); None when there are none."""
        rows = [(i, r) for i, r in enumerate(batch.reqs) if r.pending]
        if not rows:
            return None
        if pending is None:
            raise RuntimeError(f"request {rows[0][1].uid} has a pending token but no step before is given")
        dst = torch.tensor([i for i, _ in rows], dtype=torch.int64).to(self.device, non_blocking=True)
        src = torch.tensor([pending.row_of(r) for _, r in rows], dtype=torch.int64)
        return dst, pending.tokens.index_select(0, src.to(self.device, non_blocking=True))

    def _account(self, out: StepOutput) -> None:
        """Add a step's wall time to the stats when its tokens arrive: from its launch, or from the
        previous step's arrival if that came later (overlapped steps are not counted twice)."""
        now = time.perf_counter()
        dt, self._last_arrival = now - max(out.launched_at, self._last_arrival), now
        st, batch = self.stats, out.batch
        if batch.is_decode:
            st.decode_s += dt
            st.decode_tokens += len(batch.reqs)
            st.decode_batches += 1
        else:
            st.prefill_s += dt
            st.prefill_tokens += sum(batch.extend_lens)
            st.prefill_batches += 1

    def _forward_eager(
        self,
        batch: Batch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        sample_rows: list[int],
        prompt_rows: list[tuple[Req, int, int]],
        pending: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, PooledRows | None]:
        """The model on this batch -> logits (S, V) float32 of the rows that sample (None if none),
        those of the `prompt_rows` positions (P, V) (None if none), and the embedding requests'
        pooled hidden states (None if none)."""
        ids = self._to_device(input_ids)
        if pending is not None:
            ids.index_copy_(0, *pending)
        set_global_ctx(Context(attn_backend=self.attn_backend))
        try:
            hidden = self.model.forward(ids, self._to_device(positions))  # (T, H)
            pooled = self._pool(batch, hidden)
            extra = self._flat_rows(batch, prompt_rows)
            rows = sample_rows + extra
            if not rows:
                return None, None, pooled
            if len(rows) < hidden.shape[0] or extra:
                hidden = hidden.index_select(0, self._to_device(torch.tensor(rows)))  # (S + P, H)
            logits = self.model.compute_logits(hidden)  # (S + P, V) float32
        finally:
            set_global_ctx(None)
        s = len(sample_rows)
        return (logits[:s] if s else None), (logits[s:] if extra else None), pooled

    def _pool(self, batch: Batch, hidden: torch.Tensor) -> PooledRows | None:
        """The embedding requests' share of this prefill step, from `hidden` (T, H): last-token
        pooling takes the last row of the chunk that ends a prompt; mean pooling sums every chunk's
        rows (the scheduler adds the chunks up and divides by the prompt's length)."""
        if batch.is_decode or not any(r.sampling_params.embed for r in batch.reqs):
            return None
        uids: list[int] = []
        rows: list[int] = []  # of `hidden`
        groups: list[int] = []  # per row: its request's index in `uids`
        offset = 0
        for r, n, done in zip(batch.reqs, batch.extend_lens, batch.embed_done, strict=True):
            if r.sampling_params.embed and (done or self.pooling == "mean"):
                span = range(offset + n - 1 if self.pooling == "last" else offset, offset + n)
                rows += span
                groups += [len(uids)] * len(span)
                uids.append(r.uid)
            offset += n
        if not uids:
            return None
        picked = hidden.index_select(0, self._to_device(torch.tensor(rows))).float()  # (R, H)
        if self.pooling == "last":
            return PooledRows(uids, picked)  # (E, H)
        sums = torch.zeros(len(uids), hidden.shape[1], dtype=torch.float32, device=self.device)
        return PooledRows(uids, sums.index_add_(0, self._to_device(torch.tensor(groups)), picked))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without waiting for the device (`utils.transfer`): in a
        prefill step, a pageable copy before the LM head stalled the host until the forward pass was
        done, and the GPU then idled while the host prepared the next step (~8 ms of a 97 ms step of
        4,096 tokens, 8B shapes on an H200)."""
        return to_device(t, self.device)

    @staticmethod
    def _flat_rows(batch: Batch, prompt_rows: list[tuple[Req, int, int]]) -> list[int]:
        """Rows of the batch's flattened tokens for `prompt_rows` (request, first position, count)."""
        if not prompt_rows:
            return []
        offset, first = 0, {}
        for r, n in zip(batch.reqs, batch.extend_lens, strict=True):
            first[r.uid] = offset - r.cached_len  # flat row of position p: first + p
            offset += n
        return [first[r.uid] + p for r, start, n in prompt_rows for p in range(start, start + n)]

    def _generator(self, req: Req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None or req.sampling_params.is_greedy:
            return None
        if req.generator is None:
            req.generator = self.sampler.request_generator(seed)
        return req.generator

    def _prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttnInput, list[int]]:
        """Plain lists -> CPU tensors: input ids (T,), positions (T,), attention input, rows to sample."""
        reqs, ext = batch.reqs, batch.extend_lens
        ps = self.page_size
        seq_lens = [r.cached_len + n for r, n in zip(reqs, ext, strict=True)]
        rows = torch.tensor([r.table_row for r in reqs], dtype=torch.int64)  # (B,)
        max_pages = -(-max(seq_lens) // ps)
        page_rows = self.page_table.table[rows, :max_pages]  # (B, P) int32
        if batch.is_decode:
            ids = [0 if r.pending else r.token_ids[-1] for r in reqs]  # pending: patched on the device
            cached = [r.cached_len for r in reqs]
            pages = self.page_table.row_pages
            pos = torch.tensor(cached, dtype=torch.int64)  # (B,)
            slots = torch.tensor(
                [pages[r.table_row][c // ps] * ps + c % ps for r, c in zip(reqs, cached, strict=True)]
            )
            sample_rows = list(range(len(reqs)))
        else:
            ids = []
            for r, n in zip(reqs, ext, strict=True):
                ids.extend(r.token_ids[r.cached_len : r.cached_len + n])
            lens = torch.tensor(ext, dtype=torch.int64)
            starts = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)
            offsets = torch.cumsum(lens, 0) - lens  # (B,)
            which = torch.repeat_interleave(torch.arange(len(reqs)), lens)  # (T,)
            pos = torch.arange(len(ids), dtype=torch.int64) - offsets[which] + starts[which]  # (T,)
            slots = page_rows[which, pos // ps].to(torch.int64) * ps + pos % ps  # (T,)
            ends = (offsets + lens - 1).tolist()
            sample_rows = [e for e, s in zip(ends, batch.sample_mask, strict=True) if s]
        attn_input = AttnInput(
            seq_lens=seq_lens,
            extend_lens=list(ext),
            out_slots=slots,
            page_rows=page_rows,
            is_decode=batch.is_decode,
            row_ids=[r.table_row for r in reqs],
        )
        return torch.tensor(ids, dtype=torch.int64), pos, attn_input, sample_rows


def _pooling_mode(options: EngineOptions) -> str:
    """The model directory's pooling ("last" when it names none; `read_pooling`)."""
    from minisgl.models.pooling import read_pooling

    return (
        read_pooling(options.model_path, strict=options.task == "embed").mode
        if options.model_path
        else "last"
    )
