"""Decode: the running requests, one new token each per step, in uid order."""

from __future__ import annotations

from minisgl.core import Batch, Req


class DecodeManager:
    """The DECODING requests, by uid."""

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

    @staticmethod
    def batch(reqs: list[Req]) -> Batch | None:
        return Batch(reqs, [1] * len(reqs), "decode") if reqs else None
