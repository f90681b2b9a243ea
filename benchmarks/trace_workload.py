"""The throughput workload step by step on the GPU (random weights of a preset's shapes): where a
whole run's time goes, with the decode step's floor next to each batch size.

The workload of `minisgl bench offline --num-prompts 256 --min-input-len 100 --max-input-len 1024
--output-len 100 --max-output-len 1024` (same seed), all submitted at once. For each run: the wall
time and output tok/s, then per kind of step (prefill; decode by rows) the steps, rows, mean context,
the host seconds in `Engine.launch`, the seconds the host waited for the step's tokens (overlap
scheduling: a wait near zero means the GPU was idle, waiting for the host), the GPU time from one
step's end to the next's (CUDA events after each launch) and, for decode, the step's floor (weights
plus the batch's K/V over the measured copy bandwidth) and the fraction reached; "idle ms": the GPU
time from the step before's end to this launch's start, where the GPU had finished everything
queued before the host began the launch (a lower bound of the GPU's idle time), "cycle ms": the host
time from the launch before's start to this one's.

`--variants`: runs alternated in one process, each `order=longest|uid` (the decode batch's order,
`DecodeManager.longest_first`) and/or `prefill=N` (max prefill tokens), e.g.
`--variants order=uid order=longest`. `--kernel-windows 256,192,128,64,16`: one more run, in which the
kernels of `--window-steps` decode steps are profiled when the batch first has at most that many rows
(and of 2 prefill steps): run it with MINISGL_PDL=0 so that a kernel's time excludes PDL's wait.

    python benchmarks/trace_workload.py --model-config llama3-8b [--variants order=uid order=longest]
        [--repeats 2] [--kernel-windows 192,96] [--out DIR] [--quantization fp8 --kv-cache-dtype fp8_e4m3]
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
from minisgl.benchmark.offline import copy_bandwidth, make_workload, output_lengths
from minisgl.benchmark.weights_read import WeightCounts
from minisgl.engine.engine import Engine
from minisgl.engine.step import StepOutput


class Trace:
    """Wraps Engine.launch and StepOutput.host_tokens: per step its kind, rows, tokens, context, host
    seconds of the launch, an event after it, and the host's wait for its tokens."""

    def __init__(self, windows: list[int] | None = None, window_steps: int = 4) -> None:
        self.steps: list[dict[str, Any]] = []
        self._launch, self._host_tokens = Engine.launch, StepOutput.host_tokens
        self.windows = sorted(windows or [], reverse=True)
        self.window_steps = window_steps
        self.tables: list[str] = []
        self._prof: Any = None
        self._left = 0
        self._prefill_window = bool(windows)
        self._prefills = 0

    def __enter__(self) -> Trace:
        tr = self
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

        def launch(engine: Engine, batch: Any, pending: Any = None) -> Any:
            tr._maybe_start(batch)
            ctx = sum(r.cached_len + n for r, n in zip(batch.reqs, batch.extend_lens, strict=True))
            ev0 = torch.cuda.Event(enable_timing=True)
            ev0.record()
            t0 = time.perf_counter()
            out = tr._launch(engine, batch, pending)
            host = time.perf_counter() - t0
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            step = {
                "decode": batch.is_decode, "rows": len(batch.reqs), "tokens": sum(batch.extend_lens),
                "ctx": ctx, "host": host, "ev0": ev0, "ev": ev, "wait": 0.0, "t0": t0,
            }  # fmt: skip
            out._trace_step = step  # type: ignore[attr-defined]
            tr.steps.append(step)
            tr._maybe_stop()
            return out

        def host_tokens(out: StepOutput) -> torch.Tensor:
            t0 = time.perf_counter()
            res = tr._host_tokens(out)
            step = getattr(out, "_trace_step", None)
            if step is not None:
                step["wait"] += time.perf_counter() - t0
            return res

        Engine.launch = launch  # type: ignore[method-assign]
        StepOutput.host_tokens = host_tokens  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Engine.launch = self._launch  # type: ignore[method-assign]
        StepOutput.host_tokens = self._host_tokens  # type: ignore[method-assign]
        if self._prof is not None:
            torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            self._prof = None

    # -- kernel windows ---------------------------------------------------------------------------------
    def _maybe_start(self, batch: Any) -> None:
        if self._prof is not None:
            return
        if not batch.is_decode:
            self._prefills += 1
            if not (self._prefill_window and self._prefills == 5):
                return
            self._prefill_window = False
            label, n = f"prefill steps of {sum(batch.extend_lens)} tokens", 2
        elif self.windows and len(batch.reqs) <= self.windows[0]:
            while self.windows and len(batch.reqs) <= self.windows[0]:
                self.windows.pop(0)
            label, n = f"decode steps of {len(batch.reqs)} rows", self.window_steps
        else:
            return
        torch.cuda.synchronize()
        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.__enter__()
        self._left, self._label, self._n = n, label, n

    def _maybe_stop(self) -> None:
        if self._prof is None:
            return
        self._left -= 1
        if self._left > 0:
            return
        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        table = self._prof.key_averages().table(sort_by="cuda_time_total", row_limit=22)
        self.tables.append(
            f"--- kernels of {self._n} {self._label} (totals over the {self._n} steps)\n{table}\n"
            + _idle(self._prof)
        )
        self._prof = None

    # -- report -----------------------------------------------------------------------------------------
    def report(self, wall: float, out_tokens: int, bw: float, weights: WeightCounts, kv_token: int) -> str:
        torch.cuda.synchronize()
        by: dict[str, list[float]] = defaultdict(lambda: [0.0] * 10)
        for i, s in enumerate(self.steps):
            before = self.steps[i - 1]["ev"] if i else self._start
            gpu = before.elapsed_time(s["ev"]) / 1e3  # the previous step's end to this one's
            # the GPU done with every step before while the host had not begun this launch: idle
            idle = max(0.0, before.elapsed_time(s["ev0"]) / 1e3) if i else 0.0
            cycle = s["t0"] - self.steps[i - 1]["t0"] if i else 0.0  # host: launch start to launch start
            floor = (weights.read_bytes(s["rows"]) + s["ctx"] * kv_token) / bw if s["decode"] else 0.0
            keys = ["decode", f"decode rows {_bucket(s['rows'])}"] if s["decode"] else ["prefill"]
            for key in keys:
                b = by[key]
                vals = (1, s["rows"], s["ctx"] / s["rows"], s["host"], s["wait"], gpu, floor, 0, idle, cycle)
                for j, v in enumerate(vals):
                    b[j] += v
                b[7] += s["tokens"]
        lines = [f"wall {wall:.2f} s, {out_tokens / wall:.0f} output tok/s, {len(self.steps)} steps"]
        lines.append(
            f"{'steps':22} {'n':>5} {'rows':>6} {'ctx':>6} {'host ms':>8} {'wait ms':>8} {'gpu ms':>8} "
            f"{'floor ms':>9} {'floor%':>7} {'gpu s':>7} {'floor s':>8} {'idle ms':>8} {'cycle ms':>9}"
        )
        for key in sorted(by, key=_sort_key):
            n, rows, ctx, host, wait, gpu, floor, toks, idle, cycle = by[key]
            frac = f"{100 * floor / gpu:6.0f}%" if floor else "      -"
            lines.append(
                f"{key:22} {int(n):5d} {rows / n:6.1f} {ctx / n:6.0f} {host / n * 1e3:8.2f} {wait / n * 1e3:8.2f} "
                f"{gpu / n * 1e3:8.2f} {floor / n * 1e3:9.2f} {frac} {gpu:7.2f} {floor:8.2f} "
                f"{idle / n * 1e3:8.3f} {cycle / n * 1e3:9.2f}"
                + (f"  ({toks / n:.0f} tokens a step, {toks / gpu:.0f} tok/s)" if key == "prefill" else "")
            )
        return "\n".join(lines)


