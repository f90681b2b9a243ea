/* minisgl's CPU kernels for weights kept in GGUF's block formats (Q4_0 .. Q6_K) and in 16-bit floats.
 *
 * Built by minisgl/kernels/build.py once per instruction set, the one this machine runs chosen at
 * start (MINISGL_CPU_ISA forces one): MINISGL_AVX512 (AVX-512 F/BW/VL with VNNI; with MINISGL_AMX or
 * MINISGL_BF16 its prefill passes go in bfloat16, below), MINISGL_AVX2 (AVX2, FMA, F16C) or neither
 * (portable C). The three compute the same sums in their own order.
 *
 * y (M, N) = op(x) (M, K) @ W^T (+ bias) (+ y when accumulating), where W's rows are given by address
 * and ggml type (`row_ptrs`, `row_fmts`: fused and permuted weights need no copy), and op is nothing,
 * RMSNorm, or SiLU(gate) * up (the activations of the next projection, computed here once).
 *
 * Block formats go about the way llama.cpp goes: the activations are quantized to int8 per block of
 * 16 (a float scale dx each: half of llama.cpp's 32, which more than halves the error for the same
 * integer work), and each weight row is decoded once per call into unsigned bytes u
 * with a float scale and offset per 16 weights, w = sc * u + bi (e.g. Q4_1: u = q, sc = d, bi = m;
 * Q8_0: u = q + 128, bi = -128 d). A dot product is then exact integer sums of u * qx per 16 (VNNI's
 * vpdpbusd, AVX2's vpmaddubsw), scaled: sum_c sc_c dx_c sum(u qx) + sum_c bi_c dx_c sum(qx).
 * Decoding a tile of rows once and streaming every activation row past it serves decode (a few
 * rows: the weight read from memory once) and prefill (many rows: the decoded tile stays in L1).
 * Float rows (F32, F16, BF16) are converted in registers and multiplied in float32.
 *
 * Prefill passes (`prefill`), in the AMX build (a CPU with AMX-BF16) and the BF16 build (AVX-512 BF16
 * without AMX, e.g. AMD Zen 4): weights of every block format are decoded a tile of rows at a time to
 * bfloat16 and multiplied by the activations rounded to bfloat16, float32 sums, in AMX tiles (16 x 16
 * outputs, 32 k per instruction) or vdpbf16ps (16 outputs, 2 k per lane and instruction); each output
 * is again one fixed sequence of products whatever M. Decode passes keep the integer path (so a
 * decode row never depends on its batch either). The bf16 products are the closer to float32 (the
 * embedded model, teacher-forced: mean KL 0.00034 against the integer path's 0.00154) and, with no
 * per-block scaling in their loop, the faster for many rows (a 2-core Zen 4: 1.3-1.7x the prompt
 * tokens a second from 128 to 2,048 tokens a prompt).
 *
 * Batch invariance: each output element is one fixed sequence of operations on its own accumulator,
 * whatever M, the tile it falls in, or the thread count, so a row's result never depends on the
 * rows batched with it. No fast-math (built with -ffp-contract=off).
 *
 * Threads: OpenMP over tiles of weight rows (the activations are prepared before), sharing torch's
 * runtime as cpu_kernels.c does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
#include <immintrin.h>
#endif

/* ggml type ids */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };
/* minisgl's own: Q4_0, Q4_1 and Q8_0 rows repacked for the decode passes (see "repacked rows" below) */
enum { REPACKED = 100, Q4_0R = REPACKED + Q4_0, Q4_1R = REPACKED + Q4_1, Q8_0R = REPACKED + Q8_0 };
/* ... and the same formats' rows interleaved 16 at a time for the AVX-512 builds (see "grouped rows") */
enum {
    GROUPED = 200,
    Q4_0G = GROUPED + Q4_0,
    Q4_1G = GROUPED + Q4_1,
    Q5_0G = GROUPED + Q5_0,
    Q5_1G = GROUPED + Q5_1,
    Q8_0G = GROUPED + Q8_0,
    Q4_KG = GROUPED + Q4_K,
    Q5_KG = GROUPED + Q5_K,
    Q6_KG = GROUPED + Q6_K
};
static inline int is_repacked(int fmt) { return fmt == Q4_0R || fmt == Q4_1R || fmt == Q8_0R; }
static inline int is_grouped(int fmt) {
    return fmt == Q4_0G || fmt == Q4_1G || fmt == Q5_0G || fmt == Q5_1G || fmt == Q8_0G || fmt == Q4_KG || fmt == Q5_KG ||
           fmt == Q6_KG;
}
static inline int base_fmt(int fmt) { return is_repacked(fmt) ? fmt - REPACKED : is_grouped(fmt) ? fmt - GROUPED : fmt; }
enum { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SILU_MUL = 2 };

#define TILE_ROWS 8  /* weight rows decoded together */
#define MICRO_ROWS 4 /* weight rows per micro-kernel */
#if defined(MINISGL_AVX2) && !defined(MINISGL_AVX512)
#define MICRO_ACTS 2 /* activation rows per micro-kernel: 16 ymm registers hold 4 x 2 sums */
#else
#define MICRO_ACTS 4
#endif

const char *minisgl_quant_isa(void) {
#if defined(MINISGL_AMX)
    return "amx";
#elif defined(MINISGL_BF16)
    return "avx512bf16";
#elif defined(MINISGL_AVX512)
    return "avx512";
#elif defined(MINISGL_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* A decode call's activation buffers (its quantized rows, the pre-op's output): a per-thread block of
 * 64-byte aligned memory per slot, grown and kept, for requests up to SCRATCH_KEEP bytes (a decode
 * step asks for the same small sizes ~120 times: malloc and free consolidated the heap at each
 * call, ~0.4 us of a 2.7 us call at N = 16); larger ones are the caller's to free (owned = 1). */
#define SCRATCH_KEEP (256 * 1024)
static void *scratch_get(int slot, size_t bytes, int *owned) {
    static _Thread_local void *kept[2] = {NULL, NULL};
    static _Thread_local size_t cap[2] = {0, 0};
    bytes = (size_t)round_up((int64_t)bytes, 64);
    *owned = bytes > SCRATCH_KEEP;
    if (*owned) return aligned_alloc(64, bytes);
    if (bytes > cap[slot]) {
        void *grown = aligned_alloc(64, SCRATCH_KEEP);
        if (grown == NULL) return NULL;
        free(kept[slot]);
        kept[slot] = grown, cap[slot] = SCRATCH_KEEP;
    }
    return kept[slot];
}
static void scratch_put(void *p, int owned) {
    if (owned) free(p);
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, u;
    if (exp == 0x1F) u = sign | 0x7F800000u | (mant << 13);
    else if (exp != 0) u = sign | ((exp + 112) << 23) | (mant << 13);
    else if (mant == 0) u = sign;
    else { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400u)) mant <<= 1, --exp;
        u = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline int is_float_fmt(int fmt) { return fmt == F32 || fmt == F16 || fmt == BF16; }

/* whether every row has row 0's format (a loop the compiler vectorizes: the LM head has 49,152 rows) */
static int same_fmt(const int32_t *row_fmts, int64_t N) {
    int diff = 0;
    for (int64_t n = 1; n < N; ++n) diff |= row_fmts[n] ^ row_fmts[0];
    return diff == 0;
}

static int type_size(int fmt) {
    switch (base_fmt(fmt)) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static int block_size(int fmt) {
    switch (base_fmt(fmt)) {
    case F32: case F16: case BF16: return 1;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}

/* ---- repacked rows ---------------------------------------------------------------------------------
 * A Q4_0, Q4_1 or Q8_0 row repacked (minisgl_repack_rows, once at load: the same bytes, reordered, in
 * place of the file's) so that a decode pass keeps one int32 lane per (block, half of 16 weights) and
 * sums a block's integer products in that lane before any float work: a row's blocks go in sub-groups
 * of 8, then 4, 2 and 1 for the remainder (K = 576: 8 + 8 + 2). A sub-group of n blocks holds their f16
 * d (then Q4_1's m), then the quants: Q4_0/Q4_1 4n dwords, dword s * n + b = bytes [4s, 4s + 4) of
 * block b's nibbles (the low nibbles are weights 4s.., the high ones 16 + 4s..); Q8_0 8n dwords in the
 * order of the lanes that read them. A decode pass reads max(1, n / 2) vectors of 16 lanes per
 * sub-group; lane i of vector j is block b = i % n, half h = (i / n) % 2, dword s = j * 8 / n + i / 2n
 * of that half (n = 1: lanes 0-7 only). The bytes per block are the original format's. */
static inline int packable_fmt(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0; }
static inline int sub_group(int64_t nb, int64_t b0) {
    const int64_t r = nb - b0;
    return r >= 8 ? 8 : r >= 4 ? 4 : r >= 2 ? 2 : 1;
}

#if defined(MINISGL_AVX512)
/* Q4_0/Q4_1: blocks 4 half .. 4 half + 3 of a full sub-group's quants (at q: dword s * 8 + b = bytes 4s..
 * of block b's nibbles), each block's 16 bytes of nibbles in 128-bit lane b - 4 half */
static inline __m512i q4_blocks4(const uint8_t *q, int half) {
    const int b0 = 4 * half;
    const __m512i idx = _mm512_setr_epi32(b0, 8 + b0, 16 + b0, 24 + b0, b0 + 1, 9 + b0, 17 + b0, 25 + b0, b0 + 2, 10 + b0,
                                          18 + b0, 26 + b0, b0 + 3, 11 + b0, 19 + b0, 27 + b0);
    return _mm512_permutex2var_epi32(_mm512_loadu_si512((const void *)q), idx, _mm512_loadu_si512((const void *)(q + 64)));
}

/* Q8_0: the same for a full sub-group's vectors (vector s, lane i = block i % 8, half i / 8, bytes
 * 16 half + 4s..): lane L of *lo holds block 4 half + L's bytes 0..15, of *hi its 16..31 */
static inline void q8_blocks4(const uint8_t *q, int half, __m512i *lo, __m512i *hi) {
    const int b0 = 4 * half;
    /* per 128-bit lane L (block b0 + L): [zA[b], zB[b], zA[8 + b], zB[8 + b]] */
    const __m512i idx = _mm512_setr_epi32(b0, 16 + b0, 8 + b0, 24 + b0, b0 + 1, 17 + b0, 9 + b0, 25 + b0, b0 + 2, 18 + b0,
                                          10 + b0, 26 + b0, b0 + 3, 19 + b0, 11 + b0, 27 + b0);
    const __m512i u = _mm512_permutex2var_epi32(_mm512_loadu_si512((const void *)q), idx,
                                                _mm512_loadu_si512((const void *)(q + 64)));
    const __m512i v = _mm512_permutex2var_epi32(_mm512_loadu_si512((const void *)(q + 128)), idx,
                                                _mm512_loadu_si512((const void *)(q + 192)));
    *lo = _mm512_unpacklo_epi64(u, v), *hi = _mm512_unpackhi_epi64(u, v);
}

/* A full sub-group's quants (at q) back into its 8 blocks at plain (their d and m already there) */
static void unpack_group8(int fmt, const uint8_t *q, uint8_t *plain) {
    const int ts = type_size(fmt);
    if (fmt != Q8_0) { /* dword s * 8 + b -> bytes 4s.. of block b's nibbles */
        const int off = fmt == Q4_1 ? 4 : 2;
        for (int half = 0; half < 2; ++half) { /* blocks 4 half .. 4 half + 3 */
            const int b0 = 4 * half;
            const __m512i v = q4_blocks4(q, half);
            _mm_storeu_si128((__m128i *)(plain + (b0 + 0) * ts + off), _mm512_extracti32x4_epi32(v, 0));
            _mm_storeu_si128((__m128i *)(plain + (b0 + 1) * ts + off), _mm512_extracti32x4_epi32(v, 1));
            _mm_storeu_si128((__m128i *)(plain + (b0 + 2) * ts + off), _mm512_extracti32x4_epi32(v, 2));
            _mm_storeu_si128((__m128i *)(plain + (b0 + 3) * ts + off), _mm512_extracti32x4_epi32(v, 3));
        }
        return;
    }
    /* Q8_0: vector s, lane i = block i % 8, half i / 8, bytes 16 half + 4s.. */
    for (int half = 0; half < 2; ++half) {
        const int b0 = 4 * half;
        __m512i lo, hi; /* halves 0, 1 */
        q8_blocks4(q, half, &lo, &hi);
        for (int L = 0; L < 4; ++L) {
            uint8_t *blk = plain + (b0 + L) * ts + 2;
            const __m128i l = L == 0 ? _mm512_extracti32x4_epi32(lo, 0) : L == 1 ? _mm512_extracti32x4_epi32(lo, 1)
                            : L == 2 ? _mm512_extracti32x4_epi32(lo, 2) : _mm512_extracti32x4_epi32(lo, 3);
            const __m128i h = L == 0 ? _mm512_extracti32x4_epi32(hi, 0) : L == 1 ? _mm512_extracti32x4_epi32(hi, 1)
                            : L == 2 ? _mm512_extracti32x4_epi32(hi, 2) : _mm512_extracti32x4_epi32(hi, 3);
            _mm_storeu_si128((__m128i *)blk, l);
            _mm_storeu_si128((__m128i *)(blk + 16), h);
        }
    }
}
#endif

#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
/* 4 x 4 transposes of dwords in both 128-bit halves: v[i]'s dword j -> out[j]'s dword i (per half) */
static inline void transpose4_dwords(const __m256i v[4], __m256i out[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2), out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3), out[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* each of blocks 0..7's 16 bytes at in + b * ts -> dword s of blocks 0..7 as the 32 bytes at
 * q + s * stride (s = 0..3): a full sub-group's packing */
static inline void pack_dwords_8x4(const uint8_t *in, int ts, uint8_t *q, int stride) {
    __m256i v[4], c[4];
    for (int i = 0; i < 4; ++i) /* blocks i and i + 4 */
        v[i] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(in + (i + 4) * ts)), _mm_loadu_si128((const __m128i *)(in + i * ts)));
    transpose4_dwords(v, c);
    for (int s = 0; s < 4; ++s) _mm256_storeu_si256((__m256i *)(q + s * stride), c[s]);
}

/* a full sub-group's quants into the repacked order (the file's blocks at plain, g0's first) */
static void pack_group8(int fmt, const uint8_t *plain, uint8_t *q) {
    const int ts = type_size(fmt);
    if (fmt != Q8_0) {
        pack_dwords_8x4(plain + (fmt == Q4_1 ? 4 : 2), ts, q, 32);
        return;
    }
    pack_dwords_8x4(plain + 2, ts, q, 64);      /* halves 0: lanes 0-7 of the four vectors */
    pack_dwords_8x4(plain + 18, ts, q + 32, 64); /* halves 1: lanes 8-15 */
}
#endif

#if defined(MINISGL_AVX2) && !defined(MINISGL_AVX512)
/* dword s of blocks 0..7 in the 32 bytes at q + s * stride (s = 0..3) -> each block's 16 bytes at
 * out + b * ts: a 4 x 8 transpose of dwords */
static inline void dwords_4x8(const uint8_t *q, int stride, uint8_t *out, int ts) {
    __m256i c[4], u[4]; /* u[i]: block i, then block i + 4 */
    for (int s = 0; s < 4; ++s) c[s] = _mm256_loadu_si256((const __m256i *)(q + s * stride));
    transpose4_dwords(c, u);
    for (int i = 0; i < 4; ++i) {
        _mm_storeu_si128((__m128i *)(out + i * ts), _mm256_castsi256_si128(u[i]));
        _mm_storeu_si128((__m128i *)(out + (i + 4) * ts), _mm256_extracti128_si256(u[i], 1));
    }
}

/* A full sub-group's quants (at q) back into its 8 blocks at plain (their d and m already there) */
static void unpack_group8(int fmt, const uint8_t *q, uint8_t *plain) {
    const int ts = type_size(fmt);
    if (fmt != Q8_0) { /* dword s * 8 + b -> bytes 4s.. of block b's nibbles */
        dwords_4x8(q, 32, plain + (fmt == Q4_1 ? 4 : 2), ts);
        return;
    }
    /* Q8_0: vector j's 16 lanes: dword j of half 0 of blocks 0..7, then of half 1 */
    dwords_4x8(q, 64, plain + 2, ts);
    dwords_4x8(q + 32, 64, plain + 2 + 16, ts);
}
#endif

/* the row of K weights at `plain` (fmt's blocks) <-> the same row repacked at `packed`; unpack: the
 * other way round */
static void repack_row(int fmt, uint8_t *plain, uint8_t *packed, int64_t K, int unpack) {
    const int ts = type_size(fmt), q8 = fmt == Q8_0, has_min = fmt == Q4_1;
    const int64_t nb = K / 32;
#define MOVE(dst_off, src_off, len)                                                                      \
    (unpack ? memcpy(plain + (src_off), packed + (dst_off), len) : memcpy(packed + (dst_off), plain + (src_off), len))
    for (int64_t g0 = 0; g0 < nb;) {
        const int n = sub_group(nb, g0);
        const int64_t base = g0 * ts;
        for (int b = 0; b < n; ++b) {
            const int64_t blk = (g0 + b) * ts;
            MOVE(base + 2 * b, blk, 2);
            if (has_min) MOVE(base + 2 * n + 2 * b, blk + 2, 2);
        }
        const int64_t quants = base + (has_min ? 4 : 2) * n;
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
        if (unpack && n == 8) { /* the prefill's and the lookup's way back: permutes, not 4-byte copies */
            unpack_group8(fmt, packed + quants, plain + g0 * ts);
            g0 += n;
            continue;
        }
        if (!unpack && n == 8) { /* packing at load: the same transposes, not 4-byte copies */
            pack_group8(fmt, plain + g0 * ts, packed + quants);
            g0 += n;
            continue;
        }
#endif
        if (!q8) {
            for (int sd = 0; sd < 4; ++sd)
                for (int b = 0; b < n; ++b) MOVE(quants + 4 * (sd * n + b), (g0 + b) * ts + 2 + 2 * has_min + 4 * sd, 4);
        } else {
            const int nz = n >= 2 ? n / 2 : 1, lanes = n == 1 ? 8 : 16;
            for (int j = 0; j < nz; ++j)
                for (int i = 0; i < lanes; ++i) {
                    const int b = i % n, h = (i / n) % 2, sd = j * (8 / n) + i / (2 * n);
                    MOVE(quants + 4 * (16 * j + i), (g0 + b) * ts + 2 + 16 * h + 4 * sd, 4);
                }
        }
        g0 += n;
    }
#undef MOVE
}

/* ---- grouped rows ----------------------------------------------------------------------------------
 * The AVX-512 builds repack Q4_0, Q4_1 and Q8_0 weights 16 rows at a time (minisgl_repack_rows, once
 * at load; a weight of N rows, N a multiple of 16, each group of one format) so that the decode kernel
 * keeps one output row per int32 lane: a vpdpbusd multiplies 4 weights of each of the 16 rows by the
 * same 4 activation bytes (broadcast), a block's 32 products sum in the lane with no shuffles, and one
 * block's float work (its int sum converted, scaled by the row's d times the activations' scale) is
 * shared by 16 rows. A group (64-byte aligned) holds its nb blocks in pairs, each pair's quants then
 * its headers (one stream to read, every vector aligned; an odd last block alone, padded). A block's
 * quants: Q4_0/Q4_1 4 vectors, lane r of vector j = bytes [4j, 4j + 4) of row r's nibbles (low
 * nibbles: weights 4j.., high: 16 + 4j..); Q8_0 8 vectors, lane r of vector j = row r's int8 weights
 * [4j, 4j + 4) plus 128 (unsigned, as vpdpbusd takes them). Its header: the 16 rows' f16 d, then
 * (Q4_1) their f16 m. Q5_0/Q5_1 as Q4_0/Q4_1, with a fifth vector: lane r = row r's 32 fifth bits,
 * reordered so that bit 8t + j is that of byte t of vector j (weight 4j + t, or 16 + 4 (j - 4) + t
 * from j = 4). The bytes are the file's (Q8_0's with the sign bit flipped). Q4_K goes by
 * super-blocks of 256: its quants as 32 vectors, lane r of vector v = bytes [4v, 4v + 4) of row r's
 * 128 bytes of nibbles (vectors 8p .. 8p + 7: sub-block 2p in the low nibbles, 2p + 1 in the high);
 * its header the rows' f16 d, f16 dmin, then their 6-bit sub-block scales and mins one byte each
 * (sub-block j's at 64 + 16 j and 192 + 16 j: 320 bytes for the file's 16 x 16). Q5_K as Q4_K, its
 * 32 bytes of fifth bits a row as 8 more vectors after the nibbles' (bit j of byte l: weight l of
 * sub-block j). Q6_K too: 32
 * vectors of ql then 16 of qh, lane r of vector v = bytes [4v, 4v + 4) of row r's; its header the
 * rows' f16 d, then their 16 int8 scales (sub-block j's at 32 + 16 j). Row r's entry in the row table
 * is the group's address plus r. */
#define GROUP_ROWS 16
static inline int groupable_fmt(int fmt) {
    return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1 || fmt == Q8_0 || fmt == Q4_K || fmt == Q5_K ||
           fmt == Q6_K;
}
/* one block's quants and header, for 16 rows */
static inline int64_t group_qbytes(int base) {
    return base == Q6_K ? 3072 : base == Q5_K ? 2560 : base == Q4_K ? 2048 : base == Q8_0 ? 512
         : base == Q5_0 || base == Q5_1 ? 320 : 256;
}
static inline int64_t group_hbytes(int base) {
    return base == Q6_K ? 288 : base == Q4_K || base == Q5_K ? 320 : base == Q4_1 || base == Q5_1 ? 64 : 32;
}
static inline int64_t group_bytes(int base, int64_t nb) {
    return round_up(nb * (group_qbytes(base) + group_hbytes(base)), 64);
}
static inline const uint8_t *group_of(const uint8_t *p) { return (const uint8_t *)((uintptr_t)p & ~(uintptr_t)63); }
/* block b's quants and header in a group of nb blocks (QS, HS: group_qbytes, group_hbytes) */
static inline int64_t group_q_off(int64_t b, int64_t QS, int64_t HS) { return b / 2 * 2 * (QS + HS) + b % 2 * QS; }
static inline int64_t group_h_off(int64_t b, int64_t nb, int64_t QS, int64_t HS) {
    const int64_t pair = b / 2 * 2;
    return pair * (QS + HS) + (pair + 1 < nb ? 2 : 1) * QS + b % 2 * HS;
}

static inline void k_scale_min(int j, const uint8_t *q, int *sc, int *m);

/* Q5_0/Q5_1: a block's 32 fifth bits (bit i: weight i) <-> the grouped lane's order (bit 8t + j: byte t
 * of vector j, i.e. weight 4j + t, or 16 + 4 (j - 4) + t from j = 4); back: lane order -> the file's */
static uint32_t fifth_bits_order(uint32_t bits, int back) {
    uint32_t out = 0;
    for (int j = 0; j < 8; ++j)
        for (int t = 0; t < 4; ++t) {
            const int i = j < 4 ? 4 * j + t : 16 + 4 * (j - 4) + t, lane = 8 * t + j;
            out |= ((bits >> (back ? lane : i)) & 1u) << (back ? i : lane);
        }
    return out;
}

/* Q4_K: row r's 12 bytes of packed 6-bit scales and mins (q) <-> its 8 scales and 8 mins at h (one
 * byte each, 16 apart; unpack: h -> q), the inverse of k_scale_min */
static void k_scales_row(uint8_t *q, uint8_t *h, int unpack) {
    if (!unpack) {
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            k_scale_min(j, q, &sc, &m);
            h[16 * j] = (uint8_t)sc, h[128 + 16 * j] = (uint8_t)m;
        }
        return;
    }
    for (int i = 0; i < 4; ++i) {
        const int sc = h[16 * i], m = h[128 + 16 * i], sc4 = h[16 * (i + 4)], m4 = h[128 + 16 * (i + 4)];
        q[i] = (uint8_t)((sc & 63) | ((sc4 >> 4) << 6));
        q[i + 4] = (uint8_t)((m & 63) | ((m4 >> 4) << 6));
        q[i + 8] = (uint8_t)((sc4 & 0xF) | ((m4 & 0xF) << 4));
    }
}

/* row r of a group <-> its blocks in the file's layout (plain); unpack: group -> plain */
static void group_row(int base, uint8_t *g, int r, int64_t nb, uint8_t *plain, int unpack) {
    const int ts = type_size(base), q8 = base == Q8_0, q5 = base == Q5_K, kq = base == Q4_K || q5, q6 = base == Q6_K;
    const int five = base == Q5_0 || base == Q5_1, has_min = base == Q4_1 || base == Q5_1 || kq;
    /* the quants' words and offset in the file's block (Q6_K: ql and qh, then the scales and d; Q5_K:
     * the nibbles after qh, whose 8 words follow them in the group; Q5_0/Q5_1: after qh, reordered) */
    const int words = q6 ? 48 : kq ? 32 : q8 ? 8 : 4;
    const int head = q6 ? 0 : q5 ? 48 : kq ? 16 : 2 + 2 * has_min + 4 * five;
    const int64_t QS = group_qbytes(base), HS = group_hbytes(base);
    for (int64_t b = 0; b < nb; ++b) {
        uint8_t *blk = plain + b * ts, *qs = blk + head, *d = q6 ? blk + 208 : blk;
        uint8_t *h = g + group_h_off(b, nb, QS, HS) + 2 * r, *q = g + group_q_off(b, QS, HS) + 4 * r;
        uint8_t *hs = g + group_h_off(b, nb, QS, HS) + (q6 ? 32 : 64) + r; /* row r's first sub-block scale */
        /* n bytes between the group (at gp) and the file's block (at pp), the way of `unpack` */
#define GMOVE(gp, pp, n) (unpack ? memcpy((pp), (gp), (n)) : memcpy((gp), (pp), (n)))
        GMOVE(h, d, 2);
        if (has_min) GMOVE(h + 32, blk + 2, 2);
        if (kq) k_scales_row(blk + 4, hs, unpack);
        for (int j = 0; j < 16 * q6; ++j) GMOVE(hs + 16 * j, blk + 192 + j, 1);
        for (int j = 0; j < words; ++j) GMOVE(q + 64 * j, qs + 4 * j, 4);
        for (int j = 0; j < 8 * q5; ++j) GMOVE(q + 64 * (words + j), blk + 16 + 4 * j, 4);
#undef GMOVE
        if (five) { /* the fifth bits reordered on the way */
            uint32_t bits;
            memcpy(&bits, unpack ? q + 64 * words : qs - 4, 4);
            bits = fifth_bits_order(bits, unpack);
            memcpy(unpack ? qs - 4 : q + 64 * words, &bits, 4);
        }
        for (int j = 0; j < words * q8; ++j) /* Q8_0: the sign bits flipped in the group */
            for (int i = 0; i < 4; ++i) (unpack ? qs + 4 * j : q + 64 * j)[i] ^= 0x80;
    }
}

/* A row in its format's own block layout: p itself, or (a repacked or grouped row) a per-thread copy
 * put back in order, *fmt then the base format; NULL without memory. */
static const uint8_t *plain_row(int *fmt, const uint8_t *p, int64_t K) {
    if (!is_repacked(*fmt) && !is_grouped(*fmt)) return p;
    static _Thread_local uint8_t *buf = NULL;
    static _Thread_local size_t cap = 0;
    const int base = base_fmt(*fmt);
    const size_t need = (size_t)(K / block_size(base) * type_size(base));
    if (need > cap) {
        uint8_t *grown = (uint8_t *)malloc(need);
        if (grown == NULL) return NULL;
        free(buf);
        buf = grown, cap = need;
    }
    if (is_grouped(*fmt))
        group_row(base, (uint8_t *)(intptr_t)group_of(p), (int)((uintptr_t)p & 63), K / block_size(base), buf, 1);
    else repack_row(base, buf, (uint8_t *)(intptr_t)p, K, 1);
    *fmt = base;
    return buf;
}

/* whether a weight's rows go in groups (this build has the grouped kernel, N is whole groups and each
 * group is of one format that groups) */
static int groupable(const int32_t *row_fmts, int64_t N) {
#if defined(MINISGL_AVX512) && !defined(MINISGL_NO_GROUPS) /* NO_GROUPS: the repacked rows (A/B runs) */
    if (N % GROUP_ROWS) return 0;
    for (int64_t n = 0; n < N; ++n)
        if (row_fmts[n] != row_fmts[n - n % GROUP_ROWS] || !groupable_fmt(row_fmts[n])) return 0;
    return 1;
#else
    (void)row_fmts, (void)N;
    return 0;
#endif
}

/* The bytes minisgl_repack_rows needs for these rows into *bytes (grouped: the groups' padding and 64
 * for aligning dst included); -1 unless the rows group (Q4_K too) or every row is Q4_0, Q4_1 or Q8_0,
 * K whole blocks. */
int minisgl_repack_bytes(const int32_t *row_fmts, int64_t N, int64_t K, int64_t *bytes) {
    if (K <= 0 || K % 32) return -1;
    const int grouped = groupable(row_fmts, N);
    int64_t total = grouped ? 64 : 0;
    for (int64_t n = 0; n < N; ++n) {
        if (!(grouped ? groupable_fmt(row_fmts[n]) : packable_fmt(row_fmts[n])) || K % block_size(row_fmts[n]))
            return -1;
        if (!grouped) total += K / 32 * type_size(row_fmts[n]);
        else if (n % GROUP_ROWS == 0) total += group_bytes(row_fmts[n], K / block_size(row_fmts[n]));
    }
    *bytes = total;
    return 0;
}

/* Rows (row_ptrs, row_fmts: N rows of K weights) repacked into dst (minisgl_repack_bytes of room):
 * grouped where groupable, else one after another; their new addresses and formats into
 * out_ptrs/out_fmts. -1 (nothing written) as for minisgl_repack_bytes. */
int minisgl_repack_rows(const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, int64_t K, uint8_t *dst,
                        int64_t *out_ptrs, int32_t *out_fmts) {
    int64_t bytes;
    if (minisgl_repack_bytes(row_fmts, N, K, &bytes)) return -1;
    const int grouped = groupable(row_fmts, N);
    if (grouped) dst += (64 - ((uintptr_t)dst & 63)) & 63; /* groups are 64-byte aligned */
    int64_t off = 0;
    for (int64_t n = 0; n < N; ++n) {
        if (grouped) {
            out_ptrs[n] = (int64_t)(intptr_t)(dst + off + n % GROUP_ROWS);
            out_fmts[n] = GROUPED + row_fmts[n];
            if (n % GROUP_ROWS == GROUP_ROWS - 1) off += group_bytes(row_fmts[n], K / block_size(row_fmts[n]));
        } else {
            out_ptrs[n] = (int64_t)(intptr_t)(dst + off);
            out_fmts[n] = REPACKED + row_fmts[n];
            off += K / 32 * type_size(row_fmts[n]);
        }
    }
#pragma omp parallel for schedule(static) if (N * K >= 262144)
    for (int64_t n = 0; n < N; ++n) {
        uint8_t *src = (uint8_t *)(intptr_t)row_ptrs[n], *out = (uint8_t *)(intptr_t)out_ptrs[n];
        if (grouped)
            group_row(row_fmts[n], (uint8_t *)(intptr_t)group_of(out), (int)(n % GROUP_ROWS), K / block_size(row_fmts[n]),
                      src, 0);
        else repack_row(row_fmts[n], src, out, K, 0);
    }
    return 0;
}

/* whether this build's decode passes have the repacked rows' kernel (else repacking gains nothing) */
int minisgl_repack_supported(void) {
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* ---- dequantization to float32, exactly as minisgl.quant.formats computes it ------------------- */

/* Q4_K/Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes */
static inline void k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One row of K weights of type fmt at p -> out[0..K) */
static void dequant_row(int fmt, const uint8_t *p, int64_t K, float *restrict out) {
    p = plain_row(&fmt, p, K);
    if (p == NULL) { /* no memory for the copy: NaNs, never silently zeros */
        for (int64_t i = 0; i < K; ++i) out[i] = NAN;
        return;
    }
    switch (fmt) {
    case F32: memcpy(out, p, sizeof(float) * (size_t)K); break;
    case F16:
        for (int64_t i = 0; i < K; ++i) out[i] = load_half(p + 2 * i);
        break;
    case BF16:
        for (int64_t i = 0; i < K; ++i) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = bf16_to_float(h);
        }
        break;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1:
        for (int64_t b = 0; b < K / 32; ++b) {
            const int has_min = fmt == Q4_1 || fmt == Q5_1, five = fmt == Q5_0 || fmt == Q5_1;
            const uint8_t *blk = p + b * (fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : fmt == Q5_0 ? 22 : 24);
            const float d = load_half(blk), m = has_min ? load_half(blk + 2) : 0.f;
            uint32_t qh = 0;
            if (five) memcpy(&qh, blk + 2 + 2 * has_min, 4);
            const uint8_t *qs = blk + 2 + 2 * has_min + 4 * five;
            const int off = has_min ? 0 : (five ? 16 : 8);
            float *o = out + 32 * b;
            for (int j = 0; j < 16; ++j) {
                const int q0 = (qs[j] & 0xF) | (five ? ((qh >> j) & 1) << 4 : 0);
                const int q1 = (qs[j] >> 4) | (five ? ((qh >> (j + 16)) & 1) << 4 : 0);
                if (has_min) {
                    o[j] = d * (float)q0 + m;
                    o[j + 16] = d * (float)q1 + m;
                } else {
                    o[j] = d * (float)(q0 - off);
                    o[j + 16] = d * (float)(q1 - off);
                }
            }
        }
        break;
    case Q8_0:
        for (int64_t b = 0; b < K / 32; ++b) {
            const uint8_t *blk = p + b * 34;
            const float d = load_half(blk);
            for (int j = 0; j < 32; ++j) out[32 * b + j] = d * (float)(int8_t)blk[2 + j];
        }
        break;
    case Q4_K: case Q5_K:
        for (int64_t b = 0; b < K / 256; ++b) {
            const int five = fmt == Q5_K;
            const uint8_t *blk = p + b * (five ? 176 : 144);
            const float d = load_half(blk), dmin = load_half(blk + 2);
            const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + (five ? 48 : 16);
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                k_scale_min(j, scales, &sc, &m);
                const float d1 = d * (float)sc, m1 = dmin * (float)m;
                const uint8_t *q = qs + 32 * (j / 2);
                float *o = out + 256 * b + 32 * j;
                for (int l = 0; l < 32; ++l) {
                    int v = (j & 1) ? q[l] >> 4 : q[l] & 0xF;
                    if (five) v |= ((qh[l] >> j) & 1) << 4;
                    o[l] = d1 * (float)v - m1;
                }
            }
        }
        break;
    case Q6_K:
        for (int64_t b = 0; b < K / 256; ++b) {
            const uint8_t *blk = p + b * 210;
            const float d = load_half(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int half = 0; half < 2; ++half) {
                const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
                float *o = out + 256 * b + 128 * half;
                for (int l = 0; l < 128; ++l) {
                    const int lo = l < 64 ? ql[l] & 0xF : ql[l - 64] >> 4;
                    const int hi = (qh[l % 32] >> (2 * (l / 32))) & 3;
                    const float s = d * (float)sc[8 * half + l / 16];
                    o[l] = s * (float)((lo | (hi << 4)) - 32);
                }
            }
        }
        break;
    }
}

