"""Message codec (PLACEHOLDER: correct but slow and lax; to be replaced by the fast strict codec).

Wire format: a msgpack map {"__type__": class name, field: value, ...}; nested messages likewise; a
tensor is {"__type__": "Tensor", "buffer": raw bytes, "dtype": "torch.int32"} (+ "shape" for N-D).
Each group decodes only its own closed table of classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import torch

from minisgl.core import SamplingParams


class MessageDecodeError(ValueError):
    """Bytes or a dict that are not a valid message of the receiving group."""


def _enc(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        d = {"__type__": "Tensor", "buffer": value.numpy().tobytes(), "dtype": str(value.dtype)}
        if value.dim() != 1:
            d["shape"] = list(value.shape)
        return d
    if dataclasses.is_dataclass(value):
        out: dict[str, Any] = {"__type__": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = _enc(getattr(value, f.name))
        return out
    if isinstance(value, (list, tuple)):
        return [_enc(v) for v in value]
    if isinstance(value, dict):
        return {k: _enc(v) for k, v in value.items()}
    return value


def _dec(table: dict[str, type], value: Any) -> Any:
    if isinstance(value, dict):
        if "__type__" not in value:
            return {k: _dec(table, v) for k, v in value.items()}
        name = value["__type__"]
        if name == "Tensor":
            dtype = getattr(np, value["dtype"].replace("torch.", ""))
            arr = np.frombuffer(value["buffer"], dtype=dtype).copy()
            return torch.from_numpy(arr.reshape(value.get("shape", [-1])))
        cls = table.get(name)
        if cls is None:
            raise MessageDecodeError(f"unknown message type {name!r}")
        try:
            return cls(**{k: _dec(table, v) for k, v in value.items() if k != "__type__"})
        except TypeError as e:
            raise MessageDecodeError(f"bad fields for {name}: {e}") from e
    if isinstance(value, list):
        return [_dec(table, v) for v in value]
    return value


class MessageGroup:
    """A closed table of message classes decoded by one receiver."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.table: dict[str, type] = {"SamplingParams": SamplingParams}
        group = self

        class Base:
            def encoder(self) -> dict:
                return _enc(self)

            def to_bytes(self) -> bytes:
                return msgpack.packb(_enc(self), use_bin_type=True)

            @staticmethod
            def decoder(data: dict) -> Any:
                if not isinstance(data, dict):
                    raise MessageDecodeError(f"a message must be a map, got {type(data).__name__}")
                return _dec(group.table, data)

            @staticmethod
            def from_bytes(raw: bytes) -> Any:
                try:
                    data = msgpack.unpackb(raw, raw=False)
                except Exception as e:
                    raise MessageDecodeError(f"not msgpack: {e}") from e
                return Base.decoder(data)

        self.Base = Base

    def base(self, cls: type) -> type:
        return cls

    def register(self, cls: type) -> type:
        self.table[cls.__name__] = cls
        return cls
