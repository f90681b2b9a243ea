"""The quantized decode matmul (`kernels.quant.qlinear`) on each projection shape of a GGUF model,
at --rows activation rows: the best of --repeats calls per shape, and the weight's bytes per second
(a shape whose weight fits in cache shows the kernel's compute rate, not memory's; `--copies N`
cycles through N copies of each weight, so that it streams from memory as in a model's step). One
thread by default, which a loaded machine disturbs least.

    python benchmarks/bench_qlinear_shapes.py [--gguf FILE] [--rows 1] [--threads 1] [--isa avx512] [--copies 1]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from minisgl.quant import QuantizedWeight


def copy_of(w: QuantizedWeight) -> QuantizedWeight:
    """The same weight in fresh memory (its parts' bytes cloned)."""
    from minisgl.quant import QuantPart

    return QuantizedWeight([QuantPart(p.fmt, p.data.clone(), p.k, p.order) for p in w.parts])


def projection_weights(gguf: str | None = None) -> dict[str, QuantizedWeight]:
    """A GGUF model's quantized projections (default: the embedded model's), the first of each name
    (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head)."""
    from minisgl.models import load_model, resolve_model_path

    model, _ = load_model(resolve_model_path(gguf), torch.float32, torch.device("cpu"), native=True)
    shapes: dict[str, QuantizedWeight] = {}
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if isinstance(w, QuantizedWeight) and not name.endswith("embed_tokens"):
            shapes.setdefault(name.rsplit(".", 1)[-1], w)
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="default: the embedded SmolLM2 Q4_1")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--isa", default=None, help="a build of cpu_quant.c (default: the best this CPU runs)")
    ap.add_argument("--copies", type=int, default=1, help="copies of each weight, used in turn")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)  # the kernels share torch's OpenMP runtime
    from minisgl.kernels import quant

    for key, w in projection_weights(str(ns.gguf) if ns.gguf else None).items():
        n, k = w.shape
        x = torch.randn(ns.rows, k)
        nbytes = sum(p.data.numel() for p in w.parts)
        copies = [w] + [copy_of(w) for _ in range(ns.copies - 1)]
        best = float("inf")
        for _ in range(ns.repeats):
            t = time.perf_counter()
            for c in copies:
                quant.qlinear(x, c, isa=ns.isa)
            best = min(best, (time.perf_counter() - t) / len(copies))
        fmts = sorted({int(f) for f in w.row_fmts.tolist()})
        print(
            f"{key:14s} ({n:6d}, {k:5d}) ggml types {fmts}: {nbytes / 1e6:6.2f} MB, {best * 1e6:9.1f} us, "
            f"{nbytes / best / 1e9:5.1f} GB/s"
        )


if __name__ == "__main__":
    main()
