"""Mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert) on tiny random
checkpoints written by transformers (float32): logits and greedy tokens against transformers through
every backend, routing ties, the experts' kernels against a float64 reference (the C kernel, and the
Triton kernels in the interpreter on ragged and skewed routing), two ranks against one, GGUF files
with stacked experts, and the offline LLM's prefix cache, overlap scheduling and grammars."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_models import hf_logits
from test_models_support import run_prompts, save_byte_tokenizer, save_tiny_hf_model

from minisgl import kernels
from minisgl.backends import TorchOps, bind_ops, create_ops
from minisgl.core import Batch, Req, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine, EngineOptions
from minisgl.kernels.triton import interpreting, triton_available
from minisgl.models import LlamaForCausalLM, ModelConfig, ModelConfigError, load_model

CASES = {
    # layer 0 sparse, layer 1 dense (mlp_only_layers); the top-k weights renormalized
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        False,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True)
        | dict(mlp_only_layers=[1]),
    ),
    "qwen3-moe-tied-unnormed": (
        "Qwen3MoeForCausalLM",
        True,
        dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False),
    ),
    "mixtral": ("MixtralForCausalLM", False, dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16)),
    # layer 0 dense, layer 1 sparse (decoder_sparse_step=2), with a shared expert
    "qwen2-moe-shared": (
        "Qwen2MoeForCausalLM",
        False,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2)
        | dict(shared_expert_intermediate_size=48),
    ),
}
PROMPTS = [[3, 17, 99, 5, 8], list(range(10, 47)), [120, 7, 7, 7, 64, 33, 2, 90, 11]]
# The CUDA ops backend on CPU tensors in Triton's interpreter (without a GPU; test_moe_gpu.py runs it
# compiled), with the torch attention: the Triton attention is test_engine_backends.py's, and slow here
INTERPRETED = triton_available() and interpreting()
BACKENDS = [("torch", "torch"), ("cpu", "cpu")] + ([("cuda", "torch")] if INTERPRETED else [])
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton kernels' own tests run


def save_tiny_moe(case: str, out: Path, **extra: object) -> Path:
    arch, tie, kw = CASES[case]
    return save_tiny_hf_model(arch, out, tie, **(kw | extra))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {case: save_tiny_moe(case, tmp_path_factory.mktemp(case)) for case in CASES}


# ---------------------------------------------------------------------------------------------------
# Config and shapes


def test_config_fields_as_transformers_reads_them(moe_dirs: dict[str, Path]) -> None:
    q3 = ModelConfig.from_dir(moe_dirs["qwen3-moe"])
    assert q3.family == "qwen3_moe" and q3.qk_norm and not q3.attention_bias
    assert q3.moe is not None and (q3.moe.num_experts, q3.moe.top_k, q3.moe.intermediate_size) == (8, 2, 32)
    assert q3.moe.norm_topk_prob and [q3.moe.is_sparse(i) for i in range(2)] == [True, False]
    mix = ModelConfig.from_dir(moe_dirs["mixtral"])
    assert mix.family == "mixtral" and not mix.qk_norm and mix.moe is not None
    assert (mix.moe.num_experts, mix.moe.intermediate_size, mix.moe.norm_topk_prob) == (4, 96, True)
    q2 = ModelConfig.from_dir(moe_dirs["qwen2-moe-shared"])
    assert q2.attention_bias and q2.moe is not None and q2.moe.shared_intermediate_size == 48
    assert [q2.moe.is_sparse(i) for i in range(2)] == [False, True] and not q2.moe.norm_topk_prob
    raw = json.loads((moe_dirs["qwen3-moe"] / "config.json").read_text())
    raw.pop("num_local_experts")
    released = ModelConfig.from_hf_dict(raw | {"num_experts": 8})  # released checkpoints' spelling
    assert released.moe == q3.moe
    with pytest.raises(ModelConfigError, match="num_experts_per_tok 9"):
        ModelConfig.from_hf_dict(raw | {"num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ModelConfigError, match="missing field 'moe_intermediate_size'"):
        ModelConfig.from_hf_dict({k: v for k, v in raw.items() if k != "moe_intermediate_size"})


def test_each_rank_holds_its_slice_of_every_expert(moe_dirs: dict[str, Path]) -> None:
    full, cfg = load_model(moe_dirs["mixtral"], torch.float32, "cpu", progress=False)
    part, _ = load_model(
        moe_dirs["mixtral"], torch.float32, "cpu", tp_info=DistributedInfo(1, 2), progress=False
    )
    f, p = full.model.layers[0].mlp, part.model.layers[0].mlp
    inter = cfg.moe.intermediate_size // 2
    assert p.w13.shape == (4, 2 * inter, cfg.hidden_size) and p.w2.shape == (4, cfg.hidden_size, inter)
    assert torch.equal(p.router, f.router)  # replicated
    assert torch.equal(p.w13[:, :inter], f.w13[:, inter : 2 * inter])  # gate rows of the second half
    assert torch.equal(p.w13[:, inter:], f.w13[:, 3 * inter :])  # up rows likewise
    assert torch.equal(p.w2, f.w2[:, :, inter:])
    hf = load_file(str(moe_dirs["mixtral"] / "model.safetensors"))
    assert torch.equal(f.w13[2, :96], hf["model.layers.0.block_sparse_moe.experts.2.w1.weight"])
    assert torch.equal(f.w13[2, 96:], hf["model.layers.0.block_sparse_moe.experts.2.w3.weight"])
    raw = json.loads((moe_dirs["mixtral"] / "config.json").read_text()) | {"intermediate_size": 90}
    with pytest.raises(
        ValueError, match="experts' intermediate size 90 is not divisible by tensor-parallel size 4"
    ):
        LlamaForCausalLM(ModelConfig.from_hf_dict(raw), DistributedInfo(0, 4), torch.float32, "meta")


# ---------------------------------------------------------------------------------------------------
# Against transformers


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(moe_dirs: dict[str, Path], case: str) -> None:
    """Every prompt position's logits through the reference ops and the CPU backend."""
    model, _ = load_model(moe_dirs[case], torch.float32, "cpu", progress=False)
    ref = hf_logits(moe_dirs[case], PROMPTS)
    for ops in ("torch", "cpu"):
        bind_ops(model, create_ops(ops, "cpu"))
        for got, want in zip(run_prompts(model, PROMPTS), ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and each one's log probability (from the decode steps' logits)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    toks, lps = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            new = out.sequences[0, len(ids) :].tolist()
            toks.append(new)
            lps.append(
                [float(F.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new, strict=True)]
            )
    return toks, lps


