"""Which BLAS path runs a decode step fastest: Llama-3.1-8B shapes (random weights), the graph replay
of a bs=1 and bs=8 decode step with torch's default (cuBLASLt), the legacy cuBLAS path, and cuBLASLt
with TunableOp picking each GEMM's algorithm by timing (tuned while the graphs warm up).

    python benchmarks/bench_blas.py [--model-config llama3-8b]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch
from profile_decode import replay_ms  # benchmarks/, the script's own folder

from minisgl import LLM, SamplingParams
from minisgl.benchmark.offline import make_workload
from minisgl.benchmark.presets import preset_config, write_model_dir


def decode_replay_ms(llm: LLM, bs: int) -> float:
    """Run a short generate of `bs` prompts (so the graphs see real metadata), then time a replay."""
    prompts = make_workload(bs, 256, 256, llm.vocab_size, 0)
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    return replay_ms(llm, bs, iters=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="llama3-8b")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(preset_config(ns.model_config), Path(tmp) / "m")
        for mode in ("cublaslt", "cublas", "tunableop"):
            torch.backends.cuda.preferred_blas_library("cublas" if mode == "cublas" else "cublaslt")
            if mode == "tunableop":
                torch.cuda.tunable.enable(True)
                torch.cuda.tunable.tuning_enable(True)
                torch.cuda.tunable.set_max_tuning_duration(30)
            llm = LLM(
                str(model_dir),
                device="cuda",
                dummy_weights=True,
                kv_cache_memory=4 << 30,
                cuda_graph_max_bs=8,
            )
            times = {bs: decode_replay_ms(llm, bs) for bs in (1, 8)}
            print(f"{mode:10} " + "  ".join(f"bs={bs}: {t:.3f} ms" for bs, t in times.items()), flush=True)
            torch.cuda.tunable.tuning_enable(False)
            del llm
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
