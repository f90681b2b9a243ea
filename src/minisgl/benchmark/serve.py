"""`minisgl bench serve`: a serving benchmark client for any OpenAI-compatible server.

Sends streaming requests at a fixed concurrency (a closed loop) or at a request rate (Poisson
arrivals, seeded), with random prompts (seeded) or prompts from a file, and reports per request:

  TTFT  time to first token (first non-empty streamed text)
  ITL   inter-token latency (gap between streamed chunks, spread over the tokens they carry)
  TPOT  time per output token after the first: (E2E - TTFT) / (output tokens - 1)
  E2E   end-to-end latency

as mean / p50 / p90 / p99, plus output tokens/s and requests/s, and how many prompt tokens the
server took from its prefix cache (`usage.prompt_tokens_details.cached_tokens`); as a table, as JSON
(--output-json) and as a PNG of the latency distributions (--plot). Imports nothing from minisgl:
it measures a server from the outside.

Workloads (--workload): `random` (independent prompts of --input-len words), `shared-prefix`
(--num-groups system prompts of --shared-prefix-len words, each request one of them, in turn, plus
its own --input-len words: what a prefix cache is for), `multi-turn` (--num-prompts conversations of
--turns turns at --concurrency; each turn resends the whole history, answers included, plus a new
user message of --input-len words).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

Prompt = str | list[dict[str, str]]  # a text, or chat messages ({"role", "content"})
WORKLOADS = ("random", "shared-prefix", "multi-turn")

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact be have do say get make go know take see come think look "
    "want give use find tell ask seem feel try leave call good new first last long great little own other "
    "old right big high different small large next early young important few public bad same able river "
    "mountain ocean forest city music story science history language computer garden window morning"
).split()


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache
    text: str = ""  # the output (multi-turn conversations resend it)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:1919"
    model: str | None = None
    endpoint: str = "completions"  # or "chat"
    num_prompts: int = 100
    concurrency: int = 8
    request_rate: float | None = None  # requests/s (Poisson); None: closed loop at `concurrency`
    input_len: int = 64  # words per random prompt
    output_len: int = 64  # max_tokens
    prompts_file: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 2
    timeout: float = 600.0
    workload: str = "random"  # see WORKLOADS
    num_groups: int = 4  # shared-prefix: distinct system prompts
    shared_prefix_len: int = 512  # shared-prefix: words per system prompt
    turns: int = 4  # multi-turn: requests per conversation


# ---- prompts and requests ----------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def random_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [_words(rng, words) for _ in range(n)]


def shared_prefix_prompts(n: int, groups: int, prefix_words: int, words: int, seed: int) -> list[Prompt]:
    """Request i: system prompt i % groups (all `prefix_words` long) and a user message of its own."""
    rng = random.Random(seed)
    systems = [_words(rng, prefix_words) for _ in range(groups)]
    return [
        [{"role": "system", "content": systems[i % groups]}, {"role": "user", "content": _words(rng, words)}]
        for i in range(n)
    ]


def conversations(n: int, turns: int, words: int, seed: int) -> list[list[str]]:
    """The user messages of `n` conversations of `turns` turns each."""
    rng = random.Random(seed)
    return [[_words(rng, words) for _ in range(turns)] for _ in range(n)]


def prompt_text(prompt: Prompt) -> str:
    """A chat as one text (the completions endpoint): a prefix of the next turn's text."""
    if isinstance(prompt, str):
        return prompt
    return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant:"


def load_prompts(path: str, n: int) -> list[str]:
    """A text file (one prompt per line) or JSONL ({"prompt": ...} per line); cycled up to n."""
    lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    prompts = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


def request_body(cfg: BenchConfig, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": cfg.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": cfg.ignore_eos,
    }
    if cfg.model:
        body["model"] = cfg.model
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    else:
        body["prompt"] = prompt_text(prompt)
    return body


def _chunk_text(obj: dict[str, Any], chat: bool) -> str:
    out = []
    for c in obj.get("choices") or []:
        out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return "".join(out)


async def send_one(client: httpx.AsyncClient, cfg: BenchConfig, prompt: Prompt) -> RequestResult:
    url = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    chat = cfg.endpoint == "chat"
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    arrivals: list[float] = []
    chunks = 0
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=request_body(cfg, prompt)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                piece = _chunk_text(obj, chat)
                if piece:
                    arrivals.append(time.perf_counter())
                    chunks += 1
                    text.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    if not arrivals:
        res.error = "no output"
        return res
    res.ok = True
    res.text = "".join(text)
    res.ttft = arrivals[0] - t0
    res.output_tokens = res.output_tokens or chunks
    # A chunk may carry several tokens (the server merges what queued up): spread each gap over them.
    per_chunk = max(res.output_tokens - 1, 0) / max(len(arrivals) - 1, 1)
    for a, b in zip(arrivals, arrivals[1:], strict=False):
        k = max(1, round(per_chunk))
        res.itl.extend([(b - a) / k] * k)
    return res


