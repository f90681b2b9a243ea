"""The decode attention kernel alone on the GPU, under CUDA graphs: a batch of requests over a paged
KV pool with scattered pages (Llama-3.1-8B's heads by default), by launch shape (BLOCK_N, warps,
stages) and split count, with the KV bytes it reads per second. `--new` runs it as a decode step
does: q, k and v are views of the fused projection, rotated and stored by the kernel. `--kv-dtype fp8`:
the pool in float8_e4m3fn (`--kv-cache-dtype fp8_e4m3`, V by page transposed), half the bytes.
`--layers L` (with `--new`): a step's chain instead, L layers' pools each called once in one graph
(PDL between the kernels), the time per layer; `--qkv` puts each layer's fp8 qkv projection (the
row GEMV with its RMSNorm, the 8B shape) before its attention, as a step runs them, and prints the
GEMVs alone too, so that the difference is what attention adds to a layer.

`--context-range LO:HI`: each request's context uniform in [LO, HI] (seeded) instead of one length,
in `--order` random (as uid order leaves them), desc (the scheduler's longest first) or asc;
`--grid heads,reqs` times both orders of the kernel's grid (a request's KV heads side by side, the
default, or every request of one head first).

    python benchmarks/bench_decode_attention.py [--batch 256] [--context 416] [--splits 1,2] [--new] [--kv-dtype fp8]
        [--layers 32 [--qkv]] [--context-range 300:1300 --order random,desc --grid heads,reqs]
"""

from __future__ import annotations

import argparse
import functools

import torch
from triton.testing import do_bench_cudagraph

from minisgl.kernels.triton.attention import decode_attention

LAUNCHES = [
    (64, 4, 2), (64, 4, 3), (64, 8, 2), (32, 4, 3), (32, 4, 4), (32, 2, 4), (128, 4, 2), (16, 2, 4),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=416)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--splits", default="1,2")
    ap.add_argument("--new", action="store_true", help="the new token's K/V and RoPE in the kernel")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument(
        "--launches", default="",
        help="only these (BLOCK_N:warps:stages[:kv_heads],...), default all; kv_heads 0: the one-head kernel, "
        ">= 1: decode.packed's with that many KV heads a program (without: the default's choice)",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=0, help="with --new: a chain of this many layers' calls")
    ap.add_argument("--qkv", action="store_true", help="with --layers: each layer's fp8 qkv GEMV before it")
    ap.add_argument("--context-range", default="", help="LO:HI: contexts uniform in [LO, HI] per request")
    ap.add_argument("--order", default="random", help="with --context-range: random,desc,asc")
    ap.add_argument(
        "--grid", default="", help="heads,reqs: the kernel's grid orders to time (default: its own)"
    )
    ns = ap.parse_args()
    if ns.layers:
        return layers(ns)
    if ns.context_range:
        for order in ns.order.split(","):
            ns.context_lens = _context_lens(ns, order)
            ns.order_label = order
            _kernel_table(ns)
        return None
    ns.context_lens = None
    ns.order_label = ""
    return _kernel_table(ns)


def _context_lens(ns: argparse.Namespace, order: str) -> list[int]:
    lo, hi = (int(v) for v in ns.context_range.split(":"))
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(lo, hi + 1, (ns.batch,), generator=gen).tolist()
    if order == "desc":
        return sorted(lens, reverse=True)
    if order == "asc":
        return sorted(lens)
    if order != "random":
        raise SystemExit(f"--order: random, desc or asc, not {order}")
    return lens


