"""The message codec: message dataclass <-> msgpack bytes, strict, with msgspec doing the work.

Wire format (the chapters'): a message is a msgpack map {"__type__": class name, field: value, ...}
with the fields in dataclass order; nested messages and `SamplingParams` likewise; a tensor is a
`TensorMap` (tensor.py). Bytes made by the chapters' generic serializer decode here, and ours there.

What is ours:
- A group is a base class, `class BaseBackendMsg(Message, group="backend")`; its subclasses are the
  closed table of classes that its receiver decodes (never a module's globals()).
- Each dataclass of a group (and SamplingParams) has a mirror `msgspec.Struct`: its name as the
  "__type__" tag, the same fields in the same order, and types that msgspec checks in C while it
  parses (a bool is not an int; an int is taken where a float is declared). msgspec writes and reads
  the mirrors; the converters here only move field values between mirrors and dataclasses.
- Fields with a default may be left out on the wire. Anything else that is wrong raises
  `MessageDecodeError` (a ValueError). Its text comes from `_explain`: once msgspec has rejected a
  message, a walk of the plain data against the dataclass annotations names the field and the problem.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from functools import partial
from itertools import groupby, starmap
from operator import attrgetter
from typing import Any, ClassVar, Union

import msgspec
import torch
from msgspec.structs import astuple

from minisgl.core import SamplingParams

from .tensor import TensorFormatError, TensorMap, decode_tensor, tensor_from_map, tensor_to_map

__all__ = ["Message", "MessageDecodeError", "MessageGroup", "group_of"]

Convert = Callable[[Any], Any]
_ENCODER = msgspec.msgpack.Encoder()
_PLAIN_DECODER = msgspec.msgpack.Decoder()  # msgpack -> plain Python values, for `_explain`
_BYTES_LIKE = (bytes, bytearray, memoryview)


class MessageDecodeError(ValueError):
    """Bytes or a dict that are not a valid message of the receiving group."""


class _Never(msgspec.Struct, tag_field="__type__", tag="\x00never", forbid_unknown_fields=True):
    """In every union of mirrors, so that msgspec requires the "__type__" tag (a struct that is
    alone in its field type would also take a map without one). Decoding one is a rejection."""


class Message:
    """Base of the three group bases. `class BaseXMsg(Message, group="x")` starts a group and gives
    it `BaseXMsg.encoder(msg)` / `msg.encoder()` (the tagged dict), `msg.to_bytes()`,
    `BaseXMsg.decoder(dict)` and `BaseXMsg.from_bytes(raw)`; every subclass of it joins the group."""

    _group: ClassVar[MessageGroup]

    def __init_subclass__(cls, group: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not group:
            cls._group.register(cls)
            return
        cls._group = codec = MessageGroup(group, cls)
        cls.encoder = _method(codec.encode)  # type: ignore[method-assign]
        cls.to_bytes = _method(codec.to_bytes)  # type: ignore[method-assign]
        cls.decoder = staticmethod(codec.decode)  # type: ignore[method-assign,assignment]
        cls.from_bytes = staticmethod(codec.from_bytes)  # type: ignore[method-assign,assignment]

    # Replaced per group (above); declared here for readers and type checkers.
    def encoder(self) -> dict[str, Any]: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def decoder(data: dict[str, Any]) -> Message: ...
    @staticmethod
    def from_bytes(raw: bytes) -> Message: ...


def _method(bound: Callable[[Message], Any]) -> Callable[[Message], Any]:
    """A group's bound method as a message method; `__wrapped__` lets `group_of` find the group."""

    def method(self: Message) -> Any:
        return bound(self)

    method.__wrapped__ = bound  # type: ignore[attr-defined]
    method.__doc__ = bound.__doc__
    return method


def group_of(obj: object) -> MessageGroup | None:
    """The group of a group base class or of its encoder/to_bytes/decoder/from_bytes, else None.

    The queues take the one-step bytes path when they are given one of those."""
    target = getattr(obj, "__wrapped__", obj)
    group = getattr(target, "__self__", None) or getattr(target, "_group", None)
    return group if isinstance(group, MessageGroup) else None


