"""Log probabilities: the model's log-softmax of the raw logits (before penalties, biases and
temperature: what OpenAI and vLLM return by default), of the chosen tokens and of the `k` most
likely ones, computed in batched ops on the logits' device and copied to the host with the tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import TokenLogprobs


@dataclass
class LogprobTensors:
    """`TokenLogprobs` of several positions as device (or host) tensors; `top` holds max(k) columns."""

    token_ids: torch.Tensor  # (n,) int64
    logprobs: torch.Tensor  # (n,) float32
    top_ids: torch.Tensor  # (n, k) int64
    top_logprobs: torch.Tensor  # (n, k) float32

    @staticmethod
    def of(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
        """logits (n, V), chosen token_ids (n,) on the same device, k alternatives per position."""
        lp = logits.to(torch.float32).log_softmax(dim=-1)  # (n, V)
        chosen = lp.gather(1, token_ids[:, None]).squeeze(1)  # (n,)
        top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], token_ids[:, None][:, :0])
        return LogprobTensors(token_ids, chosen, top_ids, top_lp)

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_ids, self.logprobs, self.top_ids, self.top_logprobs]

    @staticmethod
    def from_tensors(ts: list[torch.Tensor]) -> LogprobTensors:
        return LogprobTensors(*ts)

    def split(self, counts: list[int], ks: list[int]) -> list[TokenLogprobs]:
        """Host lists for consecutive groups of `counts` positions, each with its own k."""
        ids, lps = self.token_ids.tolist(), self.logprobs.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        out, start = [], 0
        for n, k in zip(counts, ks, strict=True):
            end = start + n
            out.append(
                TokenLogprobs(
                    ids[start:end],
                    lps[start:end],
                    [row[:k] for row in top_ids[start:end]],
                    [row[:k] for row in top_lps[start:end]],
                )
            )
            start = end
        return out
