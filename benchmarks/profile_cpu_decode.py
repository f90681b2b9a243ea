"""Where a CPU decode step goes: the recorded program of one batch size (`engine/cpu_graph.py`)
replayed with each kernel call timed (`Program.profile`), summed per kernel and per projection shape.

    python benchmarks/profile_cpu_decode.py [--model PATH] [--batch-size 1] [--steps 200] [--threads 2]

Prints, per kernel (and per (N, K) for the quantized matmuls): calls per step, microseconds per step,
share of the step; and the step's total against the wall time of plain replays.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections import defaultdict

import numpy as np
import torch


def names() -> dict[int, str]:
    """Kernel entry points by address."""
    from minisgl.kernels.build import load, load_quant

    out: dict[int, str] = {}
    for lib in (load(), load_quant()):
        if lib is None:
            continue
        for name in (
            "decode_attention",
            "rope_store",
            "add_rmsnorm",
            "gather_rows",
            "argmax_rows",
            "qlinear",
            "dequant_rows",
        ):
            fn = getattr(lib, f"minisgl_{name}_packed", None)
            if fn is not None:
                out[ctypes.cast(fn, ctypes.c_void_p).value or 0] = name
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    import minisgl
    from minisgl import SamplingParams

    llm = minisgl.LLM(ns.model)
    prompts = [[400 + 7 * i + j for j in range(64)] for i in range(ns.batch_size)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))  # records the program
    graphs = llm.engine.graphs
    if graphs is None or ns.batch_size not in getattr(graphs, "programs", {}):
        raise SystemExit(
            "no CPU decode graph of that batch size was recorded (a GGUF model on the CPU makes one)"
        )
    program = graphs.programs[ns.batch_size][0]
    for _ in range(20):
        program.run()
    t0 = time.perf_counter()
    for _ in range(ns.steps):
        program.run()
    wall = (time.perf_counter() - t0) / ns.steps
    timed = np.zeros(program.num_ops, dtype=np.int64)
    for _ in range(ns.steps):
        program.profile(timed)
    per_step = timed / ns.steps / 1e3  # us
    by_name = names()
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for (fn, args), us in zip(program.ops(), per_step, strict=True):
        name = by_name.get(fn, hex(fn))
        if name == "qlinear":  # args: x, M, K, ldx, pre, ..., N at 9
            name = f"qlinear N={int(args[9])} K={int(args[2])} pre={int(args[4])}"
        rows[name][0] += 1
        rows[name][1] += us
    total = float(per_step.sum())
    print(f"batch {ns.batch_size}, {ns.threads} threads: {program.num_ops} kernel calls a step")
    for name, (calls, us) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:42s} {calls:4d} calls {us:9.1f} us {100 * us / total:5.1f}%")
    print(
        f"profiled step {total / 1e3:.3f} ms; plain replays {wall * 1e3:.3f} ms = {ns.batch_size / wall:.1f} tok/s"
    )


if __name__ == "__main__":
    main()
