"""Turn a batch's logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the inverse CDF: one uniform number per row, drawn from the request's own generator
when it has a seed (so its tokens do not depend on what else is in the batch) and otherwise from the
engine's seeded generator (the same on every tensor-parallel rank, so all ranks draw the same tokens).
"""

from __future__ import annotations

import torch

from minisgl.core import SamplingParams
from minisgl.utils.transfer import to_device


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def request_generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def sample(
        self,
        logits: torch.Tensor,  # (B, V) float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:  # (B,) int64
        kinds = [_kind(p) for p in params]
        if all(k == "greedy" for k in kinds):  # the fast path: no softmax, no sort, no random numbers
            return logits.argmax(dim=-1)
        # Each row by the method its own parameters call for, so that a seeded row's token never
        # depends on its batch mates; greedy rows keep their argmax.
        out = logits.argmax(dim=-1)
        for kind, method in (("full", self._sample_full), ("sorted", self._sample_sorted)):
            rows = [i for i, k in enumerate(kinds) if k == kind]
            if len(rows) == len(params):
                return method(logits, params, generators)
            if rows:
                idx = to_device(rows, logits.device, torch.int64)
                picked = method(
                    logits.index_select(0, idx), [params[i] for i in rows], [generators[i] for i in rows]
                )
                out.index_copy_(0, idx, picked)
        return out

    def _sample_full(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """No top-k, no top-p: the inverse CDF over the whole vocabulary in its own order, no sort
        (the sort of a (B, V) block dominated CPU steps at large batches)."""
        dev, f32 = logits.device, torch.float32
        temps = to_device([p.temperature for p in params], dev, f32)
        # (n, V). A row with NaN or +inf logits (or all -inf) has no mass: it takes its argmax below.
        probs = (logits.to(f32) / temps[:, None]).softmax(dim=-1).nan_to_num_(nan=0.0)
        cdf = probs.cumsum(dim=-1)  # (n, V)
        mass = cdf[:, -1]  # (n,)
        u = self._uniforms(generators, dev) * mass  # (n,) in [0, mass)
        choice = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)  # (n,)
        # Rounding can put u at the very top of the CDF: never past the last token with mass.
        last_kept = (probs > 0).cumsum(dim=-1).argmax(dim=-1)  # (n,) the first index of the max count
        choice = torch.minimum(choice, last_kept)
        return torch.where(mass > 0, choice, logits.argmax(dim=-1))

    def _sample_sorted(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Top-k and top-p: the inverse CDF over the tokens sorted by probability."""
        n, vocab = logits.shape
        dev = logits.device
        f32 = torch.float32  # whatever the logits' dtype, 1/T and the CDF need float32's range
        temps = to_device([p.temperature for p in params], dev, f32)
        top_k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], dev, torch.int64)
        top_p = to_device([p.top_p for p in params], dev, f32)
        sorted_logits, sorted_idx = (logits.to(f32) / temps[:, None]).sort(dim=-1, descending=True)  # (n, V)
        rank = torch.arange(vocab, device=dev)
        sorted_logits.masked_fill_(rank[None, :] >= top_k[:, None], float("-inf"))
        # (n, V), descending. A row with NaN or +inf logits (or all -inf) has NaN probabilities:
        # zeroed, it has no mass and falls back to its first sorted token below.
        probs = sorted_logits.softmax(dim=-1).nan_to_num_(nan=0.0)
        # top-p: keep the smallest prefix whose mass reaches top_p; the first token always stays,
        # even when top_p rounds to 0 in float32.
        probs.masked_fill_((probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (rank[None, :] > 0), 0.0)
        cdf = probs.cumsum(dim=-1)  # (n, V)
        u = self._uniforms(generators, dev) * cdf[:, -1]  # (n,) in [0, mass)
        choice = torch.searchsorted(cdf, u[:, None], right=True)  # (n, 1)
        # Rounding can put u at the very top of the CDF: never step past the last kept token (nor
        # below the first, for a row with no mass at all).
        last_kept = ((probs > 0).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
        choice = torch.minimum(choice, last_kept)
        return sorted_idx.gather(1, choice).squeeze(1)

    def _uniforms(self, generators: list[torch.Generator | None], dev: torch.device) -> torch.Tensor:
        """One U[0, 1) per row; unseeded rows share one draw from the engine's generator."""
        shared = [i for i, g in enumerate(generators) if g is None]
        u = torch.empty(len(generators), device=dev, dtype=torch.float64)
        if shared:
            u[to_device(shared, dev, torch.int64)] = torch.rand(
                len(shared), generator=self.generator, device=dev, dtype=torch.float64
            )
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g, device=dev, dtype=torch.float64)[0]
        return u.to(torch.float32)


def _kind(p: SamplingParams) -> str:
    """greedy: argmax; full: the whole vocabulary's CDF (no top-k, no top-p); sorted: top-k/top-p."""
    if p.is_greedy:
        return "greedy"
    return "full" if p.top_p >= 1.0 and p.top_k < 0 else "sorted"
