"""Helpers shared by the model tests (no tests here): a contiguous causal attention backend that
stands in for the runtime's paged one, and tiny random Hugging Face checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from minisgl.core import AttentionBackendProto, Context, set_global_ctx


class ContiguousCausalAttention(AttentionBackendProto):
    """Causal attention over a flattened batch of whole prompts (no cache): segment i is rows
    [sum(lens[:i]), sum(lens[:i+1])). Grouped-query heads are expanded as HF does."""

    def __init__(self, seq_lens: Sequence[int]) -> None:
        self.seq_lens = list(seq_lens)
        self.calls: list[int] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.calls.append(layer_id)
        assert q.shape[0] == k.shape[0] == v.shape[0] == sum(self.seq_lens)
        assert k.shape == v.shape and q.shape[2] == k.shape[2]
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()  # the documented interface
        group = q.shape[1] // k.shape[1]
        outs, start = [], 0
        for n in self.seq_lens:
            qs = q[start : start + n].transpose(0, 1)  # (Hq, n, D)
            ks = k[start : start + n].repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v[start : start + n].repeat_interleave(group, dim=1).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
            start += n
        return torch.cat(outs)  # (T, Hq, D)


def run_prompts(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """All-position float32 logits of each prompt, the prompts run together as one flattened batch."""
    lens = [len(p) for p in prompts]
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    backend = ContiguousCausalAttention(lens)
    set_global_ctx(Context(attn_backend=backend))
    try:
        hidden = model(ids, pos)  # (T, hidden)
        logits = model.compute_logits(hidden)  # (T, vocab)
    finally:
        set_global_ctx(None)
    assert backend.calls == list(range(model.config.num_layers))
    return list(logits.split(lens))


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Perturb every parameter (norms around 1, biases and matrices random) so no path is trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.05 * noise)


def save_tiny_hf_model(arch: str, out: Path, tie: bool, vocab: int = 131, **overrides) -> Path:
    """A tiny random HF checkpoint of `arch` (safetensors) written to `out`; returns `out`."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, arch)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**common)).float().eval()
    randomize_(model)
    if tie:
        model.tie_weights()
    model.save_pretrained(str(out))
    save_tiny_tokenizer(out, vocab)
    return out


def save_tiny_tokenizer(out: Path, vocab: int) -> None:
    """A character-level tokenizer (ids: <unk> 0, <s> 1, </s> 2, newline 3, printable ASCII from 4) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>", "\n"] + [chr(c) for c in range(32, 127)]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens[:vocab])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    fast.chat_template += "{% if add_generation_prompt %}assistant: {% endif %}"
    fast.save_pretrained(str(out))


def save_byte_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer without merges (ids 0-255 the bytes in GPT-2's byte-to-character
    table, 256 </s>, 257 <s>, then fillers up to `vocab`): the kind grammar libraries read (llguidance
    cannot read the character-level tokenizer's decoder). Pair it with eos_token_id=256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tokens = [table[b] for b in range(256)] + ["</s>", "<s>"]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(out))
