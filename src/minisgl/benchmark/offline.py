"""Offline throughput: minisgl's LLM vs transformers' batched `generate` on the same workload, same run.

N prompts of random lengths (uniform in [min, max], seeded) of random token ids, greedy, exactly
`output_len` new tokens each (EOS neither stops nor is banned: minisgl's ignore_eos, transformers
without an eos_token_id); transformers gets the batch left-padded in one `generate` call. Both engines
run alternately `repeats` times and each keeps its best run (on a shared machine other processes only
ever add time). Prints output tokens/s of both, the ratio, and
minisgl's prefill and decode phases (time, achieved matmul rate, weight bandwidth); on a GPU also the
decode step's bandwidth floor (weights + KV read per step over a device copy's bandwidth measured in
the same run) and the fraction of it reached.

    minisgl bench offline [--num-prompts 16] [--output-len 64] [--repeats 3]          (CPU, embedded model)
    minisgl bench offline --device cpu --dtype float32                      (the float32 reference path)
    minisgl bench offline --device cuda --model-config llama3-8b --batch-sizes 1,8 \\
        --min-input-len 256 --max-input-len 256 --output-len 256                     (random weights)

`--model-config` takes a preset (`minisgl.benchmark.presets`: llama3-8b, llama3-70b, smollm2-135m, qwen3-30b-a3b, mixtral-8x7b)
or a config.json: the model gets random weights, and transformers the same ones. `run_offline_bench(...)
-> dict` is the function form.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from minisgl.engine import Engine
from minisgl.engine.options import resolve_dtype

from .offline_args import add_arguments
from .weights_read import WeightCounts

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from minisgl.llm import LLM

__all__ = ["add_arguments", "main", "run_offline_bench"]


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    # Ordinary token ids (skip the first few hundred: special and control tokens live there).
    return [[rng.randrange(300, vocab) for _ in range(n)] for n in lens]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def output_lengths(num_prompts: int, min_len: int, max_len: int, seed: int) -> list[int]:
    """Per-prompt output lengths, uniform in [min_len, max_len] (seeded apart from the prompts)."""
    rng = random.Random(seed + 7919)
    return [rng.randint(min_len, max_len) for _ in range(num_prompts)]


def _time_minisgl(
    llm: LLM, prompts: list[list[int]], output_lens: list[int]
) -> tuple[float, float, list[list[int]], dict[str, float]]:
    """Wall-clock and CPU seconds (all threads of this process) of one run, the tokens, and the
    engine's per-phase counters for this run (empty when the engine keeps none)."""
    from minisgl.core import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    cache = getattr(llm, "cache", None)  # None with tp > 1: those ranks run without a prefix cache
    if cache is not None:
        cache.flush()  # every repeat starts cold: the prefix cache would skip the prompts' prefill
    stats = getattr(getattr(llm, "engine", None), "stats", None)
    before = dataclasses.asdict(stats) if stats is not None else {}
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert [len(o["token_ids"]) for o in outs] == output_lens
    phases = {k: v - before[k] for k, v in dataclasses.asdict(stats).items()} if stats is not None else {}
    return dt, cpu, [o["token_ids"] for o in outs], phases