/* out (T, K) = rows ids[0..T) of the weight, dequantized (the embedding lookup) */
int minisgl_dequant_rows(const int64_t *row_ptrs, const int32_t *row_fmts, int64_t nrows, const int64_t *ids,
                         int64_t T, int64_t K, float *out) {
    for (int64_t t = 0; t < T; ++t)
        if (ids[t] < 0 || ids[t] >= nrows || block_size(row_fmts[ids[t]]) == 0) return -1;
#pragma omp parallel for if (T * K >= 262144)
    for (int64_t t = 0; t < T; ++t)
        dequant_row(row_fmts[ids[t]], (const uint8_t *)(intptr_t)row_ptrs[ids[t]], K, out + t * K);
    return 0;
}

/* ---- a weight row decoded for the integer dot products --------------------------------------------
 * u[0..K64) bytes (zero past K), sc/bi[0..C16) floats per 16 weights (zero past K / 16). */

typedef struct {
    uint8_t *u;
    float *sc, *bi;
    int kind; /* 0: absent (no row, or a float row), 1: unsigned u, 2: signed int8 u (bi = 0) */
} Decoded;

static inline void set16(float *sc, float *bi, int64_t c, float s, float b) {
    sc[c] = sc[c + 1] = s;
    bi[c] = bi[c + 1] = b;
}

/* Byte-wise helpers of the decoders, in SIMD where the build has it (the portable build: plain C). */

/* u[0..32) = the nibbles of qs[0..16): low nibbles, then high nibbles */
static inline void nibbles32(const uint8_t *restrict qs, uint8_t *restrict u) {
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0F);
    _mm_storeu_si128((__m128i *)u, _mm_and_si128(v, m));
    _mm_storeu_si128((__m128i *)(u + 16), _mm_and_si128(_mm_srli_epi16(v, 4), m));
#else
    for (int j = 0; j < 16; ++j) u[j] = qs[j] & 0xF;
    for (int j = 0; j < 16; ++j) u[j + 16] = qs[j] >> 4;
#endif
}

/* u[0..32) |= 16 where bit j of qh is set (the fifth bits of Q5_0/Q5_1) */
static inline void fifth_bits32(uint32_t qh, uint8_t *restrict u) {
#if defined(MINISGL_AVX512)
    const __m256i v = _mm256_loadu_si256((const __m256i *)u);
    _mm256_storeu_si256((__m256i *)u, _mm256_or_si256(v, _mm256_maskz_set1_epi8((__mmask32)qh, 0x10)));
#elif defined(MINISGL_AVX2)
    /* byte j gets byte j / 8 of qh, then keeps bit j % 8 of it */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    const __m256i v = _mm256_loadu_si256((const __m256i *)u);
    _mm256_storeu_si256((__m256i *)u, _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10))));
#else
    for (int j = 0; j < 32; ++j) u[j] |= ((qh >> j) & 1) << 4;
#endif
}

/* Q4_K/Q5_K: 32 bytes of nibbles -> sub-blocks lo (low nibbles) and hi (high), with the fifth bits
 * (bit j_lo / j_hi of qh[l]) when qh is not NULL */
static inline void k_pair(const uint8_t *restrict q, const uint8_t *restrict qh, int j_lo, uint8_t *restrict lo,
                          uint8_t *restrict hi) {
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
    const __m256i v = _mm256_loadu_si256((const __m256i *)q), m = _mm256_set1_epi8(0x0F);
    __m256i a = _mm256_and_si256(v, m), b = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    if (qh != NULL) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)qh), one = _mm256_set1_epi8(1);
        a = _mm256_or_si256(a, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j_lo), one), 4));
        b = _mm256_or_si256(b, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j_lo + 1), one), 4));
    }
    _mm256_storeu_si256((__m256i *)lo, a);
    _mm256_storeu_si256((__m256i *)hi, b);
#else
    for (int l = 0; l < 32; ++l) lo[l] = q[l] & 0xF;
    for (int l = 0; l < 32; ++l) hi[l] = q[l] >> 4;
    if (qh != NULL) {
        for (int l = 0; l < 32; ++l) lo[l] |= ((qh[l] >> j_lo) & 1) << 4;
        for (int l = 0; l < 32; ++l) hi[l] |= ((qh[l] >> (j_lo + 1)) & 1) << 4;
    }
#endif
}

/* Q6_K: one half (64 bytes of ql, 32 of qh) -> 128 values of 6 bits */
static inline void q6_half(const uint8_t *restrict ql, const uint8_t *restrict qh, uint8_t *restrict u) {
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(h, m2), 4);
    const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4);
    const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4);
    const __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4);
    _mm256_storeu_si256((__m256i *)u, _mm256_or_si256(_mm256_and_si256(l0, m4), h0));
    _mm256_storeu_si256((__m256i *)(u + 32), _mm256_or_si256(_mm256_and_si256(l1, m4), h1));
    _mm256_storeu_si256((__m256i *)(u + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), h2));
    _mm256_storeu_si256((__m256i *)(u + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), h3));
#else
    for (int l = 0; l < 32; ++l) {
        u[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
        u[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        u[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        u[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
#endif
}

/* Q8_0's 32 int8 -> u: q + 128 (flip = 0x80), or the bytes as they are (flip = 0) */
static inline void bytes32(const uint8_t *restrict q, uint8_t flip, uint8_t *restrict u) {
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
    _mm256_storeu_si256((__m256i *)u, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)q), _mm256_set1_epi8((char)flip)));
#else
    for (int j = 0; j < 32; ++j) u[j] = q[j] ^ flip;
#endif
}

/* The 32-weight formats (Q4_0 .. Q8_0) a chunk of blocks at a time: their f16 scales gathered and
 * converted together, their nibbles unpacked four blocks per vector. A row's last blocks (fewer than
 * a chunk) go one at a time below. Same values as the one-block code. */
#if defined(MINISGL_AVX512)
#define SCALE_CHUNK 16
/* sc/bi (32 entries each: two per block) of blocks 0..15 at p, `bytes` apart; bias_of_d: the bias as
 * a multiple of d (Q4_0 -8, Q5_0 -16, Q8_0 -128 or 0), or NAN: the block's f16 m after d */
static inline void scales_chunk(const uint8_t *p, int bytes, float bias_of_d, float *sc, float *bi) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(bytes));
    const __m512i w = _mm512_i32gather_epi32(idx, (const void *)p, 1); /* (m << 16) | d per block */
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
    const __m512 b = isnan(bias_of_d) ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)))
                                      : _mm512_mul_ps(_mm512_set1_ps(bias_of_d), d);
    const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    _mm512_storeu_ps(sc, _mm512_permutexvar_ps(lo, d));
    _mm512_storeu_ps(sc + 16, _mm512_permutexvar_ps(hi, d));
    _mm512_storeu_ps(bi, _mm512_permutexvar_ps(lo, b));
    _mm512_storeu_ps(bi + 16, _mm512_permutexvar_ps(hi, b));
}

/* u of blocks 0..3 at p (`bytes` apart, 16 bytes of nibbles at `off`; Q5: fifth bits at `qh_off`) */
static inline void nibbles_4blocks(const uint8_t *p, int bytes, int off, int qh_off, uint8_t *u) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + bytes + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * bytes + off)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * bytes + off)), 3);
    const __m512i m = _mm512_set1_epi8(0x0F);
    const __m512i L = _mm512_and_si512(v, m), H = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
    /* [L0 H0 L1 H1] and [L2 H2 L3 H3], 16-byte units */
    __m512i u01 = _mm512_permutex2var_epi64(L, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), H);
    __m512i u23 = _mm512_permutex2var_epi64(L, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), H);
    if (qh_off >= 0) {
        uint32_t h[4];
        for (int i = 0; i < 4; ++i) memcpy(&h[i], p + i * bytes + qh_off, 4);
        const __m512i sixteen = _mm512_set1_epi8(0x10);
        u01 = _mm512_or_si512(u01, _mm512_maskz_mov_epi8(_cvtu64_mask64(h[0] | (uint64_t)h[1] << 32), sixteen));
        u23 = _mm512_or_si512(u23, _mm512_maskz_mov_epi8(_cvtu64_mask64(h[2] | (uint64_t)h[3] << 32), sixteen));
    }
    _mm512_storeu_si512((void *)u, u01);
    _mm512_storeu_si512((void *)(u + 64), u23);
}
#elif defined(MINISGL_AVX2)
#define SCALE_CHUNK 8
static inline void scales_chunk(const uint8_t *p, int bytes, float bias_of_d, float *sc, float *bi) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bytes));
    const __m256i w = _mm256_i32gather_epi32((const int *)p, idx, 1);
    /* the low halves (d) and the high halves (m) of the 8 words, as 8 halves each */
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13,
                                          2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i t = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, pick), 0xD8); /* [d0..7 | m0..7] */
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(t));
    const __m256 b = isnan(bias_of_d) ? _mm256_cvtph_ps(_mm256_extracti128_si256(t, 1))
                                      : _mm256_mul_ps(_mm256_set1_ps(bias_of_d), d);
    const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    _mm256_storeu_ps(sc, _mm256_permutevar8x32_ps(d, lo));
    _mm256_storeu_ps(sc + 8, _mm256_permutevar8x32_ps(d, hi));
    _mm256_storeu_ps(bi, _mm256_permutevar8x32_ps(b, lo));
    _mm256_storeu_ps(bi + 8, _mm256_permutevar8x32_ps(b, hi));
}

static inline void nibbles_4blocks(const uint8_t *p, int bytes, int off, int qh_off, uint8_t *u) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 4; i += 2) {
        const __m256i v = _mm256_loadu2_m128i((const __m128i *)(p + (i + 1) * bytes + off), (const __m128i *)(p + i * bytes + off));
        const __m256i L = _mm256_and_si256(v, m), H = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
        _mm256_storeu_si256((__m256i *)(u + 32 * i), _mm256_permute2x128_si256(L, H, 0x20));
        _mm256_storeu_si256((__m256i *)(u + 32 * i + 32), _mm256_permute2x128_si256(L, H, 0x31));
    }
    if (qh_off >= 0)
        for (int i = 0; i < 4; ++i) {
            uint32_t h;
            memcpy(&h, p + i * bytes + qh_off, 4);
            fifth_bits32(h, u + 32 * i);
        }
}
#endif

