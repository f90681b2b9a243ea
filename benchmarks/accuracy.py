"""How close the quantized CPU path stays to the float32 reference, and llama.cpp on the same file.

Teacher forcing: 16 chat prompts, each continued by the float32 reference's 64 greedy tokens; every
engine then reads each whole sequence in one pass, and at the 64 continuation positions we compare
its next-token distribution with the reference's: how often the greedy token agrees, and the mean
KL(reference || engine). Engines: minisgl's default (the GGUF's blocks through the quantized kernels,
a float16 KV cache), once through the kernels its decode steps take (int8 activations: what
generates the tokens) and once through its prefill kernels (on a CPU with AMX, bfloat16 tiles: what
reads prompts), and llama.cpp (libllama through llama-cpp-python's ctypes
bindings, both from `make llamacpp`), on the same token ids. The reference is minisgl's
`--dtype float32` (the blocks dequantized, every op in float32; token-exact with transformers).

    python benchmarks/accuracy.py [--gguf FILE] [--llamacpp-dir .llamacpp/llama_cpp_python-0.3.36]
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LLAMACPP = ROOT / ".llamacpp" / "llama_cpp_python-0.3.36"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a ten-year-old.",
    "List three prime numbers and say why they are prime.",
    "Who wrote Hamlet, and what is it about?",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Give me a recipe for a simple tomato soup.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Cinderella in two sentences.",
    "How do I make my code run faster?",
    "Why is the sky blue?",
    "Tell me a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?",
    "Describe how a bicycle works.",
]


def sequence_logits(llm, ids: list[int], decode_kernels: bool = False) -> torch.Tensor:  # noqa: ANN001
    """minisgl's logits (n, V) float32 at every position of `ids`, read as one fresh prompt;
    `decode_kernels`: through the ops a decode step takes (the CPU backend picks its matmul kernels
    by the pass: the int8 ones of decode, or prefill's, AMX-BF16 tiles where the CPU has them)."""
    from minisgl.attention import AttnInput
    from minisgl.core import Context, set_global_ctx

    eng = llm.engine
    n, ps = len(ids), eng.page_size
    pages = torch.arange(-(-n // ps), dtype=torch.int32)[None]  # (1, P): the first pages, nothing else runs
    eng.ops.prepare(decode_kernels)
    eng.attn_backend.prepare(
        AttnInput(seq_lens=[n], extend_lens=[n], out_slots=torch.arange(n), page_rows=pages, is_decode=False)
    )
    set_global_ctx(Context(attn_backend=eng.attn_backend))
    try:
        with torch.inference_mode():
            hidden = eng.model.forward(torch.tensor(ids), torch.arange(n))
            return eng.model.compute_logits(hidden).clone()
    finally:
        set_global_ctx(None)


class LlamaCpp:
    """libllama through llama-cpp-python's low-level bindings (its package __init__ is not run: it
    wants packages minisgl does not install)."""

    def __init__(self, root: Path, gguf: Path, threads: int, n_ctx: int = 1024) -> None:
        import os

        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(root / "vendor" / "llama.cpp" / "build" / "bin"))
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [str(root / "llama_cpp")]
        sys.modules.setdefault("llama_cpp", pkg)
        import llama_cpp.llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_ctx, n_ctx
        cp.n_threads, cp.n_threads_batch = threads, threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def logits(self, ids: list[int]) -> torch.Tensor:
        """(n, V) float32 logits at every position of `ids`."""
        L, n = self.L, len(ids)
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            batch.n_tokens = n
            if L.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            out = np.empty((n, self.n_vocab), dtype=np.float32)
            for i in range(n):
                out[i] = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
            return torch.from_numpy(out)
        finally:
            L.llama_batch_free(batch)


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[int, float]:
    """(greedy agreements, summed KL(ref || got)) over the rows."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return int((ref.argmax(-1) == got.argmax(-1)).sum()), float(kl.sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="default: the embedded SmolLM2 Q4_1")
    ap.add_argument("--llamacpp-dir", type=Path, default=DEFAULT_LLAMACPP)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ns = ap.parse_args()
    from minisgl import LLM, SamplingParams
    from minisgl.models import embedded_gguf_path
    from minisgl.utils.hf import apply_chat_template

    gguf = ns.gguf or embedded_gguf_path()
    ref_llm = LLM(str(gguf), device="cpu", dtype="float32")
    prompts = [apply_chat_template(ref_llm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    outs = ref_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=ns.tokens, ignore_eos=True))
    seqs = [p + o["token_ids"] for p, o in zip(prompts, outs, strict=True)]
    spans = [slice(len(p) - 1, len(p) - 1 + ns.tokens) for p in prompts]  # rows predicting the continuation
    refs = [sequence_logits(ref_llm, s)[sp] for s, sp in zip(seqs, spans, strict=True)]
    del ref_llm
    quantized = LLM(str(gguf), device="cpu")
    engines = {
        "minisgl, decode kernels": lambda s: sequence_logits(quantized, s, decode_kernels=True),
        "minisgl, prefill kernels": lambda s: sequence_logits(quantized, s),
    }
    if (ns.llamacpp_dir / "vendor" / "llama.cpp" / "build" / "bin").is_dir():
        lc = LlamaCpp(ns.llamacpp_dir, gguf, ns.threads)
        engines["llama.cpp"] = lc.logits
    else:
        print(f"(no llama.cpp build in {ns.llamacpp_dir}: `make llamacpp` builds it)")
    total = len(PROMPTS) * ns.tokens
    print(
        f"{gguf.name}: {len(PROMPTS)} prompts x {ns.tokens} teacher-forced tokens, against minisgl --dtype float32"
    )
    for name, fn in engines.items():
        agree, kl = 0, 0.0
        for s, sp, ref in zip(seqs, spans, refs, strict=True):
            a, k = compare(ref, fn(s)[sp])
            agree, kl = agree + a, kl + k
        print(
            f"  {name:30s} greedy agreement {agree / total:6.1%} ({agree}/{total})  mean KL {kl / total:.5f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
