"""What structured output costs: decode throughput of one batch with and without a JSON schema, in
the same process, runs alternated (the machine may be shared), best of --rounds each.

The offline `LLM` (the embedded model unless --model) decodes --batch prompts x --max-tokens tokens
with ignore_eos; with the schema, every row keeps to a JSON array of at least 10,000 integers, so
no row ends before --max-tokens and both runs decode the same number of steps. Decode throughput is
the engine's decode tokens over its decode time (prefill left out).

    .venv/bin/python benchmarks/bench_structured.py [--batch 16] [--max-tokens 64] [--rounds 3]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import minisgl
from minisgl import SamplingParams
from minisgl.grammar import json_schema_grammar

SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 10000}


def decode_rate(llm: minisgl.LLM, prompts: list[str], params: SamplingParams) -> tuple[float, float]:
    """(decode tokens per second, ms per decode step) of one generate() call."""
    before = dataclasses.replace(llm.engine.stats)
    outs = llm.generate(prompts, params)
    after = llm.engine.stats
    if params.grammar is not None:
        for o in outs:  # the grammar held: a prefix of a JSON array of integers
            assert o["text"].lstrip().startswith("["), o["text"][:40]
    tokens = after.decode_tokens - before.decode_tokens
    seconds = after.decode_s - before.decode_s
    steps = after.decode_batches - before.decode_batches
    return tokens / seconds, 1000 * seconds / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    llm = minisgl.LLM(ns.model, device=ns.device, cache_type="naive")
    prompts = [f"List {i + 3} numbers as a JSON array:" for i in range(ns.batch)]
    plain = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=True)
    held = dataclasses.replace(plain, grammar=json_schema_grammar(SCHEMA))
    llm.generate(prompts[:2], dataclasses.replace(held, max_tokens=4))  # warm-up (loads the tokenizer)
    best: dict[str, tuple[float, float]] = {"plain": (0.0, 0.0), "schema": (0.0, 0.0)}
    for r in range(ns.rounds):
        for name, params in (("plain", plain), ("schema", held)):
            rate, step_ms = decode_rate(llm, prompts, params)
            print(f"round {r + 1} {name:6s}: {rate:8.1f} decode tok/s, {step_ms:6.1f} ms/step", flush=True)
            best[name] = max(best[name], (rate, step_ms))
    ratio = best["schema"][0] / best["plain"][0]
    summary = {
        "batch": ns.batch,
        "max_tokens": ns.max_tokens,
        "plain_tok_s": round(best["plain"][0], 1),
        "schema_tok_s": round(best["schema"][0], 1),
        "schema_over_plain": round(ratio, 3),
        "cost_pct": round(100 * (1 - ratio), 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