/* Decodes an integer-format row; returns the row's kind (see Decoded). signed8: Q8_0 as int8 */
static int decode_row(int fmt, const uint8_t *p, int64_t K, Decoded *r, int signed8) {
    p = plain_row(&fmt, p, K);
    if (p == NULL) { /* no memory for the copy: NaN scales, never silently zeros */
        memset(r->u, 0, (size_t)K);
        for (int64_t c = 0; c < K / 16; ++c) r->sc[c] = NAN, r->bi[c] = 0.f;
        return 1;
    }
    uint8_t *u = r->u;
    float *sc = r->sc, *bi = r->bi;
    switch (fmt) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
        const int has_min = fmt == Q4_1 || fmt == Q5_1, five = fmt == Q5_0 || fmt == Q5_1;
        const int bytes = fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : fmt == Q5_0 ? 22 : 24;
        int64_t b = 0;
#ifdef SCALE_CHUNK
        const float bias_of_d = has_min ? NAN : (five ? -16.f : -8.f);
        const int off = 2 + 2 * has_min + 4 * five, qh_off = five ? 2 + 2 * has_min : -1;
        for (; b + SCALE_CHUNK <= K / 32; b += SCALE_CHUNK, p += SCALE_CHUNK * bytes) {
            scales_chunk(p, bytes, bias_of_d, sc + 2 * b, bi + 2 * b);
            for (int i = 0; i < SCALE_CHUNK; i += 4) nibbles_4blocks(p + i * bytes, bytes, off, qh_off, u + 32 * (b + i));
        }
#endif
        for (; b < K / 32; ++b, p += bytes) {
            const float d = load_half(p);
            nibbles32(p + 2 + 2 * has_min + 4 * five, u + 32 * b);
            if (five) {
                uint32_t qh;
                memcpy(&qh, p + 2 + 2 * has_min, 4);
                fifth_bits32(qh, u + 32 * b);
            }
            set16(sc, bi, 2 * b, d, has_min ? load_half(p + 2) : (five ? -16.f : -8.f) * d);
        }
        return 1;
    }
    case Q8_0: {
        int64_t b = 0;
#ifdef SCALE_CHUNK
        for (; b + SCALE_CHUNK <= K / 32; b += SCALE_CHUNK, p += SCALE_CHUNK * 34) {
            scales_chunk(p, 34, signed8 ? 0.f : -128.f, sc + 2 * b, bi + 2 * b);
            for (int i = 0; i < SCALE_CHUNK; ++i) bytes32(p + 34 * i + 2, signed8 ? 0 : 0x80, u + 32 * (b + i));
        }
#endif
        for (; b < K / 32; ++b, p += 34) {
            const float d = load_half(p);
            bytes32(p + 2, signed8 ? 0 : 0x80, u + 32 * b);
            set16(sc, bi, 2 * b, d, signed8 ? 0.f : -128.f * d);
        }
        return signed8 ? 2 : 1;
    }
    case Q4_K: case Q5_K: {
        const int five = fmt == Q5_K;
        for (int64_t b = 0; b < K / 256; ++b, p += five ? 176 : 144) {
            const float d = load_half(p), dmin = load_half(p + 2);
            const uint8_t *qs = p + (five ? 48 : 16);
            for (int j = 0; j < 8; j += 2)
                k_pair(qs + 16 * j, five ? p + 16 : NULL, j, u + 256 * b + 32 * j, u + 256 * b + 32 * j + 32);
            for (int j = 0; j < 8; ++j) {
                int s, m;
                k_scale_min(j, p + 4, &s, &m);
                set16(sc, bi, 16 * b + 2 * j, d * (float)s, -(dmin * (float)m));
            }
        }
        return 1;
    }
    case Q6_K:
        for (int64_t b = 0; b < K / 256; ++b, p += 210) {
            const float d = load_half(p + 208);
            const int8_t *scales = (const int8_t *)(p + 192);
            q6_half(p, p + 128, u + 256 * b);
            q6_half(p + 64, p + 160, u + 256 * b + 128);
            for (int g = 0; g < 16; ++g) {
                const float s = d * (float)scales[g];
                sc[16 * b + g] = s;
                bi[16 * b + g] = -32.f * s;
            }
        }
        return 1;
    }
    return 0;
}

/* ---- activations ----------------------------------------------------------------------------------
 * For each row: xf (K floats, after the pre-op), and for the integer path qx (K64 int8, zero past K),
 * dx (K64 / 16 scales, one per 16) and xs (C16 floats: dx times the sum of each 16 qx, zero past
 * K / 16). */

typedef struct {
    int64_t K, K64, C16; /* C16: K64 / 16 rounded up to 16 (the bias sums run 16 at a time) */
    const float *xf;     /* (M, ldf) */
    int64_t ldf;
    int8_t *qx; /* (M, K64) */
    float *dx;  /* (M, K64 / 16) */
    float *xs;  /* (M, C16) */
} Acts;

#if defined(MINISGL_AVX512)
/* exp(x) for 16 floats (the polynomial of cpu_kernels.c's exp8) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#elif defined(MINISGL_AVX2)
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* o[0..K) = silu(g) * up = g / (1 + exp(-g)) * up */
static void silu_mul_row(const float *restrict g, const float *restrict up, int64_t K, float *restrict o) {
    int64_t i = 0;
#if defined(MINISGL_AVX512)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= K; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
    }
#elif defined(MINISGL_AVX2)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= K; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < K; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * up[i];
}

/* o[0..K) = w * (x * rsqrt(mean(x^2) + eps)) */
static void rmsnorm_row(const float *restrict x, const float *restrict w, float eps, int64_t K, float *restrict o) {
    float ss = 0.f;
    int64_t i = 0;
#if defined(MINISGL_AVX512)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= K; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; i < K; ++i) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)K + eps);
    for (i = 0; i < K; ++i) o[i] = w[i] * (x[i] * r);
}

/* Quantizes one row of floats (K of them) into qx/dx/xs, per block of 16: dx = max|x| / 127,
 * qx = round(x / dx) to nearest, ties to even (x times 1 / dx, as llama.cpp does). */
static void quantize_row(const float *restrict x, int64_t K, int64_t K64, int64_t C16, int8_t *restrict qx,
                         float *restrict dx, float *restrict xs) {
    int64_t b = 0;
#if defined(MINISGL_AVX512)
    for (; b < K / 16; ++b) {
        const __m512 v = _mm512_loadu_ps(x + 16 * b);
        const float d = _mm512_reduce_max_ps(_mm512_abs_ps(v)) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(qx + 16 * b), _mm512_cvtepi32_epi8(q));
        dx[b] = d;
        xs[b] = d * (float)_mm512_reduce_add_epi32(q);
    }
#elif defined(MINISGL_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (; b < K / 16; ++b) {
        const __m256 v0 = _mm256_loadu_ps(x + 16 * b), v1 = _mm256_loadu_ps(x + 16 * b + 8);
        const __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float d = _mm_cvtss_f32(h) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, _mm256_set1_ps(id)));
        const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, _mm256_set1_ps(id)));
        /* |q| <= 127: the packs saturate nothing; dwords q0[0..3], q1[0..3] | q0[4..7], q1[4..7] reordered */
        const __m256i p16 = _mm256_packs_epi32(q0, q1), p8 = _mm256_packs_epi16(p16, p16);
        const __m256i ord = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
        _mm_storeu_si128((__m128i *)(qx + 16 * b), _mm256_castsi256_si128(ord));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(q0, q1)), _mm256_extracti128_si256(_mm256_add_epi32(q0, q1), 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        dx[b] = d;
        xs[b] = d * (float)_mm_cvtsi128_si32(t);
    }
#endif
    for (; b < K64 / 16; ++b) {
        const int64_t n = K - 16 * b >= 16 ? 16 : (K - 16 * b > 0 ? K - 16 * b : 0);
        float amax = 0.f;
        for (int64_t j = 0; j < n; ++j) amax = fabsf(x[16 * b + j]) > amax ? fabsf(x[16 * b + j]) : amax;
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int64_t j = 0; j < 16; ++j) {
            const int q = j < n ? (int)nearbyintf(x[16 * b + j] * id) : 0;
            qx[16 * b + j] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        xs[b] = d * (float)sum;
    }
    for (int64_t c = K64 / 16; c < C16; ++c) xs[c] = 0.f;
}

/* ---- the integer micro-kernel: MICRO_ROWS decoded rows x R activation rows -> out[w][a] ----------- */

#if defined(MINISGL_AVX512)
#define DEFINE_INT_DOT(R)                                                                                   \
    static void int_dot_##R(const Decoded *rw, const Acts *A, int64_t a0, float out[MICRO_ROWS][MICRO_ACTS]) { \
        const __m512i zero = _mm512_setzero_si512();                                                       \
        const __m512i idx_sc = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);           \
        __m512 acc[MICRO_ROWS][R];                                                                         \
        for (int w = 0; w < MICRO_ROWS; ++w)                                                               \
            for (int a = 0; a < R; ++a) acc[w][a] = _mm512_setzero_ps();                                   \
        const int8_t *qx = A->qx + a0 * A->K64;                                                            \
        const float *dx = A->dx + a0 * (A->K64 / 16);                                                      \
        for (int64_t g = 0; g < A->K64 / 64; ++g) {                                                        \
            __m512i xv[R];                                                                                 \
            __m512 dv[R];                                                                                  \
            for (int a = 0; a < R; ++a) {                                                                  \
                xv[a] = _mm512_loadu_si512((const void *)(qx + a * A->K64 + 64 * g));                      \
                const __m128 d4 = _mm_loadu_ps(dx + a * (A->K64 / 16) + 4 * g);                           \
                dv[a] = _mm512_permutexvar_ps(idx_sc, _mm512_castps128_ps512(d4));                         \
            }                                                                                              \
            for (int w = 0; w < MICRO_ROWS; ++w) {                                                         \
                const __m512i z = _mm512_loadu_si512((const void *)(rw[w].u + 64 * g));                    \
                const __m512 s = _mm512_permutexvar_ps(idx_sc, _mm512_castps128_ps512(_mm_loadu_ps(rw[w].sc + 4 * g))); \
                for (int a = 0; a < R; ++a)                                                                \
                    acc[w][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, z, xv[a])),   \
                                                _mm512_mul_ps(s, dv[a]), acc[w][a]);                       \
            }                                                                                              \
        }                                                                                                  \
        for (int w = 0; w < MICRO_ROWS; ++w)                                                               \
            for (int a = 0; a < R; ++a) {                                                                  \
                const float *xs = A->xs + (a0 + a) * A->C16;                                               \
                __m512 b = _mm512_setzero_ps();                                                            \
                for (int64_t c = 0; c < A->C16; c += 16)                                                   \
                    b = _mm512_fmadd_ps(_mm512_loadu_ps(rw[w].bi + c), _mm512_loadu_ps(xs + c), b);        \
                out[w][a] = _mm512_reduce_add_ps(acc[w][a]) + _mm512_reduce_add_ps(b);                     \
            }                                                                                              \
    }
DEFINE_INT_DOT(1)
DEFINE_INT_DOT(2)
DEFINE_INT_DOT(3)
DEFINE_INT_DOT(4)

#elif defined(MINISGL_AVX2)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* vpmaddubsw multiplies unsigned by signed bytes and saturates pairs at int16: fine for u < 64 (the
 * 4-6 bit formats); Q8_0's signed bytes go by the sign trick, |w| * (x signed by w). SIGNED says
 * whether any row of the tile is Q8_0 (the trick is exact for the others too: their u >= 0). */
#define DEFINE_INT_DOT(R, SIGNED)                                                                           \
    static void int_dot_##R##_##SIGNED(const Decoded *rw, const Acts *A, int64_t a0,                       \
                                       float out[MICRO_ROWS][MICRO_ACTS]) {                                \
        const __m256i ones = _mm256_set1_epi16(1);                                                         \
        const __m256i idx_sc = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);                                   \
        __m256 acc[MICRO_ROWS][R];                                                                         \
        for (int w = 0; w < MICRO_ROWS; ++w)                                                               \
            for (int a = 0; a < R; ++a) acc[w][a] = _mm256_setzero_ps();                                   \
        const int8_t *qx = A->qx + a0 * A->K64;                                                            \
        const float *dx = A->dx + a0 * (A->K64 / 16);                                                      \
        for (int64_t b = 0; b < A->K64 / 32; ++b) {                                                        \
            __m256i xv[R];                                                                                 \
            __m256 dv[R];                                                                                  \
            for (int a = 0; a < R; ++a) {                                                                  \
                xv[a] = _mm256_loadu_si256((const __m256i *)(qx + a * A->K64 + 32 * b));                   \
                const __m128 d2 = _mm_castpd_ps(_mm_load_sd((const double *)(dx + a * (A->K64 / 16) + 2 * b))); \
                dv[a] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d2), idx_sc);                      \
            }                                                                                              \
            for (int w = 0; w < MICRO_ROWS; ++w) {                                                         \
                __m256i z = _mm256_loadu_si256((const __m256i *)(rw[w].u + 32 * b));                       \
                const __m128 s2 = _mm_castpd_ps(_mm_load_sd((const double *)(rw[w].sc + 2 * b)));         \
                const __m256 s = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s2), idx_sc);             \
                const __m256i zu = SIGNED ? _mm256_sign_epi8(z, z) : z;                                    \
                for (int a = 0; a < R; ++a) {                                                              \
                    const __m256i xa = SIGNED ? _mm256_sign_epi8(xv[a], z) : xv[a];                        \
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(zu, xa), ones);               \
                    acc[w][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s, dv[a]), acc[w][a]); \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int w = 0; w < MICRO_ROWS; ++w)                                                               \
            for (int a = 0; a < R; ++a) {                                                                  \
                const float *xs = A->xs + (a0 + a) * A->C16;                                               \
                __m256 bsum = _mm256_setzero_ps();                                                         \
                for (int64_t c = 0; c < A->C16; c += 8)                                                    \
                    bsum = _mm256_fmadd_ps(_mm256_loadu_ps(rw[w].bi + c), _mm256_loadu_ps(xs + c), bsum);  \
                out[w][a] = hsum8(acc[w][a]) + hsum8(bsum);                                                \
            }                                                                                              \
    }
DEFINE_INT_DOT(1, 0)
DEFINE_INT_DOT(2, 0)
DEFINE_INT_DOT(1, 1)
DEFINE_INT_DOT(2, 1)

#else
/* Portable: exact integer sums per 16, then the float terms in order of k. */
static void int_dot(const Decoded *rw, const Acts *A, int64_t a0, int R, float out[MICRO_ROWS][MICRO_ACTS]) {
    for (int w = 0; w < MICRO_ROWS; ++w)
        for (int a = 0; a < R; ++a) {
            const int8_t *qx = A->qx + (a0 + a) * A->K64;
            const float *dx = A->dx + (a0 + a) * (A->K64 / 16), *xs = A->xs + (a0 + a) * A->C16;
            float acc = 0.f, accb = 0.f;
            for (int64_t c = 0; c < A->K64 / 16; ++c) {
                int32_t s = 0;
                for (int j = 0; j < 16; ++j) {
                    const int wu = rw[w].kind == 2 ? (int)(int8_t)rw[w].u[16 * c + j] : (int)rw[w].u[16 * c + j];
                    s += wu * (int)qx[16 * c + j];
                }
                acc += (float)s * (rw[w].sc[c] * dx[c]);
                accb += rw[w].bi[c] * xs[c];
            }
            out[w][a] = acc + accb;
        }
}
#endif

static void int_micro(const Decoded *rw, const Acts *A, int64_t a0, int R, float out[MICRO_ROWS][MICRO_ACTS]) {
#if defined(MINISGL_AVX512)
    switch (R) {
    case 4: int_dot_4(rw, A, a0, out); break;
    case 3: int_dot_3(rw, A, a0, out); break;
    case 2: int_dot_2(rw, A, a0, out); break;
    default: int_dot_1(rw, A, a0, out); break;
    }
#elif defined(MINISGL_AVX2)
    int sgn = 0;
    for (int w = 0; w < MICRO_ROWS; ++w) sgn |= rw[w].kind == 2;
    if (sgn) (R == 2 ? int_dot_2_1 : int_dot_1_1)(rw, A, a0, out);
    else (R == 2 ? int_dot_2_0 : int_dot_1_0)(rw, A, a0, out);
#else
    int_dot(rw, A, a0, R, out);
#endif
}

/* ---- the float micro-kernel: one F32/F16/BF16 row x R activation rows -------------------------- */

static void float_dot(int fmt, const uint8_t *p, const Acts *A, int64_t a0, int R, float out[MICRO_ACTS]) {
    const int64_t K = A->K;
    int64_t k = 0;
    float tail[MICRO_ACTS] = {0.f};
#if defined(MINISGL_AVX512)
    __m512 acc[MICRO_ACTS];
    for (int a = 0; a < R; ++a) acc[a] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        __m512 wv;
        if (fmt == F32) wv = _mm512_loadu_ps((const float *)p + k);
        else if (fmt == F16) wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * k)));
        else wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 2 * k))), 16));
        for (int a = 0; a < R; ++a) acc[a] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(A->xf + (a0 + a) * A->ldf + k), acc[a]);
    }
    for (int a = 0; a < R; ++a) tail[a] = _mm512_reduce_add_ps(acc[a]);
#elif defined(MINISGL_AVX2)
    __m256 acc[MICRO_ACTS];
    for (int a = 0; a < R; ++a) acc[a] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        __m256 wv;
        if (fmt == F32) wv = _mm256_loadu_ps((const float *)p + k);
        else if (fmt == F16) wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * k)));
        else wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 2 * k))), 16));
        for (int a = 0; a < R; ++a) acc[a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(A->xf + (a0 + a) * A->ldf + k), acc[a]);
    }
    for (int a = 0; a < R; ++a) tail[a] = hsum8(acc[a]);
#endif
    for (; k < K; ++k) {
        float wk;
        if (fmt == F32) memcpy(&wk, p + 4 * k, 4);
        else {
            uint16_t h;
            memcpy(&h, p + 2 * k, 2);
            wk = fmt == F16 ? half_to_float(h) : bf16_to_float(h);
        }
        for (int a = 0; a < R; ++a) tail[a] += wk * A->xf[(a0 + a) * A->ldf + k];
    }
    for (int a = 0; a < R; ++a) out[a] = tail[a];
}

/* ---- the driver --------------------------------------------------------------------------------- */

static inline void put(float *y, int64_t ldy, int64_t a, int64_t n, float v, const float *bias, int accumulate) {
    if (bias != NULL) v = v + bias[n];
    float *o = y + a * ldy + n;
    *o = accumulate ? *o + v : v;
}

/* Asks for rows n0 .. n0 + TILE_ROWS ahead of their use: weights stream from memory once per call,
 * and the rows of a tile need not be adjacent (permuted or fused parts), which the hardware
 * prefetcher cannot guess. */
static void prefetch_rows(const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, int64_t n0, int64_t count,
                          int64_t K) {
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
    for (int64_t n = n0; n < n0 + count && n < N; ++n) {
        const int bs = block_size(row_fmts[n]);
        const int64_t bytes = K / bs * type_size(row_fmts[n]);
        const char *p = (const char *)(intptr_t)row_ptrs[n];
        for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
#else
    (void)row_ptrs, (void)row_fmts, (void)N, (void)n0, (void)count, (void)K;
#endif
}

/* ---- decode passes over the 32-weight block formats (AVX-512, AVX2): straight from the blocks -----
 * Where every row of a weight is Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 (the embedded model's formats and
 * llama.cpp's legacy quants), decode passes skip the decoded tiles above: each row is read once from
 * its blocks, two blocks (64 weights) per step, unpacked in registers to unsigned bytes (nibbles,
 * fifth bits, or Q8_0's q + 128), vpdpbusd against the activations' int8, and each int32 lane scaled
 * by its block's d times its 16 activations' dx. Q4_0/Q4_1 keep each high nibble in place (16 q: one
 * AND unpacks a step) and their lanes of high nibbles take dx / 16 instead, which gives the same
 * float products as shifting (powers of two are exact). The blocks' f16 d (and m) are read 16
 * blocks at a time with plain loads and word permutes (a vpgatherdd per 16 blocks cost more than the
 * dot products of a K = 576 row: the Q8_0 LM head is 9-15% faster without); the offsets (Q4_1/Q5_1's m; -8 d, -16 d, -128 d for the others) add m_b times the
 * block's sum of quantized activations into the same accumulator once per 16 blocks. A micro-tile
 * is a few rows of one format against a few activation rows; each (row, activation) pair is one
 * fixed sequence of operations whatever M, the tile or the thread count, so decode rows stay
 * batch-invariant. The AVX2 build has its own micro-tiles for Q4_0, Q4_1 and Q8_0 (below); before
 * them its decode passes decoded tiles of rows to memory and read them back, 2.2x the step time at
 * batch 1 on a 2-core AMD EPYC (Zen 1). */
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
#define DIRECT_RUN 4 /* rows of one format taken together */
#ifndef DIRECT_STREAMS
#define DIRECT_STREAMS 4 /* places of a weight read side by side (a multiple of DIRECT_RUN) */
#endif

typedef struct {
    int64_t K64, NB16;  /* NB16: K / 32 blocks rounded up to 16 */
    const int8_t *qx;   /* (M, K64), zero past K */
    const float *dxl;   /* (M, K64 / 4): each 16 values' dx, once per int32 lane */
    const float *dxl16; /* the same with the second 16 of each block's dx / 16 (Q4_0/Q4_1's high nibbles) */
    const float *xsb;   /* (M, NB16): each block's sum of quantized activations, zero past K / 32 */
} DirectActs;

#if defined(MINISGL_AVX512)
static inline int is_direct_fmt(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1 || fmt == Q8_0; }
#else
static inline int is_direct_fmt(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0; }
#endif

static int direct_weight(const int32_t *row_fmts, int64_t N) {
    for (int64_t n = 0; n < N; ++n)
        if (!is_direct_fmt(row_fmts[n])) return 0;
    return 1;
}

/* A micro-tile: rows[0..NR) against activation rows a0.. of X (its kernel's own activations) */
typedef void (*MicroFn)(const uint8_t *const *rows, int64_t nb, const void *X, int64_t a0, float out[][4]);
/* the micro-tile of a kernel for a format and na (1-4) activation rows */
typedef MicroFn (*PickFn)(int fmt, int na);
/* one micro-tile function: each build's direct_micro_impl (below) for a format and shape */
#define DIRECT_FN(F, NR, NA)                                                                                 \
    static void direct_##F##_##NR##x##NA(const uint8_t *const *rows, int64_t nb, const void *X, int64_t a0,     \
                                         float out[][4]) {                                                     \
        direct_micro_impl(F, NR, NA, rows, nb, (const DirectActs *)X, a0, out);                                \
    }
#if defined(MINISGL_AVX512)
/* the offset of a block format as a multiple of its d, or NAN where the block holds an f16 m after d */
static inline float direct_bias_of_d(int fmt) {
    return fmt == Q4_0 ? -8.f : fmt == Q5_0 ? -16.f : fmt == Q8_0 ? -128.f : NAN;
}

/* u of blocks b and b + 1 at p (TWO: whether block b + 1 is in the row) as 64 unsigned bytes in
 * weight order (Q4_0/Q4_1: the second 16 of each block as 16 q); past the row's last block, zeros
 * (Q8_0: 128s, against zero activations) */
static inline __attribute__((always_inline)) __m512i direct_unpack(const int fmt, const uint8_t *p, const int TWO) {
    if (fmt == Q8_0) {
        __m512i v = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2)));
        if (TWO) v = _mm512_inserti64x4(v, _mm256_loadu_si256((const __m256i *)(p + 36)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    const int bytes = type_size(fmt), has_min = fmt == Q4_1 || fmt == Q5_1, five = fmt == Q5_0 || fmt == Q5_1;
    const int off = 2 + 2 * has_min + 4 * five;
    /* 128-bit lanes [q_b, q_b, q_b+1, q_b+1]: lanes 0 and 2 keep the low nibbles, 1 and 3 the high */
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + off)));
    if (TWO) v = _mm512_mask_broadcast_i32x4(v, 0xFF00, _mm_loadu_si128((const __m128i *)(p + bytes + off)));
    else v = _mm512_maskz_mov_epi64(0x0F, v);
    if (!five) return _mm512_and_si512(v, _mm512_setr_epi64(0x0F0F0F0F0F0F0F0F, 0x0F0F0F0F0F0F0F0F, (long long)0xF0F0F0F0F0F0F0F0,
                                                            (long long)0xF0F0F0F0F0F0F0F0, 0x0F0F0F0F0F0F0F0F, 0x0F0F0F0F0F0F0F0F,
                                                            (long long)0xF0F0F0F0F0F0F0F0, (long long)0xF0F0F0F0F0F0F0F0));
    v = _mm512_mask_srli_epi16(v, (__mmask32)0xFF00FF00u, v, 4);
    uint32_t h0, h1 = 0;
    memcpy(&h0, p + 2 + 2 * has_min, 4);
    if (TWO) memcpy(&h1, p + bytes + 2 + 2 * has_min, 4);
    return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi8(0x0F)),
                           _mm512_maskz_mov_epi8(_cvtu64_mask64(h0 | (uint64_t)h1 << 32), _mm512_set1_epi8(0x10)));
}

