"""minisgl's fp8 kernels against the dequantized reference: the GEMV with fp8 weights, activation
quantization, the block-scaled matmul, and the paged attention kernels over an fp8 KV cache.

On a GPU they run compiled (float32 and bf16 activations); without one, in Triton's CPU interpreter
(conftest.py) in float32 on small shapes."""

from __future__ import annotations

import pytest
import torch
from test_triton_kernels import _dense_attention, _pages, _rel

from minisgl.backends.fp8 import FP8, dequantize_fp8, quantize_fp8, quantize_rows_fp8
from minisgl.kernels.triton import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
BLOCKS = [None, (16, 32)]  # per channel; per block (rows, columns)


def _weight(n: int, k: int, block: tuple[int, int] | None, gen: torch.Generator):
    """A random fp8 weight (N, K), its scales, and its dequantized float32 value (the reference)."""
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3  # rows of unequal size
    q, s = quantize_fp8(w, block)
    return q.to(DEV), s.to(DEV), dequantize_fp8(q, s, block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 96), (5, 40, 64), (16, 64, 160)])
def test_gemv_fp8_matches_the_dequantized_weight(
    dtype: torch.dtype, block: tuple[int, int] | None, m: int, n: int, k: int
) -> None:
    from minisgl.kernels.triton.gemv import GemvConfig, gemv_fp8

    gen = torch.Generator().manual_seed(m * n + k)
    q, s, ref_w = _weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    ref = x.double() @ ref_w.double().T
    config = GemvConfig(16, 64, 4, 2)
    assert _rel(gemv_fp8(x.to(DEV), q, s, block, config=config), ref) < TOL[dtype]
    assert (
        _rel(gemv_fp8(x.to(DEV), q, s, block, bias.to(DEV), config=config), ref + bias.double()) < TOL[dtype]
    )
    res = torch.randn(m, n, generator=gen).to(dtype)
    out = res.to(DEV, copy=True)
    assert gemv_fp8(x.to(DEV), q, s, block, residual=out, config=config) is out  # in place
    assert _rel(out, res.double() + ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 48, 96, (16, 64, 4)),  # K in steps
        (3, 40, 200, (4, 512, 2)),  # one step over K
        (1, 48, 200, (4, 256, 2, 1, True)),  # one step, the first tile before PDL's wait
        (2, 40, 200, (2, 256, 2, 3, True)),  # x kept, 3 blocks of rows a program, the last one partial
        (1, 48, 96, (1, 128, 1, 8, False)),
    ],
)
def test_gemv_fp8_rows_matches_the_dequantized_weight(
    dtype: torch.dtype, m: int, n: int, k: int, config: tuple[int, int, int, int, bool] | tuple[int, int, int]
) -> None:
    """The CUDA-core row GEMV: plain, with a bias, adding into the residual, with the RMSNorm before
    it, and with the norm and SiLU x up around a [gate | up] weight; each launch shape: K in steps or
    in one (then x is loaded once and a program may take several blocks of rows), the first weight
    tile loaded before or after PDL's wait."""
    from minisgl.kernels.triton.gemv import RowGemvConfig, gemv_fp8_rows

    gen = torch.Generator().manual_seed(m * n + k)
    q, s, ref_w = _weight(n, k, None, gen)
    x, bias, g = (
        torch.randn(m, k, generator=gen),
        torch.randn(n, generator=gen),
        torch.rand(k, generator=gen) + 0.5,
    )
    config, tol = RowGemvConfig(*config), TOL[dtype]
    xd, wd = x.to(dtype).double(), ref_w.double()
    xl, bl, gl = x.to(dtype).to(DEV), bias.to(dtype).to(DEV), g.to(dtype).to(DEV)
    ref = xd @ wd.T
    assert _rel(gemv_fp8_rows(xl, q, s, config=config), ref) < tol
    assert _rel(gemv_fp8_rows(xl, q, s, bl, config=config), ref + bias.to(dtype).double()) < tol
    res = torch.randn(m, n, generator=gen).to(dtype)
    out = res.to(DEV, copy=True)
    assert gemv_fp8_rows(xl, q, s, residual=out, config=config) is out  # in place
    assert _rel(out, res.double() + ref) < tol
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * g.to(dtype).double()
    assert _rel(gemv_fp8_rows(xl, q, s, norm=(gl, 1e-6), config=config), normed @ wd.T) < tol
    gate, up = (normed @ wd.T).chunk(2, -1)
    gated = gemv_fp8_rows(xl, q, s, norm=(gl, 1e-6), gated=True, config=config)
    assert gated.shape == (m, n // 2) and _rel(gated, torch.nn.functional.silu(gate) * up) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16] if DEV == "cuda" else [torch.float32])
@pytest.mark.parametrize(
    ("n", "k", "config"),
    [(48, 96, (2, 128, 2, 8, True)), (40, 200, (2, 256, 2, 3, True)), (48, 96, (16, 64, 4))],
)
def test_gemv_rows_of_an_unscaled_16bit_weight(
    dtype: torch.dtype, n: int, k: int, config: tuple[int, int, int, int, bool] | tuple[int, int, int]
) -> None:
    """The row GEMV with scale None (one row of a bf16 projection: qkv with its RMSNorm, o with the
    residual add, `CudaOps.norm_linear` / `linear_add_`): against float64, and the CUDA backend's
    ops take it at one row where `bf16_row_config` gives a shape (in the interpreter: float32)."""
    from minisgl.backends import cuda
    from minisgl.kernels.triton.gemv import RowGemvConfig, gemv_fp8_rows

    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    x, g = torch.randn(1, k, generator=gen).to(dtype), (torch.rand(k, generator=gen) + 0.5).to(dtype)
    xd, wd = x.double(), w.double()
    cfg, tol = RowGemvConfig(*config), TOL[dtype]
    wl, xl, gl = w.to(DEV), x.to(DEV), g.to(DEV)
    assert _rel(gemv_fp8_rows(xl, wl, None, config=cfg), xd @ wd.T) < tol
    res = torch.randn(1, n, generator=gen).to(dtype)
    out = res.to(DEV, copy=True)
    assert gemv_fp8_rows(xl, wl, None, residual=out, config=cfg) is out
    assert _rel(out, res.double() + xd @ wd.T) < tol
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * g.double()
    assert _rel(gemv_fp8_rows(xl, wl, None, norm=(gl, 1e-6), config=cfg), normed @ wd.T) < tol
    ops = cuda.CudaOps()
    row = cuda.bf16_row_config(xl.to(torch.bfloat16), wl.to(torch.bfloat16))
    assert row is not None and cuda.bf16_row_config(xl.repeat(2, 1), wl) is None  # one row only
    if dtype == torch.bfloat16:
        assert torch.equal(
            ops.norm_linear(xl, gl, 1e-6, wl, None),
            gemv_fp8_rows(xl, wl, None, None, None, (gl, 1e-6), config=row),
        )
        added = ops.linear_add_(xl, wl, None, res.to(DEV, copy=True))
        assert torch.equal(added, gemv_fp8_rows(xl, wl, None, None, res.to(DEV, copy=True), config=row))


def test_gemv_fp8_rows_refuses_what_it_cannot_take() -> None:
    from minisgl.kernels.triton.gemv.row import MAX_ROWS, RowGemvConfig, gemv_fp8_rows

    q = torch.zeros(32, 64, dtype=FP8, device=DEV)
    with pytest.raises(ValueError, match="gemv_fp8_rows"):
        gemv_fp8_rows(torch.zeros(MAX_ROWS + 1, 64, device=DEV), q, torch.ones(32, device=DEV))
    with pytest.raises(ValueError, match="scale"):
        gemv_fp8_rows(torch.zeros(1, 64, device=DEV), q, torch.ones(31, device=DEV))
    with pytest.raises(ValueError, match="residual"):
        gemv_fp8_rows(torch.zeros(1, 64, device=DEV), q, torch.ones(32, device=DEV), gated=True,
                      residual=torch.zeros(1, 32, device=DEV)[:, ::2])  # fmt: skip
    for config in (RowGemvConfig(4, 32, 1, 2), RowGemvConfig(4, 32, 1, 1, True)):  # only in one step over K
        with pytest.raises(ValueError, match="one step over K"):
            gemv_fp8_rows(torch.zeros(1, 64, device=DEV), q, torch.ones(32, device=DEV), config=config)


def test_gemv_fp8_refuses_mismatched_scales() -> None:
    from minisgl.kernels.triton.gemv import gemv_fp8

    q = torch.zeros(32, 64, dtype=FP8, device=DEV)
    x = torch.zeros(2, 64, device=DEV)
    with pytest.raises(ValueError, match="scale"):
        gemv_fp8(x, q, torch.ones(31, device=DEV), None)
    with pytest.raises(ValueError, match="block"):
        gemv_fp8(x, q, torch.ones(2, 3, device=DEV), (16, 32))  # wants (32 / 16, 64 / 32)
    with pytest.raises(ValueError, match="block"):
        gemv_fp8(x, q, torch.ones(2, 3, device=DEV), (16, 24))  # columns not a power of two


@pytest.mark.parametrize("group", [None, 32])
def test_quant_rows_matches_the_reference(group: int | None) -> None:
    from minisgl.kernels.triton.fp8 import quant_rows

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 80, generator=gen) * torch.logspace(-3, 2, 6)[:, None]  # rows of any size
    x[2] = 0.0  # an all-zero row keeps a finite scale
    q, s = quant_rows(x.to(DEV), group)
    rq, rs = quantize_rows_fp8(x, group)
    assert s.shape == rs.shape and torch.isfinite(s).all()
    torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
    assert q.dtype == FP8 and torch.equal(q.cpu().float(), rq.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_silu_quantized_in_their_kernel_equal_quant_rows_after_them(dtype: torch.dtype) -> None:
    """`rmsnorm_fp8` and `silu_and_mul_fp8` (the per-token quantization fused into the kernel before
    the fp8 matmul): the same fp8 bits and scales as the kernel then `quant_rows`; an all-zero row too."""
    from minisgl.kernels.triton.elementwise import rmsnorm, rmsnorm_fp8, silu_and_mul, silu_and_mul_fp8
    from minisgl.kernels.triton.fp8 import quant_rows

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(5, 96, generator=gen) * torch.logspace(-2, 2, 5)[:, None]).to(dtype).to(DEV)
    x[3] = 0.0
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype).to(DEV)
    gate_up = (torch.randn(5, 2 * 80, generator=gen) * 3).to(dtype).to(DEV)
    gate_up[1] = 0.0
    for (q, s), (rq, rs) in (
        (rmsnorm_fp8(x, w, 1e-5), quant_rows(rmsnorm(x, w, 1e-5))),
        (silu_and_mul_fp8(gate_up), quant_rows(silu_and_mul(gate_up))),
    ):
        assert q.dtype == FP8 and s.shape == rs.shape == (5, 1) and torch.isfinite(s).all()
        assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [32, 64, 1024])
