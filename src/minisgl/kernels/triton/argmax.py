"""The greedy choice of a decode batch: each row's argmax over the vocabulary, as `torch.argmax(-1)`
(the first index of the maximum; a NaN counts as the maximum, the first NaN wins), in two kernels:
each (row, chunk of BLOCK entries) program finds its chunk's maximum and first index, then one program
a row picks the first chunk holding the row's. A row of 128k bf16 logits is then read by ~32
programs at once, where torch's reductions left the 8B LM head's batch-256 logits at ~1 TB/s."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_enter, pdl_launch, use_pdl


@triton.jit
def _first_max(x, offs, BIG: tl.constexpr):
    """(max of x, NaN counted largest; the first of `offs` holding it) over a 1-D block."""
    nan = x != x
    first_nan = tl.min(tl.where(nan, offs, BIG), 0)
    m = tl.max(tl.where(nan, float("-inf"), x), 0)
    first_max = tl.min(tl.where(x == m, offs, BIG), 0)
    has_nan = first_nan < BIG
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, first_nan, first_max)


@triton.jit
def _argmax_chunks_kernel(X, Best, Idx, v, stride_x, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, chunk c): Best[b, c], Idx[b, c] = the chunk's maximum and its first index."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + b * stride_x + offs, mask=offs < v, other=float("-inf")).to(tl.float32)
    best, idx = _first_max(x, offs, 2**31 - 1)
    tl.store(Best + b * chunks + c, best)
    tl.store(Idx + b * chunks + c, idx)


@triton.jit
def _argmax_rows_kernel(Best, Idx, Out, chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    """Program b: Out[b] = the first index of the row's maximum, from its chunks' (in index order)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, CHUNKS)
    best = tl.load(Best + b * chunks + cs, mask=cs < chunks, other=float("-inf"))
    _, c = _first_max(best, cs, CHUNKS)
    tl.store(Out + b, tl.load(Idx + b * chunks + c).to(tl.int64))


def argmax_rows(logits: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """logits (B, V), unit stride in V -> (B,) int64, `logits.argmax(-1)`'s indices. block: entries a
    program (H200, V = 128,256 bf16, CUDA graphs, `benchmarks/bench_argmax.py`: 256 rows 27.0 us at 4,096,
    25.4 at 2,048, 25.8 at 8,192, torch's chunked reductions 67.4; 32 rows 5.7 / 4.8 / 5.4, torch 16.9;
    the workload ran with 4,096)."""
    b, v = logits.shape
    if logits.stride(1) != 1 or v == 0:
        raise ValueError(f"argmax_rows: logits {tuple(logits.shape)} strides {logits.stride()}")
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    block = min(block, triton.next_power_of_2(v))
    chunks = triton.cdiv(v, block)
    best = torch.empty(b, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(b, chunks, dtype=torch.int32, device=logits.device)
    pdl = use_pdl(logits)
    _argmax_chunks_kernel[(b, chunks)](
        logits, best, idx, v, logits.stride(0), chunks, BLOCK=block, num_warps=max(1, min(8, block // 512)),
        PDL=pdl, **pdl_launch(pdl),
    )  # fmt: skip
    _argmax_rows_kernel[(b,)](
        best, idx, out, chunks, CHUNKS=triton.next_power_of_2(chunks), num_warps=1, PDL=pdl, **pdl_launch(pdl)
    )
    return out
