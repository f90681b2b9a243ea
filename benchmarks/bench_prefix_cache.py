"""Prefix caching on the serving path: one shared-prefix workload against `minisgl serve
--cache-type radix` and `--cache-type naive`, each server started in turn on this machine (the
baseline is measured in the same run), and the ratios of request throughput and TTFT p50.

The workload is `minisgl bench serve --workload shared-prefix`: --num-groups system prompts of
--shared-prefix-len words, each request one of them (in turn) plus --input-len words of its own, on
the completions endpoint. The script tokenizes two prompts of a group with the embedded model's
tokenizer and prints how many of their tokens they share (the defaults: about 90%).

    .venv/bin/python benchmarks/bench_prefix_cache.py [--num-prompts 64] [--concurrency 16]
        [--shared-prefix-len 450] [--input-len 50] [--output-len 16] [--rounds 1]
        [--server-args "--device cpu"]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from minisgl.benchmark.serve import (
    BenchConfig,
    format_table,
    prompt_text,
    run_benchmark,
    summarize,
    workload,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cache_type: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "minisgl", "serve", "--port", str(port), "--cache-type", cache_type]
    proc = subprocess.Popen([*cmd, "--log-level", "warning", *extra])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {cache_type} server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the {cache_type} server did not come up")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(cache_type: str, cfg: BenchConfig, extra: list[str]) -> dict[str, Any]:
    proc, url = _serve(cache_type, extra)
    try:
        run = BenchConfig(**{**cfg.__dict__, "base_url": url})
        warm, prompts = workload(run)
        results, duration = asyncio.run(run_benchmark(run, prompts, warm))
        summary = summarize(run, results, duration)
    finally:
        _stop(proc)
    print(f"--cache-type {cache_type}")
    print(format_table(summary), flush=True)
    return summary


def shared_fraction(cfg: BenchConfig) -> float:
    """Tokens two prompts of one group share, over their mean length (embedded model's tokenizer)."""
    from minisgl.models import resolve_model_path
    from minisgl.utils.hf import load_tokenizer

    tok = load_tokenizer(resolve_model_path(None))
    _, prompts = workload(cfg)
    a, b = (tok.encode(prompt_text(p)) for p in (prompts[0], prompts[cfg.num_groups]))
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return common / ((len(a) + len(b)) / 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--shared-prefix-len", type=int, default=450, metavar="WORDS")
    p.add_argument("--input-len", type=int, default=50, metavar="WORDS")
    p.add_argument("--output-len", type=int, default=16, metavar="TOKENS")
    p.add_argument("--rounds", type=int, default=1, help="alternate radix and naive this many times")
    p.add_argument("--server-args", default="", help="more `minisgl serve` options, one string")
    ns = p.parse_args()
    cfg = BenchConfig(
        workload="shared-prefix",
        num_prompts=ns.num_prompts,
        concurrency=ns.concurrency,
        num_groups=ns.num_groups,
        shared_prefix_len=ns.shared_prefix_len,
        input_len=ns.input_len,
        output_len=ns.output_len,
        warmup=2,
    )
    print(f"prompts of one group share {shared_fraction(cfg):.1%} of their tokens", flush=True)
    extra = shlex.split(ns.server_args)
    runs: dict[str, list[dict[str, Any]]] = {"radix": [], "naive": []}
    for _ in range(ns.rounds):
        for kind in runs:
            runs[kind].append(measure(kind, cfg, extra))
    print("\nround  req/s radix  naive  ratio   TTFT p50 ms radix  naive  ratio   cached (radix)")
    for i, (r, n) in enumerate(zip(runs["radix"], runs["naive"], strict=True)):
        tput = r["request_throughput"] / n["request_throughput"]
        ttft = n["ttft_ms"]["p50"] / r["ttft_ms"]["p50"]
        print(
            f"{i + 1:>5}  {r['request_throughput']:>11.2f} {n['request_throughput']:>6.2f} {tput:>6.2f}x"
            f"   {r['ttft_ms']['p50']:>17.0f} {n['ttft_ms']['p50']:>6.0f} {ttft:>6.2f}x"
            f"   {r['cached_tokens']}/{r['input_tokens']} ({r['cache_hit_rate']:.1%})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