class MessageGroup:
    """The closed table of message classes that one receiver (tokenizer, backend, frontend) decodes.

    Its msgspec mirrors are built at first use, once every class of the group is defined."""

    def __init__(self, name: str, root: type) -> None:
        self.name = name
        self.root = root
        self.classes: dict[str, type] = {}
        self._mirrors: _Mirrors | None = None

    def register(self, cls: type) -> None:
        if cls.__name__ in self.classes or cls.__name__ in ("Tensor", "SamplingParams"):
            raise TypeError(f"message name {cls.__name__!r} is already used in the {self.name} group")
        self.classes[cls.__name__] = cls
        self._mirrors = None

    @property
    def mirrors(self) -> _Mirrors:
        if self._mirrors is None:
            self._mirrors = _Mirrors(self)
        return self._mirrors

    def encode(self, msg: Message) -> dict[str, Any]:
        """The tagged dict of a message (the chapters' `encoder()`); msgpack makes `to_bytes` of it."""
        return msgspec.to_builtins(self.mirrors.member_to_wire(msg), builtin_types=(bytes,))

    def to_bytes(self, msg: Message) -> bytes:
        """Exactly `msgpack.packb(msg.encoder(), use_bin_type=True)`, in one step."""
        return _ENCODER.encode(self.mirrors.member_to_wire(msg))

    def from_bytes(self, raw: bytes | bytearray | memoryview) -> Message:
        """Bytes -> a message of this group, or MessageDecodeError (never anything else)."""
        if not isinstance(raw, _BYTES_LIKE):
            raise MessageDecodeError(f"{self.name} message: expected bytes, got {type(raw).__name__}")
        mirrors = self.mirrors
        try:
            return mirrors.decoded(mirrors.decoder.decode(raw))
        except (msgspec.ValidationError, TensorFormatError) as e:
            raise MessageDecodeError(self._explain(raw, e)) from None
        except msgspec.DecodeError as e:
            raise MessageDecodeError(f"{self.name} message: not valid msgpack ({e})") from None
        except RecursionError:
            raise MessageDecodeError(f"{self.name} message: nested too deeply") from None

    def decode(self, data: Any) -> Message:
        """A tagged dict (as msgpack gives it) -> a message of this group, or MessageDecodeError.

        The dict goes through the same bytes path, so both accept and reject exactly the same."""
        try:
            raw = _ENCODER.encode(data)
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            raise MessageDecodeError(f"{self.name} message: not msgpack data ({e})") from None
        return self.from_bytes(raw)

    def unknown(self, name: object) -> str:
        if name is None:
            return "missing '__type__'"
        return f"unknown {self.name} message type {name!r:.60} (known: {', '.join(sorted(self.classes))})"

    def _explain(self, raw: bytes | bytearray | memoryview, error: Exception) -> str:
        """The text of a rejection: what the walk finds wrong with the message."""
        try:
            data = _PLAIN_DECODER.decode(raw)
        except msgspec.DecodeError as e:
            return f"{self.name} message: not valid msgpack ({e})"
        try:
            problem = _explain(self, data)
        except RecursionError:
            return f"{self.name} message: nested too deeply"
        if problem is None:  # the two disagree: say so rather than guess
            return f"{self.name} message rejected ({error}), though the check of its fields finds no fault"
        return problem


# --------------------------------------------------------------------------------------------------
# The mirrors and the converters.


class _Mirrors:
    """One group's mirror structs (for its classes and SamplingParams) and the converters.

    A conversion is `build(*values(obj))`: `values` reads the fields in order (an attrgetter, or
    msgspec's astuple), `build` is the target class itself, or converts the values that need it
    (tensors, nested messages) first. `_convert_all` runs it over a batch in C loops."""

    def __init__(self, group: MessageGroup) -> None:
        self.group = group
        members = list(group.classes.values())
        self.struct: dict[type, type] = {cls: _mirror(cls) for cls in [SamplingParams, *members]}
        self.members_type = Union[(*(self.struct[c] for c in members), _Never)]  # noqa: UP007
        self.to_wire: dict[type, _Conversion] = {}  # dataclass -> to its mirror
        self.from_wire: dict[type, _Conversion] = {  # mirror -> to its dataclass (or tensor)
            _Never: (astuple, _reject),
            TensorMap: (astuple, _tensor_from_values),
        }
        for cls in self.struct:  # after all mirrors exist: field types may refer to any of them
            self._link(cls)
        self.member_to = {cls: self.to_wire[cls] for cls in members}
        self.decoder = msgspec.msgpack.Decoder(self.members_type)

    def _link(self, cls: type) -> None:
        """Set the mirror's field types; make the conversions between the mirror and `cls`."""
        struct, hints = self.struct[cls], typing.get_type_hints(cls)
        names = [f.name for f in _fields(cls)]
        outs, ins = [], []
        for name in names:
            struct.__annotations__[name], out, into = self._field(hints[name])
            outs.append(out)
            ins.append(into)
        self.to_wire[cls] = (_values_of(names), _builder(struct, outs))
        self.from_wire[struct] = (astuple, _builder(cls, ins))

    def _field(self, tp: Any) -> tuple[Any, Convert | None, Convert | None]:
        """(msgspec type, field value -> wire value, decoded value -> field value); None: as it is."""
        if tp is torch.Tensor:
            return Union[TensorMap, _Never], tensor_to_map, self.decoded  # noqa: UP007
        if tp is self.group.root:
            return self.members_type, self.member_to_wire, self.decoded
        if tp in self.struct:
            return Union[self.struct[tp], _Never], partial(_convert, self.to_wire), self.decoded  # noqa: UP007
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is list and args and args[0] is self.group.root:
            return list[self.members_type], self.members_to_wire, partial(_convert_all, self.from_wire)
        if origin is list and args:
            item, out, into = self._field(args[0])
            each = lambda fn: None if fn is None else lambda v: [fn(x) for x in v]  # noqa: E731
            return list[item], each(out), each(into)
        if not _is_plain(tp):
            raise TypeError(f"message field type {tp!r} is not supported by the codec")
        try:
            msgspec.msgpack.Decoder(tp)
        except TypeError:  # a union msgspec cannot take at once (e.g. two kinds of list)
            return msgspec.Raw, None, _first_fitting([msgspec.msgpack.Decoder(a) for a in args])
        return tp, None, None

    def member_to_wire(self, msg: Any) -> Any:
        return self.members_to_wire([msg])[0]

    def members_to_wire(self, msgs: list[Any]) -> list[Any]:
        try:
            return _convert_all(self.member_to, msgs)
        except KeyError as e:
            if not isinstance(e.args[0], type):
                raise
            raise TypeError(f"{e.args[0].__name__} is not a registered {self.group.name} message") from None

    def decoded(self, s: Any) -> Any:
        """A decoded mirror -> its dataclass (or tensor)."""
        return _convert(self.from_wire, s)


