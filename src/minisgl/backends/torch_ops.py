"""The reference ops in plain torch: what every layer computes, written to match Hugging Face's
Llama/Qwen code (so float32 greedy decoding is token-identical to transformers). Faster backends
subclass `TorchOps` and override what they fuse; anything they don't take falls back here.

A weight is a tensor or a `QuantizedWeight` (a checkpoint's block format kept, `minisgl.quant`): the
reference dequantizes the latter to the activations' dtype at each use (correct, slow: the fast
backends read it as it is)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.quant import QuantizedWeight

from .fp8 import Fp8Weight, Weight

QkNorm = tuple[torch.Tensor, torch.Tensor, float]  # q's RMSNorm weight (D,), k's (D,), eps


class TorchOps:
    name = "torch"

    def prepare(self, is_decode: bool) -> None:
        """Called by the engine before each forward pass (a backend may pick kernels per pass)."""

    def adopt(self, model: torch.nn.Module) -> None:
        """Called once with the model whose layers this backend serves (`bind_ops`), after its weights
        are loaded: a backend may lay weights out for its kernels here."""

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., in) @ weight (out, in)^T (+ bias) -> (..., out). An fp8 weight, or one kept in a
        checkpoint's block format, is dequantized (the reference: what the checkpoint's numbers mean;
        no activation quantization)."""
        if isinstance(weight, (Fp8Weight, QuantizedWeight)):
            weight = weight.dequantize(x.dtype)
        return F.linear(x, weight, bias)

    def lm_head(self, h: torch.Tensor, weight: Weight) -> torch.Tensor:
        """The LM head's projection, h (B, hidden) @ weight (vocab rows, hidden)^T: its rows are one a
        sequence in every pass, a decode pass's shape even in a prefill (a backend may take its decode
        kernel for it)."""
        return self.linear(h, weight, None)

    def embedding(self, ids: torch.Tensor, weight: Weight) -> torch.Tensor:
        """ids (T,) -> rows of the (vocab, hidden) table, (T, hidden)."""
        if isinstance(weight, QuantizedWeight):
            return weight.lookup(ids)
        if isinstance(weight, Fp8Weight):
            raise TypeError("the embedding table stays in the model's dtype under fp8")
        return F.embedding(ids, weight)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """(..., N) -> weight * (x * rsqrt(mean(x^2) + eps)): statistics in float32, product in x's dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def norm_linear(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: Weight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """A projection of the normed residual stream: linear(rmsnorm(x)), (T, in) -> (T, out)."""
        return self.linear(self.rmsnorm(x, norm_weight, eps), weight, bias)

    def linear_add_(
        self,
        x: torch.Tensor,
        weight: Weight,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        gated: bool = False,
    ) -> torch.Tensor:
        """`residual += linear(x)` in place (the residual add after a projection; with `gated`, x is a
        gate/up pair and the projection takes silu(gate) * up). Returns residual."""
        if gated:
            x = self.silu_and_mul(x)
        return residual.add_(self.linear(x, weight, bias))

    def norm_mlp_add_(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up: Weight,
        down: Weight,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """SwiGLU over the normed residual stream: `residual += down(silu(gate) * up)` with [gate | up] =
        gate_up(rmsnorm(x)), x (T, in) (may be residual itself), no biases. Returns residual."""
        gate_up_out = self.norm_linear(x, norm_weight, eps, gate_up, None)  # (T, 2I)
        return self.linear_add_(gate_up_out, down, None, residual, gated=True)

    def rope_lookup(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (P, D/2) cos/sin tables at positions (T,) -> (cos, sin), each (T, 1, D/2)."""
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, H, D), cos/sin (T, 1, D/2) -> rotated x (T, H, D), contiguous (HF's rotate-half)."""
        x1, x2 = x.chunk(2, dim=-1)  # (T, H, D/2) each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def rope_qkv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        hq: int,
        hkv: int,
        d: int,
        qk_norm: QkNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv (T, (Hq + 2 Hkv) D) -> q (T, Hq, D), k (T, Hkv, D) rotated, v (T, Hkv, D); contiguous.
        qk_norm (q's weight, k's weight, eps): Qwen3's per-head RMSNorm of q and k before the
        rotation (here written back into qkv, the projection's own output)."""
        if qk_norm is not None:
            self.norm_qk_(qkv, hq, hkv, d, qk_norm)
        t = qkv.shape[0]
        # q and k rotated together: half the element-wise calls (they dominate small batches).
        qk = self.rotary(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)  # (T, Hq + Hkv, D)
        v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)  # a copy: the slice is strided
        return qk[:, :hq].contiguous(), qk[:, hq:].contiguous(), v.contiguous()

    def norm_qk_(self, qkv: torch.Tensor, hq: int, hkv: int, d: int, qk_norm: QkNorm) -> None:
        """Each q and k head of qkv (T, (Hq + 2 Hkv) D) RMSNormed in place (Qwen3)."""
        t, (qw, kw, eps) = qkv.shape[0], qk_norm
        q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views into qkv
        q.view(t, hq, d).copy_(self.rmsnorm(q.view(t, hq, d), qw, eps))
        k.view(t, hkv, d).copy_(self.rmsnorm(k.view(t, hkv, d), kw, eps))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2I) laid out [gate | up] -> silu(gate) * up, (T, I). Overwrites the gate half (the
        projection's own output, used once): one (T, I) temporary fewer, the same arithmetic."""
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.mul(F.silu(gate, inplace=True), up)

    def route(
        self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H), router (E, H) -> each token's top-k experts: weights (T, K) float32 and ids
        (T, K) int64, as transformers routes: logits in x's dtype, a float32 softmax over all E,
        torch.topk (whose choice among exactly tied probabilities the CUDA backend does not copy:
        it takes the lower expert index, `kernels.triton.moe.route`), with `renormalize` the k
        weights divided by their sum."""
        probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)  # (T, E)
        weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, K) each
        if renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def moe(
        self,
        x: torch.Tensor,
        router: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Routed experts: x (T, H), router (E, H), w13 (E, 2I, H) each expert's [gate | up] rows, w2
        (E, H, I) -> (T, H) = sum over each token's top-k experts e of weight * w2[e] @
        (silu(gate_e x) * up_e x). Written as transformers' loop: one pass per expert that has
        tokens, its outputs added in expert order. With `residual` (T, H): `residual += that` in
        place, returned."""
        weights, ids = self.route(x, router, top_k, renormalize)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # ascending
            rows, slot = torch.where(ids == e)  # the tokens sent to expert e, and which of their k
            h = self.silu_and_mul(F.linear(x[rows], w13[e]))  # (n, I)
            y = F.linear(h, w2[e]) * weights[rows, slot, None]  # (n, H), float32
            out.index_add_(0, rows, y.to(out.dtype))
        return out if residual is None else residual.add_(out)

    def norm_moe_(
        self,
        h: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        router: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        """Routed experts over the normed residual stream: `h += moe(rmsnorm(h))` in place, h (T, H).
        Returns h."""
        x = self.rmsnorm(h, norm_weight, eps)
        return self.moe(x, router, w13, w2, top_k, renormalize, residual=h)


REFERENCE_OPS = TorchOps()


class OpsUser:
    """A layer that computes through an ops backend: the reference until `bind_ops` sets another."""

    ops: TorchOps = REFERENCE_OPS
