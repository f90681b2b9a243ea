"""GGUF files: a synthetic GGUF written the way llama.cpp writes one (its derived directory and cache,
its weights read in place, kept in their formats or dequantized, q/k rows back in HF's order), and
the embedded SmolLM2 model (config, tensors against the file, logits vs transformers, a real answer,
the quantized path against the float32 reference)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_models_support import run_prompts, save_tiny_hf_model

import minisgl.checkpoint.gguf_convert as gc
from minisgl.backends import bind_ops, create_ops
from minisgl.checkpoint.gguf_weights import hf_row_order
from minisgl.models import GGUFConversionError, ModelConfig, load_model, resolve_model_path
from minisgl.models.reference import transformers_model
from minisgl.quant import QuantizedWeight
from minisgl.utils.hf import apply_chat_template, load_tokenizer

if TYPE_CHECKING:
    import gguf

# ---------------------------------------------------------------------------------------------------
# A synthetic GGUF


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to attn_q / attn_k rows (per head: halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def _byte_level_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return sorted(set(bytes_to_unicode().values()))


def gguf_writer(out: Path, arch: str, cfg: dict) -> gguf.GGUFWriter:
    """A GGUFWriter with the model metadata of HF config `cfg` and a byte-level tokenizer (vocab 259)."""
    import gguf

    tokens = ["<|endoftext|>", "<|im_end|>"] + _byte_level_vocab() + ["hi"]
    assert len(tokens) == cfg["vocab_size"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["h i"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    return w


def write_tiny_gguf(
    hf_dir: Path, out: Path, arch: str = "llama", quant: str | None = None
) -> dict[str, np.ndarray]:
    """A GGUF of the tiny HF checkpoint (F32, or its matrices in `quant`, a gguf type name the gguf
    package quantizes, e.g. Q8_0), q/k permuted like llama.cpp; returns the HF tensors."""
    import gguf
    import gguf.quants as gq

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    w = gguf_writer(out, arch, cfg)
    for name, t in hf.items():
        a = t.astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[part]}.{kind}"
            if arch != "llama" or kind != "weight":
                pass  # llama.cpp permutes Llama's q/k weights only
            elif part == "self_attn.q_proj":
                a = llamacpp_permute(a, cfg["num_attention_heads"])
            elif part == "self_attn.k_proj":
                a = llamacpp_permute(a, cfg["num_key_value_heads"])
        if quant is not None and a.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(gname, gq.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    hf_dir = save_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("hf"), tie=False, vocab=259)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(hf_dir, path)


def test_gguf_weights_are_read_in_place(tiny_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The derived directory holds config, tokenizer and a link to the file, no weights; the float
    path loads exactly the HF tensors (q/k rows back in HF's order), the native path keeps every
    matrix as a QuantizedWeight over the file that dequantizes to the same, and both give logits."""
    path, hf = tiny_gguf
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    out = resolve_model_path(path, progress=False)
    assert out.parent == tmp_path / "cache"
    assert (out / "model.gguf").resolve() == path.resolve() and not list(out.glob("*.safetensors"))
    cfg = ModelConfig.from_dir(out)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM",
        2,
        4,
        2,
    )
    assert not cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-6 and cfg.vocab_size == 259
    assert 1 in cfg.eos_token_ids and cfg.bos_token_id == 0
    tok = load_tokenizer(out)
    assert tok.encode("hi", add_special_tokens=False) == [258]
    assert apply_chat_template(tok, [{"role": "user", "content": "hi"}]) == [258, 1]
    model, _ = load_model(out, torch.float32, "cpu", progress=False)
    native, _ = load_model(out, torch.float32, "cpu", progress=False, native=True)
    layer, nlayer = model.model.layers[1], native.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split([64, 32, 32])
    assert np.array_equal(q.numpy(), hf["model.layers.1.self_attn.q_proj.weight"])  # un-permuted
    assert np.array_equal(k.numpy(), hf["model.layers.1.self_attn.k_proj.weight"])
    assert np.array_equal(model.lm_head.weight.numpy(), hf["lm_head.weight"])
    for m, n in [
        (layer.self_attn.qkv_proj, nlayer.self_attn.qkv_proj),
        (layer.mlp.down_proj, nlayer.mlp.down_proj),
    ]:
        assert isinstance(n.weight, QuantizedWeight)
        assert torch.equal(n.weight.dequantize(), m.weight)
    assert torch.equal(nlayer.input_layernorm.weight, layer.input_layernorm.weight)  # norms: float params
    (want,) = run_prompts(model, [[5, 6, 7]])
    (got,) = run_prompts(native, [[5, 6, 7]])  # the reference ops dequantize: the same model
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_quantized_gguf_native_and_float(tmp_path: Path) -> None:
    """A Q8_0 file: the native model (the CPU kernels on the blocks) against the float32 one."""
    hf_dir = save_tiny_hf_model("LlamaForCausalLM", tmp_path / "hf", tie=True, vocab=259)
    write_tiny_gguf(hf_dir, tmp_path / "q8.gguf", quant="Q8_0")
    out = gc.convert_gguf_cached(tmp_path / "q8.gguf", tmp_path / "cache", progress=False)
    ref, _ = load_model(out, torch.float32, "cpu", progress=False)
    native, _ = load_model(out, torch.float32, "cpu", progress=False, native=True)
    assert native.lm_head.weight is native.model.embed_tokens.weight  # tied: one copy
    bind_ops(native, create_ops("cpu", "cpu"))
    prompts = [[5, 6, 7, 8], [100, 3]]
    for got, want in zip(run_prompts(native, prompts), run_prompts(ref, prompts), strict=True):
        torch.testing.assert_close(got, want, atol=0.05 * want.abs().max(), rtol=0)


