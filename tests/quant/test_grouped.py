"""Grouped rows (cpu_quant.c, "grouped rows"): the AVX-512 builds repack Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and
Q4_K/Q5_K/Q6_K weights of whole groups of 16 rows so that one int32 lane keeps one output row. The
layout holds the file's numbers (every path that reads a row reads the same ones, bitwise), the decode
kernel matches numpy with activations quantized per 16 and is batch-invariant (prefill passes take it
too, except in the AMX build and with MINISGL_CPU_PREFILL=bf16)."""

from __future__ import annotations

import pytest
import torch
from test_quant import RUNNABLE_ISAS, q8_activations, random_blocks

from minisgl.kernels.quant import dequant_rows, qlinear, quant_available, repack
from minisgl.quant import GGMLType, QuantizedWeight, QuantPart, dequantize

PACKABLE = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0]
GROUP_ISAS = [isa for isa in RUNNABLE_ISAS if isa in ("amx", "avx512bf16", "avx512")]
# (formats of the weight's parts, K): whole blocks of 32, an odd count leaving a last block alone in
# its pair (32, 96, 608); the K-quants' super-blocks of 256, alone and beside the other formats'
Q4_1, Q4_K, Q5_K, Q6_K = GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K
CASES = [((*PACKABLE, Q4_1), k) for k in (32, 64, 96, 576, 608)]
CASES += [((Q4_K,) * 4, k) for k in (256, 768)] + [((Q4_K, *PACKABLE), 512)]
CASES += [((Q6_K,) * 4, k) for k in (256, 768)] + [((Q6_K, Q4_K, GGMLType.Q8_0, Q4_1), 512)]
CASES += [((Q5_K,) * 4, k) for k in (256, 768)] + [((Q5_K, Q6_K, Q4_K, Q4_1), 512)]
Q5_0, Q5_1 = GGMLType.Q5_0, GGMLType.Q5_1
CASES += [((Q5_0, Q5_1, Q5_0, Q5_1), k) for k in (32, 96, 576)] + [((Q5_0, Q4_1, Q5_1, GGMLType.Q8_0), 64)]
CASE_IDS = [f"{'-'.join(sorted({f.name for f in fmts}))}-K{k}" for fmts, k in CASES]
# builds whose prefill passes over groups run the decode kernel (cpu_quant.c, GROUP_PREFILL), and those
# with bf16 products for them (MINISGL_CPU_PREFILL=bf16, the bf16_prefill argument)
PREFILL_BY_DECODE_KERNEL = {"avx512", "avx512bf16"}
BF16_BUILDS = {"amx", "avx512bf16"}

pytestmark = [
    pytest.mark.skipif(not quant_available("portable"), reason="no C compiler for the kernels"),
    pytest.mark.skipif(not GROUP_ISAS, reason="no AVX-512 build here: nothing is grouped"),
]


def grouped_weight(
    k: int, seed: int = 0, fmts: tuple[GGMLType, ...] = (*PACKABLE, Q4_1)
) -> tuple[QuantizedWeight, QuantizedWeight, torch.Tensor]:
    """(the file's rows, the same rows grouped, their dequantized rows): parts of 16, 32, 16, 16 rows
    in `fmts`, the second taken in a permuted row order, so that the groups' formats change along the
    weight."""
    parts, refs = [], []
    for i, (fmt, rows) in enumerate(zip(fmts, (16, 32, 16, 16), strict=True)):
        data = torch.from_numpy(random_blocks(fmt, rows, k, seed=seed + i))
        order = torch.arange(rows).flip(0) if i == 1 else None
        parts.append(QuantPart(fmt, data, k, order))
        ref = dequantize(fmt, data, k)
        refs.append(ref if order is None else ref[order])
    plain, grouped = QuantizedWeight(parts), QuantizedWeight(parts)
    assert repack(grouped, GROUP_ISAS[0]) and (grouped.row_fmts >= 200).all()
    return plain, grouped, torch.cat(refs)


@pytest.mark.parametrize("fmts,k", CASES, ids=CASE_IDS)
def test_grouped_rows_read_back_as_the_files(fmts: tuple[GGMLType, ...], k: int) -> None:
    """Every build's embedding lookup reads grouped rows as the file's (bitwise). Prefill passes are
    the decode kernel's (matched to numpy below) where the build takes it for them, and give the
    file's rows' results bitwise everywhere else: the bf16 products (MINISGL_CPU_PREFILL=bf16, the
    Q4_0/Q4_1/Q8_0 groups decoded straight into their panel), AMX tiles, the builds without groups."""
    plain, grouped, ref = grouped_weight(k, seed=k, fmts=fmts)
    ids = torch.arange(ref.shape[0]).flip(0)
    x = torch.randn(13, k)
    for isa in RUNNABLE_ISAS:
        torch.testing.assert_close(dequant_rows(grouped, ids, isa=isa), ref[ids], rtol=0, atol=0)
        for bf16 in (False, True):
            got = qlinear(x, grouped, prefill=True, bf16_prefill=bf16, isa=isa)
            if isa in PREFILL_BY_DECODE_KERNEL and not (bf16 and isa in BF16_BUILDS):
                same = qlinear(x, grouped, isa=isa)
            else:
                same = qlinear(x, plain, prefill=True, bf16_prefill=bf16, isa=isa)
            torch.testing.assert_close(got, same, rtol=0, atol=0)


