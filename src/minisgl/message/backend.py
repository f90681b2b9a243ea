"""Messages to the scheduler (the backend)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import SamplingParams

from .codec import Message


@dataclass
class BaseBackendMsg(Message, group="backend"):
    pass


@dataclass
class BatchBackendMsg(BaseBackendMsg):
    data: list[BaseBackendMsg]


@dataclass
class ExitMsg(BaseBackendMsg):
    pass


@dataclass
class UserMsg(BaseBackendMsg):
    uid: int
    input_ids: torch.Tensor  # (T,) int32 on the CPU
    sampling_params: SamplingParams


@dataclass
class AbortBackendMsg(BaseBackendMsg):
    uid: int
