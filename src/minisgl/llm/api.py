"""What every offline LLM offers, however its ranks run: `generate`, `chat`, `embed`, `close`.

The subclass says where the requests go (`_submit`) and how the replies come back (`_advance`, which
hands each reply to `_record`): `LLM` steps a scheduler in this process, `MultiRankLLM` talks to
rank 0 of its tensor-parallel processes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import RequestRejected, SamplingParams, check_request
from minisgl.message import (
    AbortBackendMsg,
    BaseBackendMsg,
    BaseTokenizerMsg,
    DetokenizeMsg,
    ErrorMsg,
    UserMsg,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from minisgl.models.hub import HubOptions
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.tokenizer.fast import FastTokenizer

Prompts = str | list[str] | list[int] | list[list[int]]


class OfflineAPI:
    """The user-facing half of an offline LLM (see the module docstring)."""

    vocab_size: int
    max_seq_len: int
    config: SchedulerConfig

    def _init_api(self) -> None:
        self._results: dict[int, dict[str, Any]] = {}
        self._next_uid = 0
        self._hf_tokenizer: PreTrainedTokenizerBase | None = None

    def _load_text(self, model_dir: str | Path) -> None:
        """The tokenizer this LLM encodes, decodes and renders chats with: tokenizer.json through
        `tokenizers`, as the server's tokenizer workers do, without importing transformers (~1.5 s of
        LLM()'s start on a 2-core machine); `tokenizer` loads transformers' own on first use."""
        from minisgl.tokenizer.fast import load_fast_tokenizer

        self._model_dir = Path(model_dir)
        self._text: FastTokenizer | PreTrainedTokenizerBase = load_fast_tokenizer(model_dir)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's Hugging Face tokenizer (transformers', loaded when first asked for)."""
        if self._hf_tokenizer is None:
            from minisgl.utils.hf import load_tokenizer

            self._hf_tokenizer = load_tokenizer(self._model_dir)
        return self._hf_tokenizer

    # -- where requests go (the subclass) --------------------------------------------------------------
    def _submit(self, msgs: list[BaseBackendMsg]) -> None:
        raise NotImplementedError

    def _advance(self) -> None:
        """Make progress; every reply that arrives goes to `_record`."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what this LLM holds (processes, sockets); it cannot be used afterwards."""

    def __enter__(self) -> OfflineAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _record(self, msg: BaseTokenizerMsg) -> None:
        """One reply of the scheduler (rank 0) into its request's result; others are ignored."""
        res = self._results.get(getattr(msg, "uid", -1))
        if res is None:
            return
        if isinstance(msg, DetokenizeMsg):
            if msg.next_token >= 0:
                res["token_ids"].append(msg.next_token)
            if msg.extra is not None:  # the usage comes with the first token (or an abort)
                res["cached_tokens"] = max(res["cached_tokens"], msg.extra.cached_tokens)
                if msg.extra.embedding:
                    res["embedding"] = msg.extra.embedding
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
        return self.generate([apply_chat_template(self._text, conv) for conv in convs], sampling_params)

    def embed(self, prompts: Prompts, dimensions: int | None = None) -> list[list[float]]:
        """The embedding of each prompt (text or token ids): the model's final hidden states pooled
        as its config says (last token, or mean), L2-normalised; `dimensions` truncates them first
        where the model allows it (Matryoshka). Prompts are prefilled together, nothing is sampled,
        and their KV is freed after. RequestRejected names a prompt that cannot be embedded."""
        from minisgl.models.pooling import embedding_vector, read_pooling

        if dimensions is not None:
            why = read_pooling(self.config.model_path).check_dimensions(dimensions)
            if why is not None:
                raise ValueError(why)
        token_lists = [self._tokenize(p) for p in _as_prompt_list(prompts)]
        params = SamplingParams(max_tokens=1, embed=True)
        for i, ids in enumerate(token_lists):
            self._check(i, ids, params)
        results = self._run(token_lists, [params] * len(token_lists))
        for i, res in enumerate(results):
            if "embedding" not in res:
                raise RequestRejected(f"prompt {i}: {res.get('error') or 'no embedding came back'}")
        return [embedding_vector(res["embedding"], dimensions).tolist() for res in results]

    def _abandon(self, uids: list[int]) -> None:
        """`generate` was interrupted (an error, Ctrl-C): stop what it left running."""
        if uids:
            self._submit([AbortBackendMsg(uid=u) for u in uids])

    # -- helpers ---------------------------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self._text.encode(prompt)) if prompt else []
        return list(prompt)

    def _check(self, i: int, ids: list[int], params: SamplingParams) -> None:
        try:
            check_request(ids, params, self.vocab_size, self.max_seq_len)
        except RequestRejected as e:
            raise RequestRejected(f"prompt {i}: {e}") from None

    def _run(self, token_lists: list[list[int]], params: list[SamplingParams]) -> list[dict[str, Any]]:
        uids: list[int] = []
        msgs: list[BaseBackendMsg] = []
        for ids, p in zip(token_lists, params, strict=True):
            uid, self._next_uid = self._next_uid, self._next_uid + 1
            self._results[uid] = {"token_ids": [], "finish_reason": None, "cached_tokens": 0}
            msgs.append(UserMsg(uid=uid, input_ids=torch.tensor(ids, dtype=torch.int32), sampling_params=p))
            uids.append(uid)
        self._submit(msgs)
        try:
            while any(self._results[u]["finish_reason"] is None for u in uids):
                self._advance()
        except BaseException:
            self._abandon([u for u in uids if self._results[u]["finish_reason"] is None])
            raise
        finally:
            results = [self._results.pop(u) for u in uids]
        for res, ids in zip(results, token_lists, strict=True):
            res["prompt_tokens"] = len(ids)
            res["text"] = self._text.decode(res["token_ids"], skip_special_tokens=True)
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


def check_options(options: dict[str, object]) -> None:
    """ValueError for an option that is not a SchedulerConfig field."""
    from minisgl.scheduler.config import SchedulerConfig

    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown LLM option(s) {unknown}; valid options: {sorted(known - {'tp_info'})}")


def pop_hub_options(options: dict[str, object]) -> HubOptions:
    """The Hugging Face id options (revision, download_dir, gguf_file) taken out of an LLM's options."""
    from minisgl.models.hub import HubOptions

    values = {name: options.pop(name, None) for name in ("revision", "download_dir", "gguf_file")}
    for name, value in values.items():
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return HubOptions(**values)  # type: ignore[arg-type]
