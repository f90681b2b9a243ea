"""The message codec: message dataclass <-> msgpack bytes, strict, with msgspec doing the work.

On the wire (the chapters' format) a message is a map {"__type__": class name, field: value, ...} in
dataclass field order; nested messages and SamplingParams likewise; a tensor as in tensor.py.
A group (`class BaseBackendMsg(Message, group="backend")` and its subclasses) is the closed table of
classes that one receiver decodes. Each class (and SamplingParams) has a mirror msgspec.Struct, tagged
with its name, that msgspec writes, parses and type-checks in C (a bool is not an int, an int is taken
for a float); generated converters move objects between mirrors and dataclasses. Anything wrong raises
MessageDecodeError, its text written by `_why`, a walk of the plain data against the annotations.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn, Union

import msgspec
import torch

from minisgl.core import SamplingParams

from .tensor import TensorFormatError, TensorMap, decode_tensor, tensor_to_map

__all__ = ["Message", "MessageDecodeError", "MessageGroup", "group_of"]

Fault = tuple[str, str]  # (where, as ".field[index]...", what is wrong)
_ENCODER = msgspec.msgpack.Encoder()
_PLAIN_DECODER = msgspec.msgpack.Decoder()  # msgpack -> plain Python values, for `_why`
_PLAIN = (int, float, bool, str, bytes, type(None))


class MessageDecodeError(ValueError):
    """Bytes or a dict that are not a valid message of the receiving group."""


class _Never(msgspec.Struct, tag_field="__type__", tag="\x00never", forbid_unknown_fields=True):
    """In every union of mirrors, so that msgspec requires the "__type__" tag (a struct alone in its
    field type would also take a map without one). Decoding one is a rejection."""


class Message:
    """Base of the group bases. `class BaseXMsg(Message, group="x")` starts a group and gives it
    `msg.encoder()` (the tagged dict), `msg.to_bytes()`, `BaseXMsg.decoder(dict)` and
    `BaseXMsg.from_bytes(raw)`; every subclass of it joins the group."""

    _group: ClassVar[MessageGroup]

    def __init_subclass__(cls, group: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not group:
            return cls._group.register(cls)
        cls._group = g = MessageGroup(group, cls)
        cls.encoder, cls.to_bytes = _method(g.encode), _method(g.to_bytes)  # type: ignore[method-assign]
        cls.decoder, cls.from_bytes = staticmethod(g.decode), staticmethod(g.from_bytes)  # type: ignore

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
    return method


def group_of(obj: object) -> MessageGroup | None:
    """The group of a group base or of its encoder/to_bytes/decoder/from_bytes (the queues then take
    the one-step bytes path), else None."""
    target = getattr(obj, "__wrapped__", obj)
    group = getattr(target, "__self__", None) or getattr(target, "_group", None)
    return group if isinstance(group, MessageGroup) else None


class MessageGroup:
    """One receiver's closed table of message classes; the mirrors and converters are built at first
    use, once every class of the group is defined."""

    def __init__(self, name: str, root: type) -> None:
        self.name, self.root = name, root
        self.classes: dict[str, type] = {}
        self._codec: _Mirrors | None = None

    def register(self, cls: type) -> None:
        if cls.__name__ in self.classes or cls.__name__ in ("Tensor", "SamplingParams"):
            raise TypeError(f"message name {cls.__name__!r} is already used in the {self.name} group")
        self.classes[cls.__name__] = cls
        self._codec = None

    @property
    def mirrors(self) -> _Mirrors:
        self._codec = self._codec or _Mirrors(self)
        return self._codec

    def encode(self, msg: Message) -> dict[str, Any]:
        """The tagged dict of a message (the chapters' `encoder()`)."""
        return msgspec.to_builtins(self.mirrors.to_wire_one(msg), builtin_types=(bytes,))

    def to_bytes(self, msg: Message) -> bytes:
        """Exactly `msgpack.packb(msg.encoder(), use_bin_type=True)`, in one step."""
        return _ENCODER.encode(self.mirrors.to_wire_one(msg))

    def from_bytes(self, raw: bytes | bytearray | memoryview) -> Message:
        """Bytes -> a message of this group, or MessageDecodeError (never anything else)."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise MessageDecodeError(f"{self.name} message: expected bytes, got {type(raw).__name__}")
        mirrors = self.mirrors
        try:
            return mirrors.from_wire_one(mirrors.decoder.decode(raw))
        except (msgspec.ValidationError, TensorFormatError) as e:
            raise MessageDecodeError(self._explain(raw, e)) from None
        except msgspec.DecodeError as e:
            raise MessageDecodeError(f"{self.name} message: not valid msgpack ({e})") from None
        except RecursionError:
            raise MessageDecodeError(f"{self.name} message: nested too deeply") from None

    def decode(self, data: Any) -> Message:
        """A tagged dict -> a message, through the bytes path (so both take and refuse the same)."""
        try:
            raw = _ENCODER.encode(data)
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            raise MessageDecodeError(f"{self.name} message: not msgpack data ({e})") from None
        return self.from_bytes(raw)

    def _explain(self, raw: bytes | bytearray | memoryview, error: Exception) -> str:
        try:
            fault = _explain(self, _PLAIN_DECODER.decode(raw))
        except msgspec.DecodeError as e:
            return f"{self.name} message: not valid msgpack ({e})"
        except RecursionError:
            return f"{self.name} message: nested too deeply"
        return (
            fault or f"{self.name} message rejected ({error}), though the check of its fields finds no fault"
        )


class _Mirrors:
    """A group's mirror structs, its decoder, and its converters for one object and for a list:
    messages -> mirrors (`to_wire_one`, `to_wire`), mirrors -> messages (`from_wire_one`, `from_wire`)."""

    def __init__(self, group: MessageGroup) -> None:
        self.group = group
        classes = [*group.classes.values(), SamplingParams]
        self.struct = {cls: _mirror(cls) for cls in classes}
        self.members = Union[(*(self.struct[c] for c in group.classes.values()), _Never)]  # noqa: UP007
        self.env: dict[str, Any] = {"_new": object.__new__, "tensor_to_map": tensor_to_map}
        self.env |= {"tensor_in": _tensor_in, "_checked": _checked, "group": group, "types": {}}
        to_wire, from_wire = {}, {}
        for cls in classes:  # once all mirrors exist: a field's type may be any of them
            struct, hints, outs, ins = self.struct[cls], typing.get_type_hints(cls), [], []
            for f in _fields(cls):
                struct.__annotations__[f.name], out, into = self._field(hints[f.name])
                outs.append((f.name, out))
                ins.append((f.name, into))
            to_wire[cls] = (struct, outs, False)
            from_wire[struct] = (cls, ins, _bare(cls))
        self.to_wire_one, self.to_wire = _compile("to_wire", to_wire, self._not_member, self.env)
        self.from_wire_one, self.from_wire = _compile("from_wire", from_wire, _tensor_in, self.env)
        self.decoder = msgspec.msgpack.Decoder(self.members)

    def _field(self, tp: Any) -> tuple[Any, str | None, str | None]:
        """(msgspec type, field value -> wire value, decoded value -> field value), the two as
        expression templates over `self.env` ("{}" the value), None for "as it is"."""
        if tp is torch.Tensor:
            return Union[TensorMap, _Never], "tensor_to_map({})", "tensor_in({})"  # noqa: UP007
        if tp is self.group.root or tp in self.struct:
            return self._union(tp), "to_wire_one({})", "from_wire_one({})"
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is list and args and (args[0] is self.group.root or args[0] in self.struct):
            return list[self._union(args[0])], "to_wire({})", "from_wire({})"
        if origin is list and args:
            item, out, into = self._field(args[0])
            each = lambda t: t and "[" + t.format("v") + " for v in {}]"  # noqa: E731
            return list[item], each(out), each(into)
        if not _is_plain(tp):
            raise TypeError(f"message field type {tp!r} is not supported by the codec")
        try:
            msgspec.msgpack.Decoder(tp)
            return tp, None, None
        except TypeError:  # a union msgspec cannot take (two kinds of list): `_why` checks it
            self.env["types"][key := f"t{len(self.env['types'])}"] = tp
            return Any, None, f"_checked(group, types[{key!r}], {{}})"

    def _union(self, tp: type) -> Any:
        return self.members if tp is self.group.root else Union[self.struct[tp], _Never]  # noqa: UP007

    def _not_member(self, obj: object) -> NoReturn:
        raise TypeError(f"{type(obj).__name__} is not a registered {self.group.name} message")


# target class, [(field, template of its conversion or None)], bare: build without calling __init__
_Recipe = tuple[type, list[tuple[str, str | None]], bool]


def _compile(name: str, recipes: dict[type, _Recipe], other: Callable, env: dict[str, Any]) -> tuple:
    """(`name_one(x)`, `name(items)`): an object, or each of a list, converted by the recipe for its
    class (`other(x)` for any other class): `target(*fields)`, or if bare, `object.__new__(target)`
    with the fields stored (what a plain dataclass's __init__ does, less one Python call).

    Generated from the field names, as dataclasses generates __init__, so that a batch of 256
    messages (the scheduler sends one every step) costs one loop with the classes without nested
    fields inline; the others are a call each, found by class."""
    loop = [f"def {name}(items):", " out = []", " for x in items:", "  c = x.__class__", "  if False: pass"]
    funcs, env[f"{name}_other"], by_class = [], other, env.setdefault(f"{name}_by_class", {})
    for i, (cls, (target, fields, bare)) in enumerate(recipes.items()):
        env[f"{name}_T{i}"], env[f"{name}_S{i}"] = target, cls
        values = [(f, t.format(f"x.{f}") if t else f"x.{f}") for f, t in fields]
        body = [f"o = {name}_T{i}({', '.join(v for _, v in values)})"]
        if bare:
            body = [f"o = _new({name}_T{i})", *(f"o.{f} = {v}" for f, v in values)]
        funcs += [f"def {name}_{i}(x):", *(f" {line}" for line in body), " return o"]
        if all(t is None for _, t in fields):
            loop += [f"  elif c is {name}_S{i}:", *(f"   {line}" for line in body), "   out.append(o)"]
        by_class[cls] = f"{name}_{i}"
    loop += ["  else:", f"   out.append({name}_one(x))", " return out"]
    one = [f"def {name}_one(x):", f" return {name}_by_class.get(x.__class__, {name}_other)(x)"]
    exec("\n".join(funcs + loop + one), env)  # noqa: S102 - the source holds dataclass field names only
    by_class.update((cls, env[fn]) for cls, fn in by_class.items())
    return env[f"{name}_one"], env[name]


def _bare(cls: type) -> bool:
    """True if setting the fields on `object.__new__(cls)` is all that cls(...) would do."""
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    plain = params.init and not params.frozen and not hasattr(cls, "__post_init__")
    return plain and all(f.init for f in dataclasses.fields(cls))


def _mirror(cls: type) -> type:
    """The mirror struct of a dataclass, its field types still to be set (`_Mirrors.__init__`)."""
    specs: list[tuple[Any, ...]] = []
    for f in _fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            specs.append((f.name, Any, msgspec.field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, Any) if f.default is dataclasses.MISSING else (f.name, Any, f.default))
    return msgspec.defstruct(
        cls.__name__, specs, tag_field="__type__", tag=cls.__name__, forbid_unknown_fields=True, gc=False
    )


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _tensor_in(s: Any) -> torch.Tensor:
    if s.__class__ is TensorMap:
        return decode_tensor(s.buffer, s.dtype, None if s.shape is msgspec.UNSET else s.shape)
    raise msgspec.ValidationError("a message tagged as no message type")


def _is_plain(tp: Any) -> bool:
    """True if values of this type are msgpack values all the way down (no tensor or dataclass)."""
    if tp is None or tp in _PLAIN:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    return origin in (Union, types.UnionType, list, dict) and bool(args) and all(map(_is_plain, args))


# Why a message was rejected: a walk of the plain data against the annotations (the error's text).


def _explain(group: MessageGroup, data: Any) -> str | None:
    """What is wrong with `data` as a message of `group`, naming the field; None if nothing is."""
    fault = _why(group, group.root, data)
    if fault is None:
        return None
    name = data.get("__type__") if data.__class__ is dict else None
    head = name if name.__class__ is str and name in group.classes else f"{group.name} message"
    return f"{head}{fault[0]}: {fault[1]}"


def _why(group: MessageGroup, tp: Any, v: Any) -> Fault | None:
    """The first fault of the plain value `v` as a `tp`, or None if it fits."""
    if tp is torch.Tensor:
        return _why_tensor(v)
    if tp is group.root or dataclasses.is_dataclass(tp):
        return _why_object(group, tp, v)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list or origin is dict:
        if v.__class__ is not origin:
            return "", f"expected a {'list' if origin is list else 'map'}, got {_describe(v)}"
        items = [(f"[{i}]", args[0], x) for i, x in enumerate(v)] if origin is list else []
        for k, x in v.items() if origin is dict else ():
            items += [(f"[{k!r:.40}]", args[0], k), (f"[{k!r:.40}]", args[1], x)]
        for where, t, x in items:
            if fault := _why(group, t, x):
                return where + fault[0], fault[1]
        return None
    if origin in (Union, types.UnionType):
        ok = any(_why(group, a, v) is None for a in args)
    elif tp in _PLAIN or tp is None:
        ok = v.__class__ is (type(None) if tp is None else tp) or (tp is float and v.__class__ is int)
    else:
        raise TypeError(f"message field type {tp!r} is not supported by the codec")
    return None if ok else ("", f"expected {_type_name(tp)}, got {_describe(v)}")


def _why_object(group: MessageGroup, cls: type, d: Any) -> Fault | None:
    if d.__class__ is not dict:
        return "", f"expected a map, got {_describe(d)}"
    name = d.get("__type__")
    if cls is group.root and (cls := group.classes.get(name) if name.__class__ is str else None) is None:
        return "", "missing '__type__'" if name is None else (
            f"unknown {group.name} message type {name!r:.60} (known: {', '.join(sorted(group.classes))})"
        )
    fields, hints = _fields(cls), typing.get_type_hints(cls)
    extra = [repr(k)[:40] for k in d if k != "__type__" and k not in hints]
    if extra:
        return "", f"unexpected field(s) {', '.join(extra[:5])}"
    if name != cls.__name__:
        return "", f"expected __type__ {cls.__name__!r}, got {name!r:.60}" if "__type__" in d else (
            f"missing '__type__' (expected {cls.__name__!r})"
        )
    for f in fields:
        if f.name in d and (fault := _why(group, hints[f.name], d[f.name])):
            return f".{f.name}{fault[0]}", fault[1]
        if f.name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            return "", f"missing required field {f.name!r}"
    return None


def _why_tensor(v: Any) -> Fault | None:
    if v.__class__ is not dict:
        return "", f"expected a Tensor map, got {_describe(v)}"
    keys, required = set(v), {"__type__", "buffer", "dtype"}
    if not required <= keys <= required | {"shape"}:
        extra = sorted(map(str, keys - required - {"shape"}))
        return "", f"bad Tensor map: missing {sorted(required - keys)}, unexpected {extra}"
    if v["__type__"] != "Tensor":
        return "", f"expected a Tensor, got __type__ {v['__type__']!r:.60}"
    if "shape" in v and v["shape"] is None:
        return "", "Tensor 'shape' must be a list of ints, got None"
    try:
        decode_tensor(v["buffer"], v["dtype"], v.get("shape"))
    except TensorFormatError as e:
        return "", str(e)
    return None


def _checked(group: MessageGroup, tp: Any, v: Any) -> Any:
    """A value of a type msgspec cannot check (it took it as Any), checked by `_why`."""
    if _why(group, tp, v):
        raise msgspec.ValidationError(f"not a {_type_name(tp)}")
    return v


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _type_name(tp: Any) -> str:
    if tp is type(None) or tp is None:
        return "None"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(map(_type_name, typing.get_args(tp)))
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
