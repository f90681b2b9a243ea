"""Every attention backend against dense causal attention: prefix + chunk + decode, GQA, batched.

The Triton backend runs on a GPU when there is one, else in Triton's CPU interpreter (conftest.py
sets TRITON_INTERPRET=1 without a GPU), so CI checks the kernels' logic on these small shapes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from minisgl import kernels
from minisgl.attention import AttnInput, CpuAttentionBackend, TorchAttentionBackend
from minisgl.kernels.triton import triton_available
from minisgl.kvcache import KVPool, PageAllocator, PageTable

HQ, HKV, D, PS = 6, 2, 16, 4


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Reference: q (N, Hq, D) at positions start.., k/v (L, Hkv, D) of positions 0..L-1."""
    g = HQ // HKV
    k = k.repeat_interleave(g, dim=1)  # (L, Hq, D)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) / math.sqrt(D)  # (Hq, N, L)
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).float()


def _backend(path: str, pool: KVPool, max_pages: int):  # noqa: ANN202
    if path in ("copy", "gather"):
        return TorchAttentionBackend(pool, HQ, HKV, D)
    if path == "triton":
        from minisgl.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, HQ, HKV, D, max_batch_size=4, max_pages_per_row=max_pages)
    backend = CpuAttentionBackend(pool, HQ, HKV, D)
    backend.decode_kernel = backend.prefill_kernel = path == "kernel"
    return backend


_CHUNKS = [[[5, 9, 1], [3, 6, 2]], [[7], [4]], [[2, 3], [1, 1]]]
_PATHS = ["kernel", "matmul", "copy", "gather", "triton"]


def _chunk_cases() -> list:
    """Every (chunks, path); Triton's interpreter takes 6-11 s a case on a 2-core CPU, so on the CPU
    its chunkings run under `make test-slow` (`make test` checks the Triton backend over cached
    prefixes through the engine: tests/engine/test_engine_backends.py)."""
    slow = [] if torch.cuda.is_available() else [pytest.mark.slow]
    return [
        pytest.param(c, p, id=f"chunks{i}-{p}", marks=slow if p == "triton" else [])
        for i, c in enumerate(_CHUNKS)
        for p in _PATHS
    ]


@pytest.mark.parametrize(("chunks", "decode_path"), _chunk_cases())
def test_prefill_with_prefix_then_decode_matches_dense(chunks: list[list[int]], decode_path: str) -> None:
    """Fresh prefill, prefill over a prefix, then decode steps: through the CPU backend's C kernels
    (fresh prefill, and decode reading the pool: "kernel") or its explicit-score matmuls over the
    contiguous decode copy ("matmul"); through the torch reference, where the first step rebuilds the
    contiguous decode copy and the next ones append to it ("copy"), or, without row ids, every step
    gathers from the pool ("gather"); through the Triton kernels, reading the pages ("triton")."""
    if decode_path == "kernel" and not kernels.available():
        pytest.skip("the CPU kernels could not be built here")
    if decode_path == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    decode_copy = decode_path in ("copy", "matmul")
    torch.manual_seed(0)
    dev = "cuda" if decode_path == "triton" and torch.cuda.is_available() else "cpu"
    bsz = len(chunks[0])
    pool = KVPool(
        num_layers=2,
        num_pages=32,
        page_size=PS,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=torch.float32,
        device=dev,
    )
    table = PageTable(PageAllocator(32), PS, max_rows=4, max_seq_len=64)
    backend = _backend(decode_path, pool, table.max_pages_per_row)
    # Rows allocated out of order so page ids interleave across requests.
    rows = [table.alloc_row(uid) for uid in range(bsz)][::-1]
    hist_k = [[torch.empty(0, HKV, D) for _ in range(bsz)] for _ in range(2)]
    hist_v = [[torch.empty(0, HKV, D) for _ in range(bsz)] for _ in range(2)]
    cached = [0] * bsz
    steps = [(c, False) for c in chunks] + [([1] * bsz, True)] * 4
    for ext, is_decode in steps:
        for b in range(bsz):
            assert table.reserve(rows[b], cached[b] + ext[b])
        slots = []
        for b in range(bsz):
            for p in range(cached[b], cached[b] + ext[b]):
                slots.append(int(table.table[rows[b], p // PS]) * PS + p % PS)
        seq = [c + e for c, e in zip(cached, ext, strict=True)]
        backend.prepare(
            AttnInput(
                seq,
                ext,
                torch.tensor(slots),
                table.table[torch.tensor(rows)],
                is_decode=is_decode,
                row_ids=rows if decode_path != "gather" else None,
            )
        )
        if decode_path == "kernel" and not is_decode and any(cached):
            # Prefill over a prefix reads the pages in the extend kernel: no gather index, no mask.
            assert backend.meta.kind == "extend" and backend.meta.kv_idx is None
            _, lens, starts = backend._ext
            assert lens.tolist() == seq and starts.tolist() == [0, *itertools.accumulate(ext)]
        total = sum(ext)
        for layer in range(2):
            q, k, v = torch.randn(total, HQ, D), torch.randn(total, HKV, D), torch.randn(total, HKV, D)
            out = backend.forward(q.to(dev), k.to(dev), v.to(dev), layer).cpu()
            assert out.shape == (total, HQ, D)
            off = 0
            for b in range(bsz):
                n = ext[b]
                hist_k[layer][b] = torch.cat([hist_k[layer][b], k[off : off + n]])
                hist_v[layer][b] = torch.cat([hist_v[layer][b], v[off : off + n]])
                ref = _dense(q[off : off + n], hist_k[layer][b], hist_v[layer][b], cached[b])
                torch.testing.assert_close(out[off : off + n], ref, atol=1e-4, rtol=1e-4)
                off += n
        cached = seq
        if is_decode and decode_path != "triton":
            assert (backend._copy is not None) == decode_copy