def _kernel_table(ns: argparse.Namespace) -> None:
    hq, hkv, d = (int(v) for v in ns.heads.split(","))
    b, ps = ns.batch, ns.page_size
    ctx = ns.context_lens or [ns.context] * b
    pages_per_req = -(-max(ctx) // ps)
    num_pages = b * pages_per_req * 2
    gen = torch.Generator().manual_seed(0)
    page_table = torch.randperm(num_pages, generator=gen)[: b * pages_per_req].view(b, pages_per_req)
    page_table = page_table.int().cuda()
    k_cache = torch.randn(num_pages * ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    extra: dict[str, object] = {}
    if ns.kv_dtype == "fp8":  # the fp8 pool's layout: V by page transposed (minisgl.kvcache.pool)
        k_cache = k_cache.to(torch.float8_e4m3fn)
        v_cache = torch.randn(num_pages, hkv, d, ps, device="cuda").to(torch.float8_e4m3fn)
        ones = torch.ones(hkv, device="cuda")
        extra["scales"] = (ones, ones.clone())
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(b, hq, d)
    if ns.new:
        last = torch.tensor(ctx, device="cuda") - 1
        slots = (page_table.gather(1, (last // ps)[:, None])[:, 0] * ps + last % ps).int()
        angles = torch.rand(b, d // 2, device="cuda") * 6
        k_new = qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d)
        v_new = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
        extra.update(new_kv=(k_new, v_new, slots), rope=(angles.cos().bfloat16(), angles.sin().bfloat16()))
    seq_lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    kv_gb = sum(ctx) * hkv * d * 2 * k_cache.element_size() / 1e9
    context = f"context {ns.context}" if ns.context_lens is None else (
        f"contexts in [{min(ctx)}, {max(ctx)}] (mean {sum(ctx) / b:.0f}), {ns.order_label} order"
    )  # fmt: skip
    print(
        f"{'new K/V and RoPE in the kernel, ' if ns.new else ''}batch {b}, {context}, heads {hq}/{hkv}x{d}, "
        f"page {ps}, KV {ns.kv_dtype}: {kv_gb:.3f} GB of K/V per call"
    )
    launches = [tuple(int(v) for v in t.split(":")) for t in ns.launches.split(",") if t] or LAUNCHES
    grids: list[bool | None] = [{"heads": True, "reqs": False}[g] for g in ns.grid.split(",") if g] or [None]
    ref = None
    for splits in (int(s) for s in ns.splits.split(",")):
        done = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")
        for launch in launches:
            for first in grids:
                fn = functools.partial(
                    decode_attention, q, k_cache, v_cache, page_table, seq_lens, ps, d**-0.5, splits,
                    done=done, launch=launch, heads_first=first, **extra,
                )  # fmt: skip
                out = fn()
                ref = out if ref is None else ref
                err = float((out.float() - ref.float()).abs().max())
                us = do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
                grid = "" if first is None else f" grid {'heads' if first else 'reqs'}"
                print(
                    f"splits {splits} launch {launch}{grid}: {us:7.1f} us  {kv_gb / us * 1e6:5.0f} GB/s  "
                    f"max diff {err:.2g}"
                )


def layers(ns: argparse.Namespace) -> None:
    """`--layers`: per layer, [the qkv row GEMV, then] decode attention over that layer's pool."""
    from minisgl.kernels.triton.gemv.row import RowGemvConfig, gemv_fp8_rows

    if not ns.new or ns.kv_dtype != "bf16":
        raise SystemExit("--layers runs --new over a bf16 pool")
    hq, hkv, d = (int(v) for v in ns.heads.split(","))
    b, ps, n_layers = ns.batch, ns.page_size, ns.layers
    pages_per_req = -(-ns.context // ps)
    num_pages = b * pages_per_req * 2
    gen = torch.Generator().manual_seed(0)
    page_table = torch.randperm(num_pages, generator=gen)[: b * pages_per_req].view(b, pages_per_req)
    page_table = page_table.int().cuda()
    pools = [
        (torch.randn(num_pages * ps, hkv, d, device="cuda", dtype=torch.bfloat16),)
        + (torch.randn(num_pages * ps, hkv, d, device="cuda", dtype=torch.bfloat16),)
        for _ in range(n_layers)
    ]
    hidden, n_qkv = hq * d, (hq + 2 * hkv) * d
    x = torch.randn(b, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    weights = [
        (
            torch.randn(n_qkv, hidden, device="cuda").to(torch.float8_e4m3fn),
            torch.full((n_qkv,), 0.02, device="cuda"),
        )
        for _ in range(n_layers if ns.qkv else 0)
    ]
    qkv_cfg = RowGemvConfig(2, triton_pow2(hidden), 8, 8, True)  # backends.cuda.fp8_row_config's qkv shape
    qkvs = [torch.randn(b, n_qkv, device="cuda", dtype=torch.bfloat16) for _ in range(n_layers)]
    last = ns.context - 1
    slots = (page_table[:, last // ps] * ps + last % ps).int()
    angles = torch.rand(b, d // 2, device="cuda") * 6
    rope = (angles.cos().bfloat16(), angles.sin().bfloat16())
    seq_lens = torch.full((b,), ns.context, dtype=torch.int32, device="cuda")
    done = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")

    def step(splits: int, launch: tuple[int, int, int] | None, attend: bool = True) -> None:
        for i in range(n_layers):
            qkv = qkvs[i]
            if ns.qkv:
                qkv = gemv_fp8_rows(x, *weights[i], norm=(g, 1e-5), config=qkv_cfg)
            if attend:
                q = qkv[:, : hq * d].view(b, hq, d)
                k = qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d)
                v = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
                decode_attention(
                    q, *pools[i], page_table, seq_lens, ps, d**-0.5, splits, done=done, launch=launch,
                    new_kv=(k, v, slots), rope=rope,
                )  # fmt: skip

    print(f"{n_layers} layers{' with the fp8 qkv GEMV' if ns.qkv else ''}: batch {b}, context {ns.context}")
    if ns.qkv:
        us = do_bench_cudagraph(functools.partial(step, 1, None, False), rep=100, return_mode="median") * 1e3
        print(f"qkv GEMV alone: {us / n_layers:6.2f} us a layer")
    launches = [tuple(int(v) for v in t.split(":")) for t in ns.launches.split(",") if t] or [None]
    for splits in (int(s) for s in ns.splits.split(",")):
        for launch in launches:
            us = (
                do_bench_cudagraph(functools.partial(step, splits, launch), rep=100, return_mode="median")
                * 1e3
            )
            print(f"splits {splits} launch {launch or 'default'}: {us / n_layers:6.2f} us a layer")


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
