"""minisgl's Triton kernels against the torch reference: ragged batches, scattered pages, GQA.

On a GPU they run compiled, in float32, bf16 and fp16; without one, in Triton's CPU interpreter
(conftest.py) in float32 on small shapes, which checks their indexing and masking logic in CI."""

from __future__ import annotations

import math

import pytest
import torch

from minisgl.backends import REFERENCE_OPS
from minisgl.kernels.triton import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if DEV == "cuda" else [torch.float32]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64; NaN never passes."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _pages(bsz: int, max_pages: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """(B, P) int32 page ids, all distinct and scattered over the pool."""
    return torch.randperm(num_pages, generator=gen)[: bsz * max_pages].view(bsz, max_pages).int()


def _dense_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, ps: int,
    seq_len: int, q_pos: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One request: q (N, Hq, D) at positions q_pos over its first seq_len cached tokens, in float64."""
    pos = torch.arange(seq_len)
    slots = pages[pos // ps].long() * ps + pos % ps
    g = q.shape[1] // k_cache.shape[1]
    k = k_cache[slots].double().repeat_interleave(g, 1)  # (L, Hq, D)
    v = v_cache[slots].double().repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) / math.sqrt(q.shape[2])
    s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


DECODE_SHAPES = [(8, 2, 64, 16), (9, 3, 64, 4), (4, 4, 128, 1), (6, 1, 40, 8)]  # hq, hkv, d, page size
_CPU_SLOW = [] if DEV == "cuda" else [pytest.mark.slow]  # 6-10 s a case in the interpreter: `make test-slow`
DECODE_CASES = [
    *[(*shape, splits) for splits in (1, 3) for shape in DECODE_SHAPES],
    # 16 splits (the first: more splits than its rows have pages) on the GPU, or under `make test-slow`
    *[
        pytest.param(*shape, 16, marks=_CPU_SLOW if i == 0 else pytest.mark.slow)
        for i, shape in enumerate(DECODE_SHAPES)
    ],
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d", "ps", "splits"), DECODE_CASES)
def test_decode_attention_matches_dense(
    dtype: torch.dtype, hq: int, hkv: int, d: int, ps: int, splits: int
) -> None:
    from minisgl.kernels.triton.attention import decode_attention

    gen = torch.Generator().manual_seed(hq * 100 + d + splits)
    lens = [1, 37, 0, 130, 5]  # a 0: a CUDA graph's padding row (output 0, reads nothing)
    max_pages = -(-max(lens) // ps)
    num_pages = len(lens) * max_pages + 3
    k_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype)
    pages = _pages(len(lens), max_pages, num_pages, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"), device=DEV)  # poisoned: every element must be written
    done = torch.zeros(len(lens) * hkv, dtype=torch.int32, device=DEV)  # split counters
    for _ in range(2):  # twice: the counters are back at zero after a launch
        decode_attention(
            q.to(DEV), k_cache.to(DEV), v_cache.to(DEV), pages.to(DEV), torch.tensor(lens, dtype=torch.int32).to(DEV),
            ps, d**-0.5, splits, out=out, done=done,
        )  # fmt: skip
        assert not done.any()
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b].cpu(), torch.zeros(hq, d, dtype=dtype))
            continue
        ref = _dense_attention(q[b : b + 1], k_cache, v_cache, pages[b], ps, n, torch.tensor([n - 1]))
        assert _rel(out[b : b + 1], ref) < TOL[dtype], (b, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_stores_and_uses_the_new_tokens(dtype: torch.dtype, splits: int) -> None:
    """With new_kv, the kernel writes each new token's K/V to its slot (which held NaN before: the
    kernel must not read it) and attends over it; a slot of -1 (graph padding) is not written. At
    4 splits the 300 tokens give each split two blocks of 64: the first loaded before the loop (and
    on a GPU before PDL's wait), the second in it."""
    from minisgl.kernels.triton.attention import decode_attention

    gen = torch.Generator().manual_seed(splits)
    hq, hkv, d, ps = 8, 2, 64, 4
    lens = [9, 1, 0, 70, 300]
    max_pages = -(-max(lens) // ps)
    num_pages = len(lens) * max_pages + 1
    k_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype)
    pages = _pages(len(lens), max_pages, num_pages, gen)
    slots = [int(pages[b, (n - 1) // ps]) * ps + (n - 1) % ps if n else -1 for b, n in enumerate(lens)]
    k_new = torch.randn(len(lens), hkv, d, generator=gen).to(dtype)
    v_new = torch.randn(len(lens), hkv, d, generator=gen).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot], want_v[slot] = k_new[b], v_new[b]
            k_cache[slot] = v_cache[slot] = float("nan")  # unwritten yet: never read
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    kc, vc = k_cache.to(DEV), v_cache.to(DEV)
    out = decode_attention(
        q.to(DEV), kc, vc, pages.to(DEV), torch.tensor(lens, dtype=torch.int32).to(DEV), ps, d**-0.5, splits,
        new_kv=(k_new.to(DEV), v_new.to(DEV), torch.tensor(slots, dtype=torch.int32).to(DEV)),
    )  # fmt: skip
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
    for b, n in enumerate(lens):
        if n:
            ref = _dense_attention(q[b : b + 1], want_k, want_v, pages[b], ps, n, torch.tensor([n - 1]))
            assert _rel(out[b : b + 1], ref) < TOL[dtype], b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "splits", "normed"),
    [
        (8, 2, 64, 1, False),
        (9, 3, 40, 4, False),
        (4, 1, 128, 2, False),
        (8, 2, 64, 3, True),
        pytest.param(4, 1, 128, 1, True, marks=_CPU_SLOW),
    ],
)
def test_decode_attention_rotates_q_and_the_new_k(
    dtype: torch.dtype, hq: int, hkv: int, d: int, splits: int, normed: bool
) -> None:
    """With rope, q/k/v are views of the fused projection's output before RoPE: the result and the
    K/V stored equal rope_qkv's rotation followed by the kernel without rope; normed, Qwen3's per-head
    q/k RMSNorms go into the kernel too and equal rope_qkv's."""
    from minisgl.kernels.triton.attention import decode_attention
    from minisgl.kernels.triton.elementwise import rope_qkv

    gen = torch.Generator().manual_seed(hq + d + splits)
    ps, lens = 4, [9, 1, 0, 70]
    bsz = len(lens)
    max_pages = -(-max(lens) // ps)
    num_pages = bsz * max_pages + 1
    k_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype).to(DEV)
    v_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype).to(DEV)
    pages = _pages(bsz, max_pages, num_pages, gen).to(DEV)
    slots = [int(pages[b, (n - 1) // ps]) * ps + (n - 1) % ps if n else -1 for b, n in enumerate(lens)]
    slots_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qkv = torch.randn(bsz, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEV)
    angles = torch.rand(bsz, 1, d // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)
    norms = None
    if normed:  # weights far from 1 and a large epsilon, so that a norm left out or misplaced shows
        norms = (
            (torch.rand(d, generator=gen) * 3 + 0.1).to(dtype).to(DEV),
            (torch.rand(d, generator=gen) * 3 + 0.1).to(dtype).to(DEV),
            0.5,
        )

    q, k, v = rope_qkv(qkv, cos, sin, hq, hkv, d, norms)  # the unfused way
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = decode_attention(q, kc_ref, vc_ref, pages, seq_lens, ps, d**-0.5, splits, new_kv=(k, v, slots_t))

    raw_q = qkv[:, : hq * d].view(bsz, hq, d)  # strided views, nothing copied
    raw_k = qkv[:, hq * d : (hq + hkv) * d].view(bsz, hkv, d)
    raw_v = qkv[:, (hq + hkv) * d :].view(bsz, hkv, d)
    out = decode_attention(
        raw_q, k_cache, v_cache, pages, seq_lens, ps, d**-0.5, splits,
        new_kv=(raw_k, raw_v, slots_t), rope=(cos, sin), qk_norm=norms,
    )  # fmt: skip
    assert torch.equal(v_cache, vc_ref)
    # The same float32 rotation (and norms), but the compiler may contract it into FMAs and order the
    # norms' sums differently per kernel: a few last-bit differences in 16 bits.
    k_tol = 1e-6 if dtype == torch.float32 else (1e-3 if normed else 0.0)
    assert _rel(k_cache, kc_ref) < k_tol or torch.equal(k_cache, kc_ref)
    assert _rel(out, ref) < TOL[dtype] / 10
    assert torch.equal(out[2].cpu(), torch.zeros(hq, d, dtype=dtype))  # the empty row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_with_lazy_rescaling_matches_dense(
    dtype: torch.dtype, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MINISGL_DECODE_LAZY: the running max moves only when a row's grows by more than the threshold
    (0.5 here, so that some blocks move it and others do not; a skipped rescale fails this)."""
    from minisgl.kernels.triton import attention

    monkeypatch.setattr(attention, "_LAZY", 0.5)
    gen = torch.Generator().manual_seed(11 + splits)
    hq, hkv, d, ps = 8, 2, 64, 4
    lens = [1, 37, 0, 130]
    max_pages = -(-max(lens) // ps)
    num_pages = len(lens) * max_pages + 1
    k_cache = (torch.randn(num_pages * ps, hkv, d, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype)
    pages = _pages(len(lens), max_pages, num_pages, gen)
    q = (torch.randn(len(lens), hq, d, generator=gen) * 2).to(dtype)
    out = attention.decode_attention(
        q.to(DEV), k_cache.to(DEV), v_cache.to(DEV), pages.to(DEV), torch.tensor(lens, dtype=torch.int32).to(DEV),
        ps, d**-0.5, splits, launch=(16, 4, 2, 0),
    )  # fmt: skip
    assert not out[2].any()
    for b, n in enumerate(lens):
        if n:
            ref = _dense_attention(q[b : b + 1], k_cache, v_cache, pages[b], ps, n, torch.tensor([n - 1]))
            assert _rel(out[b : b + 1], ref) < TOL[dtype], b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "ps", "splits", "heads"),
    [(16, 4, 32, 16, 1, 4), (9, 3, 40, 4, 1, 2), (8, 2, 64, 4, 2, 2)],
)
def test_decode_attention_packed_heads_match_dense(
    dtype: torch.dtype, hq: int, hkv: int, d: int, ps: int, splits: int, heads: int
) -> None:
    """`decode.packed` (launch's 4th element: KV heads a program): several KV heads' query rows in one
    block-diagonal tile, with RoPE, the new K/V stored and attended, splits merged, an empty row, and
    head counts that do not divide Hkv (3 heads in programs of 2 or 4): equal to dense attention over
    rope_qkv's rotation, the pool written as the one-head kernel writes it."""
    from minisgl.kernels.triton.attention import decode_attention
    from minisgl.kernels.triton.elementwise import rope_qkv

    gen = torch.Generator().manual_seed(hq + d + splits)
    lens = [9, 1, 0, 70, 33]
    bsz = len(lens)
    max_pages = -(-max(lens) // ps)
    num_pages = bsz * max_pages + 1
    k_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype).to(DEV)
    v_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype).to(DEV)
    pages = _pages(bsz, max_pages, num_pages, gen)
    slots = [int(pages[b, (n - 1) // ps]) * ps + (n - 1) % ps if n else -1 for b, n in enumerate(lens)]
    slots_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qkv = torch.randn(bsz, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEV)
    angles = torch.rand(bsz, 1, d // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)
    q, k, v = rope_qkv(qkv, cos, sin, hq, hkv, d)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    decode_attention(
        q,
        kc_ref,
        vc_ref,
        pages.to(DEV),
        seq_lens,
        ps,
        d**-0.5,
        splits,
        new_kv=(k, v, slots_t),
        launch=(16, 4, 2, 0),
    )  # fmt: skip  the one-head kernel: the pool as it writes it
    out = torch.full((bsz, hq, d), float("nan"), dtype=dtype, device=DEV)
    done = torch.zeros(bsz * hkv, dtype=torch.int32, device=DEV)
    raw_q = qkv[:, : hq * d].view(bsz, hq, d)  # strided views of the projection, before RoPE
    raw_k = qkv[:, hq * d : (hq + hkv) * d].view(bsz, hkv, d)
    raw_v = qkv[:, (hq + hkv) * d :].view(bsz, hkv, d)
    for _ in range(2):  # twice: the split counters are back at zero after a launch
        kc, vc = k_cache.clone(), v_cache.clone()
        decode_attention(
            raw_q, kc, vc, pages.to(DEV), seq_lens, ps, d**-0.5, splits, out=out, done=done, rope=(cos, sin),
            launch=(16, 4, 2, heads), new_kv=(raw_k, raw_v, slots_t),
        )  # fmt: skip
        assert not done.any()
    assert torch.equal(vc, vc_ref)
    assert _rel(kc, kc_ref) < (1e-6 if dtype == torch.float32 else 0.0) or torch.equal(kc, kc_ref)
    assert torch.equal(out[2].cpu(), torch.zeros(hq, d, dtype=dtype))  # the empty row
    for b, n in enumerate(lens):
        if n:
            ref = _dense_attention(
                q[b : b + 1].cpu(), kc_ref.cpu(), vc_ref.cpu(), pages[b], ps, n, torch.tensor([n - 1])
            )
            assert _rel(out[b : b + 1], ref) < TOL[dtype], b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d", "ps"), [(8, 2, 64, 16), (9, 3, 64, 4), (4, 1, 128, 1)])
def test_extend_attention_matches_dense(dtype: torch.dtype, hq: int, hkv: int, d: int, ps: int) -> None:
    """Fresh prompts and chunks over cached prefixes in one launch; lengths around the block sizes."""
    from minisgl.kernels.triton.attention import extend_attention

    gen = torch.Generator().manual_seed(hq + d)
    cached = [0, 20, 0, 3, 64]
    ext = [1, 7, 70, 33, 2]
    seq = [c + e for c, e in zip(cached, ext, strict=True)]
    max_pages = -(-max(seq) // ps)
    num_pages = len(seq) * max_pages + 2
    k_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(dtype)
    pages = _pages(len(seq), max_pages, num_pages, gen)
    q = torch.randn(sum(ext), hq, d, generator=gen).to(dtype)
    starts = torch.tensor([0, *ext]).cumsum(0).int()
    out = extend_attention(
        q.to(DEV), k_cache.to(DEV), v_cache.to(DEV), pages.to(DEV), starts.to(DEV),
        torch.tensor(seq, dtype=torch.int32).to(DEV), max(ext), ps, d**-0.5,
    )  # fmt: skip
    for b in range(len(seq)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        ref = _dense_attention(
            q[rows], k_cache, v_cache, pages[b], ps, seq[b], torch.arange(cached[b], seq[b])
        )
        assert _rel(out[rows], ref) < TOL[dtype], b


def test_store_kv_writes_its_slots_and_skips_negative_ones() -> None:
    from minisgl.kernels.triton.attention import store_kv

    k_cache = torch.zeros(12, 2, 8, device=DEV)
    v_cache = torch.zeros(12, 2, 8, device=DEV)
    k, v = torch.randn(4, 2, 8, device=DEV), torch.randn(4, 2, 8, device=DEV)
    store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0, 11], dtype=torch.int32, device=DEV))
    for t, slot in ((0, 5), (2, 0), (3, 11)):
        assert torch.equal(k_cache[slot], k[t]) and torch.equal(v_cache[slot], v[t])
    untouched = [s for s in range(12) if s not in (5, 0, 11)]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 576), (7, 64), (33, 4096)])
def test_rmsnorm_matches_reference(dtype: torch.dtype, rows: int, n: int) -> None:
    from minisgl.kernels.triton.elementwise import rmsnorm

    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, n, generator=gen) * 3).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype).to(DEV)
    assert _rel(rmsnorm(h, w, 1e-5), REFERENCE_OPS.rmsnorm(h, w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_over_heads_of_a_strided_view(dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k norm: (T, H, D) rows of a slice of the fused qkv output."""
    from minisgl.kernels.triton.elementwise import rmsnorm

    qkv = torch.randn(5, (4 + 2 * 2) * 32, device=DEV).to(dtype)
    q = qkv[:, : 4 * 32].view(5, 4, 32)  # strided rows
    w = torch.rand(32, device=DEV).to(dtype) + 0.5
    assert _rel(rmsnorm(q, w, 1e-6), REFERENCE_OPS.rmsnorm(q, w, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (32, 8, 128), (4, 4, 40)])
def test_rope_qkv_matches_reference(dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    from minisgl.kernels.triton.elementwise import rope_qkv

    gen = torch.Generator().manual_seed(d)
    t = 6
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEV)
    angles = torch.rand(t, 1, d // 2, generator=gen) * 50
    cos, sin = angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)
    got = rope_qkv(qkv, cos, sin, hq, hkv, d)
    want = REFERENCE_OPS.rope_qkv(qkv, cos, sin, hq, hkv, d)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.is_contiguous()
        assert _rel(g, w) < TOL[dtype]
    assert torch.equal(got[2], want[2])  # v is copied, not rotated
    # Qwen3's per-head q/k RMSNorm first, in the same kernel (the reference norms qkv in place)
    norms = (
        (torch.rand(d, generator=gen) + 0.5).to(dtype).to(DEV),
        (torch.rand(d, generator=gen) + 0.5).to(dtype).to(DEV),
        1e-6,
    )
    got = rope_qkv(qkv, cos, sin, hq, hkv, d, norms)
    want = REFERENCE_OPS.rope_qkv(qkv.clone(), cos, sin, hq, hkv, d, norms)
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w) < TOL[dtype]
    assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 13), (64, 2 * 14336)])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    from minisgl.kernels.triton.elementwise import silu_and_mul

    if DEV == "cpu" and shape[1] > 4096:
        pytest.skip("large shapes only on the GPU (the interpreter is slow)")
    gate_up = (torch.randn(*shape) * 4).to(dtype).to(DEV)
    assert _rel(silu_and_mul(gate_up), REFERENCE_OPS.silu_and_mul(gate_up.clone())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 40, 64), (3, 33, 100), (8, 96, 576), (16, 17, 200), (0, 8, 16)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    """Ragged rows, columns and a K that no block divides; the residual form adds in place."""
    from minisgl.kernels.triton.gemv import GemvConfig, gemv

    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * k**-0.5
    b = torch.randn(n, generator=gen) if bias else None
    res = torch.randn(m, n, generator=gen)
    x, w, res = x.to(dtype).to(DEV), w.to(dtype).to(DEV), res.to(dtype).to(DEV)
    b = None if b is None else b.to(dtype).to(DEV)
    want = REFERENCE_OPS.linear(x, w, b)
    for config in (GemvConfig(block_n=16, block_k=32), GemvConfig(block_n=32, block_k=64)):
        out = gemv(x, w, b, config=config)
        assert out.shape == (m, n)
        into = res.clone()
        assert gemv(x, w, b, into, config) is into
        if m:
            assert _rel(out, want) < TOL[dtype] and _rel(into, res + want) < TOL[dtype]


def test_gemv_refuses_what_it_cannot_take() -> None:
    from minisgl.kernels.triton.gemv import gemv

    w = torch.randn(8, 16, device=DEV)
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(17, 16, device=DEV), w)  # more rows than one tile
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(16, 2, device=DEV).t(), w)  # strided in K
    with pytest.raises(ValueError, match="residual"):
        gemv(torch.randn(2, 16, device=DEV), w, residual=torch.zeros(2, 9, device=DEV))


def test_cuda_ops_take_the_gemv_for_few_rows_only() -> None:
    """Up to GEMV_MAX_ROWS rows of a half-precision projection with N <= 2K go to the GEMV (the
    residual add as its epilogue); more rows, float32 and wide projections go to cuBLAS; both agree
    with the reference."""
    from minisgl.backends import cuda
    from minisgl.kernels.triton.gemv import gemv, gemv_fp8_rows

    ops, dt = cuda.CudaOps(), torch.float16
    w = (torch.randn(48, 64) * 0.125).to(dt).to(DEV)
    for m in (1, cuda.GEMV_MAX_ROWS, cuda.GEMV_MAX_ROWS + 1):
        x, res = torch.randn(m, 64).to(dt).to(DEV), torch.randn(m, 48).to(dt).to(DEV)
        config = cuda.gemv_config(x, w)
        assert (config is not None) == (m <= cuda.GEMV_MAX_ROWS)
        assert cuda.gemv_config(x.float(), w.float()) is None
        assert cuda.gemv_config(x, torch.empty(129, 64, dtype=dt, device=DEV)) is None  # N > 2K
        out, added = ops.linear(x, w, None), ops.linear_add_(x, w, None, res.clone())
        if config is not None:  # one row's residual add: the row GEMV, unscaled (`bf16_row_config`)
            assert torch.equal(out, gemv(x, w, config=config))
            row = cuda.bf16_row_config(x, w)
            assert (row is not None) == (m == 1)
            want_added = (
                gemv(x, w, None, res.clone(), config)
                if row is None
                else gemv_fp8_rows(x, w, None, None, res.clone(), config=row)
            )
            assert torch.equal(added, want_added)
        want = REFERENCE_OPS.linear(x.float(), w.float(), None)
        assert _rel(out, want) < TOL[dt] and _rel(added, res.float() + want) < TOL[dt]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "vocab", "block"), [(5, 97, 32), (3, 1000, 128), (2, 4096, 4096), (1, 300, 1024)]
)
def test_triton_argmax_rows_is_torch_argmax(dtype: torch.dtype, rows: int, vocab: int, block: int) -> None:
    """`kernels.triton.argmax.argmax_rows` (chunks, then a row's first chunk holding its maximum) gives
    `argmax(-1)`'s indices: ties across and within chunks to the first, a row all equal, all -inf, a
    NaN (counted largest, the first one wins), the maximum in the last partial chunk."""
    from minisgl.kernels.triton.argmax import argmax_rows

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows + 4, vocab, generator=gen)
    logits[0, 3] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie: the first index wins
    logits[1] = 0.0  # all equal: index 0
    logits[2] = float("-inf")
    logits[3, vocab // 2] = logits[3, vocab - 2] = float("nan")
    logits[4, vocab - 1] = logits[4].max() + 1
    x = logits.to(dtype).to(DEV)
    got = argmax_rows(x, block=block)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), x.float().cpu().argmax(dim=-1))
