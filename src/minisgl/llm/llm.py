"""The offline `LLM`: a scheduler in offline mode, fed and drained in-process (no sockets, no workers).

`LLM(model, tp=N)` with N > 1 returns a `MultiRankLLM` instead (`ranks.py`): N scheduler processes
and the same API."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from minisgl.engine.options import resolve_device, resolve_dtype, resolve_native
from minisgl.message import BaseBackendMsg, BaseTokenizerMsg
from minisgl.scheduler.scheduler import Scheduler

from .api import OfflineAPI, Prompts, check_options, pop_hub_options

if TYPE_CHECKING:
    from minisgl.core import SamplingParams

    from .ranks import MultiRankLLM

logger = logging.getLogger(__name__)

__all__ = ["LLM", "Prompts"]


class LLM(OfflineAPI, Scheduler):
    """`LLM(model=None, tp=1, **options)`: model None = the embedded SmolLM2-135M-Instruct, else a
    directory, a .gguf file or a Hugging Face id (with `revision`, `download_dir`, `gguf_file` as
    `minisgl serve` takes them); options are SchedulerConfig fields (device="auto", dtype, task,
    page_size, num_pages, kv_cache_memory, max_running_requests, max_prefill_tokens, max_seq_len,
    seed, engine, dummy_weights, cache_type="radix"|"naive", ...). tp > 1 gives a `MultiRankLLM`
    (N processes, same API)."""

    # LLM(tp=N > 1) is a MultiRankLLM by design (the same API over N rank processes), not an LLM.
    def __new__(cls, model: str | None = None, **options: Any) -> LLM | MultiRankLLM:  # type: ignore[misc]
        tp = options.get("tp", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {tp!r}")
        if tp > 1:
            from .ranks import MultiRankLLM

            return MultiRankLLM(model, **options)  # not an LLM: Python does not call LLM.__init__ on it
        return super().__new__(cls)

    def __init__(self, model: str | None = None, **options: Any) -> None:
        from minisgl.distributed import DistributedInfo
        from minisgl.models import resolve_model_path
        from minisgl.scheduler.config import SchedulerConfig

        options.pop("tp", None)
        device = resolve_device(str(options.pop("device", "auto")))
        native = resolve_native(options.get("dtype"), device)
        dtype = resolve_dtype(options.pop("dtype", None), device)
        hub = pop_hub_options(options)
        model_dir = resolve_model_path(
            model, require_weights=not options.get("dummy_weights", False), hub=hub
        )
        check_options(options)
        config = SchedulerConfig(
            model_path=str(model_dir),
            tp_info=DistributedInfo(0, 1),
            dtype=dtype,
            native_weights=native,
            device=device,
            **{**options, "offline_mode": True},
        )
        self._inbox: list[BaseBackendMsg] = []
        self._init_api()
        super().__init__(config)
        self._load_text(model_dir)

    # -- offline IO (bound by SchedulerIOMixin in offline mode) ----------------------------------------
    def offline_receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        if blocking:
            self.run_when_idle()
        msgs, self._inbox = self._inbox, []
        return msgs

    def offline_send_result(self, reply: list[BaseTokenizerMsg]) -> None:
        for msg in reply:
            self._record(msg)

    # -- OfflineAPI ------------------------------------------------------------------------------------
    def _submit(self, msgs: list[BaseBackendMsg]) -> None:
        self._inbox.extend(msgs)

    def _advance(self) -> None:
        self.step()

    def _abandon(self, uids: list[int]) -> None:
        """Kept as it was: an interrupted `generate` leaves its requests to run on at the next call."""

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Nothing: `generate` checked every request before it queued any, and the inbox has no
        other source, so the scheduler does not check them a second time."""
