"""Linear layers whose parameters are allocated uninitialised (weights come from the loader).

Column-parallel layers need nothing special: they are plain `Linear`s of the local output width.
`RowParallelLinear` sums the partial products of the ranks (its input is this rank's slice).

On a CPU, float32 weights take one of two prepacked paths, each packed lazily and remade whenever the
weight changes (data pointer or in-place version), so loaders and tests that write `.weight` need not
know about them:
- decode steps (a few rows): minisgl's own streaming kernel (`kernels.packed_matmul`, the weight
  interleaved 8 columns per k), ~1.5x oneDNN at 16 rows on an AVX2 CPU, where those skinny GEMMs wait
  on memory;
- prefill: oneDNN's prepacked matmul (`torch.ops.mkldnn._linear_pointwise` with a weight reordered
  once by `_reorder_linear_weight`), near the machine's peak for many rows, where MKL's `F.linear` is
  not (AMD: the LM head reached ~4 GB/s).
The choice follows the pass (`core.in_decode_pass()`), not the row count, so a row's result never
depends on what it is batched with. GPUs, other dtypes and builds without oneDNN or a C compiler use
`F.linear`. Results differ from `F.linear` by float32 rounding only (~1e-6). Each packed copy is a
second (and third) copy of the weight in RAM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import kernels
from minisgl.core import in_decode_pass
from minisgl.layers.tp import TPInfo, all_reduce

# Rows the packed layout is tuned for. Any value >= 16 gives the same kernel for every row count (1
# uses a GEMV path whose single-row results differ bitwise from the batched ones): keep it >= 16.
_PACK_BATCH_HINT = 64


def onednn_linear_available(weight: torch.Tensor) -> bool:
    """Whether `weight` (out, in) can take the prepacked oneDNN path: CPU, float32, oneDNN built in."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _weight_key(weight: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """What identifies a weight's contents: storage, in-place version and shape (inference tensors
    carry no version counter; their storage pointer alone is the key)."""
    version = -1 if weight.is_inference() else weight._version
    return (weight.data_ptr(), version, tuple(weight.shape))


class PackedWeight:
    """The packed copies of one weight (oneDNN's for prefill, minisgl's for decode), each made at
    first use and remade when the weight's storage or version changes."""

    __slots__ = ("key", "packed", "skinny", "skinny_key")

    def __init__(self) -> None:
        self.key: tuple[int, int, tuple[int, ...]] | None = None
        self.packed: torch.Tensor | None = None
        self.skinny_key: tuple[int, int, tuple[int, ...]] | None = None
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


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: PackedWeight | None
) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T (+ bias) -> (..., out); oneDNN-prepacked when `pack` is given
    and the weight qualifies (see the module docstring), else `F.linear`."""
    if pack is not None and x.dim() == 2 and in_decode_pass() and kernels.fits(x):
        skinny = pack.get_skinny(weight)
        if skinny is not None:  # decode rows: the streaming kernel, ~1.5x oneDNN at 16 rows
            return kernels.packed_matmul(x, skinny, bias)
    packed = pack.get(weight) if pack is not None and x.dtype == torch.float32 else None
    if packed is None:
        return F.linear(x, weight, bias)
    if x.dim() != 2 or not x.is_contiguous():
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (T, in)
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")  # (T, out)
        return y.view(*lead, weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # (T, out)


class Linear(nn.Module):
    """y = x W^T (+ b), W (out, in) allocated empty: no random init on load."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.pack = PackedWeight()  # not a buffer: derived data, never in the state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        return linear(x, self.weight, self.bias, self.pack)


class RowParallelLinear(Linear):
    """Input features split over ranks; the outputs are all-reduced, then the (whole) bias is added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPInfo,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in / N) -> (T, out)
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, self.pack)
        y = all_reduce(linear(x, self.weight, None, self.pack), self.tp)
        return y if self.bias is None else y + self.bias