def _idle(prof: Any, top: int = 8) -> str:
    """Where the GPU sat idle in a profiled window: its span (first device event's start to the last
    one's end), the time no kernel, copy or memset ran, and the longest gaps with the events either
    side (the profiler slows the host's launches, so these are upper bounds)."""
    from torch.autograd import DeviceType

    evs = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    if not evs:
        return "GPU idle: no device events"
    start = end = evs[0].time_range.start
    gaps: list[tuple[float, str, str]] = []
    prev = ""
    for e in evs:
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, prev, e.name))
        if e.time_range.end > end:
            end, prev = e.time_range.end, e.name
    idle = sum(g for g, _, _ in gaps)
    lines = [
        f"GPU idle: span {(end - start) / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms in {len(gaps)} gaps "
        f"({sum(1 for g in gaps if g[0] > 5)} over 5 us, {sum(g for g, _, _ in gaps if g > 5) / 1e3:.2f} ms)"
    ]
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {g:9.1f} us after {a[:60]!r} before {b[:60]!r}")
    return "\n".join(lines)


def _bucket(rows: int) -> str:
    lo = 1
    while lo * 2 <= rows:
        lo *= 2
    return f"[{lo}, {2 * lo})"


def _sort_key(key: str) -> tuple[int, int]:
    if key.startswith("decode rows"):
        return (2, -int(key.split("[")[1].split(",")[0]))
    return (0 if key == "prefill" else 1, 0)


