"""The fp8 W8A8 matmul of decode batches (`kernels/triton/fp8_skinny.py`) against cuBLASLt's
(`backends.cuda.scaled_mm`, i.e. `torch._scaled_mm`) for a model's projections (Llama-3.1-8B's by
default), each replayed from a CUDA graph over copies of the weight that stream past the L2, as in a
decode step. o and down add into the residual as a layer calls them (cuBLASLt: the matmul, then the
add). `--sweep`: every launch shape of the skinny kernel at each row count (the best marked, the
ones that do not fit skipped); without it, the shape `backends.cuda.skinny_config` picks. Prints
microseconds a call and the weight's bytes per second; `--json PATH` writes the best shapes. `--bf16`:
the same kernel unscaled on bf16 weights (`skinny_matmul`) swept against cuBLAS. `--swapped`: cuBLASLt's
x @ W^T against W @ x^T (x's rows on the matmul's N side; its output transposed).

    python benchmarks/bench_fp8_skinny.py [--rows 32,64,128,192,256] [--sweep | --sweep-big] [--json best.json]
    python benchmarks/bench_fp8_skinny.py --bf16 [--rows 64,128,192,256]   # the unscaled kernel, swept
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections.abc import Callable, Iterator

import torch
from bench_linear import L2_DEFEAT_BYTES, shapes
from triton.testing import do_bench_cudagraph

from minisgl.backends.cuda import scaled_mm, skinny_config
from minisgl.backends.fp8 import Fp8Weight, quantize_fp8
from minisgl.kernels.triton.fp8 import quant_rows
from minisgl.kernels.triton.fp8_skinny import SkinnyConfig, skinny_fp8_matmul, skinny_matmul


def candidates(m: int, n: int, k: int, bf16: bool) -> list[SkinnyConfig]:
    """The sweep's launch shapes for (m, n, k): narrow and wide W tiles, K steps of 128 and 256 (64 and
    128 in bf16), split-K where N alone gives few programs (fp8: it never won on an H200, so bf16 tries
    2 only); x's rows as the tile's wide side or (swap) its narrow one."""
    splits = [1] if n >= 16384 else ([1, 2] if bf16 else [1, 2, 4])
    bks = [64, 128] if bf16 else [128, 256]
    out = []
    bms = [64] if m <= 64 else [64, 128]
    for bm, bn, bk, sk in itertools.product(bms, [32, 64, 128], bks, splits):
        out.append(SkinnyConfig(bm, bn, bk, sk, 4 if bm * bn <= 64 * 64 else 8, 4, False))
    swap_bms = sorted({min(128, max(16, 1 << (m - 1).bit_length())), 64} if m > 32 else {32})
    for bm, bn, bk, sk in itertools.product(swap_bms, [64, 128], bks, splits):
        out.append(SkinnyConfig(bm, bn, bk, sk, 4 if bn == 64 else 8, 4, True))
    return [c for c in out if c.fits(m, n, k)]


def big_candidates(m: int, n: int, k: int) -> list[SkinnyConfig]:
    """`--sweep-big`: every batch row in one 256-row tile (swap: the tensor core's N = 256), W tiles of
    64 or 128 rows, shallower pipelines (a stage holds 256 rows of x)."""
    out = [
        SkinnyConfig(256, bn, bk, 1, 4 if bn == 64 else 8, stages, True)
        for bn, bk, stages in itertools.product([64, 128], [64, 128], [2, 3])
    ]
    return [c for c in out if c.fits(m, n, k)]


def _each(fn: Callable[[Fp8Weight], object], ws: list[Fp8Weight]) -> None:
    for w in ws:
        fn(w)


def timed(fn: Callable[[Fp8Weight], object], ws: list[Fp8Weight]) -> float:
    """Median microseconds of one call over the weight copies (from HBM, not the L2)."""
    return do_bench_cudagraph(functools.partial(_each, fn, ws), rep=20, return_mode="median") * 1e3 / len(ws)


def _cublas(xq: torch.Tensor, xs: torch.Tensor, res: torch.Tensor | None, w: Fp8Weight) -> torch.Tensor:
    y = scaled_mm(xq, xs, w, None, torch.bfloat16)
    return y if res is None else res.add_(y)


def _skinny(xq: torch.Tensor, xs: torch.Tensor, res: torch.Tensor | None, cfg: SkinnyConfig,
            w: Fp8Weight) -> torch.Tensor:  # fmt: skip
    return skinny_fp8_matmul(xq, xs, w.qweight, w.scale, None, torch.bfloat16, cfg, res)


def _cublas16(x: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w) if res is None else res.addmm_(x, w.t())


def _skinny16(x: torch.Tensor, res: torch.Tensor | None, cfg: SkinnyConfig, w: torch.Tensor) -> torch.Tensor:
    return skinny_matmul(x, w, None, cfg, res)


def _swapped(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """cuBLASLt's fp8 matmul with the operands swapped: (W (N, K) @ x^T) -> (N, M), x's rows on its N side."""
    return torch._scaled_mm(
        w.qweight, xq.t(), scale_a=w.scale.view(-1, 1), scale_b=xs.view(1, -1), out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )  # fmt: skip


def weight_copies(ns: argparse.Namespace, only: list[str]) -> Iterator[tuple[str, int, int, list[Fp8Weight]]]:
    """(name, N, K, copies of a random fp8 weight of that shape: enough to leave the L2) per projection
    of the preset (not the LM head; `only` these names if given)."""
    for name, (n, k) in shapes(ns.model_config).items():
        if name == "lm_head" or (only and name not in only):
            continue
        copies = min(64, -(-L2_DEFEAT_BYTES // (n * k)))
        gen = torch.Generator().manual_seed(n + k)
        q, s = quantize_fp8(torch.randn(n, k, generator=gen) * k**-0.5, None)
        yield name, n, k, [Fp8Weight(q.cuda(), s.cuda(), None) for _ in range(copies)]


def swapped(ns: argparse.Namespace, rows: list[int], only: list[str]) -> None:
    """`--swapped`: cuBLASLt as the layer calls it (x @ W^T) against W @ x^T (its output transposed)."""
    print(f"{torch.cuda.get_device_name()}, {ns.model_config}: cuBLASLt x @ W^T / W @ x^T, us a call")
    for name, n, k, ws in weight_copies(ns, only):
        for m in rows:
            xq, xs = quant_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            ref = scaled_mm(xq, xs, ws[0], None, torch.bfloat16).float()
            err = float((_swapped(xq, xs, ws[0]).t().float() - ref).norm() / ref.norm())
            base = timed(functools.partial(_cublas, xq, xs, None), ws)
            swap = timed(functools.partial(_swapped, xq, xs), ws)
            print(
                f"{name:8s} ({n}x{k}) rows {m:4d}: {base:7.1f} / {swap:7.1f} us ({base / swap:.2f}x, err {err:.1e})"
            )


def bf16(ns: argparse.Namespace, rows: list[int], only: list[str]) -> None:
    """`--bf16`: the unscaled kernel against cuBLAS (F.linear; o and down `addmm_` into the residual)."""
    print(f"{torch.cuda.get_device_name()}, {ns.model_config}, bf16: us a call (weight GB/s)")
    for name, (n, k) in shapes(ns.model_config).items():
        if name == "lm_head" or (only and name not in only):
            continue
        copies = min(64, -(-L2_DEFEAT_BYTES // (2 * n * k)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16) if name in ("o", "down") else None
            ref = torch.nn.functional.linear(x, ws[0]).float()
            base = timed(functools.partial(_cublas16, x, res), ws)
            results = []
            for cfg in candidates(m, n, k, True):
                try:
                    err = float((skinny_matmul(x, ws[0], None, cfg).float() - ref).norm() / ref.norm())
                    results.append((timed(functools.partial(_skinny16, x, res, cfg), ws), err, cfg))
                except Exception as e:  # a shape the GPU cannot hold (shared memory): skipped
                    print(f"  skipped {cfg}: {type(e).__name__}")
            results.sort(key=lambda r: r[0])
            gbps = 2 * n * k / 1e3
            line = f"{name:8s} ({n}x{k}) rows {m:4d}: cuBLAS {base:7.1f} us ({gbps / base:5.0f} GB/s)"
            if results:
                t, err, _ = results[0]
                line += f"  skinny {t:7.1f} us ({gbps / t:5.0f} GB/s, {base / t:.2f}x, err {err:.1e})"
            print(line, flush=True)
            for t, _err, cfg in results[: ns.top]:
                print(f"    {t:7.1f} us  {cfg}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--rows", default="32,64,128,192,256")
    ap.add_argument("--only", default="", help="projections, e.g. o,down")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-big", action="store_true", help="the chosen shape and 256-row tiles only")
    ap.add_argument("--top", type=int, default=3, help="with --sweep: shapes printed per row count")
    ap.add_argument("--json", default=None)
    ap.add_argument("--bf16", action="store_true", help="sweep the unscaled kernel on bf16 weights instead")
    ap.add_argument("--swapped", action="store_true", help="cuBLASLt's x @ W^T against W @ x^T")
    ns = ap.parse_args()
    rows = [int(r) for r in ns.rows.split(",")]
    only = [s for s in ns.only.split(",") if s]
    if ns.swapped:
        return swapped(ns, rows, only)
    if ns.bf16:
        return bf16(ns, rows, only)
    best: dict[str, list] = {}
    print(f"{torch.cuda.get_device_name()}, {ns.model_config}: us a call (weight GB/s)")
    for name, n, k, ws in weight_copies(ns, only):
        for m in rows:
            xq, xs = quant_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            res = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16) if name in ("o", "down") else None
            ref = scaled_mm(xq, xs, ws[0], None, torch.bfloat16).float()
            base = timed(functools.partial(_cublas, xq, xs, res), ws)
            cfgs = (
                candidates(m, n, k, False)
                if ns.sweep
                else [c for c in [skinny_config(m, n, k)] if c is not None]
            )
            if ns.sweep_big:
                cfgs += big_candidates(m, n, k)
            results = []
            for cfg in cfgs:
                try:
                    out = _skinny(xq, xs, None, cfg, ws[0]).float()
                    err = float((out - ref).norm() / ref.norm())
                    results.append((timed(functools.partial(_skinny, xq, xs, res, cfg), ws), err, cfg))
                except Exception as e:  # a shape the GPU cannot hold (shared memory): skipped
                    print(f"  skipped {cfg}: {type(e).__name__}")
            results.sort(key=lambda r: r[0])
            gbps = n * k / 1e3
            line = f"{name:8s} ({n}x{k}) rows {m:4d}: cuBLASLt {base:7.1f} us ({gbps / base:5.0f} GB/s)"
            if results:
                t, err, cfg = results[0]
                line += (
                    f"  skinny {t:7.1f} us ({gbps / t:5.0f} GB/s, {base / t:.2f}x, err vs cuBLASLt {err:.1e})"
                )
                best.setdefault(f"{n}x{k}", []).append([m, *_fields(cfg), round(t, 2), round(base, 2)])
            print(line, flush=True)
            for t, _err, cfg in results[: ns.top] if ns.sweep or ns.sweep_big else []:
                print(f"    {t:7.1f} us  {cfg}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(best, f, indent=1)


def _fields(c: SkinnyConfig) -> list:
    return [c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages, int(c.swap)]


if __name__ == "__main__":
    main()