@pytest.mark.parametrize("isa", GROUP_ISAS)
@pytest.mark.parametrize("fmts,k", CASES, ids=CASE_IDS)
def test_grouped_decode_matches_numpy(isa: str, fmts: tuple[GGMLType, ...], k: int) -> None:
    """Decode passes over grouped rows against float64 with the activations quantized per 16 as the
    kernel does: every tile height (M of 1 to 16, and past 16: 17, 33) and 16-value groups of very
    different scales."""
    _, grouped, ref = grouped_weight(k, seed=k, fmts=fmts)
    torch.manual_seed(k + 1)
    bias = torch.randn(ref.shape[0])
    for m in (1, 2, 3, 4, 7, 8, 15, 16, 17, 33):
        x = torch.randn(m, k) * torch.logspace(-2, 1, k)
        want = (q8_activations(x) @ ref.double().T + bias.double()).float()
        got = qlinear(x, grouped, bias, isa=isa)
        torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("isa", GROUP_ISAS)
def test_grouped_rows_are_batch_invariant(isa: str) -> None:
    """A row's result never depends on its batch mates: any subset of the rows (other tile heights,
    other places in the 16-row tiles) gives the same bits, the residual added in place and the fused
    RMSNorm included."""
    _, w, _ = grouped_weight(768, fmts=(Q4_K, Q6_K, Q5_K, GGMLType.Q8_0))
    x = torch.randn(37, 768)
    full = qlinear(x, w, isa=isa)
    for rows in ([3], [0, 1], [4, 5, 6], list(range(16)), list(range(17)), list(range(36, -1, -1))):
        torch.testing.assert_close(qlinear(x[rows].contiguous(), w, isa=isa), full[rows], rtol=0, atol=0)
    res = torch.randn(37, w.shape[0])
    added = qlinear(x, w, residual=res.clone(), isa=isa)
    torch.testing.assert_close(added, res + full, rtol=0, atol=0)
    nw = torch.rand(768) + 0.5
    fused = qlinear(x, w, norm=(nw, 1e-5), isa=isa)
    torch.testing.assert_close(
        qlinear(x[[20]].contiguous(), w, norm=(nw, 1e-5), isa=isa), fused[[20]], rtol=0, atol=0
    )


@pytest.mark.parametrize("isa", sorted(PREFILL_BY_DECODE_KERNEL & set(GROUP_ISAS)))
def test_long_prefill_passes_over_groups_change_nothing(isa: str) -> None:
    """A prefill pass of more activation rows than the kernel takes at once (256) gives every row what a
    pass of that row alone gives (bitwise)."""
    _, w, _ = grouped_weight(96, seed=3)
    x = torch.randn(300, 96)
    full = qlinear(x, w, prefill=True, isa=isa)
    for row in (0, 255, 256, 299):
        torch.testing.assert_close(full[[row]], qlinear(x[[row]].contiguous(), w, isa=isa), rtol=0, atol=0)


def test_only_whole_groups_of_one_format_are_grouped() -> None:
    """A weight whose rows are not whole groups of 16, or whose group mixes formats, keeps the repacked
    rows' layout (and its kernel)."""
    for rows in ((16, 8), (8, 16)):  # 24 rows; then a first group of two formats
        parts = [
            QuantPart(fmt, torch.from_numpy(random_blocks(fmt, n, 64, seed=n)), 64)
            for fmt, n in zip((GGMLType.Q4_1, GGMLType.Q8_0), rows, strict=True)
        ]
        w = QuantizedWeight(parts)
        assert repack(w, GROUP_ISAS[0])
        assert ((w.row_fmts >= 100) & (w.row_fmts < 200)).all()


@pytest.mark.parametrize("fmt", [Q4_K, Q5_K, Q6_K], ids=lambda f: f.name)
def test_k_quant_rows_group_only_whole(fmt: GGMLType) -> None:
    """K-quant rows have no row-by-row layout: whole groups of 16 are grouped, anything else keeps
    the file's row table (the generic tiles read it)."""
    data = torch.from_numpy(random_blocks(fmt, 24, 256, seed=5))
    w = QuantizedWeight([QuantPart(fmt, data, 256)])
    ptrs = w.row_ptrs.clone()
    assert not repack(w, GROUP_ISAS[0])
    assert w.packed is None and torch.equal(w.row_ptrs, ptrs)
    whole = QuantizedWeight([QuantPart(fmt, data[:16], 256)])
    assert repack(whole, GROUP_ISAS[0]) and (whole.row_fmts == 200 + int(fmt)).all()


def test_prefill_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """MINISGL_CPU_PREFILL picks int8 (the default) or bf16 prefill products; anything else is refused
    by name when the CPU backend starts."""
    from minisgl.backends.cpu import CpuOps
    from minisgl.kernels.quant import prefill_mode

    try:
        for value, want in ((None, "int8"), ("int8", "int8"), ("bf16", "bf16")):
            if value is None:
                monkeypatch.delenv("MINISGL_CPU_PREFILL", raising=False)
            else:
                monkeypatch.setenv("MINISGL_CPU_PREFILL", value)
            prefill_mode.cache_clear()
            assert prefill_mode() == want
        monkeypatch.setenv("MINISGL_CPU_PREFILL", "fp8")
        prefill_mode.cache_clear()
        with pytest.raises(ValueError, match="MINISGL_CPU_PREFILL='fp8': choose from int8, bf16"):
            CpuOps()
    finally:
        monkeypatch.delenv("MINISGL_CPU_PREFILL", raising=False)
        prefill_mode.cache_clear()
