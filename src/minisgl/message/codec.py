"""The message codec: message dataclass <-> msgpack bytes, strict, with msgspec doing the work.

On the wire (the chapters' format) a message is a map {"__type__": class name, field: value, ...} in
field order; a dataclass nested in a field (a record: SamplingParams, DetokenizeExtra, ...) likewise,
a tensor as in tensor.py. A class that sets `omit_defaults = True` (the per-token messages and their
records) leaves out the fields that hold their default, which a receiver then fills in: the chapters'
serializer writes them all, and both decode here. A group (`class BaseXMsg(Message, group="x")` and
its subclasses) is the closed set of classes that one receiver decodes. msgspec writes, parses and
type-checks (in C) a mirror Struct of each class, tagged with its name; generated functions convert
between mirrors and dataclasses. Bad input raises MessageDecodeError, its text written by
`MessageGroup.explain`, a walk of the plain data against the annotations.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Union

import msgspec

from .tensor import Tensor, TensorFormatError, decode_tensor, tensor_to_map

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Message", "MessageDecodeError", "MessageGroup", "group_of"]

_ENCODER = msgspec.msgpack.Encoder()
_PLAIN = msgspec.msgpack.Decoder()  # msgpack -> plain values


class MessageDecodeError(ValueError):
    """Bytes or a dict that are not a valid message of the receiving group."""


class _Never(msgspec.Struct, tag_field="__type__", tag="\x00never"):
    """In every union of mirrors, so that msgspec requires the "__type__" tag (a struct alone would
    also take a map without it). It decodes none: no msgpack value is an UNSET."""

    never: msgspec.UnsetType


class Message:
    """Base of the group bases. `class BaseXMsg(Message, group="x")` starts a group and gives it
    `msg.encoder()` (the tagged dict), `msg.to_bytes()`, `BaseXMsg.decoder(dict)` and
    `BaseXMsg.from_bytes(raw)`; every subclass of it joins the group."""

    _group: ClassVar[MessageGroup]
    omit_defaults: ClassVar[bool] = False  # True: fields at their default stay off the wire

    if TYPE_CHECKING:  # set on every group base by __init_subclass__ (call the last two on it)

        def encoder(self) -> dict[str, Any]: ...
        def to_bytes(self) -> bytes: ...
        @classmethod
        def decoder(cls, data: Any) -> Self: ...
        @classmethod
        def from_bytes(cls, raw: bytes | bytearray | memoryview) -> Self: ...

    def __init_subclass__(cls, group: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not group:
            return cls._group.register(cls)
        cls._group = g = MessageGroup(group, cls)
        # Methods that call the group's; wraps() sets `__wrapped__`, by which `group_of` finds it.
        functions = {
            "encoder": functools.wraps(g.encode)(lambda self: g.encode(self)),
            "to_bytes": functools.wraps(g.to_bytes)(lambda self: g.to_bytes(self)),
            "decoder": staticmethod(g.decode),
            "from_bytes": staticmethod(g.from_bytes),
        }
        for name, function in functions.items():
            setattr(cls, name, function)


def group_of(obj: object) -> MessageGroup | None:
    """The group of a group base or of its encoder/to_bytes/decoder/from_bytes (the queues then take
    the one-step bytes path), else None."""
    target = getattr(obj, "__wrapped__", obj)
    group = getattr(target, "__self__", None) or getattr(target, "_group", None)
    return group if isinstance(group, MessageGroup) else None


class MessageGroup:
    """One receiver's closed set of message classes; its codec is built at first use, once every
    class of the group is defined."""

    def __init__(self, name: str, root: type[Message]) -> None:
        self.name, self.root = name, root
        self.classes: dict[str, type[Message]] = {}

    def register(self, cls: type[Message]) -> None:
        if cls.__name__ in self.classes or cls.__name__ == "Tensor":
            raise TypeError(f"message name {cls.__name__!r} is already used in the {self.name} group")
        self.classes[cls.__name__] = cls
        self.__dict__.pop("codec", None)  # built again, with this class, at next use

    @functools.cached_property
    def codec(self) -> _Codec:
        return _Codec(self)

    def encode(self, msg: Message) -> dict[str, Any]:
        """The tagged dict of a message (the chapters' `encoder()`): its bytes, read back."""
        return _PLAIN.decode(self.to_bytes(msg))

    def to_bytes(self, msg: Message) -> bytes:
        """Exactly `msgpack.packb(msg.encoder(), use_bin_type=True)`, in one step."""
        return _ENCODER.encode(self.codec.to_wire_one(msg))

    def decode(self, data: Any) -> Message:
        """A tagged dict -> a message, through the bytes path (so both take and refuse the same)."""
        try:
            raw = msgspec.msgpack.encode(data)
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            raise MessageDecodeError(f"{self.name} message: not msgpack data ({e})") from None
        return self.from_bytes(raw)

    def from_bytes(self, raw: bytes | bytearray | memoryview) -> Message:
        """Bytes -> a message of this group, or MessageDecodeError (never anything else)."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise MessageDecodeError(f"{self.name} message: expected bytes, got {type(raw).__name__}")
        try:
            return self.codec.from_wire_one(self.codec.decoder.decode(raw))
        except (msgspec.DecodeError, RecursionError) as e:  # a ValidationError is a DecodeError
            raise MessageDecodeError(self.explain(raw) or f"{self.name} message rejected ({e})") from None

    # Why a message was rejected: a walk of the plain data against the annotations. msgspec decides;
    # the walk writes the error's text, naming the field. A fault is its place, ": ", what is wrong.

    def explain(self, raw: bytes | bytearray | memoryview) -> str | None:
        """What is wrong with `raw` as a message of this group; None if nothing is."""
        try:
            data = _PLAIN.decode(raw)
            fault = self._why(self.root, data)
        except msgspec.DecodeError as e:
            return f"{self.name} message: not valid msgpack ({e})"
        except RecursionError:
            return f"{self.name} message: nested too deeply"
        name = data.get("__type__") if data.__class__ is dict else None
        head = name if name.__class__ is str and name in self.classes else f"{self.name} message"
        return None if fault is None else head + fault

    def checked(self, tp: Any, v: Any) -> Any:
        """A value of a type msgspec cannot check (it took it as Any), checked by the walk."""
        if self._why(tp, v):
            raise msgspec.ValidationError(f"not a {tp}")
        return v

    def _why(self, tp: Any, v: Any) -> str | None:
        """The first fault of the plain value `v` as a `tp`, or None if it fits."""
        if tp is self.root or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return self._why_object(tp, v)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is list or origin is dict:
            if v.__class__ is not origin:
                return f": expected a {'list' if origin is list else 'map'}, got {_describe(v)}"
            if isinstance(v, list):
                items = [(i, args[0], x) for i, x in enumerate(v)]
            else:  # a map's keys, then its values
                items = [(k, args[0], k) for k in v] + [(k, args[1], x) for k, x in v.items()]
            for k, t, x in items:
                if fault := self._why(t, x):
                    return f"[{k!r:.40}]{fault}"
            return None
        if tp is Tensor:
            try:
                decode_tensor(v)
            except TensorFormatError as e:
                return f": {e}"
            return None
        if origin in (Union, types.UnionType):
            record = [a for a in args if dataclasses.is_dataclass(a)]
            if v is not None and len(args) == 2 and type(None) in args and record:  # the fault inside
                return self._why(record[0], v)
            ok = any(self._why(a, v) is None for a in args)
        else:
            ok = v.__class__ is tp or (tp is float and v.__class__ is int)
        name = tp.__name__ if isinstance(tp, type) else tp  # or a union, as "int | None"
        return None if ok else f": expected {name}, got {_describe(v)}"

    def _why_object(self, cls: type, d: Any) -> str | None:
        if d.__class__ is not dict:
            return f": expected a map, got {_describe(d)}"
        if "__type__" not in d:
            return ": missing '__type__'"
        name = d["__type__"]
        if cls is self.root:
            member = self.classes.get(name) if name.__class__ is str else None
            if member is None:
                known = ", ".join(sorted(self.classes))
                return f": unknown {self.name} message type {name!r:.60} (known: {known})"
            cls = member
        if name != cls.__name__:
            return f": expected __type__ {cls.__name__!r}, got {name!r:.60}"
        fields, hints = msgspec.structs.fields(self.codec.mirror[cls]), typing.get_type_hints(cls)
        extra = [repr(k)[:40] for k in d if k != "__type__" and k not in {f.name for f in fields}]
        if extra:
            return f": unexpected field(s) {', '.join(extra[:5])}"
        for f in fields:
            if f.name not in d and f.required:
                return f": missing required field {f.name!r}"
            if f.name in d and (fault := self._why(hints[f.name], d[f.name])):
                return f".{f.name}{fault}"
        return None


class _Codec:
    """A group's mirror structs, its msgspec decoder, and its converters of one object and of a list:
    messages -> mirrors (`to_wire_one`, `to_wire`), mirrors -> messages (`from_wire_*`)."""

    def __init__(self, group: MessageGroup) -> None:
        self.group = group
        self.env: dict[str, Any] = {"new": object.__new__, "other": self._not_member}
        self.env["tensor_to_map"] = tensor_to_map
        # The converters test classes in this order: the per-token messages (those that omit their
        # defaults), nearly all of a batch, first.
        classes = sorted(group.classes.values(), key=lambda cls: not cls.omit_defaults)
        self.mirror = {cls: _mirror(cls) for cls in [*classes, *_records(group)]}
        members = functools.reduce(operator.or_, [*(self.mirror[c] for c in group.classes.values()), _Never])
        # Each class's msgspec type: its mirror or, for the group base, any member's (a type expression).
        self.union: dict[type, Any] = {cls: m | _Never for cls, m in self.mirror.items()}
        self.union[group.root] = members
        to_wire, from_wire = {}, {}
        for cls, mirror in self.mirror.items():  # now that all exist: a field may hold any of them
            hints, outs, ins = typing.get_type_hints(cls), {}, {}
            for name in mirror.__struct_fields__:
                mirror.__annotations__[name], outs[name], ins[name] = self._field(hints[name])
            to_wire[cls], from_wire[mirror] = (mirror, outs, False), (cls, ins, _bare(cls))
        self.to_wire_one, self.to_wire = _compile(to_wire, dict(self.env))
        self.from_wire_one, self.from_wire = _compile(from_wire, dict(self.env))
        # A tensor field's plain value goes to decode_tensor: its TensorFormatError is a rejection.
        self.decoder = msgspec.msgpack.Decoder(members, dec_hook=lambda _, wire: decode_tensor(wire))

    def _field(self, tp: Any) -> tuple[Any, str | None, str | None]:
        """(msgspec type, the expressions that convert a field value `{0}` to the wire and back,
        calling functions of `self.env`; None: as it is)."""
        args = typing.get_args(tp)
        item = args[0] if typing.get_origin(tp) is list else None
        maybe = [a for a in args if a is not type(None)] if type(None) in args else None
        if tp in self.union:
            return self.union[tp], "one({0})", "one({0})"
        if item in self.union:
            return types.GenericAlias(list, self.union[item]), "many({0})", "many({0})"
        if maybe and len(maybe) == 1 and maybe[0] in self.union:  # an optional record
            return self.union[maybe[0]] | None, *["(None if {0} is None else one({0}))"] * 2
        if tp is Tensor:  # the one type msgspec does not know; decoded by the dec_hook below
            return tp, "tensor_to_map({0})", None
        if not _is_plain(tp):
            raise TypeError(f"message field type {tp!r} is not supported by the codec")
        try:
            msgspec.msgpack.Decoder(tp)
            return tp, None, None
        except TypeError:  # a union msgspec cannot take (two kinds of list): the walk checks it
            self.env[key := f"check{len(self.env)}"] = functools.partial(self.group.checked, tp)
            return Any, None, key + "({0})"

    def _not_member(self, obj: object) -> NoReturn:  # (never when decoding: msgspec makes known structs)
        raise TypeError(f"{type(obj).__name__} is not a registered {self.group.name} message")


def _compile(recipes: dict[type, tuple[type, dict, bool]], env: dict) -> tuple[Callable, ...]:
    """(`one(x)`, `many(items)`): x, or each item, made by the recipe (target, {field: expression
    of `{0}`, the field's value, or None}, bare) for its class, `other(x)` for any other. Generated as
    dataclasses generates __init__, so that a batch (one every scheduler step) is a loop with the
    classes inline that hold no list of messages."""
    one, many = ["def one(x):", " c = x.__class__"], ["def many(items):", " out = []", " add = out.append"]
    many += [" for x in items:", "  c = x.__class__"]
    for i, (cls, (target, fields, bare)) in enumerate(recipes.items()):
        env[f"C{i}"], env[f"T{i}"] = cls, target
        values = {f: fn.format(f"x.{f}") if fn else f"x.{f}" for f, fn in fields.items()}
        body = [f"o = T{i}({', '.join(values.values())})"]
        if bare:  # as the dataclass's __init__ would, less one Python call
            body = [f"o = new(T{i})", *(f"o.{f} = {v}" for f, v in values.items())]
        one += [f" if c is C{i}:", *(f"  {line}" for line in [*body, "return o"])]
        if not any(fn and fn.startswith("many") for fn in fields.values()):
            many += [f"  if c is C{i}:", *(f"   {line}" for line in [*body, "add(o)", "continue"])]
    one += [" return other(x)"]
    many += ["  add(one(x))", " return out"]
    exec("\n".join(one + many), env)  # noqa: S102 - the source holds dataclass field names only
    return env["one"], env["many"]


def _bare(cls: type) -> bool:
    """True if setting the fields on `object.__new__(cls)` is all that cls(...) would do."""
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    plain = params.init and not params.frozen and not hasattr(cls, "__post_init__")
    return plain and all(f.init for f in dataclasses.fields(cls))


def _records(group: MessageGroup) -> list[type]:
    """The dataclasses that the group's messages hold in their fields (SamplingParams, ...), nested
    ones too, found through the annotations; each is checked and converted like a message."""
    found: list[type] = []

    def walk(tp: Any) -> None:
        known = tp is group.root or tp in group.classes.values() or tp in found
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)) or known:
            for arg in typing.get_args(tp):  # list[X], X | None, ...
                walk(arg)
            return
        if tp.__name__ in group.classes or tp.__name__ == "Tensor":
            raise TypeError(f"record {tp.__name__!r} has the name of a {group.name} message")
        found.append(tp)
        for hint in typing.get_type_hints(tp).values():
            walk(hint)

    for cls in group.classes.values():
        for hint in typing.get_type_hints(cls).values():
            walk(hint)
    return found


def _mirror(cls: type) -> type[msgspec.Struct]:
    """The mirror struct of a dataclass, its field types still to be set (`_Codec.__init__`)."""
    specs = []
    for f in [f for f in dataclasses.fields(cls) if f.init]:  # an init=False field is not sent
        if f.default is not MISSING:
            spec = msgspec.field(default=f.default)
        elif f.default_factory is not MISSING:
            spec = msgspec.field(default_factory=f.default_factory)
        else:
            spec = msgspec.field()
        specs.append((f.name, Any, spec))
    return msgspec.defstruct(
        cls.__name__,
        specs,
        tag_field="__type__",
        tag=cls.__name__,
        forbid_unknown_fields=True,
        gc=False,
        omit_defaults=getattr(cls, "omit_defaults", False),
    )


def _is_plain(tp: Any) -> bool:
    """True if values of this type are msgpack values all the way down (no tensor or dataclass)."""
    if typing.get_origin(tp) in (Union, types.UnionType, list, dict):
        return all(map(_is_plain, typing.get_args(tp)))
    return tp in (int, float, bool, str, bytes, type(None))


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