def test_silu_quantized_over_row_chunks_equals_one_program_a_row(
    dtype: torch.dtype, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`silu_and_mul_fp8` with each row spread over chunks of `SILU_SPLIT_BLOCK` columns (two kernels:
    the chunks' maxima, then the quantization) gives the bits of the one-program-a-row kernel and of
    `quant_rows` after `silu_and_mul`: a last partial chunk, a row whose maximum is in its last chunk,
    an all-zero row."""
    from minisgl.kernels.triton import elementwise as tk
    from minisgl.kernels.triton.fp8 import quant_rows

    monkeypatch.setattr(tk, "SILU_SPLIT_BLOCK", block)
    gen = torch.Generator().manual_seed(block)
    gate_up = (torch.randn(7, 2 * 80, generator=gen) * torch.logspace(-2, 2, 7)[:, None]).to(dtype).to(DEV)
    gate_up[1] = 0.0
    gate_up[4, 79], gate_up[4, 159] = 30.0, 30.0  # the row's largest product in its last column
    rq, rs = quant_rows(tk.silu_and_mul(gate_up))
    for split in (True, False):
        q, s = tk.silu_and_mul_fp8(gate_up, split=split)
        assert q.dtype == FP8 and s.shape == (7, 1) and torch.isfinite(s).all()
        assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())


@pytest.mark.parametrize("rows", [17, 256] if DEV == "cuda" else [17])
def test_fp8_norm_and_silu_quantized_in_their_kernel_change_no_bit(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA ops at more than 16 rows: the RMSNorm and SiLU x up write x in fp8 with its scales for
    the fp8 matmul (`rmsnorm_fp8`, `silu_and_mul_fp8`); a layer's qkv and MLP outputs equal those of
    the separate quantization kernel (MINISGL_FP8_FUSED_QUANT=0) bit for bit. (On a CPU: the kernels
    in the interpreter, torch's CPU `_scaled_mm`.)"""
    import minisgl.backends.cuda as cuda_ops
    from minisgl.backends.fp8 import Fp8Weight

    gen = torch.Generator().manual_seed(rows)
    hidden, inter = 64 if DEV == "cpu" else 256, 96 if DEV == "cpu" else 384
    weights = {}
    for name, (n, k) in {
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "qkv": (80, hidden),
    }.items():
        q, s = quantize_fp8(torch.randn(n, k, generator=gen) * 0.05, None)
        weights[name] = Fp8Weight(q.to(DEV), s.to(DEV), None)
    x = torch.randn(rows, hidden, generator=gen).bfloat16().to(DEV)
    g = (torch.rand(hidden, generator=gen) + 0.5).bfloat16().to(DEV)
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(cuda_ops, "FUSED_QUANT", fused)
        assert cuda_ops.fused_quant(x, weights["qkv"]) is fused
        ops = cuda_ops.CudaOps()
        res = x.clone()
        ops.norm_mlp_add_(res, g, 1e-5, weights["gate_up"], weights["down"], res)
        outs.append((ops.norm_linear(x, g, 1e-5, weights["qkv"], None), res))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("fast", [False, True])
def test_scaled_mm_matches_the_product_of_its_fp8_operands(fast: bool) -> None:
    """The W8A8 matmul (`backends.cuda.scaled_mm`, cuBLASLt on a GPU), with and without fast
    accumulation (the default: `FAST_ACCUM`), against the float64 product of its fp8 operands and
    scales over a long K (down's 14,336 at 8B; 2,048 on a CPU)."""
    from minisgl.backends.cuda import scaled_mm
    from minisgl.backends.fp8 import Fp8Weight
    from minisgl.kernels.triton.fp8 import quant_rows

    gen = torch.Generator().manual_seed(7)
    m, n, k = (64, 256, 14336) if DEV == "cuda" else (8, 32, 2048)
    q, s = quantize_fp8(torch.randn(n, k, generator=gen) * 0.02, None)
    weight = Fp8Weight(q.to(DEV), s.to(DEV), None)
    xq, xs = quant_rows(torch.randn(m, k, generator=gen).bfloat16().to(DEV))
    out = scaled_mm(xq, xs, weight, None, torch.bfloat16, fast)
    ref = (xq.double() * xs.double()) @ (weight.qweight.double() * weight.scale.double()[:, None]).T
    assert out.shape == (m, n) and _rel(out, ref) < 1e-2


def _skinny_case(m: int, n: int, k: int, seed: int):
    """fp8 x (M, K) with per-row scales, an fp8 weight (N, K) per channel, the float64 product."""
    from minisgl.kernels.triton.fp8 import quant_rows

    gen = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8(torch.randn(n, k, generator=gen) * k**-0.5, None)
    xq, xs = quant_rows(torch.randn(m, k, generator=gen).bfloat16().to(DEV))
    ref = (xq.double() * xs.double()) @ (q.double() * s.double()[:, None]).T.to(DEV)
    return xq, xs, q.to(DEV), s.to(DEV), ref


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize(("m", "residual"), [(5, False), (40, True), (70, False)])
def test_skinny_fp8_matmul_matches_the_product_of_its_fp8_operands(
    swap: bool, split: int, m: int, residual: bool
) -> None:
    """The decode-batch fp8 matmul (`fp8_skinny`) in both dot orders, with split-K summed by the last
    program of each tile, rows past the end of x, a bias, and the residual add in place: against the
    float64 product of its fp8 operands; the split counters are left at zero and a second call gives
    the same bits."""
    from minisgl.kernels.triton.counters import zeroed_counters
    from minisgl.kernels.triton.fp8_skinny import SkinnyConfig, skinny_fp8_matmul

    n, k = (96, 256) if DEV == "cpu" else (384, 2048)
    cfg = SkinnyConfig(16 if DEV == "cpu" else 64, 32 if swap or DEV == "cuda" else 16,
                       32 if DEV == "cpu" else 128, split, 4, 3, swap)  # fmt: skip
    xq, xs, q, s, ref = _skinny_case(m, n, k, m + split)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEV)
    out_dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    res = (
        torch.randn(m, n, generator=torch.Generator().manual_seed(2)).to(DEV, out_dtype) if residual else None
    )
    base = None if res is None else res.double().clone()
    out = skinny_fp8_matmul(xq, xs, q, s, None if residual else bias, out_dtype, cfg, res)
    want = ref + (base if residual else bias.double())
    assert out.shape == (m, n) and (out is res if residual else True)
    assert _rel(out, want) < (1e-6 if DEV == "cpu" else 1e-2)
    assert not zeroed_counters(256, xq.device, "skinny").any()
    again = skinny_fp8_matmul(xq, xs, q, s, bias, out_dtype, cfg)
    if not residual:
        assert torch.equal(again, out)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m", [5, 40])
def test_skinny_matmul_of_16bit_operands_matches_the_product(swap: bool, m: int) -> None:
    """`skinny_matmul`: the same kernel unscaled for bf16 x and W (float32 in the interpreter), with
    the residual added in place."""
    from minisgl.kernels.triton.fp8_skinny import SkinnyConfig, skinny_matmul

    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    n, k = (64, 128) if DEV == "cpu" else (256, 1024)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEV, dtype)
    res = torch.randn(m, n, generator=gen).to(DEV, dtype)
    want = res.double() + x.double() @ w.double().T
    cfg = SkinnyConfig(16 if DEV == "cpu" else 64, 32 if swap or DEV == "cuda" else 16, 32 if DEV == "cpu" else 64,
                       1, 4, 3, swap)  # fmt: skip
    assert skinny_matmul(x, w, None, cfg, res) is res
    assert _rel(res, want) < (1e-6 if DEV == "cpu" else 1e-2)
    with pytest.raises(ValueError, match="skinny_matmul"):
        skinny_matmul(x, w.half() if dtype == torch.bfloat16 else w.double(), None, cfg)


