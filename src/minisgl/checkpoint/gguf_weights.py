"""Reading a model's weights from a GGUF file in place.

The file is memory-mapped, and each tensor's raw rows are a uint8 view over the map, found through the
tensor table the derived directory keeps (`tensors.json`: name, ggml type, shape, byte offset,
written once with the `gguf` package; parsing a GGUF's metadata, its vocabulary above all, takes
seconds).
With `native` (the CPU's default) every matrix (2-D: projections, the embedding, the LM head) becomes
a `QuantizedWeight` over those rows, in the file's own formats: no copy, no conversion, the pages
read from the file when first used. Fused projections (q/k/v, gate/up) are parts of one weight, a
tensor-parallel shard is a range of rows or of blocks, and llama.cpp's permuted q/k rows (its Llama
converter interleaves each head's rope halves) are read in Hugging Face's order through the row
table, so none of these needs a copy either. Norms and biases (1-D, float32) are copied into the
model's float parameters. A mixture of experts' tensors (the stacked experts, the router, a shared
expert) are dequantized into the model's float parameters even with `native`: the experts op takes
float (E, 2I, H) / (E, H, I) stacks. Without `native` (`--dtype float32`, GPUs) every tensor is dequantized
into the model's parameters (`minisgl.quant.dequantize`), q/k rows put back in HF's order.
"""

from __future__ import annotations

import json
import math
import mmap
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minisgl.kernels.quant import dequant_rows, quant_available
from minisgl.quant import GGMLType, QuantizedWeight, QuantPart, dequantize

from .gguf_convert import TENSOR_TABLE, GGUFConversionError, gguf_to_hf_name, moe_names
from .weights import WeightLoadError, WeightSlot, load_whole

# Architectures whose GGUF files have llama.cpp's permuted attn_q / attn_k rows (its rope is
# interleaved for Llama only; Qwen2/Qwen3 files keep HF's order).
PERMUTED_ROPE = {"llama", "mixtral"}


def gguf_file_of(model_dir: Path) -> Path | None:
    """The GGUF file a model directory's weights are read from (a derived directory's `model.gguf`
    link), or None for a safetensors directory."""
    path = model_dir / "model.gguf"
    return path if path.exists() else None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table: shape in HF's order (rows first), `offset` from the file's start."""

    name: str
    type: int  # the ggml type id (GGMLType when minisgl reads it)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class GGUFFile:
    """A GGUF file's tensors over one read-only memory map of it."""

    def __init__(self, model_dir: Path) -> None:
        path = gguf_file_of(model_dir)
        if path is None:
            raise WeightLoadError(f"{model_dir}: no model.gguf")
        self.path = path.resolve()
        try:
            table = json.loads((model_dir / TENSOR_TABLE).read_text(encoding="utf-8"))
            self.tensors = [
                GGUFTensor(t["name"], t["type"], tuple(t["shape"]), t["offset"], t["nbytes"]) for t in table
            ]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightLoadError(f"{model_dir / TENSOR_TABLE}: cannot read the tensor table: {e}") from None
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        end = max((t.offset + t.nbytes for t in self.tensors), default=0)
        if end > len(self._map):
            raise WeightLoadError(f"{self.path}: {len(self._map)} bytes, but its tensors end at byte {end}")
        with warnings.catch_warnings():  # read-only: nothing writes through these views
            warnings.simplefilter("ignore", UserWarning)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def raw_rows(self, t: GGUFTensor) -> torch.Tensor:
        """The tensor's bytes as (rows, row_bytes) uint8 over the map: rows of the last dimension (a
        stacked (E, r, c) tensor has E * r rows; a 1-D one is one row)."""
        rows = math.prod(t.shape[:-1])
        return self._bytes[t.offset : t.offset + t.nbytes].view(rows, -1)

    def format(self, t: GGUFTensor) -> GGMLType:
        try:
            return GGMLType(t.type)
        except ValueError:
            raise WeightLoadError(
                f"{self.path}: tensor {t.name!r} has ggml type {t.type}, a format minisgl does not read "
                f"(supported: {', '.join(f.name for f in GGMLType)})"
            ) from None