/* Where the headers of 16 blocks lie in the 64-byte registers that cover them: a block's d is the
 * 16-bit word (bytes / 2) j of the chunk, its m (Q4_1, Q5_1) the word after. For register pair k
 * (words 64 k .. 64 k + 63), idx[k] moves d_j to word j and m_j to word 16 + j, and mask[k] says
 * which words that pair holds. */
#define SCALE_PAIRS 5 /* Q8_0: 16 x 34 bytes = 8.5 registers */
typedef struct {
    __m512i idx[SCALE_PAIRS];
    __mmask32 mask[SCALE_PAIRS];
} ScaleWords;

static inline __attribute__((always_inline)) ScaleWords scale_words(const int fmt) {
    const int half = type_size(fmt) / 2, has_min = fmt == Q4_1 || fmt == Q5_1;
    ScaleWords t;
    const __m512i j = _mm512_and_si512(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15,
                                                        14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                       _mm512_set1_epi16(15));
    __m512i w = _mm512_mullo_epi16(j, _mm512_set1_epi16((short)half)); /* words 0..15: d_j */
    w = _mm512_mask_add_epi16(w, has_min ? (__mmask32)0xFFFF0000u : 0, w, _mm512_set1_epi16(1));
    for (int k = 0; k < SCALE_PAIRS; ++k) {
        const __m512i local = _mm512_sub_epi16(w, _mm512_set1_epi16((short)(64 * k)));
        t.mask[k] = _mm512_cmpge_epi16_mask(local, _mm512_setzero_si512()) &
                    _mm512_cmplt_epi16_mask(local, _mm512_set1_epi16(64));
        if (!has_min) t.mask[k] &= 0xFFFFu;
        t.idx[k] = local;
    }
    return t;
}

/* d and the offset m of `n` (<= 16) blocks at p, zeros past them; plain (masked) loads of the chunk
 * and word permutes: no gather, no load past the n blocks */
static inline __attribute__((always_inline)) void direct_scales(const int fmt, const uint8_t *p, int64_t n,
                                                                 const ScaleWords *t, __m512 *d, __m512 *m) {
    const int bytes = type_size(fmt);
    const int regs = (16 * bytes + 63) / 64;
    const int64_t avail = n * bytes;
    __m512i words = _mm512_setzero_si512();
    for (int k = 0; 2 * k < regs && 128 * k < avail; ++k) { /* a short tail (K = 576: 16 + 2) takes one pair */
        __m512i v[2];
        for (int h = 0; h < 2; ++h) {
            const int64_t r = 2 * k + h, left = avail - 64 * r;
            v[h] = r >= regs || left <= 0 ? _mm512_setzero_si512()
                   : left >= 64          ? _mm512_loadu_si512((const void *)(p + 64 * r))
                                         : _mm512_maskz_loadu_epi8((__mmask64)((1ull << left) - 1), (const void *)(p + 64 * r));
        }
        words = _mm512_mask_blend_epi16(t->mask[k], words, _mm512_permutex2var_epi16(v[0], t->idx[k], v[1]));
    }
    *d = _mm512_cvtph_ps(_mm512_castsi512_si256(words));
    const float bias_of_d = direct_bias_of_d(fmt);
    *m = isnan(bias_of_d) ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(words, 1)) : _mm512_mul_ps(_mm512_set1_ps(bias_of_d), *d);
}

/* One step (blocks b, b + 1) of NR rows against NA activation rows */
static inline __attribute__((always_inline)) void direct_step(const int fmt, const int NR, const int NA, const int TWO,
                                                               const uint8_t *const *rows, int64_t b, const __m512 *d,
                                                               __m512i idx, const DirectActs *X, int64_t a0, __m512 acc[][4]) {
    const int bytes = type_size(fmt);
    const float *dxl = fmt == Q4_0 || fmt == Q4_1 ? X->dxl16 : X->dxl;
    __m512i u[4];
    __m512 sd[4];
    for (int r = 0; r < NR; ++r) {
        u[r] = direct_unpack(fmt, rows[r] + b * bytes, TWO);
        sd[r] = _mm512_permutexvar_ps(idx, d[r]);
    }
    for (int a = 0; a < NA; ++a) {
        const __m512i xv = _mm512_loadu_si512((const void *)(X->qx + (a0 + a) * X->K64 + 32 * b));
        const __m512 dl = _mm512_loadu_ps(dxl + (a0 + a) * (X->K64 / 4) + 8 * b);
        for (int r = 0; r < NR; ++r)
            acc[r][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[r], xv)),
                                        _mm512_mul_ps(sd[r], dl), acc[r][a]);
    }
}

/* sums[k] = the sum of v[k]'s 16 lanes, for 16 vectors at once: a transpose as it adds, with each
 * vector's lanes paired exactly as _mm512_reduce_add_ps pairs them (j + 8, then + 4, + 2, + 1), so
 * the sums are bitwise those of 16 separate reductions (45 operations against ~130). */
static inline __attribute__((always_inline)) void reduce16(const __m512 v[16], float sums[16]) {
    __m512 w[8], x[4], u[2];
    for (int i = 0; i < 8; ++i) /* lanes 0-7: v[2i] j + j + 8; 8-15: v[2i + 1] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i) /* 128-bit lane L: v[4i + L] j + j + 4 */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i) /* lane L: v[8i + L] (0 + 2, 1 + 3), v[8i + 4 + L] (the same) */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    /* lane 4 L + j: v[L + 4 j] */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
    float t[16];
    _mm512_storeu_ps(t, r);
    for (int L = 0; L < 4; ++L)
        for (int j = 0; j < 4; ++j) sums[L + 4 * j] = t[4 * L + j];
}

/* out[r][a] = the sum of acc[r][a]'s 16 lanes, paired as _mm512_reduce_add_ps pairs them whatever the
 * tile (one transposing tree for tiles of 8 pairs or more), so a pair's sum never depends on its tile */
static inline __attribute__((always_inline)) void tile_sums(const int NR, const int NA, const __m512 acc[][4],
                                                             float out[][4]) {
    if (NR * NA < 8) {
        for (int r = 0; r < NR; ++r)
            for (int a = 0; a < NA; ++a) out[r][a] = _mm512_reduce_add_ps(acc[r][a]);
        return;
    }
    __m512 v[16];
    for (int k = 0; k < 16; ++k) v[k] = k < NR * NA ? acc[k / NA][k % NA] : _mm512_setzero_ps();
    float sums[16];
    reduce16(v, sums);
    for (int k = 0; k < NR * NA; ++k) out[k / NA][k % NA] = sums[k];
}

/* rows[0..NR) (one format) against activation rows a0 .. a0 + NA of X, nb blocks -> out[r][a] */
static inline __attribute__((always_inline)) void direct_micro_impl(const int fmt, const int NR, const int NA,
                                                                     const uint8_t *const *rows, int64_t nb,
                                                                     const DirectActs *X, int64_t a0, float out[][4]) {
    const int bytes = type_size(fmt);
    const ScaleWords words = scale_words(fmt);
    const __m512i idx_pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), two = _mm512_set1_epi32(2);
    __m512 acc[4][4];
    for (int r = 0; r < NR; ++r)
        for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 16) {
        const int64_t n = nb - c < 16 ? nb - c : 16;
        __m512 d[4], m[4];
        for (int r = 0; r < NR; ++r) direct_scales(fmt, rows[r] + c * bytes, n, &words, &d[r], &m[r]);
        for (int a = 0; a < NA; ++a) {
            const __m512 xs = _mm512_loadu_ps(X->xsb + (a0 + a) * X->NB16 + c);
            for (int r = 0; r < NR; ++r) acc[r][a] = _mm512_fmadd_ps(m[r], xs, acc[r][a]);
        }
        __m512i idx = idx_pair;
        int64_t j = 0;
        for (; j + 2 <= n; j += 2, idx = _mm512_add_epi32(idx, two))
            direct_step(fmt, NR, NA, 1, rows, c + j, d, idx, X, a0, acc);
        if (j < n) direct_step(fmt, NR, NA, 0, rows, c + j, d, idx, X, a0, acc);
    }
    tile_sums(NR, NA, acc, out);
}

/* The micro-tiles, one function per format and shape (NR rows x NA activations: 4 x 1, 4 x 2, 2 x 3
 * and 4 x 4 keep their sums in registers; 4 x 4 against 2 x 4: 8-10% less time at M = 16). */
#define DIRECT_FNS(F) DIRECT_FN(F, 4, 1) DIRECT_FN(F, 4, 2) DIRECT_FN(F, 2, 3) DIRECT_FN(F, 4, 4)
DIRECT_FNS(Q4_0)
DIRECT_FNS(Q4_1)
DIRECT_FNS(Q5_0)
DIRECT_FNS(Q5_1)
DIRECT_FNS(Q8_0)
#define DIRECT_TABLE(F) [F] = {direct_##F##_4x1, direct_##F##_4x2, direct_##F##_2x3, direct_##F##_4x4}
static const MicroFn direct_fns[Q8_0 + 1][4] = {DIRECT_TABLE(Q4_0), DIRECT_TABLE(Q4_1), DIRECT_TABLE(Q5_0),
                                                 DIRECT_TABLE(Q5_1), DIRECT_TABLE(Q8_0)};
static MicroFn direct_pick(int fmt, int na) { return direct_fns[fmt][na - 1]; }
#else
/* AVX2 (no VNNI): a step is one block (32 weights) of NR rows against NA activation rows. A row's
 * block is unpacked in registers (Q4_0/Q4_1: the low nibbles are weights 0-15, the high ones 16-31;
 * Q8_0: its signed bytes), vpmaddubsw multiplies the unsigned weights by the activations' int8 (Q8_0
 * by the sign trick, |w| times x signed by w: its u + 128 would saturate the int16 pair sums) and
 * vpmaddwd sums them into 8 int32 lanes, lanes 0-3 the block's first 16 and 4-7 its second: each is
 * scaled by d times its 16 activations' dx (`dxl` holds them lane by lane). The offsets (Q4_1's m,
 * Q4_0's -8 d) go in once per 8 blocks, times the blocks' sums of quantized activations. As for
 * AVX-512, each (row, activation) pair is one fixed sequence of operations whatever the tile. */
/* the f16 words at p, p + stride, ... (n <= 8 of them) as 8 floats, zeros past n; lane inserts, not
 * 2-byte stores read back as one vector (a stalled store forward: 1.75x the whole kernel's time) */
static inline __attribute__((always_inline)) __m256 half8(const uint8_t *p, int64_t stride, int n) {
    __m128i h = _mm_setzero_si128();
    uint16_t v;
#define HALF_LANE(i)                                      \
    if (i < n) {                                          \
        memcpy(&v, p + (i) * stride, 2);                  \
        h = _mm_insert_epi16(h, v, i);                    \
    }
    HALF_LANE(0) HALF_LANE(1) HALF_LANE(2) HALF_LANE(3) HALF_LANE(4) HALF_LANE(5) HALF_LANE(6) HALF_LANE(7)
#undef HALF_LANE
    return _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void direct_micro_impl(const int fmt, const int NR, const int NA,
                                                                     const uint8_t *const *rows, int64_t nb,
                                                                     const DirectActs *X, int64_t a0, float out[][4]) {
    const int bytes = type_size(fmt), off = fmt == Q4_1 ? 4 : 2;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4][4];
    for (int r = 0; r < NR; ++r)
        for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nb; c += 8) {
        const int n = nb - c < 8 ? (int)(nb - c) : 8;
        float d[4][8]; /* the 8 blocks' d, read back one at a time (a broadcast load: no lane permute) */
        for (int r = 0; r < NR; ++r) {
            const __m256 dr = half8(rows[r] + c * bytes, bytes, n);
            _mm256_storeu_ps(d[r], dr);
            if (fmt == Q8_0) continue;
            const __m256 m = fmt == Q4_1 ? half8(rows[r] + c * bytes + 2, bytes, n) : _mm256_mul_ps(_mm256_set1_ps(-8.f), dr);
            for (int a = 0; a < NA; ++a)
                acc[r][a] = _mm256_fmadd_ps(m, _mm256_loadu_ps(X->xsb + (a0 + a) * X->NB16 + c), acc[r][a]);
        }
        for (int j = 0; j < n; ++j) {
            const int64_t b = c + j;
            __m256i u[4];
            __m256 sd[4];
            for (int r = 0; r < NR; ++r) {
                const uint8_t *p = rows[r] + b * bytes;
                if (fmt == Q8_0) {
                    u[r] = _mm256_loadu_si256((const __m256i *)(p + 2));
                } else {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(p + off));
                    u[r] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_and_si128(q, low4));
                }
                sd[r] = _mm256_broadcast_ss(&d[r][j]);
            }
            for (int a = 0; a < NA; ++a) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(X->qx + (a0 + a) * X->K64 + 32 * b));
                const __m256 dl = _mm256_loadu_ps(X->dxl + (a0 + a) * (X->K64 / 4) + 8 * b);
                for (int r = 0; r < NR; ++r) {
                    const __m256i prod = fmt == Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(u[r], u[r]), _mm256_sign_epi8(xv, u[r]))
                                                     : _mm256_maddubs_epi16(u[r], xv);
                    acc[r][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones)), _mm256_mul_ps(sd[r], dl), acc[r][a]);
                }
            }
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int a = 0; a < NA; ++a) out[r][a] = hsum8(acc[r][a]);
}

/* The micro-tiles (16 ymm registers: 4 x 1 and 2 x 2-4), one function per format and shape */
#define DIRECT_FNS(F) DIRECT_FN(F, 4, 1) DIRECT_FN(F, 2, 2) DIRECT_FN(F, 2, 3) DIRECT_FN(F, 2, 4)
DIRECT_FNS(Q4_0)
DIRECT_FNS(Q4_1)
DIRECT_FNS(Q8_0)
#define DIRECT_TABLE(F) [F] = {direct_##F##_4x1, direct_##F##_2x2, direct_##F##_2x3, direct_##F##_2x4}
static const MicroFn direct_fns[Q8_0 + 1][4] = {DIRECT_TABLE(Q4_0), DIRECT_TABLE(Q4_1), DIRECT_TABLE(Q8_0)};
static MicroFn direct_pick(int fmt, int na) { return direct_fns[fmt][na - 1]; }
#endif

static MicroFn rp_pick(int fmt, int na);

/* Rows idx[0..R) (R <= DIRECT_RUN, any formats) against all M activation rows: those of one format
 * go through `pick`'s micro-tiles together. */
static void micro_rows(PickFn pick, const int64_t *row_ptrs, const int32_t *row_fmts, const int64_t *idx, int R,
                       int64_t K, const void *X, int64_t M, const float *bias, float *y, int64_t ldy, int accumulate) {
    int done = 0; /* bit r: row idx[r] is computed */
    while (done != (1 << R) - 1) {
        int first = 0;
        while (done >> first & 1) ++first;
        const int fmt = row_fmts[idx[first]];
        int64_t n[DIRECT_RUN];
        int nr_fmt = 0;
        for (int r = first; r < R; ++r)
            if (!(done >> r & 1) && row_fmts[idx[r]] == fmt) {
                n[nr_fmt++] = idx[r];
                done |= 1 << r;
            }
        const uint8_t *rows[DIRECT_RUN]; /* repeats of the last row past the run: computed, not stored */
        for (int r = 0; r < DIRECT_RUN; ++r) rows[r] = (const uint8_t *)(intptr_t)row_ptrs[n[r < nr_fmt ? r : nr_fmt - 1]];
        float out[4][4];
        for (int64_t a0 = 0; a0 < M; a0 += 4) {
            const int na = M - a0 < 4 ? (int)(M - a0) : 4;
#if defined(MINISGL_AVX512)
            /* rows per call: Q8_0 rows (the LM head) in 2 x 4 tiles, see RP_TILES_Q8 */
            const int nr = na == 3 || (na == 4 && pick == rp_pick && fmt == Q8_0R) ? 2 : 4;
#else /* the repacked rows' tiles (4 x 1, 2 x 2, 1 x 3, 1 x 4), the direct kernel's (4 x 1, 2 x 2-4) */
            const int nr = na == 1 ? 4 : na == 2 || pick != rp_pick ? 2 : 1;
#endif
            for (int r0 = 0; r0 < nr_fmt; r0 += nr) {
                pick(fmt, na)(rows + r0, K / 32, X, a0, out);
                for (int r = 0; r < nr && r0 + r < nr_fmt; ++r)
                    for (int a = 0; a < na; ++a) put(y, ldy, a0 + a, n[r0 + r], out[r][a], bias, accumulate);
            }
        }
    }
}

/* Stripe t of a weight cut into DIRECT_STREAMS parts of L rows: rows t, L + t, 2 L + t, ... (those < N).
 * A thread's consecutive stripes read DIRECT_STREAMS places of the weight side by side: one core keeps
 * more reads in flight over a few sequential streams than over one (the 2-core Xeon: a read loop
 * 7.6 GB/s a thread over one stream, 13.7 over eight; the embedded model's decode matmuls 0.69-0.79x
 * the time with 4 places than with adjacent rows, 8, 12 or 16 places in between). */
static void micro_stripe(PickFn pick, const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, int64_t L,
                         int64_t t, int64_t K, const void *X, int64_t M, const float *bias, float *y, int64_t ldy,
                         int accumulate) {
    for (int s0 = 0; s0 < DIRECT_STREAMS; s0 += DIRECT_RUN) {
        int64_t idx[DIRECT_RUN];
        int R = 0;
        for (int s = s0; s < s0 + DIRECT_RUN; ++s)
            if (s * L + t < N) idx[R++] = s * L + t;
        if (R > 0) micro_rows(pick, row_ptrs, row_fmts, idx, R, K, X, M, bias, y, ldy, accumulate);
    }
}

/* The decode matmul over direct formats (see above); xf: the activations after the pre-op. */
static int qlinear_direct(const float *xf, int64_t ldf, int64_t M, int64_t K, const int64_t *row_ptrs,
                          const int32_t *row_fmts, int64_t N, const float *bias, float *y, int64_t ldy, int accumulate) {
    const int64_t K64 = round_up(K, 64), C16 = round_up(K64 / 16, 16), NB16 = round_up(K / 32, 16);
    const size_t per_row = (size_t)K64 + sizeof(float) * (size_t)(K64 / 16 + C16 + K64 / 2 + NB16);
    int owned;
    uint8_t *buf = (uint8_t *)scratch_get(0, per_row * (size_t)M, &owned);
    if (buf == NULL) return -2;
    float *dx = (float *)buf, *xs = dx + M * (K64 / 16), *dxl = xs + M * C16, *dxl16 = dxl + M * (K64 / 4);
    float *xsb = dxl16 + M * (K64 / 4);
    int8_t *qx = (int8_t *)(xsb + M * NB16);
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t a = 0; a < M; ++a) {
        float *dxa = dx + a * (K64 / 16), *xsa = xs + a * C16, *dla = dxl + a * (K64 / 4), *dla16 = dxl16 + a * (K64 / 4);
        float *xba = xsb + a * NB16;
        quantize_row(xf + a * ldf, K, K64, C16, qx + a * K64, dxa, xsa);
        for (int64_t c = 0; c < K64 / 16; ++c)
            for (int i = 0; i < 4; ++i) {
                dla[4 * c + i] = dxa[c];
                dla16[4 * c + i] = c % 2 ? dxa[c] * 0.0625f : dxa[c];
            }
        for (int64_t b = 0; b < NB16; ++b) xba[b] = b < K / 32 ? xsa[2 * b] + xsa[2 * b + 1] : 0.f;
    }
    const DirectActs X = {K64, NB16, qx, dxl, dxl16, xsb};
    const int64_t L = (N + DIRECT_STREAMS - 1) / DIRECT_STREAMS;
    /* guided: each thread starts on a long run of stripes (the streams stay sequential) and the runs
     * shrink, so a thread that another process preempted (the server's HTTP and tokenizer processes
     * share the 2 cores) leaves its last stripes to the other: 0.97x the step time at batch 1 (median
     * of 24 alternated pairs, with or without a 1.5 ms/10 ms load beside it) */
#pragma omp parallel for schedule(guided) if (L > 1 && M * N * K >= 32768)
    for (int64_t t = 0; t < L; ++t)
        micro_stripe(direct_pick, row_ptrs, row_fmts, N, L, t, K, &X, M, bias, y, ldy, accumulate);
    scratch_put(buf, owned);
    return 0;
}

#endif

#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
/* the activations of a decode pass over repacked rows (both builds' layout; see below) */
typedef struct {
    int64_t QB, SB; /* per activation row: bytes of qx, floats of each of dl, dl16, xs */
    const int8_t *qx;
    const float *dl, *dl16, *xs; /* per sub-group 16 lanes: dx (dl16: / 16 in the high halves), the sums */
    const int8_t *q4;            /* AVX2, Q4_0/Q4_1 rows: the same values in the Q4 lanes (see there) */
    const float *dl4, *xs4;
} RepackActs;

static void repack_act_sizes(int64_t nb, int64_t *qb, int64_t *sb) {
    int64_t q = 0, g = 0;
    for (int64_t g0 = 0; g0 < nb; ++g) {
        const int n = sub_group(nb, g0);
        q += 64 * (n >= 2 ? n / 2 : 1);
        g0 += n;
    }
    *qb = q, *sb = 16 * g;
}

static int all_repacked(const int32_t *row_fmts, int64_t N) {
    for (int64_t n = 0; n < N; ++n)
        if (!is_repacked(row_fmts[n])) return 0;
    return 1;
}

/* rp_A_BxC: the B x C micro-tile over rows of repacked format A (each build's rp_micro_impl), and
 * rp_pick's table of the four tiles for 1..4 activation rows (RP_TILES, each build's) */
#define RP_FN(F, NR, NA)                                                                                     \
    static void rp_##F##_##NR##x##NA(const uint8_t *const *rows, int64_t nb, const void *X, int64_t a0,          \
                                     float out[][4]) {                                                       \
        rp_micro_impl(F, NR, NA, rows, nb, (const RepackActs *)X, a0, out);                                  \
    }
#define RP_PICK                                                                                              \
    static MicroFn rp_pick(int fmt, int na) {                                                                \
        static const MicroFn t[3][4] = {RP_TILES(Q4_0R), RP_TILES(Q4_1R), RP_TILES_Q8};                      \
        return t[fmt == Q4_0R ? 0 : fmt == Q4_1R ? 1 : 2][na - 1];                                           \
    }

#endif

#if defined(MINISGL_AVX512)
/* ---- decode passes over repacked rows (AVX-512; the layout: "repacked rows" above) ----------------
 * A (row, activation row) pair keeps one int32 vector per sub-group: a lane sums its 16 (Q4_0/Q4_1:
 * one vpdpbusd per 4 of them) or its 4 to 16 products (the smaller sub-groups) of one block half
 * against the activations' int8, then the lane is scaled once by its block's d times its 16
 * activations' dx and the offsets (m, -8 d, -128 d) times the block's sum of quantized activations
 * are added: four float operations per pair and 8 blocks, against 16 for the direct kernel above.
 * The activations are quantized per 16 as for the direct kernel and laid out lane by lane. Each pair
 * is one fixed sequence of operations whatever M, the tile or the thread count (batch-invariant). */
/* One activation row (K floats) quantized per 16 (as quantize_row) into the repacked lanes */
/* max (MAX) or sum of each of v[0..16)'s lanes, lane k of the result v[k]'s (the order of a sum does
 * not matter: integers, exact) */
