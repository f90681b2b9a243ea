"""minisgl against llama.cpp on the same GGUF file and the same threads, runs alternated.

Four measurements, each side's best (time: the lowest; rates: the highest) over --rounds rounds,
the two engines taking turns within each round (on a shared machine other processes only ever add
time):

  offline    one stream, a --prompt-len token prompt then --output-len tokens: minisgl's LLM
             (time to first token = its prefill step, decode tok/s) against llama-bench (pp, tg)
  one stream the same over HTTP: `minisgl serve` against `llama-server` (TTFT and decode tok/s
             from the streamed chunks, `minisgl bench serve`'s client)
  16 streams --concurrency streams through both servers: output tok/s, TTFT p50
  memory     the summed RSS of each server's processes (idle after start, and after the streams),
             both servers holding the same KV capacity (--ctx tokens)
  start-up   spawn to /health 200, caches warm (each server started once before measuring)

and prints both sides, the ratios, and the issue's targets (met or not). llama.cpp's binaries come
from `make llamacpp` (built from the llama-cpp-python 0.3.36 sdist into .llamacpp/) or --llamacpp-bin.

    python benchmarks/bench_llamacpp.py [--gguf FILE] [--threads 2] [--rounds 8] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BIN = ROOT / ".llamacpp" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"


@dataclass
class Side:
    """One engine's best figures so far (`figures`), the latest round's (`last`) and every round's."""

    name: str
    figures: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)

    def keep(self, key: str, value: float, higher_is_better: bool) -> None:
        self.last[key] = value
        self.rounds.setdefault(key, []).append(value)
        old = self.figures.get(key)
        if old is None or (value > old if higher_is_better else value < old):
            self.figures[key] = value


# ---- processes ----------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mib(pid: int) -> float:
    """The summed resident memory of a process and all its descendants, MiB."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


LIVE: list[Server] = []  # servers to stop if the benchmark is interrupted


class Server:
    """A server process started in its own session, with its start-up time to /health 200."""

    def __init__(
        self, cmd: list[str], port: int, env: dict[str, str], log: Path, timeout: float = 600.0
    ) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = open(log, "ab")  # noqa: SIM115 (closed in stop())
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        LIVE.append(self)
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                self.stop()
                raise RuntimeError(f"{cmd[0]} not healthy after {timeout:.0f} s; see {log}")
            time.sleep(0.02)
        self.startup_s = time.perf_counter() - t0

    def rss_mib(self) -> float:
        return tree_rss_mib(self.proc.pid)

    def stop(self) -> None:
        if self in LIVE:
            LIVE.remove(self)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---- the measurements ---------------------------------------------------------------------------


def offline_minisgl(llm: Any, rng: random.Random, prompt_len: int, output_len: int) -> tuple[float, float]:
    """(time to first token s, decode tok/s) of one fresh prompt (no prefix-cache hit)."""
    from minisgl import SamplingParams

    prompt = [rng.randrange(300, llm.vocab_size - 100) for _ in range(prompt_len)]
    st = llm.engine.stats
    p0, d0, n0 = st.prefill_s, st.decode_s, st.decode_tokens
    llm.generate([prompt], SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0))
    return st.prefill_s - p0, (st.decode_tokens - n0) / (st.decode_s - d0)


def offline_llamacpp(
    bin_dir: Path, gguf: Path, threads: int, prompt_len: int, output_len: int
) -> tuple[float, float]:
    """(time to first token s = prompt tokens / pp rate, decode tok/s) from one llama-bench run."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt_len)]
    cmd += ["-n", str(output_len), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt_len and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == output_len and r["n_prompt"] == 0)
    return prompt_len / pp, tg


def http_load(
    url: str, concurrency: int, prompts: int, words: int, output_len: int, seed: int
) -> dict[str, Any]:
    from minisgl.benchmark.serve import BenchConfig, random_prompts, run_benchmark, summarize

    cfg = BenchConfig(
        base_url=url, num_prompts=prompts, concurrency=concurrency, input_len=words, output_len=output_len,
        seed=seed, warmup=0, timeout=600.0,
    )  # fmt: skip
    measured = random_prompts(prompts, words, seed)
    results, duration = asyncio.run(run_benchmark(cfg, measured))
    s = summarize(cfg, results, duration)
    if s["failed"]:
        raise RuntimeError(f"{url}: {s['failed']} requests failed: {s['errors'][:2]}")
    return s


