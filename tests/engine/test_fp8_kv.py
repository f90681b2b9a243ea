"""The fp8 KV cache (`--kv-cache-dtype fp8_e4m3`): the pool stores value / scale in fp8 per KV head,
the torch and Triton backends attend over what it holds (checked against dense attention over the
rounded K/V), the engine sizes the pool in fp8 bytes and takes a checkpoint's scales."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models_support import save_tiny_hf_model

from minisgl.attention import AttnInput, TorchAttentionBackend, create_attention_backend
from minisgl.kernels.triton import triton_available
from minisgl.kvcache import KVPool, PageAllocator, PageTable
from minisgl.kvcache.pool import FP8_KV

HQ, HKV, D, PS = 6, 2, 16, 4


def _pool(dev: str, scales: list[torch.Tensor]) -> KVPool:
    return KVPool(2, 32, PS, HKV, D, FP8_KV, dev, scales=scales, value_dtype=torch.float32)


def _rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (T, Hkv, D) as an fp8 pool with per-head `scale` (Hkv,) holds it."""
    return (x / scale[None, :, None]).clamp(-448, 448).to(FP8_KV).float() * scale[None, :, None]


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    g = HQ // HKV
    k, v = k.repeat_interleave(g, dim=1).double(), v.repeat_interleave(g, dim=1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) / math.sqrt(D)
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).float()


def test_pool_stores_fp8_and_loads_the_scaled_values() -> None:
    scales = [torch.tensor([[0.5, 2.0], [0.25, 1.0]]), torch.ones(2, HKV)]
    pool = _pool("cpu", scales)
    assert pool.k[0].dtype == FP8_KV and pool.quantized and pool.value_dtype == torch.float32
    k, v = torch.randn(3, HKV, D) * 10, torch.randn(3, HKV, D) * 10
    slots = torch.tensor([5, 0, 17])
    pool.store(0, slots, k, v)
    lk, lv = pool.load(0, slots, torch.float32)
    assert torch.equal(lk, _rounded(k, scales[0][0])) and torch.equal(lv, _rounded(v, scales[0][1]))
    assert torch.equal(pool.k[0][5].float(), (k[0] / scales[0][0][:, None]).to(FP8_KV).float())
    with pytest.raises(ValueError, match="scales"):
        KVPool(2, 4, PS, HKV, D, FP8_KV, "cpu", scales=[torch.ones(2, 3)] * 2)


