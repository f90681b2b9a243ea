"""`QuantizedWeight`: a (N, K) weight kept in its checkpoint's block formats, one copy in memory.

Its rows come from one or more parts (`QuantPart`: one checkpoint tensor's raw rows, a uint8 view
over the file's memory map, or over a 16-bit tensor), so fused projections (q/k/v, gate/up) need no
copy, and the parts may differ in format (a Q4_K_M file keeps attn_v in Q6_K next to Q4_K q and k).
A part may take its rows in another order (llama.cpp's permuted q/k rows, put back in Hugging Face's
order) and only a range of K (a tensor-parallel shard of the input features): the kernels read a
table of row addresses (`row_ptrs`) and formats (`row_fmts`), so neither needs a copy either.

The CPU backend may repack the rows of Q4_0/Q4_1/Q8_0 weights once at load for its decode kernel
(`minisgl.kernels.quant.repack`): the row table then points into that buffer (`packed`) and the
file's pages of the parts are handed back to the page cache, so memory still holds one copy; the
parts stay valid for the reference path (`dequantize`, `lookup`), which reads them from the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .formats import GGMLType, dequantize


@dataclass
class QuantPart:
    """Rows of one checkpoint tensor: `data` (R, row_bytes) uint8 whose rows are `k` weights of `fmt`
    (a view: the row stride may exceed row_bytes for a K shard), taken in `order` (None: as stored)."""

    fmt: GGMLType
    data: torch.Tensor
    k: int
    order: torch.Tensor | None = None  # (rows,) int64 indices into data's rows
    mapped: bool = False  # data is a view of a read-only file mapping (its pages may be released)

    def __post_init__(self) -> None:
        d = self.data
        if (
            d.dtype != torch.uint8
            or d.dim() != 2
            or d.stride(1) != 1
            or d.shape[1] != self.fmt.row_bytes(self.k)
        ):
            raise ValueError(
                f"{self.fmt.name} part: expected (rows, {self.fmt.row_bytes(self.k)}) uint8 rows, "
                f"got {tuple(d.shape)} {d.dtype} strides {d.stride()}"
            )

    @property
    def rows(self) -> int:
        return self.data.shape[0] if self.order is None else self.order.shape[0]

    def row_ptrs(self) -> torch.Tensor:
        """(rows,) int64: the address of each row's first byte."""
        idx = torch.arange(self.data.shape[0]) if self.order is None else self.order
        return self.data.data_ptr() + idx * self.data.stride(0)

    def dequantize(self) -> torch.Tensor:
        """(rows, k) float32, in `order` (the reference path)."""
        rows = self.data if self.order is None else self.data.index_select(0, self.order)
        return dequantize(self.fmt, rows, self.k)


@dataclass(eq=False)
class QuantizedWeight:
    """W (N, K) stored as the rows of `parts`, top to bottom. Not a tensor: the ops backends take it
    where they take a weight (`linear`, `embedding`); the torch reference dequantizes it."""

    parts: list[QuantPart]
    row_ptrs: torch.Tensor = field(init=False)  # (N,) int64 row addresses
    row_fmts: torch.Tensor = field(init=False)  # (N,) int32 ggml type of each row
    packed: torch.Tensor | None = field(init=False, default=None)  # the repacked rows, when repacked

    def __post_init__(self) -> None:
        if not self.parts or len({p.k for p in self.parts}) != 1:
            raise ValueError("a QuantizedWeight needs parts of one row length")
        self.row_ptrs = torch.cat([p.row_ptrs() for p in self.parts])
        self.row_fmts = torch.cat([torch.full((p.rows,), int(p.fmt), dtype=torch.int32) for p in self.parts])

    def use_packed(self, packed: torch.Tensor, row_ptrs: torch.Tensor, row_fmts: torch.Tensor) -> None:
        """Point the row table at repacked rows held by `packed` (uint8; the kernels' own formats)."""
        if row_ptrs.shape != self.row_ptrs.shape or row_fmts.shape != self.row_fmts.shape:
            raise ValueError("use_packed: a row table of another size")
        self.packed, self.row_ptrs, self.row_fmts = packed, row_ptrs, row_fmts

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.row_ptrs.shape[0]), self.parts[0].k)

    @property
    def device(self) -> torch.device:
        return self.row_ptrs.device  # the CPU: the rows live in host memory

    @property
    def formats(self) -> set[GGMLType]:
        return {p.fmt for p in self.parts}

    @property
    def nbytes(self) -> int:
        """Bytes of weight data (what a pass over the whole weight reads)."""
        return sum(p.rows * p.fmt.row_bytes(p.k) for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) in `dtype`: the reference path, and `--dtype float32`."""
        return torch.cat([p.dequantize() for p in self.parts]).to(dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (T,) dequantized -> (T, K) float32 (the embedding lookup's reference)."""
        start = 0
        w = torch.empty(ids.shape[0], self.shape[1])
        for p in self.parts:  # each id's row lies in exactly one part
            inside = (ids >= start) & (ids < start + p.rows)
            if inside.any():
                local = ids[inside] - start
                src = local if p.order is None else p.order[local]
                w[inside] = dequantize(p.fmt, p.data.index_select(0, src), p.k)
            start += p.rows
        return w

    def __repr__(self) -> str:
        fmts = "+".join(sorted(f.name for f in self.formats))
        return f"QuantizedWeight({fmts}, shape={self.shape})"


_FLOAT_FORMATS = {torch.float32: GGMLType.F32, torch.float16: GGMLType.F16, torch.bfloat16: GGMLType.BF16}


def as_quantized(weight: torch.Tensor) -> QuantizedWeight:
    """A contiguous 2-D float32/float16/bfloat16 tensor as a one-part QuantizedWeight over its own
    storage (no copy; the QuantizedWeight holds the tensor, which must not change afterwards)."""
    if weight.dtype not in _FLOAT_FORMATS or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"as_quantized: expected a contiguous 2-D float tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    return QuantizedWeight(
        [QuantPart(_FLOAT_FORMATS[weight.dtype], weight.view(torch.uint8), weight.shape[1])]
    )
