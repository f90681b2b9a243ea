"""The quantized decode matmul (`kernels.quant.qlinear`) on each projection shape of a GGUF model,
at --rows activation rows: the best of --repeats calls per shape, and the weight's bytes per second
(a shape whose weight fits in cache shows the kernel's compute rate, not memory's; `--copies N`
cycles through N copies of each weight, so that it streams from memory as in a model's step). One
thread by default, which a loaded machine disturbs least. `--layout both` times the file's blocks
and the rows repacked for the decode kernel (`quant.repack`, what the CPU backend runs) in turn, call
set by call set, and prints the ratio.

    python benchmarks/bench_qlinear_shapes.py [--gguf FILE] [--rows 1] [--threads 1] [--isa avx512] [--copies 1]
        [--layout file|repacked|both] [--prefill]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from minisgl.quant import QuantizedWeight


def copy_of(w: QuantizedWeight, repacked: bool = False, isa: str | None = None) -> QuantizedWeight:
    """The same weight in fresh memory (its parts' bytes cloned), repacked for the decode kernel if
    asked (and its formats allow)."""
    from minisgl.kernels import quant
    from minisgl.quant import QuantPart

    c = QuantizedWeight([QuantPart(p.fmt, p.data.clone(), p.k, p.order) for p in w.parts])
    if repacked:
        quant.repack(c, isa)
    return c


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
    ap.add_argument("--layout", choices=["file", "repacked", "both"], default="file")
    ap.add_argument(
        "--prefill", action="store_true", help="as a prefill pass (the amx/avx512bf16 builds' bf16 path)"
    )
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)  # the kernels share torch's OpenMP runtime
    from minisgl.kernels import quant

    layouts = ["file", "repacked"] if ns.layout == "both" else [ns.layout]
    for key, w in projection_weights(str(ns.gguf) if ns.gguf else None).items():
        n, k = w.shape
        x = torch.randn(ns.rows, k)
        nbytes = sum(p.data.numel() for p in w.parts)
        sets = {lay: [copy_of(w, lay == "repacked", ns.isa) for _ in range(ns.copies)] for lay in layouts}
        best = dict.fromkeys(layouts, float("inf"))
        for _ in range(ns.repeats):
            for lay, copies in sets.items():
                t = time.perf_counter()
                for c in copies:
                    quant.qlinear(x, c, isa=ns.isa, prefill=ns.prefill)
                best[lay] = min(best[lay], (time.perf_counter() - t) / len(copies))
        fmts = sorted({int(f) for f in w.row_fmts.tolist()})
        line = f"{key:14s} ({n:6d}, {k:5d}) ggml types {fmts}: {nbytes / 1e6:6.2f} MB"
        for lay in layouts:
            line += f", {lay} {best[lay] * 1e6:9.1f} us {nbytes / best[lay] / 1e9:5.1f} GB/s"
            line += f" {ns.rows * n * k / best[lay] / 1e9:5.1f} GMAC/s"
        if len(layouts) == 2:
            line += f", repacked/file {best['repacked'] / best['file']:.3f}"
        print(line)


if __name__ == "__main__":
    main()
