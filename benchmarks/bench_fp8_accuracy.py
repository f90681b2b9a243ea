"""fp8 against bf16 by teacher forcing: the same random weights of a preset's shapes in several
engines fed the same tokens, bf16 the reference; at every position, whether each engine's greedy
token equals bf16's and the KL divergence of its next-token distribution from bf16's.

Engines (`--compare`): fp8 weights + fp8 KV (`--quantization fp8 --kv-cache-dtype fp8_e4m3`), fp8
weights alone (`fp8w`), fp8 weights and the LM head (`fp8h`, `--quantization fp8_lm_head`), fp8 KV alone, and float32 with bf16's exact weights: the control, bf16's own rounding
measured the same way. Each prompt is `--prompt-len` random token ids, prefilled in groups (W8A8
matmuls, the extend attention kernel), then `--decode-len` decode steps of all prompts together
feeding bf16's greedy token (at more than 16 rows the W8A8 matmuls, else the W8A16 GEMV; the decode
attention kernel). Positions are counted per path and together.

Random weights make the figures hard to read, and the bench prints what they depend on:
- the logits over the vocabulary are near-Gaussian with a spread of about 1.3 (LM head N(0, 0.02)):
  flat (entropy near log V), so the KL is tiny and the top two tokens close (a trained model's top
  token usually leads by several nats). Scaling the LM head by S scales every engine's logits by S
  (the head stays bf16): greedy agreement does not move, the KL grows about as S^2; the table gives
  both for S = 1 .. 16 with bf16's mean entropy and top-1 probability, so the KL can be read at a
  trained model's spread (about 2-3 nats of entropy on text), and the agreement by bf16's margin
  (top-1 minus top-2 logit, in units of the logits' spread) shows how it depends on how decided bf16 is;
- N(0, 0.02) projections at 8B's widths amplify a perturbation through the depth (each matmul's gain
  is about 0.02 sqrt(K) > 1): the float32 control shows how much of the difference any rounding
  makes. `--weight-scales 1,0.5,...` multiplies every projection in every engine (fp8: its scales,
  which is the same) and repeats the comparison at each scale.

A trained checkpoint instead (`--model`: a Hugging Face directory, or a GGUF file whose tensors are
dequantized into one first, e.g. the embedded SmolLM2-135M): its own weights, where these caveats do
not apply; `--prompt-source chat` then takes 64 chat prompts (16 questions in 4 framings, the model's
chat template, lengths as they come) instead of random token ids.

    python benchmarks/bench_fp8_accuracy.py --model-config llama3-8b [--compare fp8,fp32] [--weight-scales 1,0.5]
    python benchmarks/bench_fp8_accuracy.py --model SmolLM2-135M-Instruct.Q4_1.gguf --prompt-source chat,random
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accuracy import PROMPTS  # this directory's (a script's sys.path[0])

from minisgl import LLM, SamplingParams
from minisgl.benchmark.presets import preset_config, write_model_dir
from minisgl.core import Batch, Req
from minisgl.layers import Linear

SCALES = (1.0, 2.0, 4.0, 8.0, 16.0)
MARGINS = (0.0, 0.05, 0.1, 0.2, 0.4)  # margin buckets' lower ends, in units of the logits' std


@dataclass
class Stats:
    """Running sums over compared positions."""

    n: int = 0
    agree: int = 0
    kl: dict[float, float] = field(default_factory=lambda: dict.fromkeys(SCALES, 0.0))
    entropy: dict[float, float] = field(default_factory=lambda: dict.fromkeys(SCALES, 0.0))
    top1: dict[float, float] = field(default_factory=lambda: dict.fromkeys(SCALES, 0.0))
    err2: float = 0.0  # sum of squared logit errors / squared centred logits, per position
    bucket_n: list[int] = field(default_factory=lambda: [0] * len(MARGINS))
    bucket_agree: list[int] = field(default_factory=lambda: [0] * len(MARGINS))

    def add(self, ref: torch.Tensor, got: torch.Tensor) -> None:
        """ref/got (P, V) float32 logits of the same positions."""
        agree = ref.argmax(-1) == got.argmax(-1)
        self.n += ref.shape[0]
        self.agree += int(agree.sum())
        centred = ref - ref.mean(-1, keepdim=True)
        self.err2 += float(((got - ref).pow(2).sum(-1) / centred.pow(2).sum(-1)).sum())
        std = centred.pow(2).mean(-1).sqrt()
        top2 = ref.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]) / std
        for i, lo in enumerate(MARGINS):
            hi = MARGINS[i + 1] if i + 1 < len(MARGINS) else float("inf")
            sel = (margin >= lo) & (margin < hi)
            self.bucket_n[i] += int(sel.sum())
            self.bucket_agree[i] += int((agree & sel).sum())
        for s in SCALES:
            lp, lq = (ref * s).log_softmax(-1), (got * s).log_softmax(-1)
            p = lp.exp()
            self.kl[s] += float((p * (lp - lq)).sum(-1).sum())
            self.entropy[s] += float(-(p * lp).sum(-1).sum())
            self.top1[s] += float(p.max(-1).values.sum())

    def merged(self, other: Stats) -> Stats:
        out = Stats(self.n + other.n, self.agree + other.agree)
        for s in SCALES:
            out.kl[s] = self.kl[s] + other.kl[s]
            out.entropy[s] = self.entropy[s] + other.entropy[s]
            out.top1[s] = self.top1[s] + other.top1[s]
        out.err2 = self.err2 + other.err2
        out.bucket_n = [a + b for a, b in zip(self.bucket_n, other.bucket_n, strict=True)]
        out.bucket_agree = [a + b for a, b in zip(self.bucket_agree, other.bucket_agree, strict=True)]
        return out

    def report(self, label: str) -> None:
        print(
            f"{label:8}: {self.n} positions, greedy token equal at {100 * self.agree / self.n:.2f}%, "
            f"mean KL {self.kl[1.0] / self.n:.5f} (LM head as drawn), logit error "
            f"{(self.err2 / self.n) ** 0.5:.4f} of the logits' spread (RMS)"
        )
        for s in SCALES:
            print(
                f"          LM head x{s:g}: bf16 entropy {self.entropy[s] / self.n:6.3f} nats, top-1 p "
                f"{self.top1[s] / self.n:.3f}; mean KL {self.kl[s] / self.n:.5f}"
            )
        cells = []
        for i, lo in enumerate(MARGINS):
            hi = f"{MARGINS[i + 1]:g}" if i + 1 < len(MARGINS) else "inf"
            n = self.bucket_n[i]
            cells.append(f"[{lo:g},{hi}): {100 * self.bucket_agree[i] / max(1, n):.1f}% of {n}")
        print("          agreement by bf16's top-1 margin (std units): " + "; ".join(cells))


def _reqs(llm: LLM, prompts: list[list[int]], total: int) -> list[Req]:
    table = llm.engine.page_table
    reqs = []
    for i, p in enumerate(prompts):
        r = Req(uid=10_000 + i, token_ids=list(p), sampling_params=SamplingParams(max_tokens=total))
        r.table_row = table.alloc_row(r.uid)
        assert table.reserve(r.table_row, total)
        reqs.append(r)
    return reqs


def teacher_force(
    ref: LLM, others: dict[str, LLM], prompts: list[list[int]], decode_len: int, group: int
) -> dict[str, tuple[Stats, Stats]]:
    """(prefill, decode) stats of each of `others` against `ref`, all fed the same tokens: the
    prompts, then `decode_len` steps of ref's greedy tokens."""
    total = max(map(len, prompts)) + decode_len + 1
    engines = [ref, *others.values()]
    rows = [_reqs(llm, prompts, total) for llm in engines]
    stats = {name: (Stats(), Stats()) for name in others}
    last = torch.empty(len(prompts), dtype=torch.int64)
    for g in range(0, len(prompts), group):
        logits = []
        for llm, reqs in zip(engines, rows, strict=True):
            part = reqs[g : g + group]
            lens = [len(r.token_ids) for r in part]
            logits.append(llm.engine.forward_logits(Batch(part, lens, "prefill")))
            for r, n in zip(part, lens, strict=True):
                r.cached_len = n
        for name, got in zip(others, logits[1:], strict=True):
            stats[name][0].add(logits[0], got.to(logits[0].device))
        ends = torch.tensor(lens, device=logits[0].device).cumsum(0) - 1
        last[g : g + len(part)] = logits[0][ends].argmax(-1).cpu()
        del logits
    for _ in range(decode_len):
        logits = []
        for llm, reqs in zip(engines, rows, strict=True):
            for r, t in zip(reqs, last.tolist(), strict=True):
                r.token_ids.append(t)
            logits.append(llm.engine.forward_logits(Batch(reqs, [1] * len(reqs), "decode")))
            for r in reqs:
                r.cached_len += 1
        for name, got in zip(others, logits[1:], strict=True):
            stats[name][1].add(logits[0], got)
        last = logits[0].argmax(-1).cpu()
    for llm, reqs in zip(engines, rows, strict=True):
        for r in reqs:
            llm.engine.page_table.free_row(r.table_row)
    return stats


