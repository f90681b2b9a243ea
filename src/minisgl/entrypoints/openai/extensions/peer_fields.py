"""vLLM's and SGLang's request fields beyond OpenAI's: what minisgl does with each.

Clients written for vLLM or SGLang send their engine's extra fields (`guided_json`, `top_k`,
`skip_special_tokens`, `regex`, ...). Each field either engine documents for chat and completions
is here or declared on the request models, and is one of:
- honoured: a field of the request models (`protocol.py`; the structured-output ones in
  `structured.py`), e.g. `guided_choice`, `structured_outputs`, `include_stop_str_in_output`;
- refused with a 400 naming it, unless absent or at its "off" value (`REFUSED`, with the reason);
- accepted without effect because it cannot change the output (`NO_EFFECT`: a routing or metrics
  label, a choice between equivalent backends).
A field no engine knows is accepted, as vLLM does, and logged once per name (a typo shows up in the
log rather than silently). tests/entrypoints/test_peer_fields.py walks both engines' documented lists.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger("minisgl.server")


@dataclass(frozen=True)
class Refusal:
    """A field refused unless it is absent or one of `off` (same type: `0` is not `False`)."""

    off: tuple[object, ...]
    why: str

    def allows(self, value: object) -> bool:
        return any(value == o and type(value) is type(o) for o in self.off)


_NONE: tuple[object, ...] = (None,)
_FALSE: tuple[object, ...] = (None, False)
_EMPTY: tuple[object, ...] = (None, [], {})

# Refused on both endpoints unless off.
REFUSED: dict[str, Refusal] = {
    # sampling this engine does not have
    "use_beam_search": Refusal(_FALSE, "beam search is not implemented"),
    "length_penalty": Refusal((None, 1.0, 1), "it is a beam-search parameter"),
    "early_stopping": Refusal(_FALSE, "it is a beam-search parameter"),
    "min_p": Refusal((None, 0.0, 0), "min-p sampling is not implemented"),
    "allowed_token_ids": Refusal(_EMPTY, "use logit_bias"),
    "bad_words": Refusal(_EMPTY, "use logit_bias"),
    "watermarking": Refusal(_FALSE, "not implemented"),
    "thinking_token_budget": Refusal(_NONE, "not implemented"),
    "repetition_detection": Refusal(_NONE, "not implemented"),
    "logits_processors": Refusal(_EMPTY, "custom logits processors are not loaded by this server"),
    "custom_logit_processor": Refusal(_EMPTY, "custom logits processors are not loaded by this server"),
    "custom_params": Refusal(_EMPTY, "custom logits processors are not loaded by this server"),
    "stop_regex": Refusal(_EMPTY, "use stop strings"),
    "structural_tag": Refusal(_NONE, "structural tags are not implemented (use tools or a schema)"),
    # the detokenizer's settings (one per server)
    "skip_special_tokens": Refusal((None, True), "special tokens are always skipped in the output"),
    "spaces_between_special_tokens": Refusal((None, True), "special tokens are always skipped"),
    # the prompt
    "truncate_prompt_tokens": Refusal(_NONE, "prompts are never truncated: a long one is refused"),
    "truncation_side": Refusal(_NONE, "prompts are never truncated"),
    "prompt_embeds": Refusal(_NONE, "prompts are text or token ids"),
    "input_ids": Refusal(_NONE, "send token ids as a completion's prompt"),
    "mm_processor_kwargs": Refusal(_EMPTY, "the server serves text models"),
    "media_io_kwargs": Refusal(_EMPTY, "the server serves text models"),
    "images_config": Refusal(_EMPTY, "the server serves text models"),
    "max_dynamic_patch": Refusal(_NONE, "the server serves text models"),
    "min_dynamic_patch": Refusal(_NONE, "the server serves text models"),
    "use_audio_in_video": Refusal(_FALSE, "the server serves text models"),
    "task": Refusal(_NONE, "DeepSeek-V4 quick instructions are not implemented"),
    # what the answer returns besides the text
    "prompt_logprobs": Refusal(_NONE, "use a completion with echo and logprobs"),
    "logprob_token_ids": Refusal(_NONE, "use top_logprobs"),
    "return_tokens_as_token_ids": Refusal(_FALSE, "logprobs name tokens by their text and bytes"),
    "return_token_offsets": Refusal(_FALSE, "not implemented"),
    "return_prompt_text": Refusal(_FALSE, "not implemented"),
    "return_hidden_states": Refusal(_FALSE, "not implemented"),
    "return_routed_experts": Refusal(_FALSE, "not implemented"),
    "routed_experts_start_len": Refusal((None, 0), "not implemented"),
    "routed_experts_prompt_start": Refusal((None, 0), "not implemented"),
    "return_cached_tokens_details": Refusal(_FALSE, "usage has prompt_tokens_details.cached_tokens"),
    "return_meta_info": Refusal(_FALSE, "not implemented"),
    # scheduling, caching and serving features this server does not have
    "priority": Refusal((None, 0), "requests are served first come, first served"),
    "cache_salt": Refusal(_NONE, "the prefix cache is not salted per request"),
    "lora_path": Refusal(_NONE, "LoRA adapters are not implemented"),
    "session_id": Refusal(_NONE, "sessions are not implemented"),
    "session_params": Refusal(_NONE, "sessions are not implemented"),
    "ngram_corpus_id": Refusal(_NONE, "n-gram speculative decoding is not implemented"),
    "kv_transfer_params": Refusal(_EMPTY, "disaggregated serving is not implemented"),
    "ec_transfer_params": Refusal(_EMPTY, "disaggregated serving is not implemented"),
    "bootstrap_host": Refusal(_NONE, "disaggregated serving is not implemented"),
    "bootstrap_port": Refusal(_NONE, "disaggregated serving is not implemented"),
    "bootstrap_room": Refusal(_NONE, "disaggregated serving is not implemented"),
    "disagg_prefill_dp_rank": Refusal(_NONE, "disaggregated serving is not implemented"),
    "routed_dp_rank": Refusal(_NONE, "the server routes requests to --dp replicas itself"),
    "data_parallel_rank": Refusal(_NONE, "the server routes requests to --dp replicas itself"),
    "vllm_xargs": Refusal(_EMPTY, "no extensions are loaded"),
}

# Accepted on both endpoints without effect: they cannot change the output.
NO_EFFECT = frozenset(
    {
        "guided_decoding_backend",  # one grammar engine (llguidance): every backend's constraint is the same
        "stream_interval",  # how tokens are grouped into chunks, not which
        "return_mm_kwargs",  # vLLM's render endpoints only
        "extra_key",  # SGLang's caller-defined classification label
        "custom_labels",  # SGLang's metric labels
    }
)

# Off values that differ by endpoint: a chat prompt gets its special tokens from the template.
ENDPOINT_REFUSED: dict[str, dict[str, Refusal]] = {
    "chat": {
        "add_special_tokens": Refusal(
            _FALSE, "the chat template adds the special tokens; send a completion for raw prompts"
        )
    },
    "completions": {
        "add_special_tokens": Refusal(
            (None, True), "a text prompt is encoded with the tokenizer's special tokens"
        )
    },
}

_logged: set[str] = set()
_MAX_LOGGED = 256  # names logged at most (a client choosing names must not grow this without end)


def check_peer_fields(data: dict[str, object], endpoint: str, declared: Iterable[str]) -> None:
    """Raise ValueError naming the first refused field of a request body that asks for it; log
    once each field that neither OpenAI, vLLM nor SGLang defines (`declared`: the model's fields)."""
    local = ENDPOINT_REFUSED.get(endpoint, {})
    known = set(declared)
    for name, value in data.items():
        refusal = local.get(name) or REFUSED.get(name)
        if refusal is not None:
            if not refusal.allows(value):
                raise ValueError(f"{name} is not supported by this server ({refusal.why})")
        elif (
            name not in known and name not in NO_EFFECT and name not in _logged and len(_logged) < _MAX_LOGGED
        ):
            _logged.add(name)
            logger.warning("request field %r is not known to this server: accepted without effect", name[:64])