def load_gguf(
    model_dir: Path,
    model: nn.Module,
    slots: dict[str, list[WeightSlot]],
    ignore: set[str],
    native: bool,
    family: str,
) -> None:
    """Fill `model` (whose `weight_slots()` are `slots`) from the GGUF file of `model_dir`."""
    gguf = GGUFFile(model_dir)
    path = gguf.path
    heads = _permuted_heads(model, family)
    config = _derived_config(model_dir)
    seen: set[str] = set()
    matrices: dict[int, list[tuple[WeightSlot, QuantPart]]] = defaultdict(list)
    for t in gguf.tensors:
        experts = moe_names(t.name, config)
        if experts is not None:  # a mixture of experts' tensor: float, one per expert
            seen.update(_load_moe_tensor(gguf, t, experts, slots, ignore))
            continue
        name = gguf_to_hf_name(t.name)
        if name is None:
            raise WeightLoadError(f"{path}: unexpected tensor {t.name!r} for a {family} model")
        if name in ignore:
            continue
        if name not in slots:
            raise WeightLoadError(f"{path}: tensor {t.name!r} ({name}) is not part of this model")
        seen.add(name)
        shape = t.shape
        for slot in slots[name]:
            if shape != slot.full_shape:
                raise WeightLoadError(
                    f"{path}: tensor {t.name!r} has shape {list(shape)}, the model expects {list(slot.full_shape)}"
                )
        proj = name.split(".")[-2]
        n_heads = heads.get(proj) if name.endswith(".weight") else None
        if native and len(shape) == 2:
            for slot in slots[name]:
                matrices[id(slot.param)].append((slot, _part(gguf, t, slot, n_heads)))
        else:
            load_whole(path, name, _dequantized(gguf, t, n_heads), slots[name])
    missing = sorted(set(slots) - seen - ignore)
    if missing:
        raise WeightLoadError(f"{path}: missing tensor(s) {missing[:5]}")
    replace_parameters(model, {key: _installed(entries) for key, entries in matrices.items()})


def _derived_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise WeightLoadError(f"{model_dir / 'config.json'}: cannot read the derived config: {e}") from None


def _load_moe_tensor(
    gguf: GGUFFile, t: GGUFTensor, names: list[str], slots: dict[str, list[WeightSlot]], ignore: set[str]
) -> list[str]:
    """A MoE tensor dequantized into its slots: a stacked (E, r, c) one as its E experts (expert e is
    `[e]`), the shared expert's gate (H,) as Hugging Face's (1, H). Returns the names it filled."""
    parts = _moe_parts(_dequantized(gguf, t, None))
    if len(parts) != len(names):
        raise WeightLoadError(
            f"{gguf.path}: tensor {t.name!r} holds {len(parts)} experts, the model {len(names)}"
        )
    for name, part in zip(names, parts, strict=True):
        if name in ignore:
            continue
        if name not in slots:
            raise WeightLoadError(f"{gguf.path}: tensor {t.name!r} ({name}) is not part of this model")
        load_whole(gguf.path, name, part, slots[name])
    return names


def _moe_parts(w: torch.Tensor) -> list[torch.Tensor]:
    """A MoE tensor as the tensors Hugging Face names: (E, r, c) -> E of (r, c); a shared expert's
    gate (H,) -> (1, H); a router or shared projection as it is."""
    if w.dim() == 3:
        return [e.contiguous() for e in w]
    return [w.reshape(1, -1) if w.dim() == 1 else w]


def _permuted_heads(model: nn.Module, family: str) -> dict[str, int]:
    """Projection name -> its head count, for the projections whose rows llama.cpp permuted."""
    if family not in PERMUTED_ROPE:
        return {}
    cfg: Any = model.config
    return {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}


