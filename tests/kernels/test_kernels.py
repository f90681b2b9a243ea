"""The CPU kernels (minisgl.kernels) against plain torch, and their fallback when they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minisgl import kernels
from minisgl.backends import REFERENCE_OPS

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels could not be built here")


def _paged_reference(q, kp, vp, page_rows, lens, ps):  # noqa: ANN001, ANN202
    """Dense attention of each request's one query row over its cached positions, in float64."""
    bsz, hq, d = q.shape
    hkv = kp.shape[1]
    out = torch.empty_like(q)
    for b in range(bsz):
        j = torch.arange(int(lens[b]))
        slots = page_rows[b, j // ps].long() * ps + j % ps
        k, v = kp[slots].double().transpose(0, 1), vp[slots].double().transpose(0, 1)  # (Hkv, L, D)
        qq = q[b].double().view(hkv, hq // hkv, d)  # (Hkv, G, D)
        s = (qq @ k.transpose(1, 2)) * d**-0.5
        out[b] = (s.softmax(-1) @ v).reshape(hq, d).float()
    return out


@needs_kernels
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (4, 4, 64), (6, 2, 48), (2, 1, 72)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_dense(hq: int, hkv: int, d: int, threads: int) -> None:
    """AVX2 paths (head width a multiple of 64) and the plain loop (48, 72), MHA and GQA, lengths from 1
    to several pages with ragged ends, pages scattered over the pool, 1 and 2 threads alike."""
    torch.manual_seed(0)
    ps, num_pages, bsz = 16, 96, 6
    kp, vp = torch.randn(num_pages * ps, hkv, d), torch.randn(num_pages * ps, hkv, d)
    lens = torch.tensor([1, 7, 16, 17, 100, 203], dtype=torch.int32)
    pages = int((lens.max() + ps - 1) // ps)
    page_rows = torch.randperm(num_pages)[: bsz * pages].view(bsz, pages).to(torch.int32)
    q = torch.randn(bsz, hq, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.decode_attention(q, kp, vp, page_rows, lens, ps, d**-0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, _paged_reference(q, kp, vp, page_rows, lens, ps), atol=2e-5, rtol=1e-4)


@needs_kernels
def test_decode_attention_rejects_bad_layouts() -> None:
    q, kp = torch.randn(2, 4, 64), torch.randn(32, 2, 64)
    rows, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_pool"):
        kernels.decode_attention(
            q, kp.transpose(0, 1).contiguous().transpose(0, 1), kp, rows, lens, 16, 0.125
        )
    with pytest.raises(ValueError, match="page_rows"):
        kernels.decode_attention(q, kp, kp, rows.long(), lens, 16, 0.125)
    with pytest.raises(ValueError, match="shapes"):
        kernels.decode_attention(torch.randn(2, 3, 64), kp, kp, rows, lens, 16, 0.125)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 x 576 runs the rows in parallel
def test_add_rmsnorm_matches_torch(rows: int) -> None:
    torch.manual_seed(0)
    h, delta, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    ref_h = h + delta
    ref = w * (ref_h * torch.rsqrt(ref_h.pow(2).mean(-1, keepdim=True) + 1e-5))
    out = kernels.add_rmsnorm(h, delta, w, 1e-5)
    torch.testing.assert_close(h, ref_h, atol=0, rtol=0)  # the residual add happened in place, exactly
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.add_rmsnorm(h, None, w, 1e-5), ref, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [3, 200])
def test_rope_split_equals_torch_rotation(rows: int) -> None:
    """Bit for bit: the same products and sums as the reference rotary, each rounded alike."""
    torch.manual_seed(0)
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(rows, (hq + 2 * hkv) * d)
    angles = torch.rand(rows, d // 2) * 100
    cos, sin = angles.cos(), angles.sin()
    q, k, v = kernels.rope_split(qkv, cos, sin, hq, hkv, d)
    qk = REFERENCE_OPS.rotary(qkv[:, : (hq + hkv) * d].view(rows, hq + hkv, d), cos[:, None], sin[:, None])
    assert torch.equal(q, qk[:, :hq]) and torch.equal(k, qk[:, hq:])
    assert torch.equal(v, qkv[:, (hq + hkv) * d :].view(rows, hkv, d))


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [3, 200])
def test_rope_store_equals_split_then_store(rows: int, kv_dtype: torch.dtype) -> None:
    """q as rope_split gives it, k and v in the pool slots as `.to(pool dtype)` rounds them."""
    torch.manual_seed(0)
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(rows, (hq + 2 * hkv) * d) * 3
    angles = torch.rand(rows, d // 2) * 100
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(4 * rows)[:rows]
    kp, vp = torch.zeros(4 * rows, hkv, d, dtype=kv_dtype), torch.zeros(4 * rows, hkv, d, dtype=kv_dtype)
    q = kernels.rope_store(qkv, cos, sin, hq, hkv, d, slots, kp, vp)
    q_ref, k_ref, v_ref = kernels.rope_split(qkv, cos, sin, hq, hkv, d)
    assert torch.equal(q, q_ref)
    assert torch.equal(kp[slots], k_ref.to(kv_dtype)) and torch.equal(vp[slots], v_ref.to(kv_dtype))
    untouched = torch.ones(4 * rows, dtype=torch.bool)
    untouched[slots] = False
    assert not kp[untouched].any() and not vp[untouched].any()


@needs_kernels
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (6, 2, 48)])
def test_decode_attention_reads_a_float16_pool(hq: int, hkv: int, d: int) -> None:
    """A float16 pool: the same as the dense reference over the float16 values (converted exactly)."""
    torch.manual_seed(1)
    ps, num_pages = 16, 40
    kp, vp = torch.randn(num_pages * ps, hkv, d).half(), torch.randn(num_pages * ps, hkv, d).half()
    lens = torch.tensor([1, 33, 150], dtype=torch.int32)
    page_rows = torch.randperm(num_pages)[:30].view(3, 10).to(torch.int32)
    q = torch.randn(3, hq, d)
    out = kernels.decode_attention(q, kp, vp, page_rows, lens, ps, d**-0.5)
    want = _paged_reference(q, kp.float(), vp.float(), page_rows, lens, ps)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (14, 2, 64), (10, 5, 64)])
