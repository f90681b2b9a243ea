"""The routed experts of one MoE layer (the backend's `moe` op) at a few token counts.

GPU (bf16): the backend's op (the router's logits, the routing, the fused Triton MoE) replayed from a
CUDA graph as a decode step runs it, beside torch's routing (softmax, topk) before the same experts,
and the experts alone: time per call, the expert weights the call reads (the distinct experts its
tokens reach) and the bandwidth that makes, against a device copy's measured in the same run.
`--sweep` also times launch shapes of the two grouped GEMMs (the best one is marked): at decode sizes
gate/up's (SWEEP_UP) with down's chosen shape and down's (SWEEP_DOWN) with gate/up's chosen one. Each
timed call runs on the next of `--copies` copies of the layer's weights, so they stream from HBM as in
a model (one copy fits mostly in the 60 MB L2 at one token).

CPU (`--device cpu`, float32): the CPU backend's op (one C call) against the reference ops' loop over
experts (transformers' way), alternating, min and median of `--repeats` each, and their ratio.

    python benchmarks/bench_moe.py [--model-config qwen3-30b-a3b] [--tp 1] [--tokens 1,2,4,8,64,256,1024] [--sweep]
    python benchmarks/bench_moe.py --device cpu [--tokens 1,4,16,64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from minisgl.backends import create_ops
from minisgl.benchmark.presets import preset_config

# (block_m, block_n, block_k, num_warps, num_stages)
SWEEP = [
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4),
    (32, 64, 128, 4, 3), (32, 128, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
]  # fmt: skip
# decode sizes (16-row tiles): gate/up's launch shapes with down's chosen one, then down's with gate/up's
SWEEP_UP = [
    (16, 64, 128, 4, 3), (16, 32, 128, 4, 4), (16, 32, 256, 4, 3), (16, 16, 256, 4, 3), (16, 16, 512, 4, 2),
    (16, 32, 128, 4, 3), (16, 64, 256, 4, 3), (16, 32, 256, 8, 3), (16, 64, 128, 8, 4),
]  # fmt: skip
# one token's row GEMVs (`moe.experts`): (block_n, block_k, num_warps[, iters]) of gate/up, then of down (none
# spills in ptxas's report for sm_90, Triton 3.9: 96-207 registers a thread)
SWEEP_ROWS_UP = [
    (4, 1024, 4), (2, 1024, 4), (2, 2048, 4), (1, 2048, 4), (4, 2048, 8), (4, 1024, 4, 2), (2, 1024, 4, 4),
]  # fmt: skip
SWEEP_ROWS_DOWN = [(2, 256, 4), (1, 256, 2), (2, 128, 2), (4, 128, 4), (4, 256, 4), (2, 1024, 8)]
SWEEP_DOWN = [
    (16, 64, 128, 4, 3), (16, 32, 128, 4, 3), (16, 32, 256, 4, 3), (16, 64, 256, 4, 2), (16, 16, 256, 4, 3),
    (16, 128, 128, 4, 3), (16, 32, 128, 4, 4), (16, 64, 128, 8, 3), (16, 128, 256, 8, 2),
]  # fmt: skip


def layer(preset: str, tp: int) -> tuple[int, int, int, int]:
    """(hidden, experts, each expert's intermediate size on one of `tp` ranks, top-k) of a preset."""
    c = preset_config(preset)
    experts = c.get("num_experts") or c["num_local_experts"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    return c["hidden_size"], experts, inter // tp, c["num_experts_per_tok"]


def layer_weights(h: int, e: int, i: int, dev: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random router (E, H), w13 (E, 2I, H), w2 (E, H, I)."""
    gen = torch.Generator(dev).manual_seed(0)
    return tuple(
        (torch.randn(*shape, device=dev, dtype=dtype, generator=gen) * 0.02)
        for shape in ((e, h), (e, 2 * i, h), (e, h, i))
    )


def cpu(ns: argparse.Namespace, h: int, e: int, i: int, k: int) -> None:
    """The CPU backend's op against the reference loop, alternating."""
    router, w13, w2 = layer_weights(h, e, i, "cpu", torch.float32)
    ops = {
        "cpu backend (one C call)": create_ops("cpu", "cpu"),
        "reference (loop over experts)": create_ops("torch", "cpu"),
    }
    print(
        f"CPU, {torch.get_num_threads()} threads; {ns.model_config} layer at TP={ns.tp}: hidden {h}, {e} experts of {i}, top-{k}, float32"
    )
    for t in (int(s) for s in ns.tokens.split(",")):
        x = torch.randn(t, h)
        times: dict[str, list[float]] = {name: [] for name in ops}
        for rep in range(ns.repeats + 1):  # the first round warms up
            for name, o in ops.items():
                t0 = time.perf_counter()
                o.moe(x, router, w13, w2, k, True)
                if rep:
                    times[name].append(time.perf_counter() - t0)
        _, ids = ops["reference (loop over experts)"].route(x, router, k, False)
        read = int(ids.unique().numel()) * (w13[0].numel() + w2[0].numel()) * 4
        print(f"--- {t} tokens: {read / 1e6:.0f} MB of expert weights read")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"  {name:30s} min {min(ts) * 1e3:8.1f} ms  median {med * 1e3:8.1f} ms  {read / med / 1e9:5.1f} GB/s"
            )
        a, b = (statistics.median(ts) for ts in times.values())
        print(f"  ratio (reference / cpu backend, medians): {b / a:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="qwen3-30b-a3b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument(
        "--tokens", default=None, help="token counts (default: 1,2,4,8,64,256,1024; on the CPU 1,4,16,64)"
    )
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-tokens", default="1,4,16", help="token counts the sweep runs at")
    ap.add_argument(
        "--sweep-rows", action="store_true", help="at one token, only the row GEMVs' launch shapes"
    )
    ap.add_argument("--copies", type=int, default=4, help="GPU: copies of the layer's weights, used in turn")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--repeats", type=int, default=5, help="CPU: timed calls of each op")
    ns = ap.parse_args()
    h, e, i, k = layer(ns.model_config, ns.tp)
    if ns.device == "cpu":
        ns.tokens = ns.tokens or "1,4,16,64"
        return cpu(ns, h, e, i, k)
    ns.tokens = ns.tokens or "1,2,4,8,64,256,1024"
    gpu(ns, h, e, i, k)


def gpu(ns: argparse.Namespace, h: int, e: int, i: int, k: int) -> None:
    """The CUDA backend's op (or each launch shape of the sweeps) under CUDA graphs, each call on the
    next of `--copies` copies of the layer's weights (so they stream from HBM, not from the L2)."""
    from minisgl.benchmark.offline import copy_bandwidth

    dev, dtype = "cuda", torch.bfloat16
    bandwidth = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: device copy {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(
        f"{ns.model_config} layer at TP={ns.tp}: hidden {h}, {e} experts of intermediate {i}, top-{k}, bf16, "
        f"{ns.copies} copies of its weights in turn"
    )
    layers = [layer_weights(h, e, i, dev, dtype) for _ in range(ns.copies)]
    sweep_at = {int(s) for s in ns.sweep_tokens.split(",")} if ns.sweep else set()
    for t in (int(s) for s in ns.tokens.split(",")):
        times, read, shapes = time_tokens(
            torch.randn(t, h, device=dev, dtype=dtype),
            layers,
            k,
            t in sweep_at,
            ns.sweep_rows or t in sweep_at,
        )
        print(f"--- {t} tokens: {read / 1e6:.1f} MB of expert weights read ({shapes})")
        best = [
            min((n for n in times if n.startswith(kind)), key=times.get, default="")
            for kind in ("gate/up", "down", "rows up", "rows down")
        ]
        for name, us in times.items():
            gbs = read / us / 1e3
            mark = "  <- best" if name in best else ""
            print(
                f"  {name:44s} {us:8.1f} us  {gbs:7.0f} GB/s = {100 * gbs * 1e9 / bandwidth:3.0f}% of copy{mark}"
            )


def time_tokens(
    x: torch.Tensor, layers: list[tuple[torch.Tensor, ...]], k: int, sweep: bool, sweep_rows: bool = False
) -> tuple[dict[str, float], int, str]:
    """-> (us per call of each variant, the expert bytes one call reads, the chosen launch shapes)."""
    from triton.testing import do_bench_cudagraph

    from minisgl.kernels.triton.moe import MoeConfig, down_config, fused_moe, moe_config

    t, h = x.shape
    e = layers[0][0].shape[0]
    ops, ref = create_ops("cuda", "cuda"), create_ops("torch", "cuda")
    routed = [ops.route(x, r, k, renormalize=False) for r, _, _ in layers]
    read = (
        int(routed[0][1].unique().numel()) * (layers[0][1][0].numel() + layers[0][2][0].numel()) * 2
        + e * h * 2
    )
    chosen, chosen_down = moe_config(t * k, x.dtype), down_config(t * k, x.dtype)

    def each(fn):  # one call per copy of the weights
        return lambda: [fn(*lw, *rt) for lw, rt in zip(layers, routed, strict=True)]

    runs = {
        "moe op (router logits, routing, experts)": each(
            lambda r, w13, w2, *_: ops.moe(x, r, w13, w2, k, True)
        ),
        "torch's softmax + topk, then the experts": each(
            lambda r, w13, w2, *_: fused_moe(x, w13, w2, *ref.route(x, r, k, renormalize=False), True)
        ),
        "the experts alone (routing given)": each(lambda r, w13, w2, w, d: fused_moe(x, w13, w2, w, d, True)),
    }
    decode = t * k <= 256
    for c in (SWEEP_UP if decode else SWEEP) if sweep else ():
        cfg = MoeConfig(*c)
        dn = chosen_down if decode else cfg
        runs[f"gate/up {c}"] = each(
            lambda r, w13, w2, w, d, cfg=cfg, dn=dn: fused_moe(x, w13, w2, w, d, True, cfg, down=dn)
        )
    for c in SWEEP_DOWN if sweep and decode else ():
        dn = MoeConfig(*c)
        runs[f"down {c}"] = each(
            lambda r, w13, w2, w, d, dn=dn: fused_moe(x, w13, w2, w, d, True, chosen, down=dn)
        )
    if t == 1:
        runs |= one_token(x, k, each, ops, sweep_rows)
    times = {name: do_bench_cudagraph(fn) * 1e3 / len(layers) for name, fn in runs.items()}  # us a call
    return times, read, f"gate/up {chosen}, down {chosen_down}"


def with_env(env: dict[str, str], fn: Callable[[], object]) -> object:
    """fn() with the variables of `env` set (read when a graph is captured), then put back."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def one_token(x: torch.Tensor, k: int, each: Callable, ops: object, sweep: bool) -> dict[str, Callable]:
    """One token: the op by MINISGL_MOE_B1 / MINISGL_MOE_B1_ROUTE (the grouped GEMMs; the row GEMVs
    routed by the router's last program; routed inside gate/up's programs), the row GEMVs alone, and
    with `sweep` their launch shapes (each half with the other's default)."""
    from minisgl.kernels.triton.moe.experts import ExpertRowConfig, experts_one_token

    def op(env: dict[str, str]) -> Callable:
        return each(lambda r, w13, w2, *_: with_env(env, lambda: ops.moe(x, r, w13, w2, k, True)))  # type: ignore[attr-defined]

    runs = {
        "op, grouped GEMMs (MINISGL_MOE_B1=0)": op({"MINISGL_MOE_B1": "0"}),
        "op, rows routed by the router (B1_ROUTE=0)": op(
            {"MINISGL_MOE_B1": "1", "MINISGL_MOE_B1_ROUTE": "0"}
        ),
        "op, rows routed in gate/up (B1_ROUTE=1)": op({"MINISGL_MOE_B1": "1", "MINISGL_MOE_B1_ROUTE": "1"}),
        "the experts alone as row GEMVs": each(
            lambda r, w13, w2, w, d: experts_one_token(x, w13, w2, w, d, True)
        ),
    }
    for c in SWEEP_ROWS_UP if sweep else ():
        runs[f"rows up {c}"] = each(
            lambda r, w13, w2, w, d, c=c: experts_one_token(x, w13, w2, w, d, True, up=ExpertRowConfig(*c))
        )
    for c in SWEEP_ROWS_DOWN if sweep else ():
        runs[f"rows down {c}"] = each(
            lambda r, w13, w2, w, d, c=c: experts_one_token(x, w13, w2, w, d, True, down=ExpertRowConfig(*c))
        )
    return runs


if __name__ == "__main__":
    main()
