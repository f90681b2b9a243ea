"""Incremental detokenizing: token ids in, text deltas out, never a broken character.

Decoding each new token on its own is wrong twice over: a byte-level BPE token may hold half of a
UTF-8 character (Chinese, emoji), and a SentencePiece token's leading space depends on its
neighbours. So each request keeps two offsets into its ids (the prefix/read offset trick):

    prefix = decode(ids[prefix_offset:read_offset])   # text already emitted, with a little context
    full   = decode(ids[prefix_offset:])
    delta  = full[len(prefix):]                       # emitted unless it ends in U+FFFD

Text ending in U+FFFD is an unfinished character: it is held back (the window grows) until the next
token completes it. When the request finishes, whatever is held back is emitted, so the concatenated
deltas equal `decode(all_ids)` exactly. Special tokens (EOS, ...) are skipped like the full decode
with `skip_special_tokens=True` skips them, so their text never reaches the client.

One known inexactness: with byte-fallback tokenizers (Llama 2 style `<0xNN>` tokens) an *invalid*
run of byte tokens renders one U+FFFD per token, grouped by the window rather than by the whole
sequence, so the number of U+FFFD may differ from the full decode. Valid text is always exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from minisgl.message import (
    DetokenizeExtra,
    DetokenizeMsg,
    ErrorMsg,
    ReplyReasoning,
    UserReply,
    UserReplyExtra,
)
from minisgl.utils.hf import decode_text

from .token_bytes import token_bytes_fn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def fast_decoder(tokenizer: PreTrainedTokenizerBase) -> Decoder:
    """The Rust tokenizer behind a Hugging Face fast tokenizer when its `decode` gives the same text
    (no Python-side clean-up of spaces): about 4x less time per call. Else the tokenizer itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return _TextDecoder(tokenizer)


@dataclass(frozen=True)
class _TextDecoder:
    """A Hugging Face tokenizer as a `Decoder` (its `decode` of a list of ids is one text)."""

    tokenizer: PreTrainedTokenizerBase

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return decode_text(self.tokenizer, ids, skip_special_tokens)


@dataclass
class IncrementalDetokenizer:
    """The output text of one request, one token at a time."""

    tokenizer: Decoder
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def step(self, token_id: int) -> str:
        """Add one token; return the new text that is complete (possibly "")."""
        self.ids.append(token_id)
        return self._delta(final=False)

    def finish(self) -> str:
        """Emit whatever is still held back (a request may end in the middle of a character)."""
        if self.read_offset == len(self.ids):
            return ""
        return self._delta(final=True)


class DetokenizeManager:
    """Detokenizer state of every request in flight: DetokenizeMsg/ErrorMsg in, UserReply out.

    Each reply carries the request's completion token count so far, so the API server knows the
    usage at any point (also when it stops a request early on a stop string)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = fast_decoder(tokenizer)
        self.token_bytes = token_bytes_fn(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.states: dict[int, IncrementalDetokenizer] = {}

    def __len__(self) -> int:
        return len(self.states)

    def _state(self, uid: int) -> IncrementalDetokenizer:
        state = self.states.get(uid)
        if state is None:
            state = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
            self.states[uid] = state
        return state

    def detokenize(self, msg: DetokenizeMsg) -> UserReply:
        state = self._state(msg.uid)
        # A negative id is no token (e.g. the reply that only says "aborted").
        text = state.step(int(msg.next_token)) if msg.next_token >= 0 else ""
        if msg.finished:
            text += state.finish()
            del self.states[msg.uid]
        return UserReply(
            uid=msg.uid,
            incremental_output=text,
            finished=bool(msg.finished),
            finish_reason=msg.finish_reason if msg.finished else "",
            completion_tokens=len(state.ids),
            extra=None if msg.extra is None else self._extra(msg.next_token, msg.extra),
        )

    def _extra(self, token: int, x: DetokenizeExtra) -> UserReplyExtra:
        """The rare fields of a token's message -> those of its reply (token ids -> their bytes)."""
        tb = self.token_bytes
        out = UserReplyExtra(
            cached_tokens=x.cached_tokens,
            stop_token_id=x.stop_token_id,
            embedding=x.embedding,
            reasoning=ReplyReasoning(tokens=x.reasoning_tokens) if x.reasoning_tokens else None,
        )
        if x.return_token and token >= 0:
            out.token_ids = [token]
        if x.logprob is not None and token >= 0:
            out.lp_tokens = [tb(token)]
            out.lp_values = [x.logprob]
            out.lp_top_tokens = [[tb(t) for t in x.top_ids]]
            out.lp_top_values = [list(x.top_logprobs)]
        if x.prompt_ids:
            out.prompt_lp_tokens = [tb(t) for t in x.prompt_ids]
            out.prompt_lp_values = list(x.prompt_logprobs)
            out.prompt_lp_top_tokens = [[tb(t) for t in row] for row in x.prompt_top_ids]
            out.prompt_lp_top_values = [list(row) for row in x.prompt_top_logprobs]
        return out

    def reject(self, msg: ErrorMsg) -> UserReply:
        state = self.states.pop(msg.uid, None)
        return UserReply(
            uid=msg.uid,
            incremental_output=state.finish() if state else "",
            finished=True,
            finish_reason="error",
            completion_tokens=len(state.ids) if state else 0,
            error=msg.message,
        )
