"""Batch messages (`BatchBackendMsg`, `BatchTokenizerMsg`, `BatchFrontendMsg`): in and out of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar, cast

from minisgl.message import BatchBackendMsg, BatchFrontendMsg, BatchTokenizerMsg

Msg = TypeVar("Msg")
_BATCHES = (BatchBackendMsg, BatchTokenizerMsg, BatchFrontendMsg)


def unbatch(msgs: Iterable[Msg]) -> list[Msg]:
    """The members of (nested) batches, in order; other messages as they are."""
    out: list[Msg] = []
    for msg in msgs:
        if isinstance(msg, _BATCHES):  # a batch holds messages of its own group: Msgs too
            out.extend(unbatch(cast("list[Msg]", msg.data)))
        else:
            out.append(msg)
    return out


def one_or_batch(msgs: list[Msg], batch_cls: type) -> Msg:
    """One message as itself, several as one `batch_cls(data=msgs)`."""
    return msgs[0] if len(msgs) == 1 else batch_cls(data=msgs)
