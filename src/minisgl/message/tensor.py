"""The wire form of a tensor: {"__type__": "Tensor", "buffer": raw bytes, "dtype": "torch.int32"}.

A 1-D tensor carries exactly those three keys (the chapter's format); any other rank adds
"shape": [d0, d1, ...] after "dtype" (a 0-d tensor has "shape": []). Only the dtypes of `DTYPES`
travel; the buffer is the tensor's bytes in C order, native (little-endian) byte order.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

# The closed set of dtypes on the wire: name -> (torch dtype, numpy dtype used to copy the bytes).
# numpy has no bfloat16, so its bytes go through int16 and are re-viewed as bfloat16.
_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    f"torch.{n}": (getattr(torch, n), np.dtype("int16" if n == "bfloat16" else n)) for n in _NAMES
}
_NAME_OF: dict[torch.dtype, str] = {t: name for name, (t, _) in DTYPES.items()}
MAX_DIMS = 64


class TensorMap(msgspec.Struct, tag_field="__type__", tag="Tensor", forbid_unknown_fields=True, gc=False):
    """The wire map of a tensor as msgspec writes and reads it (no "shape" key when it is UNSET)."""

    buffer: bytes
    dtype: str
    shape: list[int] | msgspec.UnsetType = msgspec.UNSET


class TensorFormatError(ValueError):
    """A tensor map that cannot be turned back into a tensor (the codec adds where it was)."""


def tensor_to_map(t: torch.Tensor) -> TensorMap:
    """Tensor -> its wire map. Copies to the CPU first if needed."""
    name = _NAME_OF.get(t.dtype)
    if name is None:
        raise TypeError(f"tensor dtype {t.dtype} cannot be sent (supported: {', '.join(DTYPES)})")
    if name == "torch.bfloat16":  # numpy has no bfloat16: send its bits as int16
        buf = t.detach().cpu().contiguous().view(torch.int16).numpy().tobytes()
    else:
        try:
            buf = t.numpy().tobytes()  # C order even for a non-contiguous view
        except (RuntimeError, TypeError):  # on a GPU, or requires grad
            buf = t.detach().cpu().numpy().tobytes()
    return TensorMap(buf, name, msgspec.UNSET if t.dim() == 1 else list(t.shape))


def decode_tensor(buffer: object, dtype: object, shape: object = None) -> torch.Tensor:
    """The parts of a wire map -> a fresh CPU tensor (it owns a copy of the bytes).

    shape=None means "1-D" (the chapter's form). Raises TensorFormatError naming the problem.
    """
    if buffer.__class__ is not bytes:
        raise TensorFormatError(f"'buffer' must be bytes, got {type(buffer).__name__}")
    if dtype.__class__ is not str:
        raise TensorFormatError(f"'dtype' must be a str, got {type(dtype).__name__}")
    if dtype not in DTYPES:
        raise TensorFormatError(f"unsupported tensor dtype {dtype[:40]!r} (supported: {', '.join(DTYPES)})")
    torch_dtype, np_dtype = DTYPES[dtype]
    size = len(buffer)
    if shape is None and size % np_dtype.itemsize:
        raise TensorFormatError(f"buffer of {size} bytes is not a whole number of {dtype} elements")
    if shape is not None:
        if shape.__class__ is not list and shape.__class__ is not tuple:
            raise TensorFormatError(f"'shape' must be a list of ints, got {type(shape).__name__}")
        if len(shape) > MAX_DIMS:
            raise TensorFormatError(f"'shape' has {len(shape)} dimensions (at most {MAX_DIMS})")
        if any(d.__class__ is not int or d < 0 for d in shape):
            raise TensorFormatError(f"'shape' must hold non-negative ints, got {shape!r:.80}")
        if np_dtype.itemsize * math.prod(shape) != size:
            need = np_dtype.itemsize * math.prod(shape)
            raise TensorFormatError(
                f"buffer holds {size} bytes but shape {list(shape)} of {dtype} needs {need}"
            )
    arr = np.frombuffer(buffer, dtype=np_dtype)
    arr = (arr if shape is None else arr.reshape(shape)).copy()  # its own, writable memory
    out = torch.from_numpy(arr)
    return out.view(torch.bfloat16) if torch_dtype is torch.bfloat16 else out
