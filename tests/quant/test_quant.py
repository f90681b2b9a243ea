"""Weights kept in GGUF's block formats: the reference dequantization against the `gguf` package's,
and each quantized CPU kernel (`minisgl.kernels.quant`, every instruction set this CPU runs) against
numpy: dequantized weights times the activations as the kernels quantize them (so a wrong block
layout, scale or sum shows as a real error, not as quantization noise), batch invariance, the fused
RMSNorm / SiLU x up / residual add, mixed and permuted parts, the embedding lookup."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels.build import ISAS, cpu_flags
from minisgl.kernels.quant import dequant_rows, qlinear, quant_available
from minisgl.quant import GGMLType, QuantizedWeight, QuantPart, dequantize

BLOCK_FORMATS = [t for t in GGMLType if not t.is_float]
RUNNABLE_ISAS = [isa for isa, (_, need) in ISAS.items() if need <= cpu_flags()]
pytestmark = pytest.mark.skipif(not quant_available("portable"), reason="no C compiler for the kernels")


def random_blocks(fmt: GGMLType, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """(rows, row_bytes) uint8 of valid blocks: quantized from normal weights by the gguf package
    where it can, else random bytes with small positive f16 scales (every bit pattern of the
    integer parts is a valid K-quant block)."""
    import gguf.quants as gq
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    if fmt.is_float or fmt.block_size == 32:
        w = rng.standard_normal((rows, k)).astype(np.float32)
        return (
            np.ascontiguousarray(gq.quantize(w, GGMLQuantizationType(int(fmt))))
            .view(np.uint8)
            .reshape(rows, -1)
        )
    raw = rng.integers(0, 256, (rows, fmt.row_bytes(k)), dtype=np.uint8)
    blocks = raw.reshape(-1, fmt.type_size)
    scale = rng.uniform(1e-3, 2e-2, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if fmt == GGMLType.Q6_K:
        blocks[:, 208:210] = scale[:, 0:2]
    else:  # d, dmin
        blocks[:, 0:4] = scale
    return raw


def weight_of(fmt: GGMLType, rows: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A one-part QuantizedWeight and its dequantized (rows, k) float32."""
    data = torch.from_numpy(random_blocks(fmt, rows, k, seed))
    return QuantizedWeight([QuantPart(fmt, data, k)]), dequantize(fmt, data, k)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: per 16 values, scale max|x| / 127, rounded to nearest (even)."""
    xb = x.double().reshape(x.shape[0], -1, 16)
    d = xb.abs().amax(-1, keepdim=True).float().double() / 127
    inv = torch.where(d > 0, 1 / d.float(), 0).double()
    return (torch.round(xb * inv) * d).reshape(x.shape)


@pytest.mark.parametrize("fmt", list(GGMLType), ids=lambda f: f.name)
def test_reference_dequantization_matches_gguf(fmt: GGMLType) -> None:
    import gguf.quants as gq
    from gguf import GGMLQuantizationType

    raw = random_blocks(fmt, 4, 512, seed=int(fmt))
    typed = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}.get(fmt)
    want = gq.dequantize(raw.view(typed) if typed else raw, GGMLQuantizationType(int(fmt))).reshape(4, 512)
    got = dequantize(fmt, torch.from_numpy(raw), 512).numpy()
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("fmt", list(GGMLType), ids=lambda f: f.name)
def test_qlinear_matches_numpy(isa: str, fmt: GGMLType) -> None:
    """Against dequantized weights in float64: block formats with the activations quantized as the
    kernel does (tight), float formats with the activations as they are; and a loose bound against
    the exact product (the quantization noise itself)."""
    n, k = 37, 512  # a row count that is no multiple of the tiles
    w, ref = weight_of(fmt, n, k, seed=int(fmt))
    torch.manual_seed(0)
    x = torch.randn(5, k)
    bias = torch.randn(n)
    y = qlinear(x, w, bias, isa=isa)
    exact = (x.double() @ ref.double().T + bias.double()).float()
    scale = exact.abs().max()
    if fmt.is_float:
        torch.testing.assert_close(y, exact, atol=2e-6 * scale, rtol=0)
        return
    want = (q8_activations(x) @ ref.double().T + bias.double()).float()
    torch.testing.assert_close(y, want, atol=2e-5 * scale, rtol=0)
    assert (y - exact).abs().max() < 2e-2 * scale


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_rows_are_batch_invariant(isa: str, prefill: bool) -> None:
    """Each row's outputs are bitwise the same alone, in any batch and at any position in it (prefill
    passes too: the amx kernels' tiles, a mix of formats their other path)."""
    for w in (
        QuantizedWeight([weight_of(f, 24, 512, seed=i)[0].parts[0] for i, f in enumerate(GGMLType)]),
        QuantizedWeight([weight_of(f, 24, 512, seed=i)[0].parts[0] for i, f in enumerate(BLOCK_FORMATS)]),
    ):
        x = torch.randn(37, 512)
        full = qlinear(x, w, prefill=prefill, isa=isa)
        for rows in ([3], [0, 1], [4, 5, 6, 7, 8], list(range(33)), list(range(36, -1, -1))):
            got = qlinear(x[rows].contiguous(), w, prefill=prefill, isa=isa)
            torch.testing.assert_close(got, full[rows], rtol=0, atol=0)