_Conversion = tuple[Callable[[Any], tuple], Callable[..., Any]]  # (values of obj, build from values)


def _convert(table: dict[type, _Conversion], obj: Any) -> Any:
    values, build = table[obj.__class__]
    return build(*values(obj))


def _convert_all(table: dict[type, _Conversion], objs: list[Any]) -> list[Any]:
    """[_convert(table, x) for x in objs], one run of a class at a time, each run in C loops."""
    out: list[Any] = []
    for cls, run in groupby(objs, type):
        values, build = table[cls]
        out += starmap(build, map(values, run))
    return out


def _mirror(cls: type) -> type:
    """The mirror struct of a dataclass, its field types still to be set (`_Mirrors._link`)."""
    specs: list[tuple[Any, ...]] = []
    for f in _fields(cls):
        if f.default is not dataclasses.MISSING:
            specs.append((f.name, Any, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            specs.append((f.name, Any, msgspec.field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, Any))
    return msgspec.defstruct(
        cls.__name__, specs, tag_field="__type__", tag=cls.__name__, forbid_unknown_fields=True, gc=False
    )


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _values_of(names: list[str]) -> Callable[[Any], tuple]:
    """obj -> the tuple of its attributes `names` (attrgetter returns a bare value for one name)."""
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names) if names else lambda obj: ()


def _builder(target: Callable[..., Any], convs: list[Convert | None]) -> Callable[..., Any]:
    """(*values) -> target(*values), each value through its converter first (None: as it is)."""
    pairs = [(i, fn) for i, fn in enumerate(convs) if fn is not None]
    if not pairs:
        return target

    def build(*values: Any) -> Any:
        out = list(values)
        for i, fn in pairs:
            out[i] = fn(out[i])
        return target(*out)

    return build


def _first_fitting(decoders: list[msgspec.msgpack.Decoder]) -> Convert:
    """A msgspec.Raw value -> what the first decoder that takes it makes of it."""

    def decode(raw: msgspec.Raw) -> Any:
        for decoder in decoders[:-1]:
            try:
                return decoder.decode(raw)
            except msgspec.ValidationError:
                continue
        return decoders[-1].decode(raw)

    return decode


def _tensor_from_values(buffer: bytes, dtype: str, shape: Any) -> torch.Tensor:
    return tensor_from_map(TensorMap(buffer, dtype, shape))


def _reject(*_: Any) -> Any:
    raise msgspec.ValidationError("a message tagged as no message type")


_PLAIN = (int, float, bool, str, bytes, type(None))


def _is_plain(tp: Any) -> bool:
    """True if values of this type are msgpack values all the way down (no tensor or dataclass)."""
    if tp is None or tp in _PLAIN:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    return origin in (Union, types.UnionType, list, dict) and bool(args) and all(map(_is_plain, args))


# --------------------------------------------------------------------------------------------------
# Why a message was rejected: a walk of the plain data against the annotations (error text only).


class _Invalid(Exception):
    """A check failed at `path` (field names and [index] parts, outermost first)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []


def _explain(group: MessageGroup, data: object) -> str | None:
    """What is wrong with `data` as a message of `group`, naming the field; None if nothing is."""
    if data.__class__ is not dict:
        return f"{group.name} message: expected a map, got {_describe(data)}"
    name = data.get("__type__")  # type: ignore[attr-defined]
    cls = group.classes.get(name) if name.__class__ is str else None
    if cls is None:
        return f"{group.name} message: {group.unknown(name)}"
    try:
        _Walk(group).obj(cls, data)
    except _Invalid as e:
        return name + "".join(p if p.startswith("[") else f".{p}" for p in e.path) + f": {e.problem}"
    return None


class _Walk:
    """Checks plain values against annotations; raises _Invalid at the first problem."""

    def __init__(self, group: MessageGroup) -> None:
        self.group = group

    def check(self, tp: Any, v: Any) -> None:
        if tp is float:
            ok = v.__class__ is float or v.__class__ is int
        elif tp in _PLAIN:
            ok = v.__class__ is tp
        elif tp is None:
            ok = v is None
        elif tp is torch.Tensor:
            return self.tensor(v)
        elif tp is self.group.root:
            return self.member(v)
        elif dataclasses.is_dataclass(tp):
            return self.obj(tp, v)
        else:
            origin, args = typing.get_origin(tp), typing.get_args(tp)
            if origin in (Union, types.UnionType):
                ok = any(self.fits(a, v) for a in args)
            elif origin is list:
                if v.__class__ is not list:
                    raise _Invalid(f"expected a list, got {_describe(v)}")
                for i, x in enumerate(v):
                    self.at(f"[{i}]", args[0], x)
                return None
            elif origin is dict:
                if v.__class__ is not dict:
                    raise _Invalid(f"expected a map, got {_describe(v)}")
                for k, x in v.items():
                    self.at(f"[{k!r:.40}]", args[0], k)
                    self.at(f"[{k!r:.40}]", args[1], x)
                return None
            else:
                raise TypeError(f"message field type {tp!r} is not supported by the codec")
        if not ok:
            raise _Invalid(f"expected {_type_name(tp)}, got {_describe(v)}")
        return None

    def fits(self, tp: Any, v: Any) -> bool:
        try:
            self.check(tp, v)
        except _Invalid:
            return False
        return True

    def at(self, part: str, tp: Any, v: Any) -> None:
        try:
            self.check(tp, v)
        except _Invalid as e:
            e.path.insert(0, part)
            raise

    def member(self, v: Any) -> None:
        if v.__class__ is not dict:
            raise _Invalid(f"expected a {self.group.name} message map, got {_describe(v)}")
        name = v.get("__type__")
        cls = self.group.classes.get(name) if name.__class__ is str else None
        if cls is None:
            raise _Invalid(self.group.unknown(name))
        self.obj(cls, v)

    def obj(self, cls: type, d: Any) -> None:
        name = cls.__name__
        if d.__class__ is not dict:
            raise _Invalid(f"expected a {name} map, got {_describe(d)}")
        fields = _fields(cls)
        known = {"__type__", *(f.name for f in fields)}
        extra = [k for k in d if k not in known]
        if extra:
            raise _Invalid(f"unexpected field(s) {', '.join(repr(k)[:40] for k in extra[:5])}")
        if "__type__" not in d:
            raise _Invalid(f"missing '__type__' (expected {name!r})")
        if d["__type__"] != name:
            raise _Invalid(f"expected __type__ {name!r}, got {d['__type__']!r:.60}")
        hints = typing.get_type_hints(cls)
        for f in fields:
            if f.name in d:
                self.at(f.name, hints[f.name], d[f.name])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Invalid(f"missing required field {f.name!r}")

    @staticmethod
    def tensor(v: Any) -> None:
        if v.__class__ is not dict:
            raise _Invalid(f"expected a Tensor map, got {_describe(v)}")
        keys, required = set(v), {"__type__", "buffer", "dtype"}
        if not required <= keys <= required | {"shape"}:
            extra = sorted(map(str, keys - required - {"shape"}))
            raise _Invalid(f"bad Tensor map: missing {sorted(required - keys)}, unexpected {extra}")
        if v["__type__"] != "Tensor":
            raise _Invalid(f"expected a Tensor, got __type__ {v['__type__']!r:.60}")
        if "shape" in v and v["shape"] is None:
            raise _Invalid("Tensor 'shape' must be a list of ints, got None")
        try:
            decode_tensor(v["buffer"], v["dtype"], v.get("shape"))
        except TensorFormatError as e:
            raise _Invalid(str(e)) from None


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _type_name(tp: Any) -> str:
    if tp is type(None) or tp is None:
        return "None"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(map(_type_name, typing.get_args(tp)))
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