def hf_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """For each row of HF's layout, the row of llama.cpp's permuted layout that holds it.

    llama.cpp's converter reorders each head's D rows from HF's [first halves | second halves] to
    interleaved pairs: HF row h * D + t * D / 2 + j sits at row h * D + 2 j + t."""
    d = rows // n_heads
    hf = torch.arange(rows)
    head, within = hf // d, hf % d
    return head * d + 2 * (within % (d // 2)) + within // (d // 2)


def _part(gguf: GGUFFile, t: GGUFTensor, slot: WeightSlot, n_heads: int | None) -> QuantPart:
    """This rank's rows of a 2-D tensor, as a part of the slot's weight (in HF's row order)."""
    fmt = gguf.format(t)
    rows, k = t.shape
    data = gguf.raw_rows(t)
    order = hf_row_order(rows, n_heads) if n_heads else None
    if slot.shard_dim == 0:
        keep = torch.arange(slot.start, slot.start + slot.length)
        order = keep if order is None else order[keep]
    elif slot.shard_dim == 1:
        bs = fmt.block_size
        if slot.start % bs or slot.length % bs:
            raise WeightLoadError(
                f"{gguf.path}: tensor {t.name!r} ({fmt.name}) cannot be split at input feature {slot.start} "
                f"(not a {bs}-weight block boundary); use --dtype float32 for this tensor-parallel size"
            )
        first = slot.start // bs * fmt.type_size
        data = data[:, first : first + fmt.row_bytes(slot.length)]
        k = slot.length
    return QuantPart(fmt, data, k, order, mapped=True)


def _installed(entries: list[tuple[WeightSlot, QuantPart]]) -> QuantizedWeight:
    """One parameter's parts (in row order) as its QuantizedWeight."""
    entries.sort(key=lambda e: e[0].dst)
    param = entries[0][0].param
    parts, row = [], 0
    for slot, part in entries:
        if slot.dst != row:
            raise WeightLoadError(f"internal: rows {row}..{slot.dst} of a fused weight have no tensor")
        parts.append(part)
        row += part.rows
    if row < param.shape[0]:  # the zero-padded rows of the last vocabulary shard
        parts.append(
            QuantPart(
                GGMLType.F32,
                torch.zeros(param.shape[0] - row, param.shape[1]).view(torch.uint8),
                param.shape[1],
            )
        )
    return QuantizedWeight(parts)


def replace_parameters(model: nn.Module, values: dict[int, object]) -> None:
    """Put `values[id(p)]` wherever parameter `p` is one of a module of `model` (a tied embedding and
    LM head share one), as a plain attribute; one walk over the modules for all of them."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in values:
                del module._parameters[name]
                setattr(module, name, values[id(p)])


def _dequantized(gguf: GGUFFile, t: GGUFTensor, n_heads: int | None) -> torch.Tensor:
    """The whole tensor in float32, q/k rows in HF's order."""
    fmt, shape = gguf.format(t), t.shape
    rows, k = math.prod(shape[:-1]), shape[-1]
    try:
        part = QuantPart(fmt, gguf.raw_rows(t), k)
    except ValueError as e:
        raise GGUFConversionError(f"{gguf.path}: cannot read tensor {t.name!r}: {e}") from None
    if quant_available():  # the C kernel: the same values as the torch reference, many times faster
        w = dequant_rows(QuantizedWeight([part]), torch.arange(rows)).reshape(shape)
    else:
        w = dequantize(fmt, part.data, k).reshape(shape)
    if n_heads:
        w = w.index_select(0, hf_row_order(rows, n_heads))
    return w


def hf_state_dict(model_dir: Path, config: dict) -> dict[str, torch.Tensor]:
    """The GGUF file's tensors dequantized to float32 under Hugging Face's names and layout (q/k rows
    in HF's order): the float32 reference, for transformers (`config`: the derived config.json)."""
    gguf = GGUFFile(model_dir)
    heads = {}
    if config["model_type"] in PERMUTED_ROPE:
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    out: dict[str, torch.Tensor] = {}
    for t in gguf.tensors:
        experts = moe_names(t.name, config)
        if experts is not None:  # a mixture of experts' tensor: one per expert, as transformers names them
            out.update(zip(experts, _moe_parts(_dequantized(gguf, t, None)), strict=True))
            continue
        name = gguf_to_hf_name(t.name)
        if name is None:
            raise WeightLoadError(f"{gguf.path}: unexpected tensor {t.name!r}")
        n_heads = heads.get(name.split(".")[-2]) if name.endswith(".weight") else None
        out[name] = _dequantized(gguf, t, n_heads)
    return out