static inline __m512i lanes16_epi32(const __m512i v[16], const int MAX) {
#define OP(a, b) (MAX ? _mm512_max_epi32((a), (b)) : _mm512_add_epi32((a), (b)))
    __m512i w[8], x[4], u[2];
    for (int i = 0; i < 8; ++i) /* lanes 0-7: v[2i], 8-15: v[2i + 1], each j with j + 8 */
        w[i] = OP(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i) /* 128-bit lane L: v[4i + L] */
        x[i] = OP(_mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
        u[i] = OP(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
    /* lane 4 L + j: v[L + 4 j] (as reduce16) */
    const __m512i r = OP(_mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(u[0]), _mm512_castsi512_ps(u[1]), 0x88)),
                         _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(u[0]), _mm512_castsi512_ps(u[1]), 0xDD)));
#undef OP
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* A full sub-group (8 blocks, 256 values at x) quantized into its lanes: what the general loop below
 * writes for n = 8, with 16 half-blocks' maxima, scales and sums taken together (the activations of a
 * decode call: ~16 us for 16 rows of K = 576 one at a time, on one thread) */
static void quantize_group8(const float *restrict x, int8_t *restrict qx, float *restrict dl, float *restrict dl16,
                            float *restrict xs) {
    __m512i mx[16], q[16];
    __m512 v[16];
    for (int i = 0; i < 16; ++i) { /* half-block i = 2 b + h */
        v[i] = _mm512_loadu_ps(x + 16 * i);
        mx[i] = _mm512_castps_si512(_mm512_abs_ps(v[i])); /* non-negative floats order as their bits */
    }
    const __m512 d = _mm512_div_ps(_mm512_castsi512_ps(lanes16_epi32(mx, 1)), _mm512_set1_ps(127.f));
    const __mmask16 nz = _mm512_cmpneq_ps_mask(d, _mm512_setzero_ps());
    const __m512 id = _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.f), d);
    int8_t bytes[16][16];
    for (int i = 0; i < 16; ++i) {
        q[i] = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_permutexvar_ps(_mm512_set1_epi32(i), id)));
        _mm_storeu_si128((__m128i *)bytes[i], _mm512_cvtepi32_epi8(q[i]));
    }
    const __m512 sums = _mm512_cvtepi32_ps(lanes16_epi32(q, 0));
    /* lane L = h * 8 + b holds half-block 2 b + h */
    const __m512i lane_src = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int sd = 0; sd < 4; ++sd)
        _mm512_storeu_si512((void *)(qx + 64 * sd),
                            _mm512_i32gather_epi32(_mm512_add_epi32(_mm512_slli_epi32(lane_src, 4), _mm512_set1_epi32(4 * sd)),
                                                   (const void *)bytes, 1));
    const __m512 dv = _mm512_permutexvar_ps(lane_src, d);
    _mm512_storeu_ps(dl, dv);
    _mm512_storeu_ps(dl16, _mm512_mask_mul_ps(dv, 0xFF00, dv, _mm512_set1_ps(0.0625f)));
    _mm512_storeu_ps(xs, _mm512_mul_ps(dv, _mm512_permutexvar_ps(lane_src, sums)));
}

static void quantize_repacked(const float *restrict x, int64_t K, int64_t QB, int64_t SB, int8_t *restrict qx,
                              float *restrict dl, float *restrict dl16, float *restrict xs) {
    const int64_t nb = K / 32;
    int64_t qo = 0, so = 0, g0 = 0;
    for (; g0 + 8 <= nb; g0 += 8, qo += 256, so += 16) quantize_group8(x + 32 * g0, qx + qo, dl + so, dl16 + so, xs + so);
    memset(qx + qo, 0, (size_t)(QB - qo));
    memset(dl + so, 0, sizeof(float) * (size_t)(SB - so));
    memset(dl16 + so, 0, sizeof(float) * (size_t)(SB - so));
    memset(xs + so, 0, sizeof(float) * (size_t)(SB - so));
    for (; g0 < nb;) {
        const int n = sub_group(nb, g0), per = 8 / n, copies = per < 4 ? per : 4;
        for (int b = 0; b < n; ++b)
            for (int h = 0; h < 2; ++h) {
                const __m512 v = _mm512_loadu_ps(x + 32 * (g0 + b) + 16 * h);
                const float d = _mm512_reduce_max_ps(_mm512_abs_ps(v)) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id)));
                int32_t w[4];
                _mm_storeu_si128((__m128i *)w, _mm512_cvtepi32_epi8(q));
                for (int sd = 0; sd < 4; ++sd) {
                    const int lane = (sd % per) * 2 * n + h * n + b;
                    memcpy(qx + qo + 64 * (sd / per) + 4 * lane, &w[sd], 4);
                }
                for (int c = 0; c < copies; ++c) {
                    const int lane = c * 2 * n + h * n + b;
                    dl[so + lane] = d;
                    dl16[so + lane] = h ? d * 0.0625f : d;
                }
                xs[so + h * n + b] = d * (float)_mm512_reduce_add_epi32(q);
            }
        qo += 64 * (n >= 2 ? n / 2 : 1);
        so += 16;
        g0 += n;
    }
}

/* One sub-group of n blocks: rows at p[r] (the sub-group's first byte) against activation rows
 * (qx, dl, xs: the sub-group's, row a at + a * QB / SB), added into acc[r][a] */
static inline __attribute__((always_inline)) void rp_sub(const int fmt, const int n, const int NR, const int NA,
                                                          const uint8_t *const *p, const int8_t *qx, int64_t QB,
                                                          const float *dl, const float *xs, int64_t SB,
                                                          __m512 acc[][4]) {
    const int nz = n >= 2 ? n / 2 : 1, has_min = fmt == Q4_1R, q8 = fmt == Q8_0R;
    const int log_n = n == 8 ? 3 : n == 4 ? 2 : n == 2 ? 1 : 0;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i bi = _mm512_and_si512(lane, _mm512_set1_epi32(n - 1));
    const __mmask16 high = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(n)); /* h = 1 */
    const __m512i nib = _mm512_mask_blend_epi32(high, _mm512_set1_epi32(0x0F0F0F0F), _mm512_set1_epi32((int)0xF0F0F0F0));
    const __m512i widx = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(lane, log_n + 1), log_n), bi);
    const float bias_of_d = fmt == Q4_0R ? -8.f : -128.f;
    __m512 dd[8], mm[8];
    __m512i ia[8][4];
    for (int r = 0; r < NR; ++r) {
        __m512 v; /* d[0..n) (Q4_1: then m[0..n)) in its first lanes */
        if (n == 8 && has_min) v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p[r]));
        else v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << ((has_min ? 2 : 1) * n)) - 1), p[r]));
        dd[r] = n == 8 ? _mm512_shuffle_f32x4(v, v, 0x44) : _mm512_permutexvar_ps(bi, v);
        if (has_min) mm[r] = n == 8 ? _mm512_shuffle_f32x4(v, v, 0xEE) : _mm512_permutexvar_ps(_mm512_add_epi32(bi, _mm512_set1_epi32(n)), v);
        else mm[r] = _mm512_mul_ps(_mm512_set1_ps(bias_of_d), dd[r]);
        for (int a = 0; a < NA; ++a) ia[r][a] = _mm512_setzero_si512();
    }
    const int qoff = (has_min ? 4 : 2) * n;
    for (int j = 0; j < nz; ++j) {
        __m512i w[8];
        for (int r = 0; r < NR; ++r) {
            if (q8) {
                const uint8_t *q = p[r] + qoff + 64 * j;
                const __m512i raw = n == 1 ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)q))
                                           : _mm512_loadu_si512((const void *)q);
                w[r] = _mm512_xor_si512(raw, _mm512_set1_epi8((char)0x80)); /* lanes past n = 1's 8: x is zero */
            } else {
                const uint8_t *q = p[r] + qoff + 32 * j;
                if (n == 8) w[r] = _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q)), nib);
                else {
                    const __m256i raw = _mm256_maskz_loadu_epi32(n == 1 ? 0x0F : 0xFF, q);
                    w[r] = _mm512_and_si512(_mm512_permutexvar_epi32(widx, _mm512_castsi256_si512(raw)), nib);
                }
            }
        }
        for (int a = 0; a < NA; ++a) {
            const __m512i xv = _mm512_loadu_si512((const void *)(qx + a * QB + 64 * j));
            for (int r = 0; r < NR; ++r) ia[r][a] = _mm512_dpbusd_epi32(ia[r][a], w[r], xv);
        }
    }
    for (int a = 0; a < NA; ++a) {
        const __m512 d = _mm512_loadu_ps(dl + a * SB), s = _mm512_loadu_ps(xs + a * SB);
        for (int r = 0; r < NR; ++r) {
            acc[r][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][a]), _mm512_mul_ps(dd[r], d), acc[r][a]);
            acc[r][a] = _mm512_fmadd_ps(mm[r], s, acc[r][a]);
        }
    }
}

#define RP_AHEAD 4 /* full sub-groups of each row asked for ahead of their use (streams stay busy) */
#if defined(MINISGL_AMX)
#define RP_IN_ROW 0  /* the prefetches may run past a row's end into the rows after it */
#define RP_Q4_AHEAD RP_AHEAD
#define RP_PREFILL 0 /* prefill passes take the AMX tiles */
#else
/* Q8_0 rows (and tiles of several activation rows) prefetch only within the row: at K = 576 (2 full
 * sub-groups a row) they ran past it into rows read much later; on a 2-core Zen 4, one row through the
 * Q8_0 LM head (49152 x 576, streaming) 0.82x the time, with the 4-row tiles below 0.54x
 * (bench_qlinear_shapes.py's weights, variants in turn). */
#define RP_IN_ROW 1
/* Q4_0/Q4_1 rows against one activation row ask RP_Q4_AHEAD sub-groups ahead and past their row's
 * end: with the 4-row tiles a place's next row is the stripe this thread reads next. The same Zen 4,
 * one row streaming through copies of each weight in recorded replays, three rounds, time against 4
 * ahead within the row: down (576 x 1536) 0.82-0.92, gate/up 0.96-0.97, o 0.97-0.99, qkv 0.99-1.02,
 * the LM head 1.00 (1 or 3 ahead: down 1.04x 2's). Past the row's end for Q8_0 rows too, the LM head
 * took 1.10x; for the prefill tiles too, a 512-token prefill 1.02-1.06x. */
#define RP_Q4_AHEAD 2
#if defined(MINISGL_BF16)
#define RP_PREFILL 0 /* prefill passes take the bf16 dot products (qlinear_bf16) */
#else
/* Prefill passes run this decode kernel, RP_M_BLOCK rows at a time (a 2-core Zen 4, one 128-token
 * prompt through LLM: 180-242 ms by the generic tiles, 150-155 ms by this kernel). */
#define RP_PREFILL 1
#endif
#endif
#define RP_M_BLOCK 256

/* rows[0..NR) (one repacked format) against activation rows a0 .. a0 + NA -> out[r][a] */
static inline __attribute__((always_inline)) void rp_micro_impl(const int fmt, const int NR, const int NA,
                                                                 const uint8_t *const *rows, int64_t nb,
                                                                 const RepackActs *X, int64_t a0, float out[][4]) {
    const int ts = type_size(fmt), q8 = fmt == Q8_0R;
    __m512 acc[8][4];
    for (int r = 0; r < NR; ++r)
        for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
    const int8_t *qx = X->qx + a0 * X->QB;
    const float *dl = (q8 ? X->dl : X->dl16) + a0 * X->SB, *xs = X->xs + a0 * X->SB;
    const uint8_t *p[8];
    int64_t g0 = 0;
    for (; g0 + 8 <= nb; g0 += 8, qx += 64 * 4, dl += 16, xs += 16) {
        const int within = q8 || NA > 1; /* past the row's end: Q4 rows against one activation row */
        const int ra = within ? RP_AHEAD : RP_Q4_AHEAD, ahead = !(RP_IN_ROW && within) || g0 + (ra + 1) * 8 <= nb;
        for (int r = 0; r < NR; ++r) {
            p[r] = rows[r] + g0 * ts;
            if (ahead)
                for (int o = 0; o < 8 * ts; o += 64) _mm_prefetch((const char *)p[r] + ra * 8 * ts + o, _MM_HINT_T0);
        }
        rp_sub(fmt, 8, NR, NA, p, qx, X->QB, dl, xs, X->SB, acc);
    }
    for (int n = 4; n >= 1; n /= 2)
        if (nb - g0 >= n) {
            for (int r = 0; r < NR; ++r) p[r] = rows[r] + g0 * ts;
            if (n == 4) rp_sub(fmt, 4, NR, NA, p, qx, X->QB, dl, xs, X->SB, acc);
            else if (n == 2) rp_sub(fmt, 2, NR, NA, p, qx, X->QB, dl, xs, X->SB, acc);
            else rp_sub(fmt, 1, NR, NA, p, qx, X->QB, dl, xs, X->SB, acc);
            g0 += n, qx += 64 * (n >= 2 ? n / 2 : 1), dl += 16, xs += 16;
        }
    tile_sums(NR, NA, acc, out);
}

#define RP_FNS(F) RP_FN(F, 4, 1) RP_FN(F, 4, 2) RP_FN(F, 2, 3) RP_FN(F, 8, 1)
RP_FNS(Q4_0R)
RP_FNS(Q4_1R)
RP_FNS(Q8_0R)
RP_FN(Q4_0R, 4, 4)
RP_FN(Q4_1R, 4, 4)
RP_FN(Q8_0R, 2, 4)
#define RP_TILES(F) {rp_##F##_4x1, rp_##F##_4x2, rp_##F##_2x3, rp_##F##_4x4}
/* Q8_0 rows against 4 activation rows go 2 rows a call (fewer registers live than 4 x 4's 32 sums): a
 * 2-core Zen 4, the LM head (49152 x 576) at 16 rows, 2 threads, 0.81-0.88x the time (the Q4_1
 * projections 0.94-1.05x: they keep 4 x 4) */
#define RP_TILES_Q8 {rp_Q8_0R_4x1, rp_Q8_0R_4x2, rp_Q8_0R_2x3, rp_Q8_0R_2x4}
RP_PICK

/* Stripe t of one activation row's pass (M = 1): rows s * Lp + 2t and + 1 of the DIRECT_STREAMS places,
 * through one 8 x 1 micro-tile where they are 8 of one format (else micro_rows, 4 at a time). Each
 * pair's arithmetic is the 4 x 1 tile's and tile_sums pairs the lanes as it does, so the sums are
 * bitwise the same; 8 rows a call halve the driver's and the lane sums' work per row (the o and qkv
 * shapes in cache: 0.75-0.8x the time). */
#ifndef RP_ROWS8
#if defined(MINISGL_AMX)
#define RP_ROWS8 1
#else /* a 2-core Zen 4, one row streaming (variants in turn, in-row prefetches): the 4-row tiles of
       * micro_stripe 0.66x the 8-row ones' time on the Q8_0 LM head, 0.77-0.85x on the Q4_1 projections */
#define RP_ROWS8 0
#endif
#endif
static void rp_stripe8(const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, int64_t Lp, int64_t t,
                       int64_t K, const RepackActs *X, const float *bias, float *y, int accumulate) {
    int64_t idx[2 * DIRECT_STREAMS];
    int R = 0;
    for (int s = 0; s < DIRECT_STREAMS; ++s)
        for (int i = 0; i < 2; ++i)
            if (s * Lp + 2 * t + i < N) idx[R++] = s * Lp + 2 * t + i;
    int same = R == 8;
    for (int r = 1; r < R && same; ++r) same = row_fmts[idx[r]] == row_fmts[idx[0]];
    if (!same) {
        for (int r0 = 0; r0 < R; r0 += DIRECT_RUN)
            micro_rows(rp_pick, row_ptrs, row_fmts, idx + r0, R - r0 < DIRECT_RUN ? R - r0 : DIRECT_RUN, K, X, 1,
                       bias, y, 1, accumulate);
        return;
    }
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = (const uint8_t *)(intptr_t)row_ptrs[idx[r]];
    float out[8][4];
    const int f = row_fmts[idx[0]];
    if (f == Q4_0R) rp_Q4_0R_8x1(rows, K / 32, X, 0, out);
    else if (f == Q4_1R) rp_Q4_1R_8x1(rows, K / 32, X, 0, out);
    else rp_Q8_0R_8x1(rows, K / 32, X, 0, out);
    for (int r = 0; r < 8; ++r) put(y, 1, 0, idx[r], out[r][0], bias, accumulate);
}

/* The decode matmul over repacked rows: the direct kernel's stripes and schedule (see there) */
static int qlinear_repacked(const float *xf, int64_t ldf, int64_t M, int64_t K, const int64_t *row_ptrs,
                            const int32_t *row_fmts, int64_t N, const float *bias, float *y, int64_t ldy,
                            int accumulate) {
    int64_t QB, SB;
    repack_act_sizes(K / 32, &QB, &SB);
    int owned;
    uint8_t *buf = (uint8_t *)scratch_get(0, (size_t)(M * (QB + 3 * SB * (int64_t)sizeof(float))), &owned);
    if (buf == NULL) return -2;
    float *dl = (float *)buf, *dl16 = dl + M * SB, *xs = dl16 + M * SB;
    int8_t *qx = (int8_t *)(xs + M * SB);
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t a = 0; a < M; ++a)
        quantize_repacked(xf + a * ldf, K, QB, SB, qx + a * QB, dl + a * SB, dl16 + a * SB, xs + a * SB);
    const RepackActs X = {QB, SB, qx, dl, dl16, xs};
    if (M == 1 && RP_ROWS8) { /* one activation row: stripes of 8 rows, two adjacent in each place */
        const int64_t Lp = round_up((N + DIRECT_STREAMS - 1) / DIRECT_STREAMS, 2), T = Lp / 2;
#pragma omp parallel for schedule(guided) if (T > 1 && N * K >= 32768)
        for (int64_t t = 0; t < T; ++t) rp_stripe8(row_ptrs, row_fmts, N, Lp, t, K, &X, bias, y, accumulate);
        scratch_put(buf, owned);
        return 0;
    }
    const int64_t L = (N + DIRECT_STREAMS - 1) / DIRECT_STREAMS;
#pragma omp parallel for schedule(guided) if (L > 1 && M * N * K >= 32768)
    for (int64_t t = 0; t < L; ++t)
        micro_stripe(rp_pick, row_ptrs, row_fmts, N, L, t, K, &X, M, bias, y, ldy, accumulate);
    scratch_put(buf, owned);
    return 0;
}

/* ---- decode passes over grouped rows (AVX-512; the layout: "grouped rows" above) -------------------
 * Activations are quantized per 16 (as for the other kernels): d = max|x| / 127, q = round(x / d), laid
 * out block by block (block b of row a at qx + (b M + a) 32) with each half-block's d and sum(q), and
 * the block's sum of d * sum(q) (Q4_1's m). A block of 16 rows against one activation row is two chains
 * of 4 vpdpbusd (one per half, each started at its weights' integer offset times the half's sum(q): -8
 * Q4_0, -16 Q5_0, -32 Q6_K, -128 Q8_0, whose weights are stored plus 128), then 4 float operations
 * (Q4_1: 5) for all 16 rows; a row's sum never depends on the tile, M or the thread count. Per 32 (as
 * llama.cpp's Q8_0 activations; 3 float operations, Q4_1 4) took 0.83-0.92x the time at 16 rows on a
 * 2-core Zen 4, but greedy agreement with float32 (benchmarks/accuracy.py) fell to 97.6% from 98.2%,
 * next to llama.cpp's 97.5%. */
typedef struct {
    int64_t M;
    const int8_t *qx;
    const float *d[2], *s; /* per (block, row): the halves' scales; the scales times the sums, added */
    const int32_t *qs[2];  /* per (block, row): the halves' sums of quants */
} GroupActs;

/* The activations' bytes for M rows of K (quants, then the 5 per-block arrays) */
static inline size_t group_acts_bytes(int64_t M, int64_t K) { return (size_t)(M * K + 5 * 4 * M * (K / 32)); }

/* Activation rows x[0..M) (stride ldf) quantized into the grouped kernel's layout (see above) at buf */
static GroupActs quantize_grouped(const float *restrict x, int64_t ldf, int64_t M, int64_t K, uint8_t *buf) {
    const int64_t nb = K / 32, n = M * nb;
    float *d0 = (float *)buf, *d1 = d0 + n, *s = d1 + n;
    int32_t *qs0 = (int32_t *)(s + n), *qs1 = qs0 + n;
    int8_t *qx = (int8_t *)(qs1 + n);
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t a = 0; a < M; ++a)
        for (int64_t b = 0; b < nb; ++b) {
            const __m512 v0 = _mm512_loadu_ps(x + a * ldf + 32 * b), v1 = _mm512_loadu_ps(x + a * ldf + 32 * b + 16);
            const __m512 m0 = _mm512_abs_ps(v0), m1 = _mm512_abs_ps(v1);
            const float dd0 = _mm512_reduce_max_ps(m0) / 127.f, dd1 = _mm512_reduce_max_ps(m1) / 127.f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(dd0 != 0.f ? 1.f / dd0 : 0.f)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(dd1 != 0.f ? 1.f / dd1 : 0.f)));
            int8_t *o = qx + (b * M + a) * 32;
            _mm_storeu_si128((__m128i *)o, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(o + 16), _mm512_cvtepi32_epi8(q1));
            const int64_t i = b * M + a;
            qs0[i] = _mm512_reduce_add_epi32(q0), qs1[i] = _mm512_reduce_add_epi32(q1);
            d0[i] = dd0, d1[i] = dd1;
            s[i] = dd0 * (float)qs0[i] + dd1 * (float)qs1[i];
        }
    const GroupActs X = {M, qx, {d0, d1}, s, {qs0, qs1}};
    return X;
}

static inline __attribute__((always_inline)) __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Group g (16 rows of format fmt, nb blocks) against activation rows a0 .. a0 + NA -> acc[a] (lane r:
 * row r). A 2-core Zen 4, rows streaming through copies of each weight (bench_qlinear_shapes.py's
 * weights): reading 2 or 4 groups of a weight side by side (as the repacked rows' kernel reads 4
 * places) took 0.99-1.05x and 1.16-1.34x the time of one group after another at one row. With 8 activation rows or
 * more a block's work is long enough that the loads the out-of-order window reaches come too late, so
 * those tiles ask for the blocks GROUP_AHEAD ahead: 16 rows 0.60-0.70x the time, 8 rows 0.70-0.75x
 * (the LM head 0.96x), 128 rows 0.69-0.93x; with fewer rows the prefetches cost more than they gain
 * (1 row 0.87-1.13x, 2 rows 0.95-1.49x, 4 rows 0.82-1.18x). */
#define GROUP_PF_ROWS 8
#define GROUP_AHEAD 8
/* One block of 32 weights of the 16 rows (w[0..4): their vectors of weights 0 .. 15, w[4..8): 16 .. 31;
 * off: their integer offset, 0 with has_min; dw, mw: the rows' scales and (has_min) offsets, or
 * (halves) the two halves' scales) against activation rows xq.. (the block's, row a at + 32 a):
 * acc[a] += the products */
