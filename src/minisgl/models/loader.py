"""`load_model`: build the model for this rank (only its shard) and fill it from a checkpoint or with
random weights."""

from __future__ import annotations

import logging
import time
import zlib
from pathlib import Path

import torch

from minisgl.distributed import DistributedInfo
from minisgl.models.base import CausalLM
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
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
    task: str = "generate",
) -> tuple[CausalLM, ModelConfig]:
    """The model for this rank and its config. `dummy`: random weights, only config.json is read;
    `task="embed"`: an embedding model, whose checkpoint may lack the LM head (`embedding_slots`)."""
    model_dir = Path(model_dir)
    t0 = time.perf_counter()
    cfg = ModelConfig.from_dir(model_dir)
    tp = tp_info or DistributedInfo(0, 1)
    model = MODEL_CLASSES[cfg.family](cfg, tp, dtype, torch.device(device))
    if dummy:
        fill_dummy_weights(model)
    elif task == "embed":
        load_checkpoint(model_dir, *embedding_slots(model, model_dir), progress=progress)
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


def embedding_slots(model: LlamaForCausalLM, model_dir: Path) -> tuple[dict[str, list[WeightSlot]], set[str]]:
    """(slots, ignored names) of an embedding model's checkpoint: the LM head is not needed (an
    embedding checkpoint such as Qwen3-Embedding's has none), and names may lack the `model.` prefix
    (saved from the base model, as Qwen3-Embedding's are)."""
    slots = {k: v for k, v in model.weight_slots().items() if k != "lm_head.weight"}
    names = [n for _, n in iter_tensor_names(checkpoint_files(model_dir))]
    if not any(n.startswith("model.") for n in names):
        slots = {k.removeprefix("model."): v for k, v in slots.items()}
    return slots, model.checkpoint_ignored() | {"lm_head.weight"}
