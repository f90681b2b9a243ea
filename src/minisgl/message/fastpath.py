"""Optional msgspec acceleration of `to_bytes`/`from_bytes` (used when msgspec is installed).

Every message class of a group (and SamplingParams, and the tensor map) gets a mirror
`msgspec.Struct` tagged by "__type__" with the same fields in the same order. Encoding builds the
mirrors and lets msgspec write them in one C call; decoding parses and type-checks a whole batch in
one C call, and generated functions turn mirrors into the real dataclasses (the loops over a batch
are unrolled per class, the hot cost being one constructor call per message).

The fast path only has to be right when it succeeds. Anything it rejects (bad input, but also valid
yet unusual input such as a batch inside a batch or a field annotation msgspec cannot express)
returns None, and the caller redoes the work with the reference codec in utils.py, which also
writes the error text. The bytes equal `msgpack.packb(msg.encoder(), use_bin_type=True)`: same
field order, same smallest-format choices; the tests check it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

import torch

from minisgl.core import SamplingParams

from .tensor import decode_tensor, encode_tensor

if TYPE_CHECKING:
    from .utils import MessageGroup, _Compiler

try:
    import msgspec
except ImportError:  # pragma: no cover - depends on the environment
    msgspec = None  # type: ignore[assignment]

AVAILABLE = msgspec is not None
_PLAIN = (int, float, bool, str, bytes, type(None))

if AVAILABLE:
    _ENCODER = msgspec.msgpack.Encoder()
    # A struct no valid message uses, put in every union so that msgspec always requires the tag
    # (a lone tagged struct would otherwise also accept a map without "__type__").
    _Never = msgspec.defstruct(
        "_Never", [], tag_field="__type__", tag="\x00never", forbid_unknown_fields=True
    )
    _Tensor = msgspec.defstruct(
        "Tensor",
        [("buffer", bytes), ("dtype", str), ("shape", list[int] | msgspec.UnsetType, msgspec.UNSET)],
        tag_field="__type__",
        tag="Tensor",
        forbid_unknown_fields=True,
    )

    def _tensor_from_mirror(s: Any) -> torch.Tensor:
        return decode_tensor(s.buffer, s.dtype, None if s.shape is msgspec.UNSET else s.shape)

    def _tensor_to_mirror(t: torch.Tensor) -> Any:
        d = encode_tensor(t)  # the one place that turns a tensor into bytes
        return _Tensor(d["buffer"], d["dtype"], d.get("shape", msgspec.UNSET))


def _is_flat(cls: type, hints: dict[str, Any]) -> bool:
    return all(hints[f.name] in _PLAIN for f in dataclasses.fields(cls) if f.init)


class FastCodec:
    """One group's msgspec mirrors. `encode` -> bytes or None; `decode` -> message or None."""

    def __init__(self, group: MessageGroup, compiler: _Compiler) -> None:
        self.group = group
        self.compiler = compiler
        self.classes = [SamplingParams, *group.classes.values()]
        self.hints = {cls: typing.get_type_hints(cls) for cls in self.classes}
        self.mirrors: dict[type, type] = {}  # dataclass -> mirror struct
        self.from_m: dict[type, Callable[[Any], Any]] = {_Tensor: _tensor_from_mirror}  # by mirror
        self.to_m: dict[type, Callable[[Any], Any]] = {}  # by dataclass
        for cls in self.classes:  # pass 1: the mirror classes, with placeholder field types
            self.mirrors[cls] = msgspec.defstruct(
                cls.__name__,
                [self._field_spec(f) for f in dataclasses.fields(cls) if f.init],
                tag_field="__type__",
                tag=cls.__name__,
                forbid_unknown_fields=True,
                gc=False,  # decoded data holds no cycles; untracked structs are cheaper to make
            )
        self.members_from_m = self._unrolled_members(decode=True)
        self.members_to_m = self._unrolled_members(decode=False)
        for cls in self.classes:  # pass 2: real field types (they may refer to each other), converters
            self._finish(cls)
        members = [self.mirrors[c] for c in group.classes.values()]
        self.decoder = msgspec.msgpack.Decoder(Union[tuple([*members, _Never])])  # noqa: UP007

    @classmethod
    def build(cls, group: MessageGroup, compiler: _Compiler) -> FastCodec | None:
        try:
            return cls(group, compiler)
        except Exception:  # an annotation msgspec cannot take at all: the reference path serves
            return None

    def encode(self, msg: Any) -> bytes | None:
        try:
            return _ENCODER.encode(self.to_m[msg.__class__](msg))
        except Exception:
            return None

    def decode(self, raw: Any) -> Any:
        try:
            s = self.decoder.decode(raw)
            return self.from_m[s.__class__](s)
        except Exception:
            return None

    # -- building ----------------------------------------------------------------------------------
    @staticmethod
    def _field_spec(f: dataclasses.Field) -> tuple:
        if f.default is not dataclasses.MISSING:
            return (f.name, Any, f.default)
        if f.default_factory is not dataclasses.MISSING:
            return (f.name, Any, msgspec.field(default_factory=f.default_factory))
        return (f.name, Any)

    def _unrolled_members(self, decode: bool) -> Callable[[list], list]:
        """A loop over a batch's members with the constructor of each flat class inlined."""
        env: dict[str, Any] = {"_other": self.from_m if decode else self.to_m, "_new": object.__new__}
        src = [
            "def run(v):",
            "    out = []",
            "    ap = out.append",
            "    for x in v:",
            "        c = x.__class__",
        ]
        kw = "if"
        for i, cls in enumerate(self.group.classes.values()):
            if not _is_flat(cls, self.hints[cls]):
                continue
            names = [f.name for f in dataclasses.fields(cls) if f.init]
            src_cls, dst_cls = (self.mirrors[cls], cls) if decode else (cls, self.mirrors[cls])
            env[f"S{i}"], env[f"D{i}"] = src_cls, dst_cls
            src.append(f"        {kw} c is S{i}:")
            if decode and not hasattr(cls, "__post_init__"):
                # object.__new__ + stores: what the dataclass __init__ does, minus one Python frame
                src.append(f"            o = _new(D{i})")
                src += [f"            o.{n} = x.{n}" for n in names]
                src.append("            ap(o)")
            else:
                src.append(f"            ap(D{i}({', '.join(f'x.{n}' for n in names)}))")
            kw = "elif"
        src += [
            "        else:" if kw == "elif" else "        if True:",
            "            ap(_other[c](x))",
            "    return out",
        ]
        exec("\n".join(src), env)  # noqa: S102 - generated from dataclass field names only
        return env["run"]

    def _finish(self, cls: type) -> None:
        mirror = self.mirrors[cls]
        fields = [f for f in dataclasses.fields(cls) if f.init]
        env: dict[str, Any] = {"_cls": cls, "_mirror": mirror}
        dec_args, enc_args = [], []
        for i, f in enumerate(fields):
            mtype, from_c, to_c = self._mirror_of(self.hints[cls][f.name])
            mirror.__annotations__[f.name] = mtype
            env[f"_d{i}"], env[f"_e{i}"] = from_c, to_c
            dec_args.append(f"s.{f.name}" if from_c is None else f"_d{i}(s.{f.name})")
            enc_args.append(f"m.{f.name}" if to_c is None else f"_e{i}(m.{f.name})")
        src = f"def from_m(s):\n    return _cls({', '.join(dec_args)})\n"
        src += f"def to_m(m):\n    return _mirror({', '.join(enc_args)})\n"
        exec(src, env)  # noqa: S102
        self.from_m[mirror] = env["from_m"]
        self.to_m[cls] = env["to_m"]

    def _mirror_of(self, tp: Any) -> tuple[Any, Callable | None, Callable | None]:
        """(msgspec type for an annotation, decoded value -> field value, field value -> encodable)."""
        if tp is Any or tp in _PLAIN or tp is None:
            return tp, None, None
        if tp is torch.Tensor:
            return Union[_Tensor, _Never], _tensor_from_mirror, _tensor_to_mirror  # noqa: UP007
        from_m, to_m = self.from_m, self.to_m
        if tp is self.group.base_cls:
            members = tuple(self.mirrors[c] for c in self.group.classes.values())
            return (
                Union[(*members, _Never)],  # noqa: UP007
                lambda s: from_m[s.__class__](s),
                lambda m: to_m[m.__class__](m),
            )
        if tp in self.mirrors:
            return (
                Union[self.mirrors[tp], _Never],  # noqa: UP007
                lambda s: from_m[s.__class__](s),
                lambda m: to_m[m.__class__](m),
            )
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is list and args:
            item_t, item_d, item_e = self._mirror_of(args[0])
            if args[0] is self.group.base_cls:
                return list[item_t], self.members_from_m, self.members_to_m
            if item_d is None and item_e is None:
                return list[item_t], None, None
        if origin in (typing.Union, types.UnionType) and all(a in _PLAIN for a in args):
            try:
                msgspec.msgpack.Decoder(tp)  # msgspec allows at most one type of each kind
                return tp, None, None
            except TypeError:
                pass
        if origin is dict and args and all(a in _PLAIN for a in args):
            return tp, None, None
        # Anything else: msgspec takes any value; the reference check decides and converts, and the
        # reference encoder writes it (tagged dicts encode to the same bytes as mirrors).
        return Any, self.compiler.check_for(tp), self.group._encode_any
