"""fp8 checkpoints as published (block scales, per-channel, per-tensor; transformers' fp8,
compressed-tensors, fbgemm) and `quantization="fp8"` for 16/32-bit ones: the CPU loads them and runs
them dequantized, which must equal the same checkpoint written with the dequantized weights (the
reference); formats minisgl does not read are refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models_support import run_prompts, save_tiny_hf_model

from minisgl.backends import bind_ops, create_ops
from minisgl.backends.fp8 import FP8, Fp8Weight, dequantize_fp8, quantize_fp8
from minisgl.distributed import DistributedInfo
from minisgl.layers import Linear
from minisgl.models import ModelConfigError, WeightLoadError, load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model("Qwen3ForCausalLM", tmp_path_factory.mktemp("base"), tie=False)


def _projection(name: str) -> bool:
    return name.endswith("proj.weight")


def _write(
    base: Path,
    out: Path,
    qc: dict | None,
    per_tensor: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
) -> Path:
    """A copy of `base` whose tensors are `per_tensor(name, tensor)`'s (several names each)."""
    shutil.copytree(base, out)
    tensors = load_file(str(base / "model.safetensors"))
    new: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        new.update(per_tensor(name, t))
    save_file(new, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _fp8_pair(
    base: Path, tmp: Path, qc: dict, scale_name: str, block: tuple[int, int] | None, layout: str,
    skip: Callable[[str], bool] = lambda n: False,
) -> tuple[Path, Path]:  # fmt: skip
    """(fp8 checkpoint, the same with its weights dequantized in float32). layout: how the scales are
    stored: "block", "channel" (N, 1), "tensor" (a scalar per tensor)."""
    deq: dict[str, torch.Tensor] = {}

    def quantize(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not _projection(name) or skip(name):
            deq[name] = t
            return {name: t}
        if layout == "tensor":
            scale = t.abs().max().float() / 448
            q = (t.float() / scale).clamp(-448, 448).to(FP8)
            stored, deq[name] = scale, q.float() * scale
        else:
            q, s = quantize_fp8(t, block)
            deq[name] = dequantize_fp8(q, s, block)
            stored = s[:, None] if layout == "channel" else s
        return {name: q, name.removesuffix("weight") + scale_name: stored}

    fp8 = _write(base, tmp / "fp8", qc, quantize)
    ref = _write(base, tmp / "ref", None, lambda n, t: {n: deq[n]})
    return fp8, ref


def _ct(strategy: str, block: list[int] | None = None, ignore: list[str] | None = None) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if block:
        weights["block_structure"] = block
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head", *(ignore or [])],
    }


FORMATS = {  # name -> (quantization_config, scale tensor name, block, scale layout)
    "fp8-block": (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
         "modules_to_not_convert": ["lm_head"]},
        "weight_scale_inv", (16, 16), "block",
    ),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_scale", None, "tensor"),
    "ct-channel": (_ct("channel"), "weight_scale", None, "channel"),
    "ct-tensor": (_ct("tensor"), "weight_scale", None, "tensor"),
    "ct-block": (_ct("block", [16, 16]), "weight_scale", (16, 16), "block"),
    "fbgemm": ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"]}, "weight_scale", None, "channel"),
}  # fmt: skip


