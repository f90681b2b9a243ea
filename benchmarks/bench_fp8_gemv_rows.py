"""The fp8 projections of a batch-1..4 decode step (Llama-3.1-8B shapes by default), per layer, each
replayed from a CUDA graph over weight copies that stream past the L2: the tensor-core fp8 GEMV with
its RMSNorm / SiLU x up kernels (`tc`) against the CUDA-core row GEMV with those fused (`rows`, every
launch shape of SWEEP). Per projection: qkv (norm + GEMV), o (+ residual), gate/up (norm + GEMV +
SiLU x up; the row GEMV writes silu(gate) * up), down (+ residual; its input already gated).

    python benchmarks/bench_fp8_gemv_rows.py [--rows 1] [--model-config llama3-8b] [--top 4]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
from bench_linear import L2_DEFEAT_BYTES, shapes
from triton.testing import do_bench_cudagraph

from minisgl.backends.cuda import fp8_gemv_config, fp8_row_config
from minisgl.backends.fp8 import Fp8Weight, quantize_fp8
from minisgl.kernels.triton import elementwise as tk
from minisgl.kernels.triton.gemv import gemv_fp8
from minisgl.kernels.triton.gemv_row import RowGemvConfig, gemv_fp8_rows

SWEEP = [
    RowGemvConfig(bn, bk, warps)
    for bn, bk, warps in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8))
    if bn * bk <= 16384 and bk >= 256 * warps  # a warp's 32 threads x 8 columns each span the step
]
EPS = 1e-5
Call = Callable[[Fp8Weight], torch.Tensor]


def timed(fn: Call, ws: list[Fp8Weight]) -> float:
    """Median microseconds of one call, over the weight copies (from HBM, not L2)."""

    def each() -> None:
        for w in ws:
            fn(w)

    return do_bench_cudagraph(each, rep=25, return_mode="median") * 1e3 / len(ws)


def tc_call(name: str, x: torch.Tensor, g: torch.Tensor, res: torch.Tensor) -> Call:
    """The tensor-core GEMV path of the tree before the row GEMV, as the layer calls it."""
    x16 = x.to(torch.float16)  # down's input, as SiLU x up wrote it

    def call(w: Fp8Weight) -> torch.Tensor:
        cfg = fp8_gemv_config(x, w)
        if name in ("qkv", "gate_up"):
            h = tk.rmsnorm(x, g, EPS, out_dtype=torch.float16)
            y = gemv_fp8(h, w.qweight, w.scale, None, None, None, cfg, out_dtype=x.dtype)
            return tk.silu_and_mul(y, out_dtype=torch.float16) if name == "gate_up" else y
        h = x16 if name == "down" else x
        return gemv_fp8(h, w.qweight, w.scale, None, None, res, cfg)

    return call


def row_call(name: str, x: torch.Tensor, g: torch.Tensor, res: torch.Tensor, cfg: RowGemvConfig) -> Call:
    norm = (g, EPS) if name in ("qkv", "gate_up") else None
    out = None if norm else res
    return lambda w: gemv_fp8_rows(x, w.qweight, w.scale, None, out, norm, name == "gate_up", cfg)


def reference(name: str, x: torch.Tensor, g: torch.Tensor, res: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    xd, wd = x.double(), w.dequantize().double()
    if name in ("qkv", "gate_up"):
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * g.double()
        y = xd @ wd.T
        if name == "gate_up":
            gate, up = y.chunk(2, -1)
            y = torch.nn.functional.silu(gate) * up
        return y
    return res.double() + xd @ wd.T


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def bench(name: str, n: int, k: int, rows: list[int], top: int) -> dict[int, tuple[float, float]]:
    copies = min(32, -(-L2_DEFEAT_BYTES // (n * k)))
    ws = [
        Fp8Weight(*quantize_fp8(torch.randn(n, k, device="cuda") * k**-0.5, None), None)
        for _ in range(copies)
    ]
    out: dict[int, tuple[float, float]] = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        n_out = n // 2 if name == "gate_up" else n
        res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16)
        t_tc = timed(tc_call(name, x, g, res), ws)
        res_list = sorted((timed(row_call(name, x, g, res, c), ws), c) for c in SWEEP)
        chosen = fp8_row_config(x, ws[0], gated=name == "gate_up")
        t_ch = timed(row_call(name, x, g, res, chosen), ws) if chosen else float("nan")
        r0 = res.clone()
        err = rel(
            row_call(name, x, g, r0, chosen or res_list[0][1])(ws[0]), reference(name, x, g, res, ws[0])
        )
        gbs = lambda t: n * k / t / 1e3  # noqa: E731
        best = res_list[0][0]
        print(
            f"{name:8} rows {m}: tc {t_tc:6.1f} us ({gbs(t_tc):5.0f} GB/s) | rows chosen {chosen} {t_ch:6.1f} us"
            f" ({gbs(t_ch):5.0f} GB/s) best {best:6.1f} us ({gbs(best):5.0f} GB/s) | err {err:.2e}"
        )  # fmt: skip
        print(
            "    " + "  ".join(f"({c.block_n},{c.block_k},{c.num_warps}):{t:.1f}" for t, c in res_list[:top])
        )
        out[m] = (t_tc, t_ch)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1")
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--top", type=int, default=5)
    ns = ap.parse_args()
    rows = [int(r) for r in ns.rows.split(",")]
    total: dict[int, list[float]] = {m: [0.0, 0.0] for m in rows}
    for name, (n, k) in shapes(ns.model_config).items():
        if name == "lm_head":
            continue
        for m, (t_tc, t_ch) in bench(name, n, k, rows, ns.top).items():
            total[m][0] += t_tc
            total[m][1] += t_ch
    for m, (t_tc, t_ch) in total.items():
        print(f"a layer's fp8 projections, rows {m}: tc {t_tc:.1f} us, rows (chosen) {t_ch:.1f} us")


if __name__ == "__main__":
    main()
