"""Turn a batch's logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the inverse CDF: one uniform number per row, drawn from the request's own generator
when it has a seed (so its tokens do not depend on what else is in the batch) and otherwise from the
engine's seeded generator (the same on every tensor-parallel rank, so all ranks draw the same tokens).
"""

from __future__ import annotations

import torch

from minisgl.core import SamplingParams
from minisgl.utils.transfer import to_device

# How many of a row's most likely tokens top-k/top-p sampling orders (`Sampler._sample_sorted`), in
# turn: most nuclei fit in the first (topk of 64 cost 0.17 ms of a 49,152-token row on the 2-core
# Xeon, of 1,024 0.3-0.6 ms, the whole row's sort 4.5 ms).
_CANDIDATES = (64, 1024)


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # Whether the sampler may look at the device's numbers to skip work (whether every nucleus
        # fits among the candidates, whether a row has no mass): free on the CPU, a wait for the
        # forward pass on a GPU, where the whole-row work is cheap and stays queued behind it instead.
        self.host_checks = device.type == "cpu"
        self.candidates: tuple[int, ...] | None = _CANDIDATES if self.host_checks else None
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
        for kind, method in (("full", self._sample_full), ("sorted", self._sample_sorted)):
            if all(k == kind for k in kinds):
                return method(logits, params, generators)
        out = logits.argmax(dim=-1)
        for kind, method in (("full", self._sample_full), ("sorted", self._sample_sorted)):
            rows = [i for i, k in enumerate(kinds) if k == kind]
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
        # u in [0, mass): rounding can put u * mass at mass itself, past the CDF's last rise; the
        # float just under it selects the last token with mass, as an exact u would at most.
        u = torch.minimum(
            self._uniforms(generators, dev) * mass, torch.nextafter(mass, torch.zeros_like(mass))
        )
        choice = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)  # (n,)
        if self.host_checks and bool((mass > 0).all()):
            return choice
        return torch.where(mass > 0, choice, logits.argmax(dim=-1))

    def _sample_sorted(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Top-k and top-p: the inverse CDF over the tokens by descending probability. Only a row's
        most likely tokens are ordered, with `topk` (`_CANDIDATES` of them, or its top_k if more),
        not the whole vocabulary: a nucleus is almost always far smaller (sorting a 49,152-token row
        took ~40% of a CPU decode step at batch 1). While a row's nucleus does not end among them
        (a flat distribution with top_p near 1) the batch tries the next size, then the full sort;
        a GPU sorts the whole row at once (`candidates` None: see __init__)."""
        vocab, dev = logits.shape[1], logits.device
        f32 = torch.float32  # whatever the logits' dtype, 1/T and the CDF need float32's range
        ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        temps = to_device([p.temperature for p in params], dev, f32)
        top_k = to_device(ks, dev, torch.int64)
        top_p = to_device([p.top_p for p in params], dev, f32)
        scaled = logits.to(f32) / temps[:, None]  # (n, V)
        need = max([0, *(k for k in ks if k < vocab)])  # every row's top-k among the candidates
        sizes = [c for c in self.candidates or () if need <= c < vocab]
        if self.candidates and need > self.candidates[-1]:  # a top_k past the sizes: its own
            sizes = [need]
        full_z = None
        for cand in sizes:
            top = scaled.topk(cand, dim=-1)  # (n, C) each, descending
            if full_z is None:  # the softmax's normalizer over the whole row (rows without top-k)
                peak = top.values[:, :1]  # (n, 1) each row's largest
                full_z = (scaled - peak).exp().sum(dim=-1, keepdim=True)  # (n, 1)
            picked = self._sample_candidates(top, vocab, peak, full_z, top_k, top_p, generators)
            if picked is not None:
                return picked
        return self._sample_sorted_full(scaled, top_k, top_p, generators)

    def _sample_candidates(
        self,
        top: torch.return_types.topk,  # the (n, C) largest of logits / T and their token ids
        vocab: int,
        peak: torch.Tensor,  # (n, 1) each row's largest
        full_z: torch.Tensor,  # (n, 1) sum of exp(scaled - peak) over the row
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        generators: list[torch.Generator | None],
    ) -> torch.Tensor | None:
        """`_sample_sorted` over each row's C most likely tokens; None (nothing drawn) if a row's
        nucleus does not end among them."""
        top_logits, top_idx = top.values, top.indices
        dev, cand = top_logits.device, top_logits.shape[1]
        rank = torch.arange(cand, device=dev)
        top_logits.masked_fill_(rank[None, :] >= top_k[:, None], float("-inf"))
        # The softmax over the kept tokens: top-k's among the candidates, or the whole row. A row
        # with NaN or +inf logits (or all -inf) has NaN probabilities: zeroed, it has no mass and
        # falls back to its first candidate below.
        e = (top_logits - peak).exp()  # (n, C)
        z = torch.where(top_k[:, None] < vocab, e.sum(dim=-1, keepdim=True), full_z)
        probs = (e / z).nan_to_num_(nan=0.0)
        # top-p: keep the smallest prefix whose mass reaches top_p; the first token always stays,
        # even when top_p rounds to 0 in float32.
        before = probs.cumsum(dim=-1) - probs  # (n, C) the mass ahead of each candidate
        if bool(((before[:, -1] + probs[:, -1] < top_p) & (top_k >= vocab) & (z[:, 0] > 0)).any()):
            return None
        probs.masked_fill_((before >= top_p[:, None]) & (rank[None, :] > 0), 0.0)
        return self._pick(probs, top_idx, generators, dev)

    def _sample_sorted_full(
        self,
        scaled: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """`_sample_sorted` over the whole vocabulary sorted (a nucleus past the candidates)."""
        vocab, dev = scaled.shape[1], scaled.device
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # (n, V)
        rank = torch.arange(vocab, device=dev)
        sorted_logits.masked_fill_(rank[None, :] >= top_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1).nan_to_num_(nan=0.0)
        probs.masked_fill_((probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (rank[None, :] > 0), 0.0)
        return self._pick(probs, sorted_idx, generators, dev)

    def _pick(
        self,
        probs: torch.Tensor,  # (n, C) by descending probability, zero past each row's kept tokens
        idx: torch.Tensor,  # (n, C) their token ids
        generators: list[torch.Generator | None],
        dev: torch.device,
    ) -> torch.Tensor:
        """One token per row by the inverse CDF of `probs`."""
        cdf = probs.cumsum(dim=-1)  # (n, C)
        u = self._uniforms(generators, dev) * cdf[:, -1]  # (n,) in [0, mass)
        choice = torch.searchsorted(cdf, u[:, None], right=True)  # (n, 1)
        # Rounding can put u at the very top of the CDF: never step past the last kept token (nor
        # below the first, for a row with no mass at all).
        last_kept = ((probs > 0).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
        choice = torch.minimum(choice, last_kept)
        return idx.gather(1, choice).squeeze(1)

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
