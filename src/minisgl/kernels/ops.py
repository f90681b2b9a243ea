"""Torch-facing wrappers of the CPU kernels: shape and layout checks, then one ctypes call.

Each wrapper takes contiguous float32 CPU tensors (int32/int64 for indices) and returns a new tensor
(`add_rmsnorm` also adds into its input, as documented). Layouts and shapes are checked here; the
values of page tables and lengths are not (they come from the engine's own page table), so the C code
trusts them. `available()` says whether the kernels could be built here; callers use their
plain-torch path when it is False.
"""

from __future__ import annotations

import ctypes

import torch

from . import graph
from .build import load


def available() -> bool:
    return load() is not None


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are unavailable here: check kernels.available() first")
    return lib


def _check(t: torch.Tensor, name: str, dtype: torch.dtype = torch.float32) -> int:
    if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous CPU {dtype} tensor, got {t.dtype} {t.device} {tuple(t.stride())}"
        )
    return t.data_ptr()


def _check_scratch(rc: int, kernel: str) -> None:
    """The kernels that allocate scratch memory return nonzero when they could not."""
    if rc != 0:
        raise MemoryError(f"{kernel}: out of scratch memory")


def _paged_args(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_rows: torch.Tensor
) -> tuple[list[int], int]:
    """The arguments both attention kernels start with (q, the K/V pool, the page table and its
    width) and whether the pool is float16 (else float32)."""
    kv = k_pool.dtype if k_pool.dtype in (torch.float32, torch.float16) else torch.float32
    args = [_check(q, "q"), _check(k_pool, "k_pool", kv), _check(v_pool, "v_pool", kv)]
    return [*args, _check(page_rows, "page_rows", torch.int32), page_rows.shape[1]], int(kv == torch.float16)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """One new token per request attending over its paged cache (which already holds that token).

    q (B, Hq, D) float32; k_pool/v_pool (S, Hkv, D) float32 or float16; page_rows (B, P) int32;
    seq_lens (B,) int32 -> (B, Hq, D) float32.
    """
    lib = _lib()
    bsz, hq, d = q.shape
    hkv = k_pool.shape[1]
    if hq % hkv or k_pool.shape != v_pool.shape or k_pool.shape[2] != d or page_rows.shape[0] != bsz:
        raise ValueError(
            f"decode_attention: shapes q {tuple(q.shape)}, pool {tuple(k_pool.shape)}, pages {tuple(page_rows.shape)}"
        )
    out = graph.empty(q.shape)
    paged, half = _paged_args(q, k_pool, v_pool, page_rows)
    args = [*paged, _check(seq_lens, "seq_lens", torch.int32), bsz, hq, hkv, d, page_size]
    args += [graph.float_bits(scale), out.data_ptr(), half]
    rc = graph.call(lib.minisgl_decode_attention_packed, args, (q, k_pool, v_pool, page_rows, seq_lens, out))
    _check_scratch(rc, "decode_attention")
    return out


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    starts: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """New tokens attending over their requests' paged caches (which already hold them), each up to
    its own position: prefill, fresh or after a cached prefix.

    q (T, Hq, D) float32, request b's new tokens at rows starts[b] .. starts[b + 1]; k_pool/v_pool
    (S, Hkv, D) float32 or float16; page_rows (B, P) int32; seq_lens (B,) int32 (cached tokens, the
    new ones included); starts (B + 1,) int64 -> (T, Hq, D) float32.
    """
    lib = _lib()
    t, hq, d = q.shape
    bsz, hkv = page_rows.shape[0], k_pool.shape[1]
    bad = hq % hkv or k_pool.shape != v_pool.shape or k_pool.shape[2] != d
    if bad or seq_lens.shape[0] != bsz or starts.shape[0] != bsz + 1 or int(starts[-1]) != t:
        raise ValueError(
            f"extend_attention: shapes q {tuple(q.shape)}, pool {tuple(k_pool.shape)}, pages "
            f"{tuple(page_rows.shape)}, starts ending {int(starts[-1])}"
        )
    out = graph.empty(q.shape)
    paged, half = _paged_args(q, k_pool, v_pool, page_rows)
    args = [*paged, _check(seq_lens, "seq_lens", torch.int32), _check(starts, "starts", torch.int64)]
    args += [bsz, hq, hkv, d, page_size, graph.float_bits(scale), out.data_ptr(), half]
    rc = graph.call(
        lib.minisgl_extend_attention_packed, args, (q, k_pool, v_pool, page_rows, seq_lens, starts, out)
    )
    _check_scratch(rc, "extend_attention")
    return out


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of fresh prompts over their own tokens. q (T, Hq, D), k/v (T, Hkv, D), starts
    (B + 1,) int64 row offsets of the requests (starts[0] = 0, starts[B] = T) -> (T, Hq, D)."""
    lib = _lib()
    t, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or int(starts[-1]) != t:
        raise ValueError(
            f"prefill_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, starts ending {int(starts[-1])}"
        )
    out = torch.empty_like(q)
    rc = lib.minisgl_prefill_attention(
        _check(q, "q"),
        _check(k, "k"),
        _check(v, "v"),
        _check(starts, "starts", torch.int64),
        starts.shape[0] - 1,
        hq,
        hkv,
        d,
        scale,
        out.data_ptr(),
    )
    _check_scratch(rc, "prefill_attention")
    return out


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the element-wise kernels take these tensors: built here, CPU, float32, contiguous.
    (Called on every layer's hot path: a plain loop, no device objects.)"""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return available()