def _fp8_linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.fp8 is not None}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_runs_as_its_dequantized_weights(fmt: str, base_dir: Path, tmp_path: Path) -> None:
    qc, scale_name, block, layout = FORMATS[fmt]
    fp8_dir, ref_dir = _fp8_pair(base_dir, tmp_path, qc, scale_name, block, layout)
    if layout == "tensor":  # static activation scales ride along in such checkpoints: read past
        tensors = load_file(str(fp8_dir / "model.safetensors"))
        tensors["model.layers.0.mlp.down_proj.input_scale"] = torch.tensor(0.01)
        save_file(tensors, str(fp8_dir / "model.safetensors"))
    model, cfg = load_model(fp8_dir, torch.float32, "cpu", progress=False)
    ref, _ = load_model(ref_dir, torch.float32, "cpu", progress=False)
    assert cfg.quantization is not None and cfg.quantization.block == block
    linears = _fp8_linears(model)
    assert len(linears) == 4 * cfg.num_layers  # qkv, o, gate_up, down; the LM head stays as it is
    assert model.lm_head.weight.dtype == torch.float32
    for name, layer in linears.items():
        assert layer.weight.dtype == FP8 and isinstance(layer.w, Fp8Weight)
        torch.testing.assert_close(layer.fp8.dequantize(), ref.get_submodule(name).weight, rtol=0, atol=0)
    for ops in ("torch", "cpu"):
        bind_ops(model, create_ops(ops, "cpu"))
        bind_ops(ref, create_ops(ops, "cpu"))
        for got, want in zip(run_prompts(model, PROMPTS), run_prompts(ref, PROMPTS), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "fp8-tensor"])
def test_tensor_parallel_ranks_hold_their_shards_of_the_scales(
    fmt: str, base_dir: Path, tmp_path: Path
) -> None:
    qc, scale_name, block, layout = FORMATS[fmt]
    fp8_dir, ref_dir = _fp8_pair(base_dir, tmp_path, qc, scale_name, block, layout)
    for rank in range(2):
        tp = DistributedInfo(rank, 2)
        model, _ = load_model(fp8_dir, torch.float32, "cpu", tp_info=tp, progress=False)
        ref, _ = load_model(ref_dir, torch.float32, "cpu", tp_info=tp, progress=False)
        for name, layer in _fp8_linears(model).items():
            torch.testing.assert_close(layer.fp8.dequantize(), ref.get_submodule(name).weight, rtol=0, atol=0)


def test_blocks_that_straddle_ranks_are_refused(base_dir: Path, tmp_path: Path) -> None:
    qc = dict(FORMATS["fp8-block"][0], weight_block_size=[32, 32])
    fp8_dir, _ = _fp8_pair(base_dir, tmp_path, qc, "weight_scale_inv", (32, 32), "block")
    load_model(fp8_dir, torch.float32, "cpu", progress=False)  # one rank: every tensor is whole
    with pytest.raises(WeightLoadError, match="fp8 blocks of 32x32"):
        load_model(fp8_dir, torch.float32, "cpu", tp_info=DistributedInfo(1, 2), progress=False)


