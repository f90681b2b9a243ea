"""The message codec: dataclass <-> tagged dict <-> msgpack bytes, strict and fast.

Wire format (the chapters'): a message is a msgpack map {"__type__": class name, field: value, ...}
with the fields in dataclass order; nested messages and `SamplingParams` likewise; a tensor is
{"__type__": "Tensor", "buffer": bytes, "dtype": "torch.int32"} (+ "shape" unless 1-D, see tensor.py).
Bytes made by the chapters' generic serializer decode here, and ours decode there.

What is ours:
- Each group (tokenizer, backend, frontend) decodes only its closed table of classes, never a
  module's globals(). Every field is checked against its annotation; anything wrong raises
  `MessageDecodeError` (a ValueError) naming the class, the field path and the problem.
- Fields that have a default may be omitted on the wire (the default is used); fields without one are
  required. Our encoder (like the chapter's) always writes every field.
- Speed: at the first use of a group, one encode and one decode function is generated per class
  (field names and checks unrolled), so no per-message reflection happens. `to_bytes`/`from_bytes`
  additionally go through msgspec when it is installed (fastpath.py); whatever the fast path
  rejects is decoded again by the reference path here, which is the one that gives the error text.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import msgpack
import torch

from minisgl.core import SamplingParams

from . import fastpath
from .tensor import TensorFormatError, decode_tensor, encode_tensor

__all__ = ["MessageDecodeError", "MessageGroup"]


class MessageDecodeError(ValueError):
    """Bytes or a dict that are not a valid message of the receiving group."""


class _Invalid(Exception):
    """Internal: a check failed at `path` (field names and [index] parts, innermost last)."""

    def __init__(self, problem: str, path: list[str] | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path = path if path is not None else []


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _format_path(root: str, path: list[str]) -> str:
    out = root
    for part in path:
        out += part if part.startswith("[") else f".{part}"
    return out


# --------------------------------------------------------------------------------------------------
# Checks of decoded values against annotations (reference path). Each returns the value to store.


def _check_int(v: Any) -> int:
    if v.__class__ is not int:
        raise _Invalid(f"expected int, got {_describe(v)}")
    return v


def _check_float(v: Any) -> float:
    if v.__class__ is float:
        return v
    if v.__class__ is int:  # msgpack writes 1.0 passed as 1 as an int
        return float(v)
    raise _Invalid(f"expected float, got {_describe(v)}")


def _exact(tp: type) -> Callable[[Any], Any]:
    name = tp.__name__

    def check(v: Any) -> Any:
        if v.__class__ is not tp:
            raise _Invalid(f"expected {name}, got {_describe(v)}")
        return v

    return check


def _check_none(v: Any) -> None:
    if v is not None:
        raise _Invalid(f"expected None, got {_describe(v)}")


def _check_any(v: Any) -> Any:
    return v


_TENSOR_KEYS = frozenset({"__type__", "buffer", "dtype"})
_TENSOR_KEYS_ND = frozenset({"__type__", "buffer", "dtype", "shape"})


def _check_tensor(v: Any) -> torch.Tensor:
    if v.__class__ is not dict:
        raise _Invalid(f"expected a Tensor map, got {_describe(v)}")
    keys = v.keys()
    if keys != _TENSOR_KEYS and keys != _TENSOR_KEYS_ND:
        extra = sorted(map(str, keys - _TENSOR_KEYS_ND))
        missing = sorted(_TENSOR_KEYS - keys)
        raise _Invalid(f"bad Tensor map: missing {missing}, unexpected {extra}")
    if v["__type__"] != "Tensor":
        raise _Invalid(f"expected a Tensor, got __type__ {v['__type__']!r:.60}")
    shape = v.get("shape")
    if shape is None and "shape" in v:
        raise _Invalid("Tensor 'shape' must be a list of ints, got None")
    try:
        return decode_tensor(v["buffer"], v["dtype"], shape)
    except TensorFormatError as e:
        raise _Invalid(str(e)) from None


def _list_check(item: Callable[[Any], Any]) -> Callable[[Any], list]:
    def check(v: Any) -> list:
        if v.__class__ is not list:
            raise _Invalid(f"expected a list, got {_describe(v)}")
        try:
            return [item(x) for x in v]
        except _Invalid:
            for i, x in enumerate(v):  # only on failure: find which element, for the message
                try:
                    item(x)
                except _Invalid as e:
                    e.path.insert(0, f"[{i}]")
                    raise e from None
            raise

    return check


def _dict_check(key: Callable[[Any], Any], value: Callable[[Any], Any]) -> Callable[[Any], dict]:
    def check(v: Any) -> dict:
        if v.__class__ is not dict:
            raise _Invalid(f"expected a map, got {_describe(v)}")
        out = {}
        for k, x in v.items():
            try:
                out[key(k)] = value(x)
            except _Invalid as e:
                e.path.insert(0, f"[{k!r:.40}]")
                raise
        return out

    return check


def _union_check(
    options: list[Any], checks: list[Callable[[Any], Any]], names: list[str]
) -> Callable[[Any], Any]:
    # Values of an exact simple type (int, bool, str, bytes, None) are accepted without trying each
    # option in turn (a failed try costs an exception).
    exact = {
        t if t is not None else type(None) for t in options if t in (int, bool, str, bytes, None, type(None))
    }
    if float in options:
        exact.add(float)

    def check(v: Any) -> Any:
        if v.__class__ in exact:
            return v
        for option in checks:
            try:
                return option(v)
            except _Invalid:
                continue
        raise _Invalid(f"expected {' | '.join(names)}, got {_describe(v)}")

    return check


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# --------------------------------------------------------------------------------------------------
# Per-class code generation.

_SIMPLE_INLINE = {int: "int", bool: "bool", str: "str", bytes: "bytes"}  # exact-class checks inlined


class _Compiler:
    """Builds check/encode functions for annotations; one per codec (group)."""

    def __init__(self, group: MessageGroup) -> None:
        self.group = group
        self.decoders: dict[type, Callable[[dict], Any]] = {}  # dataclass -> dict decoder
        self.encoders: dict[type, Callable[[Any], dict]] = {}  # dataclass -> dict encoder

    # -- checks ------------------------------------------------------------------------------------
    def check_for(self, tp: Any) -> Callable[[Any], Any]:
        if tp is Any:
            return _check_any
        if tp is int:
            return _check_int
        if tp is float:
            return _check_float
        if tp in (bool, str, bytes):
            return _exact(tp)
        if tp is None or tp is type(None):
            return _check_none
        if tp is torch.Tensor:
            return _check_tensor
        if tp is self.group.base_cls:
            return self.group._check_member
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self._nested_check(tp)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            return _union_check(list(args), [self.check_for(a) for a in args], [_type_name(a) for a in args])
        if origin is list and args and args[0] is self.group.base_cls:
            return self._members_check()
        if origin is list:
            return _list_check(self.check_for(args[0]) if args else _check_any)
        if origin is dict:
            k, v = args if args else (Any, Any)
            return _dict_check(self.check_for(k), self.check_for(v))
        raise TypeError(f"message field type {tp!r} is not supported by the codec")

    def _nested_check(self, cls: type) -> Callable[[Any], Any]:
        if cls not in self.decoders:
            if cls is not SamplingParams and cls not in self.group.classes.values():
                raise TypeError(f"{cls.__name__} is neither a {self.group.name} message nor SamplingParams")
            self._compile_class(cls)
        decoders = self.decoders
        return lambda v: decoders[cls](v)

    def _members_check(self) -> Callable[[Any], list]:
        """A batch's `data`: like `_list_check(group member)`, with the common flat messages
        (only int/bool/str/float fields) checked and built inline, one Python frame for the batch."""
        group = self.group
        slow = _list_check(group._check_member)
        env: dict[str, Any] = {"_Invalid": _Invalid, "_describe": _describe, "_new": object.__new__}
        env["_member"], env["_slow"] = group._check_member, slow
        src = [
            "def run(v):",
            "    if v.__class__ is not list:",
            '        raise _Invalid(f"expected a list, got {_describe(v)}")',
            "    out = []",
            "    ap = out.append",
            "    try:",
            "        for x in v:",
            "            t = x.get('__type__') if x.__class__ is dict else None",
        ]
        for i, cls in enumerate(group.classes.values()):
            hints = typing.get_type_hints(cls)
            fields = [f for f in dataclasses.fields(cls) if f.init]
            if not all(hints[f.name] in (int, bool, str, float) for f in fields):
                continue
            env[f"K{i}"], env[f"C{i}"] = frozenset(["__type__", *(f.name for f in fields)]), cls
            names = [f"v{j}" for j in range(len(fields))]
            src.append(f"            if t == {cls.__name__!r} and x.keys() == K{i}:")
            src += [f"                v{j} = x[{f.name!r}]" for j, f in enumerate(fields)]
            conds = [f"v{j}.__class__ is {hints[f.name].__name__}" for j, f in enumerate(fields)] or ["True"]
            src.append(f"                if {' and '.join(conds)}:")
            if hasattr(cls, "__post_init__"):
                src.append(f"                    ap(C{i}({', '.join(names)}))")
            else:
                src.append(f"                    o = _new(C{i})")
                src += [f"                    o.{f.name} = v{j}" for j, f in enumerate(fields)]
                src.append("                    ap(o)")
            src.append("                    continue")
        src += [
            "            ap(_member(x))",  # anything else: the full check (it names what is wrong)
            "    except _Invalid:",
            "        _slow(v)",  # again, to find which element failed for the message
            "        raise",
            "    return out",
        ]
        exec("\n".join(src), env)  # noqa: S102 - generated from dataclass field names only
        return env["run"]

    # -- encoders ----------------------------------------------------------------------------------
    def encoder_for(self, tp: Any) -> Callable[[Any], Any] | None:
        """None: the value goes to msgpack as it is (plain data)."""
        if _is_plain(tp):
            return None
        if tp is torch.Tensor:
            return encode_tensor
        if tp is self.group.base_cls:
            return self.group._encode_member
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if tp not in self.encoders:
                self._compile_class(tp)
            encoders = self.encoders
            return lambda v: encoders[tp](v)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is list and args and args[0] is self.group.base_cls:
            return self._members_encoder()
        if origin is list and args:
            item = self.encoder_for(args[0])
            if item is not None:
                return lambda v: [item(x) for x in v]
        return self.group._encode_any

    def _members_encoder(self) -> Callable[[list], list]:
        """A batch's `data` -> list of tagged dicts, the flat messages' dicts built inline."""
        env: dict[str, Any] = {"_enc": self.group._encode_member}
        src = [
            "def run(v):",
            "    out = []",
            "    ap = out.append",
            "    for x in v:",
            "        c = x.__class__",
        ]
        for i, cls in enumerate(self.group.classes.values()):
            fields = [f for f in dataclasses.fields(cls) if f.init]
            if not all(_is_plain(t) for t in typing.get_type_hints(cls).values()):
                continue
            env[f"C{i}"] = cls
            items = ", ".join([f'"__type__": {cls.__name__!r}', *(f'"{f.name}": x.{f.name}' for f in fields)])
            src += [f"        if c is C{i}:", f"            ap({{{items}}})", "            continue"]
        src += ["        ap(_enc(x))", "    return out"]
        exec("\n".join(src), env)  # noqa: S102 - generated from dataclass field names only
        return env["run"]

    # -- one class ---------------------------------------------------------------------------------
    def _compile_class(self, cls: type) -> None:
        name = cls.__name__
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init]
        env: dict[str, Any] = {"_cls": cls, "_Invalid": _Invalid, "_describe": _describe}
        # placeholders first, so that recursive types (a batch inside a batch) resolve
        self.decoders[cls] = self.encoders[cls] = None  # type: ignore[assignment]

        enc_items = [f'"__type__": "{name}"']
        for i, f in enumerate(fields):
            fn = self.encoder_for(hints[f.name])
            if fn is None:
                enc_items.append(f'"{f.name}": m.{f.name}')
            else:
                env[f"_e{i}"] = fn
                enc_items.append(f'"{f.name}": _e{i}(m.{f.name})')
        src = ["def encode(m):", f"    return {{{', '.join(enc_items)}}}"]

        env["_keys"] = frozenset(["__type__", *(f.name for f in fields)])
        env["_fill"] = self._defaults_filler(cls, fields)
        src += [
            "def decode(d):",
            "    if d.__class__ is not dict:",
            f'        raise _Invalid(f"expected a {name} map, got {{_describe(d)}}")',
            "    if d.keys() != _keys:",
            "        d = _fill(d)",
            f'    if d["__type__"] != "{name}":',
            f"        raise _Invalid(f\"expected __type__ {name!r}, got {{d['__type__']!r:.60}}\")",
        ]
        for i, f in enumerate(fields):
            tp = hints[f.name]
            src.append(f'    v{i} = d["{f.name}"]')
            if tp in _SIMPLE_INLINE:
                src += [
                    f"    if v{i}.__class__ is not {_SIMPLE_INLINE[tp]}:",
                    f'        raise _Invalid(f"expected {_SIMPLE_INLINE[tp]}, got {{_describe(v{i})}}", ["{f.name}"])',
                ]
            else:
                env[f"_c{i}"] = self.check_for(tp)
                src += [
                    "    try:",
                    f"        v{i} = _c{i}(v{i})",
                    "    except _Invalid as e:",
                    f'        e.path.insert(0, "{f.name}")',
                    "        raise",
                ]
        src.append(f"    return _cls({', '.join(f'v{i}' for i in range(len(fields)))})")
        exec("\n".join(src), env)  # noqa: S102 - generated from dataclass field names only
        self.encoders[cls] = env["encode"]
        self.decoders[cls] = env["decode"]

    @staticmethod
    def _defaults_filler(cls: type, fields: list[dataclasses.Field]) -> Callable[[dict], dict]:
        """The slow path of a decode: report missing/extra keys, or fill omitted defaults."""
        known = {"__type__", *(f.name for f in fields)}

        def fill(d: dict) -> dict:
            extra = [k for k in d if k not in known]
            if extra:
                raise _Invalid(f"unexpected field(s) {', '.join(repr(k)[:40] for k in extra[:5])}")
            if "__type__" not in d:
                raise _Invalid(f"missing '__type__' (expected {cls.__name__!r})")
            out = dict(d)
            for f in fields:
                if f.name in out:
                    continue
                if f.default is not dataclasses.MISSING:
                    out[f.name] = f.default
                elif f.default_factory is not dataclasses.MISSING:
                    out[f.name] = f.default_factory()
                else:
                    raise _Invalid(f"missing required field {f.name!r}")
            return out

        return fill


_PLAIN_TYPES = (int, float, bool, str, bytes, type(None))


def _is_plain(tp: Any) -> bool:
    """True if values of this type are msgpack-native all the way down (no tensor/dataclass/Any)."""
    if tp is None or tp in _PLAIN_TYPES:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType, list, dict) and args:
        return all(_is_plain(a) for a in args)
    return False


# --------------------------------------------------------------------------------------------------
# Groups.


class MessageGroup:
    """A closed table of message classes decoded by one receiver (tokenizer, backend, frontend).

    Usage in a message module: `_GROUP = MessageGroup("backend")`; the group base class derives from
    `_GROUP.Base` and is decorated `@_GROUP.base`; each concrete message is `@_GROUP.register`ed.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.classes: dict[str, type] = {}
        self.base_cls: type | None = None
        self._compiled = False
        self._enc: dict[type, Callable[[Any], dict]] = {}
        self._all_enc: dict[type, Callable[[Any], dict]] = {}
        self._dec: dict[str, Callable[[dict], Any]] = {}
        self._fast: fastpath.FastCodec | None = None
        self.Base = self._make_base()

    # -- declaration -------------------------------------------------------------------------------
    def base(self, cls: type) -> type:
        self.base_cls = cls
        return cls

    def register(self, cls: type) -> type:
        if cls.__name__ in self.classes or cls.__name__ in ("Tensor", "SamplingParams"):
            raise TypeError(f"message name {cls.__name__!r} is already used in the {self.name} group")
        self.classes[cls.__name__] = cls
        self._compiled = False
        return cls

    # -- the compiled tables -----------------------------------------------------------------------
    def _compile(self) -> None:
        compiler = _Compiler(self)
        for cls in self.classes.values():
            if cls not in compiler.decoders:
                compiler._compile_class(cls)
        compiler.encoder_for(SamplingParams)
        self._all_enc = dict(compiler.encoders)
        self._enc = {cls: compiler.encoders[cls] for cls in self.classes.values()}
        self._dec = {name: compiler.decoders[cls] for name, cls in self.classes.items()}
        self._fast = fastpath.FastCodec.build(self, compiler) if fastpath.AVAILABLE else None
        self._compiled = True

    def _ensure(self) -> None:
        if not self._compiled:
            self._compile()

    def _encode_member(self, msg: Any) -> dict:
        fn = self._enc.get(msg.__class__)
        if fn is None:
            raise TypeError(f"{type(msg).__name__} is not a registered {self.name} message")
        return fn(msg)

    def _encode_any(self, value: Any) -> Any:
        """Values of loosely typed fields (unions, Any): the chapter's generic walk."""
        if isinstance(value, (str, int, float, bytes)) or value is None:
            return value
        if isinstance(value, (list, tuple)):
            return [self._encode_any(v) for v in value]
        if isinstance(value, dict):
            return {k: self._encode_any(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            return encode_tensor(value)
        enc = self._all_enc.get(value.__class__)  # SamplingParams or a message of the group
        if enc is None:
            raise TypeError(f"cannot encode a {type(value).__name__} in a {self.name} message")
        return enc(value)

    def _check_member(self, v: Any) -> Any:
        """A value annotated with the group's base class: any message of the group."""
        if v.__class__ is not dict:
            raise _Invalid(f"expected a {self.name} message map, got {_describe(v)}")
        name = v.get("__type__")
        dec = self._dec.get(name) if name.__class__ is str else None
        if dec is None:
            raise _Invalid(self._unknown(name))
        return dec(v)

    def _unknown(self, name: Any) -> str:
        if name is None:
            return "missing '__type__'"
        return f"unknown {self.name} message type {name!r:.60} (known: {', '.join(sorted(self.classes))})"

    # -- the public entry points -------------------------------------------------------------------
    def encode(self, msg: Any) -> dict:
        self._ensure()
        return self._encode_member(msg)

    def to_bytes(self, msg: Any) -> bytes:
        self._ensure()
        if self._fast is not None:
            raw = self._fast.encode(msg)
            if raw is not None:
                return raw
        return msgpack.packb(self._encode_member(msg), use_bin_type=True)

    def decode(self, data: Any) -> Any:
        """A dict (as msgpack gives it) -> a message of this group, or MessageDecodeError."""
        self._ensure()
        if data.__class__ is not dict:
            raise MessageDecodeError(f"{self.name} message: expected a map, got {_describe(data)}")
        name = data.get("__type__")
        dec = self._dec.get(name) if name.__class__ is str else None
        if dec is None:
            raise MessageDecodeError(f"{self.name} message: {self._unknown(name)}")
        try:
            return dec(data)
        except _Invalid as e:
            raise MessageDecodeError(f"{_format_path(name, e.path)}: {e.problem}") from None
        except RecursionError:
            raise MessageDecodeError(f"{name}: nested too deeply") from None

    def from_bytes(self, raw: bytes | bytearray | memoryview) -> Any:
        """Bytes -> a message of this group, or MessageDecodeError (never anything else)."""
        self._ensure()
        if self._fast is not None:
            msg = self._fast.decode(raw)
            if msg is not None:
                return msg
        try:
            data = msgpack.unpackb(raw, raw=False)
        except Exception as e:  # truncated, trailing bytes, bad UTF-8, non-str keys, not bytes, ...
            raise MessageDecodeError(
                f"{self.name} message: not valid msgpack ({type(e).__name__}: {e})"
            ) from None
        return self.decode(data)

    def _make_base(self) -> type:
        group = self

        class Base:
            """Gives every message of the group its encode/decode methods."""

            _group = group

            def encoder(self) -> dict:
                """The tagged dict of this message (callable as `BaseXMsg.encoder(msg)` too)."""
                return group.encode(self)

            def to_bytes(self) -> bytes:
                """Exactly `msgpack.packb(self.encoder(), use_bin_type=True)`, faster."""
                return group.to_bytes(self)

            @staticmethod
            def decoder(data: dict) -> Any:
                """A tagged dict -> a message of this group (MessageDecodeError if it is not one)."""
                return group.decode(data)

            @staticmethod
            def from_bytes(raw: bytes) -> Any:
                """Bytes -> a message of this group (MessageDecodeError if they are not one)."""
                return group.from_bytes(raw)

        for fn in (Base.encoder, Base.to_bytes, Base.decoder, Base.from_bytes):
            fn._group = group  # type: ignore[attr-defined]  # lets group_of() recognise them
        Base.__name__ = Base.__qualname__ = f"_{self.name.capitalize()}MsgBase"
        return Base


def group_of(obj: Any) -> MessageGroup | None:
    """The group of a group's `encoder`/`decoder` function or base class, else None.

    The queues use it to take the one-step bytes path (`to_bytes`/`from_bytes`) when they are given
    the chapter-style `BaseXMsg.encoder` / `BaseXMsg.decoder`.
    """
    group = getattr(obj, "_group", None)
    return group if isinstance(group, MessageGroup) else None
