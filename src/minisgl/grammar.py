"""Structured output: grammars (llguidance), one matcher per request, and token bitmasks.

A grammar travels in `SamplingParams.grammar` as llguidance's grammar text (JSON), made here from a
JSON schema or a Lark grammar. Making the text is cheap; compiling it is not (the cost grows faster
than the schema: seconds for a few thousand optional properties), so it never happens where a
request arrives. The HTTP layer checks a schema's size and shape only (`check_schema`: linear, with
limits, a 400 naming the field); the scheduler compiles grammars on the `GrammarCompiler`'s worker
threads (llguidance drops the GIL while it compiles), while its step goes on. Compiled grammars are
cached by their text (the `n` choices of a request, and a schema sent again, compile once; each
request gets a copy of the compiled matcher), and a compile is checked by computing its first
bitmask, so a grammar that cannot be followed from its start is refused before any token.

Each step the engine asks the matchers of the rows that have one for a bitmask (one bit per token,
computed on the CPU once the forward pass is launched: on a GPU while it runs) and masks the logits
on their device before sampling; after sampling, the scheduler feeds each matcher its new token and
ends the request ("stop") once the grammar is complete, or with an error when the matcher fails
(llguidance's limits on the work of one step, `PARSER_LIMITS`, were reached). Every
tensor-parallel rank runs the same matchers on the same tokens, so all compute the same masks
without communicating.

This module imports only `core` of minisgl (llguidance is imported when first needed).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from minisgl.core import reasoning_end

if TYPE_CHECKING:  # torch, in the functions that take tensors: the API server checks grammars without it
    import torch
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer
    from llguidance._lib import JsonCompileOptions

# Any JSON object: `response_format: {"type": "json_object"}`.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# Whitespace between JSON tokens: a space, or a newline and an indentation of up to 20 spaces.
# Unbounded whitespace (llguidance's default) lets a small model emit newlines until max_tokens;
# a schema's own "x-guidance" options override this.
JSON_WHITESPACE = r"(?:\n {0,20}| ?)"
# What a refusal of the scheduler starts with when the grammar is at fault (the API server names
# the request field the grammar came from).
GRAMMAR_REFUSED = "the grammar cannot be used"
# Longest error text passed on (llguidance's can hold the grammar, parser state or a backtrace).
_MAX_ERROR_CHARS = 300


class GrammarError(ValueError):
    """A grammar (or JSON schema) that llguidance cannot use; the message says why."""


@dataclass(frozen=True)
class SchemaLimits:
    """What the HTTP layer lets through to the compiler: bounds on a JSON schema's size and shape
    that keep its compile time in seconds, checked in one linear walk."""

    max_bytes: int = 128 * 1024  # its JSON text
    max_nodes: int = 20_000  # objects, arrays and values in it
    max_depth: int = 64  # nesting of objects and arrays


SCHEMA_LIMITS = SchemaLimits()
# Keywords whose values must be schemas, lists of schemas, or maps of names to schemas.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})


def check_schema(schema: object, limits: SchemaLimits = SCHEMA_LIMITS) -> None:
    """Raise GrammarError unless `schema` is a JSON schema (an object or a boolean) within `limits`
    whose keywords have the right kinds of value. Cheap: what llguidance alone can tell (regexes,
    references, formats) is found when the scheduler compiles it."""
    size = len(json.dumps(schema, ensure_ascii=False))
    if size > limits.max_bytes:
        raise GrammarError(f"the schema is too large ({size} bytes; at most {limits.max_bytes})")
    nodes = 0
    stack: list[tuple[object, int, str]] = [(schema, 0, "")]
    while stack:
        node, depth, where = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise GrammarError(f"the schema has too many parts (at most {limits.max_nodes})")
        if depth > limits.max_depth:
            raise GrammarError(f"the schema nests too deeply (at most {limits.max_depth} levels)")
        if not isinstance(node, (dict, bool)):
            raise GrammarError(f"{where or 'the schema'} must be a JSON object or a boolean")
        if isinstance(node, dict):
            _check_keywords(node, where)
            stack.extend(_subschemas(node, depth, where))


def _check_keywords(node: dict[str, Any], where: str) -> None:
    at = f" (at {where})" if where else ""
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in _TYPES for k in kinds):
        raise GrammarError(f"invalid type {kind!r}{at}: one of {sorted(_TYPES)} or a list of them")
    for key in ("pattern", "format", "$ref"):
        if key in node and not isinstance(node[key], str):
            raise GrammarError(f"{key} must be a string{at}")
    if "required" in node and not (
        isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])
    ):
        raise GrammarError(f"required must be a list of property names{at}")
    if "enum" in node and not isinstance(node["enum"], list):
        raise GrammarError(f"enum must be a list{at}")


def _subschemas(node: dict[str, Any], depth: int, where: str) -> list[tuple[object, int, str]]:
    """The schemas inside `node`, each with its depth and where it is (a JSON pointer)."""
    out: list[tuple[object, int, str]] = []
    for key in _SUBSCHEMA:
        if key in node and not (key == "items" and isinstance(node[key], list)):
            out.append((node[key], depth + 1, f"{where}/{key}"))
    for key in (*_SUBSCHEMA_LISTS, "items"):
        if isinstance(node.get(key), list):
            out += [(s, depth + 2, f"{where}/{key}/{i}") for i, s in enumerate(node[key])]
        elif key != "items" and key in node:
            raise GrammarError(f"{key} must be a list of schemas (at {where or '/'})")
    for key in _SUBSCHEMA_MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                raise GrammarError(f"{key} must be an object of schemas (at {where or '/'})")
            out += [(s, depth + 2, f"{where}/{key}/{name}") for name, s in node[key].items()]
    return out


def json_schema_grammar(
    schema: dict[str, Any] | bool, check: bool = True, whitespace: str | None = JSON_WHITESPACE
) -> str:
    """llguidance's grammar text for a JSON schema. `check`: compile it once to be sure it is valid
    (GrammarError if not; this can take seconds for a large schema). The server passes False: its
    scheduler compiles the grammar off the hot paths and refuses it there. `whitespace`: the regex
    of the whitespace allowed between JSON tokens (None: none at all)."""
    from llguidance import LLMatcher

    options: JsonCompileOptions = (
        {"whitespace_flexible": False} if whitespace is None else {"whitespace_pattern": whitespace}
    )
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    except (ValueError, TypeError) as e:
        raise GrammarError(short_error(str(e))) from None
    if check:
        check_grammar(grammar)
    return grammar


def lark_grammar(lark: str, check: bool = True) -> str:
    """llguidance's grammar text for a Lark grammar (which may embed `%json {schema}`)."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_lark(lark)
    if check:
        check_grammar(grammar)
    return grammar