@pytest.mark.parametrize("half", [True, False])
def test_decode_attention_grouped_heads_equal_one_head_at_a_time(
    hq: int, hkv: int, d: int, half: bool
) -> None:
    """Query heads that share a KV head are attended together (their K/V converted once): bitwise what
    each head gives with a KV head of its own (the pool's heads repeated, one query head per KV head),
    at batches and lengths on either side of the one-thread bound, padding rows included."""
    torch.manual_seed(5)
    ps, num_pages, g = 16, 120, hq // hkv
    dtype = torch.float16 if half else torch.float32
    kp, vp = torch.randn(num_pages * ps, hkv, d).to(dtype), torch.randn(num_pages * ps, hkv, d).to(dtype)
    kp1, vp1 = kp.repeat_interleave(g, dim=1).contiguous(), vp.repeat_interleave(g, dim=1).contiguous()
    for lens in ([1], [17], [300], [70, 0, 150, 33, 2, 16]):
        b = len(lens)
        page_rows = torch.randperm(num_pages)[: b * 20].view(b, 20).to(torch.int32)
        q = torch.randn(b, hq, d)
        seq = torch.tensor(lens, dtype=torch.int32)
        grouped = kernels.decode_attention(q, kp, vp, page_rows, seq, ps, d**-0.5)
        alone = kernels.decode_attention(q, kp1, vp1, page_rows, seq, ps, d**-0.5)
        assert torch.equal(grouped, alone), lens


@needs_kernels
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (6, 2, 48), (4, 4, 64)])
def test_decode_attention_rows_do_not_depend_on_the_batch(hq: int, hkv: int, d: int) -> None:
    """Each request's output is bitwise the same alone or in a batch (float16 pool, grouped heads),
    and a padding row (length 0) gives zeros."""
    torch.manual_seed(2)
    ps, num_pages = 16, 40
    kp, vp = torch.randn(num_pages * ps, hkv, d).half(), torch.randn(num_pages * ps, hkv, d).half()
    lens = torch.tensor([70, 1, 0, 150], dtype=torch.int32)
    page_rows = torch.randperm(num_pages)[:40].view(4, 10).to(torch.int32)
    q = torch.randn(4, hq, d)
    batch = kernels.decode_attention(q, kp, vp, page_rows, lens, ps, d**-0.5)
    for i in range(4):
        one = kernels.decode_attention(
            q[i : i + 1].contiguous(),
            kp,
            vp,
            page_rows[i : i + 1].contiguous(),
            lens[i : i + 1].contiguous(),
            ps,
            d**-0.5,
        )
        assert torch.equal(one[0], batch[i]), i
    assert torch.equal(batch[2], torch.zeros(hq, d))


