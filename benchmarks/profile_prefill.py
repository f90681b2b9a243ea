"""Host time of eager prefill steps on the GPU (random weights of a preset's shapes): where the Python
side of a prefill step goes, function by function (cProfile), and op by op (torch.profiler, CPU).

Serving at high concurrency admits a few new prompts nearly every step, so each eager prefill step's
host time stalls the decode batch behind it: this is the cost to cut.

    python benchmarks/profile_prefill.py [--model-config smollm2-135m] [--prompts 64] [--len 500]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch
from profile_workload import StepLog
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams
from minisgl.benchmark.offline import make_workload
from minisgl.benchmark.presets import preset_config, write_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--len", type=int, default=500)
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    ap.add_argument("--out", default=None, help="directory for the tables")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(preset_config(ns.model_config), Path(tmp) / "m")
        llm = LLM(str(model_dir), device="cuda", dummy_weights=True, max_prefill_tokens=ns.max_prefill_tokens)
        prompts = make_workload(ns.prompts, ns.len, ns.len, llm.vocab_size, 0)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def run() -> float:
            llm.cache.flush()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        run()  # warm-up: Triton compiles
        with StepLog() as log:
            wall = run()
        print(f"{ns.model_config}: {ns.prompts} prompts x {ns.len} tokens, max_tokens 1: {wall * 1e3:.1f} ms")
        log.report()
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        with profile(activities=[ProfilerActivity.CPU]) as tp:
            run()
        table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        print(text.getvalue())
        print(table)
        if ns.out:
            Path(ns.out).mkdir(parents=True, exist_ok=True)
            (Path(ns.out) / f"profile_prefill_{ns.model_config}.txt").write_text(text.getvalue() + table)


if __name__ == "__main__":
    main()
