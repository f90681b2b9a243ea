"""CUDA graphs for decode steps: one graph per padded batch size, captured when the engine starts.

A decode step of B requests replays the graph of the smallest captured size >= B. Its inputs (token
ids, positions) and the attention backend's metadata live in buffers whose addresses never change;
the replay writes nothing else and allocates nothing. Padding rows compute garbage that nobody reads
(the attention backend gives them length 0 and no KV slot). The graph covers the whole forward
pass, the LM head and the greedy choice: it outputs the (B, vocab) logits in the head's dtype (bf16
for a bf16 model: no float32 copy is written) and their argmax per row, which an all-greedy batch
takes as its tokens (other batches sample the logits, cast to float32 outside the graph).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from minisgl.attention import AttentionBackend, AttnInput
from minisgl.kernels.triton import triton_available

logger = logging.getLogger(__name__)

# The graph's greedy argmax in minisgl's Triton kernels (on a GPU): at batch 256 of the 8B shapes torch's
# chunked reductions took ~70 us a step. MINISGL_TRITON_ARGMAX=0: torch's (A/B).
TRITON_ARGMAX = os.environ.get("MINISGL_TRITON_ARGMAX", "1") not in ("", "0")

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids (B,), positions (B,)) -> logits


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) int64 first index of each row's maximum, as `argmax(-1)`, in two passes
    over chunks of the vocabulary (one row of 100k+ entries is otherwise a single slow reduction); on
    a GPU minisgl's Triton kernels (`kernels.triton.argmax`; MINISGL_TRITON_ARGMAX=0: torch's)."""
    b, v = logits.shape
    if logits.is_cuda and TRITON_ARGMAX and triton_available() and logits.stride(1) == 1 and v:
        from minisgl.kernels.triton.argmax import argmax_rows as triton_argmax_rows

        return triton_argmax_rows(logits)
    chunks = 256
    while chunks > 1 and v % chunks:
        chunks //= 2
    if chunks == 1:
        return logits.argmax(dim=-1)
    best, idx = logits.view(b, chunks, v // chunks).max(dim=-1)  # (B, C) each chunk's first maximum
    c = best.argmax(dim=-1, keepdim=True)  # (B, 1) the first chunk holding the row's maximum
    return (c * (v // chunks) + idx.gather(1, c)).squeeze(1)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The captured sizes: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 256, 16)) + list(range(256, max_bs + 32, 32))
    out = sorted({s for s in sizes if s < max_bs} | {max_bs})
    return out if max_bs > 0 else []


class CudaGraphRunner:
    def __init__(
        self,
        forward: Forward,
        attn_backend: AttentionBackend,
        max_bs: int,
        device: torch.device,
        prepare_ops: Callable[[], None],
    ) -> None:
        self.forward = forward
        self.attn_backend = attn_backend
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1] if self.sizes else 0
        self.inputs = torch.zeros(2, self.max_bs, dtype=torch.int64, device=device)  # ids; positions
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits (B, V), argmax (B,)
        self._prepare_ops = prepare_ops
        self._device = device

    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (smaller graphs reuse it)."""
        t0 = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):
            self._dummy_prepare(bs)
            ids, pos = self.inputs[0, :bs], self.inputs[1, :bs]
            argmax_rows(self.forward(ids, pos))  # warm-up: compiles kernels, settles the allocator
            torch.cuda.synchronize(self._device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(ids, pos)
                self.outputs[bs] = (logits, argmax_rows(logits))
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self._device)
        logger.info(
            "captured %d CUDA graphs for decode batches of 1..%d in %.1f s",
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - t0,
        )

    def _dummy_prepare(self, bs: int) -> None:
        """Metadata of a decode batch of `bs` requests of one cached token each and no KV write."""
        self._prepare_ops()
        self.attn_backend.prepare(
            AttnInput(
                seq_lens=[1] * bs,
                extend_lens=[1] * bs,
                out_slots=torch.full((bs,), -1, dtype=torch.int64),
                page_rows=torch.zeros(bs, 1, dtype=torch.int32),
                is_decode=True,
            )
        )

    def padded_size(self, bs: int) -> int | None:
        """The captured size a batch of `bs` replays, or None when it is too large for any graph."""
        for size in self.sizes:
            if size >= bs:
                return size
        return None

    def replay(
        self, inputs: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs (2, B) int64 on the CPU: token ids, then positions; pending: (rows, token ids) on
        the device that replace those rows' ids; the attention backend already prepared -> logits
        (B, V) in the head's dtype and their argmax (B,), views of the graph's output (valid until
        the next replay)."""
        bs = inputs.shape[1]
        size = self.padded_size(bs)
        assert size is not None, f"no CUDA graph holds a batch of {bs}"
        self.inputs[:, :bs].copy_(inputs, non_blocking=True)
        if pending is not None:
            self.inputs[0].index_copy_(0, *pending)
        self.graphs[size].replay()
        logits, best = self.outputs[size]
        return logits[:bs], best[:bs]
