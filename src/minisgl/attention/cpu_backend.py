"""The CPU attention backend: the torch reference with its fresh-prefill and decode paths replaced.

- float32 activations with minisgl's C kernels built (`minisgl.kernels`), over a float32 or a
  float16 pool (the C kernels convert float16 K/V themselves): decode reads each request's K/V
  straight from its pages (no copy, no padding), and so does prefill, fresh or over a cached prefix:
  the extend kernel takes each request's new tokens in blocks, converts the K/V a block sees once
  and runs the block's query rows against it (no gather, no padding); fresh prompts' causal
  attention outside `forward_rope` runs per request and head in C. Given the projection before RoPE
  (`forward_rope`), one C pass rotates q and k and writes k and v into the pool, and the new tokens
  then attend through the paged kernels, fresh prompts too: all of them read K/V as the pool keeps it
  (float16 there, float32 or float16 here);
- otherwise (other dtypes, no C compiler): explicit-score matmuls instead of
  `scaled_dot_product_attention`, whose CPU flash kernel is slow for these shapes (a few query rows
  per KV head, or a short causal block): decode over the reference's contiguous copy, fresh prompts
  up to `_MATMUL_PREFILL_MAX` tokens with their G query heads stacked per KV head.
Without the kernels, prefill over a cached prefix keeps the reference path. Results equal the
reference up to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl import kernels
from minisgl.kvcache import KVPool

from .base import AttnInput
from .torch_backend import TorchAttentionBackend, _Meta

_MATMUL_PREFILL_MAX = 1024  # fresh prefills longer than this use SDPA (the scores are Hq * n^2 floats)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(
        self,
        pool: KVPool,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 0,
        max_pages_per_row: int = 0,
    ) -> None:
        """max_batch_size, max_pages_per_row: decode batches up to this size keep their metadata in
        buffers whose addresses never change (what a recorded decode step, `engine.cpu_graph`, reads)."""
        super().__init__(pool, num_q_heads, num_kv_heads, head_dim, dtype)
        kernel = (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and pool.dtype in (torch.float32, torch.float16)
            and kernels.available()
        )
        self.decode_kernel = kernel  # decode reads the paged pool directly
        self.prefill_kernel = kernel  # fresh prompts' causal attention likewise
        self._page_rows: torch.Tensor | None = None  # decode kernel: (B, P) int32, extend: (T, P)
        self._seq_lens: torch.Tensor | None = None  # decode kernel: (B,) int32, extend: (T,)
        self._starts: torch.Tensor | None = None  # prefill kernel: (B + 1,) int64 row offsets
        # prefill over the pool (fresh via forward_rope, extend): page rows (B, P) int32, lengths (B,)
        # int32, the new tokens' row offsets (B + 1,) int64
        self._ext: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._causal: list[torch.Tensor] | None = None  # matmul prefill: additive (G * n, n) per request
        self._scores_mask: torch.Tensor | None = None  # matmul decode: additive (B * Hkv, G, Lmax)
        # Decode metadata of up to max_batch_size requests: page rows (B, P) of a fixed width,
        # lengths (B,), KV slots (B,) (-1: a padding row, nothing stored)
        self.static_rows = max_batch_size if kernel else 0
        self._dec_pages = torch.zeros(self.static_rows, max(max_pages_per_row, 1), dtype=torch.int32)
        self._dec_lens = torch.zeros(self.static_rows, dtype=torch.int32)
        self._dec_slots = torch.full((self.static_rows,), -1, dtype=torch.int64)

    # -- per batch ------------------------------------------------------------------------------------
    def _prepare_fresh(self, inp: AttnInput, common: dict) -> _Meta:
        self._starts = self._causal = None
        if self.prefill_kernel:
            self._starts = torch.tensor([0, *inp.extend_lens], dtype=torch.int64).cumsum(0)  # (B + 1,)
            self._ext = self._request_rows(inp, self._starts)  # forward_rope: the paged prefill kernel
        elif max(inp.extend_lens) <= _MATMUL_PREFILL_MAX:
            self._causal = self._causal_masks(inp.extend_lens)
        return super()._prepare_fresh(inp, common)

    def _prepare_decode(self, inp: AttnInput, common: dict) -> _Meta:
        if self.decode_kernel:
            bsz, pages = inp.page_rows.shape
            if bsz <= self.static_rows and pages <= self._dec_pages.shape[1]:  # into the fixed buffers
                self._dec_pages[:bsz, :pages].copy_(inp.page_rows)
                self._dec_lens[:bsz].copy_(torch.tensor(inp.seq_lens, dtype=torch.int32))
                self._dec_slots[:bsz].copy_(inp.out_slots)
                self._page_rows, self._seq_lens = self._dec_pages[:bsz], self._dec_lens[:bsz]
                common = {**common, "out_slots": self._dec_slots[:bsz]}
            else:
                self._page_rows = inp.page_rows.contiguous()
                self._seq_lens = torch.tensor(inp.seq_lens, dtype=torch.int32)
            return _Meta(kind="decode", **common)
        meta = super()._prepare_decode(inp, common)
        self._scores_mask = None
        if meta.mask is not None:
            bsz, hkv, n = inp.batch_size, self.num_kv_heads, common["max_seq_len"]
            self._scores_mask = meta.mask.expand(bsz, hkv, self.group, n).reshape(bsz * hkv, self.group, n)
        return meta

    def _prepare_extend(self, inp: AttnInput, common: dict) -> _Meta:
        if not self.decode_kernel:
            return super()._prepare_extend(inp, common)
        starts = torch.tensor([0, *inp.extend_lens], dtype=torch.int64).cumsum(0)  # (B + 1,)
        self._ext = self._request_rows(inp, starts)
        return _Meta(kind="extend", **common)

    @staticmethod
    def _request_rows(
        inp: AttnInput, starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The extend kernel's metadata: page rows (B, P) int32, lengths (B,) int32, starts (B + 1,)."""
        lens = torch.tensor(inp.seq_lens, dtype=torch.int32)
        return inp.page_rows.to(torch.int32).contiguous(), lens, starts

    def _causal_masks(self, lens: list[int]) -> list[torch.Tensor]:
        """Per request an additive causal mask (G * n, n), the G query heads of a KV head stacked."""
        neg = torch.finfo(self.dtype).min
        out = []
        for n in lens:
            m = torch.full((n, n), neg, dtype=self.dtype).triu_(1)  # (n, n): 0 on and below the diagonal
            out.append(m.repeat(self.group, 1))  # (G * n, n)
        return out

    # -- per layer ------------------------------------------------------------------------------------
    def forward_rope(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        layer_id: int,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        m = self.meta
        if (
            not self.decode_kernel or m is None or self.head_dim % 2 or not kernels.fits(qkv)
            or qk_norm is not None  # the C pass rotates without norms: `split` norms first
        ):  # fmt: skip
            return super().forward_rope(qkv, rope, split, layer_id, qk_norm)
        t = qkv.shape[0]
        cos, sin = rope  # (T, 1, D/2) each
        q = kernels.rope_store(
            qkv, cos.view(t, -1), sin.view(t, -1), self.num_q_heads, self.num_kv_heads, self.head_dim,
            m.out_slots, self.pool.k[layer_id], self.pool.v[layer_id],
        )  # fmt: skip
        if m.kind in ("fresh", "extend"):
            return self._paged_prefill(q, layer_id)  # (T, Hq, D)
        return self._paged(q, layer_id)  # (T, Hq, D)

    def _fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: _Meta) -> torch.Tensor:
        if self._starts is not None:
            return kernels.prefill_attention(
                q.contiguous(), k.contiguous(), v.contiguous(), self._starts, self.head_dim**-0.5
            )
        if self._causal is not None:
            return self._fresh_prefill_matmul(q, k, v, m.extend_lens, self._causal)
        return super()._fresh_prefill(q, k, v, m)

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, m: _Meta
    ) -> torch.Tensor:
        if self.decode_kernel:
            return self._paged(q, layer_id)  # (T=B, Hq, D)
        bsz, hkv, d, n = m.batch_size, self.num_kv_heads, self.head_dim, m.max_seq_len
        kk, vv = self._decode_kv(k, v, layer_id, m)  # (B, Hkv, Lmax, D)
        kk, vv = kk.reshape(bsz * hkv, n, d), vv.reshape(bsz * hkv, n, d)
        qq = q.reshape(bsz * hkv, self.group, d)  # a KV head's G query heads as G rows
        if self._scores_mask is None:
            s = torch.bmm(qq, kk.transpose(1, 2)).mul_(d**-0.5)  # (B * Hkv, G, Lmax)
        else:
            s = torch.baddbmm(self._scores_mask, qq, kk.transpose(1, 2), alpha=d**-0.5)
        return torch.bmm(s.softmax(-1), vv).view(bsz, self.num_q_heads, d)  # (T=B, Hq, D)

    def _extend(self, q: torch.Tensor, layer_id: int, m: _Meta) -> torch.Tensor:
        if not self.decode_kernel:
            return super()._extend(q, layer_id, m)
        return self._paged_prefill(q, layer_id)  # (T, Hq, D)

    def _paged_prefill(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """The extend kernel over the pool: each request's new tokens against its pages."""
        if self._ext is None:
            raise RuntimeError("attention before prepare(): no batch metadata")
        page_rows, seq_lens, starts = self._ext
        return kernels.extend_attention(
            q.contiguous(),
            self.pool.k[layer_id],
            self.pool.v[layer_id],
            page_rows,
            seq_lens,
            starts,
            self.pool.page_size,
            self.head_dim**-0.5,
        )

    def _paged(self, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """The decode kernel over the pool: one query row per entry of _page_rows/_seq_lens."""
        if self._page_rows is None or self._seq_lens is None:
            raise RuntimeError("attention before prepare(): no batch metadata")
        return kernels.decode_attention(
            q.contiguous(),
            self.pool.k[layer_id],
            self.pool.v[layer_id],
            self._page_rows,
            self._seq_lens,
            self.pool.page_size,
            self.head_dim**-0.5,
        )

    def _fresh_prefill_matmul(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lens: list[int],
        causal: list[torch.Tensor],
    ) -> torch.Tensor:
        """Per request and KV head, its G query heads stacked as G * n rows, so grouped-query
        attention is one bmm without K/V expansion."""
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        outs = []
        for qi, ki, vi, mask in zip(q.split(lens), k.split(lens), v.split(lens), causal, strict=True):
            n = qi.shape[0]
            qq = qi.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)  # (Hkv, G * n, D)
            s = torch.baddbmm(mask, qq, ki.permute(1, 2, 0), alpha=d**-0.5)  # (Hkv, G * n, n)
            o = torch.bmm(s.softmax(-1), vi.transpose(0, 1))  # (Hkv, G * n, D)
            outs.append(o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hkv * g, d))  # (n, Hq, D)
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, Hq, D)
