"""Decode-step projections on the GPU, each replayed from a CUDA graph as a decode step runs it: the
ways of calling cuBLAS for one projection (with the residual add in the epilogue, plain, through
cuBLASLt) and the kernels each launches, for a model's shapes at a few row counts. `--sweep` times
minisgl's Triton GEMV (kernels/triton/gemv/tile.py) in each launch shape of SWEEP against cuBLAS instead:
the projections with a residual add (o, down) against `addmm_`, the others against `linear`.

    python benchmarks/bench_linear.py [--rows 1,8] [--model-config llama3-8b] [--sweep [--only qkv,o,down]]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench_cudagraph

from minisgl.benchmark.presets import preset_config
from minisgl.kernels.triton.gemv import GemvConfig, gemv

# (block_n, block_k, num_warps, num_stages)
SWEEP = [
    (16, 128, 4, 6), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 6), (32, 256, 4, 3), (32, 256, 4, 4),
    (32, 256, 2, 4), (32, 512, 4, 4), (32, 512, 4, 5), (64, 128, 4, 4), (64, 256, 4, 4), (64, 256, 8, 4),
    (64, 512, 8, 3), (128, 128, 8, 4),
]  # fmt: skip


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the preset's projections: fused qkv, o, fused gate/up, down, the LM head."""
    c = preset_config(preset)
    h, d = c["hidden_size"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    i = c["intermediate_size"]
    return {
        "qkv": (qkv, h),
        "o": (h, c["num_attention_heads"] * d),
        "gate_up": (2 * i, h),
        "down": (h, i),
        "lm_head": (c["vocab_size"], h),
    }


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


def _project(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None, config: GemvConfig | None) -> object:
    """One projection: cuBLAS (config None; `addmm_` into res, or `linear`) or the Triton GEMV."""
    if config is None:
        return F.linear(x, w) if res is None else res.addmm_(x, w.t())
    return gemv(x, w, None, res, config)


def _project_each(
    x: torch.Tensor, ws: list[torch.Tensor], res: torch.Tensor | None, config: GemvConfig | None
) -> None:
    for w in ws:
        _project(x, w, res, config)


L2_DEFEAT_BYTES = 256 << 20  # the H200's L2 is 50 MB: weights are cycled through 5x that


def sweep(preset: str, rows: list[int], only: list[str]) -> None:
    """The Triton GEMV in every launch shape of SWEEP against cuBLAS, per projection and row count.

    Each timed call runs the projection over enough copies of its weight (at most 64) to stream
    L2_DEFEAT_BYTES, so the weight comes from HBM as in a decode step, not from L2; times are per
    projection."""
    print(f"== {preset}: Triton GEMV launch shapes (block_n, block_k, warps, stages) against cuBLAS")
    for name, (n, k) in shapes(preset).items():
        if only and name not in only:
            continue
        gb = n * k * 2 / 1e9
        copies = min(64, -(-L2_DEFEAT_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        w = ws[0]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=w.dtype)
            res = torch.randn(m, n, device="cuda", dtype=w.dtype) if name in ("o", "down") else None
            res0 = None if res is None else res.clone()  # the timed calls keep adding into res
            ref = x.float() @ w.float().t() + (0 if res0 is None else res0.float())
            us = {}
            for cfg in [None, *SWEEP]:
                config = None if cfg is None else GemvConfig(*cfg)
                fn = functools.partial(_project_each, x, ws, res, config)
                us[cfg] = do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3 / copies
            base = us.pop(None)
            ranked = sorted((t, cfg) for cfg, t in us.items())
            best_us, best = ranked[0]
            out = _project(x, w, None if res0 is None else res0.clone(), GemvConfig(*best))
            err = float((out.float() - ref).abs().max())  # type: ignore[union-attr]
            top = "  ".join(f"{c}:{t:.1f}" for t, c in ranked[:4])
            print(
                f"{name:8} x{copies:<3d} rows {m:3d} cuBLAS {base:6.1f} us ({gb / base * 1e6:4.0f} GB/s)  gemv best "
                f"{best_us:6.1f} us ({gb / best_us * 1e6:4.0f} GB/s) {best} max err {err:.3g}  "
                f"ratio {base / best_us:.3f}  | {top}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--sweep", action="store_true", help="time the Triton GEMV's launch shapes instead")
    ap.add_argument("--only", default="", help="with --sweep: these projections only (e.g. qkv,o,down)")
    ns = ap.parse_args()
    if ns.sweep:
        for preset in ns.model_config.split(","):
            sweep(preset, [int(r) for r in ns.rows.split(",")], [p for p in ns.only.split(",") if p])
        return
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
