"""Reading safetensors checkpoints into a model's (fused, possibly sharded) parameters.

A model describes, for every checkpoint tensor name, where that tensor goes (`WeightSlot`): which
parameter, at which row offset (fused q/k/v and gate/up), and which part of the tensor this
tensor-parallel rank keeps. The loader then reads only that part (`safe_open(...).get_slice`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model: the message names the file and the tensor."""


@dataclass
class WeightSlot:
    """One checkpoint tensor's destination: rows [dst, dst + rows) of `param` (rows along dim 0)."""

    param: torch.Tensor
    full_shape: tuple[int, ...]  # the tensor's shape in the checkpoint
    shard_dim: int | None = None  # dim of the checkpoint tensor split over ranks (None: whole tensor)
    start: int = 0  # this rank's range on shard_dim
    length: int = 0
    dst: int = 0  # row offset inside `param`

    def read(self, sl: Any) -> torch.Tensor:  # sl: a safetensors slice (PySafeSlice)
        """This rank's part of the tensor from a safetensors slice."""
        if self.shard_dim is None:
            return sl[:]
        if self.shard_dim == 0:
            return sl[self.start : self.start + self.length]
        return sl[:, self.start : self.start + self.length]

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Whether a checkpoint tensor of `shape` fits this slot."""
        return shape == self.full_shape

    def copy_in(self, t: torch.Tensor) -> None:
        self.param.narrow(0, self.dst, t.shape[0]).copy_(t)


def whole(param: torch.Tensor) -> WeightSlot:
    """A replicated tensor: the checkpoint shape is the parameter's shape."""
    return WeightSlot(param, tuple(param.shape))


def swiglu_slots(
    names: tuple[str, str, str],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    inter: int,
    hidden: int,
    rank: int,
) -> dict[str, list[WeightSlot]]:
    """A SwiGLU MLP's three checkpoint tensors (`names`: gate, up, down) into this rank's fused
    `gate_up` (2 I/N, hidden) [gate rows | up rows] and `down` (hidden, I/N); `inter` = I."""
    local = down.shape[1]
    first = rank * local
    gate, up, down_name = names
    return {
        gate: [WeightSlot(gate_up, (inter, hidden), 0, first, local, 0)],
        up: [WeightSlot(gate_up, (inter, hidden), 0, first, local, local)],
        down_name: [WeightSlot(down, (hidden, inter), 1, first, local)],
    }


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those the shard index names when there is one (Mistral repos also ship a
    `consolidated.safetensors` in another layout, which the index leaves out), else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightLoadError(f"{index}: cannot read the shard index: {e}") from None
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise WeightLoadError(f"{model_dir / missing[0]}: file not found (named by {index.name})")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(
            f"{model_dir}: no *.safetensors files (only safetensors checkpoints are supported)"
        )
    return files


def iter_tensor_names(files: list[Path]) -> Iterator[tuple[Path, str]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                names = list(fh.keys())
        except Exception as e:  # safetensors raises its own error types
            raise WeightLoadError(f"{f}: cannot read safetensors file: {e}") from None
        yield from ((f, n) for n in names)


def load_checkpoint(
    model_dir: Path,
    slots: dict[str, list[WeightSlot]],
    ignore: set[str],
    progress: bool = True,
) -> None:
    """Fill every slot from the *.safetensors files; any mismatch is a WeightLoadError."""
    from minisgl.utils.progress_bar import progress_bar

    files = checkpoint_files(model_dir)
    entries = list(iter_tensor_names(files))
    seen: set[str] = set()
    bar = progress_bar(total=len(entries), desc="Loading weights", unit="tensor", disable=not progress)
    try:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    bar.update(1)
                    if name in ignore or name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name not in slots:
                        raise WeightLoadError(f"{f}: unexpected tensor {name!r} (not part of this model)")
                    if name in seen:
                        raise WeightLoadError(f"{f}: tensor {name!r} appears in more than one file")
                    seen.add(name)
                    load_whole(f, name, fh.get_slice(name), slots[name])
    finally:
        bar.close()
    missing = sorted(set(slots) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightLoadError(
            f"{model_dir}: missing tensor(s) {missing[:5]}{more} in {[f.name for f in files]}"
        )


def load_whole(f: Path, name: str, sl: Any, targets: list[WeightSlot]) -> None:
    """Tensor `name` of file `f` into its slots. sl: a safetensors slice, or a whole tensor (both
    slice the same way)."""
    shape = tuple(sl.shape) if isinstance(sl, torch.Tensor) else tuple(sl.get_shape())
    for slot in targets:
        if not slot.accepts(shape):
            raise WeightLoadError(
                f"{f}: tensor {name!r} has shape {list(shape)}, the model expects {list(slot.full_shape)}"
            )
        slot.copy_in(slot.read(sl))


def load_generated(
    slots: dict[str, list[WeightSlot]], make: Callable[[str, tuple[int, ...]], torch.Tensor]
) -> None:
    """Fill every slot from whole tensors made one at a time by `make(name, shape in the checkpoint)`
    (random weights), each rank keeping its shard as from a checkpoint."""
    for name, targets in slots.items():
        load_whole(Path("generated"), name, make(name, targets[0].full_shape), targets)


def load_tensors(
    tensors: dict[str, torch.Tensor], slots: dict[str, list[WeightSlot]], ignore: set[str]
) -> None:
    """Fill every slot from in-memory tensors named as in a checkpoint (e.g. a transformers model's
    `state_dict()`), with the same checks as `load_checkpoint`."""
    for name, t in tensors.items():
        if name in ignore or name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in slots:
            raise WeightLoadError(f"state dict: unexpected tensor {name!r} (not part of this model)")
        load_whole(Path("state dict"), name, t, slots[name])
    missing = sorted(set(slots) - set(tensors))
    if missing:
        raise WeightLoadError(f"state dict: missing tensor(s) {missing[:5]}")


@dataclass(frozen=True)
class ExpertNames:
    """A family's checkpoint names under `model.layers.N.`: the block, and each expert's gate, up
    and down projections under `<block>.experts.<e>.`."""

    block: str
    gate: str
    up: str
    down: str


_QWEN = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
EXPERT_NAMES = {
    "mixtral": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
}
