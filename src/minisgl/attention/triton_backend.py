"""The CUDA attention backend: minisgl's paged Triton kernels (`minisgl.kernels.triton.attention`).

Per layer, decode: one launch stores the new tokens' K/V into their pool slots and attends for the
whole batch (split-KV over the pages, the last split of each head merging them); prefill and extend: one kernel
stores the new K/V, then the varlen causal kernel attends. No K/V is gathered or padded on the host.

Decode metadata (sequence lengths, new slots, page-table rows) lives in buffers allocated once for
`max_batch_size` rows, so a decode step captured in a CUDA graph replays against whatever `prepare`
wrote there last. Rows past the batch get length 0 and slot -1: the padding rows of a graph batch
read nothing and write nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from minisgl.kernels.triton.attention import decode_attention, decode_splits, extend_attention, store_kv
from minisgl.kernels.triton.decode.packed import packed_heads
from minisgl.kvcache import KVPool

from .base import AttentionBackend, AttnInput


@dataclass
class _ExtendMeta:
    out_slots: torch.Tensor  # (T,) int32
    page_table: torch.Tensor  # (B, P) int32
    q_starts: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    max_extend: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    # Most split-KV programs per (request, KV head) in decode; MINISGL_DECODE_MAX_SPLITS overrides it
    # (for measurements).
    max_splits = int(os.environ.get("MINISGL_DECODE_MAX_SPLITS", 16))
    # Qwen3's per-head q/k norms inside the decode kernel (one kernel fewer a layer); 0: `rope_qkv`'s
    # kernel first, as before (MINISGL_QK_NORM_IN_ATTENTION, for A/B runs)
    qk_norm_in_kernel = os.environ.get("MINISGL_QK_NORM_IN_ATTENTION", "1") != "0"

    def __init__(
        self,
        pool: KVPool,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_batch_size: int,
        max_pages_per_row: int,
    ) -> None:
        super().__init__(pool, num_q_heads, num_kv_heads, head_dim)
        self.scale = head_dim**-0.5
        self.max_batch_size = max_batch_size
        props = torch.cuda.get_device_properties(self.device) if self.device.type == "cuda" else None
        self.num_sms = props.multi_processor_count if props is not None else 8
        pin = self.device.type == "cuda"
        # Decode buffers (fixed addresses). Row 0: sequence lengths; row 1: slots of the new tokens.
        self._dec_meta = torch.zeros(2, max_batch_size, dtype=torch.int32, device=self.device)
        # Two pinned staging buffers, used in turn: with overlap scheduling the previous step's copy
        # may still be queued on the device when this step's metadata is written.
        self._dec_meta_host = [
            torch.zeros(2, max_batch_size, dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._turn = 0
        self._dec_pages = torch.zeros(
            max_batch_size, max_pages_per_row, dtype=torch.int32, device=self.device
        )
        self._dec_done = torch.zeros(max_batch_size * num_kv_heads, dtype=torch.int32, device=self.device)
        self._decode = False
        self._extend: _ExtendMeta | None = None

    # -- per batch ------------------------------------------------------------------------------------
    def prepare(self, inp: AttnInput) -> None:
        self._decode = inp.is_decode
        if inp.is_decode:
            self._prepare_decode(inp)
        else:
            self._extend = self._prepare_extend(inp)

    def _prepare_decode(self, inp: AttnInput) -> None:
        bsz, pages = inp.batch_size, inp.page_rows.shape[1]
        if bsz > self.max_batch_size:
            raise ValueError(f"decode batch of {bsz} exceeds the backend's {self.max_batch_size} rows")
        self._turn ^= 1
        host = self._dec_meta_host[self._turn]
        meta = host.numpy()
        meta[0, :bsz] = inp.seq_lens
        meta[0, bsz:] = 0
        meta[1, :bsz] = inp.out_slots.numpy()
        meta[1, bsz:] = -1
        self._dec_meta.copy_(host, non_blocking=True)
        self._dec_pages[:bsz, :pages].copy_(inp.page_rows, non_blocking=True)

    def _prepare_extend(self, inp: AttnInput) -> _ExtendMeta:
        bsz = inp.batch_size
        lens = np.asarray(inp.extend_lens, dtype=np.int32)
        starts = np.zeros(bsz + 1, dtype=np.int32)
        np.cumsum(lens, out=starts[1:])
        t = int(starts[-1])
        # One host buffer, one copy: slots (T) | q starts (B + 1) | seq lens (B) | page table (B, P).
        # Triton compiles a kernel variant per pattern of its pointers' 16-byte alignment and of its
        # integers being 1 or multiples of 16: each part starts 16 bytes aligned and the page table's
        # rows are padded to a multiple of 16 pages (zeros, never read), so that every batch takes
        # the same variants (else a new server compiled ~6 of the extend kernel on its first batches).
        rows = inp.page_rows.numpy().astype(np.int32, copy=False)
        p = -(-max(rows.shape[1], 1) // 16) * 16
        table = np.zeros((bsz, p), dtype=np.int32)
        table[:, : rows.shape[1]] = rows
        parts = [
            inp.out_slots.numpy().astype(np.int32),
            starts,
            np.asarray(inp.seq_lens, dtype=np.int32),
            table,
        ]
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + -(-part.size // 4) * 4)  # int32s, to the next 16 bytes
        host = np.zeros(offsets[-1], dtype=np.int32)
        for part, o in zip(parts, offsets, strict=False):
            host[o : o + part.size] = part.reshape(-1)
        src = torch.from_numpy(host)  # pinned, so that the copy never waits for the device
        dev = (src.pin_memory() if self.device.type == "cuda" else src).to(self.device, non_blocking=True)
        return _ExtendMeta(
            out_slots=dev[offsets[0] : offsets[0] + t],
            q_starts=dev[offsets[1] : offsets[1] + bsz + 1],
            seq_lens=dev[offsets[2] : offsets[2] + bsz],
            page_table=dev[offsets[3] : offsets[3] + bsz * p].view(bsz, p),
            max_extend=int(lens.max()),
        )

    # -- per layer ------------------------------------------------------------------------------------
    def forward_rope(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        layer_id: int,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Decode: the kernel norms (Qwen3) and rotates q and the new k itself, reading them from qkv
        (one kernel fewer per layer); prefill and extend split first, and so does a normed decode
        batch that takes the packed kernel (an fp8 pool at large batches: it has no norm)."""
        if not self._decode or qkv.stride(-1) != 1 or (qk_norm is not None and not self._norm_in_kernel(qkv)):
            return super().forward_rope(qkv, rope, split, layer_id, qk_norm)
        t, hq, hkv, d = qkv.shape[0], self.num_q_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, : hq * d].view(t, hq, d)  # strided views of the projection's rows
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        return self._decode_attention(q, k, v, layer_id, rope, qk_norm)

    def _norm_in_kernel(self, qkv: torch.Tensor) -> bool:
        """Whether this decode batch's q/k norms go into the one-head decode kernel."""
        if not self.qk_norm_in_kernel:
            return False
        bsz = qkv.shape[0]
        splits = decode_splits(bsz, self.num_kv_heads, self.num_sms, self.max_splits)
        return not packed_heads(bsz, self.num_kv_heads, splits, self.pool.scales is not None, qkv.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        if self._decode:
            return self._decode_attention(q, k, v, layer_id, None)
        kc, vc = self.pool.k[layer_id], self.pool.v[layer_id]
        m = self._extend
        assert m is not None, "prepare() must run before forward()"
        scales = self._kv_scales(layer_id)
        store_kv(k, v, kc, vc, m.out_slots, scales)
        return extend_attention(
            q, kc, vc, m.page_table, m.q_starts, m.seq_lens, m.max_extend, self.pool.page_size, self.scale,
            scales,
        )  # fmt: skip

    def _kv_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An fp8 pool's (k_scale, v_scale) of this layer, each (Hkv,); None for a 16/32-bit pool."""
        if self.pool.scales is None:
            return None
        both = self.pool.scales[layer_id]  # (2, Hkv)
        return both[0], both[1]

    def _decode_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """One launch: store the new K/V (norming and rotating k first with `qk_norm` and `rope`),
        attend over the pages."""
        bsz = q.shape[0]  # a CUDA graph's padded size while capturing
        splits = decode_splits(bsz, self.num_kv_heads, self.num_sms, self.max_splits)
        seq_lens, slots = self._dec_meta[0, :bsz], self._dec_meta[1, :bsz]
        return decode_attention(
            q, self.pool.k[layer_id], self.pool.v[layer_id], self._dec_pages, seq_lens, self.pool.page_size,
            self.scale, splits, new_kv=(k, v, slots), done=self._dec_done, rope=rope,
            scales=self._kv_scales(layer_id), qk_norm=qk_norm,
        )  # fmt: skip
