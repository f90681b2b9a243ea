"""Offline throughput: minisgl's LLM vs transformers' batched `generate` on the same workload, same run.

N prompts of random lengths (uniform in [min, max], seeded) of random token ids, greedy, exactly `output_len` new tokens
each (ignore_eos / min_new_tokens); transformers gets the batch left-padded in one `generate` call.
Both engines run alternately `repeats` times and each keeps its best run (on a shared machine other
processes only ever add time). Prints output tokens/s of both, the ratio, wall-clock and CPU time,
and minisgl's prefill and decode phases (time, achieved GFLOP/s of the matmuls, weight GB/s).

    minisgl bench offline [--num-prompts 16] [--output-len 64] [--repeats 2]
    .venv/bin/python benchmarks/bench_offline.py (the same)

`run_offline_bench(...) -> dict` is the function form.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF dir or GGUF file (default: the embedded model)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-input-len", type=int, default=16)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per engine; the best counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both engines")
    ap.add_argument("--skip-hf", action="store_true", help="measure minisgl only")
