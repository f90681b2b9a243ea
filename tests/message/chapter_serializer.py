"""A generic tagged-dict serializer, the way the chapters build their first one.

It is the yardstick that `minisgl.message`'s codec is measured against (`benchmarks/bench_codec.py`)
and the interop partner of the codec tests: any object becomes `{"__type__": class name, **fields}`
through its `__dict__`, a 1-D tensor becomes raw bytes plus a dtype string, containers are walked,
primitives pass through; decoding reverses it through a name -> class table. It checks nothing,
which is what makes it a fair picture of "generic": one walk, one isinstance chain per value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

_PRIMITIVES = (int, float, str, bytes, bool, type(None))


def to_tagged(value: Any) -> Any:
    """An object tree -> a tree of msgpack-able primitives (containers are tested first, as the
    chapters do, so a plain field value goes through three isinstance checks)."""
    if isinstance(value, dict):
        return {k: to_tagged(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_tagged(v) for v in value)
    if isinstance(value, _PRIMITIVES):
        return value
    return _tag_object(value)


def _tag_object(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError("the generic serializer sends 1-D tensors only")
        return {"__type__": "Tensor", "buffer": value.numpy().tobytes(), "dtype": str(value.dtype)}
    tagged: dict[str, Any] = {"__type__": type(value).__name__}
    tagged.update((k, to_tagged(v)) for k, v in vars(value).items())
    return tagged


def from_tagged(classes: dict[str, type], value: Any) -> Any:
    """The inverse of `to_tagged`, building classes by name from `classes`."""
    if isinstance(value, dict):
        if "__type__" in value:
            return _build_object(classes, value)
        return {k: from_tagged(classes, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(from_tagged(classes, v) for v in value)
    return value


def _build_object(classes: dict[str, type], value: dict[str, Any]) -> Any:
    name = value["__type__"]
    if name == "Tensor":
        dtype = np.dtype(value["dtype"].removeprefix("torch."))
        return torch.from_numpy(np.frombuffer(value["buffer"], dtype=dtype).copy())
    fields = {k: from_tagged(classes, v) for k, v in value.items() if k != "__type__"}
    return classes[name](**fields)


def pack(obj: Any) -> bytes:
    return msgpack.packb(to_tagged(obj), use_bin_type=True)


def unpack(classes: dict[str, type], raw: bytes) -> Any:
    return from_tagged(classes, msgpack.unpackb(raw, raw=False))


# The chapters' per-token messages, as the chapters define them (three fields each), and their batches;
# named on the wire as there (`CHAPTER_CLASSES` is the class table that decodes them).
@dataclass
class ChapterDetokenizeMsg:
    uid: int
    next_token: int
    finished: bool


@dataclass
class ChapterUserReply:
    uid: int
    incremental_output: str
    finished: bool


@dataclass
class ChapterBatchTokenizerMsg:
    data: list[Any]


@dataclass
class ChapterBatchFrontendMsg:
    data: list[Any]


_CHAPTER = [ChapterDetokenizeMsg, ChapterUserReply, ChapterBatchTokenizerMsg, ChapterBatchFrontendMsg]
for _cls in _CHAPTER:
    _cls.__name__ = _cls.__name__.removeprefix("Chapter")
CHAPTER_CLASSES: dict[str, type] = {cls.__name__: cls for cls in _CHAPTER}
