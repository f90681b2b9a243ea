"""Offline throughput benchmark: minisgl's LLM vs transformers' batched `generate` (same workload,
same run, with the ratio). The code lives in `minisgl.benchmark.offline` (also `minisgl bench offline`).

    .venv/bin/python benchmarks/bench_offline.py [--num-prompts 16] [--output-len 64] [--repeats 2]
"""

from __future__ import annotations

import argparse

from minisgl.benchmark.offline import add_arguments, main, run_offline_bench

__all__ = ["run_offline_bench"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