def test_skinny_fp8_matmul_refuses_shapes_it_cannot_take() -> None:
    from minisgl.kernels.triton.fp8_skinny import SkinnyConfig, skinny_fp8_matmul

    xq, xs, q, s, _ = _skinny_case(8, 48, 64, 0)
    with pytest.raises(ValueError, match="skinny matmul"):  # 48 rows of W: not whole 32-row tiles
        skinny_fp8_matmul(xq, xs, q, s, None, torch.float32, SkinnyConfig(16, 32, 32, 1))
    with pytest.raises(ValueError, match="skinny matmul"):  # K = 64 in 3 splits of 32 columns
        skinny_fp8_matmul(xq, xs, q, s, None, torch.float32, SkinnyConfig(16, 16, 32, 3))


def test_cuda_ops_take_the_skinny_fp8_matmul_between_the_gemv_and_prefill_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`skinny_config`: more rows than the GEMV's 16 up to SKINNY_MAX_ROWS, shapes it fits, not with
    MINISGL_FP8_SKINNY=0. Through the CUDA ops, o (residual added in place) and down (after SiLU x up)
    equal cuBLASLt's matmul followed by the add (on a CPU: torch's `_scaled_mm`)."""
    import minisgl.backends.cuda as cuda_ops
    from minisgl.backends.fp8 import Fp8Weight

    assert cuda_ops.skinny_config(16, 4096, 4096) is None and cuda_ops.skinny_config(257, 4096, 4096) is None
    for m in (17, 64, 128, 256):  # o and down at every size; qkv to 128 rows, gate/up to 64 (the sweep's)
        for n, k in ((4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096)):
            want = m <= {6144: 128, 28672: 64}.get(n, 256)
            assert (cuda_ops.skinny_config(m, n, k) is not None) is want
    assert cuda_ops.skinny_config(40, 4096 + 16, 4096) is None  # N not whole tiles: cuBLASLt
    gen = torch.Generator().manual_seed(3)
    m, hidden, inter = 40, 256, 256
    weights = {}
    for name, (n, k) in {"o": (hidden, hidden), "down": (hidden, inter)}.items():
        q, s = quantize_fp8(torch.randn(n, k, generator=gen) * k**-0.5, None)
        weights[name] = Fp8Weight(q.to(DEV), s.to(DEV), None)
    x = torch.randn(m, hidden, generator=gen).bfloat16().to(DEV)
    gu = torch.randn(m, 2 * inter, generator=gen).bfloat16().to(DEV)
    res0 = torch.randn(m, hidden, generator=gen).bfloat16().to(DEV)
    outs = []
    for on in (True, False):
        monkeypatch.setattr(cuda_ops, "SKINNY", on)
        assert (cuda_ops.skinny_config(m, hidden, hidden) is not None) is on
        assert (cuda_ops.skinny_config(m, hidden, inter) is not None) is on
        ops = cuda_ops.CudaOps()
        r_o, r_down = res0.clone(), res0.clone()
        assert ops.linear_add_(x, weights["o"], None, r_o) is r_o
        assert ops.linear_add_(gu, weights["down"], None, r_down, gated=True) is r_down
        outs.append((r_o, r_down))
    for new, old in zip(outs[0], outs[1], strict=True):
        assert _rel(new - res0, old - res0) < 2e-2  # each rounded to bf16 once, from float32 sums


@pytest.mark.parametrize(("m", "n", "k"), [(3, 64, 96), (70, 96, 64)])
def test_block_matmul_matches_the_dequantized_operands(m: int, n: int, k: int) -> None:
    from minisgl.kernels.triton.fp8 import block_matmul, quant_rows

    gen = torch.Generator().manual_seed(m + n)
    block = (32, 32)
    q, s, ref_w = _weight(n, k, block, gen)
    x = torch.randn(m, k, generator=gen)
    xq, xs = quant_rows(x.to(DEV), block[1])
    ref_x = xq.cpu().float() * xs.cpu().repeat_interleave(block[1], 1)[:, :k]
    bias = torch.randn(n, generator=gen)
    out = block_matmul(xq, xs, q, s, block, bias.to(DEV), torch.float32)
    # the GPU's fp8 tensor cores keep fewer bits than float32 while summing a block's products
    tol = 1e-3 if DEV == "cuda" else 1e-5
    assert _rel(out, ref_x.double() @ ref_w.double().T + bias.double()) < tol
    # and close to the unquantized product: per-group activation scales lose little
    assert _rel(out, x.double() @ ref_w.double().T + bias.double()) < 0.05


# -- the paged attention kernels over an fp8 KV cache ----------------------------------------------


def _by_page(v: torch.Tensor, ps: int) -> torch.Tensor:
    """A (S, Hkv, D) V cache in the fp8 pool's layout, by page transposed: (S / ps, Hkv, D, ps)."""
    s, hkv, d = v.shape
    return v.view(torch.uint8).view(s // ps, ps, hkv, d).permute(0, 2, 3, 1).contiguous().view(v.dtype)


def _by_slot(vt: torch.Tensor) -> torch.Tensor:
    pages, hkv, d, ps = vt.shape
    return vt.view(torch.uint8).permute(0, 3, 1, 2).reshape(pages * ps, hkv, d).view(vt.dtype)


def _fp8_cache(slots: int, hkv: int, d: int, gen: torch.Generator):
    """A random fp8 cache of K or V with per-head scales: (fp8 (S, Hkv, D), scale (Hkv,), dequantized)."""
    scale = torch.rand(hkv, generator=gen) * 0.05 + 0.01
    values = torch.randn(slots, hkv, d, generator=gen) * (scale * 100)[None, :, None]
    q = (values / scale[None, :, None]).clamp(-448, 448).to(FP8)
    return q, scale, q.float() * scale[None, :, None]


@pytest.mark.parametrize("v_pages", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "ps", "splits"), [(8, 2, 64, 16, 1), (9, 3, 64, 4, 3), (4, 1, 128, 1, 2)]
)
def test_decode_attention_reads_an_fp8_cache(
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    d: int,
    ps: int,
    splits: int,
    v_pages: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-head kernel over an fp8 pool, V read as a (positions, channels) tile or in page rows
    (`fp8_v_pages`, which large batches take; forced here for these few requests)."""
    from minisgl.kernels.triton import attention
    from minisgl.kernels.triton.attention import decode_attention

    monkeypatch.setattr(attention, "fp8_v_pages", lambda bsz, splits: v_pages)
    gen = torch.Generator().manual_seed(hq + d + splits)
    lens = [1, 37, 0, 70]
    max_pages = -(-max(lens) // ps)
    num_pages = len(lens) * max_pages + 2
    kq, ks, kref = _fp8_cache(num_pages * ps, hkv, d, gen)
    vq, vs, vref = _fp8_cache(num_pages * ps, hkv, d, gen)
    pages = _pages(len(lens), max_pages, num_pages, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"), device=DEV)
    decode_attention(
        q.to(DEV), kq.to(DEV), _by_page(vq, ps).to(DEV), pages.to(DEV), torch.tensor(lens, dtype=torch.int32).to(DEV),
        ps, d**-0.5, splits, out=out, scales=(ks.to(DEV), vs.to(DEV)),
    )  # fmt: skip
    for b, n in enumerate(lens):
        if n == 0:
            assert not out[b].any()
            continue
        ref = _dense_attention(q[b : b + 1], kref, vref, pages[b], ps, n, torch.tensor([n - 1]))
        assert _rel(out[b : b + 1], ref) < TOL[dtype], (b, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_stores_the_new_token_in_fp8_and_attends_over_it_as_stored(
    dtype: torch.dtype,
) -> None:
    from minisgl.kernels.triton.attention import decode_attention

    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, ps, splits = 8, 2, 64, 4, 2
    lens = [9, 1, 0, 30]
    max_pages = -(-max(lens) // ps)
    num_pages = len(lens) * max_pages + 1
    kq, ks, _ = _fp8_cache(num_pages * ps, hkv, d, gen)
    vq, vs, _ = _fp8_cache(num_pages * ps, hkv, d, gen)
    pages = _pages(len(lens), max_pages, num_pages, gen)
    slots = [int(pages[b, (n - 1) // ps]) * ps + (n - 1) % ps if n else -1 for b, n in enumerate(lens)]
    k_new = (torch.randn(len(lens), hkv, d, generator=gen) * 2).to(dtype)
    v_new = (torch.randn(len(lens), hkv, d, generator=gen) * 2).to(dtype)
    want_k, want_v = kq.clone(), vq.clone()
    for b, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot] = (k_new[b].float() / ks[:, None]).clamp(-448, 448).to(FP8)
            want_v[slot] = (v_new[b].float() / vs[:, None]).clamp(-448, 448).to(FP8)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    kc, vc = kq.to(DEV), _by_page(vq, ps).to(DEV)
    out = decode_attention(
        q.to(DEV), kc, vc, pages.to(DEV), torch.tensor(lens, dtype=torch.int32).to(DEV), ps, d**-0.5, splits,
        new_kv=(k_new.to(DEV), v_new.to(DEV), torch.tensor(slots, dtype=torch.int32).to(DEV)),
        scales=(ks.to(DEV), vs.to(DEV)),
    )  # fmt: skip
    # the stored bytes: the reference's rounding (ties aside, which random data does not hit)
    assert torch.equal(kc.cpu().float(), want_k.float())
    assert torch.equal(_by_slot(vc.cpu()).float(), want_v.float())
    kref, vref = want_k.float() * ks[None, :, None], want_v.float() * vs[None, :, None]
    for b, n in enumerate(lens):
        if n:
            ref = _dense_attention(q[b : b + 1], kref, vref, pages[b], ps, n, torch.tensor([n - 1]))
            assert _rel(out[b : b + 1], ref) < TOL[dtype], b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "ps", "splits", "launch"),
    [
        (16, 4, 32, 16, 1, (16, 4, 2, 4, 0)),
        (9, 3, 64, 4, 2, (16, 4, 2, 2, 0)),
        (8, 2, 64, 32, 1, (16, 4, 2, 2, 0)),  # pages longer than a block: V read by position
        (
            8,
            2,
            128,
            16,
            1,
            (64, 4, 2, 0, 80),
        ),  # the one-head kernel as a large batch runs it (maxnreg on a GPU)
    ],
)
def test_decode_attention_packed_heads_over_an_fp8_cache(
    dtype: torch.dtype, hq: int, hkv: int, d: int, ps: int, splits: int, launch: tuple[int, ...]
) -> None:
    """`decode.packed` over an fp8 pool (V by page, unequal per-head scales), and the one-head kernel
    with its registers bounded: the new token stored as the reference rounds it, the output equal to
    dense attention over what the pool holds."""
    from minisgl.kernels.triton.attention import decode_attention

    gen = torch.Generator().manual_seed(hq + d)
    lens = [9, 1, 0, 70]
    max_pages = -(-max(lens) // ps)
    num_pages = len(lens) * max_pages + 1
    kq, ks, _ = _fp8_cache(num_pages * ps, hkv, d, gen)
    vq, vs, _ = _fp8_cache(num_pages * ps, hkv, d, gen)
    pages = _pages(len(lens), max_pages, num_pages, gen)
    slots = [int(pages[b, (n - 1) // ps]) * ps + (n - 1) % ps if n else -1 for b, n in enumerate(lens)]
    k_new = (torch.randn(len(lens), hkv, d, generator=gen) * 2).to(dtype)
    v_new = (torch.randn(len(lens), hkv, d, generator=gen) * 2).to(dtype)
    want_k, want_v = kq.clone(), vq.clone()
    for b, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot] = (k_new[b].float() / ks[:, None]).clamp(-448, 448).to(FP8)
            want_v[slot] = (v_new[b].float() / vs[:, None]).clamp(-448, 448).to(FP8)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    kc, vc = kq.to(DEV), _by_page(vq, ps).to(DEV)
    out = decode_attention(
        q.to(DEV), kc, vc, pages.to(DEV), torch.tensor(lens, dtype=torch.int32).to(DEV), ps, d**-0.5, splits,
        new_kv=(k_new.to(DEV), v_new.to(DEV), torch.tensor(slots, dtype=torch.int32).to(DEV)),
        scales=(ks.to(DEV), vs.to(DEV)), launch=launch,
    )  # fmt: skip
    assert torch.equal(kc.cpu().float(), want_k.float())
    assert torch.equal(_by_slot(vc.cpu()).float(), want_v.float())
    assert not out[2].any()
    kref, vref = want_k.float() * ks[None, :, None], want_v.float() * vs[None, :, None]
    for b, n in enumerate(lens):
        if n:
            ref = _dense_attention(q[b : b + 1], kref, vref, pages[b], ps, n, torch.tensor([n - 1]))
            assert _rel(out[b : b + 1], ref) < TOL[dtype], b


def test_packed_heads_default_takes_large_batches_over_an_fp8_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed kernel's choice (`packed_heads`): by default 2 KV heads a program for an fp8 pool at
    one split from 160 requests, else the one-head kernel; with more heads allowed, the most that still
    leave two programs a multiprocessor (8 on a CPU); MINISGL_FP8_ATTN_V2=0: never."""
    from minisgl.kernels.triton.decode import packed, packed_heads, packed_maxnreg

    cpu = torch.device("cpu")
    assert packed_heads(256, 8, 1, True, cpu) == 2 and packed_maxnreg(2) == 128
    assert packed_heads(160, 8, 1, True, cpu) == 2
    assert packed_heads(159, 8, 1, True, cpu) == 0  # fewer requests: the one-head kernel
    assert packed_heads(256, 8, 2, True, cpu) == 0  # splits: the one-head kernel (its early loads)
    assert packed_heads(256, 8, 1, False, cpu) == 0  # a 16-bit pool
    assert packed_heads(256, 1, 1, True, cpu) == 0
    monkeypatch.setattr(packed, "_MAX_HEADS", 4)
    assert packed_heads(256, 8, 1, True, cpu) == 4 and packed_maxnreg(4) == 96
    monkeypatch.setattr(packed, "_MODE", "all")  # any batch and split count
    assert packed_heads(4, 8, 1, True, cpu) == 2  # 4 x 4 programs of 2 heads = 16
    assert packed_heads(2, 8, 1, True, cpu) == 0  # 2 x 2 x 4 heads < 16: one head a program
    monkeypatch.setattr(packed, "_MODE", "0")
    assert packed_heads(256, 8, 1, True, cpu) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d", "ps"), [(8, 2, 64, 16), (4, 1, 128, 1)])
def test_extend_attention_reads_an_fp8_cache(dtype: torch.dtype, hq: int, hkv: int, d: int, ps: int) -> None:
    from minisgl.kernels.triton.attention import extend_attention, store_kv

    gen = torch.Generator().manual_seed(hq + d)
    cached, ext = [0, 20, 3], [5, 7, 40]
    seq = [c + e for c, e in zip(cached, ext, strict=True)]
    max_pages = -(-max(seq) // ps)
    num_pages = len(seq) * max_pages + 2
    kq, ks, _ = _fp8_cache(num_pages * ps, hkv, d, gen)
    vq, vs, _ = _fp8_cache(num_pages * ps, hkv, d, gen)
    pages = _pages(len(seq), max_pages, num_pages, gen)
    # the new tokens' K/V through store_kv (quantized there), the prefix as cached
    new_slots = torch.tensor(
        [int(pages[b, p // ps]) * ps + p % ps for b in range(len(seq)) for p in range(cached[b], seq[b])]
    )
    k_new = torch.randn(sum(ext), hkv, d, generator=gen).to(dtype)
    v_new = torch.randn(sum(ext), hkv, d, generator=gen).to(dtype)
    kc, vc = kq.to(DEV), _by_page(vq, ps).to(DEV)
    scales = (ks.to(DEV), vs.to(DEV))
    store_kv(k_new.to(DEV), v_new.to(DEV), kc, vc, new_slots.int().to(DEV), scales)
    want_k, want_v = kq.clone(), vq.clone()
    want_k[new_slots] = (k_new.float() / ks[None, :, None]).clamp(-448, 448).to(FP8)
    want_v[new_slots] = (v_new.float() / vs[None, :, None]).clamp(-448, 448).to(FP8)
    assert torch.equal(kc.cpu().float(), want_k.float())
    assert torch.equal(_by_slot(vc.cpu()).float(), want_v.float())
    q = torch.randn(sum(ext), hq, d, generator=gen).to(dtype)
    starts = torch.tensor([0, *ext]).cumsum(0).int()
    out = extend_attention(
        q.to(DEV), kc, vc, pages.to(DEV), starts.to(DEV), torch.tensor(seq, dtype=torch.int32).to(DEV),
        max(ext), ps, d**-0.5, scales,
    )  # fmt: skip
    kref, vref = want_k.float() * ks[None, :, None], want_v.float() * vs[None, :, None]
    for b in range(len(seq)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        ref = _dense_attention(q[rows], kref, vref, pages[b], ps, seq[b], torch.arange(cached[b], seq[b]))
        assert _rel(out[rows], ref) < TOL[dtype], b


def test_an_fp8_cache_needs_its_scales() -> None:
    from minisgl.kernels.triton.attention import store_kv

    kc = torch.zeros(8, 2, 16, dtype=FP8, device=DEV)
    k = torch.zeros(1, 2, 16, device=DEV)
    slots = torch.zeros(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="scale"):
        store_kv(k, k, kc, kc.clone(), slots)
    with pytest.raises(ValueError, match="scale"):
        store_kv(k, k, kc, kc.clone(), slots, (torch.ones(3, device=DEV), torch.ones(3, device=DEV)))
