"""Decode: the running requests, one new token each per step, longest context first."""

from __future__ import annotations

import os

from minisgl.core import Batch, Req

# MINISGL_DECODE_ORDER=uid: decode batches in uid order (the old order; for A/B measurements).
_LONGEST_FIRST = os.environ.get("MINISGL_DECODE_ORDER", "longest") != "uid"


class DecodeManager:
    """The DECODING requests, by uid."""

    longest_first = _LONGEST_FIRST

    def __init__(self) -> None:
        self.running: dict[int, Req] = {}

    def __len__(self) -> int:
        return len(self.running)

    def add(self, req: Req) -> None:
        self.running[req.uid] = req

    def remove(self, uid: int) -> Req | None:
        return self.running.pop(uid, None)

    def ordered(self) -> list[Req]:
        """Sorted by uid: every tensor-parallel rank builds the same batch, whatever its dict order."""
        return [self.running[uid] for uid in sorted(self.running)]

    def batch(self, reqs: list[Req]) -> Batch | None:
        """One decode step of `reqs`, the longest cached context first (ties by uid: every rank
        builds the same batch). The decode attention kernel gives each (request, KV head) its own
        programs, launched in batch order, and a request's time grows with its context: starting
        the longest first leaves the short ones to fill the GPU at the end (longest processing time
        first), where uid order may start a long request last and leave most of the GPU idle while
        it runs alone."""
        if not reqs:
            return None
        if self.longest_first:
            reqs = sorted(reqs, key=lambda r: (-r.cached_len, r.uid))
        return Batch(reqs, [1] * len(reqs), "decode")
