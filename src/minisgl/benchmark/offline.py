"""Offline throughput: minisgl's LLM vs transformers' batched `generate` on the same workload, same run.

N prompts of random lengths (seeded) of random token ids, greedy, exactly `output_len` new tokens
each (ignore_eos / min_new_tokens); transformers gets the batch left-padded in one `generate` call.
Both engines run alternately `repeats` times and each keeps its best run (on a shared machine other
processes only ever add time). Prints output tokens/s of both, the ratio, wall-clock and CPU time.

    minisgl bench offline [--num-prompts 16] [--output-len 64] [--repeats 2]
    .venv/bin/python benchmarks/bench_offline.py (the same)

`run_offline_bench(...) -> dict` is the function form.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from typing import Any

import torch
from tqdm import tqdm


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    # Ordinary token ids (skip the first few hundred: special and control tokens live there).
    return [[rng.randrange(300, vocab) for _ in range(n)] for n in lens]


def _time_minisgl(
    llm: Any, prompts: list[list[int]], output_len: int
) -> tuple[float, float, list[list[int]]]:
    """Wall-clock and CPU seconds (all threads of this process) of one run, and the tokens."""
    from minisgl.core import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(len(o["token_ids"]) == output_len for o in outs)
    return dt, cpu, [o["token_ids"] for o in outs]


def _time_hf(
    hf: Any, prompts: list[list[int]], output_len: int, pad_id: int
) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad_id,
        )
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, cpu, out[:, width:].tolist()


def run_offline_bench(
    num_prompts: int = 16,
    output_len: int = 64,
    min_input_len: int = 16,
    max_input_len: int = 256,
    model: str | None = None,
    repeats: int = 2,
    seed: int = 0,
    threads: int | None = None,
    skip_hf: bool = False,
    **llm_options: Any,
) -> dict[str, Any]:
    """Run both engines `repeats` times on one seeded workload; report the best time of each."""
    from minisgl import LLM
    from minisgl.models import resolve_model_path

    if threads:
        torch.set_num_threads(threads)
    model_dir = resolve_model_path(model)
    llm = LLM(str(model_dir), device="cpu", dtype=torch.float32, **llm_options)
    prompts = make_workload(num_prompts, min_input_len, max_input_len, llm.vocab_size, seed)
    hf = None
    if not skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    warm = [prompts[0][:8]]
    _time_minisgl(llm, warm, 2)  # warm-up: first-call allocations of both engines
    if hf is not None:
        _time_hf(hf, warm, 2, pad_id)
    # Alternate the two engines and keep each one's best run: on a shared machine, other processes
    # only ever add time, so the minimum is the least disturbed measurement.
    best_m = best_h = cpu_m = cpu_h = float("inf")
    toks_m: list[list[int]] = []
    toks_h: list[list[int]] = []
    for _ in tqdm(range(repeats), desc="bench offline (minisgl, transformers)"):
        dt, cpu, toks_m = _time_minisgl(llm, prompts, output_len)
        best_m, cpu_m = min(best_m, dt), min(cpu_m, cpu)
        if hf is not None:
            dt, cpu, toks_h = _time_hf(hf, prompts, output_len, pad_id)
            best_h, cpu_h = min(best_h, dt), min(cpu_h, cpu)
    total = num_prompts * output_len
    lens = [len(p) for p in prompts]
    res: dict[str, Any] = {
        "num_prompts": num_prompts,
        "output_len": output_len,
        "prompt_lens": lens,
        "threads": torch.get_num_threads(),
        "minisgl_s": best_m,
        "minisgl_cpu_s": cpu_m,
        "minisgl_tok_s": total / best_m,
    }
    if hf is not None:
        same = sum(a == b for a, b in zip(toks_m, toks_h, strict=True))
        res.update(
            hf_s=best_h,
            hf_cpu_s=cpu_h,
            hf_tok_s=total / best_h,
            ratio=best_h / best_m,
            cpu_ratio=cpu_h / cpu_m,
            same_outputs=same,
        )
    return res


def print_report(res: dict[str, Any]) -> None:
    lens = res["prompt_lens"]
    print(f"machine: {platform.processor() or platform.machine()}, torch threads {res['threads']}")
    print(
        f"workload: {res['num_prompts']} prompts, input lengths min {min(lens)} / mean "
        f"{sum(lens) / len(lens):.0f} / max {max(lens)}, {res['output_len']} output tokens each (greedy)"
    )
    print(
        f"minisgl      : {res['minisgl_tok_s']:8.1f} output tok/s  "
        f"({res['minisgl_s']:.2f} s wall, {res['minisgl_cpu_s']:.2f} s CPU)"
    )
    if "hf_tok_s" in res:
        print(
            f"transformers : {res['hf_tok_s']:8.1f} output tok/s  ({res['hf_s']:.2f} s wall, {res['hf_cpu_s']:.2f} s CPU)"
        )
        print(
            f"ratio        : {res['ratio']:.2f}x wall-clock  (target >= 2x); {res['cpu_ratio']:.2f}x in CPU time"
        )
        print(f"identical outputs: {res['same_outputs']}/{res['num_prompts']} prompts")


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


def main(ns: argparse.Namespace) -> int:
    if (
        min(ns.num_prompts, ns.output_len, ns.min_input_len, ns.repeats) < 1
        or ns.max_input_len < ns.min_input_len
    ):
        print("minisgl bench offline: counts must be >= 1 and --max-input-len >= --min-input-len")
        return 2
    res = run_offline_bench(
        ns.num_prompts,
        ns.output_len,
        ns.min_input_len,
        ns.max_input_len,
        ns.model,
        ns.repeats,
        ns.seed,
        ns.threads,
        ns.skip_hf,
    )
    print_report(res)
    return 0
