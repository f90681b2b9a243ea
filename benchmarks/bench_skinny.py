"""The skinny (few-row) matmul against cuBLAS on a model's projection shapes, each call replayed from
a CUDA graph as a decode step runs it: time per call and the weight bandwidth reached, and each fused
variant (norm before, SiLU x up before, residual after) against the unfused kernels it replaces.

    python benchmarks/bench_skinny.py [--rows 1,8] [--model-config llama3-8b]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from minisgl.benchmark.presets import preset_config
from minisgl.kernels.triton.elementwise import rmsnorm, silu_and_mul
from minisgl.kernels.triton.skinny import skinny_linear


def _us(fn: Callable[[], object]) -> float:
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the preset's projections: fused qkv, o, fused gate/up, down."""
    c = preset_config(preset)
    h, d = c["hidden_size"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    i = c["intermediate_size"]
    return {"qkv": (qkv, h), "o": (h, c["num_attention_heads"] * d), "gate_up": (2 * i, h), "down": (h, i)}


def bench_one(name: str, w: torch.Tensor, m: int) -> str:
    """One shape at m rows: cuBLAS, skinny, and the fused variant against the kernels it replaces."""
    n, k = w.shape
    x = torch.randn(m, k, device=w.device, dtype=w.dtype)
    t_cublas = _us(lambda: F.linear(x, w))
    t_skinny = _us(lambda: skinny_linear(x, w))
    if name in ("qkv", "gate_up"):
        nw = torch.ones(k, device=w.device, dtype=w.dtype)
        tf = _us(lambda: skinny_linear(x, w, norm=(nw, 1e-5)))
        tu = _us(lambda: F.linear(rmsnorm(x, nw, 1e-5), w))
        fused = f"norm+mm {tf:.1f} vs {tu:.1f}"
    else:
        res = torch.randn(m, n, device=w.device, dtype=w.dtype)
        gated = name == "down"
        xin = torch.randn(m, 2 * k, device=w.device, dtype=w.dtype) if gated else x
        tf = _us(lambda: skinny_linear(xin, w, gated=gated, residual=res))
        tu = _us(lambda: res.addmm_(silu_and_mul(xin) if gated else xin, w.t()))
        fused = f"mm+add {tf:.1f} vs {tu:.1f}"
    gb = n * k * w.dtype.itemsize / 1e9
    return (
        f"{name:8} {m:4d} {t_cublas:10.1f} {gb / t_cublas * 1e6:6.0f} {t_skinny:10.1f} "
        f"{gb / t_skinny * 1e6:6.0f}   {fused}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--model-config", default="llama3-8b")
    ns = ap.parse_args()
    print(
        f"{ns.model_config}: {'shape':8} {'rows':>4} {'cuBLAS us':>10} {'GB/s':>6} {'skinny us':>10} {'GB/s':>6}"
    )
    for name, (n, k) in shapes(ns.model_config).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        for m in (int(r) for r in ns.rows.split(",")):
            print(bench_one(name, w, m), flush=True)


if __name__ == "__main__":
    main()
