"""Projections of a few rows (decode batches) in Triton: the tensor-core GEMV of up to 16 rows, 16-bit
or fp8 weights (`tile`), and the CUDA-core fp8 row GEMV of batch-1 decode with the RMSNorm, SiLU x up
and the residual add fused (`row`)."""

from .row import RowGemvConfig, gemv_fp8_rows
from .tile import GemvConfig, gemv, gemv_fp8, store_rounded

__all__ = ["GemvConfig", "RowGemvConfig", "gemv", "gemv_fp8", "gemv_fp8_rows", "store_rounded"]
