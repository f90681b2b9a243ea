"""Decode-step projections on the GPU, each replayed from a CUDA graph as a decode step runs it: the
ways of calling cuBLAS for one projection (with the residual add in the epilogue, plain, through
cuBLASLt) and the kernels each launches, for a model's shapes at a few row counts.

    python benchmarks/bench_linear.py [--rows 1,8] [--model-config llama3-8b]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench_cudagraph

from minisgl.benchmark.presets import preset_config


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the preset's projections: fused qkv, o, fused gate/up, down."""
    c = preset_config(preset)
    h, d = c["hidden_size"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    i = c["intermediate_size"]
    return {"qkv": (qkv, h), "o": (h, c["num_attention_heads"] * d), "gate_up": (2 * i, h), "down": (h, i)}


def kernels(fn: Callable[[], object]) -> str:
    """The GPU kernels one call launches (short names)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return " + ".join(n.split("(")[0][:40] for n in names)


def variants(w: torch.Tensor, m: int) -> dict[str, Callable[[], object]]:
    n, k = w.shape
    x = torch.randn(m, k, device=w.device, dtype=w.dtype)
    res = torch.randn(m, n, device=w.device, dtype=w.dtype)
    out = torch.empty(m, n, device=w.device, dtype=w.dtype)
    wt = w.t()
    return {
        "addmm_ (beta 1)": lambda: res.addmm_(x, wt),
        "linear": lambda: F.linear(x, w),
        "mm out=": lambda: torch.mm(x, wt, out=out),
        "mm + add_": lambda: res.add_(torch.mm(x, wt)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--model-config", default="llama3-8b")
    ns = ap.parse_args()
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        print(f"== {ns.model_config}, preferred BLAS {lib}")
        for name, (n, k) in shapes(ns.model_config).items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            gb = n * k * w.dtype.itemsize / 1e9
            for m in (int(r) for r in ns.rows.split(",")):
                for label, fn in variants(w, m).items():
                    us = do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
                    print(
                        f"{name:8} rows {m:3d} {label:16} {us:8.1f} us {gb / us * 1e6:6.0f} GB/s  {kernels(fn)}"
                    )


if __name__ == "__main__":
    main()
