"""Mixtures of experts on the GPU: the fused Triton MoE compiled (bf16, real layer shapes) against the
reference, inside a CUDA graph and without a host sync; tiny Qwen3-MoE / Mixtral / Qwen2-MoE models
in bf16 against transformers in bf16, greedy decoding with CUDA graphs; two GPUs against one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl.backends import TorchOps, bind_ops, create_ops
from minisgl.models import load_model
from test_models_support import run_prompts
from test_moe import CASES, PROMPTS, engine_greedy, hf_greedy, routing, save_tiny_moe

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {case: save_tiny_moe(case, tmp_path_factory.mktemp(case)) for case in CASES}


def _layer(t: int, h: int, e: int, i: int, k: int, case: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    weights = torch.rand(t, k, generator=gen)
    ids = routing(case, t, e, k, gen)
    return x.to("cuda", dtype), w13.to("cuda", dtype), w2.to("cuda", dtype), weights.cuda(), ids.cuda()


# Qwen3-30B-A3B's layer (and its TP=2 shard), Mixtral-8x7B's at TP=2 (to keep the test's memory small)
LAYERS = [(2048, 128, 768, 8), (2048, 128, 384, 8), (4096, 8, 7168, 2)]


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("layer", LAYERS)
def test_fused_moe_bf16_matches_the_reference(layer: tuple[int, ...], tokens: int) -> None:
    from minisgl.kernels.triton.moe import fused_moe

    h, e, i, k = layer
    for case in ("random", "one-hot"):
        x, w13, w2, weights, ids = _layer(tokens, h, e, i, k, case, torch.bfloat16)
        got = fused_moe(x, w13, w2, weights, ids, renormalize=True).float()
        w = weights / weights.sum(-1, keepdim=True)
        want = _reference_experts(x.float(), w13.float(), w2.float(), w, ids)  # the bf16 weights in float32
        rel = float((got - want).norm() / want.norm())
        assert rel < 2e-2, (case, rel)


def _reference_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The reference loop over experts (TorchOps.moe's) on given routing, in x's dtype."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slot = torch.where(ids == e)
        h = TorchOps().silu_and_mul(x[rows] @ w13[e].T)
        out.index_add_(0, rows, (h @ w2[e].T) * weights[rows, slot, None])
    return out


def test_fused_moe_in_a_cuda_graph_without_host_sync() -> None:
    """Captured once, replayed on new inputs (other routing, all tokens on one expert): the eager
    results; and an eager call makes no host synchronization."""
    from minisgl.kernels.triton.moe import fused_moe

    h, e, i, k = LAYERS[0]
    x, w13, w2, weights, ids = _layer(16, h, e, i, k, "random", torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids, True)  # compile outside the capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, w13, w2, weights, ids, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids, True)
    for case in ("random", "same", "one-hot"):
        nx, _, _, nw, nids = _layer(16, h, e, i, k, case, torch.bfloat16)
        x.copy_(nx.roll(1, 0)), weights.copy_(nw), ids.copy_(nids)
        graph.replay()
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids, True)), case


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_logits_are_as_close_as_transformers_bf16(moe_dirs: dict[str, Path], case: str) -> None:
    """Both in bf16 against the float32 model: ours no further from it than transformers' (plus a
    bf16 step), and close to transformers' own bf16 logits."""
    from transformers import AutoModelForCausalLM

    ref, _ = load_model(moe_dirs[case], torch.float32, "cpu", progress=False)
    want = run_prompts(ref, PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(str(moe_dirs[case]), dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        hf_out = [hf(torch.tensor([p], device="cuda")).logits[0].float().cpu() for p in PROMPTS]
    ours, _ = load_model(moe_dirs[case], torch.bfloat16, "cuda", progress=False)
    bind_ops(ours, create_ops("cuda", "cuda"))
    got = [g.cpu() for g in run_prompts(ours, PROMPTS)]
    for g, h_, w in zip(got, hf_out, want, strict=True):
        err, hf_err = float((g - w).abs().max()), float((h_ - w).abs().max())
        assert err <= 2 * hf_err + 0.02, (err, hf_err)
        torch.testing.assert_close(g, h_, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_cuda_graphs_matches_transformers(moe_dirs: dict[str, Path], case: str) -> None:
    """float32: the tokens and log probabilities of transformers' greedy decoding, decode steps
    replayed from CUDA graphs. bf16: each of our tokens is transformers' bf16 choice or within its
    rounding of it, with its log probability."""
    n = 6
    want_toks, want_lps = hf_greedy(moe_dirs[case], PROMPTS, n)
    toks, lps = engine_greedy(moe_dirs[case], "cuda", "triton", PROMPTS, n, device="cuda", graphs=8)
    assert toks == want_toks
    for got, want in zip(lps, want_lps, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
    toks, lps = engine_greedy(
        moe_dirs[case], "cuda", "triton", PROMPTS, n, device="cuda", graphs=8, dtype=torch.bfloat16
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(moe_dirs[case]), dtype=torch.bfloat16).cuda().eval()
    for prompt, ours, our_lps in zip(PROMPTS, toks, lps, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
        hf_lps = torch.log_softmax(logits, -1)  # (n, V) at each of our steps, teacher-forced
        for j, t in enumerate(ours):
            assert abs(float(hf_lps[j, t]) - our_lps[j]) < 0.1
            assert float(hf_lps[j].max() - hf_lps[j, t]) < 0.1  # its argmax, or a bf16 near-tie


def test_two_gpus_match_one(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    from test_models_tp import check_ranks_match_one, run_ranks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    dirs = [moe_dirs[c] for c in ("qwen3-moe", "mixtral", "qwen2-moe-shared")]
    check_ranks_match_one(dirs, run_ranks(dirs, tmp_path, 2, "nccl", "cuda:RANK"), 2, tol=1e-4)
