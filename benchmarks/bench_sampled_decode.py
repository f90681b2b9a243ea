"""Decode tok/s at batch 1, greedy against sampled, on a preset's shapes with random weights: the
host's share of a step shows on a small model, so a host that waits for the device (a blocking
copy in the sampler) shows as a sampled rate far under the greedy one.

    python benchmarks/bench_sampled_decode.py [--model-config smollm2-135m] [--device cuda] [--tokens 256]

Prints the best of --repeats generations of each: greedy; temperature 0.8 with top-p 0.9; temperature
0.8 with a repetition penalty of 1.1.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from minisgl import LLM, SamplingParams
from minisgl.benchmark.presets import preset_config, write_model_dir


def best_rate(llm: LLM, params: SamplingParams, repeats: int, rng: random.Random) -> float:
    """The best decode tok/s of `repeats` fresh 128-token prompts (from the engine's step stats)."""
    out = []
    for _ in range(repeats):
        prompt = [rng.randrange(300, llm.vocab_size - 100) for _ in range(128)]
        st = llm.engine.stats
        d0, n0 = st.decode_s, st.decode_tokens
        llm.generate([prompt], params)
        out.append((st.decode_tokens - n0) / (st.decode_s - d0))
    return max(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="", help="a name for this tree in the printed line")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(preset_config(ns.model_config), Path(tmp) / "model")
        llm = LLM(str(model), device=ns.device, dummy_weights=True)
        rng = random.Random(0)
        kinds = {
            "greedy": SamplingParams(max_tokens=ns.tokens, ignore_eos=True, temperature=0),
            "T 0.8, top-p 0.9": SamplingParams(
                max_tokens=ns.tokens, ignore_eos=True, temperature=0.8, top_p=0.9
            ),
            "T 0.8, repetition penalty 1.1": SamplingParams(
                max_tokens=ns.tokens, ignore_eos=True, temperature=0.8, repetition_penalty=1.1
            ),
        }
        rates = {k: best_rate(llm, p, ns.repeats, rng) for k, p in kinds.items()}
    print(
        f"{ns.label or ns.model_config}: batch 1 decode tok/s "
        + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()),
        flush=True,
    )


if __name__ == "__main__":
    main()
