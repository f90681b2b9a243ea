"""fp8 on CUDA: each path of the CUDA ops' fp8 projection against its emulation, an fp8 checkpoint
against its dequantized CPU reference, and fp8 weights with an fp8 KV cache through the engine, with
and without CUDA graphs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from test_fp8_weights import FORMATS, _fp8_pair
from test_models_support import run_prompts, save_tiny_hf_model

from minisgl.backends.fp8 import Fp8Weight, dequantize_fp8, quantize_fp8, quantize_rows_fp8
from minisgl.models import load_model

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 100, 600])
def test_fp8_projection_paths_match_their_emulation(block: tuple[int, int] | None, rows: int) -> None:
    """Up to 16 rows: the fp8 GEMV, x as it is (W8A16); more: x quantized per token (per group of
    the block's columns) and an fp8 matmul (W8A8). Both plain and with the residual added."""
    from minisgl.backends.cuda import CudaOps

    gen = torch.Generator().manual_seed(rows)
    n, k = 384, 512
    w = torch.randn(n, k, generator=gen) * 0.02
    q, s = quantize_fp8(w, block)
    weight = Fp8Weight(q.cuda(), s.cuda(), block)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    deq = dequantize_fp8(q, s, block).double()
    if rows <= 16:
        xe = x.double()
    else:
        xq, xs = quantize_rows_fp8(x, None if block is None else block[1])
        xe = xq.double() * (xs.repeat_interleave(block[1], 1) if block else xs).double()
    want = xe @ deq.T
    ops = CudaOps()
    assert _rel(ops.linear(x.cuda(), weight, None), want) < 1e-2
    res = torch.randn(rows, n, generator=gen).bfloat16()
    out = res.cuda()
    assert ops.linear_add_(x.cuda(), weight, None, out) is out
    assert _rel(out, res.double() + want) < 1e-2


@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_norm_and_mlp_ops_match_the_reference(rows: int) -> None:
    """A decoder layer's fused fp8 calls (the row GEMV at 1 row: RMSNorm and SiLU x up fused; the
    tensor-core GEMV with its norm and SiLU kernels at more) against the torch reference ops on the
    dequantized weights."""
    from minisgl.backends import REFERENCE_OPS
    from minisgl.backends.cuda import CudaOps

    gen = torch.Generator().manual_seed(rows)
    hidden, inter = 256, 384
    weights = {}
    for name, (n, k) in {
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "qkv": (320, hidden),
    }.items():
        q, s = quantize_fp8(torch.randn(n, k, generator=gen) * 0.05, None)
        weights[name] = Fp8Weight(q.cuda(), s.cuda(), None)
    x = torch.randn(rows, hidden, generator=gen).bfloat16().cuda()
    g = (torch.rand(hidden, generator=gen) + 0.5).bfloat16().cuda()
    ops = CudaOps()
    want = REFERENCE_OPS.norm_linear(x.float(), g.float(), 1e-5, weights["qkv"], None)
    assert _rel(ops.norm_linear(x, g, 1e-5, weights["qkv"], None), want) < 2e-2
    ref_res = x.float().clone()
    REFERENCE_OPS.norm_mlp_add_(x.float(), g.float(), 1e-5, weights["gate_up"], weights["down"], ref_res)
    res = x.clone()
    assert ops.norm_mlp_add_(res, g, 1e-5, weights["gate_up"], weights["down"], res) is res
    assert _rel(res - x, ref_res - x.float()) < 2e-2


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "fp8-tensor"])
def test_fp8_checkpoint_on_cuda_is_close_to_its_cpu_reference(fmt: str, tmp_path: Path) -> None:
    base = save_tiny_hf_model("LlamaForCausalLM", tmp_path / "base", tie=False)
    qc, scale_name, block, layout = FORMATS[fmt]
    if block is not None:  # the GPU's fp8 dots take 32 columns at least
        block = (32, 32)
        qc = dict(qc, **({"weight_block_size": [32, 32]} if "weight_block_size" in qc else {}))
    fp8_dir, ref_dir = _fp8_pair(base, tmp_path, qc, scale_name, block, layout)
    ref, _ = load_model(ref_dir, torch.float32, "cpu", progress=False)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(50, 70))]  # 30 rows: the W8A8 path
    want = run_prompts(ref, prompts)
    from minisgl.backends import bind_ops, create_ops

    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(fp8_dir, dtype, "cuda", progress=False)
        bind_ops(model, create_ops("cuda", "cuda"))
        errors[dtype] = [_rel(got, w) for got, w in zip(run_prompts(model, prompts), want, strict=True)]
    # float32 runs the reference's dequantized matmuls (torch's, beyond 16 rows); bf16 rounds to bf16
    # and, beyond 16 rows, quantizes the activations per token (about 4% a matmul)
    assert max(errors[torch.float32]) < 1e-5 and max(errors[torch.bfloat16]) < 0.12, errors


@pytest.fixture(scope="module")
def small_model() -> Path:
    from minisgl.benchmark.presets import preset_config, write_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="msgl-fp8-"))
    return write_model_dir(preset_config("smollm2-135m"), tmp / "m")


@pytest.mark.parametrize("bsz", [1, 20])
def test_fp8_weights_and_kv_under_cuda_graphs_change_no_token(small_model: Path, bsz: int) -> None:
    """Random weights of SmolLM2-135M's shapes in fp8 with an fp8 KV cache: the same greedy tokens
    with and without CUDA graphs (1 row: the fp8 GEMV; 20: the W8A8 matmuls). (How close they are to
    bf16's: benchmarks/bench_fp8_accuracy.py, which feeds both the same tokens.)"""
    from minisgl import LLM, SamplingParams
    from minisgl.benchmark.offline import make_workload

    opts = dict(device="cuda", dummy_weights=True, kv_cache_memory=1 << 30)
    prompts = make_workload(bsz, 20, 60, 49152, 1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for name, extra in {
        "graphs": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", cuda_graph_max_bs=32),
        "eager": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", cuda_graph_max_bs=0),
    }.items():
        llm = LLM(str(small_model), **opts, **extra)
        if name == "graphs":
            assert llm.engine.graphs is not None and llm.engine.pool.quantized
        outs[name] = [o["token_ids"] for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs["graphs"] == outs["eager"]
    assert all(len(t) == 24 for t in outs["graphs"])


def test_fp8_lm_head_on_cuda_is_close_to_its_cpu_reference(tmp_path: Path) -> None:
    """`quantization="fp8_lm_head"` on CUDA (one row: the head in the row GEMV; 37: the W8A8 matmul)
    against the same option on the CPU, which runs the head dequantized."""
    from minisgl.backends import bind_ops, create_ops

    base = save_tiny_hf_model("LlamaForCausalLM", tmp_path / "base", tie=False, vocab=1000)
    ref, _ = load_model(base, torch.float32, "cpu", progress=False, quantization="fp8_lm_head")
    model, _ = load_model(base, torch.bfloat16, "cuda", progress=False, quantization="fp8_lm_head")
    assert model.lm_head.fp8 is not None
    bind_ops(model, create_ops("cuda", "cuda"))
    errors = []
    for prompts in ([[40]], [[5, 6, 7, 8, 9, 10, 11], list(range(50, 80))]):  # 1 row; 37 rows
        got = run_prompts(model, prompts)
        errors += [_rel(g, w) for g, w in zip(got, run_prompts(ref, prompts), strict=True)]
    assert max(errors) < 0.12, errors