def _time_hf(
    hf: PreTrainedModel, prompts: list[list[int]], output_len: int, pad_id: int, device: str
) -> tuple[float, float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    from transformers import GenerationMixin

    if not isinstance(hf, GenerationMixin):  # (every *ForCausalLM is one)
        raise TypeError(f"{type(hf).__name__} cannot generate")
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_len,
            eos_token_id=None,  # as minisgl's ignore_eos: EOS neither stops nor is banned (min_new_tokens bans it)
            pad_token_id=pad_id,
        )
    _sync(device)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, cpu, out[:, width:].tolist()


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read + written), median of 10 after warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / sorted(times)[len(times) // 2]


@dataclasses.dataclass
class _Models:
    llm: LLM
    hf: PreTrainedModel | None
    pad_id: int
    model_dir: Path
    label: str


def _load(
    model: str | None, model_config: str | None, device: str, dtype: torch.dtype | str, skip_hf: bool, tmp: Path,
    **llm_options: Any,
) -> _Models:  # fmt: skip
    """minisgl's LLM and (unless skipped) transformers' model, with the same weights."""
    from minisgl import LLM
    from minisgl.models import ModelConfig, resolve_model_path

    from .presets import preset_config, write_model_dir

    if model_config is not None:
        model_dir, label = (
            write_model_dir(preset_config(model_config), tmp / "model"),
            f"{model_config} (random weights)",
        )
    else:
        model_dir = resolve_model_path(model)
        label = str(model or "the embedded model")
    hf = None
    if not skip_hf:  # first: minisgl sizes its KV pool from the device memory left
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_dtype = getattr(
            torch, resolve_dtype("float32" if dtype == "auto" else dtype, device)
        )  # (auto: the quantized CPU path)
        if model_config is not None:
            with torch.device(device):
                hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=hf_dtype)
        else:
            from minisgl.models.reference import transformers_model

            hf = transformers_model(model_dir, hf_dtype).to(device)
        hf.eval()
    llm = LLM(
        str(model_dir), device=device, dtype=dtype, dummy_weights=model_config is not None, **llm_options
    )
    if hf is not None and model_config is not None:
        _fill_hf_like_dummy(hf, ModelConfig.from_dir(model_dir).family)
    pad = llm.tokenizer.pad_token_id
    return _Models(llm, hf, pad if pad is not None else 0, model_dir, label)


@torch.no_grad()
def _fill_hf_like_dummy(hf: PreTrainedModel, family: str) -> None:
    """Give transformers' model the random weights minisgl draws for the same checkpoint names
    (`dummy_tensor`), whatever minisgl's tensor-parallel size."""
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    for name, p in hf.state_dict().items():
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        p.copy_(_hf_dummy(name, p, family))


# transformers >= 5 keeps a layer's experts fused (E, 2I, H) / (E, H, I) under `mlp.`, where a
# checkpoint has one tensor per expert (Mixtral's under `block_sparse_moe.`)
_FUSED_EXPERTS = re.compile(
    r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)"
)


