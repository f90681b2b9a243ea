"""Decode attention kernels beside `kernels.triton.attention`'s (which picks them; they take its
arguments): `packed`, several KV heads' query rows in one tensor-core tile (for large batches over an
fp8 KV pool)."""

from .packed import decode_packed, packed_heads, packed_maxnreg

__all__ = ["decode_packed", "packed_heads", "packed_maxnreg"]
