"""Dataclass fields that carry their own description.

A config's option is declared once, with its default and a line of help beside it: readers of the
dataclass see both, and `minisgl serve --help` shows both from there (`minisgl.launch.args`), so a
default is never restated in a help string. Refer to another option in a help text as `name` (in
backticks): the command line shows it as its flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def option(default: Any, help: str, *, unset: str = "", choices: Sequence[str] = (), **metadata: Any) -> Any:
    """A field with a default and its help. `unset` says what a default of None means (shown as the
    default); `choices` are the values it may take (checked by `check_choices`)."""
    meta = {"help": help, "unset": unset, "choices": tuple(choices), **metadata}
    return dataclasses.field(default=default, metadata=meta)


def check_choices(config: DataclassInstance) -> None:
    """Raise ValueError naming the first field whose value is not one of its `choices`."""
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")


def shown_default(f: dataclasses.Field[Any]) -> str:
    """How --help shows a field's default: its `unset` text for None, on/off for a bool."""
    value = f.default
    if value is None:
        return f.metadata.get("unset") or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