@pytest.mark.parametrize("path", ["copy", "gather", "triton", "triton_packed"])
def test_backends_attend_over_the_rounded_kv(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill, prefill over a prefix, decode steps over an fp8 pool with unequal per-head scales:
    each output equals dense attention over the K/V as the pool rounded them. `triton_packed`: the
    decode steps in `decode.packed`'s kernel (its default taken at any batch size)."""
    if path.startswith("triton") and not triton_available():
        pytest.skip("triton is not installed")
    if path == "triton_packed":
        from minisgl.kernels.triton.decode import packed

        monkeypatch.setattr(packed, "_PER_SM", 0.0)
        monkeypatch.setattr(packed, "_MODE", "all")  # the split counts the backend picks too
        path = "triton"
    torch.manual_seed(0)
    dev = "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"
    scales = [torch.tensor([[0.02, 0.05], [0.03, 0.01]]), torch.tensor([[0.04, 0.02], [0.01, 0.05]])]
    pool = _pool(dev, scales)
    table = PageTable(PageAllocator(32), PS, max_rows=4, max_seq_len=64)
    if path == "triton":
        from minisgl.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend(pool, HQ, HKV, D, 4, table.max_pages_per_row)
    else:
        backend = TorchAttentionBackend(pool, HQ, HKV, D)
    bsz = 2
    rows = [table.alloc_row(uid) for uid in range(bsz)][::-1]
    hist: list[list[list[torch.Tensor]]] = [
        [[torch.empty(0, HKV, D)] * 2 for _ in range(bsz)] for _ in range(2)
    ]
    cached = [0] * bsz
    for ext, is_decode in [([5, 3], False), ([2, 6], False)] + [([1, 1], True)] * 3:
        for b in range(bsz):
            assert table.reserve(rows[b], cached[b] + ext[b])
        slots = [
            int(table.table[rows[b], p // PS]) * PS + p % PS
            for b in range(bsz)
            for p in range(cached[b], cached[b] + ext[b])
        ]
        seq = [c + e for c, e in zip(cached, ext, strict=True)]
        backend.prepare(
            AttnInput(seq, ext, torch.tensor(slots), table.table[torch.tensor(rows)], is_decode,
                      rows if path != "gather" else None)
        )  # fmt: skip
        total = sum(ext)
        for layer in range(2):
            q = torch.randn(total, HQ, D)
            k, v = torch.randn(total, HKV, D) * 2, torch.randn(total, HKV, D) * 2
            out = backend.forward(q.to(dev), k.to(dev), v.to(dev), layer).cpu()
            off = 0
            for b in range(bsz):
                n = ext[b]
                hk, hv = hist[layer][b]
                hk = torch.cat([hk, _rounded(k[off : off + n], scales[layer][0])])
                hv = torch.cat([hv, _rounded(v[off : off + n], scales[layer][1])])
                hist[layer][b] = [hk, hv]
                ref = _dense(q[off : off + n], hk, hv, cached[b])
                torch.testing.assert_close(out[off : off + n], ref, atol=2e-4, rtol=2e-4)
                off += n
        cached = seq


def test_the_cpu_backend_refuses_an_fp8_pool_and_auto_takes_the_reference() -> None:
    pool = _pool("cpu", [torch.ones(2, HKV)] * 2)
    with pytest.raises(ValueError, match="fp8 KV cache"):
        create_attention_backend("cpu", pool, HQ, HKV, D, 4, 16)
    assert create_attention_backend("auto", pool, HQ, HKV, D, 4, 16).name == "torch"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("kvfp8"), tie=False)


def test_engine_sizes_an_fp8_pool_in_fp8_bytes(model_dir: Path) -> None:
    from minisgl.llm import LLM

    budget = 1 << 20
    plain = LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory=budget, cuda_graph_max_bs=0)
    fp8 = LLM(
        str(model_dir), device="cpu", dtype="float32", kv_cache_memory=budget, kv_cache_dtype="fp8_e4m3"
    )
    assert fp8.engine.pool.quantized and fp8.engine.attn_backend.name == "torch"
    assert fp8.engine.num_pages == 4 * plain.engine.num_pages  # 1 byte a value against float32's 4
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    from minisgl import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    a = [o["token_ids"] for o in plain.generate(prompts, params)]
    b = [o["token_ids"] for o in fp8.generate(prompts, params)]
    assert all(len(x) == 6 for x in b)
    same = sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
    assert same >= 9, (a, b)  # a tiny random model: most greedy tokens survive fp8 K/V


def test_engine_takes_the_checkpoints_kv_scales(model_dir: Path, tmp_path: Path) -> None:
    """Per-tensor `self_attn.k_scale` / `v_scale` (compressed-tensors' names) and a per-head
    `kv_scale` reach the pool; without `--kv-cache-dtype fp8_e4m3` they are read past."""
    import shutil

    from minisgl.llm import LLM

    d = Path(shutil.copytree(model_dir, tmp_path / "m"))
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor([0.125, 2.0])  # one per KV head
    save_file(tensors, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    llm = LLM(str(d), device="cpu", num_pages=64, kv_cache_dtype="fp8_e4m3")
    pool = llm.engine.pool
    assert pool.scales is not None
    assert pool.scales[0].tolist() == [[0.5, 0.5], [0.25, 0.25]]
    assert pool.scales[1].tolist() == [[0.125, 2.0], [0.125, 2.0]]
    assert cfg["num_key_value_heads"] == 2
    plain = LLM(str(d), device="cpu", num_pages=64)
    assert plain.engine.pool.scales is None and not plain.engine.pool.quantized
