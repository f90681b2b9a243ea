"""Checkpoint loading: clear errors for bad directories, dummy weights, sharded checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models_support import run_prompts, save_tiny_hf_model

from minisgl.models import ModelConfigError, WeightLoadError, load_model, resolve_model_path


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), tie=False)


@pytest.fixture
def model_dir(base_dir: Path, tmp_path: Path) -> Path:
    """A private copy that a test may damage."""
    return Path(shutil.copytree(base_dir, tmp_path / "m"))


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn) -> None:  # noqa: ANN001
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_unknown_architecture(model_dir: Path) -> None:
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelConfigError, match=r"config\.json.*unsupported architecture.*GPT2LMHeadModel"):
        load_model(model_dir, torch.float32, "cpu", progress=False)


def test_missing_config_json(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelConfigError, match=r"config\.json: file not found"):
        load_model(model_dir, torch.float32, "cpu", progress=False)
    with pytest.raises(ModelConfigError, match=r"config\.json: file not found"):
        resolve_model_path(model_dir)


def test_missing_weights_and_paths(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match=r"no \*\.safetensors"):
        resolve_model_path(model_dir)
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors"):
        load_model(model_dir, torch.float32, "cpu", progress=False)
    assert resolve_model_path(model_dir, require_weights=False) == model_dir
    with pytest.raises(ModelConfigError, match="no such model directory"):
        resolve_model_path(tmp_path / "nowhere")


def test_missing_tensor(model_dir: Path) -> None:
    _edit_tensors(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_dir, torch.float32, "cpu", progress=False)


def test_unexpected_tensor(model_dir: Path) -> None:
    _edit_tensors(model_dir, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(3)))
    with pytest.raises(
        WeightLoadError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.extra\.weight'"
    ):
        load_model(model_dir, torch.float32, "cpu", progress=False)


def test_shape_mismatch(model_dir: Path) -> None:
    _edit_config(model_dir, intermediate_size=64)  # the checkpoint has 96
    with pytest.raises(
        WeightLoadError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape",
    ):
        load_model(model_dir, torch.float32, "cpu", progress=False)


def test_corrupt_safetensors_names_the_file(model_dir: Path) -> None:
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightLoadError, match=r"model\.safetensors: cannot read"):
        load_model(model_dir, torch.float32, "cpu", progress=False)


def test_sharded_checkpoint_loads_the_same(model_dir: Path, base_dir: Path) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    (model_dir / "model.safetensors").unlink()
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(model_dir / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(model_dir / "model-00002-of-00002.safetensors"))
    sharded, _ = load_model(model_dir, torch.float32, "cpu", progress=False)
    whole, _ = load_model(base_dir, torch.float32, "cpu", progress=False)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), whole.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_shard_index_selects_the_files(model_dir: Path, base_dir: Path) -> None:
    """With model.safetensors.index.json, other *.safetensors (Mistral's consolidated file) are ignored."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00001.safetensors")
    save_file({"layers.0.attention.wq.weight": torch.zeros(2)}, str(model_dir / "consolidated.safetensors"))
    index = {"weight_map": {n: "model-00001-of-00001.safetensors" for n in tensors}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load_model(model_dir, torch.float32, "cpu", progress=False)
    whole, _ = load_model(base_dir, torch.float32, "cpu", progress=False)
    assert torch.equal(model.lm_head.weight, whole.lm_head.weight)
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match=r"model-00002-of-00002\.safetensors: file not found"):
        load_model(model_dir, torch.float32, "cpu", progress=False)


def test_dummy_weights_read_no_weight_file(model_dir: Path) -> None:
    # A corrupt weight file proves it is never opened.
    (model_dir / "model.safetensors").write_bytes(b"garbage")
    model, cfg = load_model(model_dir, torch.float32, "cpu", dummy=True)
    again, _ = load_model(model_dir, torch.float32, "cpu", dummy=True, progress=False)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
        cfg.hidden_size,
    )
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert model.lm_head.weight.shape == (cfg.vocab_size, cfg.hidden_size)
    assert torch.equal(model.model.norm.weight, torch.ones(cfg.hidden_size))
    std = attn.qkv_proj.weight.std().item()
    assert 0.015 < std < 0.025
    (logits,) = run_prompts(model, [[1, 2, 3, 4]])
    assert logits.shape == (4, cfg.vocab_size) and torch.isfinite(logits).all()
    # same seed -> same weights (ranks agree on replicated tensors)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
