"""Two versions of cpu_quant.c in one process, call by call: the decode (or prefill) matmul on each
projection shape of a GGUF model, alternating A and B within each round, so a noisy machine slows
both alike. Prints each side's best, B/A and the median of the rounds' ratios, and whether the two
give bitwise the same outputs (a change meant to keep the float order must say True).

    python benchmarks/ab_quant_kernels.py A.c B.c [--rows 1] [--threads 2] [--copies 1] [--prefill]

e.g. `git show HEAD~1:src/minisgl/kernels/cpu_quant.c > /tmp/a.c` against the working tree's file.
`--copies N` cycles through N copies of each weight so that it streams from memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_qlinear_shapes import copy_of, projection_weights  # this folder's (the scripts run from it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--prefill", action="store_true", help="the prefill pass (AMX-BF16 where built)")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    from minisgl.kernels import build, quant

    isa = build.quant_isa()
    libs = []
    for src in (ns.a, ns.b):  # each source builds its own library (the build cache keys on the text)
        build._QUANT_SOURCE = src
        build._quant.pop(isa, None)
        libs.append(build.load_quant(isa))
    for key, w in projection_weights().items():
        copies = [w] + [copy_of(w) for _ in range(ns.copies - 1)]
        x = torch.randn(ns.rows, w.shape[1])
        outs = []
        for lib in libs:
            build._quant[isa] = lib
            outs.append(quant.qlinear(x, w, prefill=ns.prefill))
        times: list[list[float]] = [[], []]
        reps = 3 if w.shape[0] > 10000 else 20
        for _ in range(ns.rounds):
            for i, lib in enumerate(libs):
                build._quant[isa] = lib
                best = float("inf")
                for _ in range(reps):
                    t = time.perf_counter()
                    for c in copies:
                        quant.qlinear(x, c, prefill=ns.prefill)
                    best = min(best, (time.perf_counter() - t) / len(copies))
                times[i].append(best)
        a, b = min(times[0]) * 1e6, min(times[1]) * 1e6
        ratio = statistics.median(y / x for x, y in zip(times[0], times[1], strict=True))
        same = torch.equal(outs[0], outs[1])
        print(
            f"{key:14s} A {a:9.1f} us  B {b:9.1f} us  B/A {b / a:.3f}  median pair {ratio:.3f}  same={same}",
            flush=True,
        )


if __name__ == "__main__":
    main()
