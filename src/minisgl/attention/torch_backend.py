"""The reference attention backend in plain torch (CPU and GPU).

Per batch (`prepare`): the pool slot of every cached position of every request as one padded
(B, Lmax) index, and an additive mask. Per layer (`forward`): store the new K/V in the pool, then
attend with one `scaled_dot_product_attention` call:

- prefill of fresh prompts (nothing cached): per request, causal attention over its own new K/V;
- prefill with a cached prefix (chunked prefill): gather K/V with one `index_select` into
  (B, Hkv, Lmax, D), queries padded to (B, Hq, Nmax, D), a causal mask offset by each prefix;
- decode: queries folded as (B, Hkv, G, D) (a KV group's heads act as query positions), so
  grouped-query attention needs no K/V expansion. Consecutive decode steps of the same requests keep
  their K/V in a contiguous per-batch copy and only append the new token (the paged pool stays the
  source of truth); any other batch rebuilds that copy with one gather.

On the CPU, decode and short fresh prefills use two batched matmuls and a softmax instead of
`scaled_dot_product_attention`, whose CPU flash kernel is slow for these shapes (a few query rows per
KV head, or a short causal block): ~20% less time for decode attention, ~30% for prefill. The result
is the same attention up to float32 rounding. GPUs keep SDPA.

With float32 on a CPU where minisgl's C kernels could be built (`minisgl.kernels`), decode reads each
request's K/V straight from its pages (no copy, no padding) and fresh prompts' causal attention runs
per request and head in C; prefill over a cached prefix keeps the torch path. `decode_kernel` and
`prefill_kernel` turn these off per backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl import kernels
from minisgl.kvcache import KVPool

from .base import AttentionBackend, AttnInput

_DECODE_CACHE_SLACK = 64  # positions a decode copy can grow before it is rebuilt
_MATMUL_PREFILL_MAX = 1024  # fresh prefills longer than this use SDPA (the scores are Hq * n^2 floats)


@dataclass
class _Meta:
    kind: str  # "fresh" (prefill, nothing cached), "extend" (prefill over a prefix), "decode"
    out_slots: torch.Tensor  # (T,) int64: pool slot of each new token
    batch_size: int
    max_seq_len: int
    max_extend_len: int
    extend_lens: list[int]
    kv_idx: torch.Tensor | None = None  # (B * Lmax,) int64 slots per padded position (pad -> zero page)
    mask: torch.Tensor | None = None  # additive: decode (B, 1, 1, Lmax), extend (B, 1, Nmax, Lmax)
    q_rows: torch.Tensor | None = None  # extend: (T,) row of each new token in the (B * Nmax) layout
    new_pos: torch.Tensor | None = None  # decode: (B,) position of the new token
    rebuild: bool = True  # decode: refill the contiguous copy from the pool in this step
    page_rows: torch.Tensor | None = None  # decode with the CPU kernel: (B, P) int32 page-table rows
    seq_lens: torch.Tensor | None = None  # decode with the CPU kernel: (B,) int32
    copy_idx: torch.Tensor | None = None  # decode: (B * Hkv,) row of each new K/V in the flat copy
    scores_mask: torch.Tensor | None = None  # CPU decode: additive (B * Hkv, G, Lmax), or None
    causal: list[torch.Tensor] | None = None  # CPU fresh prefill: additive (G * n, n) per request
    starts: torch.Tensor | None = None  # fresh prefill with the CPU kernel: (B + 1,) int64 row offsets


@dataclass
class _DecodeCopy:
    """Contiguous K/V of the current decode batch, per layer (B, Hkv, cap, D)."""

    row_ids: list[int]
    seq_lens: list[int]
    cap: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]


class TorchAttentionBackend(AttentionBackend):
    decode_copy_budget = 512 << 20  # bytes; larger decode batches gather from the pool every layer

    def __init__(self, pool: KVPool, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.pool = pool
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_q_heads // num_kv_heads
        self.device = pool.k[0].device
        self.dtype = pool.k[0].dtype
        self.meta: _Meta | None = None
        self._copy: _DecodeCopy | None = None
        # CPU float32 decode reads the paged pool directly with the C kernel (minisgl.kernels)
        self.decode_kernel = self.device.type == "cpu" and self.dtype == torch.float32 and kernels.available()
        self.prefill_kernel = self.decode_kernel  # fresh prompts' causal attention likewise

    # -- per batch ------------------------------------------------------------------------------------
    def prepare(self, inp: AttnInput) -> None:
        bsz, max_len, max_ext = len(inp.seq_lens), max(inp.seq_lens), max(inp.extend_lens)
        common = dict(
            out_slots=inp.out_slots,
            batch_size=bsz,
            max_seq_len=max_len,
            max_extend_len=max_ext,
            extend_lens=list(inp.extend_lens),
        )
        if inp.is_decode:
            self.meta = self._prepare_decode(inp, common)
            return
        self._copy = None  # the running set may change after a prefill: rebuild at the next decode
        if inp.seq_lens == inp.extend_lens:
            if self.prefill_kernel:
                starts = torch.tensor([0, *inp.extend_lens], dtype=torch.int64).cumsum(0)  # (B + 1,)
                self.meta = _Meta(kind="fresh", starts=starts, **common)
            else:
                self.meta = _Meta(kind="fresh", causal=self._causal_masks(inp.extend_lens), **common)
            return
        seq_lens = torch.tensor(inp.seq_lens, dtype=torch.int64)  # (B,)
        ext_lens = torch.tensor(inp.extend_lens, dtype=torch.int64)  # (B,)
        kv_idx, pos = self._gather_index(inp, seq_lens, max_len)
        cached = seq_lens - ext_lens  # (B,)
        i = torch.arange(max_ext, dtype=torch.int64)  # (Nmax,)
        # Padded query rows (i >= extend_len) copy the last real row so no row is fully masked.
        i = torch.minimum(i[None, :], ext_lens[:, None] - 1)  # (B, Nmax)
        allowed = pos[None, None, :] <= (cached[:, None] + i)[:, :, None]  # (B, Nmax, Lmax)
        mask = self._additive(allowed[:, None])  # (B, 1, Nmax, Lmax)
        q_rows = None
        if bsz > 1:
            starts = torch.arange(bsz, dtype=torch.int64) * max_ext  # (B,)
            q_rows = (torch.repeat_interleave(starts, ext_lens) + _ranges(ext_lens)).to(self.device)  # (T,)
        self.meta = _Meta(kind="extend", kv_idx=kv_idx, mask=mask, q_rows=q_rows, **common)

    def _prepare_decode(self, inp: AttnInput, common: dict) -> _Meta:
        max_len = common["max_seq_len"]
        if self.decode_kernel:
            return _Meta(
                kind="decode",
                page_rows=inp.page_rows.contiguous(),
                seq_lens=torch.tensor(inp.seq_lens, dtype=torch.int32),
                **common,
            )
        seq_lens = torch.tensor(inp.seq_lens, dtype=torch.int64)  # (B,)
        mask = None
        if any(n != max_len for n in inp.seq_lens):
            pos = torch.arange(max_len, dtype=torch.int64)
            mask = self._additive((pos[None, :] < seq_lens[:, None])[:, None, None])  # (B, 1, 1, Lmax)
        meta = _Meta(kind="decode", mask=mask, new_pos=(seq_lens - 1).to(self.device), **common)
        if mask is not None and self.device.type == "cpu":
            bsz, hkv = len(inp.seq_lens), self.num_kv_heads
            meta.scores_mask = mask.expand(bsz, hkv, self.group, max_len).reshape(bsz * hkv, self.group, -1)
        c = self._copy
        if (
            c is not None
            and inp.row_ids is not None
            and c.row_ids == inp.row_ids
            and max_len <= c.cap
            and all(n == p + 1 for n, p in zip(inp.seq_lens, c.seq_lens, strict=True))
        ):
            c.seq_lens = list(inp.seq_lens)
            meta.rebuild = False
            meta.copy_idx = self._copy_index(seq_lens - 1, c.cap)
            return meta
        meta.kv_idx, _ = self._gather_index(inp, seq_lens, max_len)
        self._copy = self._new_copy(inp, max_len)
        return meta

    def _copy_index(self, new_pos: torch.Tensor, cap: int) -> torch.Tensor:
        """(B * Hkv,) rows of the new tokens in a copy viewed as (B * Hkv * cap, D): one index_copy_
        per layer writes them, cheaper than advanced-index assignment."""
        bsz, hkv = new_pos.shape[0], self.num_kv_heads
        b = torch.arange(bsz, dtype=torch.int64)[:, None] * (hkv * cap)
        h = torch.arange(hkv, dtype=torch.int64)[None, :] * cap
        return (b + h + new_pos[:, None]).reshape(-1).to(self.device)

    def _causal_masks(self, lens: list[int]) -> list[torch.Tensor] | None:
        """CPU only: per request an additive causal mask (G * n, n), the G query heads of a KV head
        stacked (see `_fresh_prefill`); None when some prompt is too long for explicit scores."""
        if self.device.type != "cpu" or max(lens) > _MATMUL_PREFILL_MAX:
            return None
        neg = torch.finfo(self.dtype).min
        out = []
        for n in lens:
            m = torch.full((n, n), neg, dtype=self.dtype).triu_(1)  # (n, n): 0 on and below the diagonal
            out.append(m.repeat(self.group, 1))  # (G * n, n)
        return out

    def _new_copy(self, inp: AttnInput, max_len: int) -> _DecodeCopy | None:
        if inp.row_ids is None:
            return None
        cap = max_len + _DECODE_CACHE_SLACK
        shape = (len(inp.seq_lens), self.num_kv_heads, cap, self.head_dim)
        nbytes = 2 * self.pool.num_layers * torch.Size(shape).numel() * self.pool.k[0].element_size()
        if nbytes > self.decode_copy_budget:
            return None
        old = self._copy
        if old is not None and old.k[0].shape == shape:  # reuse the buffers
            return _DecodeCopy(list(inp.row_ids), list(inp.seq_lens), cap, old.k, old.v)
        # Zeroed, not empty: positions past a short request's length are masked, but a masked NaN
        # from uninitialised memory would still poison the softmax. Later reuse leaves finite values.
        alloc = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * self.pool.num_layers)
        ]
        n = self.pool.num_layers
        return _DecodeCopy(list(inp.row_ids), list(inp.seq_lens), cap, alloc[:n], alloc[n:])

    def _gather_index(
        self, inp: AttnInput, seq_lens: torch.Tensor, max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B * Lmax,) pool slots of every cached position (padding -> the zero page), and positions."""
        ps = self.pool.page_size
        pos = torch.arange(max_len, dtype=torch.int64)  # (Lmax,)
        pages = inp.page_rows[:, pos // ps].to(torch.int64)  # (B, Lmax)
        valid = pos[None, :] < seq_lens[:, None]  # (B, Lmax)
        kv_idx = torch.where(valid, pages * ps + pos % ps, self.pool.pad_slot)  # (B, Lmax)
        return kv_idx.reshape(-1).to(self.device), pos

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        neg = torch.finfo(self.dtype).min
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, neg)
        return mask.to(self.device)

    # -- per layer ------------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        m = self.meta
        assert m is not None, "prepare() must run before forward()"
        self.pool.store(layer_id, m.out_slots, k, v)
        if m.kind == "fresh":
            if m.starts is not None:
                return kernels.prefill_attention(
                    q.contiguous(), k.contiguous(), v.contiguous(), m.starts, self.head_dim**-0.5
                )
            if m.causal is not None:
                return self._fresh_prefill_matmul(q, k, v, m)
            return self._fresh_prefill(q, k, v, m.extend_lens)
        if m.kind == "decode":
            if m.page_rows is not None:
                return kernels.decode_attention(
                    q.contiguous(),
                    self.pool.k[layer_id],
                    self.pool.v[layer_id],
                    m.page_rows,
                    m.seq_lens,
                    self.pool.page_size,
                    self.head_dim**-0.5,
                )
            return self._decode(q, k, v, layer_id, m)
        return self._extend(q, layer_id, m)

    def _gather(self, layer_id: int, m: _Meta) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the batch from the pool: (B, Hkv, Lmax, D) each (strided views)."""
        assert m.kv_idx is not None
        shape = (m.batch_size, m.max_seq_len, self.num_kv_heads, self.head_dim)
        kk = self.pool.k[layer_id].index_select(0, m.kv_idx).view(shape).transpose(1, 2)
        vv = self.pool.v[layer_id].index_select(0, m.kv_idx).view(shape).transpose(1, 2)
        return kk, vv

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, m: _Meta
    ) -> torch.Tensor:
        bsz, hkv, d, n = m.batch_size, self.num_kv_heads, self.head_dim, m.max_seq_len
        c = self._copy
        if c is None:
            kk, vv = self._gather(layer_id, m)
        else:
            ck, cv = c.k[layer_id], c.v[layer_id]  # (B, Hkv, cap, D)
            if m.rebuild:
                gk, gv = self._gather(layer_id, m)
                ck[:, :, :n].copy_(gk)
                cv[:, :, :n].copy_(gv)
            else:
                assert m.copy_idx is not None  # each request's new K/V at its new position
                ck.view(-1, d).index_copy_(0, m.copy_idx, k.reshape(bsz * hkv, d))
                cv.view(-1, d).index_copy_(0, m.copy_idx, v.reshape(bsz * hkv, d))
            kk, vv = ck[:, :, :n], cv[:, :, :n]
            if self.device.type == "cpu":
                kk, vv = kk.reshape(bsz * hkv, n, d), vv.reshape(bsz * hkv, n, d)  # views
                qq = q.reshape(bsz * hkv, self.group, d)  # a KV head's G query heads as G rows
                if m.scores_mask is None:
                    s = torch.bmm(qq, kk.transpose(1, 2)).mul_(d**-0.5)  # (B * Hkv, G, Lmax)
                else:
                    s = torch.baddbmm(m.scores_mask, qq, kk.transpose(1, 2), alpha=d**-0.5)
                return torch.bmm(s.softmax(-1), vv).view(bsz, self.num_q_heads, d)  # (T=B, Hq, D)
        # q: (B, Hq, D) -> (B, Hkv, G, D): a KV group's query heads act as query positions.
        out = F.scaled_dot_product_attention(q.view(bsz, hkv, self.group, d), kk, vv, attn_mask=m.mask)
        return out.reshape(bsz, self.num_q_heads, d)  # (T=B, Hq, D)

    def _extend(self, q: torch.Tensor, layer_id: int, m: _Meta) -> torch.Tensor:
        bsz, n, d = m.batch_size, m.max_extend_len, self.head_dim
        kk, vv = self._gather(layer_id, m)  # (B, Hkv, Lmax, D)
        if m.q_rows is None:  # one request: no padding
            qq = q.view(1, n, self.num_q_heads, d)
        else:
            qq = q.new_zeros(bsz * n, self.num_q_heads, d).index_copy_(0, m.q_rows, q).view(bsz, n, -1, d)
        out = F.scaled_dot_product_attention(
            qq.transpose(1, 2), kk, vv, attn_mask=m.mask, enable_gqa=self.group > 1
        )  # (B, Hq, Nmax, D)
        out = out.transpose(1, 2).reshape(bsz * n, self.num_q_heads, d)  # (B * Nmax, Hq, D)
        return out if m.q_rows is None else out.index_select(0, m.q_rows)  # (T, Hq, D)

    def _fresh_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]
    ) -> torch.Tensor:
        """Causal attention of each request over its own new tokens (nothing cached before them)."""
        outs = []
        gqa = self.group > 1
        for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens), strict=True):
            o = F.scaled_dot_product_attention(  # (Hq, n, D)
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), is_causal=True, enable_gqa=gqa
            )
            outs.append(o.transpose(0, 1))  # (n, Hq, D)
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, Hq, D)

    def _fresh_prefill_matmul(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: _Meta
    ) -> torch.Tensor:
        """`_fresh_prefill` with explicit scores (CPU, short prompts): per request and KV head, its G
        query heads stacked as G * n rows, so grouped-query attention is one bmm without K/V expansion."""
        assert m.causal is not None
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        outs = []
        for qi, ki, vi, mask in zip(
            q.split(m.extend_lens), k.split(m.extend_lens), v.split(m.extend_lens), m.causal, strict=True
        ):
            n = qi.shape[0]
            qq = qi.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)  # (Hkv, G * n, D)
            s = torch.baddbmm(mask, qq, ki.permute(1, 2, 0), alpha=d**-0.5)  # (Hkv, G * n, n)
            o = torch.bmm(s.softmax(-1), vi.transpose(0, 1))  # (Hkv, G * n, D)
            outs.append(o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hkv * g, d))  # (n, Hq, D)
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, Hq, D)


def _ranges(lens: torch.Tensor) -> torch.Tensor:
    """[0..lens[0]), [0..lens[1]), ... concatenated. lens: (B,) int64 -> (sum(lens),)."""
    total = int(lens.sum())
    offsets = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)  # (T,)
    return torch.arange(total, dtype=torch.int64) - offsets
