"""The CPU backend: minisgl's C kernels (`minisgl.kernels`) for float32 rows, prepacked weights for
the matmuls, and the torch reference for everything else (other dtypes, no C compiler, odd layouts).

Float32 weights take one of two prepacked paths, each packed lazily and remade whenever the weight
changes (data pointer or in-place version), so loaders and tests that write `.weight` need not know:
- decode passes (a few rows) on an AVX2 host: minisgl's streaming kernel (`kernels.packed_matmul`,
  the weight interleaved 8 columns per k), faster there than oneDNN for these skinny GEMMs that wait
  on memory. On an AVX-512 host oneDNN's wider kernels win at decode too (16 rows of SmolLM2-135M
  on a 2-core Xeon: 82 vs 108 ms per step), so decode takes oneDNN's path as well;
- prefill: oneDNN's prepacked matmul (`torch.ops.mkldnn._linear_pointwise` with a weight reordered
  once by `_reorder_linear_weight`), near the machine's peak for many rows, where MKL's `F.linear` is
  not (on AMD the LM head reached ~4 GB/s).
The choice follows the pass (the engine calls `prepare(is_decode)`), not the row count, so a row's
result never depends on what it is batched with (prefill and decode rows never share a batch).
Results differ from `F.linear` by float32 rounding only (~1e-6). Each packed copy is a second (and
third) copy of the weight in RAM.

Weights kept in a checkpoint's format (`QuantizedWeight`: GGUF blocks, 16-bit floats) go to the
quantized kernels (`kernels.quant`) in every pass, one copy in RAM: the projection with the RMSNorm
before it or the SiLU x up and residual add around it in one call, the embedding lookup, the LM head.
Their results are batch-invariant too; prefill passes of the amx and avx512bf16 builds take
bfloat16 products (`kernels.quant`), decode passes and the LM head the integer kernels.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from minisgl import kernels
from minisgl.kernels import quant
from minisgl.quant import QuantizedWeight
from minisgl.utils.pages import huge_page_buffer

from .fp8 import Fp8Weight, Weight
from .torch_ops import QkNorm, TorchOps

logger = logging.getLogger(__name__)

# Rows the oneDNN layout is tuned for. Any value >= 16 gives the same kernel for every row count (1
# uses a GEMV path whose single-row results differ bitwise from the batched ones): keep it >= 16.
_PACK_BATCH_HINT = 64

WeightKey = tuple[int, int, tuple[int, ...]]

# Whether decode passes take minisgl's streaming kernel (8-wide on AVX2 hosts, 16 columns per vector on
# AVX-512 hosts); fixed per process, so a row's result still never depends on its batch mates.
SKINNY_DECODE = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def onednn_linear_available(weight: torch.Tensor) -> bool:
    """Whether `weight` (out, in) can take the prepacked oneDNN path: CPU, float32, oneDNN built in."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _weight_key(weight: torch.Tensor) -> WeightKey:
    """What identifies a weight's contents: storage, in-place version and shape (inference tensors
    carry no version counter; their storage pointer alone is the key)."""
    version = -1 if weight.is_inference() else weight._version
    return (weight.data_ptr(), version, tuple(weight.shape))


