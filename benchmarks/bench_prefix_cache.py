"""Prefix caching, radix against naive on one shared-prefix workload, the baseline measured in the
same run: the ratios of request throughput and of TTFT p50.

Serving (the default): `minisgl serve --cache-type radix`, then `--cache-type naive`, each started
in turn on this machine and driven by `minisgl bench serve --workload shared-prefix`: --num-groups
system prompts of --shared-prefix-len words, each request one of them (in turn) plus --input-len
words of its own, --concurrency requests in flight, on the completions endpoint. The script
tokenizes two prompts of a group with the embedded model's tokenizer and prints how many tokens they
share (the defaults: about 90%).

`--workload multi-turn` drives the same two servers with `minisgl bench serve --workload
multi-turn` (chat conversations that resend their history) instead.

Offline (--offline): `LLM(cache_type=...)` in this process, all --num-prompts requests submitted at
once (a burst), prompts of random token ids (--shared-prefix-len shared, --input-len own); TTFT is
when the host got a request's first token. With --model-config (a preset, e.g. llama3-8b) it runs
that architecture's shapes with random weights (e.g. on a GPU).

    .venv/bin/python benchmarks/bench_prefix_cache.py [--num-prompts 64] [--concurrency 16]
        [--shared-prefix-len 450] [--input-len 50] [--output-len 16] [--rounds 1]
        [--server-args "--device cpu"]
    .venv/bin/python benchmarks/bench_prefix_cache.py --offline [--device cuda --model-config llama3-8b]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from minisgl import LLM, SamplingParams
from minisgl.benchmark.serve import (
    BenchConfig,
    describe,
    format_table,
    prompt_text,
    run_benchmark,
    summarize,
    workload,
)
from minisgl.message import BaseTokenizerMsg, DetokenizeMsg


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


class TimedLLM(LLM):
    """`LLM` that notes when the host got each request's first token."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.first_token: dict[int, float] = {}

    def offline_send_result(self, reply: list[BaseTokenizerMsg]) -> None:
        now = time.perf_counter()
        for m in reply:
            if isinstance(m, DetokenizeMsg) and m.next_token >= 0:
                self.first_token.setdefault(m.uid, now)
        super().offline_send_result(reply)


def token_prompts(ns: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(100, vocab) for _ in range(ns.shared_prefix_len)] for _ in range(ns.num_groups)]
    return [
        systems[i % ns.num_groups] + [rng.randrange(100, vocab) for _ in range(ns.input_len)]
        for i in range(ns.num_prompts)
    ]


def measure_offline(llm: TimedLLM, kind: str, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate([[7] * 32], params)  # warm-up
    llm.cache.flush()  # start cold
    uid0, fed0 = llm._next_uid, llm.num_prefill_tokens
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    duration = time.perf_counter() - t0
    ttft = [llm.first_token[uid0 + i] - t0 for i in range(len(prompts))]
    cached = sum(o["cached_tokens"] for o in outs)
    res = {
        "request_throughput": len(prompts) / duration,
        "ttft_ms": describe(ttft),
        "cached_tokens": cached,
        "input_tokens": sum(map(len, prompts)),
        "prefilled_tokens": llm.num_prefill_tokens - fed0,
        "duration_s": duration,
    }
    res["cache_hit_rate"] = cached / res["input_tokens"]
    print(
        f"--cache-type {kind}: {len(prompts)} requests in {duration:.2f} s, {res['request_throughput']:.2f} req/s, "
        f"TTFT p50 {res['ttft_ms']['p50']:.0f} ms (p90 {res['ttft_ms']['p90']:.0f}), "
        f"{res['prefilled_tokens']} tokens prefilled, {cached} cached",
        flush=True,
    )
    return res


def offline(ns: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    from minisgl.benchmark.presets import preset_config, write_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model, dummy = None, False
        if ns.model_config:
            model, dummy = str(write_model_dir(preset_config(ns.model_config), Path(tmp) / "model")), True
        runs: dict[str, list[dict[str, Any]]] = {"radix": [], "naive": []}
        for kind in runs:  # one engine at a time (a GPU's memory holds one), its rounds in a row
            opts = {"gpu_memory_fraction": ns.gpu_memory_fraction} if ns.gpu_memory_fraction else {}
            llm = TimedLLM(model, device=ns.device, cache_type=kind, dummy_weights=dummy, **opts)
            prompts = token_prompts(ns, llm.vocab_size)
            shared = ns.shared_prefix_len / (ns.shared_prefix_len + ns.input_len)
            print(f"{len(prompts)} prompts of {len(prompts[0])} tokens, {shared:.1%} shared in groups")
            for _ in range(ns.rounds):
                runs[kind].append(measure_offline(llm, kind, prompts, ns.output_len))
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next engine sizes its KV pool from the free memory
        return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="serving: requests in flight")
    p.add_argument("--num-groups", type=int, default=4, help="system prompts")
    p.add_argument("--shared-prefix-len", type=int, default=450, help="words (offline: tokens) shared")
    p.add_argument("--input-len", type=int, default=50, help="words (offline: tokens) of a request's own")
    p.add_argument("--output-len", type=int, default=16, metavar="TOKENS")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="serving: alternate radix and naive servers; offline: rounds each",
    )
    p.add_argument("--server-args", default="", help="more `minisgl serve` options, one string")
    p.add_argument(
        "--workload",
        default="shared-prefix",
        choices=["shared-prefix", "multi-turn"],
        help="serving: multi-turn runs --num-prompts chat conversations of --turns turns instead",
    )
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--offline", action="store_true", help="LLM in this process, one burst of requests")
    p.add_argument("--device", default="auto", help="--offline: auto, cpu or cuda")
    p.add_argument("--model-config", help="--offline: a preset's shapes with random weights (e.g. llama3-8b)")
    p.add_argument(
        "--gpu-memory-fraction", type=float, help="--offline: of the free GPU memory, for the KV pool"
    )
    ns = p.parse_args()
    runs = offline(ns) if ns.offline else serving(ns)
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


def serving(ns: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    cfg = BenchConfig(
        workload=ns.workload,
        endpoint="chat" if ns.workload == "multi-turn" else "completions",
        turns=ns.turns,
        num_prompts=ns.num_prompts,
        concurrency=ns.concurrency,
        num_groups=ns.num_groups,
        shared_prefix_len=ns.shared_prefix_len,
        input_len=ns.input_len,
        output_len=ns.output_len,
        warmup=2,
    )
    if ns.workload == "shared-prefix":
        print(f"prompts of one group share {shared_fraction(cfg):.1%} of their tokens", flush=True)
    extra = shlex.split(ns.server_args)
    runs: dict[str, list[dict[str, Any]]] = {"radix": [], "naive": []}
    for _ in range(ns.rounds):
        for kind in runs:
            runs[kind].append(measure(kind, cfg, extra))
    return runs


if __name__ == "__main__":
    sys.exit(main())
