"""The offline `LLM`: a scheduler in offline mode, fed and drained in-process (no sockets, no workers)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from minisgl.core import RequestRejected, SamplingParams, check_request
from minisgl.engine.options import resolve_device, resolve_dtype
from minisgl.message import BaseBackendMsg, BaseTokenizerMsg, DetokenizeMsg, ErrorMsg, UserMsg
from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

Prompts = str | list[str] | list[int] | list[list[int]]


class LLM(Scheduler):
    """`LLM(model=None, **options)`: model None = the embedded SmolLM2-135M-Instruct; options are
    SchedulerConfig fields (device="auto", dtype, page_size, num_pages, kv_cache_memory,
    max_running_requests, max_prefill_tokens, max_seq_len, seed, engine, dummy_weights,
    cache_type="radix"|"naive", ...)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        from minisgl.distributed import DistributedInfo
        from minisgl.models import resolve_model_path
        from minisgl.scheduler.config import SchedulerConfig
        from minisgl.utils.hf import load_tokenizer

        device = resolve_device(str(options.pop("device", "auto")))
        dtype = resolve_dtype(options.pop("dtype", None), device)
        model_dir = resolve_model_path(model, require_weights=not options.get("dummy_weights", False))
        known = {f.name for f in dataclasses.fields(SchedulerConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown LLM option(s) {unknown}; valid options: {sorted(known - {'tp_info'})}")
        config = SchedulerConfig(
            model_path=str(model_dir),
            tp_info=DistributedInfo(0, 1),
            dtype=dtype,
            device=device,
            **{**options, "offline_mode": True},
        )
        self._inbox: list[BaseBackendMsg] = []
        self._results: dict[int, dict[str, Any]] = {}
        self._next_uid = 0
        super().__init__(config)
        self.tokenizer = load_tokenizer(model_dir)

    # -- offline IO (bound by SchedulerIOMixin in offline mode) ----------------------------------------
    def offline_receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        if blocking:
            self.run_when_idle()
        msgs, self._inbox = self._inbox, []
        return msgs

    def offline_send_result(self, reply: list[BaseTokenizerMsg]) -> None:
        for msg in reply:
            res = self._results.get(msg.uid)
            if res is None:
                continue
            if isinstance(msg, DetokenizeMsg):
                if msg.next_token >= 0:
                    res["token_ids"].append(msg.next_token)
                res["cached_tokens"] = msg.cached_tokens
                if msg.finished:
                    res["finish_reason"] = msg.finish_reason
            elif isinstance(msg, ErrorMsg):
                res["finish_reason"], res["error"] = "error", msg.message

    # -- the API ---------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[dict[str, Any]]:
        """Complete each prompt (text or token ids). Returns, per prompt, a dict with "text",
        "token_ids" (generated ids), "finish_reason" ("stop", "length"), "prompt_tokens" and
        "cached_tokens" (prompt tokens whose KV came from the prefix cache)."""
        token_lists = [self._tokenize(p) for p in _as_prompt_list(prompts)]
        params = _as_params_list(sampling_params, len(token_lists))
        for i, (ids, p) in enumerate(zip(token_lists, params, strict=True)):
            self._check(i, ids, p)
        return self._run(token_lists, params)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[dict[str, Any]]:
        """Answer one conversation (a list of {"role", "content"} dicts) or several, with the chat template."""
        from minisgl.utils.hf import apply_chat_template

        if not isinstance(messages, list) or not messages:
            raise ValueError("chat() needs a non-empty list of messages (or a list of conversations)")
        convs = [messages] if isinstance(messages[0], dict) else messages
        for conv in convs:
            if not isinstance(conv, list) or not conv or not all(isinstance(m, dict) for m in conv):
                raise ValueError("each conversation must be a non-empty list of {'role', 'content'} dicts")
        return self.generate([apply_chat_template(self.tokenizer, conv) for conv in convs], sampling_params)

    # -- helpers ---------------------------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt)) if prompt else []
        return list(prompt)

    def _check(self, i: int, ids: list[int], params: SamplingParams) -> None:
        try:
            check_request(ids, params, self.vocab_size, self.max_seq_len)
        except RequestRejected as e:
            raise RequestRejected(f"prompt {i}: {e}") from None

    def _run(self, token_lists: list[list[int]], params: list[SamplingParams]) -> list[dict[str, Any]]:
        uids = []
        for ids, p in zip(token_lists, params, strict=True):
            uid, self._next_uid = self._next_uid, self._next_uid + 1
            self._results[uid] = {"token_ids": [], "finish_reason": None, "cached_tokens": 0}
            self._inbox.append(
                UserMsg(uid=uid, input_ids=torch.tensor(ids, dtype=torch.int32), sampling_params=p)
            )
            uids.append(uid)
        try:
            while any(self._results[u]["finish_reason"] is None for u in uids):
                self.step()
        finally:
            results = [self._results.pop(u) for u in uids]
        for res, ids in zip(results, token_lists, strict=True):
            res["prompt_tokens"] = len(ids)
            res["text"] = self.tokenizer.decode(res["token_ids"], skip_special_tokens=True)
        return results


def _as_prompt_list(prompts: Prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(
            "prompts must be a string, a list of strings, a list of token ids or a list of such lists"
        )
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    for p in prompts:
        if not isinstance(p, (str, list)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(params: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, list) or len(params) != n:
        raise ValueError(f"give one SamplingParams or a list of {n} (one per prompt)")
    return params
