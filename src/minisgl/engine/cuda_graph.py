"""CUDA graphs for decode steps: one graph per padded batch size, captured when the engine starts.

A decode step of B requests replays the graph of the smallest captured size >= B. Its inputs (token
ids, positions) and the attention backend's metadata live in buffers whose addresses never change;
the replay writes nothing else and allocates nothing. Padding rows compute garbage that nobody reads
(the attention backend gives them length 0 and no KV slot). The graph covers the whole forward
pass and the LM head: the output is the (B, vocab) float32 logits, sampled outside the graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from minisgl.attention import AttentionBackend, AttnInput

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids (B,), positions (B,)) -> logits


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
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._prepare_ops = prepare_ops
        self._device = device

    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (smaller graphs reuse it)."""
        t0 = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):
            self._dummy_prepare(bs)
            ids, pos = self.input_ids[:bs], self.positions[:bs]
            self.forward(ids, pos)  # warm-up: compiles kernels and settles the allocator outside the graph
            torch.cuda.synchronize(self._device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.forward(ids, pos)
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

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids/positions (B,) on the CPU; the attention backend already prepared -> (B, V) logits."""
        bs = input_ids.shape[0]
        size = self.padded_size(bs)
        assert size is not None, f"no CUDA graph holds a batch of {bs}"
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:bs]
