"""minisgl.engine: one rank's model + KV pool + attention backend + sampler.

The names load on first use: `minisgl.engine.options` is imported by processes without torch (the
API server builds the scheduler configs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from .create import create_engine
    from .dummy import DummyEngine
    from .engine import Engine
    from .interface import EngineProtocol
    from .options import EngineOptions
    from .sampler import Sampler
    from .step import StepOutput

__all__ = [
    "DummyEngine",
    "Engine",
    "EngineOptions",
    "EngineProtocol",
    "Sampler",
    "StepOutput",
    "create_engine",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "DummyEngine": ".dummy",
        "Engine": ".engine",
        "EngineOptions": ".options",
        "EngineProtocol": ".interface",
        "Sampler": ".sampler",
        "StepOutput": ".step",
        "create_engine": ".create",
    },
)
