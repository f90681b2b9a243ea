"""Where the throughput workload's time goes on the GPU (random weights of a preset's shapes): 256
requests, input and output lengths uniform in [100, 1024], all submitted at once.

Prints the wall time and output tok/s, the steps by kind (prefill / decode, rows per step), the host
time spent in `Engine.launch` per step (preparing and enqueueing: with overlap scheduling this hides
behind the GPU while it is shorter than the GPU's step), the GPU time per step (CUDA events at each
launch), and a torch.profiler table (CPU time per op) of a second run.

    python benchmarks/profile_workload.py [--model-config smollm2-135m] [--disable-overlap] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl import LLM, SamplingParams
from minisgl.benchmark.offline import make_workload, output_lengths
from minisgl.benchmark.presets import preset_config, write_model_dir
from minisgl.engine.engine import Engine


class StepLog:
    """Wraps Engine.launch: host seconds per launch and a CUDA event at each, by step kind."""

    def __init__(self) -> None:
        self.rows: list[tuple[bool, int, float, torch.cuda.Event]] = []
        self._real = Engine.launch

    def __enter__(self) -> StepLog:
        log = self

        def launch(engine: Engine, batch: Any, pending: Any = None) -> Any:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            t0 = time.perf_counter()
            out = log._real(engine, batch, pending)
            log.rows.append((batch.is_decode, len(batch.reqs), time.perf_counter() - t0, ev))
            return out

        Engine.launch = launch  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Engine.launch = self._real  # type: ignore[method-assign]

    def report(self) -> None:
        torch.cuda.synchronize()
        by: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
        for i, (dec, rows, host, ev) in enumerate(self.rows[:-1]):
            gpu = ev.elapsed_time(self.rows[i + 1][3]) / 1e3  # start to next start
            kind = "decode" if dec else "prefill"
            bucket = f"{kind} rows {_bucket(rows)}"
            for key in (kind, bucket):
                b = by[key]
                b[0] += 1
                b[1] += rows
                b[2] += host
                b[3] += gpu
        print(f"{'steps':28} {'n':>6} {'rows/step':>10} {'host ms/step':>13} {'launch-to-launch ms':>20}")
        for key in sorted(by):
            n, rows, host, gpu = by[key]
            print(f"{key:28} {n:6d} {rows / n:10.1f} {host / n * 1e3:13.3f} {gpu / n * 1e3:20.3f}")


def _bucket(rows: int) -> str:
    lo = 1
    while lo * 2 <= rows:
        lo *= 2
    return f"[{lo}, {2 * lo})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--disable-overlap", action="store_true")
    ap.add_argument("--out", default=None, help="directory for the profiler table")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(preset_config(ns.model_config), Path(tmp) / "m")
        opts = {"overlap_schedule": False} if ns.disable_overlap else {}
        llm = LLM(str(model_dir), device="cuda", dummy_weights=True, **opts)
        prompts = make_workload(ns.num_prompts, 100, 1024, llm.vocab_size, 0)
        lens = output_lengths(ns.num_prompts, 100, 1024, 0)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        llm.generate(prompts, params)  # warm-up (Triton compiles, graphs)
        llm.cache.flush()
        with StepLog() as log:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
        print(
            f"{ns.model_config}, {ns.num_prompts} requests, overlap {'off' if ns.disable_overlap else 'on'}: "
            f"{wall:.2f} s, {sum(lens) / wall:.0f} output tok/s"
        )
        log.report()
        llm.cache.flush()
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # host time per op, whole run
            llm.generate(prompts, params)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        print(table)
        if ns.out:
            Path(ns.out).mkdir(parents=True, exist_ok=True)
            suffix = "no_overlap" if ns.disable_overlap else "overlap"
            (Path(ns.out) / f"profile_workload_{ns.model_config}_{suffix}.txt").write_text(table)


if __name__ == "__main__":
    main()