def serve_round(side: Side, server: Server, ns: argparse.Namespace, seed: int) -> None:
    """One stream, then the concurrent streams, through one running server; RSS before and after."""
    side.keep("rss_idle_mib", server.rss_mib(), higher_is_better=False)
    one = http_load(server.url, 1, ns.one_stream_prompts, ns.prompt_words, ns.output_len, seed)
    side.keep("http_ttft_s", one["ttft_ms"]["p50"] / 1e3, higher_is_better=False)
    side.keep("http_decode_tok_s", 1e3 / one["tpot_ms"]["mean"], higher_is_better=True)
    many = http_load(server.url, ns.concurrency, ns.streams_prompts, ns.prompt_words, ns.output_len, seed + 1)
    side.keep("streams_tok_s", many["output_throughput"], higher_is_better=True)
    side.keep("streams_ttft_p50_s", many["ttft_ms"]["p50"] / 1e3, higher_is_better=False)
    side.keep("rss_loaded_mib", server.rss_mib(), higher_is_better=False)


def minisgl_cmd(ns: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "minisgl", "serve", "--model", str(ns.gguf), "--port", str(port)]
    cmd += ["--num-pages", str(ns.ctx // 16), "--page-size", "16", "--log-level", "warning"]
    return cmd + shlex.split(ns.minisgl_args)


def llamacpp_cmd(ns: argparse.Namespace, port: int) -> list[str]:
    cmd = [
        str(ns.llamacpp_bin / "llama-server"),
        "-m",
        str(ns.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return cmd + [
        "-t",
        str(ns.threads),
        "-tb",
        str(ns.threads),
        "-c",
        str(ns.ctx),
        "--parallel",
        str(ns.concurrency),
    ]


# ---- report ---------------------------------------------------------------------------------------

ROWS = [  # key, label, unit, higher is better
    ("offline_ttft_s", "offline: time to first token", "s", False),
    ("offline_decode_tok_s", "offline: decode, one stream", "tok/s", True),
    ("http_ttft_s", "HTTP one stream: TTFT p50", "s", False),
    ("http_decode_tok_s", "HTTP one stream: decode", "tok/s", True),
    ("streams_tok_s", "HTTP streams: output", "tok/s", True),
    ("streams_ttft_p50_s", "HTTP streams: TTFT p50", "s", False),
    ("rss_idle_mib", "RSS, all processes, idle", "MiB", False),
    ("rss_loaded_mib", "RSS, all processes, after streams", "MiB", False),
    ("startup_s", "start-up to /health 200", "s", False),
]


def report(ours: Side, theirs: Side, ns: argparse.Namespace) -> str:
    a, b = ours.figures, theirs.figures
    lines = [f"{'':38s} {'minisgl':>10s} {'llama.cpp':>10s} {'ratio':>7s}"]
    for key, label, unit, _ in ROWS:
        if key in a and key in b:
            lines.append(
                f"{label + ' (' + unit + ')':38s} {a[key]:10.3f} {b[key]:10.3f} {a[key] / b[key]:7.2f}"
            )
    lines += ["", "ratio round by round (the two engines' turns in one round):"]
    for key, label, _, higher in ROWS:
        pairs = list(zip(ours.rounds.get(key, []), theirs.rounds.get(key, []), strict=False))
        if higher and len(pairs) > 1:
            ratios = sorted(x / y for x, y in pairs)
            lines.append(
                f"  {label:36s} min {ratios[0]:.2f}  median {statistics.median(ratios):.2f}  "
                f"max {ratios[-1]:.2f}  ({len(ratios)} rounds)"
            )
    rss = max(a.get("rss_idle_mib", 0), a.get("rss_loaded_mib", 0))
    rss_ll = max(b.get("rss_idle_mib", 0), b.get("rss_loaded_mib", 1))
    targets = [
        ("decode >= 1.5x llama-bench", a["offline_decode_tok_s"] / b["offline_decode_tok_s"], 1.5, True),
        ("decode >= 1.5x llama-server (HTTP)", a["http_decode_tok_s"] / b["http_decode_tok_s"], 1.5, True),
        ("TTFT ahead (offline, ratio < 1)", a["offline_ttft_s"] / b["offline_ttft_s"], 1.0, False),
        ("TTFT ahead (HTTP, ratio < 1)", a["http_ttft_s"] / b["http_ttft_s"], 1.0, False),
        (f"{ns.concurrency} streams >= 4x llama-server", a["streams_tok_s"] / b["streams_tok_s"], 4.0, True),
        ("RSS <= 1.5x llama-server (same KV capacity)", rss / rss_ll, 1.5, False),
        ("start-up <= 3 s", a["startup_s"], 3.0, False),
    ]
    lines += ["", "targets:"]
    for name, value, bound, higher in targets:
        met = value >= bound if higher else value <= bound
        lines.append(f"  {'met    ' if met else 'NOT met'}  {name:45s} {value:7.2f}")
    return "\n".join(lines)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the servers' stop()
    try:
        return run()
    finally:
        for srv in list(LIVE):
            srv.stop()


def run() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="the GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--llamacpp-bin", type=Path, default=Path(os.environ.get("LLAMACPP_BIN", DEFAULT_BIN)))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="issue 23 measured best of 8, alternated")
    ap.add_argument("--prompt-len", type=int, default=128, help="offline prompt tokens")
    ap.add_argument("--prompt-words", type=int, default=100, help="HTTP prompt words (about 128 tokens)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--one-stream-prompts", type=int, default=4)
    ap.add_argument("--streams-prompts", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=8192, help="KV capacity of both servers, tokens")
    ap.add_argument("--minisgl-args", default="", help='more `minisgl serve` flags, e.g. "--frontend-nice 0"')
    ap.add_argument("--skip", default="", help="comma list of sections to skip: offline, serve")
    ap.add_argument("--output-json", type=Path)
    ns = ap.parse_args()
    for tool in ("llama-bench", "llama-server"):
        if not (ns.llamacpp_bin / tool).is_file():
            print(
                f"bench_llamacpp: no {tool} in {ns.llamacpp_bin}: run `make llamacpp` (builds llama.cpp from the "
                "llama-cpp-python 0.3.36 sdist, ~10 minutes on 2 cores) or pass --llamacpp-bin",
                file=sys.stderr,
            )
            return 2
    if ns.gguf is None:
        from minisgl.models import embedded_gguf_path

        ns.gguf = embedded_gguf_path()
    skip = set(filter(None, ns.skip.split(",")))
    env = {**os.environ, "OMP_NUM_THREADS": str(ns.threads)}
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)
    ours, theirs = Side("minisgl"), Side("llama.cpp")
    rng = random.Random(0)
    print(
        f"{ns.gguf.name}, {ns.threads} threads, {ns.rounds} rounds, KV capacity {ns.ctx} tokens", flush=True
    )
    if "offline" not in skip:
        from minisgl import LLM

        llm = LLM(str(ns.gguf), device="cpu", num_pages=ns.ctx // 16)
        offline_minisgl(llm, rng, ns.prompt_len, ns.output_len)  # warm-up
        for r in range(ns.rounds):
            ttft, tg = offline_minisgl(llm, rng, ns.prompt_len, ns.output_len)
            ours.keep("offline_ttft_s", ttft, False)
            ours.keep("offline_decode_tok_s", tg, True)
            ttft_l, tg_l = offline_llamacpp(
                ns.llamacpp_bin, ns.gguf, ns.threads, ns.prompt_len, ns.output_len
            )
            theirs.keep("offline_ttft_s", ttft_l, False)
            theirs.keep("offline_decode_tok_s", tg_l, True)
            print(f"  offline round {r}: minisgl ttft {ttft:.3f} s decode {tg:.1f} tok/s | "
                  f"llama-bench ttft {ttft_l:.3f} s decode {tg_l:.1f} tok/s", flush=True)  # fmt: skip
        del llm
    if "serve" not in skip:
        import compileall

        import minisgl

        # warm caches: the package's bytecode (which PYTHONDONTWRITEBYTECODE would leave unwritten,
        # as `make serve` does), then a start of each server (the page cache)
        compileall.compile_dir(Path(minisgl.__file__).parent, quiet=1)
        with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
            for name, make in (("minisgl", minisgl_cmd), ("llama.cpp", llamacpp_cmd)):
                Server(make(ns, port := free_port()), port, env, Path(tmp) / f"{name}.log").stop()
            for r in range(ns.rounds):
                for side, make in ((ours, minisgl_cmd), (theirs, llamacpp_cmd)):
                    srv = Server(make(ns, port := free_port()), port, env, Path(tmp) / f"{side.name}.log")
                    try:
                        side.keep("startup_s", srv.startup_s, False)
                        serve_round(side, srv, ns, seed=100 * r)
                    finally:
                        srv.stop()
                print(f"  serve round {r}: " + ", ".join(
                    f"{s.name} {k} {s.last[k]:.2f}" for s in (ours, theirs) for k in ("http_decode_tok_s", "streams_tok_s", "rss_loaded_mib", "startup_s")
                ), flush=True)  # fmt: skip
    print()
    if ours.figures.keys() >= {k for k, *_ in ROWS} and theirs.figures.keys() >= {k for k, *_ in ROWS}:
        print(report(ours, theirs, ns))
    else:
        for side in (ours, theirs):
            print(side.name, json.dumps(side.figures, indent=1))
    if ns.output_json:
        ns.output_json.write_text(
            json.dumps({"minisgl": ours.figures, "llama.cpp": theirs.figures}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
