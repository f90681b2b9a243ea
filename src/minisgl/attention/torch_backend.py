"""The reference attention backend in plain torch (CPU and GPU).

Per batch (in `prepare`): the slot of every cached position of every request, as one padded
(B, Lmax) index, and an additive mask. Per layer (in `forward`): store the new K/V, gather each
request's K/V with one `index_select` into (B, Hkv, Lmax, D), and run one
`scaled_dot_product_attention`. Decode folds the query heads of a KV group into the query length
(q as (B, Hkv, G, D)), so grouped-query attention needs no K/V expansion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.kvcache import KVPool

from .base import AttentionBackend, AttnInput


@dataclass
class _Meta:
    out_slots: torch.Tensor  # (T,) int64
    kv_idx: torch.Tensor  # (B * Lmax,) int64: pool slot per padded position (pad -> zero page)
    mask: torch.Tensor | None  # additive; decode (B, 1, 1, Lmax), prefill (B, 1, Nmax, Lmax)
    batch_size: int
    max_seq_len: int
    max_extend_len: int
    q_rows: torch.Tensor | None  # (T,) int64: row of each new token in the padded (B * Nmax) layout
    is_decode: bool


class TorchAttentionBackend(AttentionBackend):
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

    # -- per batch ------------------------------------------------------------------------------------
    def prepare(self, inp: AttnInput) -> None:
        ps = self.pool.page_size
        seq_lens = torch.tensor(inp.seq_lens, dtype=torch.int64)  # (B,)
        ext_lens = torch.tensor(inp.extend_lens, dtype=torch.int64)  # (B,)
        bsz, max_len, max_ext = len(inp.seq_lens), max(inp.seq_lens), max(inp.extend_lens)
        pos = torch.arange(max_len, dtype=torch.int64)  # (Lmax,)
        pages = inp.page_rows[:, pos // ps].to(torch.int64)  # (B, Lmax)
        valid = pos[None, :] < seq_lens[:, None]  # (B, Lmax)
        kv_idx = torch.where(valid, pages * ps + pos % ps, self.pool.pad_slot)  # (B, Lmax)
        neg_inf = torch.finfo(self.dtype).min
        mask: torch.Tensor | None
        q_rows = None
        if inp.is_decode:
            uniform = all(n == max_len for n in inp.seq_lens)
            mask = (
                None
                if uniform
                else torch.zeros(bsz, 1, 1, max_len).masked_fill_(~valid[:, None, None], neg_inf)
            )
        else:
            cached = seq_lens - ext_lens  # (B,)
            i = torch.arange(max_ext, dtype=torch.int64)  # (Nmax,)
            # Padded query rows (i >= extend_len) copy the last real row so no row is fully masked.
            i = torch.minimum(i[None, :], ext_lens[:, None] - 1)  # (B, Nmax)
            allowed = pos[None, None, :] <= (cached[:, None] + i)[:, :, None]  # (B, Nmax, Lmax)
            mask = torch.zeros(bsz, 1, max_ext, max_len).masked_fill_(~allowed[:, None], neg_inf)
            if bsz > 1:
                starts = torch.arange(bsz, dtype=torch.int64) * max_ext  # (B,)
                q_rows = torch.repeat_interleave(starts, ext_lens) + _ranges(ext_lens)  # (T,)
                q_rows = q_rows.to(self.device)
        if mask is not None:
            mask = mask.to(device=self.device, dtype=self.dtype)
        self.meta = _Meta(
            out_slots=inp.out_slots,
            kv_idx=kv_idx.reshape(-1).to(self.device),
            mask=mask,
            batch_size=bsz,
            max_seq_len=max_len,
            max_extend_len=max_ext,
            q_rows=q_rows,
            is_decode=inp.is_decode,
        )

    # -- per layer ------------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        m = self.meta
        assert m is not None, "prepare() must run before forward()"
        self.pool.store(layer_id, m.out_slots, k, v)
        bsz, max_len, hkv, d = m.batch_size, m.max_seq_len, self.num_kv_heads, self.head_dim
        kk = self.pool.k[layer_id].index_select(0, m.kv_idx).view(bsz, max_len, hkv, d).transpose(1, 2)
        vv = self.pool.v[layer_id].index_select(0, m.kv_idx).view(bsz, max_len, hkv, d).transpose(1, 2)
        if m.is_decode:  # q: (B, Hq, D) -> (B, Hkv, G, D): a KV group's heads act as query positions
            out = F.scaled_dot_product_attention(q.view(bsz, hkv, self.group, d), kk, vv, attn_mask=m.mask)
            return out.reshape(bsz, self.num_q_heads, d)  # (T=B, Hq, D)
        n = m.max_extend_len
        if m.q_rows is None:  # one request: no padding
            qq = q.view(1, n, self.num_q_heads, d)
        else:
            qq = q.new_zeros(bsz * n, self.num_q_heads, d).index_copy_(0, m.q_rows, q).view(bsz, n, -1, d)
        out = F.scaled_dot_product_attention(
            qq.transpose(1, 2), kk, vv, attn_mask=m.mask, enable_gqa=self.group > 1
        )  # (B, Hq, Nmax, D)
        out = out.transpose(1, 2).reshape(bsz * n, self.num_q_heads, d)  # (B * Nmax, Hq, D)
        return out if m.q_rows is None else out.index_select(0, m.q_rows)  # (T, Hq, D)


def _ranges(lens: torch.Tensor) -> torch.Tensor:
    """[0..lens[0]), [0..lens[1]), ... concatenated. lens: (B,) int64 -> (sum(lens),)."""
    total = int(lens.sum())
    offsets = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)  # (T,)
    return torch.arange(total, dtype=torch.int64) - offsets