@torch.no_grad()
def scale_projections(llm: LLM, factor: float) -> None:
    """Every projection of the decoder layers times `factor` (an fp8 one: its scales, the same)."""
    for module in llm.engine.model.modules():
        if isinstance(module, Linear):
            (module.weight if module.fp8 is None else module.weight_scale).mul_(factor)


@torch.no_grad()
def copy_weights(src: LLM, dst: LLM) -> None:
    """dst's parameters := src's (e.g. a float32 engine given the bf16 engine's exact values)."""
    theirs = dict(src.engine.model.named_parameters())
    for name, p in dst.engine.model.named_parameters():
        p.copy_(theirs[name])


# `--prompt-source chat`'s 64 prompts for a trained model: accuracy.py's 16 questions in 4 framings
FRAMINGS = ["{q}", "Answer briefly: {q}", "Explain step by step. {q}", "{q} Please give details."]


def gguf_as_hf_dir(gguf: Path, out: Path) -> Path:
    """A Hugging Face directory of the GGUF file's model: its derived config and tokenizer, and its
    tensors dequantized to float32 in model.safetensors (what every engine below loads, fp8 too)."""
    from safetensors.torch import save_file

    from minisgl.checkpoint.gguf_convert import convert_gguf
    from minisgl.checkpoint.gguf_weights import hf_state_dict

    out.mkdir(parents=True)
    convert_gguf(gguf, out)
    config = json.loads((out / "config.json").read_text())
    state = hf_state_dict(out, config)
    (out / "model.gguf").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def make_prompts(ns: argparse.Namespace, source: str, model_dir: Path, vocab: int) -> list[list[int]]:
    """`ns.prompts` prompts: random token ids (`ns.prompt_len` each), or chat prompts through the
    model's chat template (a trained model's; lengths as they come)."""
    rng = random.Random(ns.seed)
    if source == "random":
        return [[rng.randrange(300, vocab) for _ in range(ns.prompt_len)] for _ in range(ns.prompts)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [f.format(q=q) for f in FRAMINGS for q in PROMPTS][: ns.prompts]
    chats = [[{"role": "user", "content": t}] for t in texts]
    rendered = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tok(r, add_special_tokens=False)["input_ids"] for r in rendered]