def engine_greedy(
    model_dir: Path,
    ops: str,
    attention: str,
    prompts: list[list[int]],
    n: int,
    device: str = "cpu",
    graphs: int = 0,
    dtype: torch.dtype = torch.float32,
    routes: list[torch.Tensor] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """The engine's greedy tokens and their log probabilities: chunked prefill, then batched decode
    (from CUDA graphs of up to `graphs` rows). routes (eager steps only): filled with each router
    call's chosen experts (T, K), T the prompts and tokens laid end to end (a position no step
    routed, the last token, holds -1)."""
    model, cfg = load_model(model_dir, dtype, device, progress=False)
    opts = EngineOptions(
        device=device,
        page_size=4,
        num_pages=64,
        max_running_requests=8,
        ops_backend=ops,
        attention_backend=attention,
        cuda_graph_max_bs=graphs,
        dtype=dtype,
    )
    engine = Engine(model, cfg, opts)
    assert (engine.graphs is not None) == (graphs > 0)
    log: Routes = []
    if routes is not None:
        assert graphs == 0, "a CUDA graph's routing cannot be logged"
        engine.ops = recording(engine.ops, log)
        bind_ops(model, engine.ops)
    reqs = [
        Req(uid=i, token_ids=list(p), sampling_params=SamplingParams(max_tokens=n, logprobs=1))
        for i, p in enumerate(prompts)
    ]
    lps: dict[int, list[float]] = {r.uid: [] for r in reqs}
    for r in reqs:
        r.table_row = engine.page_table.alloc_row(r.uid)
        assert engine.page_table.reserve(r.table_row, r.prompt_len + n)

    forwards: list[list[tuple[int, int, int]]] = []  # per forward: (request, first position, tokens)

    def step(batch: Batch, done: list[Req]) -> None:
        forwards.append(
            [(r.uid, r.cached_len, e) for r, e in zip(batch.reqs, batch.extend_lens, strict=True)]
        )
        out = engine.launch(batch)
        toks, (sampled, _) = out.tolist(), out.logprobs()
        for r, e in zip(batch.reqs, batch.extend_lens, strict=True):
            r.cached_len += e
        for r, t in zip(done, toks, strict=True):
            r.token_ids.append(t)
            lps[r.uid] += sampled[r.uid].logprobs

    while any(r.output_len == 0 for r in reqs):  # prefill in chunks of 6
        todo = [r for r in reqs if r.output_len == 0]
        ext = [min(6, r.remaining_len) for r in todo]
        step(
            Batch(todo, ext, "prefill"),
            [r for r, e in zip(todo, ext, strict=True) if r.cached_len + e == r.seq_len],
        )
    while any(r.output_len < n for r in reqs):
        step(Batch(reqs, [1] * len(reqs), "decode"), reqs)
    if routes is not None:
        routes.extend(_laid_end_to_end(log, forwards, [r.prompt_len + n for r in reqs], cfg.moe.top_k))
    return [r.output_ids[:n] for r in reqs], [lps[r.uid][:n] for r in reqs]


Routes = list[tuple[torch.Tensor, torch.Tensor]]  # per router call: logits (T, E) float32, ids (T, K)


def recording(ops: TorchOps, log: Routes) -> TorchOps:
    """`ops` whose routing also appends each call's router logits and chosen experts to `log`."""

    class Recording(type(ops)):  # type: ignore[misc]
        def route(
            self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
        ) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = super().route(x, router, top_k, renormalize)
            log.append((F.linear(x, router).float().cpu(), ids.cpu()))
            return weights, ids

        def routed_experts(  # the CUDA backend's fast path routes inside its kernels
            self, x: torch.Tensor, router: torch.Tensor, *args: object
        ) -> tuple[torch.Tensor, torch.Tensor]:
            norm = args[5] if len(args) > 5 else None  # (weight, eps): x is the residual stream
            xn = x if norm is None else TorchOps.rmsnorm(self, x, *norm)  # before x is updated
            out, ids = super().routed_experts(x, router, *args)
            log.append((F.linear(xn, router).float().cpu(), ids.cpu()))
            return out, ids

    return Recording()


def _laid_end_to_end(
    log: Routes, forwards: list[list[tuple[int, int, int]]], seq_lens: list[int], k: int
) -> list[torch.Tensor]:
    """Router calls logged forward by forward (each forward's rows: its requests' tokens, listed as
    (request, first position, tokens) in `forwards`) -> per router call of a forward, the chosen
    experts (T, K) over the sequences laid end to end (-1 where no forward ran a position)."""
    calls = len(log) // len(forwards)  # the same router calls in every forward
    starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
    out = [torch.full((sum(seq_lens), k), -1, dtype=torch.int64) for _ in range(calls)]
    for f, rows in enumerate(forwards):
        at = torch.cat([torch.arange(starts[uid] + pos, starts[uid] + pos + n) for uid, pos, n in rows])
        for c in range(calls):
            out[c][at] = log[f * calls + c][1].long()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_decode_matches_transformers(moe_dirs: dict[str, Path], case: str) -> None:
    """Greedy tokens identical to transformers' and every step's log probability within float32
    tolerance, through the CPU backend; on Mixtral also through the torch reference and (Triton's
    interpreter) the CUDA backend."""
    n = 6
    want_toks, want_lps = hf_greedy(moe_dirs[case], PROMPTS, n)
    backends = BACKENDS if case == "mixtral" else BACKENDS[1:2]  # the CPU's; all of them on one case
    for ops, attention in backends:
        toks, lps = engine_greedy(moe_dirs[case], ops, attention, PROMPTS, n)
        assert toks == want_toks, ops
        for got, want in zip(lps, want_lps, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=ops)


def test_routing_ties_are_broken_as_transformers_breaks_them(tmp_path: Path) -> None:
    """Experts 0 and 1 (and 2 and 3) have the same router row, so every token's probabilities tie
    exactly, but different weights: a different choice of the tied experts changes the output. The
    torch and CPU backends choose as transformers (torch.topk); the CUDA backend (interpreted) by its
    documented rule, the lower index, which here gives other logits than transformers'."""
    d = save_tiny_moe("qwen3-moe-tied-unnormed", tmp_path, num_experts_per_tok=1)
    tensors = load_file(str(d / "model.safetensors"))
    for i in range(2):
        router = tensors[f"model.layers.{i}.mlp.gate.weight"]
        router[1], router[3] = router[0], router[2]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(d, torch.float32, "cpu", progress=False)
    x = torch.randn(20, model.config.hidden_size)
    probs = torch.softmax(F.linear(x, model.model.layers[0].mlp.router), -1)
    assert torch.equal(probs[:, 0], probs[:, 1]) and torch.equal(probs[:, 2], probs[:, 3])
    ref = hf_logits(d, PROMPTS)
    for ops in ("torch", "cpu"):
        bind_ops(model, create_ops(ops, "cpu"))
        for got, want in zip(run_prompts(model, PROMPTS), ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if INTERPRETED:
        bind_ops(model, StableTieOps())
        lower = run_prompts(model, PROMPTS)
        assert any((a - b).abs().max() > 1e-2 for a, b in zip(lower, ref, strict=True))  # the rules differ
        bind_ops(model, create_ops("cuda", "cpu"))
        for got, want in zip(run_prompts(model, PROMPTS), lower, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------
# The experts' kernels against a float64 reference


def experts_f64(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * w2[e] @ (silu(gate_e x) * up_e x), e = ids[t, k], in float64."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = w13[e] @ x[t]
            out[t] += weights[t, k] * (w2[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


def routing(case: str, t: int, e: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(T, K) distinct experts per token: random, all tokens on the same K experts (the others get
    none), or one expert taking every token's first slot."""
    if case == "random":
        return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if case == "same":
        return torch.arange(e - k, e).repeat(t, 1)  # experts 0 .. e-k-1 get no token
    rest = torch.stack([torch.randperm(e - 1, generator=gen)[: k - 1] + 1 for _ in range(t)])
    return torch.cat([torch.zeros(t, 1, dtype=torch.int64), rest], 1)  # expert 0 takes every token


SHAPES = [  # tokens, hidden, experts, intermediate, top-k (ragged: none a multiple of a block)
    (1, 40, 8, 24, 2),
    (3, 72, 4, 40, 1),
    (17, 48, 8, 24, 3),
    (40, 40, 6, 16, 2),
]


def _inputs(t: int, h: int, e: int, i: int, k: int, case: str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    weights = torch.rand(t, k, generator=gen)
    return x, w13, w2, weights, routing(case, t, e, k, gen)


@pytest.mark.parametrize("case", ["random", "same", "one-hot"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_kernel_matches_the_reference(shape: tuple[int, ...], case: str) -> None:
    x, w13, w2, weights, ids = _inputs(*shape, case, seed=1)
    got = kernels.moe(x, w13, w2, weights, ids)
    want = experts_f64(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # batch-invariant: a token's output is bitwise the same alone
    for r in (0, shape[0] - 1):
        assert torch.equal(kernels.moe(x[r : r + 1], w13, w2, weights[r : r + 1], ids[r : r + 1])[0], got[r])


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("case", ["random", "same", "one-hot"])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_moe_matches_the_reference(shape: tuple[int, ...], case: str) -> None:
    """Under the interpreter: the device-side sort and padding, both grouped GEMMs, the routing
    weights (and their renormalization) and the k-sum (and a residual add) in the down kernel's
    epilogue, with 16- and 32-row tiles (the down GEMM's own launch shape in the second)."""
    from minisgl.kernels.triton.moe import MoeConfig, fused_moe

    x, w13, w2, weights, ids = _inputs(*shape, case, seed=2)
    on = [t.to(DEV) for t in (x, w13, w2, weights, ids)]
    res = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    for cfg, down in ((None, None), (MoeConfig(32, 32, 32, 4, 1), MoeConfig(32, 64, 16, 4, 1))):
        for renormalize in (False, True):
            w = weights / weights.sum(-1, keepdim=True) if renormalize else weights
            want = experts_f64(x, w13, w2, w, ids)
            got = fused_moe(*on, renormalize, cfg, down=down).cpu()
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
            added = fused_moe(
                *on, renormalize, cfg, residual=res.clone().to(DEV), down=down
            ).cpu()  # in place
            torch.testing.assert_close(added.double(), want + res.double(), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("tokens", [1, 5, 20])
def test_routed_moe_routes_as_the_stable_rule(tokens: int) -> None:
    """From router logits with exact ties: routed inside the alignment kernel (up to 16 tokens) or
    by the routing kernel (more), the experts of a stable descending sort, the output of the
    reference on that routing."""
    from minisgl.kernels.triton.moe import routed_moe

    h, e, i, k = 24, 8, 16, 3
    x, w13, w2, _, _ = _inputs(tokens, h, e, i, k, "random", seed=7)
    logits = torch.randn(tokens, e, generator=torch.Generator().manual_seed(8))
    logits[:, 3] = logits[:, 1]  # a tie in every row
    logits[0] = 0.5  # every expert tied
    for renormalize in (False, True):
        out, ids = routed_moe(x.to(DEV), logits.to(DEV), w13.to(DEV), w2.to(DEV), k, renormalize)
        want_w, want_ids = stable_topk(torch.softmax(logits, -1), k)
        if renormalize:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        assert torch.equal(ids.cpu(), want_ids)
        torch.testing.assert_close(
            out.cpu().double(), experts_f64(x, w13, w2, want_w, want_ids), atol=2e-5, rtol=2e-5
        )


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize(("tokens", "e", "h"), [(1, 8, 600), (5, 20, 40), (16, 8, 24)])
def test_routed_moe_from_router_routes_as_the_stable_rule(tokens: int, e: int, h: int) -> None:
    """A decode batch's router in one launch (logits over slices of H summed by the last program,
    the routing, the alignment): the experts of a stable descending sort of the logits, exact ties
    (equal router rows; a zero token: every expert) to the lower index, and the reference's output.
    Integer x and router: every logit is exact, so ties are ties in both."""
    from minisgl.kernels.triton.moe import routed_moe_from_router

    i, k = 16, 3
    gen = torch.Generator().manual_seed(tokens * e + h)
    _, w13, w2, _, _ = _inputs(tokens, h, e, i, k, "random", seed=9)
    x = torch.randint(-1, 2, (tokens, h), generator=gen).float()
    router = torch.randint(-1, 2, (e, h), generator=gen).float()
    router[3] = router[1]  # a tie in every row
    x[0] = 0.0  # every expert tied
    logits = x @ router.T  # exact: small integers
    for renormalize in (False, True):
        out, ids = routed_moe_from_router(x.to(DEV), router.to(DEV), w13.to(DEV), w2.to(DEV), k, renormalize)
        want_w, want_ids = stable_topk(torch.softmax(logits, -1), k)
        if renormalize:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        assert torch.equal(ids.cpu(), want_ids)
        want = experts_f64(x, w13, w2, want_w, want_ids)
        torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=2e-5)
        res = torch.randn(x.shape, generator=gen)
        added, _ = routed_moe_from_router(
            x.to(DEV), router.to(DEV), w13.to(DEV), w2.to(DEV), k, renormalize, res.clone().to(DEV)
        )
        torch.testing.assert_close(added.cpu().double(), want + res.double(), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize(
    ("tokens", "e", "h"),
    [
        (1, 8, 40),
        # 16 s in Triton's interpreter: `make test-slow` on the CPU (one token's path: the case above)
        pytest.param(1, 8, 600, marks=[pytest.mark.slow] if DEV == "cpu" else []),
        pytest.param(
            1, 128, 2048, marks=pytest.mark.skipif(DEV == "cpu", reason="Qwen3-30B-A3B's: GPU only")
        ),
        # 11 s in the interpreter: `make test-slow` on the CPU (several tokens: the case below)
        pytest.param(3, 20, 40, marks=[pytest.mark.slow] if DEV == "cpu" else []),
        (16, 8, 24),
    ],
)
def test_router_launch_normalizes_as_the_rmsnorm_kernel(
    tokens: int, e: int, h: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RMSNorm inside the router's launch (`norm`): the normed x, the routing and the output are
    the bits of the RMSNorm kernel followed by the router's launch on its output; one token's
    blocks (no sort) give the bits of the sorted alignment (`routed_moe` from the same logits). The
    grouped GEMMs at one token too (MINISGL_MOE_B1=0; the row GEMVs: the test after this one)."""
    monkeypatch.setenv("MINISGL_MOE_B1", "0")
    from minisgl.kernels.triton.elementwise import rmsnorm
    from minisgl.kernels.triton.moe import fused_moe, moe_config, route_and_align, routed_moe_from_router

    i, k = 16, min(8, e // 2)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(tokens * e + h)
    _, w13, w2, _, _ = _inputs(tokens, h, e, i, k, "random", seed=11)
    x = torch.randn(tokens, h, generator=gen)
    router = torch.randn(e, h, generator=gen) / h**0.5
    norm_w = 1.0 + 0.1 * torch.randn(h, generator=gen)
    x, router, w13, w2, norm_w = (t.to(DEV, dtype) for t in (x, router, w13, w2, norm_w))
    xn_want = rmsnorm(x, norm_w, 1e-6)
    for renormalize in (False, True):
        res = torch.randn(x.shape, generator=gen).to(DEV, dtype)
        want, want_ids = routed_moe_from_router(xn_want, router, w13, w2, k, renormalize, res.clone())
        xn = torch.empty_like(x)
        _, ids_n, _ = route_and_align(x, router, k, renormalize, 16, (norm_w, 1e-6, xn))
        assert torch.equal(xn, xn_want) and torch.equal(ids_n, want_ids)
        h_inout = x.clone()  # the residual stream: normed, routed and updated in place
        got, ids = routed_moe_from_router(h_inout, router, w13, w2, k, renormalize, h_inout, (norm_w, 1e-6))
        assert got is h_inout and torch.equal(ids, want_ids)
        want_h, _ = routed_moe_from_router(xn_want, router, w13, w2, k, renormalize, x.clone())
        assert torch.equal(got, want_h)
        weights, ids, aligned = route_and_align(xn_want, router, k, renormalize, 16)
        if tokens == 1:  # one token's blocks in slot order, not sorted
            assert aligned[1][:k].tolist() == ids[0].tolist() and int(aligned[2]) == 16 * k
        one = fused_moe(
            xn_want, w13, w2, weights, ids, False, moe_config(tokens * k, dtype), res.clone(), aligned
        )
        sorted_out = fused_moe(
            xn_want, w13, w2, weights, ids, False, moe_config(tokens * k, dtype), res.clone()
        )
        assert torch.equal(one, sorted_out) and torch.equal(one, want)


ROW_CASES = [  # (tokens, hidden, experts, intermediate, top-k), routing, gate/up's and down's launch shapes
    ((1, 40, 8, 24, 2), "random", None, None),
    ((1, 72, 4, 40, 1), "one-hot", (2, 16, 4, 3), (8, 16, 4)),  # K in steps, blocks past the end
    ((1, 64, 16, 24, 8), "random", (4, 32, 4, 2), (4, 16, 4)),  # 2 blocks of rows a program
]


@pytest.mark.slow  # the opt-in row experts (MINISGL_MOE_B1=1) under the interpreter: `make test-slow`
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize(("shape", "case", "up", "down"), ROW_CASES)
def test_triton_experts_one_token_match_the_reference(
    shape: tuple[int, ...], case: str, up: tuple[int, ...] | None, down: tuple[int, ...] | None
) -> None:
    """One token's experts as row GEMVs (`moe.experts`): gate/up a block of rows of one expert a
    program, down all K experts' rows a program with the k-sum in its registers; blocks of rows past
    the end, K in one step or several (not a power of two), the weights renormalized or not, with and
    without the residual, against float64; on the GPU the same bits on a second call (no atomics)."""
    from minisgl.kernels.triton.moe.experts import ExpertRowConfig, experts_one_token

    up_cfg = ExpertRowConfig(*up) if up else None
    down_cfg = ExpertRowConfig(*down) if down else None
    x, w13, w2, weights, ids = _inputs(*shape, case, seed=sum(shape))
    on = [t.to(DEV) for t in (x, w13, w2, weights, ids)]
    res = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    for renormalize in (False, True):
        w = weights / weights.sum(-1, keepdim=True) if renormalize else weights
        want = experts_f64(x, w13, w2, w, ids)
        got = experts_one_token(*on, renormalize, up=up_cfg, down=down_cfg).cpu()
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
        if DEV == "cuda":  # (the interpreter's numpy sums may round by the arrays' alignment)
            assert torch.equal(experts_one_token(*on, renormalize, up=up_cfg, down=down_cfg).cpu(), got)
        added = experts_one_token(*on, renormalize, res.clone().to(DEV), up=up_cfg, down=down_cfg).cpu()
        torch.testing.assert_close(added.double(), want + res.double(), atol=2e-5, rtol=2e-5)


@pytest.mark.slow  # the opt-in routing inside gate/up under the interpreter: `make test-slow`
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize(("e", "h", "k"), [(8, 24, 8)])  # interpreted: 10-20 s a case
def test_one_token_routes_in_gate_up_as_the_router_tail(
    e: int, h: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One token, routed inside gate/up's programs from the router's partial logits
    (MINISGL_MOE_B1_ROUTE): the weights and ids of the router's own tail bit for bit, exact ties
    (integer x and router) to the lower index; the op's output (row GEMVs, routed either way) that of
    the reference on that routing and of the grouped GEMMs (MINISGL_MOE_B1=0); with the RMSNorm in
    the router's launch, the same routing and output as the grouped path's."""
    from minisgl.kernels.triton.moe.experts import RouterPartials, experts_one_token
    from minisgl.kernels.triton.moe.fused import _router_launch, route_and_align, routed_moe_from_router

    i = 16
    gen = torch.Generator().manual_seed(e * h + k)
    _, w13, w2, _, _ = _inputs(1, h, e, i, k, "random", seed=13)
    x = torch.randint(-1, 2, (1, h), generator=gen).float()
    router = torch.randint(-1, 2, (e, h), generator=gen).float()
    router[3] = router[1]  # a tie
    norm_w = 1.0 + 0.1 * torch.randn(h, generator=gen)
    res = torch.randn(1, h, generator=gen)
    x, router, w13, w2, norm_w, res = (t.to(DEV) for t in (x, router, w13, w2, norm_w, res))
    for renormalize in (False, True):
        want_w, want_ids, _ = route_and_align(x, router, k, renormalize, 16)
        _, _, _, partial = _router_launch(x, router, k, renormalize, 16, None, tail=False)
        weights, ids = torch.empty_like(want_w), torch.empty_like(want_ids)
        route = RouterPartials(partial, e, renormalize)
        out = experts_one_token(x, w13, w2, weights, ids, False, res.clone(), route)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
        ref = experts_f64(x.cpu(), w13.cpu(), w2.cpu(), want_w.cpu(), want_ids.cpu()) + res.cpu().double()
        torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)
        outs = {}
        for b1, in_gate_up in (("0", "0"), ("1", "0"), ("1", "1")):
            monkeypatch.setenv("MINISGL_MOE_B1", b1)
            monkeypatch.setenv("MINISGL_MOE_B1_ROUTE", in_gate_up)
            got, got_ids = routed_moe_from_router(x, router, w13, w2, k, renormalize, res.clone())
            stream = x.clone()
            normed, normed_ids = routed_moe_from_router(
                stream, router, w13, w2, k, renormalize, stream, (norm_w, 1e-6)
            )
            assert torch.equal(got_ids, want_ids)
            outs[b1 + in_gate_up] = (got, normed.clone(), normed_ids)
        for got, normed, normed_ids in outs.values():
            torch.testing.assert_close(got.cpu().double(), ref, atol=2e-5, rtol=2e-5)
            assert torch.equal(normed_ids, outs["00"][2])
            torch.testing.assert_close(normed, outs["00"][1], atol=2e-5, rtol=2e-5)
        assert torch.equal(outs["10"][0], outs["11"][0]) and torch.equal(outs["10"][1], outs["11"][1])


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (5, 60, 4), (6, 128, 8), (3, 4, 3), (40, 16, 4)])
def test_route_topk_takes_the_lower_index_on_ties(t: int, e: int, k: int) -> None:
    """The routing kernel: softmax, top-k and renormalization, exactly tied probabilities (equal
    logits, a row all equal) taken in the order of a stable descending sort (lower index first)."""
    from minisgl.kernels.triton.moe.route import route_topk

    gen = torch.Generator().manual_seed(t * e + k)
    logits = torch.randn(t, e, generator=gen)
    logits[:, 1], logits[:, e - 1] = logits[:, 0], logits[:, 2]  # two tied pairs in every row
    logits[0] = 0.25  # every expert tied
    for renormalize in (False, True):
        weights, ids = route_topk(logits.to(DEV), k, renormalize)
        want_w, want_ids = stable_topk(torch.softmax(logits, -1), k)
        if renormalize:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        assert torch.equal(ids.cpu(), want_ids) and ids.dtype == torch.int64
        torch.testing.assert_close(weights.cpu(), want_w, atol=1e-6, rtol=1e-6)


def stable_topk(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA backend's tie rule in torch: the k largest, equal ones by the lower index."""
    values, ids = probs.sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


class StableTieOps(TorchOps):
    """The reference ops with the CUDA backend's routing rule on ties (a stable sort, not topk)."""

    def route(
        self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = stable_topk(torch.softmax(F.linear(x, router), -1, dtype=torch.float32), top_k)
        return (weights / weights.sum(-1, keepdim=True) if renormalize else weights), ids


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_align_pairs_sorts_and_pads_on_the_device() -> None:
    from minisgl.kernels.triton.moe import align_pairs

    gen = torch.Generator().manual_seed(3)
    for p, e, bm in ((1, 8, 16), (7, 4, 4), (300, 16, 16), (64, 3, 32)):
        ids = torch.randint(0, e, (p,), generator=gen)
        ids[: p // 2] = e - 1  # skewed: half the pairs on the last expert
        sorted_ids, block_expert, total = (t.cpu() for t in align_pairs(ids.to(DEV), e, bm))
        counts = torch.bincount(ids, minlength=e)
        assert int(total) == int(((counts + bm - 1) // bm * bm).sum())
        assert sorted_ids.shape[0] == p + min(p, e) * (bm - 1)  # the grid's worst case
        used = sorted_ids[: int(total)]
        assert sorted(used[used < p].tolist()) == list(range(p))  # every pair once
        assert torch.all(sorted_ids[int(total) :] == p)  # padding past the used rows
        for b in range(int(total) // bm):
            rows = used[b * bm : (b + 1) * bm]
            real = rows[rows < p].long()
            assert len(real) > 0 and torch.all(ids[real] == block_expert[b])  # one expert per block


# ---------------------------------------------------------------------------------------------------
# Tensor parallelism


@pytest.mark.timeout(240)
def test_two_ranks_match_one(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The reference ops on two gloo ranks: each rank's logits equal one rank's."""
    from test_models_tp import check_ranks_match_one, run_ranks

    dirs = [moe_dirs[c] for c in ("qwen3-moe", "mixtral", "qwen2-moe-shared")]
    check_ranks_match_one(dirs, run_ranks(dirs, tmp_path, 2, "gloo", "cpu"), 2)


@pytest.mark.timeout(300)
def test_llm_tp2_gives_the_tokens_of_tp1(moe_dirs: dict[str, Path]) -> None:
    from minisgl import LLM

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o["token_ids"] for o in LLM(str(moe_dirs["qwen3-moe"]), device="cpu").generate(PROMPTS, params)]
    with LLM(str(moe_dirs["qwen3-moe"]), device="cpu", tp=2) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, params)] == want


# ---------------------------------------------------------------------------------------------------
# The offline LLM: prefix cache, overlap scheduling, a grammar


def test_llm_prefix_cache_overlap_and_grammar(tmp_path: Path) -> None:
    from minisgl import LLM
    from minisgl.grammar import json_schema_grammar

    d = save_tiny_moe("qwen3-moe", tmp_path, vocab_size=300, eos_token_id=256, bos_token_id=257)
    save_byte_tokenizer(d, 300)
    prompts = [list(range(40, 80)), list(range(40, 70)) + [5, 6]]  # a shared prefix of 30 tokens
    want, _ = hf_greedy(d, prompts, 10)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for overlap in (False, True):
        llm = LLM(str(d), device="cpu", overlap_schedule=overlap, page_size=4)
        assert llm.overlap is overlap
        first = llm.generate(prompts, greedy)
        again = llm.generate(prompts, greedy)  # now from the prefix cache
        assert [o["token_ids"] for o in first] == [o["token_ids"] for o in again] == want
        assert all(o["cached_tokens"] >= 28 for o in again)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    held = SamplingParams(temperature=0, max_tokens=40, grammar=json_schema_grammar(schema))
    out = llm.generate([[40, 41, 42]], held)[0]
    assert out["finish_reason"] == "stop", out
    assert isinstance(json.loads(out["text"])["n"], int)


# ---------------------------------------------------------------------------------------------------
# GGUF files with stacked experts (llama.cpp's layout), written by the gguf package


def _gguf_name(hf: str, arch: str) -> tuple[str, int | None]:
    """(GGUF name, expert index or None) of a Hugging Face tensor name, as llama.cpp converts it."""
    from test_gguf import GGUF_NAMES

    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in globals_ or hf == "lm_head.weight":
        return globals_.get(hf, "output.weight"), None
    _, _, layer, rest = hf.split(".", 3)
    moe = {
        "mlp.gate": "ffn_gate_inp",
        "block_sparse_moe.gate": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    }
    part, kind = rest.rsplit(".", 1)
    if ".experts." in part:
        _, e, proj = part.rsplit(".", 2)
        stacked = {
            "gate_proj": "gate",
            "w1": "gate",
            "up_proj": "up",
            "w3": "up",
            "down_proj": "down",
            "w2": "down",
        }
        return f"blk.{layer}.ffn_{stacked[proj]}_exps.{kind}", int(e)
    return f"blk.{layer}.{moe.get(part) or GGUF_NAMES[part]}.{kind}", None


def write_moe_gguf(hf_dir: Path, out: Path, arch: str, qtype: str = "F32") -> None:
    """A GGUF of a tiny MoE checkpoint: experts stacked per layer (in `qtype`), the rest F32, Llama's
    q/k rows permuted as llama.cpp permutes them; the byte-level tokenizer of test_gguf."""
    import gguf
    from test_gguf import gguf_writer, llamacpp_permute

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    w = gguf_writer(out, arch, cfg)
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in hf.items():
        gname, e = _gguf_name(name, arch)
        a = t.numpy().astype(np.float32)
        if e is not None:
            experts.setdefault(gname, {})[e] = a
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            a = llamacpp_permute(a, heads)
        w.add_tensor(gname, np.ascontiguousarray(a.reshape(-1) if gname.endswith("inp_shexp.weight") else a))
    qt = gguf.GGMLQuantizationType[qtype]
    for gname, per_expert in experts.items():
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])  # (E, rows, cols)
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, stacked)
        else:
            w.add_tensor(gname, gguf.quants.quantize(stacked, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_CASES = {"qwen3-moe": "qwen3moe", "mixtral": "llama", "qwen2-moe-shared": "qwen2moe"}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_moe_gives_the_same_model(case: str, tmp_path: Path) -> None:
    import minisgl.checkpoint.gguf_convert as gc

    hf_dir = save_tiny_moe(case, tmp_path / "hf", vocab_size=259)
    write_moe_gguf(hf_dir, tmp_path / "m.gguf", GGUF_CASES[case])
    out = gc.convert_gguf_cached(tmp_path / "m.gguf", tmp_path / "cache", progress=False)
    cfg, want_cfg = ModelConfig.from_dir(out), ModelConfig.from_dir(hf_dir)
    for c in (cfg, want_cfg):
        assert c.moe is not None
    assert (cfg.architecture, cfg.attention_bias) == (want_cfg.architecture, want_cfg.attention_bias)
    assert [cfg.moe.is_sparse(i) for i in range(2)] == [want_cfg.moe.is_sparse(i) for i in range(2)]
    fields = ("num_experts", "top_k", "intermediate_size", "norm_topk_prob", "shared_intermediate_size")
    assert [getattr(cfg.moe, f) for f in fields] == [getattr(want_cfg.moe, f) for f in fields]
    want = run_prompts(load_model(hf_dir, torch.float32, "cpu", progress=False)[0], PROMPTS)
    got = run_prompts(load_model(out, torch.float32, "cpu", progress=False)[0], PROMPTS)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_gguf_quantized_experts_are_dequantized_per_expert(tmp_path: Path) -> None:
    import gguf

    import minisgl.checkpoint.gguf_convert as gc

    hf_dir = save_tiny_moe("qwen3-moe", tmp_path / "hf", vocab_size=259)
    write_moe_gguf(hf_dir, tmp_path / "m.gguf", "qwen3moe", qtype="Q8_0")
    from minisgl.checkpoint.gguf_weights import hf_state_dict

    out = gc.convert_gguf_cached(tmp_path / "m.gguf", tmp_path / "cache", progress=False)
    got = hf_state_dict(out, json.loads((out / "config.json").read_text()))
    hf = load_file(str(hf_dir / "model.safetensors"))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for e in (0, 5):
        name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        want = gguf.quants.dequantize(gguf.quants.quantize(hf[name].numpy(), q8), q8)
        assert np.array_equal(got[name].numpy(), want) and not np.array_equal(want, hf[name].numpy())
    want_logits = hf_logits(hf_dir, PROMPTS[:1])[0]
    for native in (False, True):  # native: the dense matrices in their Q8_0 blocks, the experts float
        model = load_model(out, torch.float32, "cpu", progress=False, native=native)[0]
        (logits,) = run_prompts(model, PROMPTS[:1])
        torch.testing.assert_close(logits, want_logits, atol=0.05, rtol=0.05)
