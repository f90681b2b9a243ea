"""The reference attention backend in plain torch (any device).

Per batch (`prepare`): the pool slot of every cached position of every request as one padded
(B, Lmax) index, and an additive mask. Per layer (`forward`): store the new K/V in the pool, then
attend with `scaled_dot_product_attention`:

- prefill of fresh prompts (nothing cached): per request, causal attention over its own new K/V;
- prefill with a cached prefix (chunked prefill): gather K/V with one `index_select` into
  (B, Hkv, Lmax, D), queries padded to (B, Hq, Nmax, D), a causal mask offset by each prefix;
- decode: queries folded as (B, Hkv, G, D) (a KV group's heads act as query positions), so
  grouped-query attention needs no K/V expansion. Consecutive decode steps of the same requests keep
  their K/V in a contiguous per-batch copy and only append the new token (the paged pool stays the
  source of truth); any other batch rebuilds that copy with one gather.

The CPU backend (`cpu_backend.py`) subclasses this one and replaces the fresh-prefill and decode
paths with C kernels or explicit-score matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.kvcache import KVPool

from .base import AttentionBackend, AttnInput

_DECODE_CACHE_SLACK = 64  # positions a decode copy can grow before it is rebuilt


@dataclass
class _Meta:
    kind: str  # "fresh" (prefill, nothing cached), "extend" (prefill over a prefix), "decode"
    out_slots: torch.Tensor  # (T,) int64 on the device: pool slot of each new token
    batch_size: int
    max_seq_len: int
    max_extend_len: int
    extend_lens: list[int]
    kv_idx: torch.Tensor | None = None  # (B * Lmax,) int64 slots per padded position (pad -> zero page)
    mask: torch.Tensor | None = None  # additive: decode (B, 1, 1, Lmax), extend (B, 1, Nmax, Lmax)
    q_rows: torch.Tensor | None = None  # extend: (T,) row of each new token in the (B * Nmax) layout
    rebuild: bool = True  # decode: refill the contiguous copy from the pool in this step
    copy_idx: torch.Tensor | None = None  # decode: (B * Hkv,) row of each new K/V in the flat copy


@dataclass
class _DecodeCopy:
    """Contiguous K/V of the current decode batch, per layer (B, Hkv, cap, D)."""

    row_ids: list[int]
    seq_lens: list[int]
    cap: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    decode_copy_budget = 512 << 20  # bytes; larger decode batches gather from the pool every layer

    def __init__(
        self,
        pool: KVPool,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(pool, num_q_heads, num_kv_heads, head_dim, dtype)
        self.group = num_q_heads // num_kv_heads
        self.meta: _Meta | None = None
        self._copy: _DecodeCopy | None = None

    # -- per batch ------------------------------------------------------------------------------------
    def prepare(self, inp: AttnInput) -> None:
        common = dict(
            out_slots=inp.out_slots.to(self.device, non_blocking=True),
            batch_size=inp.batch_size,
            max_seq_len=max(inp.seq_lens),
            max_extend_len=max(inp.extend_lens),
            extend_lens=list(inp.extend_lens),
        )
        if inp.is_decode:
            self.meta = self._prepare_decode(inp, common)
            return
        self._copy = None  # the running set may change after a prefill: rebuild at the next decode
        if inp.seq_lens == inp.extend_lens:
            self.meta = self._prepare_fresh(inp, common)
        else:
            self.meta = self._prepare_extend(inp, common)

    def _prepare_fresh(self, inp: AttnInput, common: dict) -> _Meta:
        return _Meta(kind="fresh", **common)

    def _prepare_extend(self, inp: AttnInput, common: dict) -> _Meta:
        bsz, max_len, max_ext = inp.batch_size, common["max_seq_len"], common["max_extend_len"]
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
        return _Meta(kind="extend", kv_idx=kv_idx, mask=mask, q_rows=q_rows, **common)

    def _prepare_decode(self, inp: AttnInput, common: dict) -> _Meta:
        max_len = common["max_seq_len"]
        seq_lens = torch.tensor(inp.seq_lens, dtype=torch.int64)  # (B,)
        mask = None
        if any(n != max_len for n in inp.seq_lens):
            pos = torch.arange(max_len, dtype=torch.int64)
            mask = self._additive((pos[None, :] < seq_lens[:, None])[:, None, None])  # (B, 1, 1, Lmax)
        meta = _Meta(kind="decode", mask=mask, **common)
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

    def _new_copy(self, inp: AttnInput, max_len: int) -> _DecodeCopy | None:
        if inp.row_ids is None:
            return None
        cap = max_len + _DECODE_CACHE_SLACK
        shape = (len(inp.seq_lens), self.num_kv_heads, cap, self.head_dim)
        nbytes = 2 * self.pool.num_layers * torch.Size(shape).numel() * self.dtype.itemsize
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
        # This step's own tokens attend over K/V as the pool keeps them (rounded to a 16-bit pool's
        # dtype, an fp8 pool's scaled values), as later steps reading the pool will.
        if not self.pool.quantized and self.pool.dtype != k.dtype:
            k, v = k.to(self.pool.dtype).to(k.dtype), v.to(self.pool.dtype).to(v.dtype)
        self.pool.store(layer_id, m.out_slots, k, v)
        if self.pool.quantized:
            k, v = self.pool.load(layer_id, m.out_slots, q.dtype)
        if m.kind == "fresh":
            return self._fresh_prefill(q, k, v, m)
        if m.kind == "decode":
            return self._decode(q, k, v, layer_id, m)
        return self._extend(q, layer_id, m)

    def _gather(self, layer_id: int, m: _Meta) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the batch from the pool: (B, Hkv, Lmax, D) each (strided views)."""
        assert m.kv_idx is not None
        shape = (m.batch_size, m.max_seq_len, self.num_kv_heads, self.head_dim)
        kk, vv = self.pool.load(layer_id, m.kv_idx, self.dtype)
        return kk.view(shape).transpose(1, 2), vv.view(shape).transpose(1, 2)

    def _decode_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer_id: int, m: _Meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode batch's K/V, (B, Hkv, Lmax, D) each: from the contiguous copy (appending this
        step's token, or refilling it) or, without a copy, gathered from the pool."""
        bsz, hkv, d, n = m.batch_size, self.num_kv_heads, self.head_dim, m.max_seq_len
        c = self._copy
        if c is None:
            return self._gather(layer_id, m)
        ck, cv = c.k[layer_id], c.v[layer_id]  # (B, Hkv, cap, D)
        if m.rebuild:
            gk, gv = self._gather(layer_id, m)
            ck[:, :, :n].copy_(gk)
            cv[:, :, :n].copy_(gv)
        else:
            assert m.copy_idx is not None  # each request's new K/V at its new position
            ck.view(-1, d).index_copy_(0, m.copy_idx, k.reshape(bsz * hkv, d))
            cv.view(-1, d).index_copy_(0, m.copy_idx, v.reshape(bsz * hkv, d))
        return ck[:, :, :n], cv[:, :, :n]

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, m: _Meta
    ) -> torch.Tensor:
        bsz, hkv, d = m.batch_size, self.num_kv_heads, self.head_dim
        kk, vv = self._decode_kv(k, v, layer_id, m)
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

    def _fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: _Meta) -> torch.Tensor:
        """Causal attention of each request over its own new tokens (nothing cached before them)."""
        outs = []
        gqa = self.group > 1
        lens = m.extend_lens
        for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens), strict=True):
            o = F.scaled_dot_product_attention(  # (Hq, n, D)
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), is_causal=True, enable_gqa=gqa
            )
            outs.append(o.transpose(0, 1))  # (n, Hq, D)
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, Hq, D)


def _ranges(lens: torch.Tensor) -> torch.Tensor:
    """[0..lens[0]), [0..lens[1]), ... concatenated. lens: (B,) int64 -> (sum(lens),)."""
    total = int(lens.sum())
    offsets = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)  # (T,)
    return torch.arange(total, dtype=torch.int64) - offsets