def run(ns: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if ns.model:
            path = Path(ns.model)
            model_dir = gguf_as_hf_dir(path, Path(tmp) / "m") if path.suffix == ".gguf" else path
            cfg = json.loads((model_dir / "config.json").read_text())
            what = f"{path.name} (its trained weights)"
        else:
            cfg = preset_config(ns.model_config)
            model_dir = write_model_dir(cfg, Path(tmp) / "m")
            what = f"{ns.model_config} random weights (projections N(0, 0.02) x the scale below)"
        vocab = int(cfg["vocab_size"])
        sources = ns.prompt_source.split(",")
        prompt_sets = {src: make_prompts(ns, src, model_dir, vocab) for src in sources}
        longest = max(len(p) for ps in prompt_sets.values() for p in ps)
        pages = (
            ns.prompts * (-(-(longest + ns.decode_len + 1) // 16)) + 16
        )  # every engine's pool holds them all
        common = dict(device=ns.device, dummy_weights=not ns.model, num_pages=pages, page_size=16,
                      cuda_graph_max_bs=0, max_running_requests=max(256, ns.prompts))  # fmt: skip

        ref = LLM(str(model_dir), **common)
        kinds = {
            "fp8": ("fp8 weights (per channel, activations per token) + fp8 KV", dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")),
            "fp8w": ("fp8 weights, bf16 KV", dict(quantization="fp8")),
            "fp8h": ("fp8 weights and LM head (per vocab row), bf16 KV", dict(quantization="fp8_lm_head")),
            "kv": ("bf16 weights + fp8 KV", dict(kv_cache_dtype="fp8_e4m3")),
            "fp32": ("float32 (the same weights; the control: bf16's own rounding against it)", dict(dtype="float32")),
        }  # fmt: skip
        others = {}
        for key in ns.compare.split(","):
            label, extra = kinds[key]
            others[label] = LLM(str(model_dir), **common, **extra)
            if key == "fp32":
                copy_weights(ref, others[label])
        for src, prompts in prompt_sets.items():
            lens = sorted(map(len, prompts))
            print(
                f"{what}, {len(prompts)} {src} prompts ({lens[0]}-{lens[-1]} tokens) + {ns.decode_len} decode "
                f"steps feeding bf16's greedy tokens; each engine against bf16"
            )
            applied = 1.0
            for f in (float(v) for v in ns.weight_scales.split(",")):
                for llm in (ref, *others.values()):
                    scale_projections(llm, f / applied)
                applied = f
                results = teacher_force(ref, others, prompts, ns.decode_len, ns.prefill_batch)
                for label, (prefill, decode) in results.items():
                    print(f"==== {src} prompts, projection weights x{f:g}: {label}")
                    prefill.report("prefill")
                    decode.report(f"decode ({len(prompts)} rows)")
                    prefill.merged(decode).report("all")
            for llm in (ref, *others.values()):
                scale_projections(llm, 1.0 / applied)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="llama3-8b", help="a preset's shapes, random weights")
    ap.add_argument("--model", help="a trained checkpoint instead: a Hugging Face directory or a GGUF file")
    ap.add_argument(
        "--prompt-source",
        default="random",
        help="random (token ids), chat (a trained model's template), or both",
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--prefill-batch", type=int, default=8, help="prompts per prefill pass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--compare", default="fp8,fp32", help="engines against bf16: fp8 (weights + KV), fp8w, kv, fp32"
    )
    ap.add_argument("--weight-scales", default="1", help="projection weights x each of these, in turn")
    ap.add_argument("--device", default="cuda", help="cuda (bf16 reference); cpu runs float32 (a smoke test)")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
