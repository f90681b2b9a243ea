"""A lower bound on a text's token count from its length alone, so that a prompt far too long for the
context is refused without being tokenized (tokenizing a megabyte takes the worker about a second).

The bound must never exceed the true count, or a valid request would be refused. It holds for a
tokenizer whose tokens together cover every byte of the text it tokenizes:

    tokens(text) >= ceil(bytes(normalized text, less the bytes it may drop) / L)

where L is the most bytes of normalized text one token can stand for. That is the case for a BPE
model that cannot drop a character unnoticed: a byte-level alphabet (a byte whose character is not
in the vocabulary vanishes: SmolLM2 lacks 21 of the 256, control characters among them, so those
bytes are not counted), or byte fallback with all 256 byte tokens; behind normalizers and
pre-tokenizers that never shorten the text beyond what we measure: we run the tokenizer's own
normalizer (fast, no BPE) and measure its output; pre-tokenizers may only split or grow it. Anything
else — a Unigram or WordPiece model, a pre-tokenizer that removes whitespace, a
`Strip` normalizer, added tokens that swallow neighbouring spaces (lstrip/rstrip), truncation set in
the tokenizer — gets no bound (`LengthBound.of` returns None) and every prompt is tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Normalizers whose output, measured on the whole text, is never longer than on the pieces the
# tokenizer actually normalizes (the text between special tokens): per-character mappings, Unicode
# (de)composition, one prefix.
_SAFE_NORMALIZERS = {
    "NFC",
    "NFD",
    "NFKC",
    "NFKD",
    "Lowercase",
    "Prepend",
    "StripAccents",
    "Nmt",
    "ByteLevel",
    "Replace",
}
# Pre-tokenizers that only split (keeping every character) or map characters to longer ones.
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


@dataclass(frozen=True)
class LengthBound:
    """`min_tokens(text)`: a count the tokenizer's result for `text` never falls below."""

    max_token_bytes: int  # L: the most normalized-text bytes one token stands for
    normalize: Callable[[str], str] | None  # the tokenizer's own normalizer, if it has one
    dropped: bytes = b""  # byte values the tokenizer may silently drop (not counted)

    def min_tokens(self, text: str) -> int:
        if self.normalize is not None:
            text = self.normalize(text)
        data = _utf8(text)
        if self.dropped:
            data = data.translate(None, self.dropped)
        return -(-len(data) // self.max_token_bytes)

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> LengthBound | None:
        """The bound for a transformers fast tokenizer, or None where it cannot be proven."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        if not _covers_every_byte(spec):
            return None
        byte_level = _uses(spec.get("pre_tokenizer"), "ByteLevel") or _uses(
            spec.get("normalizer"), "ByteLevel"
        )
        vocab = spec["model"].get("vocab") or {}
        if not byte_level and not all(f"<0x{b:02X}>" in vocab for b in range(256)):
            return None  # byte fallback without all its byte tokens: a character could vanish
        # A byte-level token's characters are bytes one for one; any other token is a piece of the
        # (pre-tokenized) text itself, or a byte-fallback "<0x41>" that stands for fewer bytes.
        sizes = [len(t) if byte_level else len(_utf8(t)) for t in vocab]
        norm = backend.normalizer
        normalize = None if norm is None else norm.normalize_str
        for added in spec.get("added_tokens") or []:  # matched in the raw text; we measure it normalized
            content = added["content"]
            sizes += [len(_utf8(content)), len(_utf8(normalize(content) if normalize else content))]
        if not sizes:
            return None
        dropped = _unknown_bytes(vocab) if byte_level else b""
        return cls(max(max(sizes), 1), normalize, dropped)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _unknown_bytes(vocab: dict[str, int]) -> bytes:
    """The bytes whose byte-level character is not in the vocabulary: BPE drops them (or, with an
    unknown token, may fuse a run of them into one token)."""

    chars = _byte_level_chars()
    return bytes(b for b in range(256) if chars[b] not in vocab)


def _byte_level_chars() -> list[str]:
    """GPT-2's byte-to-character table (what the ByteLevel pre-tokenizer maps byte b to)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def _covers_every_byte(spec: dict[str, Any]) -> bool:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation") is not None:
        return False
    if any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens") or []):
        return False
    pre = spec.get("pre_tokenizer")
    if not (model.get("byte_fallback") or _uses(pre, "ByteLevel")):
        return False  # an unknown character would become an unknown token, or nothing
    return _all_safe(spec.get("normalizer"), _SAFE_NORMALIZERS, _safe_normalizer) and _all_safe(
        pre, _SAFE_PRE_TOKENIZERS, _safe_pre_tokenizer
    )


def _parts(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The components of a (possibly nested) Sequence, or the node itself."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        inner = node.get("normalizers") or node.get("pretokenizers") or []
        return [p for n in inner for p in _parts(n)]
    return [node]


def _uses(node: dict[str, Any] | None, kind: str) -> bool:
    return any(p.get("type") == kind for p in _parts(node))


def _all_safe(node: dict[str, Any] | None, safe: set[str], check: Callable[[dict[str, Any]], bool]) -> bool:
    return all(p.get("type") in safe and check(p) for p in _parts(node))


def _safe_normalizer(node: dict[str, Any]) -> bool:
    """A Replace is per character only with a one-character plain pattern (a longer one or a regex
    could match across a special token's edge differently on the whole text)."""
    return node.get("type") != "Replace" or len((node.get("pattern") or {}).get("String") or "") == 1


def _safe_pre_tokenizer(node: dict[str, Any]) -> bool:
    return str(node.get("behavior", "Isolated")).lower() != "removed"
