"""fp8 (float8_e4m3fn) weights: how a quantized projection's weight is held, and the reference
quantize / dequantize every backend is checked against.

A weight W (N, K) is held as `qweight` (N, K) float8_e4m3fn and float32 scales with W ~= qweight * scale:
one scale per output channel (N,) (a per-tensor checkpoint's scalar is spread over its rows, so fused
q/k/v or gate/up with different per-tensor scales need no requantization), or one per `block`
(rows, cols) tile, (ceil(N / rows), ceil(K / cols)), as DeepSeek's and Qwen3's fp8 checkpoints publish.
The ops backends read this one type: the torch reference and the CPU dequantize it, CUDA runs fp8
kernels (activations quantized per token as they come, "dynamic").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.quant import QuantizedWeight

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_MIN_SCALE = 1e-12  # an all-zero row or block keeps a finite scale


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """A projection's fp8 weight and its dequantization scales (views of the layer's parameters)."""

    qweight: torch.Tensor  # (N, K) float8_e4m3fn
    scale: torch.Tensor  # float32: (N,) per channel, or (ceil(N / bn), ceil(K / bk)) per block
    block: tuple[int, int] | None = None  # (bn, bk); None: per output channel

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (N, K) in `dtype`: qweight * scale, computed in float32."""
        return dequantize_fp8(self.qweight, self.scale, self.block).to(dtype)


Weight = torch.Tensor | Fp8Weight | QuantizedWeight  # what the ops' projections take


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales (ceil(N / bn), ceil(K / bk)) -> one per element (N, K)."""
    n, k = shape
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """q (N, K) fp8 with per-channel (N,) or per-block scales -> float32 (N, K)."""
    if block is None:
        return q.float() * scale.float()[:, None]
    return q.float() * expand_block_scale(scale.float(), (q.shape[0], q.shape[1]), block)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N, K) -> (qweight (N, K) fp8, scales float32): each row's (or block's) largest magnitude
    maps to 448. Computed in float32 on W's device."""
    w = w.float()
    if block is None:
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)  # (N,)
        return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = w.new_zeros(nb * bn, kb * bk)
    padded[:n, :k] = w
    tiles = padded.view(nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(_MIN_SCALE)  # (nb, kb)
    q = (w / expand_block_scale(scale, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_rows_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization, the reference of the CUDA kernel: x (M, K) -> (xq (M, K) fp8,
    scales float32 (M, 1) per row, or (M, ceil(K / group)) per group of `group` columns)."""
    m, k = x.shape
    xf = x.float()
    if group is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)  # (M, 1)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    g = -(-k // group)
    padded = xf.new_zeros(m, g * group)
    padded[:, :k] = xf
    scale = (padded.view(m, g, group).abs().amax(dim=2) / FP8_MAX).clamp_min(_MIN_SCALE)  # (M, G)
    full = scale.repeat_interleave(group, 1)[:, :k]
    return (xf / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
