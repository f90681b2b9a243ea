"""The decode graph's greedy argmax over the 8B LM head's logits (128,256 bf16 a row) by batch size,
under CUDA graphs: torch's chunked reductions (`engine.cuda_graph.argmax_rows` with
MINISGL_TRITON_ARGMAX=0) against minisgl's Triton kernels (`kernels.triton.argmax`).

    python benchmarks/bench_argmax.py [--rows 32,64,128,192,256] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import functools

import torch
from triton.testing import do_bench_cudagraph

from minisgl.engine import cuda_graph
from minisgl.kernels.triton.argmax import argmax_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,64,128,192,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ns = ap.parse_args()
    for b in (int(r) for r in ns.rows.split(",")):
        x = torch.randn(b, ns.vocab, device="cuda", dtype=torch.bfloat16)
        cuda_graph.TRITON_ARGMAX = False
        ref = cuda_graph.argmax_rows(x)
        assert torch.equal(argmax_rows(x), ref)
        torch_us = do_bench_cudagraph(functools.partial(cuda_graph.argmax_rows, x), rep=30) * 1e3
        cells = [f"torch {torch_us:6.1f}"]
        for block in (2048, 4096, 8192):
            us = do_bench_cudagraph(functools.partial(argmax_rows, x, block), rep=30) * 1e3
            cells.append(f"triton {block} {us:6.1f}")
        print(f"argmax {b} rows (us): {', '.join(cells)}", flush=True)


if __name__ == "__main__":
    main()
