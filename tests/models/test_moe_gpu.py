"""Mixtures of experts on the GPU: the fused Triton MoE compiled (bf16, real layer shapes) against the
reference, inside a CUDA graph and without a host sync; tiny Qwen3-MoE / Mixtral / Qwen2-MoE models
in bf16 against transformers in bf16, greedy decoding with CUDA graphs; two GPUs against one.

Routing near ties. A bf16 model computes its router logits in bf16, so where the float32 model's
k-th and (k+1)-th logits of a token are closer than bf16's rounding, a bf16 run may take either
expert: transformers' bf16 and ours each choose by their own rounding noise, and a different expert
moves that token's logits (and the later positions of its prompt) by a few hundredths in these tiny
models, more than the bf16 bounds below allow. (The qwen2-moe-shared failure of the earlier bound
was one such token: float32 logit gap 2.5e-5, and swapping its k-th expert for the (k+1)-th gives
the 0.047-0.049 error measured.) So the bf16 comparisons hold where both runs route as float32 does,
and check that every routing difference sits at such a near tie (a gap under NEAR_TIE), so a routing
bug still fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_models_support import run_prompts
from test_moe import CASES, PROMPTS, Routes, engine_greedy, hf_greedy, recording, routing, save_tiny_moe

from minisgl.backends import TorchOps, bind_ops, create_ops
from minisgl.models import load_model

pytestmark = pytest.mark.gpu

# A float32 router-logit gap under which bf16 may route either way: twice the largest change of a
# k-th/(k+1)-th gap between these checkpoints' float32 and bf16 runs (0.0144, torch ops on the CPU).
NEAR_TIE = 0.03


def hf_routes(hf: torch.nn.Module, top_k: int) -> tuple[list[torch.Tensor], list]:
    """Hooks that log the experts each of transformers' routers chooses, (T, K) per call."""
    log: list[torch.Tensor] = []

    def hook(_: torch.nn.Module, __: tuple, out: object) -> None:
        if isinstance(out, tuple) and len(out) >= 3:  # (logits, weights, ids)
            log.append(out[2].reshape(-1, top_k).cpu())
        else:  # a plain linear's logits: transformers' softmax and topk
            probs = torch.softmax(out.reshape(-1, out.shape[-1]), -1, dtype=torch.float32)  # type: ignore[union-attr]
            log.append(torch.topk(probs, top_k, -1).indices.cpu())

    blocks = [m for m in hf.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    return log, [b.gate.register_forward_hook(hook) for b in blocks]


def hf_bf16(
    model_dir: Path, seqs: list[list[int]], top_k: int, device: str = "cuda"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers in bf16 on the GPU, one sequence at a time: each one's logits (L, V) float32, and
    per router call its chosen experts (T, K) over the sequences laid end to end."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    log, hooks = hf_routes(hf, top_k)
    with torch.no_grad():
        logits = [hf(torch.tensor([s], device=device)).logits[0].float().cpu() for s in seqs]
    for h in hooks:
        h.remove()
    calls = len(log) // len(seqs)
    return logits, [torch.cat(log[c::calls]) for c in range(calls)]


def routed_as_float32(ref: Routes, lens: list[int], runs: list[list[torch.Tensor]]) -> list[int]:
    """Per sequence, how many leading positions route as the float32 model (`ref`) does in each run
    of `runs` (per router call, ids (T, K) over the sequences laid end to end; -1: not run). Asserts
    that every difference is at a float32 near tie: other experts at a wide gap are a bug."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    prefix = list(lens)
    for call, (logits, want) in enumerate(ref):
        k = want.shape[1]
        top = logits.topk(k + 1, -1).values  # (T, K + 1)
        gap = top[:, k - 1] - top[:, k]
        for run in runs:
            got = run[call]
            differs = (got >= 0).all(-1) & (got.sort(-1).values != want.sort(-1).values).any(-1)
            for t in differs.nonzero().flatten().tolist():
                assert gap[t] < NEAR_TIE, (
                    f"router call {call}, token {t}: other experts at a gap of {gap[t]:.4f}"
                )
                i = max(i for i, s in enumerate(starts) if s <= t)
                prefix[i] = min(prefix[i], t - starts[i])
    return prefix


def float32_routes(model_dir: Path, seqs: list[list[int]]) -> tuple[list[torch.Tensor], Routes]:
    """The float32 model (reference ops, CPU): each sequence's logits and every router call's log."""
    ref, _ = load_model(model_dir, torch.float32, "cpu", progress=False)
    log: Routes = []
    bind_ops(ref, recording(TorchOps(), log))
    return run_prompts(ref, seqs), log


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
        w = weights / weights.sum(-1, keepdim=True)
        want = _reference_experts(x.float(), w13.float(), w2.float(), w, ids)  # the bf16 weights in float32
        got = fused_moe(x, w13, w2, weights, ids, True).float()
        rel = float((got - want).norm() / want.norm())
        assert rel < 2e-2, (case, rel)
        res = torch.randn_like(x)
        added = fused_moe(x, w13, w2, weights, ids, True, residual=res.clone()).float()
        assert float((added - want - res.float()).norm() / want.norm()) < 2e-2


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


@pytest.mark.parametrize("layer", LAYERS)
def test_one_token_rows_match_the_grouped_gemms(
    layer: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One token's experts as row GEMVs (`moe.experts`) at real layer shapes in bf16: close to the
    reference and to the grouped GEMMs, the same bits on a second call. Then the op with the RMSNorm
    in the router's launch, three ways (grouped GEMMs; row GEMVs routed by the router's last program;
    row GEMVs routed inside gate/up's programs): the same experts chosen, outputs within bf16 rounding
    of the grouped path's, and a CUDA graph's replay the eager call's bits."""
    from minisgl.kernels.triton.moe import fused_moe, routed_moe_from_router
    from minisgl.kernels.triton.moe.experts import experts_one_token

    h, e, i, k = layer
    for case in ("random", "one-hot"):
        x, w13, w2, weights, ids = _layer(1, h, e, i, k, case, torch.bfloat16)
        w = weights / weights.sum(-1, keepdim=True)
        want = _reference_experts(x.float(), w13.float(), w2.float(), w, ids)
        got = experts_one_token(x, w13, w2, weights, ids, True)
        assert torch.equal(got, experts_one_token(x, w13, w2, weights, ids, True))
        assert float((got.float() - want).norm() / want.norm()) < 2e-2, case
        grouped = fused_moe(x, w13, w2, weights, ids, True).float()
        assert float((got.float() - grouped).norm() / grouped.norm()) < 1e-2, case
    gen = torch.Generator().manual_seed(1)
    router = (torch.randn(e, h, generator=gen) / h**0.5).to("cuda", torch.bfloat16)
    norm_w = (1.0 + 0.1 * torch.randn(h, generator=gen)).to("cuda", torch.bfloat16)
    stream = torch.randn(1, h, generator=gen).to("cuda", torch.bfloat16)
    results = {}
    for b1, in_gate_up in (("0", "0"), ("1", "0"), ("1", "1")):
        monkeypatch.setenv("MINISGL_MOE_B1", b1)
        monkeypatch.setenv("MINISGL_MOE_B1_ROUTE", in_gate_up)
        eager, eager_ids = routed_moe_from_router(stream, router, w13, w2, k, True, None, (norm_w, 1e-6))
        with torch.cuda.graph(graph := torch.cuda.CUDAGraph()):
            out, graph_ids = routed_moe_from_router(stream, router, w13, w2, k, True, None, (norm_w, 1e-6))
        graph.replay()
        assert torch.equal(out, eager) and torch.equal(graph_ids, eager_ids), (b1, in_gate_up)
        results[b1 + in_gate_up] = (eager.float(), eager_ids)
    base, base_ids = results["00"]
    for name, (got, got_ids) in results.items():
        assert torch.equal(got_ids, base_ids), name
        assert float((got - base).norm() / base.norm()) < 1e-2, name
    assert torch.equal(results["10"][0], results["11"][0])


@pytest.mark.parametrize("tokens", [1, 16, 80])
def test_fused_moe_in_a_cuda_graph_without_host_sync(tokens: int) -> None:
    """Captured once, replayed on new inputs (other routing, all tokens on one expert): the eager
    results; and an eager call makes no host synchronization. Then the backend's whole op (router
    logits, routing (inside the alignment up to 16 tokens), experts, with and without the residual
    add) likewise."""
    from minisgl.kernels.triton.moe import fused_moe

    h, e, i, k = LAYERS[0]
    x, w13, w2, weights, ids = _layer(tokens, h, e, i, k, "random", torch.bfloat16)
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
        nx, _, _, nw, nids = _layer(tokens, h, e, i, k, case, torch.bfloat16)
        x.copy_(nx.roll(1, 0)), weights.copy_(nw), ids.copy_(nids)
        graph.replay()
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids, True)), case
    ops = create_ops("cuda", "cuda")
    router = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    res = torch.randn_like(x)
    ops.moe(x, router, w13, w2, k, True, residual=res.clone())  # compile outside the capture
    with torch.cuda.graph(graph := torch.cuda.CUDAGraph()):
        out = ops.moe(x, router, w13, w2, k, True)
        added = ops.moe(x, router, w13, w2, k, True, residual=res)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        res.copy_(torch.randn_like(x))
        want_added = res + ops.moe(x, router, w13, w2, k, True)
        graph.replay()
        assert torch.equal(out, ops.moe(x, router, w13, w2, k, True))
        torch.testing.assert_close(added, want_added, atol=2e-2, rtol=2e-2)
    # The RMSNorm before the experts (inside the router's launch up to 16 tokens): the bits of the
    # RMSNorm kernel, then the op.
    norm_w = 1.0 + 0.1 * torch.randn(h, device="cuda", dtype=torch.bfloat16)
    stream = torch.randn_like(x)
    ops.norm_moe_(stream.clone(), norm_w, 1e-6, router, w13, w2, k, True)  # compile outside the capture
    with torch.cuda.graph(graph := torch.cuda.CUDAGraph()):
        ops.norm_moe_(stream, norm_w, 1e-6, router, w13, w2, k, True)
    for _ in range(2):
        stream.copy_(torch.randn_like(x))
        want = ops.moe(ops.rmsnorm(stream, norm_w, 1e-6), router, w13, w2, k, True, residual=stream.clone())
        graph.replay()
        assert torch.equal(stream, want)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_logits_are_as_close_as_transformers_bf16(moe_dirs: dict[str, Path], case: str) -> None:
    """Both in bf16 against the float32 model: ours no further from it than transformers' (plus a
    bf16 step), and close to transformers' own bf16 logits, at every position before a routing
    near tie that either bf16 run took the other way (the module's docstring)."""
    want, ref_routes = float32_routes(moe_dirs[case], PROMPTS)
    ours, cfg = load_model(moe_dirs[case], torch.bfloat16, "cuda", progress=False)
    hf_out, hf_ids = hf_bf16(moe_dirs[case], PROMPTS, cfg.moe.top_k)
    log: Routes = []
    bind_ops(ours, recording(create_ops("cuda", "cuda"), log))
    got = [g.cpu() for g in run_prompts(ours, PROMPTS)]
    lens = [len(p) for p in PROMPTS]
    keep = routed_as_float32(ref_routes, lens, [hf_ids, [ids for _, ids in log]])
    print(f"{case}: leading positions routed as float32 by both bf16 runs {keep} of {lens}")
    assert sum(keep) >= sum(lens) // 2, keep  # most positions are compared
    for n, g, h_, w in zip(keep, got, hf_out, want, strict=True):
        g, h_, w = g[:n], h_[:n], w[:n]
        err, hf_err = float((g - w).abs().max()), float((h_ - w).abs().max())
        assert err <= 2 * hf_err + 0.02, (err, hf_err, keep)
        torch.testing.assert_close(g, h_, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_cuda_graphs_matches_transformers(moe_dirs: dict[str, Path], case: str) -> None:
    """float32: the tokens and log probabilities of transformers' greedy decoding, decode steps
    replayed from CUDA graphs. bf16: the graphs give the eager steps' tokens and log probabilities,
    and each of those tokens is transformers' bf16 choice or within its rounding of it, with its
    log probability, until the first routing near tie either bf16 run took the other way (the
    module's docstring; the eager steps' routing is logged)."""
    n = 6
    want_toks, want_lps = hf_greedy(moe_dirs[case], PROMPTS, n)
    toks, lps = engine_greedy(moe_dirs[case], "cuda", "triton", PROMPTS, n, device="cuda", graphs=8)
    assert toks == want_toks
    for got, want in zip(lps, want_lps, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    toks, lps = engine_greedy(moe_dirs[case], "cuda", "triton", PROMPTS, n, graphs=8, **bf16)
    routes: list[torch.Tensor] = []
    eager_toks, eager_lps = engine_greedy(moe_dirs[case], "cuda", "triton", PROMPTS, n, routes=routes, **bf16)
    assert toks == eager_toks
    for got, want in zip(lps, eager_lps, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
    seqs = [p + t for p, t in zip(PROMPTS, toks, strict=True)]
    _, ref_routes = float32_routes(moe_dirs[case], seqs)
    hf_out, hf_ids = hf_bf16(moe_dirs[case], seqs, ref_routes[0][1].shape[1])
    keep = routed_as_float32(ref_routes, [len(s) for s in seqs], [hf_ids, routes])
    checked = 0
    for prompt, ours, our_lps, logits, m in zip(PROMPTS, toks, lps, hf_out, keep, strict=True):
        hf_lps = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)  # (n, V) at each of our steps
        for j, t in enumerate(ours[: max(0, m - len(prompt) + 1)]):  # steps whose positions all route alike
            assert abs(float(hf_lps[j, t]) - our_lps[j]) < 0.1, (j, keep)
            assert float(hf_lps[j].max() - hf_lps[j, t]) < 0.1, (j, keep)  # its argmax, or a bf16 near-tie
            checked += 1
    print(
        f"{case}: leading positions routed as float32 {keep}; {checked} of {len(PROMPTS) * n} steps checked"
    )
    assert checked >= n, keep


def test_two_gpus_match_one(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    from test_models_tp import check_ranks_match_one, run_ranks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    dirs = [moe_dirs[c] for c in ("qwen3-moe", "mixtral", "qwen2-moe-shared")]
    check_ranks_match_one(dirs, run_ranks(dirs, tmp_path, 2, "nccl", "cuda:RANK"), 2, tol=1e-4)