@pytest.mark.parametrize(
    ("arch", "gguf_arch"), [("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3")]
)
def test_qwen_gguf_gives_the_same_model(arch: str, gguf_arch: str, tmp_path: Path) -> None:
    """Qwen2 (q/k/v bias, tied) and Qwen3 (q/k norm, head_dim != hidden / heads): not permuted by llama.cpp."""
    extra = {"head_dim": 32} if gguf_arch == "qwen3" else {}
    hf_dir = save_tiny_hf_model(arch, tmp_path / "hf", tie=gguf_arch == "qwen2", vocab=259, **extra)
    write_tiny_gguf(hf_dir, tmp_path / "m.gguf", arch=gguf_arch)
    out = gc.convert_gguf_cached(tmp_path / "m.gguf", tmp_path / "cache", progress=False)
    assert ModelConfig.from_dir(out).architecture == arch
    prompts = [[5, 6, 7, 8], [100, 3]]
    want = run_prompts(load_model(hf_dir, torch.float32, "cpu", progress=False)[0], prompts)
    for native in (False, True):
        got = run_prompts(load_model(out, torch.float32, "cpu", progress=False, native=native)[0], prompts)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_conversion_is_cached(tiny_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_gguf
    first = gc.convert_gguf_cached(path, tmp_path, progress=False)

    def fail(*args, **kwargs) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gc, "convert_gguf", fail)
    assert gc.convert_gguf_cached(path, tmp_path, progress=False) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary directories left
    os.utime(path, ns=(0, 0))  # a changed file is a new cache entry
    with pytest.raises(AssertionError, match="converted twice"):
        gc.convert_gguf_cached(path, tmp_path, progress=False)


def test_a_copy_of_the_file_shares_the_entry_and_outlives_the_original(tiny_gguf, tmp_path: Path) -> None:
    """Two virtualenvs' embedded models (or a `cp -a`) have the same name, size and mtime: one cache
    entry, whose model.gguf must name a file that still exists once the first copy is deleted."""
    path, _ = tiny_gguf
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    first, second = shutil.copy2(path, a / path.name), shutil.copy2(path, b / path.name)
    entry = gc.convert_gguf_cached(Path(first), tmp_path / "cache", progress=False)
    assert (entry / "model.gguf").samefile(first)
    os.unlink(first)
    assert gc.convert_gguf_cached(Path(second), tmp_path / "cache", progress=False) == entry
    assert (entry / "model.gguf").samefile(second)
    assert [p.name for p in entry.iterdir() if p.name.startswith(".")] == []  # no link left behind


