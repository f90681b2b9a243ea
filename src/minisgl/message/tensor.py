"""The wire form of a tensor: {"__type__": "Tensor", "buffer": raw bytes, "dtype": "torch.int32"}.

A 1-D tensor carries exactly those three keys (the chapter's format); any other rank adds
"shape": [d0, d1, ...] after "dtype" (a 0-d tensor has "shape": []). Only the dtypes of `DTYPES`
travel; the buffer is the tensor's bytes in C order, native (little-endian) byte order.

Decoding gives a torch tensor; encoding takes a torch tensor, a numpy array or a 1-D `array.array`
(the standard library's). torch is imported only when a tensor is decoded (or a torch tensor is met),
and numpy only by who made an array: the tokenizer workers send token ids as `array("i")` and the API
server carries no tensor, so neither imports torch or numpy (16 MB of RSS a process).
"""

from __future__ import annotations

import array
import math
import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor
else:

    class _TensorType(type):
        def __instancecheck__(cls, obj: object) -> bool:
            # a torch tensor or numpy array exists only once its module is imported
            np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
            return (
                isinstance(obj, array.array)
                or (np is not None and isinstance(obj, np.ndarray))
                or (torch is not None and isinstance(obj, torch.Tensor))
            )

    class Tensor(metaclass=_TensorType):
        """The annotation of a message field holding a tensor: torch.Tensor for type checkers; at
        runtime this marker, of which torch tensors (what decoding gives) and numpy arrays (what the
        tokenizer sends) are instances, so that the message classes import without torch."""


_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
DTYPES = tuple(f"torch.{n}" for n in _NAMES)  # the closed set
_ITEMSIZE = {"torch.bool": 1, "torch.uint8": 1, "torch.int8": 1, "torch.int16": 2, "torch.int32": 4}
_ITEMSIZE |= {
    "torch.int64": 8,
    "torch.float16": 2,
    "torch.bfloat16": 2,
    "torch.float32": 4,
    "torch.float64": 8,
}
MAX_DIMS = 64
# array.array type codes -> wire dtypes, by the code's size on this platform (signed, unsigned 8, floats)
_ARRAY_NAME = {
    code: name
    for code, name in (
        ("b", "torch.int8"),
        ("B", "torch.uint8"),
        ("h", "torch.int16"),
        ("i", "torch.int32"),
        ("l", "torch.int64"),
        ("q", "torch.int64"),
        ("f", "torch.float32"),
        ("d", "torch.float64"),
    )
    if array.array(code).itemsize == _ITEMSIZE[name]
}


class TensorFormatError(ValueError):
    """A tensor map that cannot be turned back into a tensor (the codec adds where it was)."""


def tensor_to_map(t: Tensor | np.ndarray | array.array) -> dict[str, Any]:
    """A torch tensor (copied to the CPU first if needed), a numpy array or an array.array -> its
    wire map."""
    if isinstance(t, array.array):  # 1-D
        name = _ARRAY_NAME.get(t.typecode)
        if name is None:
            raise TypeError(
                f"array type code {t.typecode!r} cannot be sent (supported: {', '.join(_ARRAY_NAME)})"
            )
        return {"__type__": "Tensor", "buffer": t.tobytes(), "dtype": name}
    np = sys.modules.get("numpy")  # (loaded wherever an array was made)
    if np is not None and isinstance(t, np.ndarray):
        name = f"torch.{t.dtype.name}" if t.dtype.name in _NAMES and t.dtype.name != "bfloat16" else None
        if name is None:
            raise TypeError(f"array dtype {t.dtype} cannot be sent (supported: {', '.join(DTYPES)})")
        wire = {"__type__": "Tensor", "buffer": np.ascontiguousarray(t).tobytes(), "dtype": name}
        return wire if t.ndim == 1 else wire | {"shape": list(t.shape)}
    tt = cast("Tensor", t)  # (what is left: a torch tensor)
    name = str(tt.dtype)
    if name not in _ITEMSIZE:
        raise TypeError(f"tensor dtype {tt.dtype} cannot be sent (supported: {', '.join(DTYPES)})")
    if name == "torch.bfloat16":  # numpy has no bfloat16: send its bits as int16
        import torch  # (loaded: t is a torch tensor)

        buf = tt.detach().cpu().contiguous().view(torch.int16).numpy().tobytes()
    else:
        try:
            buf = tt.numpy().tobytes()  # C order even for a non-contiguous view
        except (RuntimeError, TypeError):  # on a GPU, or requires grad
            buf = tt.detach().cpu().numpy().tobytes()
    wire = {"__type__": "Tensor", "buffer": buf, "dtype": name}
    return wire if tt.dim() == 1 else wire | {"shape": list(tt.shape)}


def decode_tensor(wire: object) -> Tensor:
    """A wire map (plain msgpack data) -> a CPU tensor over its own, writable copy of the bytes.

    Raises TensorFormatError naming the problem."""
    if wire.__class__ is not dict or wire.get("__type__") != "Tensor":
        got = f"__type__ {wire.get('__type__')!r:.40}" if wire.__class__ is dict else type(wire).__name__
        raise TensorFormatError(f"expected a Tensor map, got {got}")
    if len(wire) != 3 + ("shape" in wire) or "buffer" not in wire or "dtype" not in wire:
        keys = ", ".join(sorted(map(str, wire))[:8])
        raise TensorFormatError(f"bad Tensor map: keys {keys}; expected __type__, buffer, dtype, maybe shape")
    buffer, dtype = wire["buffer"], wire["dtype"]
    if buffer.__class__ is not bytes:
        raise TensorFormatError(f"'buffer' must be bytes, got {type(buffer).__name__}")
    if dtype.__class__ is not str:
        raise TensorFormatError(f"'dtype' must be a str, got {type(dtype).__name__}")
    if dtype not in _ITEMSIZE:
        raise TensorFormatError(f"unsupported tensor dtype {dtype[:40]!r} (supported: {', '.join(DTYPES)})")
    itemsize, size = _ITEMSIZE[dtype], len(buffer)
    shape = wire.get("shape")
    if "shape" not in wire:  # 1-D
        if size % itemsize:
            raise TensorFormatError(f"buffer of {size} bytes is not a whole number of {dtype} elements")
    elif shape.__class__ is not list:
        raise TensorFormatError(f"'shape' must be a list of ints, got {type(shape).__name__}")
    elif len(shape) > MAX_DIMS:
        raise TensorFormatError(f"'shape' has {len(shape)} dimensions (at most {MAX_DIMS})")
    elif any(d.__class__ is not int or d < 0 for d in shape):
        raise TensorFormatError(f"'shape' must hold non-negative ints, got {shape!r:.80}")
    elif (need := itemsize * math.prod(shape)) != size:
        raise TensorFormatError(f"buffer holds {size} bytes but shape {shape} of {dtype} needs {need}")
    import torch

    torch_dtype = getattr(torch, dtype[len("torch.") :])
    if size == 0:  # (torch.frombuffer takes no empty buffer)
        try:
            return torch.empty([0] if shape is None else shape, dtype=torch_dtype)
        except (RuntimeError, TypeError) as e:  # dimensions too large for torch, around a zero
            raise TensorFormatError(f"shape {shape!r:.80}: {str(e).splitlines()[0]:.80}") from None
    out = torch.frombuffer(bytearray(buffer), dtype=torch_dtype)
    return out if shape is None else out.view(shape)
