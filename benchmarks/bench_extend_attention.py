"""The prefill (extend) attention kernel alone on the GPU: a prefill chunk of the throughput workload
(requests of uniform random lengths in [100, 1024] packed into ~4,096 new tokens, no cached prefix)
over a paged pool, Llama-3.1-8B's heads by default, by launch shape (BLOCK_M, BLOCK_N, warps,
stages): microseconds a call and the causal attention's TFLOP/s; `--kv-dtype fp8` for an fp8 pool.

    python benchmarks/bench_extend_attention.py [--kv-dtype bf16,fp8] [--launches 64:32:4:2,128:64:8:3]
"""

from __future__ import annotations

import argparse
import functools
import random

import torch
from triton.testing import do_bench

from minisgl.kernels.triton.attention import extend_attention

LAUNCHES = "64:32:4:2,64:64:4:2,64:64:4:3,128:32:4:2,128:64:4:2,128:64:8:2,128:64:8:3,128:128:8:2,64:128:4:2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32,8,128", help="q heads, KV heads, head size")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="bf16,fp8")
    ap.add_argument("--launches", default=LAUNCHES)
    ns = ap.parse_args()
    hq, hkv, d = (int(v) for v in ns.heads.split(","))
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < ns.tokens:
        lens.append(min(rng.randint(100, 1024), ns.tokens - sum(lens)))
    b, ps = len(lens), ns.page_size
    pages = [-(-n // ps) for n in lens]
    perm = torch.randperm(sum(pages) * 2, generator=torch.Generator().manual_seed(0))
    table = torch.zeros(b, max(pages), dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[at : at + p]
        at += p
    table = table.cuda()
    q_starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    slots = perm.numel() * ps
    flops = sum(4 * n * (n + 1) / 2 * hq * d for n in lens)  # QK and PV over the causal half
    print(
        f"{b} requests {lens}, {sum(lens)} tokens, heads {hq}/{hkv}x{d}, page {ps}: {flops / 1e9:.1f} GFLOP"
    )
    for kv in ns.kv_dtype.split(","):
        k_cache = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        extra: dict[str, object] = {}
        if kv == "fp8":  # the fp8 pool's layout: V by page transposed (minisgl.kvcache.pool)
            k_cache = k_cache.to(torch.float8_e4m3fn)
            v_cache = torch.randn(slots // ps, hkv, d, ps, device="cuda").to(torch.float8_e4m3fn)
            ones = torch.ones(hkv, device="cuda")
            extra["scales"] = (ones, ones.clone())
        ref = None
        for launch in (tuple(int(v) for v in t.split(":")) for t in ns.launches.split(",") if t):
            fn = functools.partial(
                extend_attention, q, k_cache, v_cache, table, q_starts, seq_lens, max(lens), ps, d**-0.5,
                launch=launch, **extra,
            )  # fmt: skip
            try:
                out = fn()
            except Exception as e:  # shared memory: skipped
                print(f"  {kv} launch {launch}: skipped ({type(e).__name__})")
                continue
            ref = out if ref is None else ref
            err = float((out.float() - ref.float()).abs().max())
            us = do_bench(fn, rep=100, return_mode="median") * 1e3
            print(
                f"  {kv} launch {launch}: {us:7.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  max diff {err:.2g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
