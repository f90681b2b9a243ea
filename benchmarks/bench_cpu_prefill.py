"""Offline prefill on the CPU: the time of one fresh prompt of each length through `LLM` (one output
token, so the step is the prefill), each length run --repeats times; prints every time and the best.
Run it with PYTHONPATH pointing at another checkout's src/ for the other side of an A/B.

    python benchmarks/bench_cpu_prefill.py [--model PATH] [--lens 64,128,256] [--repeats 4]
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--lens", default="64,100,128,200,256")
    ap.add_argument("--repeats", type=int, default=4)
    ns = ap.parse_args()
    from minisgl import LLM
    from minisgl.core import SamplingParams

    llm = LLM(ns.model, device="cpu", num_pages=512)
    rng = random.Random(0)
    once = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    llm.generate([[rng.randrange(300, 40000) for _ in range(32)]], once)  # warm-up
    for n in (int(x) for x in ns.lens.split(",")):
        times = []
        for _ in range(ns.repeats):  # a fresh prompt each time: no prefix-cache hit
            prompt = [rng.randrange(300, llm.vocab_size - 100) for _ in range(n)]
            t = time.perf_counter()
            llm.generate([prompt], once)
            times.append(time.perf_counter() - t)
        shown = " ".join(f"{x * 1e3:.0f}" for x in times)
        print(
            f"prefill {n:5d} tokens: {shown} ms; best {min(times) * 1e3:.1f} ms = {n / min(times):.0f} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
