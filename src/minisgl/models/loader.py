"""`load_model`: build the model for this rank (only its shard) and fill it from a checkpoint (a
safetensors directory, or a GGUF file read in place) or with random weights.

`native` (the CPU's default) keeps each matrix in the checkpoint's own format as a `QuantizedWeight`:
GGUF's blocks over the file's memory map, a safetensors checkpoint's 16-bit floats (one 16-bit copy,
no float32 one); the model computes in `dtype` (float32) all the same. Without it every weight is
converted to `dtype`."""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from pathlib import Path

import torch
from torch import nn

from minisgl.checkpoint.fp8 import apply_fp8, fp8_slots, kv_scale_slots, resolve_scheme, unused_scales
from minisgl.checkpoint.gguf_weights import gguf_file_of, load_gguf, replace_parameter
from minisgl.checkpoint.weights import (
    WeightSlot,
    checkpoint_files,
    iter_tensor_names,
    load_checkpoint,
    load_generated,
)
from minisgl.distributed import DistributedInfo
from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
from minisgl.quant import as_quantized

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
    native: bool = False,
    quantization: str | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """The model for this rank and its config. `dummy`: random weights, only config.json is read;
    `native`: matrices kept in the checkpoint's format (see the module's docstring). An fp8
    checkpoint loads as published; `quantization="fp8"` quantizes a 16/32-bit one as it loads
    (`minisgl.checkpoint.fp8`)."""
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
    ignore = model.checkpoint_ignored()
    if dummy:
        fill_dummy_weights(model, slots=slots)
    elif gguf_file_of(model_dir) is not None:
        if scheme is not None:
            raise ValueError(
                f"{model_dir}: --quantization fp8 applies to safetensors checkpoints, not GGUF files"
            )
        load_gguf(model_dir, model, slots, ignore, native=native, family=cfg.family)
    elif native and scheme is None and (dtype16 := _checkpoint_16bit(model_dir)) is not None:
        _load_16bit(model, model_dir, slots, ignore, dtype16, progress)
    else:
        names = {n for _, n in iter_tensor_names(checkpoint_files(model_dir))}
        slots.update(kv_scale_slots(model, names, cfg.num_kv_heads, model.heads.kv_start))
        load_checkpoint(model_dir, slots, ignore | unused_scales(names), progress=progress)
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


def _checkpoint_16bit(model_dir: Path) -> torch.dtype | None:
    """The checkpoint's float16/bfloat16, when its first file's 2-D tensors are in one (else None)."""
    from safetensors import safe_open

    names = {"F16": torch.float16, "BF16": torch.bfloat16}
    with safe_open(str(checkpoint_files(model_dir)[0]), framework="pt") as fh:
        for name in fh.keys():
            sl = fh.get_slice(name)
            if len(sl.get_shape()) == 2:
                return names.get(sl.get_dtype())
    return None


def _load_16bit(
    model: nn.Module,
    model_dir: Path,
    slots: dict[str, list[WeightSlot]],
    ignore: set[str],
    dtype: torch.dtype,
    progress: bool,
) -> None:
    """Load a 16-bit checkpoint with every 2-D parameter (the matrices) kept in `dtype`: each is
    filled into a new `dtype` tensor of its shape, then put in its place as a QuantizedWeight over
    that tensor; 1-D ones (norms, biases) are filled as they are."""
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(parameter) -> (it, its 16-bit tensor)

    def retarget(slot: WeightSlot) -> WeightSlot:
        if slot.param.dim() != 2:
            return slot
        old = slot.param
        _, repl = new.setdefault(
            id(old), (old, torch.zeros(old.shape, dtype=dtype))
        )  # zeros: LMHead's padding
        return dataclasses.replace(slot, param=repl)

    load_checkpoint(
        model_dir, {n: [retarget(s) for s in v] for n, v in slots.items()}, ignore, progress=progress
    )
    for old, repl in new.values():
        replace_parameter(model, old, as_quantized(repl))


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