def test_losing_a_conversion_race_keeps_the_winner(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    """Another process renames its result into place first: ours is discarded, theirs is used."""
    path, _ = tiny_gguf
    real = gc.convert_gguf
    target = gc.cache_dir_for(path, tmp_path)

    def convert_while_other_wins(src: Path, out: Path, progress: bool = True) -> None:
        real(src, out, progress=progress)
        target.mkdir()
        (target / "config.json").write_text("{}")  # the winner's (complete) entry
        (target / "marker").write_text("winner")

    monkeypatch.setattr(gc, "convert_gguf", convert_while_other_wins)
    assert gc.convert_gguf_cached(path, tmp_path, progress=False) == target
    assert (target / "marker").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_bad_gguf_files_are_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"definitely not gguf")
    with pytest.raises(GGUFConversionError, match=r"bad\.gguf: not a readable GGUF"):
        resolve_model_path(bad, progress=False)
    assert not any((tmp_path / "cache").iterdir())  # nothing half-written left behind


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFConversionError, match=r"other\.gguf: GGUF architecture 'gpt2' is not supported"):
        gc.convert_gguf_cached(path, tmp_path / "cache", progress=False)


def test_hf_row_order_inverts_llamacpp_permute() -> None:
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    for heads in (1, 2, 6):
        assert np.array_equal(llamacpp_permute(w, heads)[hf_row_order(48, heads).numpy()], w)
    assert not np.array_equal(llamacpp_permute(w, 2), w)


# ---------------------------------------------------------------------------------------------------
# The embedded default model (its derived directory made once in the user's cache)


@pytest.fixture(scope="module")
def smollm_dir() -> Path:
    return resolve_model_path(None)


def test_embedded_model_conversion(smollm_dir: Path) -> None:
    cfg = ModelConfig.from_dir(smollm_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.tie_word_embeddings) == (49152, 1536, True)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert 2 in cfg.eos_token_ids and cfg.bos_token_id == 1  # <|im_end|> ends a chat turn
    assert sum(f.stat().st_size for f in smollm_dir.iterdir() if f.name != "model.gguf") < 8 << 20
    tok = load_tokenizer(smollm_dir)
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def smollm(smollm_dir: Path):
    return load_model(smollm_dir, torch.float32, "cpu", progress=False)


def test_embedded_model_matches_transformers(smollm_dir: Path, smollm) -> None:
    model, _ = smollm
    tok = load_tokenizer(smollm_dir)
    prompts = [
        tok.encode(t) for t in ("The quick brown fox", "def fibonacci(n):\n    if n", "1, 2, 3, 5, 8,")
    ]
    ours = [lg[-1] for lg in run_prompts(model, prompts)]
    hf = transformers_model(smollm_dir)
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0, -1].float() for p in prompts]
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert int(got.argmax()) == int(want.argmax())


def test_embedded_model_knows_the_capital_of_france(smollm_dir: Path, smollm) -> None:
    model, cfg = smollm
    tok = load_tokenizer(smollm_dir)
    ids = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
    prompt_len = len(ids)
    answer = ""
    for _ in range(12):  # greedy, recomputing the whole sequence (no cache here); stops at Paris or EOS
        (logits,) = run_prompts(model, [ids])
        nxt = int(logits[-1].argmax())
        ids.append(nxt)
        answer = tok.decode(ids[prompt_len:], skip_special_tokens=True)
        if nxt in cfg.eos_token_ids or "Paris" in answer:
            break
    assert "Paris" in answer, answer