async def run_benchmark(
    cfg: BenchConfig, prompts: Sequence[Prompt] | list[list[str]], warmup: Sequence[str] = ()
) -> tuple[list[RequestResult], float]:
    """Send the warm-up prompts (one at a time, not measured), then every prompt (or, multi-turn,
    every conversation: lists of user messages); return the results (in prompt order, a
    conversation's turns in order) and the measured wall time."""
    limits = httpx.Limits(
        max_connections=max(cfg.concurrency, 1) + 4, max_keepalive_connections=cfg.concurrency
    )
    timeout = httpx.Timeout(cfg.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=timeout) as client:
        for p in warmup:
            await send_one(client, cfg, p)
        t0 = time.perf_counter()
        if cfg.workload == "multi-turn":
            results = await _conversation_loop(client, cfg, prompts)  # type: ignore[arg-type]
        elif cfg.request_rate:
            results = await _open_loop(client, cfg, prompts)  # type: ignore[arg-type]
        else:
            results = await _closed_loop(client, cfg, prompts)  # type: ignore[arg-type]
        return results, time.perf_counter() - t0


async def _closed_loop(
    client: httpx.AsyncClient, cfg: BenchConfig, prompts: Sequence[Prompt]
) -> list[RequestResult]:
    results: list[RequestResult | None] = [None] * len(prompts)
    next_i = iter(range(len(prompts)))

    async def worker() -> None:
        for i in next_i:
            results[i] = await send_one(client, cfg, prompts[i])

    await asyncio.gather(*(worker() for _ in range(max(cfg.concurrency, 1))))
    return [r for r in results if r is not None]


async def _conversation_loop(
    client: httpx.AsyncClient, cfg: BenchConfig, convs: list[list[str]]
) -> list[RequestResult]:
    """`concurrency` conversations at a time; each turn waits for the previous answer."""
    results: list[list[RequestResult]] = [[] for _ in convs]
    next_i = iter(range(len(convs)))

    async def worker() -> None:
        for i in next_i:
            history: list[dict[str, str]] = []
            for user in convs[i]:
                history.append({"role": "user", "content": user})
                res = await send_one(client, cfg, list(history))
                results[i].append(res)
                if not res.ok:
                    break
                history.append({"role": "assistant", "content": res.text})

    await asyncio.gather(*(worker() for _ in range(max(cfg.concurrency, 1))))
    return [r for conv in results for r in conv]


async def _open_loop(
    client: httpx.AsyncClient, cfg: BenchConfig, prompts: Sequence[Prompt]
) -> list[RequestResult]:
    rng = random.Random(cfg.seed + 1)
    sem = asyncio.Semaphore(max(cfg.concurrency, 1))  # at most this many in flight

    async def one(p: Prompt) -> RequestResult:
        async with sem:
            return await send_one(client, cfg, p)

    tasks = []
    for p in prompts:
        tasks.append(asyncio.create_task(one(p)))
        await asyncio.sleep(rng.expovariate(cfg.request_rate or 1.0))
    return list(await asyncio.gather(*tasks))


# ---- statistics and reports --------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float]) -> dict[str, float]:
    """mean/p50/p90/p99 in milliseconds."""
    if not values:
        return {k: math.nan for k in ("mean", "p50", "p90", "p99")}
    ms = [v * 1000 for v in values]
    return {
        "mean": statistics.fmean(ms),
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
    }


def summarize(cfg: BenchConfig, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "config": asdict(cfg),
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:10],
        "duration_s": duration,
        "input_tokens": in_tokens,
        "cached_tokens": cached,
        "cache_hit_rate": cached / in_tokens if in_tokens else 0.0,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": out_tokens / duration if duration > 0 else math.nan,
        "ttft_ms": describe([r.ttft for r in ok]),
        "itl_ms": describe([x for r in ok for x in r.itl]),
        "tpot_ms": describe([t for r in ok if (t := r.tpot) is not None]),
        "e2e_ms": describe([r.e2e for r in ok]),
    }


