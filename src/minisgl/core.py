"""Core data types shared by every layer: sampling parameters, requests, batches.

`SamplingParams` travels inside messages, so its fields must stay msgpack-friendly
(ints, floats, bools, lists of ints, None).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only in annotations: the workers that import this need no torch
    import torch

    from minisgl.grammar import Grammar

# Temperatures below this sample greedily (vLLM's choice): dividing float32 logits by a smaller one
# overflows them, and at or below ~1e-38 the temperature itself rounds to 0 in float32.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes (and msgpack carries)
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's chat limit; vLLM's default)


@dataclass
class SamplingParams:
    """How to sample one request. The first five fields (and their order) are fixed by the chapters."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 1024
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    # Penalties and biases, as vLLM defines them (batched on the logits' device, engine/penalties.py):
    # presence/frequency over the generated tokens, repetition over prompt + generated (> 1 discourages),
    # logit_bias added to the logits of token ids, min_tokens: no EOS or stop token id before that many.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    # Log probabilities (the model's log-softmax of the raw logits, before penalties and temperature):
    # `logprobs` = how many top alternatives to return with each sampled token (None: no logprobs);
    # `prompt_logprobs` likewise for every prompt token after the first (None: none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: llguidance's grammar text (minisgl.grammar builds it from a JSON schema or a
    # Lark grammar); sampling keeps to it and the request stops when it is complete. None: free text.
    grammar: str | None = None
    # Embeddings: the request is its prompt's prefill only, answered with the pooled final hidden
    # state (the engine's pooling) instead of tokens; nothing is sampled, max_tokens is not used.
    embed: bool = False
    # Reasoning models (set by the tokenizer for chat prompts): the output's reasoning ends with
    # token `reasoning_end_id` (-1: the output has no reasoning), and the grammar applies only after
    # it. `reasoning_start_id` >= 0: the reasoning is optional, present iff the output's first token
    # is that one; -1 with an end id: the prompt opened the reasoning, the output starts inside it.
    reasoning_start_id: int = -1
    reasoning_end_id: int = -1
    # The answer carries the token ids (the prompt's, and each new token's), not only their text.
    return_token_ids: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field; a client's mistake, never a crash."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        self._validate_penalties()
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("grammar must be a non-empty string (llguidance's grammar text)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}")
        for name in ("reasoning_start_id", "reasoning_end_id"):
            t = getattr(self, name)
            if t < -1 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"{name} must be -1 or a token id, got {t}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids out of the vocabulary (size {vocab_size}): {bad[:5]}")
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids out of the vocabulary (size {vocab_size}): {bad[:5]}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:  # NaN fails this too
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if not all(math.isfinite(b) for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    @property
    def has_penalties(self) -> bool:
        """Whether sampling must adjust the logits (then the CUDA graph's greedy argmax is not used)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, biases or a grammar: the CUDA graph's greedy argmax cannot be used."""
        return self.has_penalties or self.grammar is not None

    @property
    def is_greedy(self) -> bool:
        """Argmax sampling: top_k 1, or a temperature under GREEDY_TEMPERATURE (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def reasoning_end(output_ids: Sequence[int], start_id: int, end_id: int, scanned: int = 0) -> int | None:
    """Where the reasoning of an output ends (see SamplingParams.reasoning_*): the index after its
    end token, 0 if the output has none, None while it is still open. `scanned`: output tokens
    already known to hold no end token (a caller that looks again as the output grows)."""
    if end_id < 0:
        return 0
    if start_id >= 0:
        if not output_ids:
            return None
        if output_ids[0] != start_id:
            return 0
    for i in range(max(scanned, 1 if start_id >= 0 else 0), len(output_ids)):
        if output_ids[i] == end_id:
            return i + 1
    return None


@dataclass
class TokenLogprobs:
    """Per position: the token, its log probability, and the top alternatives (most likely first)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: TokenLogprobs, skip: int = 0) -> None:
        """Append `other`'s positions after the first `skip`."""
        self.token_ids += other.token_ids[skip:]
        self.logprobs += other.logprobs[skip:]
        self.top_ids += other.top_ids[skip:]
        self.top_logprobs += other.top_logprobs[skip:]

    def __len__(self) -> int:
        return len(self.token_ids)


class RequestRejected(ValueError):
    """A request that cannot be served as asked; the message is for the client."""