def _hf_dummy(name: str, p: torch.Tensor, family: str) -> torch.Tensor:
    """minisgl's random value of transformers' parameter `name`, from the checkpoint tensors it holds."""
    from minisgl.checkpoint.weights import EXPERT_NAMES
    from minisgl.models.loader import dummy_tensor

    def make(ckpt: str, shape: tuple[int, ...]) -> torch.Tensor:
        return dummy_tensor(ckpt, shape, p.dtype, p.device)

    m = _FUSED_EXPERTS.fullmatch(name)
    if m is None or family not in EXPERT_NAMES:
        return make(name, tuple(p.shape))
    names = EXPERT_NAMES[family]
    block = f"model.layers.{m.group(1)}.{names.block}."
    if m.group(2) == "gate.weight":
        return make(block + "gate.weight", tuple(p.shape))
    e, rows, cols = p.shape
    if m.group(2) == "experts.down_proj":
        return torch.stack([make(f"{block}experts.{i}.{names.down}.weight", (rows, cols)) for i in range(e)])
    parts = [
        (f"{block}experts.{i}.{names.gate}.weight", f"{block}experts.{i}.{names.up}.weight") for i in range(e)
    ]
    return torch.stack(
        [torch.cat([make(g, (rows // 2, cols)), make(u, (rows // 2, cols))]) for g, u in parts]
    )


def _bench_one(
    ms: _Models, prompts: list[list[int]], output_lens: list[int], repeats: int, device: str
) -> dict[str, Any]:
    """Alternate the engines `repeats` times on `prompts`; keep each one's best run. transformers
    runs only when every prompt has the same output length (one `generate` call)."""
    hf = ms.hf if len(set(output_lens)) == 1 else None
    output_len = output_lens[0]
    warm = [prompts[0][:8]]
    _time_minisgl(ms.llm, warm, [2])  # warm-up: first-call allocations of both engines
    if device == "cuda" and len(prompts) > 1:
        # Triton specializes kernels on their integer arguments (== 1, multiples of 16), so the
        # prefill batches of a run compile variants the short warm-up above never saw: every prompt
        # through prefill and one decode step first, untimed. (A first run of the 256-prompt workload
        # spent about 3 s of its prefill compiling; with 8 prompts warmed up, about 2 s.)
        _time_minisgl(ms.llm, prompts, [2] * len(prompts))
    if hf is not None:
        _time_hf(hf, warm, 2, ms.pad_id, device)
    best_m = best_h = cpu_m = cpu_h = float("inf")
    toks_m: list[list[int]] = []
    toks_h: list[list[int]] = []
    phases: dict[str, float] = {}
    for _ in tqdm(range(repeats), desc=f"bench offline, {len(prompts)} prompts (minisgl, transformers)"):
        dt, cpu, toks_m, ph = _time_minisgl(ms.llm, prompts, output_lens)
        if dt < best_m:
            phases = ph
        best_m, cpu_m = min(best_m, dt), min(cpu_m, cpu)
        if hf is not None:
            dt, cpu, toks_h = _time_hf(hf, prompts, output_len, ms.pad_id, device)
            best_h, cpu_h = min(best_h, dt), min(cpu_h, cpu)
    total = sum(output_lens)
    res: dict[str, Any] = {
        "num_prompts": len(prompts),
        "prompt_lens": [len(p) for p in prompts],
        "output_lens": output_lens,
        "minisgl_s": best_m,
        "minisgl_cpu_s": cpu_m,
        "minisgl_tok_s": total / best_m,
    }
    engine = getattr(ms.llm, "engine", None)
    if phases and isinstance(engine, Engine) and hasattr(engine.model, "lm_head"):
        res["phases"] = dict(phases, weights=WeightCounts.of(engine.model))
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


def matmul_rate(device: str, n: int = 8192) -> float:
    """bf16 FLOP/s of an n x n x n matmul on random data, median of 10 after warm-up."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def _roofline(ms: _Models, res: dict[str, Any], bandwidth: float, flops: float) -> dict[str, float]:
    """The workload's floor: every decode step reads the weights once (a mixture of experts: the
    experts its tokens are expected to reach, `weights_read`) plus the KV of the requests still
    running (all admitted at once), over the measured copy bandwidth; prefill does its matmul FLOPs
    at the measured matmul rate. Also the mean decode step's floor against the measured one."""
    engine = ms.llm.engine
    if not isinstance(engine, Engine):
        raise TypeError("the roofline needs a model's engine, not the dummy one")
    w = WeightCounts.of(engine.model)
    kv_per_token = sum(k.shape[1] * k.shape[2] * k.element_size() * 2 for k in engine.pool.k)
    ins, outs = res["prompt_lens"], res["output_lens"]
    decode_s = 0.0
    for t in range(1, max(outs)):  # step t feeds each running request's t-th output token
        running = [n for n, o in zip(ins, outs, strict=True) if o > t]
        decode_s += (w.read_bytes(len(running)) + sum(n + t for n in running) * kv_per_token) / bandwidth
    prefill_s = (2 * w.active() * sum(ins) + 2 * w.head * len(ins)) / flops
    ph = res.get("phases", {})
    steps = ph.get("decode_batches", 0)
    step_s = ph["decode_s"] / steps if steps else float("nan")
    floor_step = decode_s / max(1, max(outs) - 1)
    return {
        "weight_bytes": w.read_bytes(len(ins)),
        "experts_read": w.experts_read(len(ins)),
        "num_experts": w.num_experts,
        "floor_ms": floor_step * 1e3,
        "step_ms": step_s * 1e3,
        "fraction": floor_step / step_s,
        "workload_floor_s": decode_s + prefill_s,
        "workload_tok_s": sum(outs) / (decode_s + prefill_s),
    }


def run_offline_bench(
    num_prompts: int = 16,
    output_len: int = 64,
    min_input_len: int = 16,
    max_input_len: int = 256,
    model: str | None = None,
    repeats: int = 3,
    seed: int = 0,
    threads: int | None = None,
    skip_hf: bool = False,
    device: str = "auto",
    model_config: str | None = None,
    batch_sizes: list[int] | None = None,
    max_output_len: int | None = None,
    dtype: str = "auto",
    **llm_options: Any,
) -> dict[str, Any]:
    """Run both engines `repeats` times on one seeded workload per batch size (default: one of
    `num_prompts`); report the best time of each."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if threads:
        torch.set_num_threads(threads)
    if dtype == "auto" and device != "cpu":
        dtype = "bfloat16"
    dtype = dtype if dtype == "auto" else getattr(torch, dtype)  # auto on the CPU: weights as stored
    with tempfile.TemporaryDirectory(prefix="msgl-bench-") as tmp:
        ms = _load(model, model_config, device, dtype, skip_hf, Path(tmp), **llm_options)
        cuda = device.startswith("cuda")
        rates = (copy_bandwidth(device), matmul_rate(device)) if cuda else None  # bytes/s, flop/s
        runs = []
        for n in batch_sizes or [num_prompts]:
            prompts = make_workload(n, min_input_len, max_input_len, ms.llm.vocab_size, seed)
            out_lens = output_lengths(n, output_len, max_output_len or output_len, seed)
            res = _bench_one(ms, prompts, out_lens, repeats, device)
            if rates is not None and "phases" in res:
                res["roofline"] = _roofline(ms, res, *rates)
            runs.append(res)
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
        "dtype": "auto (weights as stored, float32 activations)"
        if dtype == "auto"
        else str(dtype).removeprefix("torch."),
        "model": ms.label,
        "output_len_range": (output_len, max_output_len or output_len),
        "input_len_range": (min_input_len, max_input_len),
        "threads": torch.get_num_threads(),
        "copy_bandwidth": rates[0] if rates else None,
        "matmul_rate": rates[1] if rates else None,
        "overlap": getattr(ms.llm, "overlap", None),
        "tp": llm_options.get("tp", 1),
        "quantization": llm_options.get("quantization"),
        "kv_cache_dtype": llm_options.get("kv_cache_dtype", "auto"),
        "runs": runs,
    }


def print_report(res: dict[str, Any]) -> None:
    print(
        f"machine: {res['device_name'] or platform.machine()} ({res['device']}), torch threads {res['threads']}"
    )
    if res["copy_bandwidth"]:
        overlap = {True: "on", False: "off", None: "as the ranks choose"}[res["overlap"]]
        print(
            f"measured here: device copy {res['copy_bandwidth'] / 1e12:.2f} TB/s (read + write), "
            f"bf16 matmul {res['matmul_rate'] / 1e12:.0f} TFLOP/s; overlap scheduling {overlap}"
        )
    lo, hi = res["input_len_range"]
    olo, ohi = res["output_len_range"]
    outs = f"{olo}" if olo == ohi else f"uniform random in [{olo}, {ohi}]"
    tp = f", tensor-parallel over {res['tp']} ranks" if res["tp"] > 1 else ""
    if res.get("quantization"):
        tp += f", minisgl's weights {res['quantization']} (transformers keeps {res['dtype']})"
    if res.get("kv_cache_dtype", "auto") != "auto":
        tp += f", minisgl's KV cache {res['kv_cache_dtype']}"
    print(
        f"model: {res['model']}, {res['dtype']}{tp}; input lengths uniform random in [{lo}, {hi}], output "
        f"lengths {outs} (greedy, ignore EOS); transformers (equal output lengths only): the same "
        "prompts left-padded in one generate call"
    )
    for run in res["runs"]:
        lens = run["prompt_lens"]
        print(
            f"--- {run['num_prompts']} prompts (input lengths min {min(lens)} / mean "
            f"{sum(lens) / len(lens):.0f} / max {max(lens)})"
        )
        print(
            f"minisgl      : {run['minisgl_tok_s']:9.1f} output tok/s  "
            f"({run['minisgl_s']:.2f} s wall, {run['minisgl_cpu_s']:.2f} s CPU)"
        )
        if "phases" in run:
            print_phases(run["phases"], run["num_prompts"])
        if "roofline" in run:
            r = run["roofline"]
            experts = (
                f", {r['experts_read']:.1f} of {r['num_experts']} experts per layer"
                if r["num_experts"]
                else ""
            )
            print(
                f"  roofline   : decode step floor {r['floor_ms']:.2f} ms ({r['weight_bytes'] / 1e9:.2f} GB of "
                f"weights{experts} at the first step + KV), measured {r['step_ms']:.2f} ms: {100 * r['fraction']:.0f}% of the roofline; "
                f"whole workload floor {r['workload_floor_s']:.2f} s = {r['workload_tok_s']:.0f} output tok/s, "
                f"reached {100 * run['minisgl_tok_s'] / r['workload_tok_s']:.0f}%"
            )
        if "hf_tok_s" in run:
            print(
                f"transformers : {run['hf_tok_s']:9.1f} output tok/s  ({run['hf_s']:.2f} s wall, "
                f"{run['hf_cpu_s']:.2f} s CPU)"
            )
            cpu = (
                f"; {run['cpu_ratio']:.2f}x in CPU time"
                if res["tp"] == 1
                else " (ranks' CPU time not counted)"
            )
            print(f"ratio        : {run['ratio']:.2f}x wall-clock{cpu}")
            print(f"identical outputs: {run['same_outputs']}/{run['num_prompts']} prompts")


def print_phases(ph: dict[str, Any], num_prompts: int) -> None:
    """minisgl's prefill and decode phases with what the matmuls achieved (attention not counted)."""
    w: WeightCounts = ph["weights"]
    lw, hw = w.active(), w.head
    if ph["prefill_s"] > 0:
        flops = 2 * lw * ph["prefill_tokens"] + 2 * hw * num_prompts  # the head runs on sampled rows only
        print(
            f"  prefill    : {ph['prefill_s']:.3f} s for {int(ph['prefill_tokens'])} prompt tokens in "
            f"{int(ph['prefill_batches'])} batch(es), {ph['prefill_tokens'] / ph['prefill_s']:.0f} tok/s, "
            f"matmuls {flops / ph['prefill_s'] / 1e9:.0f} GFLOP/s"
        )
    if ph["decode_batches"] > 0:
        steps, rows = ph["decode_batches"], ph["decode_tokens"]
        step_ms = ph["decode_s"] / steps * 1e3
        flops = 2 * (lw + hw) * rows
        print(
            f"  decode     : {ph['decode_s']:.2f} s for {int(steps)} steps of ~{rows / steps:.0f} rows, "
            f"{step_ms:.2f} ms/step = {rows / ph['decode_s']:.0f} tok/s, matmuls "
            f"{flops / ph['decode_s'] / 1e9:.0f} GFLOP/s, weights read "
            f"{w.read_bytes(rows / steps) * steps / ph['decode_s'] / 1e9:.1f} GB/s"
        )


def main(ns: argparse.Namespace) -> int:
    sizes = [int(s) for s in ns.batch_sizes.split(",")] if ns.batch_sizes else None
    if (
        min(ns.num_prompts, ns.output_len, ns.min_input_len, ns.repeats, *(sizes or [1])) < 1
        or ns.max_input_len < ns.min_input_len
    ):
        print("minisgl bench offline: counts must be >= 1 and --max-input-len >= --min-input-len")
        return 2
    extra: dict[str, Any] = (
        {} if ns.cuda_graph_max_bs is None else {"cuda_graph_max_bs": ns.cuda_graph_max_bs}
    )
    if ns.disable_overlap:
        extra["overlap_schedule"] = False
    if ns.tp < 1:
        print("minisgl bench offline: --tp must be >= 1")
        return 2
    if ns.tp > 1:
        extra.update(tp=ns.tp, cache_type="naive")
    if ns.kv_cache_memory is not None:
        extra["kv_cache_memory"] = int(ns.kv_cache_memory * (1 << 30))
    if ns.quantization is not None:
        extra["quantization"] = ns.quantization
    if ns.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = ns.kv_cache_dtype
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
        ns.device,
        ns.model_config,
        sizes,
        ns.max_output_len,
        ns.dtype,
        **extra,
    )
    print_report(res)
    return 0