def format_table(s: dict[str, Any]) -> str:
    c = s["config"]
    mode = f"rate {c['request_rate']}/s" if c["request_rate"] else f"concurrency {c['concurrency']}"
    mode += f", workload {c['workload']}"
    lines = [
        f"serving benchmark: {c['base_url']} /v1/{'chat/completions' if c['endpoint'] == 'chat' else 'completions'}"
        f", {mode}",
        f"  requests        {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s",
        f"  tokens          {s['input_tokens']} in ({s['cached_tokens']} from the prefix cache, "
        f"{s['cache_hit_rate']:.1%}), {s['output_tokens']} out",
        f"  throughput      {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s",
        f"  {'latency (ms)':<15} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        d = s[key]
        lines.append(f"  {label:<15} {d['mean']:>9.2f} {d['p50']:>9.2f} {d['p90']:>9.2f} {d['p99']:>9.2f}")
    for e in s["errors"][:3]:
        lines.append(f"  error: {e}")
    return "\n".join(lines)


def plot(results: list[RequestResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = [
        ("TTFT", [r.ttft * 1000 for r in ok]),
        ("ITL", [x * 1000 for r in ok for x in r.itl]),
        ("TPOT", [t * 1000 for r in ok if (t := r.tpot) is not None]),
        ("E2E", [r.e2e * 1000 for r in ok]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series, strict=True):
        if values:
            spread = max(values) - min(values) > 1e-9 * max(abs(v) for v in values)
            ax.hist(values, bins=40 if spread else 1, color="tab:blue", alpha=0.8)
            for q, style in ((50, "-"), (99, "--")):
                ax.axvline(percentile(values, q), color="tab:red", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle(f"latency distributions, {len(ok)} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- CLI ---------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument("--base-url", default=d.base_url, help="the server (default %(default)s)")
    p.add_argument("--model", help="the `model` field to send (default: none; minisgl accepts that)")
    p.add_argument(
        "--endpoint", default=d.endpoint, choices=["completions", "chat"], help="(default %(default)s)"
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=d.num_prompts,
        metavar="N",
        help="requests measured (default %(default)s)",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        metavar="N",
        help="requests in flight (closed loop; default %(default)s; also the cap with --request-rate)",
    )
    load.add_argument("--request-rate", type=float, metavar="R", help="Poisson arrivals at R requests/s")
    p.add_argument("--input-len", type=int, default=d.input_len, metavar="WORDS", help="random prompt length")
    p.add_argument(
        "--output-len", type=int, default=d.output_len, metavar="TOKENS", help="max_tokens per request"
    )
    p.add_argument("--prompts-file", help="prompts, one per line (text or JSONL with a 'prompt' field)")
    p.add_argument(
        "--workload",
        default=d.workload,
        choices=WORKLOADS,
        help="random prompts; shared-prefix: groups of requests sharing a long system prompt; "
        "multi-turn: conversations that resend their history (default %(default)s)",
    )
    p.add_argument(
        "--num-groups", type=int, default=d.num_groups, metavar="N", help="shared-prefix: system prompts"
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=d.shared_prefix_len,
        metavar="WORDS",
        help="shared-prefix: words per system prompt (default %(default)s)",
    )
    p.add_argument(
        "--turns", type=int, default=d.turns, metavar="N", help="multi-turn: turns per conversation"
    )
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: ignore EOS, so every request has --output-len tokens)",
    )
    p.add_argument("--temperature", type=float, default=d.temperature, help="(default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="for random prompts and arrival times")
    p.add_argument("--warmup", type=int, default=d.warmup, metavar="N", help="requests sent before measuring")
    p.add_argument("--timeout", type=float, default=d.timeout, metavar="SECONDS", help="per request")
    p.add_argument("--output-json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the latency distributions")


def _check(cfg: BenchConfig) -> str:
    """What is wrong with `cfg`, or ""."""
    if cfg.num_prompts < 1 or cfg.concurrency < 1 or cfg.output_len < 1:
        return "--num-prompts, --concurrency and --output-len must be >= 1"
    if cfg.num_groups < 1 or cfg.turns < 1 or cfg.shared_prefix_len < 0:
        return "--num-groups and --turns must be >= 1, --shared-prefix-len >= 0"
    if cfg.workload != "random" and cfg.prompts_file:
        return "--prompts-file goes with --workload random"
    if cfg.workload == "multi-turn" and cfg.request_rate:
        return "--workload multi-turn runs --concurrency conversations (no --request-rate)"
    return ""


def workload(cfg: BenchConfig) -> tuple[list[str], Sequence[Prompt] | list[list[str]]]:
    """The warm-up prompts (random: they share nothing with the measured ones) and the measured
    prompts, or conversations for multi-turn."""
    if cfg.workload != "random":
        warm = random_prompts(cfg.warmup, cfg.input_len, cfg.seed + 1000)
        if cfg.workload == "multi-turn":
            return warm, conversations(cfg.num_prompts, cfg.turns, cfg.input_len, cfg.seed)
        n, g = cfg.num_prompts, cfg.num_groups
        return warm, shared_prefix_prompts(n, g, cfg.shared_prefix_len, cfg.input_len, cfg.seed)
    n = cfg.num_prompts + cfg.warmup
    if cfg.prompts_file:
        prompts = load_prompts(cfg.prompts_file, n)
        return prompts[: cfg.warmup], prompts[cfg.warmup :]
    prompts = random_prompts(n, cfg.input_len, cfg.seed)
    return prompts[: cfg.warmup], prompts[cfg.warmup :]


def main(ns: argparse.Namespace) -> int:
    fields = {k: v for k, v in vars(ns).items() if k in BenchConfig.__dataclass_fields__}
    if fields.get("request_rate") is not None:
        fields.setdefault("concurrency", BenchConfig.concurrency)
    cfg = BenchConfig(**{k: v for k, v in fields.items() if v is not None})
    problem = _check(cfg)
    if problem:
        print(f"minisgl bench serve: {problem}", file=sys.stderr)
        return 2
    warm, measured = workload(cfg)
    results, duration = asyncio.run(run_benchmark(cfg, measured, warm))
    summary = summarize(cfg, results, duration)
    print(format_table(summary))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"  summary written to {ns.output_json}")
    if ns.plot:
        plot(results, ns.plot)
        print(f"  plot written to {ns.plot}")
    return 0 if summary["completed"] else 1
