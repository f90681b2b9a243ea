"""Where a decode step's time goes on the GPU (random weights of a preset's shapes).

Prints: the decode step time through the scheduler (CUDA graphs on), the GPU time of the bare graph
replay (so the difference is host time per step), the kernels of that replay (torch.profiler over
10 replays: GPU time per kernel per step), and a torch.profiler table of one eager prefill and
decode steps (CPU time per op, CUDA time per kernel, kernel launches).

    python benchmarks/profile_decode.py --model-config llama3-8b --batch-size 1 [--out DIR]
        [--quantization fp8] [--kv-cache-dtype fp8_e4m3] [--skip-eager]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams
from minisgl.benchmark.offline import make_workload
from minisgl.benchmark.presets import preset_config, write_model_dir


def replay_ms(llm: LLM, bs: int, iters: int = 50) -> float:
    """GPU time of one replay of the decode graph that holds a batch of `bs` (events, after warm-up)."""
    runner = llm.engine.graphs
    size = runner.padded_size(bs)
    graph = runner.graphs[size]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=int, default=8)
    ap.add_argument("--out", default=None, help="directory for the profiler table")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    ap.add_argument("--skip-eager", action="store_true", help="no profile of eager steps")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(preset_config(ns.model_config), Path(tmp) / "m")
        llm = LLM(
            str(model_dir), device="cuda", dummy_weights=True, kv_cache_memory=ns.kv_cache_gib << 30,
            quantization=ns.quantization, kv_cache_dtype=ns.kv_cache_dtype,
            cuda_graph_max_bs=max(1, ns.batch_size),
        )  # fmt: skip
        prompts = make_workload(ns.batch_size, ns.input_len, ns.input_len, llm.vocab_size, 0)
        params = SamplingParams(max_tokens=ns.output_len, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        st = llm.engine.stats
        d0, n0 = st.decode_s, st.decode_batches
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        step_ms = (st.decode_s - d0) / (st.decode_batches - n0) * 1e3
        replay = replay_ms(llm, ns.batch_size)
        what = f" {ns.quantization or 'bf16'} weights, KV {ns.kv_cache_dtype}"
        print(
            f"{ns.model_config}{what} bs={ns.batch_size}: decode step {step_ms:.3f} ms through the scheduler "
            f"({ns.batch_size * 1e3 / step_ms:.0f} tok/s), graph replay alone {replay:.3f} ms on the GPU, "
            f"host share {step_ms - replay:.3f} ms; generate wall {wall:.2f} s"
        )
        graph = llm.engine.graphs.graphs[llm.engine.graphs.padded_size(ns.batch_size)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        print("kernels of one graph replay (the last decode step's batch), GPU time over 10 replays:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        if ns.skip_eager:
            return
        graphs, llm.engine.graphs = llm.engine.graphs, None  # one eager step for the profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
        llm.engine.graphs = graphs
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
        print(table)
        print(f"CUDA kernel launches in 1 prefill + 4 eager decode steps: {kernels}")
        if ns.out:
            Path(ns.out).mkdir(parents=True, exist_ok=True)
            name = f"profile_{ns.model_config}_{ns.quantization or 'bf16'}_bs{ns.batch_size}.txt"
            (Path(ns.out) / name).write_text(table)


if __name__ == "__main__":
    main()