@needs_kernels
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (6, 2, 48)])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_extend_attention_matches_dense(hq: int, hkv: int, d: int, half: bool, threads: int) -> None:
    """New tokens over their paged caches, each up to its own position: fresh prompts and prompts
    after a cached prefix, blocks of query rows (32) with ragged ends, pages scattered over the pool,
    float32 and float16 pools, the blocked AVX-512 path (widths a multiple of 16) and the per-row one
    (48 here is one too; the portable build takes the other) -- each new row against the dense
    reference of the decode kernel's test, its request's positions up to itself."""
    torch.manual_seed(2)
    ps, num_pages = 16, 160
    kp, vp = torch.randn(num_pages * ps, hkv, d), torch.randn(num_pages * ps, hkv, d)
    if half:
        kp, vp = kp.half(), vp.half()
    new = [1, 33, 70, 5, 64]  # new tokens per request
    cached = [0, 0, 15, 200, 33]  # positions before them
    lens = torch.tensor([c + n for c, n in zip(cached, new, strict=True)], dtype=torch.int32)
    pages = int((lens.max() + ps - 1) // ps)
    page_rows = torch.randperm(num_pages)[: len(new) * pages].view(len(new), pages).to(torch.int32)
    starts = torch.tensor([0, *new], dtype=torch.int64).cumsum(0)
    q = torch.randn(int(starts[-1]), hq, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.extend_attention(q, kp, vp, page_rows, lens, starts, ps, d**-0.5)
    finally:
        torch.set_num_threads(before)
    # each new token as one decode query row that sees its prefix and the new tokens up to itself
    rows = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))
    seen = torch.cat([torch.arange(c + 1, c + n + 1) for c, n in zip(cached, new, strict=True)]).to(
        torch.int32
    )
    want = _paged_reference(q, kp.float(), vp.float(), page_rows[rows], seen, ps)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("half", [False, True])
def test_extend_attention_rows_do_not_depend_on_their_batch_or_chunk(half: bool) -> None:
    """A new row's output is bitwise the same alone, beside another request, and when its prompt is
    extended in two chunks (the rows grouped differently each time: blocks of 32 query rows, 12
    (row, head) pairs sharing each K/V load)."""
    torch.manual_seed(5)
    hq, hkv, d, ps = 9, 3, 64, 16
    kp, vp = torch.randn(64 * ps, hkv, d), torch.randn(64 * ps, hkv, d)
    if half:
        kp, vp = kp.half(), vp.half()
    cached, new = 15, 70
    page_rows = torch.randperm(64)[:12].view(2, 6).to(torch.int32)
    q = torch.randn(new + 23, hq, d)

    def extend(rows: slice, before: int, others: int = 0) -> torch.Tensor:
        n = rows.stop - rows.start
        lens = torch.tensor([before + n, 9 + others][: 1 + (others > 0)], dtype=torch.int32)
        starts = torch.tensor([0, n, n + others][: 2 + (others > 0)], dtype=torch.int64)
        qs = torch.cat([q[rows], q[new : new + others]]) if others else q[rows]
        out = kernels.extend_attention(
            qs.contiguous(), kp, vp, page_rows[: len(lens)].contiguous(), lens, starts, ps, d**-0.5
        )
        return out[:n]

    alone = extend(slice(0, new), cached)
    assert torch.equal(extend(slice(0, new), cached, others=23), alone)
    head, tail = extend(slice(0, 41), cached), extend(slice(41, new), cached + 41)
    assert torch.equal(torch.cat([head, tail]), alone)


def test_extend_attention_rejects_bad_layouts() -> None:
    if not kernels.available():
        pytest.skip("the CPU kernels could not be built here")
    kp = torch.randn(64, 2, 64)
    rows, lens, starts = (
        torch.zeros(2, 4, dtype=torch.int32),
        torch.tensor([3, 4], dtype=torch.int32),
        torch.tensor([0, 1, 3]),
    )
    with pytest.raises(ValueError, match="extend_attention"):
        kernels.extend_attention(
            torch.randn(4, 4, 64), kp, kp, rows, lens, starts, 16, 0.125
        )  # starts end at 3
    with pytest.raises(ValueError, match="extend_attention"):
        kernels.extend_attention(torch.randn(3, 3, 64), kp, kp, rows, lens, starts, 16, 0.125)  # 3 % 2 heads