class PackedWeight:
    """The packed copies of one weight (oneDNN's for prefill, minisgl's for decode), each made at
    first use and remade when the weight's storage or version changes."""

    __slots__ = ("key", "packed", "skinny", "skinny_key")

    def __init__(self) -> None:
        self.key: WeightKey | None = None
        self.packed: torch.Tensor | None = None
        self.skinny_key: WeightKey | None = None
        self.skinny: torch.Tensor | None = None

    def get_skinny(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The (N / 8, K, 8) copy for the decode matmul kernel (`kernels.packed_matmul`), or None."""
        key = _weight_key(weight)
        if key != self.skinny_key:
            ok = weight.dim() == 2 and weight.shape[0] % 8 == 0 and kernels.fits(weight)
            self.skinny = kernels.pack_weight(weight.detach()) if ok else None
            self.skinny_key = key
        return self.skinny

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """oneDNN's packed weight, or None when `weight` does not qualify (then use `F.linear`)."""
        key = _weight_key(weight)
        if key != self.key:
            ok = onednn_linear_available(weight)
            self.packed = (
                torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT) if ok else None
            )
            self.key = key
        return self.packed


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: PackedWeight, decode: bool
) -> torch.Tensor:
    """x (..., in) @ weight^T (+ bias) through the packed copies in `pack` (decode: minisgl's
    streaming kernel; otherwise oneDNN), or `F.linear` when the weight does not qualify."""
    if decode and SKINNY_DECODE and x.dim() == 2 and kernels.fits(x):
        skinny = pack.get_skinny(weight)
        if skinny is not None:
            return kernels.packed_matmul(x, skinny, bias)
    packed = pack.get(weight) if x.dtype == torch.float32 else None
    if packed is None:
        return torch.nn.functional.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (T, in)
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")  # (T, out)
    return y.view(*lead, weight.shape[0])


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self) -> None:
        quant.prefill_mode()  # a bad MINISGL_CPU_PREFILL is refused here, at start-up
        self.decode = False
        self._packs: dict[int, PackedWeight] = {}  # id(weight) -> its packed copies
        # id(fp8 weight) -> (keys of its tensors, its dequantized copy): fp8 checkpoints run as the
        # reference's weights, dequantized once (a copy in the activations' dtype).
        self._dequantized: dict[int, tuple[tuple[WeightKey, WeightKey], torch.Tensor]] = {}

    def prepare(self, is_decode: bool) -> None:
        self.decode = is_decode

    def adopt(self, model: torch.nn.Module) -> None:
        """Repack the block-format weights for the decode kernel (`quant.repack`: grouped or repacked
        rows), unless MINISGL_CPU_REPACK=0 (the direct kernel over the file's blocks, for comparison).
        They share one buffer in 2 MiB pages (`huge_page_buffer`): a decode step streams every one of
        them, and in 4 KiB pages (small weights each their own allocation) it took 1.14-1.18x the time."""
        if os.environ.get("MINISGL_CPU_REPACK", "1") == "0" or not quant.quant_available():
            return
        start = time.perf_counter()
        weights = {
            id(w): w for m in model.modules() for w in vars(m).values() if isinstance(w, QuantizedWeight)
        }
        sizes = {i: quant.repack_bytes(w) for i, w in weights.items() if w.packed is None}
        offsets, total = {}, 0
        for i, size in sizes.items():
            if size is not None:
                offsets[i], total = total, total + -(-size // 64) * 64
        if not offsets:
            return
        arena = huge_page_buffer(total)
        for i, offset in offsets.items():
            quant.repack(weights[i], out=arena[offset:])
        logger.info(
            "repacked %d weights (%.1f MiB, in 2 MiB pages) for the decode kernel in %.2f s",
            len(offsets),
            total / 2**20,
            time.perf_counter() - start,
        )

    def dequantized(self, weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
        """`weight` dequantized to `dtype`, made at first use and remade when its tensors change."""
        key = (_weight_key(weight.qweight), _weight_key(weight.scale))
        entry = self._dequantized.get(id(weight))
        if entry is None or entry[0] != key or entry[1].dtype != dtype:
            entry = self._dequantized[id(weight)] = (key, weight.dequantize(dtype))
        return entry[1]

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            if _rows_fit(x):
                return quant.qlinear(x, weight, bias, prefill=not self.decode)
            return super().linear(x, weight, bias)
        if isinstance(weight, Fp8Weight):
            weight = self.dequantized(weight, x.dtype)
        if weight.dtype != torch.float32 or not weight.is_cpu:
            return super().linear(x, weight, bias)
        pack = self._packs.get(id(weight))
        if pack is None:  # a stale entry (a freed weight's id reused) is caught by PackedWeight's key
            pack = self._packs[id(weight)] = PackedWeight()
        return packed_linear(x, weight, bias, pack, self.decode)

    def lm_head(self, h: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight) and _rows_fit(h):  # the decode kernel in every pass: a
            return quant.qlinear(h, weight)  # prefill's few rows need not decode the whole table to bf16
        return self.linear(h, weight, None)

    def norm_linear(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: Weight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight) and _rows_fit(x, norm_weight):
            return quant.qlinear(x, weight, bias, norm=(norm_weight, eps), prefill=not self.decode)
        return super().norm_linear(x, norm_weight, eps, weight, bias)

    def linear_add_(
        self,
        x: torch.Tensor,
        weight: Weight,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        gated: bool = False,
    ) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight) and _rows_fit(x, residual):
            return quant.qlinear(x, weight, bias, silu_mul=gated, residual=residual, prefill=not self.decode)
        return super().linear_add_(x, weight, bias, residual, gated)

    def embedding(self, ids: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight) and quant.quant_available():
            return quant.dequant_rows(weight, ids.contiguous())
        return super().embedding(ids, weight)

    def rope_lookup(
        self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kernels.fits(cos, sin) and positions.dtype == torch.int64 and positions.is_contiguous():
            return kernels.gather_rows(cos, positions).unsqueeze(1), kernels.gather_rows(
                sin, positions
            ).unsqueeze(1)
        return super().rope_lookup(cos, sin, positions)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and kernels.fits(x, weight):
            return kernels.add_rmsnorm(x, None, weight, eps)
        return super().rmsnorm(x, weight, eps)

    def rope_qkv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        hq: int,
        hkv: int,
        d: int,
        qk_norm: QkNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        if kernels.fits(qkv, cos, sin):  # one pass in C (after the heads' norms, if any)
            if qk_norm is not None:
                self.norm_qk_(qkv, hq, hkv, d, qk_norm)
            return kernels.rope_split(qkv, cos.view(t, -1), sin.view(t, -1), hq, hkv, d)
        return super().rope_qkv(qkv, cos, sin, hq, hkv, d, qk_norm)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and kernels.fits(gate_up):
            return kernels.silu_mul(gate_up)  # one pass, no temporaries
        return super().silu_and_mul(gate_up)

    def moe(
        self,
        x: torch.Tensor,
        router: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts in one C call (`kernels.moe`): pairs grouped per expert, each expert's weights
        streamed once per call, in their own (E, 2I, H) / (E, H, I) layout (no packed copy)."""
        if x.dim() != 2 or top_k > kernels.MOE_MAX_K or not kernels.fits(x, w13, w2):
            return super().moe(x, router, w13, w2, top_k, renormalize, residual)
        weights, ids = self.route(x, router, top_k, renormalize)
        out = kernels.moe(x, w13, w2, weights, ids)
        return out if residual is None else residual.add_(out)


def _rows_fit(x: torch.Tensor, *more: torch.Tensor) -> bool:
    """Whether the quantized kernels take these: built here, 2-D rows, contiguous float32 CPU tensors."""
    return x.dim() == 2 and kernels.fits(x, *more) and quant.quant_available()