def text_grammar(kind: Literal["regex", "choice", "grammar"], text: str | list[str]) -> str:
    """llguidance's grammar text for a regex (Rust syntax), a list of choices (the output is one of
    them, exactly), or a context-free grammar in Lark or GBNF syntax (llama.cpp's, which vLLM's
    xgrammar and SGLang's `ebnf` take). Cheap and unchecked: the scheduler compiles it."""
    from llguidance import grammar_from

    try:
        return grammar_from(kind, text)  # type: ignore[arg-type]  # "choice" takes the list as is
    except ValueError as e:
        raise GrammarError(short_error(str(e))) from None


def check_grammar(grammar: str) -> None:
    """Raise GrammarError unless `grammar` compiles (without a tokenizer: the model's does not matter)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise GrammarError(short_error(error))


def parser_limits() -> LLParserLimits:
    """llguidance's limits on the work of one compile and one step. A row of up to 20,000 items lets
    objects of a few thousand optional properties be followed (llguidance's 2,000 stopped at ~500);
    the per-step limits stay llguidance's, bounding what one grammar row adds to a step. Errors
    are short (no parser state or grammar in them)."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_items_in_row=20_000, verbose_errors=False)


def short_error(text: str) -> str:
    """The first line of an error of llguidance, without backtrace or parser state, cut short."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()] or ["unknown error"]
    line = lines[0]
    if "panicked at" in line:  # a Rust panic: the message is on the next line, the location is internal
        line = "the grammar library failed: " + (lines[1] if len(lines) > 1 else "internal error")
    for marker in (" at src/", " at /", "stack backtrace", "<state>", "<non-verbose/>"):
        line = line.split(marker)[0]
    line = line.strip() or "unknown error"
    return line if len(line) <= _MAX_ERROR_CHARS else line[: _MAX_ERROR_CHARS - 3] + "..."


class Grammar:
    """One request's matcher: which tokens may come next, fed the request's output as it grows.

    A reasoning model's output (`reasoning`: the request's reasoning start and end token ids, see
    SamplingParams) thinks freely first: the grammar begins after the reasoning's end token, so
    the matcher is fed, and masks the logits, only from there on. Where the reasoning is optional,
    the first token may be the grammar's or the reasoning's start token (`extra_token`)."""

    def __init__(self, matcher: LLMatcher, reasoning: tuple[int, int] = (-1, -1)) -> None:
        self.matcher = matcher
        self.consumed = 0  # output tokens fed to the matcher so far
        self.start_id, self.end_id = reasoning
        self.start = 0 if self.end_id < 0 else -1  # output index the grammar begins at (-1: not yet)
        self._scanned = 0  # output tokens looked at for the reasoning's end

    def advance(self, output_ids: Sequence[int]) -> None:
        """Feed the tokens of `output_ids` not fed yet (a token the mask allowed is always accepted;
        one it did not, e.g. a forced EOS, puts the matcher in its error state, which stops it)."""
        if self.start < 0:
            end = reasoning_end(output_ids, self.start_id, self.end_id, self._scanned)
            self._scanned = len(output_ids)
            if end is None:
                return
            self.start = self.consumed = end
        for token in output_ids[self.consumed :]:
            self.matcher.consume_token(token)
        self.consumed = max(self.consumed, len(output_ids))

    @property
    def constrains(self) -> bool:
        """Whether the next token is held to the grammar (not while the output reasons)."""
        return self.start >= 0 or self.extra_token >= 0

    @property
    def extra_token(self) -> int:
        """A token allowed next besides the grammar's (-1: none): an optional reasoning's start,
        at the output's first token."""
        return self.start_id if self.start < 0 and self.start_id >= 0 and self._scanned == 0 else -1

    @property
    def is_done(self) -> bool:
        """The grammar is complete (only EOS may follow) or broken: the request ends."""
        return self.start >= 0 and (self.matcher.is_stopped() or self.matcher.is_error())

    @property
    def error(self) -> str:
        """Why the matcher failed ("" if it did not), short."""
        return short_error(self.matcher.get_error()) if self.matcher.is_error() else ""


