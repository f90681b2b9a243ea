"""Structured output: grammars (llguidance), one matcher per request, and token bitmasks.

A grammar travels in `SamplingParams.grammar` as llguidance's grammar text (JSON), made here from a
JSON schema or a Lark grammar and checked where the request arrives (`grammar_error`: the HTTP
layer's 400). The scheduler compiles it into a `Grammar` (a matcher) when it admits the request; a
grammar that does not compile there ends that request with an error reply. Each step the engine
asks the matchers of the rows that have one for a bitmask (one bit per token, computed on the CPU
once the forward pass is launched: on a GPU while it runs) and masks the logits on their device before sampling; after sampling,
the scheduler feeds each matcher its new token and ends the request ("stop") once the grammar is
complete. Every tensor-parallel rank runs the same matchers on the same tokens, so all compute the
same masks without communicating.

Like `core`, this module imports nothing else of minisgl (llguidance is imported when first needed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch, in the functions that take tensors: the API server checks grammars without it
    import torch
    from llguidance import LLMatcher, LLTokenizer

# Any JSON object: `response_format: {"type": "json_object"}`.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# Whitespace between JSON tokens: a space, or a newline and an indentation of up to 20 spaces.
# Unbounded whitespace (llguidance's default) lets a small model emit newlines until max_tokens;
# a schema's own "x-guidance" options override this.
JSON_WHITESPACE = r"(?:\n {0,20}| ?)"


class GrammarError(ValueError):
    """A grammar (or JSON schema) that llguidance cannot use; the message says why."""


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """llguidance's grammar text for a JSON schema (raises GrammarError if it is not valid)."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_pattern": JSON_WHITESPACE}
        )
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None
    check_grammar(grammar)
    return grammar


def lark_grammar(lark: str) -> str:
    """llguidance's grammar text for a Lark grammar (which may embed `%json {schema}`)."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_lark(lark)
    check_grammar(grammar)
    return grammar


def check_grammar(grammar: str) -> None:
    """Raise GrammarError unless `grammar` compiles (without a tokenizer: the model's does not matter)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)


class Grammar:
    """One request's matcher: which tokens may come next, fed the request's output as it grows."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0  # output tokens fed to the matcher so far

    def advance(self, output_ids: Sequence[int]) -> None:
        """Feed the tokens of `output_ids` not fed yet (a token the mask allowed is always accepted;
        one it did not, e.g. a forced EOS, puts the matcher in its error state, which stops it)."""
        for token in output_ids[self.consumed :]:
            self.matcher.consume_token(token)
        self.consumed = max(self.consumed, len(output_ids))

    @property
    def is_done(self) -> bool:
        """The grammar is complete (only EOS may follow) or broken: the request ends."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles grammars against the model's tokenizer, which is loaded with the first grammar (a
    server that never sees one never pays for it). `vocab_size` is the model's (the logits' width)."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer

            from minisgl.utils.hf import load_tokenizer

            hf = load_tokenizer(self.model_path)
            self._tokenizer = from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tokenizer

    def compile(self, grammar: str) -> Grammar:
        """A fresh matcher for `grammar`; GrammarError if it does not compile."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Grammar(matcher)

    def fill_masks(self, grammars: Sequence[Grammar]) -> torch.Tensor:
        """(G, ceil(V / 32)) int32 on the CPU: bit t of row i set iff token t may follow in grammar i.
        One row after the other in this thread: llguidance's thread pool would compete with torch's
        threads for the cores during a CPU forward pass."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        mask = allocate_token_bitmask(len(grammars), self.vocab_size)
        for i, g in enumerate(grammars):
            fill_next_token_bitmask(g.matcher, mask, i)
        return mask


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set to -inf, in place, the logits (B, V) at the tokens the mask (G, W) int32 (on the logits'
    device) does not allow: mask row i is for logits row rows[i] (rows None: G == B, in order)."""
    import torch

    vocab = logits.shape[1]
    bits = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32, device=mask.device)
    forbidden = (torch.bitwise_and(mask.unsqueeze(-1), bits) == 0).view(mask.shape[0], -1)[:, :vocab]
    if rows is None:
        logits.masked_fill_(forbidden, float("-inf"))
        return
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(forbidden, float("-inf")))