BF16_ISAS = [isa for isa in ("amx", "avx512bf16") if isa in RUNNABLE_ISAS]


@pytest.mark.skipif(not BF16_ISAS, reason="no AVX-512 BF16 or AMX-BF16 here")
@pytest.mark.parametrize("isa", BF16_ISAS or ["none"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.name)
def test_bf16_prefill_matches_numpy_in_bfloat16(fmt: GGMLType, isa: str) -> None:
    """The prefill passes of the amx (AMX tiles) and avx512bf16 (vdpbf16ps) builds: weights and
    activations rounded to bfloat16, float32 sums; the norm, SiLU x up, bias and residual as in the
    other path; row counts that are no multiple of the tiles."""
    w, ref = weight_of(fmt, 70, 512, seed=int(fmt))
    torch.manual_seed(1)
    x, bias, res = torch.randn(45, 512), torch.randn(70), torch.randn(45, 70)
    bf = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    want = (bf(x) @ bf(ref).T + bias.double()).float()
    got = qlinear(x, w, bias, prefill=True, isa=isa)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max(), rtol=0)
    assert (got - (x.double() @ ref.double().T + bias.double())).abs().max() < 2e-2 * want.abs().max()
    gu = torch.randn(45, 1024)
    act = F.silu(gu[:, :512]) * gu[:, 512:]
    want = res.double() + bf(act) @ bf(ref).T
    got = qlinear(gu, w, silu_mul=True, residual=res.clone(), prefill=True, isa=isa)
    torch.testing.assert_close(got, want.float(), atol=1e-4 * want.abs().max(), rtol=0)
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1 + 0.1 * torch.arange(512) / 512)
    want = bf(normed) @ bf(ref).T
    got = qlinear(x, w, norm=(1 + 0.1 * torch.arange(512) / 512, 1e-6), prefill=True, isa=isa)
    torch.testing.assert_close(got, want.float(), atol=1e-4 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_isa_paths_agree(isa: str) -> None:
    """Every instruction set's kernel computes the same sums (in its own order)."""
    w = QuantizedWeight([weight_of(f, 16, 512, seed=i)[0].parts[0] for i, f in enumerate(GGMLType)])
    x = torch.randn(3, 512)
    want = qlinear(x, w, isa="portable")
    torch.testing.assert_close(qlinear(x, w, isa=isa), want, rtol=0, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_fused_norm_silu_and_residual(isa: str) -> None:
    w, ref = weight_of(GGMLType.Q4_K, 40, 256)
    x = torch.randn(6, 256)
    nw = torch.rand(256) + 0.5
    normed = nw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(
        qlinear(x, w, norm=(nw, 1e-5), isa=isa), qlinear(normed, w, isa=isa), rtol=1e-4, atol=1e-4
    )
    gu = torch.randn(6, 512)
    act = F.silu(gu[:, :256]) * gu[:, 256:]
    torch.testing.assert_close(
        qlinear(gu, w, silu_mul=True, isa=isa), qlinear(act, w, isa=isa), rtol=1e-4, atol=1e-4
    )
    res = torch.randn(6, 40)
    want = res + qlinear(act, w, isa=isa)
    out = qlinear(gu, w, silu_mul=True, residual=res, isa=isa)
    assert out is res
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_parts_orders_and_k_shards(isa: str) -> None:
    """A fused weight of parts in different formats, one read in a permuted row order and one through
    a K-range view (a tensor-parallel shard of whole blocks): the kernel reads the row table."""
    a_data = torch.from_numpy(random_blocks(GGMLType.Q4_0, 8, 512, 1))
    b_full = torch.from_numpy(random_blocks(GGMLType.Q8_0, 6, 1024, 2))
    b_data = b_full[:, GGMLType.Q8_0.row_bytes(256) : GGMLType.Q8_0.row_bytes(768)]  # K 256..768
    c_data = torch.from_numpy(random_blocks(GGMLType.F16, 4, 512, 3))
    order = torch.tensor([7, 0, 5, 2, 1, 6, 3, 4])
    w = QuantizedWeight(
        [
            QuantPart(GGMLType.Q4_0, a_data, 512, order),
            QuantPart(GGMLType.Q8_0, b_data, 512),
            QuantPart(GGMLType.F16, c_data, 512),
        ]
    )
    ref = torch.cat(
        [
            dequantize(GGMLType.Q4_0, a_data, 512)[order],
            dequantize(GGMLType.Q8_0, b_full, 1024)[:, 256:768],
            dequantize(GGMLType.F16, c_data, 512),
        ]
    )
    torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=0)
    x = torch.randn(3, 512)
    want = (q8_activations(x) @ ref.double().T).float()
    want[:, 14:] = (x.double() @ ref[14:].double().T).float()  # the float rows see x as it is
    torch.testing.assert_close(qlinear(x, w, isa=isa), want, atol=2e-5 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_embedding_lookup_is_exact(isa: str) -> None:
    w = QuantizedWeight([weight_of(f, 8, 512, seed=i)[0].parts[0] for i, f in enumerate(GGMLType)])
    ids = torch.tensor([0, 17, 80, 3, 87, 17])
    ref = w.dequantize()
    torch.testing.assert_close(dequant_rows(w, ids, isa=isa), ref[ids], rtol=0, atol=0)
    torch.testing.assert_close(w.lookup(ids), ref[ids], rtol=0, atol=0)
    with pytest.raises(IndexError):
        dequant_rows(w, torch.tensor([88]), isa=isa)


def test_bad_shapes_are_clear_errors() -> None:
    w, _ = weight_of(GGMLType.Q4_1, 8, 64)
    with pytest.raises(ValueError, match="against a"):
        qlinear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="whole number"):
        QuantPart(GGMLType.Q4_K, torch.zeros(2, 144, dtype=torch.uint8), 100)
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        qlinear(torch.randn(2, 64, dtype=torch.float64), w)


DIRECT_FORMATS = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]


