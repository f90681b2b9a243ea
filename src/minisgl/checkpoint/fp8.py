"""fp8 weights: the schemes read from a checkpoint's `quantization_config` (or asked for with
`--quantization fp8`), turning a model's projections to fp8 before loading, and where each
checkpoint scale goes.

Read as published:
- `quant_method: "fp8"` (DeepSeek-V3, Qwen3-*-FP8, transformers' FineGrainedFP8): e4m3 weights with
  a `weight_scale_inv` per `weight_block_size` block; without a block size, a `weight_scale` per tensor;
- `quant_method: "compressed-tensors"` with 8-bit float weights (llm-compressor's FP8, FP8-dynamic,
  FP8-block): a `weight_scale` per tensor, per channel or per block;
- `quant_method: "fbgemm_fp8"`: a `weight_scale` per channel.
Activations are quantized per token as they come (dynamic), also where a checkpoint carries static
`input_scale`s (ignored: a per-token scale fits each row at least as well as one fixed scale); the LM
head and the embedding stay in the model's dtype. Other methods and formats (GPTQ, AWQ, int8, fp4,
group scales, ...) are refused by name.

`--quantization fp8` over a checkpoint of 16- or 32-bit weights quantizes each projection as it is
loaded, one scale per output channel; random weights (`--dummy-weights`) are quantized the same way
(by blocks where the config names a block size). `--quantization fp8_lm_head` does the same and
also holds the LM head in fp8 with one scale per vocab row, quantized at load from the checkpoint's
16/32-bit head (the published schemes and vLLM keep it in the model's dtype, so it is opt-in: at
batch 1 of an 8B model the bf16 head is ~9% of a decode step; not with tied embeddings on one rank,
where the head is the embedding table). A per-tensor scale is held per channel, so fused
q/k/v and gate/up keep each part's own scale. Under tensor parallelism a rank quantizing at load
scales its own shard. KV-cache scales a checkpoint carries (`self_attn.k_scale`, `v_scale`, ...) are
kept on the attention layers for an fp8 KV cache (`--kv-cache-dtype fp8_e4m3`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minisgl.backends.fp8 import FP8, Fp8Weight, quantize_fp8
from minisgl.checkpoint.weights import WeightLoadError, WeightSlot
from minisgl.layers import AttentionLayer, Embedding, Linear, LMHead

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8", "fp8_lm_head")
# minisgl's fused projections and the checkpoint modules each is made of
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Activation scales some checkpoints carry: read past (activations are quantized per token).
ACTIVATION_SCALES = ("input_scale", "input_scale_ub", "input_zero_point", "q_scale")
# KV-cache scales under `...self_attn.` and which of K (0) and V (1) each gives.
KV_SCALES = {
    "k_scale": (0,),
    "v_scale": (1,),
    "k_proj.output_scale": (0,),
    "v_proj.output_scale": (1,),
    "kv_scale": (0, 1),
}
_SUPPORTED = "quant_method fp8, compressed-tensors with 8-bit float weights, fbgemm_fp8"


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's projections are held in fp8 and what its checkpoint holds."""

    source: str  # where the scheme comes from, for messages
    block: tuple[int, int] | None = None  # weight scale block (rows, cols); None: per channel
    prequantized: bool = False  # the checkpoint holds fp8 weights and their scales
    scale_suffix: str = "weight_scale"  # the scale tensor's name beside `weight`
    targets: tuple[str, ...] = ("Linear",)  # modules quantized: "Linear" (all), names, "re:" patterns
    ignore: tuple[str, ...] = ()  # modules kept in the model's dtype: names or "re:" patterns
    substring: bool = False  # an `ignore` entry matches any module name containing it (HF's rule)
    lm_head: bool = False  # the LM head too, per vocab row, quantized at load (`fp8_lm_head`)

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint module `module` (e.g. model.layers.0.self_attn.q_proj) is fp8."""
        if any(self._match(module, p) or (self.substring and p in module) for p in self.ignore):
            return False
        return "Linear" in self.targets or any(self._match(module, p) for p in self.targets)

    @staticmethod
    def _match(module: str, pattern: str) -> bool:
        return re.match(pattern[3:], module) is not None if pattern.startswith("re:") else module == pattern


def parse_scheme(raw: dict[str, Any]) -> Fp8Scheme | None:
    """The fp8 scheme of a config.json's `quantization_config` (None without one); ValueError naming
    what is not supported."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError("quantization_config must be a JSON object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fbgemm_fp8":
        ignore = _names(qc.get("modules_to_not_convert"), "modules_to_not_convert")
        return Fp8Scheme("fbgemm_fp8 (per channel)", prequantized=True, ignore=ignore, substring=True)
    raise ValueError(
        f"quantization_config: quant_method {method!r} is not supported (supported: {_SUPPORTED})"
    )


