"""The options of `minisgl bench offline` (see `minisgl.benchmark.offline`), in a module that does not
import torch, so that building the CLI parser (and `minisgl --help`) stays instant."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF dir or GGUF file (default: the embedded model)")
    ap.add_argument(
        "--num-prompts", type=int, default=16, help="prompts, all sent at once (default %(default)s)"
    )
    ap.add_argument(
        "--output-len",
        type=int,
        default=64,
        help="output tokens per prompt (the minimum with --max-output-len)",
    )
    ap.add_argument(
        "--max-output-len", type=int, default=None, help="output lengths uniform in [--output-len, this]"
    )
    ap.add_argument(
        "--min-input-len", type=int, default=16, help="prompt lengths uniform in [this, --max-input-len]"
    )
    ap.add_argument("--max-input-len", type=int, default=256, help="(default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine; the best counts")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts and lengths")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both engines")
    ap.add_argument("--skip-hf", action="store_true", help="measure minisgl only")
    ap.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when a GPU is visible"
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="as for `minisgl serve` (auto: on the CPU the weights as stored, GGUF blocks or 16-bit; bf16 on "
        "CUDA); transformers runs in float32 on the CPU",
    )
    ap.add_argument(
        "--model-config",
        default=None,
        metavar="PRESET|config.json",
        help="random weights of these shapes (presets: llama3-8b, llama3-70b, smollm2-135m, qwen3-30b-a3b, mixtral-8x7b) instead of --model",
    )
    ap.add_argument(
        "--batch-sizes",
        default=None,
        metavar="N,N,...",
        help="one workload per size (default: --num-prompts)",
    )
    ap.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, help="as for `minisgl serve` (0: no graphs)"
    )
    ap.add_argument("--disable-overlap", action="store_true", help="as for `minisgl serve`")
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (processes; one GPU each on CUDA); with N > 1 the prefix cache is "
        "off (every repeat starts cold) and the per-phase figures are not printed",
    )
    ap.add_argument(
        "--quantization",
        choices=["fp8", "fp8_lm_head"],
        default=None,
        help="as for `minisgl serve` (minisgl only)",
    )
    ap.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto", help="as for `minisgl serve`"
    )
    ap.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="minisgl's KV pool size (default: from the device memory left; on a GPU, leave room for "
        "transformers' generate when it runs in the same process)",
    )
