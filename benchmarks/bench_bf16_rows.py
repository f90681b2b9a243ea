"""One bf16 row (batch-1 decode) of qkv with its RMSNorm and of o with the residual add, as a layer calls
them: the path before (the RMSNorm kernel then cuBLAS for qkv; the tensor-core GEMV or cuBLAS with the
residual add for o) against the CUDA-core row GEMV with the norm / the add fused (`gemv_fp8_rows` with
scale None, `CudaOps.norm_linear` / `linear_add_` at one row), each launch shape of a short sweep.
Each call runs on the next of the weight copies (past the L2), replayed from a CUDA graph; error
against float64 printed beside.

    python benchmarks/bench_bf16_rows.py [--model-config qwen3-30b-a3b,llama3-8b]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import triton
from bench_linear import L2_DEFEAT_BYTES, shapes
from triton.testing import do_bench_cudagraph

from minisgl.backends.cuda import CudaOps, bf16_row_config
from minisgl.kernels.triton.gemv import RowGemvConfig, gemv_fp8_rows

EPS = 1e-6


def sweep(k: int) -> list[RowGemvConfig]:
    kp = triton.next_power_of_2(k)
    return [
        RowGemvConfig(bn, kp, w, it, True)
        for bn, w, it in ((2, 8, 8), (2, 8, 4), (1, 8, 8), (2, 4, 4), (4, 8, 4))
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="qwen3-30b-a3b")
    ns = ap.parse_args()
    for preset in ns.model_config.split(","):
        for name in ("qkv", "o"):
            projection(preset, name)


def projection(preset: str, name: str, dev: str = "cuda") -> None:
    """Time one projection's ways (qkv with its norm, o with the residual add) and print them."""
    dt = torch.bfloat16
    n, k = shapes(preset)[name]
    copies = max(2, L2_DEFEAT_BYTES // (n * k * 2))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=dt)
    g = 1.0 + 0.1 * torch.randn(k, device=dev, dtype=dt)
    res = torch.randn(1, n, device=dev, dtype=dt)
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * g.double() if name == "qkv" else xd
    want = xn @ ws[0].double().T + (0 if name == "qkv" else res.double())
    ops = CudaOps()
    norm = (g, EPS) if name == "qkv" else None

    def before(w: torch.Tensor) -> torch.Tensor:
        os.environ["MINISGL_BF16_ROW"] = "0"
        try:
            return ops.norm_linear(x, g, EPS, w, None) if norm else ops.linear_add_(x, w, None, res)
        finally:
            os.environ.pop("MINISGL_BF16_ROW")

    def rows(cfg: RowGemvConfig) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda w: gemv_fp8_rows(x, w, None, None, None if norm else res, norm, config=cfg)

    runs: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"before (norm kernel + cuBLAS / GEMV)": before}
    chosen = bf16_row_config(x, ws[0])
    for cfg in [chosen, *sweep(k)] if chosen else sweep(k):
        shape = (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.iters, cfg.prefetch)
        runs[f"rows {shape}{' <- chosen' if cfg is chosen else ''}"] = rows(cfg)
    print(f"--- {preset} {name}: N {n}, K {k}, {n * k * 2 / 1e6:.1f} MB, {copies} copies")
    base = res.clone()
    for label, fn in runs.items():
        res.copy_(base)
        err = float((fn(ws[0]).double() - want).norm() / want.norm())
        us = do_bench_cudagraph(lambda fn=fn: [fn(w) for w in ws], rep=25) * 1e3 / copies
        res.copy_(base)
        print(f"  {label:60s} {us:7.2f} us  {n * k * 2 / us / 1e6:6.2f} TB/s  rel err {err:.1e}")


if __name__ == "__main__":
    main()
