"""Package attributes loaded on first use (PEP 562), so that importing a package for its plain names
(the option choices that configs check) does not import torch: the API server's process builds the
configs and stays free of it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, table: Mapping[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: attribute `name` comes from submodule `table[name]`
    (relative, e.g. ".engine"), imported when first asked for."""

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