@needs_kernels
@pytest.mark.parametrize("shape", [(16, 2 * 1536), (5, 2 * 13), (100, 2 * 1536)])
def test_silu_mul_matches_torch(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(*shape) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("v", [1, 15, 16, 100, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_argmax_rows_is_torch_argmax(rows: int, v: int) -> None:
    """The greedy tokens of a CPU decode graph: the first index of each row's maximum, ties, -inf
    rows and NaN (which torch counts as the maximum) included."""
    torch.manual_seed(v)
    x = torch.randn(rows, v)
    if v >= 16:
        x[0, 5] = x[0, v - 3] = x[0].max() + 1  # a tie: the first wins
        x[-1, :] = float("-inf")
    if rows > 1:
        x[1, v // 2] = float("nan")
        x[1, v - 1] = float("nan")
        x[1, 0] = float("inf")
    want = x.argmax(-1)
    got = kernels.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"MINISGL_CPU_KERNELS": "0"}, "turned off"), ({"CC": "false"}, "could not build")],
)
def test_without_kernels_torch_paths_serve(tmp_path, env: dict[str, str], expected: str) -> None:  # noqa: ANN001
    """Turned off, or a compiler that fails: load() says why once and the CPU ops fall back to torch."""
    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "from minisgl import kernels\n"
        "from minisgl.backends.cpu import CpuOps\n"
        "assert not kernels.available()\n"
        "x = torch.randn(4, 8)\n"
        "g, u = x.chunk(2, dim=-1)\n"
        "assert torch.allclose(CpuOps().silu_and_mul(x.clone()), torch.nn.functional.silu(g) * u)\n"
        "print('fallback ok')\n"
    )
    full_env = {**os.environ, "MINISGL_CACHE_DIR": str(tmp_path), **env}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout
    assert expected in proc.stderr


def test_build_cache_is_keyed_by_the_compiler_install_without_running_it(
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """A library is built once per (source, flags, compiler install): a second start reuses it, with no
    `cc --version` subprocess; a compiler that changed on disk builds a new one."""
    from minisgl.kernels import build

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    cc = tmp_path / "cc"  # a stand-in compiler: logs its arguments, writes the -o file
    cc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nwhile [ "$1" != -o ]; do shift; done\n: > "$2"\n')
    cc.chmod(0o755)
    source = tmp_path / "k.c"
    source.write_text("int f(void) { return 1; }\n")
    first = build._build(str(cc), source, ["-O2"], "libk.so")
    again = build._build(str(cc), source, ["-O2"], "libk.so")
    assert first == again and first.exists()
    assert len(calls.read_text().splitlines()) == 1  # one compile; never a --version
    os.utime(cc, ns=(1, 1))  # the compiler was replaced (a new install's time)
    rebuilt = build._build(str(cc), source, ["-O2"], "libk.so")
    assert rebuilt != first and len(calls.read_text().splitlines()) == 2


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 13, 16, 130, 300])  # register blocks 1..12, two row chunks
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matmul_matches_linear_and_is_batch_invariant(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    n, k = 200, 77  # 25 column blocks of 8, an odd depth
    w, x = torch.randn(n, k), torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    packed = kernels.pack_weight(w)
    y = kernels.packed_matmul(x, packed, b)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    # every row is one sum in the same order whatever shares its batch: bit-identical alone
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(kernels.packed_matmul(x[i : i + 1].contiguous(), packed, b), y[i : i + 1])


@needs_kernels
def test_pack_weight_rejects_widths_not_a_multiple_of_8() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.pack_weight(torch.randn(12, 4))


@needs_kernels
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 2, 128), (6, 2, 48)])
def test_prefill_attention_matches_causal_sdpa(hq: int, hkv: int, d: int) -> None:
    """Three prompts of different lengths in one flat batch, each causal over its own rows only."""
    torch.manual_seed(0)
    lens = [1, 9, 70]
    t = sum(lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    starts = torch.tensor([0, *lens]).cumsum(0)
    out = kernels.prefill_attention(q, k, v, starts, d**-0.5)
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        ref = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).double(),
            k[a:b].transpose(0, 1).double(),
            v[a:b].transpose(0, 1).double(),
            is_causal=True,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref.float(), atol=2e-5, rtol=1e-4)