def _apply(llm: LLM, variant: str) -> None:
    for part in filter(None, variant.split(",")):
        k, v = part.split("=")
        if k == "order":
            llm.decode.longest_first = v == "longest"
        elif k == "prefill":
            llm.prefill.max_prefill_tokens = int(v)
        else:
            raise SystemExit(f"unknown variant key {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--variants", nargs="*", default=[""])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--kernel-windows", default="", help="decode rows at which to profile kernels")
    ap.add_argument("--window-steps", type=int, default=4)
    ap.add_argument("--no-warmup", action="store_true", help="no first run (kernel windows only)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (as `minisgl bench offline`)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8_e4m3")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from minisgl.benchmark.presets import preset_config, write_model_dir

        model_dir = write_model_dir(preset_config(ns.model_config), Path(tmp) / "m")
        llm = LLM(
            str(model_dir),
            device="cuda",
            dummy_weights=True,
            quantization=ns.quantization,
            kv_cache_dtype=ns.kv_cache_dtype,
        )
        bw = copy_bandwidth("cuda")
        engine = llm.engine
        weights = WeightCounts.of(engine.model)
        kv_token = sum(k.shape[1] * k.shape[2] * k.element_size() * 2 for k in engine.pool.k)
        prompts = make_workload(ns.num_prompts, 100, 1024, llm.vocab_size, 0)
        lens = output_lengths(ns.num_prompts, 100, 1024, 0)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        print(f"{ns.model_config}: device copy {bw / 1e12:.2f} TB/s; prompts {sum(map(len, prompts))} tokens")
        if not ns.no_warmup:
            llm.generate(prompts, params)  # warm-up (Triton compiles)
        out_lines = []
        for rep in range(ns.repeats):
            for variant in ns.variants:
                _apply(llm, variant)
                llm.cache.flush()
                with Trace() as tr:
                    t0 = time.perf_counter()
                    llm.generate(prompts, params)
                    wall = time.perf_counter() - t0
                text = f"=== run {rep + 1}, variant '{variant}'\n" + tr.report(
                    wall, sum(lens), bw, weights, kv_token
                )
                print(text, flush=True)
                out_lines.append(text)
        if ns.kernel_windows:
            _apply(llm, ns.variants[-1])
            llm.cache.flush()
            windows = [int(w) for w in ns.kernel_windows.split(",")]
            with Trace(windows, ns.window_steps) as tr:
                llm.generate(prompts, params)
            for t in tr.tables:
                print(t, flush=True)
                out_lines.append(t)
        if ns.out:
            Path(ns.out).mkdir(parents=True, exist_ok=True)
            (Path(ns.out) / f"trace_{ns.model_config}.txt").write_text("\n".join(out_lines) + "\n")


if __name__ == "__main__":
    main()
