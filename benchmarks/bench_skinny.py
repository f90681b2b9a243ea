"""The skinny (few-row) matmul against cuBLAS on a model's projection shapes: time per call and the
weight bandwidth it reaches, fused variants included (norm before, SiLU x up before, residual after).

    python benchmarks/bench_skinny.py [--rows 1,2,4,8,16]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from minisgl.kernels.triton.elementwise import rmsnorm, silu_and_mul
from minisgl.kernels.triton.skinny import skinny_linear

SHAPES = {  # Llama-3.1-8B projections (N, K), and its LM head
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def _us(fn: object) -> float:
    return do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3


def bench_one(name: str, ws: list[torch.Tensor], m: int) -> str:
    """One shape at m rows: cuBLAS, skinny, and the fused variant against its unfused kernels."""
    n, k = ws[0].shape
    dev, dt = ws[0].device, ws[0].dtype
    x = torch.randn(m, k, device=dev, dtype=dt)
    turn = [0]

    def w() -> torch.Tensor:  # rotate over copies: time DRAM, not the L2
        turn[0] = (turn[0] + 1) % len(ws)
        return ws[turn[0]]

    t_cublas = _us(lambda: F.linear(x, w()))
    t_skinny = _us(lambda: skinny_linear(x, w()))
    fused = ""
    if name in ("qkv", "gate_up"):
        nw = torch.ones(k, device=dev, dtype=dt)
        tf = _us(lambda: skinny_linear(x, w(), norm=(nw, 1e-5)))
        tu = _us(lambda: F.linear(rmsnorm(x, nw, 1e-5), w()))
        fused = f"norm+mm {tf:.1f} vs {tu:.1f}"
    elif name in ("o", "down"):
        res = torch.randn(m, n, device=dev, dtype=dt)
        gated = name == "down"
        xin = torch.randn(m, 2 * k, device=dev, dtype=dt) if gated else x
        tf = _us(lambda: skinny_linear(xin, w(), gated=gated, residual=res))
        tu = _us(lambda: res.addmm_(silu_and_mul(xin) if gated else xin, w().t()))
        fused = f"mm+add {tf:.1f} vs {tu:.1f}"
    gb = n * k * dt.itemsize / 1e9
    return (
        f"{name:8} {m:4d} {t_cublas:10.1f} {gb / t_cublas * 1e6:6.0f} {t_skinny:10.1f} "
        f"{gb / t_skinny * 1e6:6.0f} {fused:>22}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ns = ap.parse_args()
    print(
        f"{'shape':8} {'rows':>4} {'cuBLAS us':>10} {'GB/s':>6} {'skinny us':>10} {'GB/s':>6} {'fused (vs unfused) us':>22}"
    )
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(3)]
        for m in (int(r) for r in ns.rows.split(",")):
            print(bench_one(name, ws, m))


if __name__ == "__main__":
    main()
