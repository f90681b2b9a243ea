"""A launched step: its sampled tokens (and logprobs) on the device, copied to the host as they are
produced. It is also where a request's pending token lives (overlap scheduling): the scheduler keeps
the step it launched last in flight and hands it to the next launch, which feeds each pending token
from here, on the device, before the host has seen it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req, TokenLogprobs

from .logprobs import LogprobTensors

# What a step's logprobs come to on the host: uid -> its sampled token's; uid -> (first prompt
# position, logprobs of the prompt tokens after it).
StepLogprobLists = tuple[dict[int, TokenLogprobs], dict[int, tuple[int, TokenLogprobs]]]


class StepOutput:
    """The sampled tokens of a launched step, one per request whose chunk ends its tokens (in batch
    order), and the logprobs asked for. On a GPU they are copied to the host as they are produced
    (pinned memory, no wait); `tolist()` waits for them. `on_done(self)` runs once, when they are
    first taken; `launched_at` is when the launch began (perf_counter)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        batch: Batch,
        launched_at: float,
        logprobs: StepLogprobs | None = None,
        on_done: Callable[[StepOutput], None] | None = None,
        pooled: PooledRows | None = None,
    ) -> None:
        self.tokens = tokens  # (S,) int64 on the device
        self.batch, self.launched_at = batch, launched_at
        sampling = [r for r, s in zip(batch.reqs, batch.sample_mask, strict=True) if s]
        self.rows = {r.uid: i for i, r in enumerate(sampling)}  # uid -> its row of `tokens`
        self._on_done = on_done
        self._event: torch.cuda.Event | None = None
        self._logprobs = logprobs
        self._pooled_uids = pooled.uids if pooled is not None else []
        extra = logprobs.tensors() if logprobs is not None else []
        extra += [pooled.values] if pooled is not None else []  # last: read by `pooled()`
        if tokens.is_cuda:
            self._host = [_to_host(t) for t in (tokens, *extra)]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = [tokens, *extra]

    def host_tokens(self) -> torch.Tensor:
        """The sampled tokens on the host, once copied (without counting the step as taken)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host[0]

    def tolist(self) -> list[int]:
        tokens = self.host_tokens()
        if self._on_done is not None:  # the step is over: count it once
            self._on_done(self)
            self._on_done = None
        return tokens.tolist()

    def logprobs(self) -> StepLogprobLists:
        """After `tolist()`: uid -> logprobs of its sampled token; uid -> (first prompt position,
        logprobs of the prompt tokens after it) for requests that asked for them."""
        if self._logprobs is None:
            return {}, {}
        return self._logprobs.to_lists(self._host[1 : len(self._host) - bool(self._pooled_uids)])

    def pooled(self) -> dict[int, torch.Tensor]:
        """After `tolist()`: uid -> its embedding request's pooled rows of this step, (H,) float32
        on the host (see Engine._pool); empty when the step had none."""
        if not self._pooled_uids:
            return {}
        return dict(zip(self._pooled_uids, self._host[-1].unbind(0), strict=True))

    # -- pending tokens (overlap scheduling) ------------------------------------------------------------
    def row_of(self, req: Req) -> int:
        """The row of `req`'s token, which `req` has pending: the scheduler launches a request with a
        pending token only in the step right after the one that sampled it."""
        row = self.rows.get(req.uid)
        if row is None:
            raise RuntimeError(f"request {req.uid} has a pending token that the step before did not sample")
        return row

    def pending_token(self, req: Req) -> int:
        """`req`'s pending token on the host (waits for this step)."""
        return int(self.host_tokens()[self.row_of(req)])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class PooledRows:
    """A step's pooled hidden states of embedding requests: `values` (E, H) float32, row i `uids[i]`'s."""

    uids: list[int]
    values: torch.Tensor


@dataclass
class StepLogprobs:
    """A step's logprob tensors and whose they are: `sampled` rows in `sampled_uids` order (k each);
    `prompt` rows grouped per request as (uid, first position, count, k)."""

    sampled: LogprobTensors | None
    sampled_uids: list[tuple[int, int]]  # (uid, k)
    prompt: LogprobTensors | None
    prompt_groups: list[tuple[int, int, int, int]]

    def tensors(self) -> list[torch.Tensor]:
        return [
            *(self.sampled.tensors() if self.sampled else []),
            *(self.prompt.tensors() if self.prompt else []),
        ]

    def to_lists(self, host: list[torch.Tensor]) -> StepLogprobLists:
        sampled: dict[int, TokenLogprobs] = {}
        prompt: dict[int, tuple[int, TokenLogprobs]] = {}
        if self.sampled is not None:
            uids, ks = zip(*self.sampled_uids, strict=True)
            lists = LogprobTensors.from_tensors(host[:4]).split([1] * len(uids), list(ks))
            sampled = dict(zip(uids, lists, strict=True))
            host = host[4:]
        if self.prompt is not None:
            g = self.prompt_groups
            lists = LogprobTensors.from_tensors(host[:4]).split([c for *_, c, _ in g], [k for *_, k in g])
            prompt = {uid: (start, lp) for (uid, start, _, _), lp in zip(g, lists, strict=True)}
        return sampled, prompt
