"""The block formats of GGUF tensors (ggml's types) that minisgl keeps as they are, and their
reference dequantization in torch.

A tensor of shape (N, K) in a block format stores each row as K / block_size blocks of `type_size`
bytes; a block holds its own scale (and minimum) in float16 next to packed integers. The layouts
(ggml-common.h; `gguf.quants` implements the same in numpy):

- Q4_0 (32 weights, 18 B): f16 d, 16 B of nibbles (low nibbles are weights 0..15, high 16..31);
  w = d * (q - 8).
- Q4_1 (32, 20 B): f16 d, f16 m, 16 B of nibbles; w = d * q + m.
- Q5_0 (32, 22 B): f16 d, u32 qh (bit j: the fifth bit of weight j), 16 B of nibbles;
  w = d * (q - 16).
- Q5_1 (32, 24 B): f16 d, f16 m, u32 qh, 16 B of nibbles; w = d * q + m.
- Q8_0 (32, 34 B): f16 d, 32 int8; w = d * q.
- Q4_K (256, 144 B): f16 d, f16 dmin, 12 B of 6-bit scales and mins of 8 sub-blocks of 32, 128 B of
  nibbles (each 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high ones);
  w = d * sc * q - dmin * m.
- Q5_K (256, 176 B): Q4_K's header, 32 B of fifth bits (bit i of byte l: weight l of sub-block i),
  128 B of nibbles; w = d * sc * q - dmin * m.
- Q6_K (256, 210 B): 128 B of low nibbles, 64 B of 2-bit highs, 16 int8 scales (one per 16 weights),
  f16 d; w = d * sc * (q - 32).
- F32, F16, BF16: one weight per element.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class GGMLType(IntEnum):
    """ggml's type ids (the values GGUF files store) of the formats minisgl reads."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30

    @property
    def block_size(self) -> int:
        """Weights per block."""
        return _LAYOUT[self][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return _LAYOUT[self][1]

    @property
    def is_float(self) -> bool:
        """F32, F16 and BF16: plain floats, no blocks."""
        return self in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` weights (k a multiple of the block size)."""
        if k % self.block_size:
            raise ValueError(
                f"{self.name}: a row of {k} weights is not a whole number of {self.block_size}-blocks"
            )
        return k // self.block_size * self.type_size


_LAYOUT = {  # (weights per block, bytes per block)
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
}


def dequantize(fmt: GGMLType, data: torch.Tensor, k: int) -> torch.Tensor:
    """Raw rows (R, row_bytes) uint8 in format `fmt`, `k` weights each -> (R, k) float32."""
    rows = data.shape[0]
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != fmt.row_bytes(k):
        raise ValueError(
            f"{fmt.name}: expected ({rows}, {fmt.row_bytes(k)}) uint8, got {tuple(data.shape)} {data.dtype}"
        )
    b = data.contiguous().view(-1, fmt.type_size)  # (R * k / block, type_size)
    return _DEQUANT[fmt](b).reshape(rows, k)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte offset `at` of each block, as float32 (blocks, 1)."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(blocks, n) bytes -> (blocks, 2n): the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(blocks, 4) bytes of a little-endian u32 -> (blocks, 32) bits 0..31, times 16."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # (blocks, 4, 8)
    return bits.reshape(-1, 32) << 4


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6])
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes (blocks, 12) -> 6-bit scales and mins (blocks, 8) each. Sub-blocks 0..3
    keep theirs in the low 6 bits of bytes 0..3 (scales) and 4..7 (mins); 4..7 keep their low 4 bits
    in the nibbles of bytes 8..11 and their high 2 bits in the top bits of bytes 0..7."""
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)], dim=1)
    m = torch.cat([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], dim=1)
    return sc, m


def _k_sub_blocks(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K nibbles (blocks, 128) -> (blocks, 8, 32): each 32 bytes hold two sub-blocks."""
    q = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, m = k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)  # (blocks, 8, 1)
    dm = (_f16(b, 2) * m.float()).unsqueeze(-1)
    return (d * _k_sub_blocks(b[:, 16:]).float() - dm).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, m = k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * m.float()).unsqueeze(-1)
    qh = b[:, 16:48]  # (blocks, 32): bit i of byte l is weight l of sub-block i
    high = ((qh.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1) << 4  # (blocks, 8, 32)
    q = _k_sub_blocks(b[:, 48:]) | high
    return (d * q.float() - dm).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # (blocks, 16)
    d = _f16(b, 208)
    # Each half of 128 weights: 64 bytes of ql (weights l and l + 64 of the half in the low / high
    # nibbles of byte l, l < 64) and 32 bytes of qh (bits 2i..2i+1 of byte l: weight l + 32 i).
    low = ql.reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    low = (low & 0x0F).reshape(-1, 2, 128)  # (blocks, half, 128)
    high = qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (high & 3).reshape(-1, 2, 128)
    q = ((low | (high << 4)).float() - 32).reshape(-1, 16, 16)  # (blocks, 16 groups of 16)
    return ((d * sc).unsqueeze(-1) * q).reshape(-1, 256)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float32)


def _f16_elems(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.bfloat16).float()


_DEQUANT = {
    GGMLType.F32: _f32,
    GGMLType.F16: _f16_elems,
    GGMLType.BF16: _bf16,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