def _hf_fp8(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config: fp8 fmt {fmt!r} is not supported (only e4m3)")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ValueError(
            f"quantization_config: activation_scheme {qc.get('activation_scheme')!r} is not supported"
        )
    ignore = _names(qc.get("modules_to_not_convert") or qc.get("ignored_layers"), "modules_to_not_convert")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8 (per tensor)", prequantized=True, ignore=ignore, substring=True)
    block = _block(block, "weight_block_size")
    return Fp8Scheme(
        f"fp8 (blocks of {block[0]}x{block[1]})",
        block=block,
        prequantized=True,
        scale_suffix="weight_scale_inv",
        ignore=ignore,
        substring=True,
    )


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise ValueError(
            f"quantization_config: compressed-tensors format {fmt!r} is not supported ({_SUPPORTED})"
        )
    sparsity = qc.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        raise ValueError("quantization_config: compressed-tensors sparsity is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config: compressed-tensors without config_groups")
    strategies: set[tuple[str, tuple[int, int] | None]] = set()
    targets: list[str] = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise ValueError(f"quantization_config: config_groups.{name} must be an object")
        strategies.add(_ct_weights(group.get("weights"), name))
        _ct_activations(group.get("input_activations"), name)
        targets += _names(group.get("targets") or ["Linear"], f"config_groups.{name}.targets")
    if len(strategies) > 1:
        raise ValueError(
            f"quantization_config: config groups with different weight strategies {sorted(strategies, key=str)}"
        )
    kv = qc.get("kv_cache_scheme")
    if isinstance(kv, dict) and (kv.get("type") != "float" or kv.get("num_bits") != 8):
        raise ValueError(
            f"quantization_config: kv_cache_scheme {kv.get('type')} {kv.get('num_bits')}-bit is not supported (only 8-bit float)"
        )
    strategy, block = strategies.pop()
    return Fp8Scheme(
        f"compressed-tensors (fp8 per {strategy})",
        block=block,
        prequantized=True,
        targets=tuple(targets),
        ignore=_names(qc.get("ignore"), "ignore"),
    )


def _ct_weights(w: Any, group: str) -> tuple[str, tuple[int, int] | None]:
    """(strategy, block) of a compressed-tensors group's weights, if they are 8-bit floats."""
    if not isinstance(w, dict):
        raise ValueError(f"quantization_config: config_groups.{group} has no weights scheme")
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if kind != "float" or bits != 8:
        raise ValueError(
            f"quantization_config: compressed-tensors {kind} {bits}-bit weights are not supported ({_SUPPORTED})"
        )
    if strategy == "block":
        return "block", _block(w.get("block_structure"), "block_structure")
    if strategy not in ("tensor", "channel"):
        raise ValueError(
            f"quantization_config: fp8 weight strategy {strategy!r} is not supported (tensor, channel, block)"
        )
    return strategy, None


def _ct_activations(a: Any, group: str) -> None:
    """Activations: none (weight-only) or 8-bit float, any strategy: all run per token here."""
    if a is None:
        return
    if not isinstance(a, dict) or a.get("type") != "float" or a.get("num_bits") != 8:
        what = f"{a.get('type')} {a.get('num_bits')}-bit" if isinstance(a, dict) else repr(a)
        raise ValueError(f"quantization_config: config_groups.{group}: {what} activations are not supported")


def _block(value: Any, field: str) -> tuple[int, int]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(f"quantization_config: {field} must be two positive ints, got {value!r}")
    return int(value[0]), int(value[1])


