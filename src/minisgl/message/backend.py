"""Messages to the scheduler (the backend)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import SamplingParams

from .codec import Message
from .tensor import Tensor


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
    input_ids: Tensor  # (T,) int32 on the CPU (a numpy array before it is sent, from the tokenizer)
    sampling_params: SamplingParams


@dataclass
class AbortBackendMsg(BaseBackendMsg):
    uid: int
