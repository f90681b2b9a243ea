"""The per-token activation quantization before an fp8 matmul (8B shapes), fused into the RMSNorm /
SiLU x up kernel (`rmsnorm_fp8`, `silu_and_mul_fp8`) against the kernel then `fp8.quant_rows`, alone
and followed by the cuBLASLt fp8 matmul (`backends.cuda.scaled_mm`), by row count (decode batches and
prefill chunks). Eager launches, `triton.testing.do_bench` medians. `--accum`: instead, each 8B
projection's fp8 matmul under a CUDA graph with and without cuBLASLt's fast accumulation
(`_scaled_mm`'s use_fast_accum), and each one's error against the float64 product of its fp8 operands.

`--silu`: `silu_and_mul_fp8` one program a row against a row over chunks, under a CUDA graph.

    python benchmarks/bench_fused_quant.py [--rows 64,128,256,512,1024,4096] [--accum | --silu]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
from triton.testing import do_bench, do_bench_cudagraph

from minisgl.backends.cuda import scaled_mm
from minisgl.backends.fp8 import Fp8Weight
from minisgl.kernels.triton import elementwise as tk
from minisgl.kernels.triton.fp8 import quant_rows


def _weight(n: int, k: int) -> Fp8Weight:
    q = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8Weight(q, torch.full((n,), 1e-3, device="cuda"), None)


def _cases(t: int, h: int, i: int, qkv: Fp8Weight, down: Fp8Weight) -> dict[str, Callable[[], object]]:
    """Each launch sequence at t rows (the norm's and SiLU x up's inputs random)."""
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(t, 2 * i, device="cuda", dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    return {
        "norm fused": lambda: tk.rmsnorm_fp8(x, g, 1e-5),
        "norm + quant": lambda: quant_rows(tk.rmsnorm(x, g, 1e-5)),
        "norm fused + qkv mm": lambda: scaled_mm(*tk.rmsnorm_fp8(x, g, 1e-5), qkv, None, bf16),
        "norm + quant + qkv mm": lambda: scaled_mm(*quant_rows(tk.rmsnorm(x, g, 1e-5)), qkv, None, bf16),
        "silu fused": lambda: tk.silu_and_mul_fp8(gu),
        "silu + quant": lambda: quant_rows(tk.silu_and_mul(gu)),
        "silu fused + down mm": lambda: scaled_mm(*tk.silu_and_mul_fp8(gu), down, None, bf16),
        "silu + quant + down mm": lambda: scaled_mm(*quant_rows(tk.silu_and_mul(gu)), down, None, bf16),
    }


def accum(rows: list[int], h: int, i: int) -> None:
    """`--accum`: us a call and relative error (Frobenius, against float64) with and without fast accumulation."""
    shapes = {"qkv": (6144, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
    for name, (n, k) in shapes.items():
        w = _weight(n, k)
        for t in rows:
            xq, xs = quant_rows(torch.randn(t, k, device="cuda", dtype=torch.bfloat16))
            ref = (xq.double() * xs.double()) @ (w.qweight.double() * w.scale.double()[:, None]).T
            cells = []
            for fast in (False, True):
                out = scaled_mm(xq, xs, w, None, torch.bfloat16, fast)
                err = float((out.double() - ref).norm() / ref.norm())
                us = (
                    do_bench_cudagraph(
                        functools.partial(scaled_mm, xq, xs, w, None, torch.bfloat16, fast), rep=30
                    )
                    * 1e3
                )
                cells.append(f"{'fast' if fast else 'promoted'} {us:6.1f} us (err {err:.2e})")
            print(f"{name} {n}x{k}, {t} rows: {', '.join(cells)}", flush=True)


def _silu_us(gus: list[torch.Tensor], split: bool) -> float:
    """us a call of `silu_and_mul_fp8` under a CUDA graph over the inputs `gus` in turn, after
    checking its bits against the one-program-a-row kernel's at 16 warps."""
    fn = tk.silu_and_mul_fp8
    warps, tk.SILU_ROW_WARPS = tk.SILU_ROW_WARPS, 16
    ref = fn(gus[0], split=False)
    tk.SILU_ROW_WARPS = warps
    got = fn(gus[0], split=split)
    assert torch.equal(got[0].float(), ref[0].float()) and torch.equal(got[1], ref[1])
    return do_bench_cudagraph(lambda: [fn(g, split=split) for g in gus], rep=30) * 1e3 / len(gus)


def silu(rows: list[int], i: int) -> None:
    """`--silu`: `silu_and_mul_fp8` under a CUDA graph: one program a row (by warps) and a row over
    chunks (two kernels) of each SILU_SPLIT_BLOCK; 8 copies of the input from 1,024 rows (out of L2,
    as a prefill's matmul output mostly is), one below (in L2, as a decode batch's fresh output)."""
    for t in rows:
        gus = [
            torch.randn(t, 2 * i, device="cuda", dtype=torch.bfloat16) for _ in range(8 if t >= 1024 else 1)
        ]
        cells = []
        for warps in (8, 16, 32):
            tk.SILU_ROW_WARPS = warps
            cells.append(f"row/{warps} {_silu_us(gus, False):6.2f}")
        tk.SILU_ROW_WARPS = 0
        for block in (1024, 2048, 4096):
            tk.SILU_SPLIT_BLOCK = block
            cells.append(f"split {block} {_silu_us(gus, True):6.2f}")
        print(f"silu_and_mul_fp8 {t} rows (us): {', '.join(cells)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,128,256,512,1024,4096")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--accum", action="store_true", help="the fp8 matmuls with and without fast accumulation")
    ap.add_argument("--silu", action="store_true", help="SiLU x up quantized: a row a program or over chunks")
    ns = ap.parse_args()
    h, i = ns.hidden, ns.inter
    if ns.silu:
        return silu([int(r) for r in ns.rows.split(",")], i)
    if ns.accum:
        return accum([int(r) for r in ns.rows.split(",")], h, i)
    qkv, down = _weight(6144, h), _weight(h, i)
    for t in (int(r) for r in ns.rows.split(",")):
        cases = _cases(t, h, i, qkv, down)
        line = ", ".join(f"{name} {do_bench(fn, rep=40) * 1e3:.1f}" for name, fn in cases.items())
        print(f"rows {t}: {line} us", flush=True)


if __name__ == "__main__":
    main()