# The float32 weights against the GGUF file itself, dequantized here by the formats' definitions
# (ggml's block layouts), not by minisgl.quant: the transformers comparison above reads minisgl's
# dequantization too, so only this catches one that is wrong but self-consistent (a bad layout,
# rows left permuted, a tensor under the wrong name).


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1, block_bytes)


def dequant_q4_1(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Q4_1: blocks of 32 weights = f16 scale d, f16 minimum m, 16 bytes of nibbles (low nibbles
    are weights 0..15, high nibbles 16..31); w = d * q + m."""
    b = _blocks(data, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # (blocks, 32)
    return (d * q + m).reshape(shape)


def dequant_q8_0(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Q8_0: blocks of 32 weights = f16 scale d, 32 int8; w = d * q."""
    b = _blocks(data, 34)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    return (d * b[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)


def test_embedded_model_matches_the_gguf_file(smollm) -> None:
    from gguf import GGUFReader

    from minisgl.models import embedded_gguf_path

    tensors = {t.name: t for t in GGUFReader(embedded_gguf_path()).tensors}
    model, _ = smollm

    def from_gguf(name: str) -> np.ndarray:
        t = tensors[name]
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml lists dimensions innermost first
        kind = t.tensor_type.name
        if kind == "F32":
            return np.asarray(t.data, dtype=np.float32).reshape(shape)
        return {"Q4_1": dequant_q4_1, "Q8_0": dequant_q8_0}[kind](t.data, shape)

    def layer(i: int):  # noqa: ANN202
        return model.model.layers[i]

    heads, kv_heads, d = 9, 3, 64
    pairs = [
        ("token_embd.weight", model.model.embed_tokens.weight, None),  # Q8_0
        ("blk.0.attn_norm.weight", layer(0).input_layernorm.weight, None),  # F32
        ("blk.0.attn_v.weight", layer(0).self_attn.qkv_proj.weight[(heads + kv_heads) * d :], None),  # Q4_1
        ("blk.7.ffn_down.weight", layer(7).mlp.down_proj.weight, None),
        ("blk.7.ffn_up.weight", layer(7).mlp.gate_up_proj.weight[1536:], None),
        ("blk.29.attn_q.weight", layer(29).self_attn.qkv_proj.weight[: heads * d], heads),  # rows permuted
        (
            "blk.29.attn_k.weight",
            layer(29).self_attn.qkv_proj.weight[heads * d : (heads + kv_heads) * d],
            kv_heads,
        ),
    ]
    for gguf_name, param, permuted_heads in pairs:
        want = from_gguf(gguf_name)
        got = param.detach().numpy()
        if permuted_heads is not None:
            got = llamacpp_permute(got, permuted_heads)  # back to llama.cpp's row order
        assert got.shape == want.shape, (gguf_name, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=gguf_name)
    q29 = layer(29).self_attn.qkv_proj.weight[: heads * d].numpy()
    assert not np.array_equal(q29, from_gguf("blk.29.attn_q.weight"))  # the permutation is not the identity


def test_embedded_quantized_model_close_to_float32(smollm_dir: Path, smollm) -> None:
    """The native model (Q4_1/Q8_0 blocks through the CPU kernels, int8 activations) against the
    float32 reference: the same model within the activations' quantization noise."""
    model, _ = smollm
    native, _ = load_model(smollm_dir, torch.float32, "cpu", progress=False, native=True)
    bind_ops(native, create_ops("cpu", "cpu"))
    tok = load_tokenizer(smollm_dir)
    prompts = [
        tok.encode(t) for t in ("The quick brown fox jumps over", "def fibonacci(n):\n    if n", "Paris is")
    ]
    kl, agree, total = 0.0, 0, 0
    for got, want in zip(run_prompts(native, prompts), run_prompts(model, prompts), strict=True):
        lp, lq = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
        kl += float((lp.exp() * (lp - lq)).sum())
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += want.shape[0]
    assert kl / total < 0.02 and agree / total > 0.85, (kl / total, agree / total)
