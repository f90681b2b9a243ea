"""`load_model`: build the model for this rank (only its shard) and fill it from a checkpoint or with
random weights."""

from __future__ import annotations

import logging
import time
import zlib
from pathlib import Path

import torch
from torch import nn

from minisgl.distributed import DistributedInfo
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.weights import load_checkpoint, load_generated

logger = logging.getLogger(__name__)

# config.family -> implementation (all current families share the Llama code, flags differ)
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    family: LlamaForCausalLM for family in ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
}


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_info: DistributedInfo | None = None,
    dummy: bool = False,
    progress: bool = True,
) -> tuple[nn.Module, ModelConfig]:
    """The model for this rank and its config. `dummy`: random weights, only config.json is read."""
    model_dir = Path(model_dir)
    t0 = time.perf_counter()
    cfg = ModelConfig.from_dir(model_dir)
    tp = tp_info or DistributedInfo(0, 1)
    model = MODEL_CLASSES[cfg.family](cfg, tp, dtype, torch.device(device))
    if dummy:
        fill_dummy_weights(model)
    else:
        load_checkpoint(model_dir, model.weight_slots(), model.checkpoint_ignored(), progress=progress)
    model.eval()
    logger.info(
        "loaded %s (%s%s) in %.2f s",
        model_dir,
        cfg.architecture,
        ", dummy" if dummy else "",
        time.perf_counter() - t0,
    )
    return model, cfg


@torch.no_grad()
def dummy_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    """The random value of checkpoint tensor `name`: N(0, 0.02) for matrices, 1 for norms, 0 for
    biases, drawn from a generator seeded by the name (the same on every rank and every run)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)


def fill_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights (`dummy_tensor`): each checkpoint tensor drawn whole and sharded as from a
    checkpoint, so every tensor-parallel size holds the same model (TP=2 can be checked against TP=1,
    and transformers given the same weights, without a checkpoint)."""
    like = model.model.embed_tokens.weight
    load_generated(
        model.weight_slots(), lambda name, shape: dummy_tensor(name, shape, like.dtype, like.device, seed)
    )