static inline __attribute__((always_inline)) void group_block(const int NA, const int has_min, const int halves,
                                                               const int off, const __m512i *w, __m512 dw, __m512 mw,
                                                               const int8_t *xq, const float *xd0, const float *xd1,
                                                               const float *xs, const int32_t *xq0, const int32_t *xq1,
                                                               __m512 *acc) {
    for (int a = 0; a < NA; ++a) {
        const int8_t *x = xq + 32 * a;
        /* the halves in two chains of 4 vpdpbusd (per 32: not one chain of 8, whose latency showed:
         * one activation row's qkv in cache 0.82x the time, 16 rows the same) */
        __m512i ia = has_min ? _mm512_setzero_si512() : _mm512_set1_epi32(off * xq0[a]);
        __m512i ib = has_min ? _mm512_setzero_si512() : _mm512_set1_epi32(off * xq1[a]);
        for (int j = 0; j < 4; ++j) {
            ia = _mm512_dpbusd_epi32(ia, w[j], bcast4(x + 4 * j));
            ib = _mm512_dpbusd_epi32(ib, w[4 + j], bcast4(x + 16 + 4 * j));
        }
        if (halves) { /* Q6_K: each half's own weight scale (dw, then mw for the second half) */
            acc[a] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ia), _mm512_set1_ps(xd0[a])), dw, acc[a]);
            acc[a] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ib), _mm512_set1_ps(xd1[a])), mw, acc[a]);
            continue;
        }
        /* the block's sum over the activations' scales */
        const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_set1_ps(xd1[a]),
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(ia), _mm512_set1_ps(xd0[a])));
        if (has_min) acc[a] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[a]), acc[a]);
        acc[a] = _mm512_fmadd_ps(f, dw, acc[a]);
    }
}

static inline __attribute__((always_inline)) __m512 u8x16_ps(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __attribute__((always_inline)) __m512 i8x16_ps(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __attribute__((always_inline)) void grouped_micro(const int fmt, const int NA, const uint8_t *g,
                                                                 int64_t nb, const GroupActs *X, int64_t a0,
                                                                 __m512 *acc) {
    const int q5 = fmt == Q5_K, kq = fmt == Q4_K || q5, q6 = fmt == Q6_K, five = fmt == Q5_0 || fmt == Q5_1;
    const int has_min = fmt == Q4_1 || fmt == Q5_1 || kq;
    const int64_t QS = group_qbytes(fmt), HS = group_hbytes(fmt), M = X->M;
    const int8_t *xq = X->qx + a0 * 32;
    const float *xd0 = X->d[0] + a0, *xd1 = X->d[1] + a0, *xs = X->s + a0;
    const int off = fmt == Q4_0 ? -8 : fmt == Q5_0 ? -16 : q6 ? -32 : -128; /* (Q8_0; has_min: unused) */
    const int32_t *xq0 = X->qs[0] + a0, *xq1 = X->qs[1] + a0;
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30), bit4 = _mm512_set1_epi8(0x10);
    for (int a = 0; a < NA; ++a) acc[a] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *q = g + group_q_off(b, QS, HS), *h = g + group_h_off(b, nb, QS, HS);
        if (NA >= GROUP_PF_ROWS) /* (past the group: the next group's first blocks, or unused bytes) */
            for (int64_t o = 0; o < QS + HS; o += 64)
                _mm_prefetch((const char *)q + GROUP_AHEAD * (QS + HS) + o, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        const __m512 m = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 32))) : d;
        __m512i kraw[8]; /* Q4_K/Q5_K: a sub-block pair's vectors */
        for (int sb = 0; sb < (kq || q6 ? 8 : 1); ++sb) { /* the K-quants: the super-block's blocks of 32 */
            __m512i w[8]; /* w[0..4): weights 0 .. 15 of the block, w[4..8): 16 .. 31 */
            if (q6) { /* block sb = 4 half + k: ql's low (k < 2) or high nibbles of bytes 64 half + 32 (k % 2)
                       * .., with bits 2k, 2k + 1 of qh's bytes 32 half .. as bits 4, 5 */
                const int half = sb / 4, k = sb % 4;
                for (int j = 0; j < 8; ++j) {
                    const __m512i ql = _mm512_load_si512((const void *)(q + 64 * (16 * half + 8 * (k % 2) + j)));
                    const __m512i qh = _mm512_load_si512((const void *)(q + 2048 + 64 * (8 * half + j)));
                    const __m512i lo = _mm512_and_si512(k < 2 ? ql : _mm512_srli_epi16(ql, 4), low4);
                    const __m512i hi = k == 0 ? _mm512_slli_epi16(qh, 4) : k == 1 ? _mm512_slli_epi16(qh, 2)
                                     : k == 2 ? qh : _mm512_srli_epi16(qh, 2);
                    w[j] = _mm512_or_si512(lo, _mm512_and_si512(hi, bits45));
                }
            } else if (kq) { /* sub-block sb: the low (even sb) or high nibbles of vectors 8 (sb / 2) .. + 7;
                              * Q5_K: bit sb of the fifth bits' vector j as bit 4. Up to 4 activation rows
                              * the pair's vectors stay in registers for its odd sub-block (registers
                              * allow it there; Q4_K, one row, one thread: 0.85-0.89x the time of
                              * loading them again) */
                if (NA <= 4 && sb % 2 == 0)
                    for (int j = 0; j < 8; ++j) kraw[j] = _mm512_load_si512((const void *)(q + 512 * (sb / 2) + 64 * j));
                for (int j = 0; j < 8; ++j) {
                    const __m512i raw =
                        NA <= 4 ? kraw[j] : _mm512_load_si512((const void *)(q + 512 * (sb / 2) + 64 * j));
                    w[j] = _mm512_and_si512(sb % 2 ? _mm512_srli_epi16(raw, 4) : raw, low4);
                    if (q5) {
                        const __m512i qh = _mm512_load_si512((const void *)(q + 2048 + 64 * j));
                        const __m512i at4 = sb < 4 ? _mm512_slli_epi16(qh, 4 - sb) : _mm512_srli_epi16(qh, sb - 4);
                        w[j] = _mm512_or_si512(w[j], _mm512_and_si512(at4, bit4));
                    }
                }
            } else if (fmt == Q8_0) {
                for (int j = 0; j < 8; ++j) w[j] = _mm512_load_si512((const void *)(q + 64 * j));
            } else {
                for (int j = 0; j < 4; ++j) {
                    const __m512i raw = _mm512_load_si512((const void *)(q + 64 * j));
                    w[j] = _mm512_and_si512(raw, low4);                           /* weights 4j .. 4j + 3 */
                    w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4); /* 16 + 4j .. */
                }
                if (five) { /* bit j of each byte of the fifth vector, as bit 4 of vector j's */
                    const __m512i qh = _mm512_load_si512((const void *)(q + 256));
                    for (int j = 0; j < 8; ++j) {
                        const __m512i at4 = j < 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
                        w[j] = _mm512_or_si512(w[j], _mm512_and_si512(at4, bit4));
                    }
                }
            }
            /* Q4_K: w = d sc q - dmin mn per sub-block; Q6_K: w = d sc (q - 32) per 16 (exact products) */
            const __m512 dw = kq ? _mm512_mul_ps(d, u8x16_ps(h + 64 + 16 * sb))
                            : q6 ? _mm512_mul_ps(d, i8x16_ps(h + 32 + 32 * sb)) : d;
            const __m512 mw = kq ? _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(m, u8x16_ps(h + 192 + 16 * sb)))
                            : q6 ? _mm512_mul_ps(d, i8x16_ps(h + 48 + 32 * sb)) : m;
            group_block(NA, has_min, q6, off, w, dw, mw, xq, xd0, xd1, xs, xq0, xq1, acc);
            xq += 32 * M, xd0 += M, xd1 += M, xs += M, xq0 += M, xq1 += M;
        }
    }
}

typedef void (*GroupFn)(const uint8_t *g, int64_t nb, const GroupActs *X, int64_t a0, __m512 *acc);
#define GROUP_FN(F, NA)                                                                                     \
    static void grouped_##F##_##NA(const uint8_t *g, int64_t nb, const GroupActs *X, int64_t a0, __m512 *acc) { \
        grouped_micro(F, NA, g, nb, X, a0, acc);                                                            \
    }
#define GROUP_FNS(F)                                                                                        \
    GROUP_FN(F, 1) GROUP_FN(F, 2) GROUP_FN(F, 3) GROUP_FN(F, 4) GROUP_FN(F, 5) GROUP_FN(F, 6) GROUP_FN(F, 7) \
    GROUP_FN(F, 8) GROUP_FN(F, 9) GROUP_FN(F, 10) GROUP_FN(F, 11) GROUP_FN(F, 12) GROUP_FN(F, 13)           \
    GROUP_FN(F, 14) GROUP_FN(F, 15) GROUP_FN(F, 16)
GROUP_FNS(Q4_0)
GROUP_FNS(Q4_1)
GROUP_FNS(Q5_0)
GROUP_FNS(Q5_1)
GROUP_FNS(Q8_0)
GROUP_FNS(Q4_K)
GROUP_FNS(Q5_K)
GROUP_FNS(Q6_K)
#define GROUP_TABLE(F)                                                                                      \
    {grouped_##F##_1,  grouped_##F##_2,  grouped_##F##_3,  grouped_##F##_4,  grouped_##F##_5,  grouped_##F##_6, \
     grouped_##F##_7,  grouped_##F##_8,  grouped_##F##_9,  grouped_##F##_10, grouped_##F##_11, grouped_##F##_12, \
     grouped_##F##_13, grouped_##F##_14, grouped_##F##_15, grouped_##F##_16}
static const GroupFn group_fns[8][GROUP_ROWS] = {GROUP_TABLE(Q4_0), GROUP_TABLE(Q4_1), GROUP_TABLE(Q8_0),
                                                  GROUP_TABLE(Q4_K), GROUP_TABLE(Q5_K), GROUP_TABLE(Q6_K),
                                                  GROUP_TABLE(Q5_0), GROUP_TABLE(Q5_1)};

/* Prefill passes (prefill = 1) over grouped rows take this kernel too, except in the AMX build (its
 * tiles). A 2-core Zen 4, the embedded model's prompts through LLM (bench_cpu_prefill.py, alternated
 * twice) against the bf16 dot products (qlinear_bf16, the groups decoded straight into its panel): 16
 * tokens 19-28 against 34-41 ms, 128 84-88 against 102-108, 512 346-362 against 446-451, 2,048
 * 2.05-2.31 against 2.39-2.66 s. Its int8 activations agree less with float32 than bf16's (greedy
 * agreement 98.1% against 99.2%; llama.cpp 97.5%): prefill = 2 (MINISGL_CPU_PREFILL=bf16) keeps the
 * bf16 products where the build has them. */
#if defined(MINISGL_AMX)
#define GROUP_PREFILL 0
#else
#define GROUP_PREFILL 1
#endif

static int all_grouped(const int32_t *row_fmts, int64_t N) {
    for (int64_t n = 0; n < N; n += GROUP_ROWS)
        if (!is_grouped(row_fmts[n])) return 0;
    return N % GROUP_ROWS == 0;
}

/* The decode matmul over grouped rows (groups handed to the threads in order, guided: a thread that
 * another process preempts leaves its groups to the other; one row streaming, a 2-core Zen 4, 0.86-0.93x
 * static's time; activation rows 16 at a time through each group); xf: the activations after the
 * pre-op. */
static int qlinear_grouped(const float *xf, int64_t ldf, int64_t M, int64_t K, const int64_t *row_ptrs,
                           const int32_t *row_fmts, int64_t N, const float *bias, float *y, int64_t ldy,
                           int accumulate) {
    const int64_t G = N / GROUP_ROWS;
    int owned;
    uint8_t *buf = (uint8_t *)scratch_get(0, group_acts_bytes(M, K), &owned);
    if (buf == NULL) return -2;
    const GroupActs X = quantize_grouped(xf, ldf, M, K, buf);
#pragma omp parallel for schedule(guided) if (G > 1 && M * N * K >= 32768)
    for (int64_t gi = 0; gi < G; ++gi) {
        const int f = base_fmt(row_fmts[gi * GROUP_ROWS]);
        const GroupFn *fns = group_fns[f == Q4_0 ? 0 : f == Q4_1 ? 1 : f == Q8_0 ? 2 : f == Q4_K ? 3 : f == Q5_K ? 4
                                       : f == Q6_K ? 5 : f == Q5_0 ? 6 : 7];
        const int64_t nb = K / block_size(f);
        const uint8_t *g = group_of((const uint8_t *)(intptr_t)row_ptrs[gi * GROUP_ROWS]);
        const __m512 bv = bias != NULL ? _mm512_loadu_ps(bias + gi * GROUP_ROWS) : _mm512_setzero_ps();
        for (int64_t a0 = 0; a0 < M; a0 += GROUP_ROWS) {
            const int NA = M - a0 < GROUP_ROWS ? (int)(M - a0) : GROUP_ROWS;
            __m512 acc[GROUP_ROWS];
            fns[NA - 1](g, nb, &X, a0, acc);
            for (int a = 0; a < NA; ++a) {
                float *o = y + (a0 + a) * ldy + gi * GROUP_ROWS;
                __m512 v = _mm512_add_ps(acc[a], bv);
                if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(o), v);
                _mm512_storeu_ps(o, v);
            }
        }
    }
    scratch_put(buf, owned);
    return 0;
}
#endif

#if defined(MINISGL_AVX2) && !defined(MINISGL_AVX512)
/* ---- decode passes over repacked rows (AVX2, no VNNI; the layout: "repacked rows" above) ----------
 * The AVX-512 layout read 8 lanes at a time. In a full sub-group (8 blocks) the Q4_0/Q4_1 quants'
 * 32 bytes j (j = 0..3) hold dword j of each block's nibbles, lane b = block b: the low nibbles are
 * weights 4j..4j+3 of block b, the high ones 16+4j..; the activations' 64 bytes j hold, lane h * 8 + b,
 * the same positions' int8. vpmaddubsw gives int16 pair sums of one block half per lane; a half's four
 * j add up in int16 (at most 4 x 2 x 15 x 127 < 2^15) and one vpmaddwd widens them: per 8 blocks and
 * (row, activation) pair 8 vpmaddubsw and 2 vpmaddwd, then 2 conversions and 3 fmas for all 8 blocks
 * (the direct kernel above: 8, 8, 8 and 16). Zen 1 runs vpmaddubsw and vpmaddwd on one pipe only, so
 * their count bounds the kernel. Q8_0 (signed bytes: pair sums near 2^15) goes by the sign trick and a
 * vpmaddwd per 32 bytes, adding in int32. A partial sub-group (n = 4, 2 or 1 blocks, at a row's end)
 * moves its dwords into its lanes' order (vpermd) and shifts each lane's nibbles by its half (vpsrlvd).
 * Activations: RepackActs as the AVX-512 kernel lays them out (dl16 unused: the high nibbles are
 * shifted down here, vpmaddubsw would saturate on them in place). Each (row, activation) pair is one
 * fixed sequence of operations whatever M, the tile or the thread count (batch-invariant). */

/* One activation row (K floats) quantized per 16 (quantize_row's values) into the repacked lanes:
 * qx/dl in the AVX-512 kernel's layout (Q8_0 rows' lanes), q4/dl4/xs4 in the Q4 rows' (see above) */
static void quantize_repacked(const float *restrict x, int64_t K, int64_t QB, int64_t SB, int8_t *restrict qx,
                              float *restrict dl, int8_t *restrict q4, float *restrict dl4, float *restrict xs4) {
    const int64_t nb = K / 32;
    int8_t q16[64 * 16];
    float d16[64], s16[64];
    memset(qx, 0, (size_t)QB);
    memset(q4, 0, (size_t)QB);
    memset(dl, 0, sizeof(float) * (size_t)SB);
    int64_t qo = 0, so = 0;
    for (int64_t g0 = 0; g0 < nb;) {
        const int n = sub_group(nb, g0), per = 8 / n, copies = per < 4 ? per : 4;
        quantize_row(x + 32 * g0, 32 * n, 64 * ((n + 1) / 2), 64, q16, d16, s16); /* 2n halves */
        if (n == 8) { /* both layouts alike: half-block 2b + h's dword s -> lane h * 8 + b of vector s */
            for (int h = 0; h < 2; ++h) pack_dwords_8x4((const uint8_t *)q16 + 16 * h, 32, (uint8_t *)qx + qo + 32 * h, 64);
            memcpy(q4 + qo, qx + qo, 256);
            for (int i = 0; i < 16; ++i) dl[so + 8 * (i % 2) + i / 2] = d16[i];
        } else
            for (int b = 0; b < n; ++b)
                for (int h = 0; h < 2; ++h) {
                    const int i = 2 * b + h;
                    for (int sd = 0; sd < 4; ++sd) {
                        const int lane = (sd % per) * 2 * n + h * n + b, k = sd * n + b; /* k: Q4 dword */
                        memcpy(qx + qo + 64 * (sd / per) + 4 * lane, q16 + 16 * i + 4 * sd, 4);
                        memcpy(q4 + qo + 64 * (k / 8) + 32 * h + 4 * (k % 8), q16 + 16 * i + 4 * sd, 4);
                    }
                    for (int c = 0; c < copies; ++c) dl[so + c * 2 * n + h * n + b] = d16[i];
                }
        for (int l = 0; l < 8; ++l)
            for (int h = 0; h < 2; ++h) {
                dl4[so + 8 * h + l] = d16[2 * (l % n) + h];
                xs4[so + 8 * h + l] = l < n ? s16[2 * l + h] : 0.f;
            }
        qo += 64 * (n >= 2 ? n / 2 : 1);
        so += 16;
        g0 += n;
    }
}

/* The 8 floats of f16 words p[0..n) (then zeros) in lanes idx (lane i: word idx[i]) */
static inline __attribute__((always_inline)) __m256 rp2_halves(const uint8_t *p, int n, __m256i idx) {
    __m128i h;
    if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (n == 4) h = _mm_loadl_epi64((const __m128i *)p);
    else if (n == 2) h = _mm_cvtsi32_si128(*(const int32_t *)(const void *)p);
    else h = _mm_cvtsi32_si128(*(const uint16_t *)(const void *)p);
    return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(h), idx);
}

/* *s (+)= the int16 pair sums of w's bytes against the 32 at x (set when first): a fixed pair of
 * instructions, the product in its own register (from the intrinsics gcc moves every sum between
 * registers after its add: a third of a chunk's instructions in the 1 x 4 tile) */
static inline __attribute__((always_inline)) void rp2_madd(__m256i w, const int8_t *x, __m256i *s, const int first) {
    if (first) {
        __asm__("vpmaddubsw %[x], %[w], %[s]" : [s] "=x"(*s) : [w] "x"(w), [x] "m"(*(const __m256i *)x));
        return;
    }
    __m256i t;
    __asm__("vpmaddubsw %[x], %[w], %[t]\n\t"
            "vpaddw %[t], %[s], %[s]"
            : [s] "+x"(*s), [t] "=&x"(t)
            : [w] "x"(w), [x] "m"(*(const __m256i *)x));
}

/* s_lo += the int16 pair sums of a 32-byte chunk's low nibbles (q) against xl, s_hi of its high ones
 * against xh: one fixed sequence (gcc, left to itself, hoists the loads and spills the sums) */
static inline __attribute__((always_inline)) void rp2_chunk(const uint8_t *q, __m256i xl, __m256i xh, __m256i low4,
                                                             __m256i *s_lo, __m256i *s_hi, const int first) {
    __m256i t0, t1;
    if (first) { /* the sums start at the first chunk's products (as 0 + them, exactly) */
        __asm__("vmovdqu %[q], %[t0]\n\t"
                "vpsrlw $4, %[t0], %[sh]\n\t"
                "vpand %[m], %[t0], %[t0]\n\t"
                "vpand %[m], %[sh], %[sh]\n\t"
                "vpmaddubsw %[xl], %[t0], %[sl]\n\t"
                "vpmaddubsw %[xh], %[sh], %[sh]"
                : [sl] "=&x"(*s_lo), [sh] "=&x"(*s_hi), [t0] "=&x"(t0)
                : [q] "m"(*(const __m256i *)q), [xl] "x"(xl), [xh] "x"(xh), [m] "x"(low4));
        return;
    }
    __asm__("vmovdqu %[q], %[t0]\n\t"
            "vpsrlw $4, %[t0], %[t1]\n\t"
            "vpand %[m], %[t0], %[t0]\n\t"
            "vpand %[m], %[t1], %[t1]\n\t"
            "vpmaddubsw %[xl], %[t0], %[t0]\n\t"
            "vpmaddubsw %[xh], %[t1], %[t1]\n\t"
            "vpaddw %[t0], %[sl], %[sl]\n\t"
            "vpaddw %[t1], %[sh], %[sh]"
            : [sl] "+x"(*s_lo), [sh] "+x"(*s_hi), [t0] "=&x"(t0), [t1] "=&x"(t1)
            : [q] "m"(*(const __m256i *)q), [xl] "x"(xl), [xh] "x"(xh), [m] "x"(low4));
}

/* The n halves (f16 words at p) as floats in lanes 0..n-1, zeros after */
static inline __attribute__((always_inline)) __m128 rp2_halves4(const uint8_t *p, int n) {
    const __m128i h = n == 4 ? _mm_loadl_epi64((const __m128i *)p)
                      : n == 2 ? _mm_cvtsi32_si128(*(const int32_t *)(const void *)p)
                               : _mm_cvtsi32_si128(*(const uint16_t *)(const void *)p);
    return _mm_cvtph_ps(h);
}

/* The products of a partial Q4 sub-group (n = 4, 2 or 1 blocks; int32 lane l of each half: block
 * l % n) into tail[r][a]: each half's lanes of one block summed first (exactly, in int32: lane l and
 * l + 4, then l ^ 2 and l ^ 1 for the smaller n), so that lanes 0..n-1 hold the blocks and the
 * scaling runs on 4 lanes, once, instead of 8 lanes of scales permuted into place (a K = 576 row's
 * last 2 blocks cost about as much as 8 before). Lanes past n are scaled by zero. */
static inline __attribute__((always_inline)) void rp2_tail(const int has_min, const int n, const int NR, const int NA,
                                                            const uint8_t *const *p, __m256i ia[][4][2],
                                                            const float *dl4, const float *xs4, int64_t SB,
                                                            __m128 tail[][4]) {
    __m128 dd[4], mm[4];
    for (int r = 0; r < NR; ++r) {
        dd[r] = rp2_halves4(p[r], n);
        mm[r] = has_min ? rp2_halves4(p[r] + 2 * n, n) : _mm_mul_ps(_mm_set1_ps(-8.f), dd[r]);
    }
    for (int a = 0; a < NA; ++a) {
        const __m128 d0 = _mm_loadu_ps(dl4 + a * SB), d1 = _mm_loadu_ps(dl4 + a * SB + 8);
        const __m128 sx = _mm_add_ps(_mm_loadu_ps(xs4 + a * SB), _mm_loadu_ps(xs4 + a * SB + 8));
        for (int r = 0; r < NR; ++r) {
            __m128i j[2];
            for (int h = 0; h < 2; ++h) {
                j[h] = _mm_add_epi32(_mm256_castsi256_si128(ia[r][a][h]), _mm256_extracti128_si256(ia[r][a][h], 1));
                if (n <= 2) j[h] = _mm_add_epi32(j[h], _mm_shuffle_epi32(j[h], 0x4E));
                if (n == 1) j[h] = _mm_add_epi32(j[h], _mm_shuffle_epi32(j[h], 0xB1));
            }
            const __m128 t = _mm_fmadd_ps(_mm_cvtepi32_ps(j[1]), d1, _mm_mul_ps(_mm_cvtepi32_ps(j[0]), d0));
            tail[r][a] = _mm_fmadd_ps(t, dd[r], tail[r][a]);
            tail[r][a] = _mm_fmadd_ps(mm[r], sx, tail[r][a]);
        }
    }
}

/* One sub-group of n blocks: rows at p[r] (the sub-group's first byte) against activation rows a
 * (qx / q4 + a * QB, dl / dl4 / xs4 + a * SB: the sub-group's), added into acc[r][a] */
