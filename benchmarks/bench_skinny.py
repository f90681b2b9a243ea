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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ns = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    print(
        f"{'shape':8} {'rows':>4} {'cuBLAS us':>10} {'GB/s':>6} {'skinny us':>10} {'GB/s':>6} {'fused':>22}"
    )
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(3)]  # rotate: beat the L2
        for m in (int(r) for r in ns.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            gb = n * k * 2 / 1e9
            i = [0]

            def w() -> torch.Tensor:
                i[0] = (i[0] + 1) % 3
                return ws[i[0]]

            t_cublas = do_bench(lambda: F.linear(x, w()), warmup=20, rep=100, return_mode="median") * 1e3
            t_skinny = do_bench(lambda: skinny_linear(x, w()), warmup=20, rep=100, return_mode="median") * 1e3
            fused = ""
            if name in ("qkv", "gate_up"):
                nw = torch.ones(k, device=dev, dtype=dt)
                tf = (
                    do_bench(lambda: skinny_linear(x, w(), norm=(nw, 1e-5)), rep=100, return_mode="median")
                    * 1e3
                )
                tu = (
                    do_bench(lambda: F.linear(rmsnorm(x, nw, 1e-5), w()), rep=100, return_mode="median") * 1e3
                )
                fused = f"norm+mm {tf:.1f} vs {tu:.1f}"
            elif name in ("o", "down"):
                res = torch.randn(m, n, device=dev, dtype=dt)
                gated = name == "down"
                xin = torch.randn(m, 2 * k, device=dev, dtype=dt) if gated else x
                tf = (
                    do_bench(
                        lambda: skinny_linear(xin, w(), gated=gated, residual=res),
                        rep=100,
                        return_mode="median",
                    )
                    * 1e3
                )

                def unfused() -> None:
                    res.addmm_(silu_and_mul(xin) if gated else xin, w().t())

                tu = do_bench(unfused, rep=100, return_mode="median") * 1e3
                fused = f"mm+add {tf:.1f} vs {tu:.1f}"
            print(
                f"{name:8} {m:4d} {t_cublas:10.1f} {gb / t_cublas * 1e6:6.0f} {t_skinny:10.1f} "
                f"{gb / t_skinny * 1e6:6.0f} {fused:>22}"
            )


if __name__ == "__main__":
    main()
