"""`load_model`: build the model for this rank (only its shard) and fill it from a checkpoint or with
random weights."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from minisgl.distributed import DistributedInfo
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.weights import load_checkpoint

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
def fill_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Numerically sane random weights: N(0, 0.02) matrices, norms 1, biases 0.

    Every rank uses the same seed and creates parameters in the same order, so replicated tensors
    (embedding, norms) agree across ranks."""
    gen = torch.Generator(device=model.model.embed_tokens.weight.device).manual_seed(seed)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    if model.config.tie_word_embeddings and model.tp.size > 1:
        _copy_tied_head(model)


def _copy_tied_head(model: LlamaForCausalLM) -> None:
    """The vocab shard of the (tied) embedding that this rank's LM head holds."""
    slot = model.weight_slots()["model.embed_tokens.weight"][-1]
    model.lm_head.weight.zero_()
    slot.copy_in(model.model.embed_tokens.weight.narrow(0, slot.start, slot.length))