def add_rmsnorm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h (T, H) += delta (in place, when given); returns weight * h * rsqrt(mean(h^2) + eps), (T, H)."""
    lib = _lib()
    t, hid = h.shape
    if weight.shape != (hid,) or (delta is not None and delta.shape != h.shape):
        raise ValueError(f"add_rmsnorm: shapes h {tuple(h.shape)}, weight {tuple(weight.shape)}")
    out = graph.empty(h.shape)
    args = [_check(h, "h"), 0 if delta is None else _check(delta, "delta"), _check(weight, "weight")]
    args += [graph.float_bits(eps), t, hid, out.data_ptr()]
    keep = [x for x in (h, delta, weight, out) if x is not None]
    graph.call(lib.minisgl_add_rmsnorm_packed, args, keep)
    return out


def rope_split(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int, num_kv: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (T, (Hq + 2 Hkv) D), cos/sin (T, D/2) -> q (T, Hq, D), k (T, Hkv, D) rotated, v (T, Hkv, D)."""
    lib = _lib()
    t = qkv.shape[0]
    if (
        qkv.shape[1] != (num_q + 2 * num_kv) * head_dim
        or cos.shape != (t, head_dim // 2)
        or sin.shape != cos.shape
    ):
        raise ValueError(f"rope_split: shapes qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}")
    q = qkv.new_empty(t, num_q, head_dim)
    k = qkv.new_empty(t, num_kv, head_dim)
    v = qkv.new_empty(t, num_kv, head_dim)
    lib.minisgl_rope_split(
        _check(qkv, "qkv"),
        _check(cos, "cos"),
        _check(sin, "sin"),
        t,
        num_q,
        num_kv,
        head_dim,
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
    )
    return q, k, v


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q: int,
    num_kv: int,
    head_dim: int,
    slots: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
) -> torch.Tensor:
    """qkv (T, (Hq + 2 Hkv) D), cos/sin (T, D/2) -> q (T, Hq, D) rotated; k rotated and v written into
    the pools (S, Hkv, D), float32 or float16, at slots (T,) int64 (the slots are not checked)."""
    lib = _lib()
    t = qkv.shape[0]
    kv = k_pool.dtype
    if (
        qkv.shape[1] != (num_q + 2 * num_kv) * head_dim
        or cos.shape != (t, head_dim // 2)
        or sin.shape != cos.shape
        or slots.shape != (t,)
        or k_pool.shape != v_pool.shape
        or k_pool.shape[1:] != (num_kv, head_dim)
        or kv not in (torch.float32, torch.float16)
    ):
        raise ValueError(f"rope_store: shapes qkv {tuple(qkv.shape)}, pool {tuple(k_pool.shape)} {kv}")
    q = graph.empty((t, num_q, head_dim))
    args = [_check(qkv, "qkv"), _check(cos, "cos"), _check(sin, "sin"), t, num_q, num_kv, head_dim]
    args += [_check(slots, "slots", torch.int64), _check(k_pool, "k_pool", kv), _check(v_pool, "v_pool", kv)]
    args += [int(kv == torch.float16), q.data_ptr()]
    graph.call(lib.minisgl_rope_store_packed, args, (qkv, cos, sin, slots, k_pool, v_pool, q))
    return q


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table (R, D) float32, idx (T,) int64 -> table[idx] (T, D) (indices clamped to the table)."""
    lib = _lib()
    rows, d = table.shape
    out = graph.empty((idx.shape[0], d))
    args = [_check(table, "table"), rows, _check(idx, "idx", torch.int64), idx.shape[0], d, out.data_ptr()]
    graph.call(lib.minisgl_gather_rows_packed, args, (table, idx, out))
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x (B, V) float32 -> (B,) int64 the first index of each row's maximum (NaN counts as the
    maximum), as `x.argmax(-1)`: one pass over the logits instead of torch's reductions."""
    lib = _lib()
    b, v = x.shape
    if v == 0:
        raise ValueError("argmax_rows: rows of no values")
    out = graph.empty((b,), torch.int64)
    graph.call(lib.minisgl_argmax_rows_packed, [_check(x, "x"), b, v, out.data_ptr()], (x, out))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) laid out [gate | up] -> silu(gate) * up, (T, I)."""
    lib = _lib()
    t, two_i = gate_up.shape
    out = gate_up.new_empty(t, two_i // 2)
    lib.minisgl_silu_mul(_check(gate_up, "gate_up"), t, two_i // 2, out.data_ptr())
    return out


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W (N, K) float32, N a multiple of 8 -> the (N / 8, K, 8) layout `packed_matmul` streams."""
    lib = _lib()
    n, k = weight.shape
    if n % 8:
        raise ValueError(f"pack_weight: {n} output features are not a multiple of 8")
    out = weight.new_empty(n // 8, k, 8)
    lib.minisgl_pack_weight(_check(weight, "weight"), n, k, out.data_ptr())
    return out


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) -> (M, N), W given as `pack_weight(W)`."""
    lib = _lib()
    m, k = x.shape
    nb, pk, _ = packed.shape
    n = nb * 8
    if pk != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"packed_matmul: x {tuple(x.shape)} against a packed ({n}, {pk}) weight")
    y = x.new_empty(m, n)
    rc = lib.minisgl_packed_matmul(
        _check(x, "x"),
        m,
        k,
        _check(packed, "packed"),
        n,
        None if bias is None else _check(bias, "bias"),
        y.data_ptr(),
    )
    _check_scratch(rc, "packed_matmul")
    return y


MOE_MAX_K = 64  # experts per token the kernel takes (cpu_kernels.c)


def moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Routed experts: x (T, H), w13 (E, 2I, H) [gate | up] rows, w2 (E, H, I), each token's K
    experts ids (T, K) int64 with weights (T, K) -> (T, H) = sum over them of weight * w2[e] @
    (silu(gate_e x) * up_e x). The token-expert pairs are grouped per expert here (a stable sort),
    every expert's work done in one call."""
    lib = _lib()
    t, h = x.shape
    e, two_i, _ = w13.shape
    k = ids.shape[1]
    if (
        w13.shape[2] != h
        or w2.shape != (e, h, two_i // 2)
        or ids.shape != (t, k)
        or weights.shape != ids.shape
    ):
        raise ValueError(
            f"moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, ids {tuple(ids.shape)}"
        )
    if k > MOE_MAX_K:
        raise ValueError(f"moe: {k} experts per token, the kernel takes at most {MOE_MAX_K}")
    flat = ids.reshape(-1)  # (P,) pair p = token * K + slot
    order = torch.argsort(flat, stable=True)  # (P,) pairs grouped by expert
    starts = torch.zeros(e + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(flat, minlength=e), 0, out=starts[1:])
    act = x.new_empty(t * k, two_i // 2)  # (P, I) scratch, sorted rows
    y = x.new_empty(t * k, h)  # (P, H) scratch, sorted rows
    out = x.new_empty(t, h)
    rc = lib.minisgl_moe(
        _check(x, "x"), t, h, _check(w13, "w13"), _check(w2, "w2"), e, two_i // 2, k,
        _check(order, "order", torch.int64), _check(starts, "starts", torch.int64),
        _check(flat, "ids", torch.int64), _check(weights.reshape(-1), "weights"),
        act.data_ptr(), y.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    _check_scratch(rc, "moe")
    return out
