"""The fp8 projections of a batch-1..4 decode step (Llama-3.1-8B shapes by default), per layer, each
replayed from a CUDA graph over weight copies that stream past the L2: the tensor-core fp8 GEMV with
its RMSNorm / SiLU x up kernels (`tc`) against the CUDA-core row GEMV with those fused (`rows`, every
launch shape `sweep` gives the projection). Per projection: qkv (norm + GEMV), o (+ residual),
gate/up (norm + GEMV + SiLU x up; the row GEMV writes silu(gate) * up), down (+ residual; its input
already gated); with `--lm-head`, also the LM head (plain; beside bf16's cuBLAS call, `tc` there being
the bf16 head as `CudaOps.linear` runs it). `--json PATH` writes each projection's best launch shape at the first --rows, keyed as
`fp8_row_config` reads it from MINISGL_FP8_ROW_CONFIGS (N x K, "g" for [gate | up]).

    python benchmarks/bench_fp8_gemv_rows.py [--rows 1] [--model-config llama3-8b] [--top 4] [--json PATH] [--lm-head]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton
from bench_linear import L2_DEFEAT_BYTES, shapes
from triton.testing import do_bench_cudagraph

from minisgl.backends.cuda import CudaOps, fp8_gemv_config, fp8_row_config, fp8_row_key
from minisgl.backends.fp8 import Fp8Weight, quantize_fp8
from minisgl.kernels.triton import elementwise as tk
from minisgl.kernels.triton.gemv import RowGemvConfig, gemv_fp8, gemv_fp8_rows


def sweep(name: str, k: int) -> list[RowGemvConfig]:
    """Launch shapes to time: (BLOCK_N, BLOCK_K, warps, blocks a program, prefetch). One step over
    K (BLOCK_K = K's power of two) keeps x in registers and lets a program take several blocks of
    rows (and prefetch its first tile); the shapes are those without spills in ptxas's report for
    sm_90 (Triton 3.6 and 3.9)."""
    kp = triton.next_power_of_2(k)
    if k > 8192:  # down: K in steps, or one step of 16384 columns over 8 warps
        steps = [(4, 2048, 8), (1, 1024, 2), (1, 2048, 2), (2, 2048, 4), (4, 1024, 4)]
        one = [(1, kp, 8, 1), (1, kp, 8, 2), (1, kp, 8, 4), (2, kp, 8, 1), (2, kp, 8, 2)]
    elif name == "lm_head":  # 128K rows: K in steps as gate/up, or one step with several blocks a program
        steps = [(2, 1024, 2), (4, 512, 2), (4, 1024, 4), (2, 2048, 4), (4, 2048, 8)]
        one = [(2, kp, 8, 8), (2, kp, 4, 4), (2, kp, 8, 4), (4, kp, 8, 4), (4, kp, 8, 2), (1, kp, 4, 8)]
    elif name == "gate_up":  # per half
        steps = [(4, 512, 2), (2, 1024, 2), (2, 512, 2)]
        one = [
            (1, kp, 4, 2),
            (1, kp, 4, 4),
            (1, kp, 4, 8),
            (2, kp, 4, 2),
            (2, kp, 4, 4),
            (2, kp, 8, 2),
            (2, kp, 8, 4),
        ]
    else:  # qkv, o
        steps = [(4, 2048, 4), (4, 1024, 2), (2, 1024, 2)]
        one = [
            (1, kp, 4, 8), (1, kp, 8, 8), (2, kp, 4, 2), (2, kp, 4, 4), (2, kp, 4, 8), (2, kp, 8, 4),
            (2, kp, 8, 8), (4, kp, 4, 1), (4, kp, 4, 2), (4, kp, 8, 2), (4, kp, 8, 4),
        ]  # fmt: skip
    return [
        *(RowGemvConfig(bn, bk, w) for bn, bk, w in steps),  # K in steps: no prefetch, one block
        *(RowGemvConfig(bn, bk, w, it, pf) for bn, bk, w, it in one for pf in (True, False)[: 1 + (it == 8)]),
    ]  # one step over K: with prefetch, and without it where iters = 8 (how much prefetch gives)


EPS = 1e-5
Call = Callable[[Fp8Weight], torch.Tensor]


def timed(fn: Call, ws: list[Fp8Weight]) -> float:
    """Median microseconds of one call, over the weight copies (from HBM, not L2)."""

    def each() -> None:
        for w in ws:
            fn(w)

    return do_bench_cudagraph(each, rep=25, return_mode="median") * 1e3 / len(ws)


def tc_call(name: str, x: torch.Tensor, g: torch.Tensor, res: torch.Tensor) -> Call:
    """The tensor-core GEMV path of the tree before the row GEMV, as the layer calls it; the LM head:
    bf16 (each copy's weight dequantized once), as `CudaOps.linear` runs it (cuBLAS)."""
    x16 = x.to(torch.float16)  # down's input, as SiLU x up wrote it
    if name == "lm_head":
        ops, bf16 = CudaOps(), {}

        def head(w: Fp8Weight) -> torch.Tensor:
            if id(w) not in bf16:
                bf16[id(w)] = w.dequantize(torch.bfloat16)
            return ops.linear(x, bf16[id(w)], None)

        return head

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
    out = None if norm or name == "lm_head" else res
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
    return xd @ wd.T if name == "lm_head" else res.double() + xd @ wd.T


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def short(c: RowGemvConfig) -> str:
    return f"({c.block_n},{c.block_k},{c.num_warps},{c.iters}{',p' if c.prefetch else ''})"


def bench(
    name: str, n: int, k: int, rows: list[int], top: int, tc: bool
) -> dict[int, tuple[float, float, float, RowGemvConfig]]:
    """Per row count: (tc us, chosen us, best us, the best launch shape)."""
    copies = min(32, -(-L2_DEFEAT_BYTES // (n * k)))
    ws = [
        Fp8Weight(*quantize_fp8(torch.randn(n, k, device="cuda") * k**-0.5, None), None)
        for _ in range(copies)
    ]
    out: dict[int, tuple[float, float, float, RowGemvConfig]] = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        n_out = n // 2 if name == "gate_up" else n
        res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16)
        t_tc = timed(tc_call(name, x, g, res), ws) if tc else float("nan")
        res_list = sorted(
            ((timed(row_call(name, x, g, res, c), ws), c) for c in sweep(name, k)), key=lambda tc_: tc_[0]
        )
        chosen = fp8_row_config(x, ws[0], gated=name == "gate_up")
        t_ch = timed(row_call(name, x, g, res, chosen), ws) if chosen else float("nan")
        ref = reference(name, x, g, res, ws[0])
        errs = [rel(row_call(name, x, g, res.clone(), c)(ws[0]), ref) for c in (chosen, res_list[0][1]) if c]
        gbs = lambda t: n * k / t / 1e3  # noqa: E731
        best = res_list[0][0]
        print(
            f"{name:8} rows {m}: tc {t_tc:6.1f} us ({gbs(t_tc):5.0f} GB/s) | rows chosen {chosen and short(chosen)}"
            f" {t_ch:6.1f} us ({gbs(t_ch):5.0f} GB/s) best {short(res_list[0][1])} {best:6.1f} us"
            f" ({gbs(best):5.0f} GB/s) | err {max(errs):.2e}"
        )  # fmt: skip
        print("    " + "  ".join(f"{short(c)}:{t:.1f}" for t, c in res_list[:top]))
        print("    all: " + "  ".join(f"{short(c)}:{t:.1f}" for t, c in res_list[top:]), flush=True)
        if max(errs) > 1e-2:
            raise SystemExit(f"{name}: error {max(errs):.2e} against the float64 reference")
        out[m] = (t_tc, t_ch, best, res_list[0][1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1")
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--no-tc", action="store_true", help="skip the tensor-core GEMV's timings")
    ap.add_argument("--json", help="write the best launch shapes (first --rows) here")
    ap.add_argument("--lm-head", action="store_true", help="also the LM head (not in a layer's sums)")
    ap.add_argument("--only", help="comma-separated projections to time (qkv, o, gate_up, down, lm_head)")
    ns = ap.parse_args()
    rows = [int(r) for r in ns.rows.split(",")]
    total: dict[int, list[float]] = {m: [0.0, 0.0, 0.0] for m in rows}
    best: dict[str, list[int | bool]] = {}
    for name, (n, k) in shapes(ns.model_config).items():
        if (name == "lm_head" and not ns.lm_head) or (ns.only and name not in ns.only.split(",")):
            continue
        for m, (t_tc, t_ch, t_best, cfg) in bench(name, n, k, rows, ns.top, not ns.no_tc).items():
            if name == "lm_head":
                print(
                    f"lm_head rows {m}: bf16 {t_tc:.1f} us, fp8 rows chosen {t_ch:.1f} us, best {t_best:.1f} us"
                )
            else:
                total[m][0] += t_tc
                total[m][1] += t_ch
                total[m][2] += t_best
            if m == rows[0]:
                key = fp8_row_key(n, k, name == "gate_up")
                best[key] = [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.iters, cfg.prefetch]
                if ns.json:  # after each projection: a sweep cut short still leaves the ones done
                    with open(ns.json, "w") as f:
                        json.dump(best, f)
    for m, (t_tc, t_ch, t_best) in total.items():
        print(
            f"a layer's fp8 projections, rows {m}: tc {t_tc:.1f} us, rows chosen {t_ch:.1f} us, best {t_best:.1f} us"
        )
    if ns.json:
        print(f"best launch shapes -> {ns.json}: {best}")


if __name__ == "__main__":
    main()
