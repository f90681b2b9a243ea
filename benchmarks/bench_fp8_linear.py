"""fp8 projections on the GPU against bf16, each replayed from a CUDA graph: a model's projections
(Llama-3.1-8B's by default) at a few row counts, called through the CUDA ops backend as a layer
calls them (qkv and gate/up with their RMSNorm, o with its residual add, down with SiLU x up and the
residual add): bf16 takes the Triton GEMV or cuBLAS; fp8 per channel the fp8 GEMV up to 16 rows,
else per-token quantization + torch._scaled_mm; fp8 per 128x128 block the fp8 GEMV, else the Triton
block matmul. Weights cycle through copies that stream past the L2, as in a decode step; each figure
is per call, with the weight's bytes per second. `--sweep`: the fp8 GEMV's launch shapes (rows <= 16).

    python benchmarks/bench_fp8_linear.py [--rows 1,8,16,64,256,2048] [--sweep]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
from bench_linear import L2_DEFEAT_BYTES, shapes
from triton.testing import do_bench_cudagraph

from minisgl.backends.cuda import CudaOps
from minisgl.backends.fp8 import Fp8Weight, Weight, quantize_fp8
from minisgl.kernels.triton.gemv import GemvConfig, gemv_fp8

SWEEP = [
    (16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 4, 4), (32, 512, 4, 5), (32, 1024, 4, 3), (64, 256, 4, 4),
    (64, 512, 4, 3), (64, 512, 4, 4), (64, 512, 8, 3), (128, 256, 8, 3), (128, 512, 8, 3),
]  # fmt: skip


def _each(fn: Callable[[Weight], object], ws: list[Weight]) -> None:
    for w in ws:
        fn(w)


def timed(fn: Callable[[Weight], object], ws: list[Weight]) -> float:
    """Median microseconds of one call, over the weight copies (from HBM, not L2)."""
    return do_bench_cudagraph(functools.partial(_each, fn, ws), rep=30, return_mode="median") * 1e3 / len(ws)


def _gemv(w: Fp8Weight, x: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    return gemv_fp8(x, w.qweight, w.scale, None, config=config, out_dtype=torch.bfloat16)


def layer_call(name: str, m: int, n: int, k: int) -> Callable[[CudaOps, Weight], torch.Tensor]:
    """The ops call a layer makes for projection `name` at m rows (inputs drawn once)."""
    dev, bf = "cuda", torch.bfloat16
    if name in ("qkv", "gate_up"):
        h, norm = torch.randn(m, k, device=dev, dtype=bf), torch.ones(k, device=dev, dtype=bf)
        return lambda ops, w: ops.norm_linear(h, norm, 1e-5, w, None)
    res = torch.randn(m, n, device=dev, dtype=bf)
    if name == "o":
        x = torch.randn(m, k, device=dev, dtype=bf)
        return lambda ops, w: ops.linear_add_(x, w, None, res)
    gate_up = torch.randn(m, 2 * k, device=dev, dtype=bf)
    return lambda ops, w: ops.linear_add_(gate_up, w, None, res, gated=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,64,256,2048")
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--sweep", action="store_true")
    ns = ap.parse_args()
    ops = CudaOps()
    rows = [int(r) for r in ns.rows.split(",")]
    for name, (n, k) in shapes(ns.model_config).items():
        if name == "lm_head":
            continue  # stays bf16
        copies = min(32, -(-L2_DEFEAT_BYTES // (n * k)))
        bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        chan: list[Weight] = [Fp8Weight(*quantize_fp8(w, None), None) for w in bf]
        block: list[Weight] = [Fp8Weight(*quantize_fp8(w, (128, 128)), (128, 128)) for w in bf]
        for m in rows:
            call = layer_call(name, m, n, k)
            times = {
                label: timed(functools.partial(call, ops), ws)
                for label, ws in (("bf16", bf), ("chan", chan), ("block", block))
            }
            want = call(ops, bf[0]).float()
            err = {
                label: float((call(ops, ws[0]).float() - want).norm() / want.norm())
                for label, ws in (("chan", chan), ("block", block))
            }
            t_bf, t_ch, t_bk = times["bf16"], times["chan"], times["block"]
            tflop = 2 * m * n * k / 1e12
            print(
                f"{name:8} rows {m:5d}: bf16 {t_bf:8.1f} us ({n * k * 2 / t_bf / 1e3:5.0f} GB/s, {tflop / t_bf * 1e6:4.0f} TFLOP/s)"
                f" | fp8 chan {t_ch:8.1f} us ({n * k / t_ch / 1e3:5.0f} GB/s, {tflop / t_ch * 1e6:4.0f} TFLOP/s) x{t_bf / t_ch:.2f}"
                f" vs bf16 {err['chan']:.3f} | fp8 block {t_bk:8.1f} us x{t_bf / t_bk:.2f} vs bf16 {err['block']:.3f}"
            )  # fmt: skip
            if ns.sweep and m <= 16:
                # the GEMV's input as the layer hands it: fp16 from RMSNorm / SiLU x up, bf16 for o
                dtype = torch.bfloat16 if name == "o" else torch.float16
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                res = []
                for cfg in SWEEP:
                    fn = functools.partial(_gemv, x=x, config=GemvConfig(*cfg))
                    res.append((timed(fn, chan), cfg))
                print("    fp8 gemv shapes: " + "  ".join(f"{c}:{t:.1f}" for t, c in sorted(res)[:6]))


if __name__ == "__main__":
    main()
