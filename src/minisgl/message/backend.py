"""Messages to the scheduler (the backend)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import SamplingParams

from .utils import MessageGroup

_GROUP = MessageGroup("backend")


@_GROUP.base
@dataclass
class BaseBackendMsg(_GROUP.Base):
    pass


@_GROUP.register
@dataclass
class BatchBackendMsg(BaseBackendMsg):
    data: list[BaseBackendMsg]


@_GROUP.register
@dataclass
class ExitMsg(BaseBackendMsg):
    pass


@_GROUP.register
@dataclass
class UserMsg(BaseBackendMsg):
    uid: int
    input_ids: torch.Tensor  # (T,) int32 on the CPU
    sampling_params: SamplingParams


@_GROUP.register
@dataclass
class AbortBackendMsg(BaseBackendMsg):
    uid: int