static inline __attribute__((always_inline)) void rp2_sub(const int fmt, const int n, const int NR, const int NA,
                                                           const uint8_t *const *p, const int8_t *qx, const int8_t *q4,
                                                           int64_t QB, const float *dl, const float *dl4,
                                                           const float *xs4, int64_t SB, __m256 acc[][4],
                                                           __m128 tail[][4]) {
    const int has_min = fmt == Q4_1R, q8 = fmt == Q8_0R, nz = n >= 2 ? n / 2 : 1;
    const int qoff = (has_min ? 4 : 2) * n;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
    /* lane i's block i % n (both halves of a vector of 8 lanes: i and i + 8 have the same block) */
    const __m256i bi = _mm256_and_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(n - 1));
    __m256i ia[4][4][2]; /* int32 lanes 0-7 and 8-15 of each pair */
    if (!q8) { /* the Q4 lanes: chunk c's dword l is dword 8c + l of the quants, block (8c + l) % n */
        const int chunks = n == 8 ? 4 : n == 4 ? 2 : 1;
        __m256i s16[4][4][2]; /* int16 pair sums of each half over the chunks */
        for (int r = 0; r < NR; ++r)
            for (int a = 0; a < NA; ++a) s16[r][a][0] = s16[r][a][1] = _mm256_setzero_si256();
        /* not unrolled: unrolled, gcc hoists every load and product and spills them */
#pragma GCC unroll 1
        for (int c = 0; c < chunks && NA == 1; ++c) { /* one activation row: its 64 bytes loaded once */
            __m256i xl = _mm256_loadu_si256((const __m256i *)(q4 + 64 * c));
            __m256i xh = _mm256_loadu_si256((const __m256i *)(q4 + 64 * c + 32));
            __asm__("" : "+x"(xl), "+x"(xh)); /* in registers: gcc would fold a load into each row's product */
            for (int r = 0; r < NR; ++r) {
                const uint8_t *q = p[r] + qoff + 32 * c;
                if (n == 1) {
                    const __m256i raw = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q));
                    const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    s16[r][0][0] = _mm256_add_epi16(s16[r][0][0], _mm256_maddubs_epi16(lo, xl));
                    s16[r][0][1] = _mm256_add_epi16(s16[r][0][1], _mm256_maddubs_epi16(hi, xh));
                } else if (c == 0)
                    rp2_chunk(q, xl, xh, low4, &s16[r][0][0], &s16[r][0][1], 1);
                else
                    rp2_chunk(q, xl, xh, low4, &s16[r][0][0], &s16[r][0][1], 0);
            }
        }
#pragma GCC unroll 1
        for (int c = 0; c < chunks && NA > 1; ++c)
            for (int r = 0; r < NR; ++r) {
                const uint8_t *q = p[r] + qoff + 32 * c;
                const __m256i raw = n == 1 ? _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q)) /* lanes 4-7: x is 0 */
                                           : _mm256_loadu_si256((const __m256i *)q);
                const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                for (int a = 0; a < NA; ++a) {
                    const int8_t *x = q4 + a * QB + 64 * c;
                    rp2_madd(lo, x, &s16[r][a][0], c == 0);
                    rp2_madd(hi, x + 32, &s16[r][a][1], c == 0);
                }
            }
        for (int r = 0; r < NR; ++r)
            for (int a = 0; a < NA; ++a) {
                ia[r][a][0] = _mm256_madd_epi16(s16[r][a][0], ones);
                ia[r][a][1] = _mm256_madd_epi16(s16[r][a][1], ones);
            }
    } else { /* Q8_0: the AVX-512 lanes, 32 bytes of signed weights against 32 of activations */
        for (int r = 0; r < NR; ++r)
            for (int a = 0; a < NA; ++a) ia[r][a][0] = ia[r][a][1] = _mm256_setzero_si256();
        const int halves = n == 1 ? 1 : 2; /* n = 1: 32 bytes, lanes 0-7 only */
        for (int j = 0; j < nz; ++j)
            for (int r = 0; r < NR; ++r)
                for (int L = 0; L < halves; ++L) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(p[r] + qoff + 64 * j + 32 * L));
                    const __m256i aw = _mm256_abs_epi8(w);
                    for (int a = 0; a < NA; ++a) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + a * QB + 64 * j + 32 * L));
                        const __m256i prod = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w));
                        ia[r][a][L] = _mm256_add_epi32(ia[r][a][L], _mm256_madd_epi16(prod, ones));
                    }
                }
    }
    if (!q8 && n < 8) { /* a row's last 1, 2 or 4 Q4 blocks: see rp2_tail */
        rp2_tail(has_min, n, NR, NA, p, ia, dl4, xs4, SB, tail);
        return;
    }
    __m256 dd[4], mm[4]; /* the rows' scales, read after the products (fewer registers live in their loop) */
    for (int r = 0; r < NR; ++r) {
        dd[r] = rp2_halves(p[r], n, bi);
        if (has_min) mm[r] = rp2_halves(p[r] + 2 * n, n, bi);
        else if (!q8) mm[r] = _mm256_mul_ps(_mm256_set1_ps(-8.f), dd[r]);
    }
    const float *d = q8 ? dl : dl4;
    for (int a = 0; a < NA; ++a) {
        const __m256 d0 = _mm256_loadu_ps(d + a * SB), d1 = _mm256_loadu_ps(d + a * SB + 8);
        for (int r = 0; r < NR; ++r) { /* the halves' sums, each by its dx, then by the block's d */
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][a][1]), d1,
                                             _mm256_mul_ps(_mm256_cvtepi32_ps(ia[r][a][0]), d0));
            acc[r][a] = _mm256_fmadd_ps(t, dd[r], acc[r][a]);
        }
        if (q8) continue;
        const __m256 sx = _mm256_add_ps(_mm256_loadu_ps(xs4 + a * SB), _mm256_loadu_ps(xs4 + a * SB + 8));
        for (int r = 0; r < NR; ++r) acc[r][a] = _mm256_fmadd_ps(mm[r], sx, acc[r][a]);
    }
}

#define RP_AHEAD 16 /* full sub-groups ahead, as above (Zen 1: 4, 8 and 16 alike; the runs quoted took 16) */

/* rows[0..NR) (one repacked format) against activation rows a0 .. a0 + NA -> out[r][a] */
static inline __attribute__((always_inline)) void rp_micro_impl(const int fmt, const int NR, const int NA,
                                                                  const uint8_t *const *rows, int64_t nb,
                                                                  const RepackActs *X, int64_t a0, float out[][4]) {
    const int ts = type_size(fmt);
    __m256 acc[4][4];
    __m128 tail[4][4]; /* the partial sub-groups' (Q4 rows) */
    for (int r = 0; r < NR; ++r)
        for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps(), tail[r][a] = _mm_setzero_ps();
    const int8_t *qx = X->qx + a0 * X->QB, *q4 = X->q4 + a0 * X->QB;
    const float *dl = X->dl + a0 * X->SB, *dl4 = X->dl4 + a0 * X->SB, *xs4 = X->xs4 + a0 * X->SB;
    const uint8_t *p[4];
    int64_t g0 = 0;
    for (; g0 + 8 <= nb; g0 += 8, qx += 64 * 4, q4 += 64 * 4, dl += 16, dl4 += 16, xs4 += 16) {
        for (int r = 0; r < NR; ++r) {
            p[r] = rows[r] + g0 * ts;
            for (int o = 0; o < 8 * ts; o += 64) _mm_prefetch((const char *)p[r] + RP_AHEAD * 8 * ts + o, _MM_HINT_T0);
        }
        rp2_sub(fmt, 8, NR, NA, p, qx, q4, X->QB, dl, dl4, xs4, X->SB, acc, tail);
    }
    for (int n = 4; n >= 1; n /= 2)
        if (nb - g0 >= n) {
            for (int r = 0; r < NR; ++r) p[r] = rows[r] + g0 * ts;
            if (n == 4) rp2_sub(fmt, 4, NR, NA, p, qx, q4, X->QB, dl, dl4, xs4, X->SB, acc, tail);
            else if (n == 2) rp2_sub(fmt, 2, NR, NA, p, qx, q4, X->QB, dl, dl4, xs4, X->SB, acc, tail);
            else rp2_sub(fmt, 1, NR, NA, p, qx, q4, X->QB, dl, dl4, xs4, X->SB, acc, tail);
            g0 += n, qx += 64 * (n >= 2 ? n / 2 : 1), q4 += 64 * (n >= 2 ? n / 2 : 1), dl += 16, dl4 += 16, xs4 += 16;
        }
    for (int r = 0; r < NR; ++r)
        for (int a = 0; a < NA; ++a) out[r][a] = hsum8(_mm256_add_ps(acc[r][a], _mm256_zextps128_ps256(tail[r][a])));
}

/* tiles: 4 rows x 1 activation row, 2 x 2, 1 x 3 and 1 x 4 (16 ymm registers: the int16 sums, 2 a pair) */
#define RP_FNS(F) RP_FN(F, 4, 1) RP_FN(F, 2, 2) RP_FN(F, 1, 3) RP_FN(F, 1, 4)
RP_FNS(Q4_0R)
RP_FNS(Q4_1R)
RP_FNS(Q8_0R)
#define RP_TILES(F) {rp_##F##_4x1, rp_##F##_2x2, rp_##F##_1x3, rp_##F##_1x4}
#define RP_TILES_Q8 RP_TILES(Q8_0R)
RP_PICK

/* Stripe t of one activation row's pass (M = 1): rows t, L + t, 2 L + t, 3 L + t (the four places)
 * through one 4 x 1 tile when they are four of one format, else micro_rows; the same arithmetic per
 * row either way (bitwise), without micro_rows' grouping and dispatch per call (at K = 576 about a
 * third of a row's time) */
static void rp2_stripe4(const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, int64_t L, int64_t t, int64_t K,
                        const RepackActs *X, const float *bias, float *y, int accumulate) {
    const int64_t last = 3 * L + t;
    const int f = row_fmts[t];
    if (last >= N || row_fmts[L + t] != f || row_fmts[2 * L + t] != f || row_fmts[last] != f) {
        micro_stripe(rp_pick, row_ptrs, row_fmts, N, L, t, K, X, 1, bias, y, 1, accumulate);
        return;
    }
    const uint8_t *rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = (const uint8_t *)(intptr_t)row_ptrs[r * L + t];
    float out[4][4];
    if (f == Q4_0R) rp_Q4_0R_4x1(rows, K / 32, X, 0, out);
    else if (f == Q4_1R) rp_Q4_1R_4x1(rows, K / 32, X, 0, out);
    else rp_Q8_0R_4x1(rows, K / 32, X, 0, out);
    for (int r = 0; r < 4; ++r) put(y, 1, 0, r * L + t, out[r][0], bias, accumulate);
}

/* Prefill passes over repacked rows take this kernel too (RP_PREFILL): without AMX it outruns the
 * generic tiles (which unpack the rows again) at every prompt size measured, e.g. on Zen 1, 2
 * threads, the embedded model's gate/up at M = 16, 128, 512: 21.4, 25.8, 23.7 GMAC/s against 15.1,
 * 19.0, 17.9, and down 29.9-33.7 against 17.6-20.8. Rows go RP_M_BLOCK at a time (M = 2048 in one
 * pass: 15.9 against 16.7 GMAC/s, the quantized activations out of the L2). */
#define RP_PREFILL 1
#define RP_M_BLOCK 256

/* The decode matmul over repacked rows: the direct kernel's stripes and schedule (see there) */
static int qlinear_repacked(const float *xf, int64_t ldf, int64_t M, int64_t K, const int64_t *row_ptrs,
                            const int32_t *row_fmts, int64_t N, const float *bias, float *y, int64_t ldy,
                            int accumulate) {
    int64_t QB, SB;
    repack_act_sizes(K / 32, &QB, &SB);
    int owned;
    uint8_t *buf = (uint8_t *)scratch_get(0, (size_t)(M * (2 * QB + 3 * SB * (int64_t)sizeof(float))), &owned);
    if (buf == NULL) return -2;
    float *dl = (float *)buf, *dl4 = dl + M * SB, *xs4 = dl4 + M * SB;
    int8_t *qx = (int8_t *)(xs4 + M * SB), *q4 = qx + M * QB;
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t a = 0; a < M; ++a)
        quantize_repacked(xf + a * ldf, K, QB, SB, qx + a * QB, dl + a * SB, q4 + a * QB, dl4 + a * SB, xs4 + a * SB);
    const RepackActs X = {QB, SB, qx, dl, dl, NULL, q4, dl4, xs4};
    const int64_t L = (N + DIRECT_STREAMS - 1) / DIRECT_STREAMS;
    if (M == 1 && DIRECT_STREAMS == 4) { /* rp2_stripe4's four places */
#pragma omp parallel for schedule(guided) if (L > 1 && N * K >= 32768)
        for (int64_t t = 0; t < L; ++t) rp2_stripe4(row_ptrs, row_fmts, N, L, t, K, &X, bias, y, accumulate);
    } else {
#pragma omp parallel for schedule(guided) if (L > 1 && M * N * K >= 32768)
        for (int64_t t = 0; t < L; ++t)
            micro_stripe(rp_pick, row_ptrs, row_fmts, N, L, t, K, &X, M, bias, y, ldy, accumulate);
    }
    scratch_put(buf, owned);
    return 0;
}
#endif

/* Rows n0 .. n0 + TILE_ROWS (those < N) against all M activation rows */
static void tile(const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, int64_t n0, const Acts *A,
                 int64_t M, Decoded *dec, const float *bias, float *y, int64_t ldy, int accumulate) {
    int any_int = 0;
    for (int i = 0; i < TILE_ROWS; ++i) {
        const int64_t n = n0 + i;
        dec[i].kind = 0;
        if (n < N && !is_float_fmt(row_fmts[n])) {
#if defined(MINISGL_AVX2) && !defined(MINISGL_AVX512)
            const int signed8 = 1;
#else
            const int signed8 = 0;
#endif
            dec[i].kind = decode_row(row_fmts[n], (const uint8_t *)(intptr_t)row_ptrs[n], A->K, &dec[i], signed8);
            any_int |= dec[i].kind != 0;
        }
        if (dec[i].kind == 0) { /* zeros: the micro-kernel runs over it, nothing is stored */
            memset(dec[i].u, 0, (size_t)A->K);
            memset(dec[i].sc, 0, sizeof(float) * (size_t)(A->K / 16));
            memset(dec[i].bi, 0, sizeof(float) * (size_t)(A->K / 16));
        } /* (past K the scratch stays as zeroed when allocated: decoding never writes there) */
    }
    float out[MICRO_ROWS][MICRO_ACTS];
    if (any_int)
        for (int s = 0; s < TILE_ROWS; s += MICRO_ROWS)
            for (int64_t a0 = 0; a0 < M; a0 += MICRO_ACTS) {
                const int R = M - a0 < MICRO_ACTS ? (int)(M - a0) : MICRO_ACTS;
                int_micro(dec + s, A, a0, R, out);
                for (int w = 0; w < MICRO_ROWS; ++w)
                    if (dec[s + w].kind != 0)
                        for (int a = 0; a < R; ++a) put(y, ldy, a0 + a, n0 + s + w, out[w][a], bias, accumulate);
            }
    for (int i = 0; i < TILE_ROWS; ++i) {
        const int64_t n = n0 + i;
        if (n >= N || !is_float_fmt(row_fmts[n])) continue;
        for (int64_t a0 = 0; a0 < M; a0 += MICRO_ACTS) {
            const int R = M - a0 < MICRO_ACTS ? (int)(M - a0) : MICRO_ACTS;
            float o[MICRO_ACTS];
            float_dot(row_fmts[n], (const uint8_t *)(intptr_t)row_ptrs[n], A, a0, R, o);
            for (int a = 0; a < R; ++a) put(y, ldy, a0 + a, n, o[a], bias, accumulate);
        }
    }
}

#if defined(MINISGL_AMX) || defined(MINISGL_BF16)
/* ---- weights decoded to bfloat16 for the prefill passes of the amx and avx512bf16 builds ---- */
/* A decoded row (u, sc, bi) -> K bf16 weights, w = sc * u + bi per 16 */
static void bf16_row(const Decoded *r, int64_t K, uint16_t *out) {
    for (int64_t c = 0; c < K / 16; c += 2) {
        const __m512 u0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r->u + 16 * c))));
        const __m512 u1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r->u + 16 * c + 16))));
        const __m512 w0 = _mm512_fmadd_ps(_mm512_set1_ps(r->sc[c]), u0, _mm512_set1_ps(r->bi[c]));
        const __m512 w1 = _mm512_fmadd_ps(_mm512_set1_ps(r->sc[c + 1]), u1, _mm512_set1_ps(r->bi[c + 1]));
        _mm512_storeu_si512((void *)(out + 16 * c), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
}

/* One block's 32 unsigned values (l: the first 16, h: the second) as bf16, w = d u + b (bf16_row's
 * operations) */
static inline void bf16_values32(__m128i l, __m128i h, float d, float b, uint16_t *out) {
    const __m512 dv = _mm512_set1_ps(d), bv = _mm512_set1_ps(b);
    const __m512 w0 = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(l)), bv);
    const __m512 w1 = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h)), bv);
    _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}

/* Block L's 32 weights of 4 blocks' unsigned values (lo: the first 16 of each block in 128-bit lane L,
 * hi: the second 16) as bf16 */
static inline void bf16_block(__m512i lo, __m512i hi, int L, float d, float b, uint16_t *out) {
    const __m128i l = L == 0 ? _mm512_extracti32x4_epi32(lo, 0) : L == 1 ? _mm512_extracti32x4_epi32(lo, 1)
                    : L == 2 ? _mm512_extracti32x4_epi32(lo, 2) : _mm512_extracti32x4_epi32(lo, 3);
    const __m128i h = L == 0 ? _mm512_extracti32x4_epi32(hi, 0) : L == 1 ? _mm512_extracti32x4_epi32(hi, 1)
                    : L == 2 ? _mm512_extracti32x4_epi32(hi, 2) : _mm512_extracti32x4_epi32(hi, 3);
    bf16_values32(l, h, d, b, out);
}

/* A partial sub-group of a repacked row (n = 4, 2 or 1 blocks at g; the layout: "repacked rows"
 * above) -> its 32 n bf16 weights: each block's dwords gathered back from their lanes, then
 * bf16_values32 (the way round through repack_row and decode_row took 15% of a K = 576
 * row's decoding for 2 blocks of 18) */
static void bf16_partial(int base, int n, const uint8_t *g, uint16_t *out) {
    const int has_min = base == Q4_1, q8 = base == Q8_0, per = 8 / n;
    const uint8_t *q = g + (has_min ? 4 : 2) * n;
    for (int b = 0; b < n; ++b) {
        uint16_t h;
        memcpy(&h, g + 2 * b, 2);
        const float d = half_to_float(h);
        float bias = (q8 ? -128.f : -8.f) * d;
        if (has_min) memcpy(&h, g + 2 * n + 2 * b, 2), bias = half_to_float(h);
        uint32_t w[8];
        __m128i lo, hi;
        if (!q8) { /* dword sd * n + b: bytes 4 sd.. of the block's nibbles */
            for (int sd = 0; sd < 4; ++sd) memcpy(&w[sd], q + 4 * (sd * n + b), 4);
            const __m128i v = _mm_loadu_si128((const __m128i *)w), low4 = _mm_set1_epi8(0x0F);
            lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        } else { /* bytes 16 h + 4 sd.. of block b: lane i = (sd % per) 2n + h n + b of vector sd / per */
            for (int t = 0; t < 8; ++t) {
                const int hh = t / 4, sd = t % 4, i = (sd % per) * 2 * n + hh * n + b;
                memcpy(&w[t], q + 4 * (16 * (sd / per) + i), 4);
            }
            const __m128i flip = _mm_set1_epi8((char)0x80);
            lo = _mm_xor_si128(_mm_loadu_si128((const __m128i *)w), flip);
            hi = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(w + 4)), flip);
        }
        bf16_values32(lo, hi, d, bias, out + 32 * b);
    }
}

/* A repacked row (Q4_0R, Q4_1R, Q8_0R) -> K bf16 weights, the values bf16_row gives for the row
 * put back in order and decoded (w = d u + bias per block, the same operations), its full sub-groups
 * straight from their lanes: one pass instead of three (unpack, decode, convert), the AMX prefill of
 * gate/up at 256 rows 0.9x the time. Sub-groups under 8 blocks: bf16_partial. */
static void bf16_row_repacked(int fmt, const uint8_t *p, int64_t K, uint16_t *out) {
    const int base = base_fmt(fmt), ts = type_size(base), has_min = base == Q4_1, q8 = base == Q8_0;
    const int64_t nb = K / 32;
    int64_t g0 = 0;
    for (; g0 + 8 <= nb; g0 += 8) {
        const uint8_t *g = p + g0 * ts, *q = g + (has_min ? 32 : 16);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        const __m256 b = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)))
                                 : _mm256_mul_ps(_mm256_set1_ps(q8 ? -128.f : -8.f), d);
        float ds[8], bs[8];
        _mm256_storeu_ps(ds, d);
        _mm256_storeu_ps(bs, b);
        uint16_t *o = out + 32 * g0;
        if (!q8) { /* dword s * 8 + b: bytes 4s.. of block b's nibbles (unpack_group8's permutes) */
            for (int half = 0; half < 2; ++half) {
                const int b0 = 4 * half;
                const __m512i v = q4_blocks4(q, half);
                const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
                for (int L = 0; L < 4; ++L) bf16_block(lo, hi, L, ds[b0 + L], bs[b0 + L], o + 32 * (b0 + L));
            }
        } else { /* vector s, lane i = block i % 8, half i / 8, bytes 16 half + 4s.. */
            for (int half = 0; half < 2; ++half) {
                const int b0 = 4 * half;
                const __m512i flip = _mm512_set1_epi8((char)0x80);
                __m512i lo, hi;
                q8_blocks4(q, half, &lo, &hi);
                lo = _mm512_xor_si512(lo, flip), hi = _mm512_xor_si512(hi, flip); /* weights 0..15, 16..31 */
                for (int L = 0; L < 4; ++L) bf16_block(lo, hi, L, ds[b0 + L], bs[b0 + L], o + 32 * (b0 + L));
            }
        }
    }
    for (int n = 4; n >= 1; n /= 2) /* the last sub-groups (K = 576: 2 blocks) straight from their lanes */
        if (nb - g0 >= n) {
            bf16_partial(base, n, p + g0 * ts, out + 32 * g0);
            g0 += n;
        }
}

/* A thread's scratch for decoding rows of K to bf16: a Decoded row (its own bytes zeroed: decoding
 * never writes past K) at the start, then `extra` bytes from *off; NULL without memory */
static uint8_t *bf16_scratch(int64_t K, size_t extra, Decoded *dec, size_t *off) {
    const int64_t K64 = round_up(K, 64), C16 = round_up(K64 / 16, 16);
    *off = (size_t)round_up(K64 + 8 * C16, 64);
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, *off + extra);
    if (scratch == NULL) return NULL;
    memset(scratch, 0, *off);
    dec->u = scratch;
    dec->sc = (float *)(scratch + K64);
    dec->bi = dec->sc + C16;
    return scratch;
}