def check_request(token_ids: list[int], params: SamplingParams, vocab_size: int, max_seq_len: int) -> None:
    """Raise RequestRejected saying why a prompt and its sampling parameters cannot run on a model of
    `vocab_size` tokens and a context of `max_seq_len`: the one check of the tokenizer, the scheduler
    and the offline LLM."""
    if not isinstance(params, SamplingParams):
        raise RequestRejected(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if not token_ids:
        raise RequestRejected("the prompt is empty")
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(
            f"token id {bad[0]} is out of vocabulary (size {vocab_size}; bad ids: {bad[:5]})"
        )
    try:
        params.validate(vocab_size)
    except (ValueError, TypeError) as e:
        raise RequestRejected(str(e)) from None
    if params.embed:
        if len(token_ids) > max_seq_len:
            raise RequestRejected(
                f"This model's maximum context length is {max_seq_len} tokens, however you requested "
                f"{len(token_ids)} tokens in the input. Please reduce the length of the input."
            )
        return
    total = len(token_ids) + params.max_tokens
    if total > max_seq_len:
        raise RequestRejected(
            context_error(
                max_seq_len, total, len(token_ids), params.max_tokens, len(token_ids) >= max_seq_len
            )
        )


def context_error(
    max_seq_len: int, total: int | str, prompt: int | str, completion: int | str, prompt_alone: bool = False
) -> str:
    """OpenAI's wording of a request longer than the context (clients such as LiteLLM and LangChain
    recognise it by "maximum context length"), with SGLang's sentence that its clients match on:
    `prompt_alone` when the prompt leaves no room for even one token ("is longer than the model's
    context length"), else "Requested token count exceeds the model's maximum context length"."""
    sglang = (
        f"The input ({prompt} tokens) is longer than the model's context length ({max_seq_len} tokens)."
        if prompt_alone
        else "Requested token count exceeds the model's maximum context length."
    )
    return (
        f"This model's maximum context length is {max_seq_len} tokens. However, you requested {total} "
        f"tokens ({prompt} in the messages, {completion} in the completion). {sglang} Please reduce the "
        "length of the messages or completion."
    )


# --------------------------------------------------------------------------------------------------
# The forward context. The engine sets it before each forward pass; attention layers read it, so
# model code never threads the batch through every call (mini-sglang's "guarded global context").


class AttentionBackendProto:
    """What an attention layer calls. Implementations live in `minisgl.attention`."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
    ) -> torch.Tensor:  # q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, D)
        raise NotImplementedError

    def forward_rope(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        layer_id: int,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """qkv (T, (Hq + 2 Hkv) D), the fused projection before RoPE; rope (cos, sin), (T, 1, D/2) each;
        `split(qkv)` -> rotated q, k, v (the ops backend's, Qwen3's per-head norms included);
        qk_norm: those norms (q's weight (D,), k's weight (D,), eps) or None. A backend that rotates
        (and norms) inside its own kernel overrides this; the default splits, then attends."""
        q, k, v = split(qkv)
        return self.forward(q, k, v, layer_id)


@dataclass
class Context:
    """What a forward pass may consult: the attention backend (prepared for the batch being run)."""

    attn_backend: AttentionBackendProto


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context | None) -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    if _GLOBAL_CTX is None:
        raise RuntimeError("no forward context is set: run the model through an Engine")
    return _GLOBAL_CTX


# --------------------------------------------------------------------------------------------------
# Requests and batches. The scheduler owns `Req`s and hands the engine a `Batch` of plain lists; only
# the engine turns them into tensors (nano-vllm's split).


class ReqStatus(enum.Enum):
    """Where a request is in the scheduler (nano-vllm's SequenceStatus, vLLM's RequestStatus)."""

    WAITING = "waiting"  # queued for KV pages, never admitted yet
    PREFILLING = "prefilling"  # holds pages for all its tokens; chunks of them still to launch
    DECODING = "decoding"  # every token launched: one new token per step
    RETRACTED = "retracted"  # lost its pages to a full pool; queued again to recompute its tokens
    FINISHED = "finished"  # stopped, reached its length or aborted; results in flight are dropped


_NEXT_STATUS: dict[ReqStatus, frozenset[ReqStatus]] = {
    ReqStatus.WAITING: frozenset({ReqStatus.PREFILLING, ReqStatus.FINISHED}),
    ReqStatus.PREFILLING: frozenset({ReqStatus.DECODING, ReqStatus.RETRACTED, ReqStatus.FINISHED}),
    ReqStatus.DECODING: frozenset({ReqStatus.RETRACTED, ReqStatus.FINISHED}),
    # (a token in flight when it was retracted may still end it: overlap scheduling)
    ReqStatus.RETRACTED: frozenset({ReqStatus.PREFILLING, ReqStatus.FINISHED}),
    ReqStatus.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request moved where its status does not lead (a scheduler bug, never a client's)."""


@dataclass(eq=False)
class Req:
    """One request's state in the scheduler.

    `token_ids` is the prompt followed by every token generated so far; the first `cached_len` of them
    have their K/V in the pool. `status` says where the request is (`ReqStatus`); `move_to` changes
    it, refusing a move its status does not lead to.
    """

    uid: int
    token_ids: list[int]
    sampling_params: SamplingParams
    prompt_len: int = -1
    cached_len: int = 0
    status: ReqStatus = field(default=ReqStatus.WAITING, init=False)  # every request starts waiting
    table_row: int = -1  # row in the page table while the request holds KV pages; -1 otherwise
    admit_seq: int = -1  # when it last got KV pages (the newest is retracted first when the pool is full)
    generator: torch.Generator | None = None  # per-request RNG when sampling_params.seed is set
    # Overlap scheduling: tokens that launched steps sampled for this request and the host has not
    # taken yet (at most 2, between launching a step and taking the previous one's tokens). Their
    # values are in the steps' StepOutputs: the scheduler hands the one in flight to the next launch,
    # which feeds the newest from the device.
    pending: int = 0
    # Prefix caching: `kv_ready_len` tokens have K/V computed (the steps that wrote them returned;
    # only these may enter the prefix cache); `cached_prompt_len` prompt tokens came from the prefix
    # cache when the request was first admitted (-1 before that; reported as usage).
    kv_ready_len: int = 0
    cached_prompt_len: int = -1
    # Prompt logprobs (sampling_params.prompt_logprobs set): those of prompt tokens 1.. received so
    # far; a request that wants them is prefilled whole (no prefix cache) until it has them all.
    prompt_logprobs: TokenLogprobs | None = None
    # Structured output (sampling_params.grammar): the request's matcher, made when it is admitted.
    grammar: Grammar | None = None
    # Embeddings (sampling_params.embed): the pooled hidden state of the chunks computed so far,
    # (H,) float32 (mean pooling: their sum), set as each step's result arrives.
    pooled: torch.Tensor | None = None

    def move_to(self, status: ReqStatus) -> None:
        """Change the status; IllegalTransition if the current one does not lead there."""
        if status not in _NEXT_STATUS[self.status]:
            raise IllegalTransition(
                f"request {self.uid}: {self.status.value} -> {status.value} is not a transition "
                f"(from {self.status.value}: {', '.join(sorted(s.value for s in _NEXT_STATUS[self.status])) or 'none'})"
            )
        self.status = status

    @property
    def finished(self) -> bool:
        """Ended (stop, length, abort): results still in flight for it are dropped."""
        return self.status is ReqStatus.FINISHED

    @property
    def holds_pages(self) -> bool:
        """Admitted and not retracted or finished since: its KV pages are in its page-table row."""
        return self.status is ReqStatus.PREFILLING or self.status is ReqStatus.DECODING

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must be computed (no prefix from the cache): prompt logprobs still
        to come, or an embedding (its pooling reads every position's hidden state)."""
        return self.wants_prompt_logprobs or self.sampling_params.embed

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet."""
        if self.sampling_params.prompt_logprobs is None:
            return False
        return self.prompt_logprobs is None or len(self.prompt_logprobs) < self.prompt_len - 1

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def decoding_output_len(self) -> int:
        """Output tokens once the pending one (if any) arrives."""
        return self.output_len + self.pending

    @property
    def remaining_len(self) -> int:
        """Tokens not yet in the KV pool (the next forward pass feeds them)."""
        return len(self.token_ids) - self.cached_len


@dataclass
class Batch:
    """One forward pass: for each request, feed `token_ids[cached_len : cached_len + extend_len]`.

    A request samples its next token when its chunk reaches the end of its tokens
    (`cached_len + extend_len == seq_len`; every decode row does); a partial prefill chunk samples
    nothing. `sample_mask` is fixed when the batch is made (the scheduler then advances `cached_len`).
    """

    reqs: list[Req]
    extend_lens: list[int]
    phase: str  # "prefill" or "decode"
    sample_mask: list[bool] = field(init=False)
    kv_ends: list[int] = field(init=False)  # per request: tokens with K/V once this step has run
    # per request: an embedding request whose prompt this step ends (its pooled state is its answer)
    embed_done: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        decode = self.phase == "decode"
        self.kv_ends = [r.cached_len + n for r, n in zip(self.reqs, self.extend_lens, strict=True)]
        ends = [decode or end == r.seq_len for r, end in zip(self.reqs, self.kv_ends, strict=True)]
        embeds = [r.sampling_params.embed for r in self.reqs]
        self.sample_mask = [e and not b for e, b in zip(ends, embeds, strict=True)]
        self.embed_done = [e and b for e, b in zip(ends, embeds, strict=True)]

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)