def _names(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config: {field} must be a list of names")
    return tuple(value)


def resolve_scheme(checkpoint: Fp8Scheme | None, quantization: str | None, dummy: bool) -> Fp8Scheme | None:
    """The scheme to load with: the checkpoint's if it has one, else `--quantization`'s (per channel,
    quantized at load); random weights are always quantized at load, by the checkpoint's blocks."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    scheme = checkpoint
    if scheme is None and quantization is not None:
        scheme = Fp8Scheme("--quantization fp8 (per channel, quantized at load)")
    if scheme is not None and dummy and scheme.prequantized:
        scheme = dataclasses.replace(scheme, prequantized=False, source=f"{scheme.source}, random weights")
    if scheme is not None and quantization == "fp8_lm_head":
        scheme = dataclasses.replace(scheme, lm_head=True, source=f"{scheme.source}, LM head fp8 per row")
    return scheme


# -------------------------------------------------------------------------------------------------
# The model's side: fp8 projections and where the checkpoint's tensors go


def apply_fp8(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Turn the projections `scheme` quantizes to fp8 (before loading: the slots then point at the fp8
    parameters). Returns how many."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and _quantized(scheme, name):
            module.to_fp8(scheme.block)
            count += 1
    if scheme.lm_head:
        tables = {id(m.weight) for m in model.modules() if isinstance(m, Embedding)}
        for module in model.modules():
            if isinstance(module, LMHead) and id(module.weight) not in tables:  # tied: the table stays
                module.to_fp8()
                count += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the 16-bit weights just freed, back to the device for the KV pool
    logger.info("fp8 weights: %s, %d projections", scheme.source, count)
    return count


def _quantized(scheme: Fp8Scheme, name: str) -> bool:
    prefix, _, leaf = name.rpartition(".")
    parts = [f"{prefix}.{p}" if prefix else p for p in FUSED.get(leaf, (leaf,))]
    flags = [scheme.quantizes(p) for p in parts]
    if any(flags) and not all(flags):
        fp8 = [p for p, f in zip(parts, flags, strict=True) if f]
        raise WeightLoadError(
            f"{scheme.source}: {fp8} are fp8 but not the rest of {parts}, which minisgl runs as one projection"
        )
    return all(flags)


def fp8_slots(model: nn.Module, slots: dict[str, list[WeightSlot]], scheme: Fp8Scheme) -> None:
    """In place: each fp8 projection's weight slots quantize what they are given (or take fp8 as it
    is), and a prequantized checkpoint's scale tensors get slots placed like their weight's rows."""
    fp8_of = {
        id(m.weight): m.fp8 for m in model.modules() if isinstance(m, (Linear, LMHead)) and m.fp8 is not None
    }
    heads = {id(m.weight) for m in model.modules() if isinstance(m, LMHead)}  # quantized at load, always
    scales: dict[str, list[WeightSlot]] = {}
    for name, targets in slots.items():
        for i, slot in enumerate(targets):
            fp8 = fp8_of.get(id(slot.param))
            if fp8 is None:
                continue
            geometry = {f.name: getattr(slot, f.name) for f in dataclasses.fields(WeightSlot)}
            fp8_slot = Fp8WeightSlot(**geometry, fp8=fp8)
            fp8_slot.check_blocks(name)
            targets[i] = fp8_slot
            if scheme.prequantized and id(slot.param) not in heads:
                scale_name = name.removesuffix("weight") + scheme.scale_suffix
                scales.setdefault(scale_name, []).append(Fp8ScaleSlot.of(fp8_slot))
    slots.update(scales)


def kv_scale_slots(
    model: nn.Module, names: set[str], total_kv_heads: int, kv_start: int
) -> dict[str, list[WeightSlot]]:
    """Slots for the KV-cache scales among the checkpoint's tensor `names`: each attention layer that
    has any gets `kv_scale` (2, local KV heads) float32, ones where the checkpoint gives none."""
    slots: dict[str, list[WeightSlot]] = {}
    for mod_name, layer in model.named_modules():
        if not isinstance(layer, AttentionLayer):
            continue
        prefix = mod_name.removesuffix("attn")  # "model.layers.3.self_attn."
        found = [s for s in KV_SCALES if prefix + s in names]
        if not found:
            continue
        device = next(model.parameters()).device
        layer.kv_scale = torch.ones(2, layer.num_kv_heads, dtype=torch.float32, device=device)
        for s in found:
            slots[prefix + s] = [
                KVScaleSlot(layer.kv_scale[row], (total_kv_heads,), 0, kv_start, layer.num_kv_heads)
                for row in KV_SCALES[s]
            ]
    return slots


def unused_scales(names: set[str]) -> set[str]:
    """The checkpoint's activation scales, which minisgl reads past."""
    return {n for n in names if n.rpartition(".")[2] in ACTIVATION_SCALES}