class GrammarCompiler:
    """Compiles grammars against the model's tokenizer on worker threads, and computes bitmasks.

    `submit` returns a future of the compiled grammar, shared by every request with the same text
    (a bounded LRU cache of `cache_size` grammars); `matcher` makes a request's own matcher from a
    done future. The tokenizer is loaded on a worker with the first grammar (a server that never
    sees one never pays for it). `vocab_size` is the model's (the logits' width)."""

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        workers: int | None = None,
        cache_size: int = 64,
    ) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.num_compiles = 0  # grammars compiled so far (the cache's misses)
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # One thread on a small machine (a compile takes a core from the forward pass), else two.
        self._workers = workers or (1 if (os.cpu_count() or 1) <= 4 else 2)
        self._cache: OrderedDict[str, Future[LLMatcher]] = OrderedDict()

    @property
    def tokenizer(self) -> LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from llguidance.hf import from_tokenizer

                from minisgl.utils.hf import load_tokenizer

                hf = load_tokenizer(self.model_path)
                self._tokenizer = from_tokenizer(
                    hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._tokenizer

    def submit(self, grammar: str) -> Future[LLMatcher]:
        """The compile of `grammar`, started now unless cached (called from one thread only)."""
        future = self._cache.get(grammar)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="grammar")
            future = self._pool.submit(self._compile, grammar)
            self.num_compiles += 1
            self._cache[grammar] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # a request still waiting holds its own future
        self._cache.move_to_end(grammar)
        return future

    @staticmethod
    def matcher(future: Future[LLMatcher], reasoning: tuple[int, int] = (-1, -1)) -> Grammar:
        """A fresh matcher from a done compile; GrammarError if the grammar did not compile."""
        return Grammar(future.result().deep_copy(), reasoning)

    def compile(self, grammar: str, reasoning: tuple[int, int] = (-1, -1)) -> Grammar:
        """A fresh matcher for `grammar`, waiting for its compile; GrammarError if it does not compile."""
        return self.matcher(self.submit(grammar), reasoning)

    def _compile(self, grammar: str) -> LLMatcher:
        """On a worker: the compiled matcher, checked by computing its first bitmask."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        if not matcher.is_error():
            self.fill_masks([Grammar(matcher)])
        if matcher.is_error():
            raise GrammarError(short_error(matcher.get_error()))
        return matcher

    def fill_masks(self, grammars: Sequence[Grammar]) -> torch.Tensor:
        """(G, ceil(V / 32)) int32 on the CPU: bit t of row i set iff token t may follow in grammar i.
        One row after the other in this thread: llguidance's thread pool would compete with torch's
        threads for the cores during a CPU forward pass."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        mask = allocate_token_bitmask(len(grammars), self.vocab_size)
        for i, g in enumerate(grammars):
            fill_next_token_bitmask(g.matcher, mask, i)
            if g.extra_token >= 0:
                allow_token(mask, i, g.extra_token)
        return mask

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def allow_token(mask: torch.Tensor, row: int, token: int) -> None:
    """Set, in place, token `token`'s bit in row `row` of a (G, W) int32 bitmask."""
    word, bit = divmod(token, 32)
    value = int(mask[row, word]) | (1 << bit)
    mask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # as an int32


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