def test_ignored_modules_stay_in_the_models_dtype(base_dir: Path, tmp_path: Path) -> None:
    qc = _ct("channel", ignore=["re:.*mlp\\.down_proj"])
    fp8_dir, ref_dir = _fp8_pair(
        base_dir, tmp_path, qc, "weight_scale", None, "channel", skip=lambda n: "down_proj" in n
    )
    model, _ = load_model(fp8_dir, torch.float32, "cpu", progress=False)
    ref, _ = load_model(ref_dir, torch.float32, "cpu", progress=False)
    assert not any("down_proj" in n for n in _fp8_linears(model))
    assert any("gate_up_proj" in n for n in _fp8_linears(model))
    for got, want in zip(run_prompts(model, PROMPTS), run_prompts(ref, PROMPTS), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_fused_projection_half_quantized_is_refused(base_dir: Path, tmp_path: Path) -> None:
    qc = _ct("channel", ignore=["re:.*self_attn\\.q_proj"])
    fp8_dir, _ = _fp8_pair(
        base_dir, tmp_path, qc, "weight_scale", None, "channel", skip=lambda n: "q_proj" in n
    )
    with pytest.raises(WeightLoadError, match="k_proj.*one projection"):
        load_model(fp8_dir, torch.float32, "cpu", progress=False)


def test_quantization_fp8_quantizes_a_float_checkpoint_per_channel(base_dir: Path) -> None:
    model, cfg = load_model(base_dir, torch.float32, "cpu", progress=False, quantization="fp8")
    plain, _ = load_model(base_dir, torch.float32, "cpu", progress=False)
    assert cfg.quantization is None  # the checkpoint's; the flag made the scheme
    tensors = load_file(str(base_dir / "model.safetensors"))
    layer = model.model.layers[1].mlp.down_proj
    q, s = quantize_fp8(tensors["model.layers.1.mlp.down_proj.weight"], None)
    assert torch.equal(layer.weight.float(), q.float()) and torch.equal(layer.weight_scale, s)
    gate_up = model.model.layers[0].mlp.gate_up_proj.fp8  # each part's rows scaled on their own
    q, s = quantize_fp8(tensors["model.layers.0.mlp.up_proj.weight"], None)
    assert torch.equal(gate_up.scale[cfg.intermediate_size :], s)
    for got, want in zip(run_prompts(model, PROMPTS), run_prompts(plain, PROMPTS), strict=True):
        rel = float((got - want).norm() / want.norm())
        assert 0 < rel < 0.05, rel  # fp8's rounding, and nothing worse


def test_fp8_lm_head_quantizes_the_head_per_row_too(base_dir: Path, tmp_path: Path) -> None:
    """`quantization="fp8_lm_head"`: the projections as with "fp8" and the LM head in fp8 with a scale
    per vocab row (run dequantized on the CPU); with tied embeddings on one rank the head is the
    embedding table and stays in the model's dtype."""
    model, _ = load_model(base_dir, torch.float32, "cpu", progress=False, quantization="fp8_lm_head")
    fp8, _ = load_model(base_dir, torch.float32, "cpu", progress=False, quantization="fp8")
    tensors = load_file(str(base_dir / "model.safetensors"))
    q, s = quantize_fp8(tensors["lm_head.weight"], None)
    head = model.lm_head
    assert head.fp8 is not None and fp8.lm_head.fp8 is None
    assert torch.equal(head.weight.float(), q.float()) and torch.equal(head.weight_scale, s)
    for got, want in zip(run_prompts(model, PROMPTS), run_prompts(fp8, PROMPTS), strict=True):
        rel = float((got - want).norm() / want.norm())
        assert 0 < rel < 0.05, rel
    tied_dir = save_tiny_hf_model("Qwen3ForCausalLM", tmp_path / "tied", tie=True)
    tied, _ = load_model(tied_dir, torch.float32, "cpu", progress=False, quantization="fp8_lm_head")
    assert tied.lm_head.fp8 is None and tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.model.layers[0].mlp.gate_up_proj.fp8 is not None


def test_random_weights_take_the_configs_blocks(base_dir: Path, tmp_path: Path) -> None:
    d = _write(base_dir, tmp_path / "cfg", FORMATS["fp8-block"][0], lambda n, t: {n: t})
    model, cfg = load_model(d, torch.bfloat16, "cpu", dummy=True, progress=False)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.fp8.block == (16, 16)
    assert qkv.weight_scale.shape == (-(-qkv.weight.shape[0] // 16), -(-cfg.hidden_size // 16))
    assert torch.isfinite(qkv.weight_scale).all() and (qkv.weight_scale > 0).all()


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        (
            {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}},
            "format 'int-quantized'",
        ),
        (
            {**_ct("channel"), "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
            "int 8-bit weights",
        ),
        (
            {**_ct("channel"), "format": None, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
            "float 4-bit weights",
        ),
        (
            {**_ct("channel"), "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}},
            "strategy 'group'",
        ),
    ],
)  # fmt: skip
def test_unsupported_formats_are_refused_by_name(
    qc: dict, match: str, base_dir: Path, tmp_path: Path
) -> None:
    d = _write(base_dir, tmp_path / "q", qc, lambda n, t: {n: t})
    with pytest.raises(ModelConfigError, match=match):
        load_model(d, torch.float32, "cpu", progress=False)


def test_unknown_quantization_option_is_refused(base_dir: Path) -> None:
    from minisgl.engine import EngineOptions

    with pytest.raises(ValueError, match="quantization"):
        load_model(base_dir, torch.float32, "cpu", progress=False, quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        EngineOptions(quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineOptions(kv_cache_dtype="fp8_e5m2")