@dataclass
class Fp8WeightSlot(WeightSlot):
    """An fp8 projection's rows: fp8 from a prequantized checkpoint is copied as it is (its scales
    have their own slot); 16/32-bit weights are quantized here (per channel or block)."""

    fp8: Fp8Weight | None = None

    def check_blocks(self, name: str) -> None:
        """WeightLoadError if a scale block would straddle two checkpoint tensors of one fused
        projection, or two tensor-parallel ranks."""
        if self.fp8 is None or self.fp8.block is None:
            return
        bn, bk = self.fp8.block
        n, k = self.full_shape
        rows = self.length if self.shard_dim == 0 else n
        problems = []
        if self.dst % bn or (rows % bn and self.dst + rows != self.param.shape[0]):
            problems.append(f"rows {self.dst}..{self.dst + rows} of the fused projection")
        if self.shard_dim is not None:
            size, step, what = (n, bn, "rows") if self.shard_dim == 0 else (k, bk, "columns")
            end = self.start + self.length
            if self.start % step or (self.length % step and end != size):
                problems.append(f"this rank's {what} {self.start}..{end}")
        if problems:
            raise WeightLoadError(f"{name}: {' and '.join(problems)} do not fall on fp8 blocks of {bn}x{bk}")

    def copy_in(self, t: torch.Tensor) -> None:
        assert self.fp8 is not None
        if t.dtype == FP8:
            super().copy_in(t)
            return
        if not t.dtype.is_floating_point:
            raise WeightLoadError(f"an fp8 projection cannot load a {t.dtype} tensor")
        q, scale = quantize_fp8(t.to(self.param.device), self.fp8.block)
        super().copy_in(q)
        rows = self.dst if self.fp8.block is None else self.dst // self.fp8.block[0]
        self.fp8.scale.narrow(0, rows, scale.shape[0]).copy_(scale)


@dataclass
class Fp8ScaleSlot(WeightSlot):
    """A prequantized weight's scales (per tensor, per channel or per block), placed like the weight
    slot's rows (per block, also its columns)."""

    weight: WeightSlot | None = None
    block: tuple[int, int] | None = None

    @staticmethod
    def of(slot: Fp8WeightSlot) -> Fp8ScaleSlot:
        assert slot.fp8 is not None
        n, k = slot.full_shape
        block = slot.fp8.block
        shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
        return Fp8ScaleSlot(slot.fp8.scale, shape, weight=slot, block=block)

    def accepts(self, shape: tuple[int, ...]) -> bool:
        if self.block is None:
            return shape in ((), (1,), (1, 1), self.full_shape, (*self.full_shape, 1))
        return shape == self.full_shape

    def read(self, sl: Any) -> torch.Tensor:
        return sl[...]  # scales are small: whole, then placed in copy_in

    def copy_in(self, t: torch.Tensor) -> None:
        w = self.weight
        assert w is not None
        n = w.full_shape[0]
        t = t.to(self.param.device, torch.float32)
        if self.block is None:
            src = t.reshape(-1).expand(n) if t.numel() == 1 else t.reshape(-1)
            start, rows = (w.start, w.length) if w.shard_dim == 0 else (0, n)
            self.param.narrow(0, w.dst, rows).copy_(src[start : start + rows])
            return
        bn, bk = self.block
        if w.shard_dim == 0:
            t = t[w.start // bn : -(-(w.start + w.length) // bn)]
        elif w.shard_dim == 1:
            t = t[:, w.start // bk : -(-(w.start + w.length) // bk)]
        self.param.narrow(0, w.dst // bn, t.shape[0]).copy_(t)


@dataclass
class KVScaleSlot(WeightSlot):
    """One of K/V's cache scales of a layer: one for every KV head (spread) or one per head."""

    def accepts(self, shape: tuple[int, ...]) -> bool:
        numel = int(torch.Size(shape).numel())
        return numel == 1 or numel == self.full_shape[0]

    def read(self, sl: Any) -> torch.Tensor:
        return sl[...]

    def copy_in(self, t: torch.Tensor) -> None:
        t = t.to(self.param.device, torch.float32).reshape(-1)
        src = t.expand(self.full_shape[0]) if t.numel() == 1 else t
        self.param.copy_(src[self.start : self.start + self.length])