/* Rows n0 .. n0 + count of the weight -> bf16, row i at wbf + i * K (rows past N and float rows: zeros) */
static void bf16_rows(const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, int64_t n0, int count, int64_t K,
                      Decoded *dec, uint16_t *wbf) {
    for (int i = 0; i < count; ++i) {
        const int64_t n = n0 + i;
        if (n < N && is_repacked(row_fmts[n]))
            bf16_row_repacked(row_fmts[n], (const uint8_t *)(intptr_t)row_ptrs[n], K, wbf + i * K);
        else if (n < N && decode_row(row_fmts[n], (const uint8_t *)(intptr_t)row_ptrs[n], K, dec, 0))
            bf16_row(dec, K, wbf + i * K);
        else
            memset(wbf + i * K, 0, sizeof(uint16_t) * (size_t)K);
    }
}


/* Group g's 16 rows (format base: Q4_0, Q4_1 or Q8_0 (panel_fmt), nb blocks; the layout: "grouped
 * rows") as bf16 pairs straight in
 * the bf16 prefill's panel layout (bf16_panel's: pair p of row r at panel[32 p + 16 h + r], the group
 * as rows 16 h ..): the lanes already hold one row each, so no transpose. The values are bf16_row's
 * (w = d u + b in one fused step, rounded to nearest even), bitwise. */
static inline int panel_fmt(int base) { return base == Q4_0 || base == Q4_1 || base == Q8_0; }
static void bf16_group_panel(int base, const uint8_t *g, int64_t nb, int h, uint32_t *panel) {
    const int has_min = base == Q4_1, q8 = base == Q8_0;
    const int64_t QS = group_qbytes(base), HS = group_hbytes(base);
    const float bias_of_d = base == Q4_0 ? -8.f : -128.f;
    __m512i byte[4]; /* byte i of each dword, zero-extended (vpshufb indexes within 128-bit lanes) */
    const __m512i dword4 = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
    for (int i = 0; i < 4; ++i)
        byte[i] = _mm512_or_si512(_mm512_set1_epi32((int)(0x80808000u | (uint32_t)i)), dword4);
    const __m512i pairs = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                            0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                            0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F); /* words 0, 16, 1, 17 .. */
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *q = g + group_q_off(b, QS, HS), *hd = g + group_h_off(b, nb, QS, HS);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)hd));
        const __m512 bi = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hd + 32)))
                                  : _mm512_mul_ps(_mm512_set1_ps(bias_of_d), d);
        uint32_t *out = panel + 32 * 16 * b + 16 * h;
        for (int v = 0; v < 8; ++v) { /* v's dwords: weights 4 v' .. of the block (pairs 2 v', 2 v' + 1) */
            __m512i u;
            int first; /* the block's first weight in v */
            if (q8) u = _mm512_load_si512((const void *)(q + 64 * v)), first = 4 * v;
            else {
                const __m512i raw = _mm512_load_si512((const void *)(q + 64 * (v % 4)));
                u = v < 4 ? _mm512_and_si512(raw, low4) : _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                first = v < 4 ? 4 * v : 16 + 4 * (v - 4);
            }
            for (int pp = 0; pp < 2; ++pp) {
                const __m512 w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(u, byte[2 * pp])), bi);
                const __m512 w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(u, byte[2 * pp + 1])), bi);
                const __m512i pk = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
                _mm512_storeu_si512((void *)(out + 32 * (first / 2 + pp)), pk);
            }
        }
    }
}

#endif

#if defined(MINISGL_AMX)
#include <sys/syscall.h>
#include <unistd.h>

/* Asks Linux for the AMX tile state (once per process; every thread may then use the tiles). */
int minisgl_amx_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tmm0-3: four 16 x 16 float32 sums, tmm4-5: two weight tiles (16 rows x 32 k), tmm6-7: two
 * activation tiles (16 k pairs x 16 rows x 2) */
static void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
}

/* Activations f32 (M rows, stride ld) -> bf16 in AMX's pair layout, zero past M (Mp rows, a multiple
 * of 32): for row tile r = m / 16 and k-step s, 16 k pairs x 16 rows x 2: element (m, 2j + h) of the
 * step at ((r * K / 32 + s) * 16 + j) * 32 + (m % 16) * 2 + h. A row tile's steps lie one after the
 * other, so the tile loop over K reads them as one stream, and it prefetches the next step's two
 * tiles into L1 (the steps of all row tiles interleaved, each step jumping Mp KB, made the tile
 * loads wait: the projections at M = 2,048 took 1.4-1.55x the time, at M = 128 1.02-1.15x). */
static void amx_pack_acts(const float *x, int64_t ld, int64_t M, int64_t Mp, int64_t K, uint16_t *out) {
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t m = 0; m < Mp; ++m) {
        for (int64_t s = 0; s < K / 32; ++s) {
            uint32_t *dst = (uint32_t *)(out + ((m / 16 * (K / 32) + s) * 16) * 32) + (m % 16);
            if (m >= M) {
                for (int j = 0; j < 16; ++j) dst[j * 16] = 0;
                continue;
            }
            const __m512 lo = _mm512_loadu_ps(x + m * ld + 32 * s), hi = _mm512_loadu_ps(x + m * ld + 32 * s + 16);
            uint32_t pairs[16];
            _mm512_storeu_si512((void *)pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); /* k 0..31 in order */
            for (int j = 0; j < 16; ++j) dst[j * 16] = pairs[j];
        }
    }
}

/* Rows n0 .. n0 + 32 of the weight (decoded to bf16, rows past N zero) against all Mp activation
 * rows: 2 x 2 tiles of 16 x 16 sums per step of 32 k. */
static void amx_tile_pair(const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, int64_t n0, int64_t M,
                          int64_t Mp, int64_t K, const uint16_t *acts, Decoded *dec, uint16_t *wbf, float *cbuf,
                          const float *bias, float *y, int64_t ldy, int accumulate) {
    bf16_rows(row_ptrs, row_fmts, N, n0, 32, K, dec, wbf);
    const int64_t steps = K / 32;
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(4, wbf + 32 * s, K * 2);
            _tile_loadd(5, wbf + 16 * K + 32 * s, K * 2);
            const uint16_t *a0 = acts + ((m0 / 16 * steps + s) * 16) * 32, *a1 = a0 + steps * 16 * 32;
            for (int l = 0; l < 16; ++l) { /* the next step's activation tiles into L1, a line each */
                _mm_prefetch((const char *)(a0 + 512) + 64 * l, _MM_HINT_T0);
                _mm_prefetch((const char *)(a1 + 512) + 64 * l, _MM_HINT_T0);
            }
            _tile_loadd(6, a0, 64);
            _tile_loadd(7, a1, 64);
            _tile_dpbf16ps(0, 4, 6); /* weight rows 0..15 x act rows 0..15 */
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        for (int t = 0; t < 4; ++t) { /* tile (w, a): C[n][m], weight rows 16 (t / 2), act rows 16 (t % 2) */
            switch (t) {
            case 0: _tile_stored(0, cbuf, 64); break;
            case 1: _tile_stored(1, cbuf, 64); break;
            case 2: _tile_stored(2, cbuf, 64); break;
            default: _tile_stored(3, cbuf, 64); break;
            }
            /* column j of the tile (act row m) is y[m, nb .. nb + 16): gathered, then as put() does */
            const int64_t nb = n0 + 16 * (t / 2);
            if (nb >= N) continue;
            const __mmask16 cols = nb + 16 <= N ? 0xFFFF : (__mmask16)((1u << (N - nb)) - 1);
            const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                      _mm512_set1_epi32(16));
            const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(cols, bias + nb) : _mm512_setzero_ps();
            for (int j = 0; j < 16; ++j) {
                const int64_t m = m0 + 16 * (t % 2) + j;
                if (m >= M) break;
                __m512 v = _mm512_i32gather_ps(stride, cbuf + j, 4);
                if (bias != NULL) v = _mm512_add_ps(v, b);
                float *o = y + m * ldy + nb;
                if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(cols, o), v);
                _mm512_mask_storeu_ps(o, cols, v);
            }
        }
    }
}

/* The prefill matmul in AMX tiles (see the file's comment); xf: the activations after the pre-op. */
static int qlinear_amx(const float *xf, int64_t ldf, int64_t M, int64_t K, const int64_t *row_ptrs,
                       const int32_t *row_fmts, int64_t N, const float *bias, float *y, int64_t ldy, int accumulate) {
    const int64_t Mp = round_up(M, 32);
    uint16_t *acts = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(Mp * K));
    if (acts == NULL) return -2;
    amx_pack_acts(xf, ldf, M, Mp, K, acts);
    const int64_t pairs = (N + 31) / 32;
    int failed = 0;
#pragma omp parallel if (pairs > 1 && M * N * K >= 32768) reduction(| : failed)
    {
        const size_t w_bytes = sizeof(uint16_t) * (size_t)(32 * K);
        Decoded dec;
        size_t dec_bytes;
        uint8_t *scratch = bf16_scratch(K, w_bytes + 64 * 16 * 16, &dec, &dec_bytes);
        if (scratch == NULL) failed = 1;
        else amx_configure();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; ++p)
            if (scratch != NULL)
                amx_tile_pair(row_ptrs, row_fmts, N, 32 * p, M, Mp, K, acts, &dec, (uint16_t *)(scratch + dec_bytes),
                              (float *)(scratch + dec_bytes + w_bytes), bias, y, ldy, accumulate);
        if (scratch != NULL) _tile_release();
        free(scratch);
    }
    free(acts);
    return failed ? -2 : 0;
}
#endif

#if defined(MINISGL_BF16)
/* ---- prefill passes in bfloat16 dot products (the avx512bf16 build: AVX-512 BF16 without AMX) ----
 * Weights are decoded 32 rows at a time to bf16 (the AMX build's values) and laid out as a panel of k
 * pairs: pair p's 32 dwords (row n's weights 2p, 2p + 1 in dword n) are two vectors of vdpbf16ps's
 * second operand. An activation row's pair is its first operand, broadcast from memory. A micro-tile
 * is BF_MR activation rows x the panel's 32 rows: 2 BF_MR float32 accumulators, two vector loads a
 * pair, no other work in the loop (the integer kernel spends as many float operations scaling its
 * sums per block as it does products). Each output is one lane's sum over the pairs in order, the
 * same sequence whatever M, the micro-tile or the thread (batch-invariant). */
/* activation rows of a micro-tile: 24 accumulators and 2 weight vectors of 32 (a 2-core Zen 4, the
 * embedded model's projections at 140 rows: 8 or 14 rows the same time within the noise, ~180 GMAC/s
 * on both cores, 80% of vdpbf16ps's peak) */
#define BF_MR 12

/* Activations f32 (M rows, stride ld) -> bf16 pairs in micro-tile order, zeros in rows M .. Mp: the
 * pair p of row m is dword (m / BF_MR * P + p) * BF_MR + m % BF_MR, so that a micro-tile reads its
 * rows' pairs as one stream (its rows side by side, 12 streams a tile, made the loads wait at M = 512) */
static void bf16_acts(const float *x, int64_t ld, int64_t M, int64_t Mp, int64_t K, uint32_t *out) {
    const int64_t P = K / 2;
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t m = 0; m < Mp; ++m) {
        uint32_t *dst = out + m / BF_MR * P * BF_MR + m % BF_MR;
        for (int64_t k = 0; k < K; k += 32) {
            uint32_t pairs[16] = {0};
            if (m < M)
                _mm512_storeu_si512((void *)pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * ld + k + 16),
                                                                              _mm512_loadu_ps(x + m * ld + k)));
            for (int j = 0; j < 16; ++j) dst[(k / 2 + j) * BF_MR] = pairs[j];
        }
    }
}

/* v[i] (row i of a 16 x 16 dword matrix) -> v[j] = its column j */
static inline void transpose16_dwords(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; ++j) {
        v[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        v[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
    }
}

/* 32 bf16 rows of K (row i at w + i * K) -> the panel: pair p's dword n at panel[32 p + n] */
static void bf16_panel(const uint16_t *w, int64_t K, uint32_t *panel) {
    const int64_t P = K / 2; /* a multiple of 16: K is whole blocks of 32 */
    for (int64_t p0 = 0; p0 < P; p0 += 16)
        for (int h = 0; h < 2; ++h) {
            __m512i v[16];
            for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512((const void *)(w + (16 * h + i) * K + 2 * p0));
            transpose16_dwords(v);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512((void *)(panel + 32 * (p0 + j) + 16 * h), v[j]);
        }
}

/* A micro-tile's activation rows a (P pairs of BF_MR dwords) against the panel: y[m0 + r][n0 .. n0 + 32) for r < R */
static void bf16_micro(const uint32_t *a, int64_t P, const uint32_t *panel, int64_t m0, int R, int64_t n0, int64_t N,
                       const float *bias, float *y, int64_t ldy, int accumulate) {
    __m512 acc[BF_MR][2];
    for (int r = 0; r < BF_MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(panel + 32 * p));
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(panel + 32 * p + 16));
        for (int r = 0; r < BF_MR; ++r) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[p * BF_MR + r]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        }
    }
    for (int h = 0; h < 2; ++h) {
        const int64_t nb = n0 + 16 * h;
        if (nb >= N) break;
        const __mmask16 cols = nb + 16 <= N ? 0xFFFF : (__mmask16)((1u << (N - nb)) - 1);
        const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(cols, bias + nb) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
            __m512 v = acc[r][h];
            if (bias != NULL) v = _mm512_add_ps(v, b);
            float *o = y + (m0 + r) * ldy + nb;
            if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(cols, o), v);
            _mm512_mask_storeu_ps(o, cols, v);
        }
    }
}

/* The prefill matmul in bf16 dot products (see above); xf: the activations after the pre-op. */
static int qlinear_bf16(const float *xf, int64_t ldf, int64_t M, int64_t K, const int64_t *row_ptrs,
                        const int32_t *row_fmts, int64_t N, const float *bias, float *y, int64_t ldy, int accumulate) {
    const int64_t Mp = round_up(M, BF_MR), P = K / 2, panels = (N + 31) / 32;
    uint32_t *acts = (uint32_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(Mp * K));
    if (acts == NULL) return -2;
    bf16_acts(xf, ldf, M, Mp, K, acts);
    int failed = 0;
#pragma omp parallel if (panels > 1 && M * N * K >= 32768) reduction(| : failed)
    {
        const size_t w_bytes = sizeof(uint16_t) * (size_t)(32 * K);
        Decoded dec;
        size_t dec_bytes;
        uint8_t *scratch = bf16_scratch(K, 2 * w_bytes, &dec, &dec_bytes);
        if (scratch == NULL) failed = 1;
        uint16_t *wbf = (uint16_t *)(scratch + dec_bytes);
        uint32_t *panel = (uint32_t *)(scratch + dec_bytes + w_bytes);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < panels; ++t) {
            if (scratch == NULL) continue;
            if (is_grouped(row_fmts[32 * t]) && panel_fmt(base_fmt(row_fmts[32 * t])) &&
                (32 * t + 16 >= N || panel_fmt(base_fmt(row_fmts[32 * t + 16])))) /* (a weight is grouped whole) */
                for (int h = 0; h < 2; ++h) {
                    if (32 * t + 16 * h < N)
                        bf16_group_panel(base_fmt(row_fmts[32 * t + 16 * h]),
                                         group_of((const uint8_t *)(intptr_t)row_ptrs[32 * t + 16 * h]), K / 32, h, panel);
                    else
                        for (int64_t p = 0; p < K / 2; ++p) memset(panel + 32 * p + 16, 0, 16 * sizeof(uint32_t));
                }
            else { /* (other grouped rows are put back in the file's order, a row at a time) */
                bf16_rows(row_ptrs, row_fmts, N, 32 * t, 32, K, &dec, wbf);
                bf16_panel(wbf, K, panel);
            }
            for (int64_t m0 = 0; m0 < M; m0 += BF_MR)
                bf16_micro(acts + m0 * P, P, panel, m0, M - m0 < BF_MR ? (int)(M - m0) : BF_MR,
                           32 * t, N, bias, y, ldy, accumulate);
        }
        free(scratch);
    }
    free(acts);
    return failed ? -2 : 0;
}
#endif

/* A matmul kernel over activation rows xf (M, K; stride ldf) after the pre-op */
typedef int (*BlockedFn)(const float *xf, int64_t ldf, int64_t M, int64_t K, const int64_t *row_ptrs,
                         const int32_t *row_fmts, int64_t N, const float *bias, float *y, int64_t ldy, int accumulate);

/* y (M, N; row stride ldy) (+)= op(x) @ W^T (+ bias).
 *   x: (M, K) with row stride ldx; for PRE_SILU_MUL (M, 2K) laid out [gate | up]
 *   pre: PRE_NONE, PRE_RMSNORM (pre_w: the norm's (K) weight, eps) or PRE_SILU_MUL
 *   row_ptrs, row_fmts (N): each weight row's address and ggml type; K a multiple of its block size
 *   prefill: 0 a decode pass, 1 a prefill pass (the AMX build multiplies block formats in AMX tiles
 *            then), 2 a prefill pass in bf16 products where the build has them (AMX, AVX-512 BF16)
 * Returns 0, -1 for an unknown type or a K the blocks do not divide, -2 without memory. */
int minisgl_qlinear(const float *x, int64_t M, int64_t K, int64_t ldx, int pre, const float *pre_w, float eps,
                    const int64_t *row_ptrs, const int32_t *row_fmts, int64_t N, const float *bias, float *y,
                    int64_t ldy, int accumulate, int prefill) {
    int has_int = 0, has_float = 0;
    const int uniform = N > 0 && same_fmt(row_fmts, N); /* most weights: one pass, no per-row checks */
    for (int64_t n = 0; n < (uniform ? 1 : N); ++n) {
        const int bs = block_size(row_fmts[n]);
        if (bs == 0 || K % bs) return -1;
        if (is_float_fmt(row_fmts[n])) has_float = 1;
        else has_int = 1;
    }
    if (M <= 0 || N <= 0) return 0;
    Acts A;
    A.K = K;
    A.K64 = round_up(K, 64);
    A.C16 = round_up(A.K64 / 16, 16);
    float *xf = NULL;
    int xf_owned = 0;
    if (pre == PRE_NONE) {
        A.xf = x;
        A.ldf = ldx;
    } else {
        xf = (float *)scratch_get(1, sizeof(float) * (size_t)(M * K), &xf_owned);
        if (xf == NULL) return -2;
#pragma omp parallel for if (M * K >= 65536)
        for (int64_t m = 0; m < M; ++m) {
            if (pre == PRE_RMSNORM) rmsnorm_row(x + m * ldx, pre_w, eps, K, xf + m * K);
            else silu_mul_row(x + m * ldx, x + m * ldx + K, K, xf + m * K);
        }
        A.xf = xf;
        A.ldf = K;
    }
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
    BlockedFn blocked = NULL; /* the grouped or repacked rows' kernel, RP_M_BLOCK activation rows at a
                               * time: their quantized rows stay in the L2 */
#if defined(MINISGL_AVX512)
    if ((!prefill || RP_PREFILL || (GROUP_PREFILL && prefill == 1)) &&
        (uniform ? is_grouped(row_fmts[0]) : all_grouped(row_fmts, N)))
        blocked = qlinear_grouped;
#endif
    if (blocked == NULL && (!prefill || RP_PREFILL) && (uniform ? is_repacked(row_fmts[0]) : all_repacked(row_fmts, N)))
        blocked = qlinear_repacked;
    if (blocked != NULL) {
        int rc = 0;
        for (int64_t m0 = 0; m0 < M && rc == 0; m0 += RP_M_BLOCK)
            rc = blocked(A.xf + m0 * A.ldf, A.ldf, M - m0 < RP_M_BLOCK ? M - m0 : RP_M_BLOCK, K, row_ptrs, row_fmts,
                         N, bias, y + m0 * ldy, ldy, accumulate);
        scratch_put(xf, xf_owned);
        return rc;
    }
#endif
#if defined(MINISGL_AVX512) || defined(MINISGL_AVX2)
    if (!prefill && !has_float && (uniform ? is_direct_fmt(row_fmts[0]) : direct_weight(row_fmts, N))) {
        const int rc = qlinear_direct(A.xf, A.ldf, M, K, row_ptrs, row_fmts, N, bias, y, ldy, accumulate);
        scratch_put(xf, xf_owned);
        return rc;
    }
#endif
#if defined(MINISGL_AMX) || defined(MINISGL_BF16)
    if (prefill && has_int && !has_float) {
#if defined(MINISGL_AMX)
        const int rc = qlinear_amx(A.xf, A.ldf, M, K, row_ptrs, row_fmts, N, bias, y, ldy, accumulate);
#else
        const int rc = qlinear_bf16(A.xf, A.ldf, M, K, row_ptrs, row_fmts, N, bias, y, ldy, accumulate);
#endif
        scratch_put(xf, xf_owned);
        return rc;
    }
#else
    (void)prefill;
#endif
    A.qx = NULL, A.dx = NULL, A.xs = NULL;
    void *qbuf = NULL;
    if (has_int) {
        const size_t qx_bytes = (size_t)(M * A.K64), dx_bytes = sizeof(float) * (size_t)(M * (A.K64 / 16));
        qbuf = malloc(qx_bytes + dx_bytes + sizeof(float) * (size_t)(M * A.C16) + 64);
        if (qbuf == NULL) {
            scratch_put(xf, xf_owned);
            return -2;
        }
        A.xs = (float *)qbuf;
        A.dx = A.xs + M * A.C16;
        A.qx = (int8_t *)(A.dx + M * (A.K64 / 16));
#pragma omp parallel for if (M * K >= 65536)
        for (int64_t m = 0; m < M; ++m)
            quantize_row(A.xf + m * A.ldf, K, A.K64, A.C16, A.qx + m * A.K64, A.dx + m * (A.K64 / 16), A.xs + m * A.C16);
    }
    (void)has_float;
    int failed = 0;
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel if (tiles > 1 && M * N * K >= 32768) reduction(| : failed)
    {
        const size_t row_bytes = (size_t)A.K64 + 2 * sizeof(float) * (size_t)A.C16;
        const size_t scratch_bytes = (size_t)round_up((int64_t)(row_bytes * TILE_ROWS), 64);
        uint8_t *scratch = (uint8_t *)aligned_alloc(64, scratch_bytes);
        Decoded dec[TILE_ROWS];
        if (scratch == NULL) failed = 1;
        else memset(scratch, 0, scratch_bytes);
        if (scratch != NULL)
            for (int i = 0; i < TILE_ROWS; ++i) {
                dec[i].u = scratch + row_bytes * i;
                dec[i].sc = (float *)(dec[i].u + A.K64);
                dec[i].bi = dec[i].sc + A.C16;
            }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t)
            if (scratch != NULL) {
                if (M <= 8) prefetch_rows(row_ptrs, row_fmts, N, (t + 1) * TILE_ROWS, TILE_ROWS, K);
                tile(row_ptrs, row_fmts, N, t * TILE_ROWS, &A, M, dec, bias, y, ldy, accumulate);
            }
        free(scratch);
    }
    free(qbuf);
    scratch_put(xf, xf_owned);
    return failed ? -2 : 0;
}

/* ---- packed entry points: the arguments as one int64 array (floats as their bits in the low 32) --
 * what minisgl.kernels.graph records and minisgl_graph_run (cpu_kernels.c) replays. */

static inline float arg_float(int64_t a) {
    const int32_t bits = (int32_t)a;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#define P(i) ((void *)(intptr_t)a[i])

int minisgl_qlinear_packed(const int64_t *a) {
    return minisgl_qlinear(P(0), a[1], a[2], a[3], (int)a[4], P(5), arg_float(a[6]), P(7), P(8), a[9], P(10), P(11),
                           a[12], (int)a[13], (int)a[14]);
}

int minisgl_dequant_rows_packed(const int64_t *a) {
    return minisgl_dequant_rows(P(0), P(1), a[2], P(3), a[4], a[5], P(6));
}