def direct_weight(k: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A fused weight of every format the decode passes read straight from their blocks (runs of one
    format that do not line up with the kernels' groups of rows, one part in a permuted row order)."""
    parts, refs = [], []
    for i, (fmt, rows) in enumerate(zip(DIRECT_FORMATS, (5, 3, 6, 1, 7), strict=True)):
        data = torch.from_numpy(random_blocks(fmt, rows, k, seed=10 + i))
        order = torch.arange(rows).flip(0) if i == 2 else None
        parts.append(QuantPart(fmt, data, k, order))
        ref = dequantize(fmt, data, k)
        refs.append(ref if order is None else ref[order])
    return QuantizedWeight(parts), torch.cat(refs)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
@pytest.mark.parametrize("k", [64, 96, 608, 1056], ids=lambda k: f"K{k}")
def test_decode_rows_of_legacy_formats_match_numpy(isa: str, k: int) -> None:
    """The 32-weight formats in decode passes (the avx512 builds read them straight from their blocks):
    odd block counts, a partial chunk of 16 blocks, every micro-tile shape (M of 1 to 9)."""
    w, ref = direct_weight(k)
    torch.manual_seed(k)
    bias = torch.randn(ref.shape[0])
    for m in (1, 2, 3, 4, 5, 7, 9):
        x = torch.randn(m, k) * torch.logspace(-2, 1, k)  # 16-value groups of very different scales
        want = (q8_activations(x) @ ref.double().T + bias.double()).float()
        got = qlinear(x, w, bias, isa=isa)
        torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("isa", RUNNABLE_ISAS)
def test_decode_rows_of_legacy_formats_are_batch_invariant(isa: str) -> None:
    w, _ = direct_weight(608)
    x = torch.randn(23, 608)
    full = qlinear(x, w, isa=isa)
    for rows in ([3], [0, 1], [4, 5, 6], [7, 8, 9, 10, 11], list(range(22, -1, -1))):
        torch.testing.assert_close(qlinear(x[rows].contiguous(), w, isa=isa), full[rows], rtol=0, atol=0)
    nw = torch.rand(608) + 0.5
    fused = qlinear(x, w, norm=(nw, 1e-5), isa=isa)
    torch.testing.assert_close(
        qlinear(x[[5]].contiguous(), w, norm=(nw, 1e-5), isa=isa), fused[[5]], rtol=0, atol=0
    )


_GUARD_PAGE_CHECK = """
import ctypes, mmap, sys
import numpy as np, torch
sys.path[:0] = sys.argv[2:]
from test_quant import DIRECT_FORMATS, dequantize, q8_activations, random_blocks
from minisgl.kernels.quant import qlinear
from minisgl.quant import QuantizedWeight, QuantPart

page = mmap.PAGESIZE
k, rows = 96, 3  # an odd number of blocks per row
# fixed activations: torch seeds each process at random, and an activation that lands on a rounding
# tie of its int8 quantization can round one way here and the other in q8_activations (one step of
# dx, ~2e-3 of the output: seen once in make test)
torch.manual_seed(0)
for isa in sys.argv[1].split(","):
    for fmt in DIRECT_FORMATS:
        print(isa, fmt.name, flush=True)  # the last line printed names the culprit of a crash
        raw = random_blocks(fmt, rows, k, seed=3)
        buf = mmap.mmap(-1, 2 * page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(base + page), page, 0) == 0  # PROT_NONE
        view = np.frombuffer(buf, dtype=np.uint8, count=raw.size, offset=page - raw.size).reshape(rows, -1)
        view[:] = raw
        data = torch.from_numpy(view)
        x = torch.randn(2, k)
        want = (q8_activations(x) @ dequantize(fmt, data, k).double().T).float()
        got = qlinear(x, QuantizedWeight([QuantPart(fmt, data, k)]), isa=isa)
        torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max(), rtol=0)
"""


def test_decode_reads_nothing_past_the_last_row() -> None:
    """Weights whose last byte is the last byte before an unreadable page (as a tensor at the end of
    a memory-mapped GGUF file can be), every 32-weight format and instruction set: a kernel that loads
    past a row kills the process (SIGSEGV), so the check runs in a child."""
    import subprocess
    import sys
    from pathlib import Path

    paths = [str(Path(__file__).parent), *sys.path]
    proc = subprocess.run(
        [sys.executable, "-c", _GUARD_PAGE_CHECK, ",".join(RUNNABLE_ISAS), *paths],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"died at {proc.stdout.splitlines()[-1:]}: {proc.stderr[-2000:]}"


def test_cpu_lm_head_takes_the_decode_kernel_in_prefill_passes() -> None:
    """The LM head's rows (one a sequence) go through the decode kernel in a prefill pass too: bitwise
    what a decode pass gives, so a bf16 build's prefill never decodes the whole vocabulary table."""
    from minisgl.backends.cpu import CpuOps

    w, ref = weight_of(GGMLType.Q8_0, 40, 512, seed=3)
    h = torch.randn(3, 512)
    ops = CpuOps()
    ops.prepare(is_decode=False)
    prefill_head = ops.lm_head(h, w)
    torch.testing.assert_close(prefill_head, qlinear(h, w), rtol=0, atol=0)
    ops.prepare(is_decode=True)
    torch.testing.assert_close(ops.lm_head(h, w), prefill_head, rtol=0, atol=0)
    want = (q8_activations(h) @ ref.double().T).float()
    torch.testing.assert_close(prefill_head, want, atol=2e-5 * want.abs().max(), rtol=0)
