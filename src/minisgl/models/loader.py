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
from minisgl.models.quant import apply_fp8, fp8_slots, kv_scale_slots, resolve_scheme, unused_scales
from minisgl.models.weights import (
    WeightSlot,
    checkpoint_files,
    iter_tensor_names,
    load_checkpoint,
    load_generated,
)

logger = logging.getLogger(__name__)

# config.family -> implementation (all current families share the Llama code, flags differ)
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_info: DistributedInfo | None = None,
    dummy: bool = False,
    progress: bool = True,
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """The model for this rank and its config. `dummy`: random weights, only config.json is read.
    An fp8 checkpoint loads as published; `quantization="fp8"` quantizes a 16/32-bit one as it loads
    (`minisgl.models.quant`)."""
    model_dir = Path(model_dir)
    t0 = time.perf_counter()
    cfg = ModelConfig.from_dir(model_dir)
    tp = tp_info or DistributedInfo(0, 1)
    model = MODEL_CLASSES[cfg.family](cfg, tp, dtype, torch.device(device))
    scheme = resolve_scheme(cfg.quantization, quantization, dummy)
    if scheme is not None:
        apply_fp8(model, scheme)
    slots = model.weight_slots()
    if scheme is not None:
        fp8_slots(model, slots, scheme)
    if dummy:
        fill_dummy_weights(model, slots=slots)
    else:
        names = {n for _, n in iter_tensor_names(checkpoint_files(model_dir))}
        slots.update(kv_scale_slots(model, names, cfg.num_kv_heads, model.heads.kv_start))
        ignored = model.checkpoint_ignored() | unused_scales(names)
        load_checkpoint(model_dir, slots, ignored, progress=progress)
    model.eval()
    logger.info(
        "loaded %s (%s%s%s) in %.2f s",
        model_dir,
        cfg.architecture,
        ", dummy" if dummy else "",
        f", {scheme.source}" if scheme is not None else "",
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


def fill_dummy_weights(
    model: LlamaForCausalLM, seed: int = 0, slots: dict[str, list[WeightSlot]] | None = None
) -> None:
    """Random weights (`dummy_tensor`): each checkpoint tensor drawn whole and sharded as from a
    checkpoint, so every tensor-parallel size holds the same model (TP=2 can be checked against TP=1,
    and transformers given the same weights, without a checkpoint). `slots`: the model's, or ones
    that quantize its fp8 projections as they are filled."""
    like = model.model.embed_tokens.weight
    load_generated(
        slots if slots is not None else model.weight_slots(),
        lambda name, shape: dummy_tensor(name, shape, like.dtype, like.device, seed),
    )
