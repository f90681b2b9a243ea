/* minisgl's CPU kernels: the small, memory-bound pieces of a forward pass that plain torch runs as
 * many separate ops (each a dispatch, a temporary and a pass over memory).
 *
 * Built at first use by minisgl/kernels/build.py (gcc -O3 -march=native -fopenmp), called through
 * ctypes with raw pointers of contiguous float32 tensors. No fast-math: every sum is written in a
 * fixed order, so results do not depend on the thread count.
 *
 * OpenMP here shares torch's runtime (both load libgomp.so.1), so the two never fight over threads.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The horizontal sums of r[0..7], as one vector. */
static inline __m256 hsum8x8(const __m256 r[8]) {
    const __m256 t0 = _mm256_hadd_ps(r[0], r[1]), t1 = _mm256_hadd_ps(r[2], r[3]);
    const __m256 t2 = _mm256_hadd_ps(r[4], r[5]), t3 = _mm256_hadd_ps(r[6], r[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* per 128-bit half */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r, times 2^n.
 * Relative error ~2e-7 (about expf's); x below -87 gives 0, as the softmax wants. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
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
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#define HAVE_AVX2 1
#endif

/* K/V elements: float32, or float16 (the CPU's KV pool with native weights). The helpers below take
 * the element type as a constant `half` and are inlined into one kernel per type. */
#define INLINE static inline __attribute__((always_inline))

INLINE float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, u;
    if (exp == 0x1F) u = sign | 0x7F800000u | (mant << 13);
    else if (exp != 0) u = sign | ((exp + 112) << 23) | (mant << 13);
    else if (mant == 0) u = sign;
    else {
        exp = 113;
        while (!(mant & 0x400u)) mant <<= 1, --exp;
        u = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* element i of a K/V buffer */
INLINE float kv1(const void *p, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(HAVE_AVX2) && defined(__F16C__)
/* elements i .. i + 8 of a K/V buffer */
INLINE __m256 kv8(const void *p, int64_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}
#define HAVE_KV8 1
#endif

/* A float vector for kernels written once for both widths (the extend attention, the MoE): 16 floats
 * on AVX-512, 8 on AVX2, FV_W of them */
#if defined(__AVX512F__)
#define FV_W 16
typedef __m512 fvec;
INLINE fvec fv_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE void fv_store(float *p, fvec v) { _mm512_storeu_ps(p, v); }
INLINE fvec fv_fma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE fvec fv_set1(float x) { return _mm512_set1_ps(x); }
INLINE fvec fv_zero(void) { return _mm512_setzero_ps(); }
INLINE float fv_sum(fvec v) { return _mm512_reduce_add_ps(v); }
#elif defined(HAVE_AVX2)
#define FV_W 8
typedef __m256 fvec;
INLINE fvec fv_load(const float *p) { return _mm256_loadu_ps(p); }
INLINE void fv_store(float *p, fvec v) { _mm256_storeu_ps(p, v); }
INLINE fvec fv_fma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
INLINE fvec fv_set1(float x) { return _mm256_set1_ps(x); }
INLINE fvec fv_zero(void) { return _mm256_setzero_ps(); }
INLINE float fv_sum(fvec v) { return hsum8(v); }
#endif

/* sum_d a[d] * b[d], b the K/V elements from b0 */
INLINE float dot(const float *a, const void *b, int64_t b0, int64_t D, int half) {
    int64_t d = 0;
    float s = 0.f;
#ifdef HAVE_KV8
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; d + 16 <= D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), kv8(b, b0 + d, half), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), kv8(b, b0 + d + 8, half), a1);
    }
    for (; d + 8 <= D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), kv8(b, b0 + d, half), a0);
    s = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; d < D; ++d) s += a[d] * kv1(b, b0 + d, half);
    return s;
}

#if defined(HAVE_AVX2) && defined(__AVX512F__)
/* exp8's polynomial on 16 floats */
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

/* x[0:n] <- softmax(scale * x), in place (scale > 0): 16 lanes at a time, the tail masked (the
 * scalar max and normalisation loops of the AVX2 form took 13% of a 1,024-token prefill) */
static void softmax_inplace(float *x, int64_t n, float scale) {
    const int64_t n16 = n / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (n - n16)) - 1);
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n16; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + j));
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, x + n16));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm)), vscale = _mm512_set1_ps(scale);
    __m512 vs = _mm512_setzero_ps();
    for (int64_t j = 0; j < n16; j += 16) {
        const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), m), vscale));
        _mm512_storeu_ps(x + j, e);
        vs = _mm512_add_ps(vs, e);
    }
    if (tail) {
        const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + n16), m), vscale));
        _mm512_mask_storeu_ps(x + n16, tail, e);
        vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(tail, e));
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vs));
    for (int64_t j = 0; j < n16; j += 16) _mm512_storeu_ps(x + j, _mm512_mul_ps(_mm512_loadu_ps(x + j), inv));
    if (tail) _mm512_mask_storeu_ps(x + n16, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + n16), inv));
}
#else
/* x[0:n] <- softmax(scale * x), in place (scale > 0) */
static void softmax_inplace(float *x, int64_t n, float scale) {
    float m = x[0];
    for (int64_t j = 1; j < n; ++j) m = x[j] > m ? x[j] : m;
    float sum = 0.f;
    int64_t j = 0;
#ifdef HAVE_AVX2
    const __m256 vm = _mm256_set1_ps(m), vscale = _mm256_set1_ps(scale);
    __m256 vs = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vscale));
        _mm256_storeu_ps(x + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum8(vs);
#endif
    for (; j < n; ++j) {
        x[j] = expf((x[j] - m) * scale);
        sum += x[j];
    }
    const float inv = 1.f / sum;
    for (j = 0; j < n; ++j) x[j] *= inv;
}

#endif

#ifdef HAVE_KV8
/* s[0:L] (+)= q[0:64] . K[j][0:64] where K[j] starts at element k0 + offs[j]: 8 positions per step,
 * q in registers. */
INLINE void scores64(const float *q, const void *k, int64_t k0, const int64_t *offs, int64_t L, float *s, int first,
                     int half) {
    const int64_t esize = half ? 2 : 4;
    __m256 qv[8];
    for (int i = 0; i < 8; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) {
        __m256 r[8];
        for (int u = 0; u < 8; ++u) {
            const int64_t kr = k0 + offs[j + u];
            if (j + 16 < L) _mm_prefetch((const char *)k + (k0 + offs[j + u + 8]) * esize, _MM_HINT_T0);
            __m256 a = _mm256_mul_ps(qv[0], kv8(k, kr, half));
            for (int i = 1; i < 8; ++i) a = _mm256_fmadd_ps(qv[i], kv8(k, kr + 8 * i, half), a);
            r[u] = a;
        }
        __m256 t = hsum8x8(r);
        if (!first) t = _mm256_add_ps(t, _mm256_loadu_ps(s + j));
        _mm256_storeu_ps(s + j, t);
    }
    for (; j < L; ++j) {
        const float d = dot(q, k, k0 + offs[j], 64, half);
        s[j] = first ? d : s[j] + d;
    }
}

/* o[0:64] = sum_j p[j] * V[j][0:64] where V[j] starts at element v0 + offs[j]: the 64 sums in 8
 * registers. */
INLINE void weighted_sum64(const float *p, const void *v, int64_t v0, const int64_t *offs, int64_t L, float *o,
                           int half) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
        const __m256 pj = _mm256_broadcast_ss(p + j);
        const int64_t vr = v0 + offs[j];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pj, kv8(v, vr + 8 * i, half), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + 8 * i, a[i]);
}
#endif

#if defined(__AVX512F__)
/* elements i .. i + 16 of a K/V buffer as float32 */
INLINE __m512 kv16(const void *p, int64_t i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}
#endif

#if defined(HAVE_KV8) && defined(__AVX512F__)
/* The AVX-512 forms of scores64 / weighted_sum64: a 64-wide head row is 4 registers, not 8, so a
 * position costs half the loads, conversions and FMAs (decode attention at batch 16: 12% of the
 * scheduler's CPU time with the AVX2 forms). */

/* The lane sums of r[0..15] as one vector, lane u holding r[u]'s: a transpose as it adds (45
 * operations against 16 separate reductions' ~130). */
INLINE __m512 hsum16x16(const __m512 r[16]) {
    __m512 w[8], x[4], u[2];
    /* the tree below leaves v[L + 4 j] in lane 4 L + j: feed it v[m] = r[4 (m % 4) + m / 4] */
#define HSUM_V(m) r[4 * ((m) % 4) + (m) / 4]
    for (int i = 0; i < 8; ++i) /* lanes 0-7: v[2i] j + j + 8; lanes 8-15: v[2i + 1]'s */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(HSUM_V(2 * i), HSUM_V(2 * i + 1), 0x44),
                             _mm512_shuffle_f32x4(HSUM_V(2 * i), HSUM_V(2 * i + 1), 0xEE));
#undef HSUM_V
    for (int i = 0; i < 4; ++i) /* 128-bit lane L: v[4i + L] j + j + 4 */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i) /* 128-bit lane L: v[8i + L] and v[8i + 4 + L], two lanes each */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
}

/* q[0:64] . K row at element kr, left in 16 lanes (their sum is the dot product) */
INLINE __m512 dot64_lanes(const __m512 qv[4], const void *k, int64_t kr, int half) {
    __m512 a = _mm512_mul_ps(qv[0], kv16(k, kr, half));
    for (int i = 1; i < 4; ++i) a = _mm512_fmadd_ps(qv[i], kv16(k, kr + 16 * i, half), a);
    return a;
}

/* s[0:L] (+)= q[0:64] . K[j][0:64] (K[j] at element k0 + offs[j]): 16 positions per step, q in 4
 * registers; the last L % 16 positions one at a time. */
INLINE void scores64x16(const float *q, const void *k, int64_t k0, const int64_t *offs, int64_t L, float *s,
                        int first, int half) {
    const int64_t esize = half ? 2 : 4;
    __m512 qv[4];
    for (int i = 0; i < 4; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        __m512 r[16];
        for (int u = 0; u < 16; ++u) {
            const int64_t kr = k0 + offs[j + u];
            if (j + 32 < L) _mm_prefetch((const char *)k + (k0 + offs[j + u + 16]) * esize, _MM_HINT_T0);
            r[u] = dot64_lanes(qv, k, kr, half);
        }
        __m512 t = hsum16x16(r);
        if (!first) t = _mm512_add_ps(t, _mm512_loadu_ps(s + j));
        _mm512_storeu_ps(s + j, t);
    }
    for (; j < L; ++j) {
        const float d = _mm512_reduce_add_ps(dot64_lanes(qv, k, k0 + offs[j], half));
        s[j] = first ? d : s[j] + d;
    }
}

/* o[0:64] = sum_j p[j] * V[j][0:64] (V[j] at element v0 + offs[j]): even and odd positions in two
 * sets of 4 accumulators (one set would wait on the FMA latency), added at the end. */
INLINE void weighted_sum64x16(const float *p, const void *v, int64_t v0, const int64_t *offs, int64_t L, float *o,
                              int half) {
    __m512 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= L; j += 2) {
        const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
        const int64_t r0 = v0 + offs[j], r1 = v0 + offs[j + 1];
        for (int i = 0; i < 4; ++i) {
            a[i] = _mm512_fmadd_ps(p0, kv16(v, r0 + 16 * i, half), a[i]);
            b[i] = _mm512_fmadd_ps(p1, kv16(v, r1 + 16 * i, half), b[i]);
        }
    }
    if (j < L) {
        const __m512 p0 = _mm512_set1_ps(p[j]);
        for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(p0, kv16(v, v0 + offs[j] + 16 * i, half), a[i]);
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + 16 * i, _mm512_add_ps(a[i], b[i]));
}
#define SCORES64 scores64x16
#define WEIGHTED_SUM64 weighted_sum64x16

/* The same two passes for G <= 3 query heads of one KV head at once (grouped-query attention): each
 * position's K and V are loaded and converted once for the G heads instead of once per head (the
 * conversions and the FMAs share this core's one 512-bit pipe). Every head's arithmetic is that of
 * scores64x16 / weighted_sum64x16 above, in the same order, so the results are bitwise theirs. */
#define GROUP_MAX 3
/* below this many (query head, position) pairs a decode attention call runs on one thread: the
 * fork and join cost more than the work (~8 ns a pair). 512: a fork and join takes ~0.7 us on a
 * 2-core Zen 4; the embedded model's 9 heads at batch 1 and ~130-230 positions (under 2,048, the
 * earlier threshold) went from one thread to two: 287-302 -> 208-273 us a step in three pairs */
#ifndef ATTN_PARALLEL_WORK
#define ATTN_PARALLEL_WORK 512
#endif
INLINE void scores64x16_group(const float *q, int64_t qs, const int G, const void *k, int64_t k0, const int64_t *offs,
                              int64_t L, float *s, int64_t ss, int first, int half) {
    const int64_t esize = half ? 2 : 4;
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        __m512 r[GROUP_MAX][16];
        for (int u = 0; u < 16; ++u) {
            const int64_t kr = k0 + offs[j + u];
            if (j + 32 < L) _mm_prefetch((const char *)k + (k0 + offs[j + u + 16]) * esize, _MM_HINT_T0);
            __m512 kv[4];
            for (int i = 0; i < 4; ++i) kv[i] = kv16(k, kr + 16 * i, half);
            for (int g = 0; g < G; ++g) {
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + g * qs), kv[0]);
                for (int i = 1; i < 4; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * qs + 16 * i), kv[i], a);
                r[g][u] = a;
            }
        }
        for (int g = 0; g < G; ++g) {
            __m512 t = hsum16x16(r[g]);
            if (!first) t = _mm512_add_ps(t, _mm512_loadu_ps(s + g * ss + j));
            _mm512_storeu_ps(s + g * ss + j, t);
        }
    }
    for (; j < L; ++j) {
        __m512 kv[4];
        for (int i = 0; i < 4; ++i) kv[i] = kv16(k, k0 + offs[j] + 16 * i, half);
        for (int g = 0; g < G; ++g) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + g * qs), kv[0]);
            for (int i = 1; i < 4; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * qs + 16 * i), kv[i], a);
            const float d = _mm512_reduce_add_ps(a);
            s[g * ss + j] = first ? d : s[g * ss + j] + d;
        }
    }
}

INLINE void weighted_sum64x16_group(const float *p, int64_t ps_, const int G, const void *v, int64_t v0,
                                    const int64_t *offs, int64_t L, float *o, int64_t os, int half) {
    __m512 a[GROUP_MAX][4], b[GROUP_MAX][4];
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) a[g][i] = b[g][i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= L; j += 2) {
        __m512 x[4];
        for (int i = 0; i < 4; ++i) x[i] = kv16(v, v0 + offs[j] + 16 * i, half);
        for (int g = 0; g < G; ++g) {
            const __m512 pg = _mm512_set1_ps(p[g * ps_ + j]);
            for (int i = 0; i < 4; ++i) a[g][i] = _mm512_fmadd_ps(pg, x[i], a[g][i]);
        }
        for (int i = 0; i < 4; ++i) x[i] = kv16(v, v0 + offs[j + 1] + 16 * i, half);
        for (int g = 0; g < G; ++g) {
            const __m512 pg = _mm512_set1_ps(p[g * ps_ + j + 1]);
            for (int i = 0; i < 4; ++i) b[g][i] = _mm512_fmadd_ps(pg, x[i], b[g][i]);
        }
    }
    if (j < L) {
        __m512 x[4];
        for (int i = 0; i < 4; ++i) x[i] = kv16(v, v0 + offs[j] + 16 * i, half);
        for (int g = 0; g < G; ++g) {
            const __m512 pg = _mm512_set1_ps(p[g * ps_ + j]);
            for (int i = 0; i < 4; ++i) a[g][i] = _mm512_fmadd_ps(pg, x[i], a[g][i]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + g * os + 16 * i, _mm512_add_ps(a[g][i], b[g][i]));
}

/* Query heads hq0 .. hq0 + G (one KV head h) of one query row: attend_row for each, the K/V passes
 * shared. q rows and o rows D apart; s: scratch of G * L. */
INLINE void attend_group(const float *q, const void *k, const void *v, const int64_t *offs, int64_t L, int64_t h,
                         int64_t D, float scale, float *s, float *o, const int G, int half) {
    for (int64_t c = 0; c + 64 <= D; c += 64) scores64x16_group(q + c, D, G, k, h * D + c, offs, L, s, L, c == 0, half);
    for (int g = 0; g < G; ++g) softmax_inplace(s + g * L, L, scale);
    for (int64_t c = 0; c + 64 <= D; c += 64) weighted_sum64x16_group(s, L, G, v, h * D + c, offs, L, o + c, D, half);
}
#define HAVE_ATTEND_GROUP 1
#elif defined(HAVE_KV8)
#define SCORES64 scores64
#define WEIGHTED_SUM64 weighted_sum64
#endif

/* Query head hq of one query row against its L positions (element offsets offs[j] of each
 * position's row of Hkv * D): scores, softmax, weighted sum of V -> o[0:D]. s: scratch of L. */
INLINE void attend_row(const float *qr, const void *k, const void *v, const int64_t *offs, int64_t L, int64_t h,
                       int64_t D, float scale, float *s, float *o, int half) {
    int64_t c = 0;
#ifdef HAVE_KV8
    for (; c + 64 <= D; c += 64) SCORES64(qr + c, k, h * D + c, offs, L, s, c == 0, half);
#endif
    if (c < D)
        for (int64_t j = 0; j < L; ++j) {
            const float d = dot(qr + c, k, offs[j] + h * D + c, D - c, half);
            s[j] = c == 0 ? d : s[j] + d;
        }
    softmax_inplace(s, L, scale);
    c = 0;
#ifdef HAVE_KV8
    for (; c + 64 <= D; c += 64) WEIGHTED_SUM64(s, v, h * D + c, offs, L, o + c, half);
#endif
    for (; c < D; ++c) {
        float a = 0.f;
        for (int64_t j = 0; j < L; ++j) a += s[j] * kv1(v, offs[j] + h * D + c, half);
        o[c] = a;
    }
}

/* Scratch for L positions of one request: s (L) for scores, and offs (L) each position's element
 * offset in the pool (pages: the request's page-table row, row: elements per position). 0 when out
 * of memory (nothing left allocated); else the caller frees both. */
static int paged_scratch_n(const int32_t *pages, int64_t ps, int64_t row, int64_t L, int64_t ns, float **s,
                           int64_t **offs) {
    *s = (float *)malloc(sizeof(float) * (size_t)ns);
    *offs = (int64_t *)malloc(sizeof(int64_t) * (size_t)L);
    if (*s == NULL || *offs == NULL) {
        free(*s);
        free(*offs);
        return 0;
    }
    int64_t *o = *offs;
    for (int64_t j0 = 0, p = 0; j0 < L; j0 += ps, ++p) { /* page by page: no division per position */
        const int64_t base = (int64_t)pages[p] * ps * row, n = L - j0 < ps ? L - j0 : ps;
        for (int64_t i = 0; i < n; ++i) o[j0 + i] = base + i * row;
    }
    return 1;
}

static int paged_scratch(const int32_t *pages, int64_t ps, int64_t row, int64_t L, float **s, int64_t **offs) {
    return paged_scratch_n(pages, ps, row, L, L, s, offs);
}

/* Decode attention over the paged KV pool of one layer, one new token per request.
 *   q        (B, Hq, D)       the new tokens' queries
 *   k, v     (S, Hkv, D)      the layer's pool (float32, or float16 for the _f16 kernel);
 *                             slot = page_rows[b, j / ps] * ps + j % ps
 *   page_rows (B, P) int32    the requests' page-table rows
 *   seq_lens (B,) int32       tokens in each request's cache, the new one included
 *   out      (B, Hq, D)
 * One task per (request, query head): its scratch holds the pool offset of every cached position and
 * the L scores (one request's heads spread over the threads, which a batch of one needs). Query head
 * hq reads KV head hq / G (grouped-query attention without copies). Head widths that are multiples
 * of 64 take the AVX2 path (64 columns of q, or of the output, in registers); others a plain loop.
 * With AVX-512 and grouped heads a task takes up to 3 query heads of one KV head instead
 * (attend_group: each K/V element converted once for them, bitwise the per-head results; the
 * embedded model's 9 heads over 3 at batch 16 and 128-190 positions: 0.5-0.65x the time), and a
 * call with under ATTN_PARALLEL_WORK (head, position) pairs stays on one thread.
 * Returns 0, or -1 when scratch memory could not be had. */
INLINE int decode_attention(const float *q, const void *k, const void *v, const int32_t *page_rows, int64_t P,
                            const int32_t *seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t ps,
                            float scale, float *out, int half) {
    const int64_t G = Hq / Hkv, row = Hkv * D;
    int failed = 0;
#ifdef HAVE_ATTEND_GROUP
    if (D % 64 == 0 && G > 1) { /* one task per (request, group of <= 3 query heads of a KV head) */
        int64_t work = 0; /* query head x position pairs */
        for (int64_t b = 0; b < B; ++b) work += Hq * (seq_lens[b] > 0 ? seq_lens[b] : 0);
        const int threads = work >= ATTN_PARALLEL_WORK ? omp_get_max_threads() : 1;
        const int64_t ng = (G + GROUP_MAX - 1) / GROUP_MAX; /* groups per KV head, their sizes within one */
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed) num_threads(threads)
        for (int64_t t = 0; t < B * Hkv * ng; ++t) {
            const int64_t b = t / (Hkv * ng), h = t / ng % Hkv, gi = t % ng;
            const int64_t g0 = gi * G / ng, gn = (gi + 1) * G / ng - g0, hq0 = h * G + g0, L = seq_lens[b];
            float *o = out + (b * Hq + hq0) * D;
            if (L <= 0) {
                memset(o, 0, sizeof(float) * (size_t)(gn * D));
                continue;
            }
            float *s;
            int64_t *offs;
            if (!paged_scratch_n(page_rows + b * P, ps, row, L, L * gn, &s, &offs)) {
                failed = 1;
                continue;
            }
            const float *qr = q + (b * Hq + hq0) * D;
            if (gn == 3) attend_group(qr, k, v, offs, L, h, D, scale, s, o, 3, half);
            else if (gn == 2) attend_group(qr, k, v, offs, L, h, D, scale, s, o, 2, half);
            else attend_group(qr, k, v, offs, L, h, D, scale, s, o, 1, half);
            free(s);
            free(offs);
        }
        return failed ? -1 : 0;
    }
#endif
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t t = 0; t < B * Hq; ++t) {
        const int64_t b = t / Hq, hq = t % Hq, L = seq_lens[b];
        if (L <= 0) { /* a padding row: nothing to attend to */
            memset(out + t * D, 0, sizeof(float) * (size_t)D);
            continue;
        }
        float *s;
        int64_t *offs;
        if (!paged_scratch(page_rows + b * P, ps, row, L, &s, &offs)) {
            failed = 1;
            continue;
        }
        attend_row(q + t * D, k, v, offs, L, hq / G, D, scale, s, out + t * D, half);
        free(s);
        free(offs);
    }
    return failed ? -1 : 0;
}

int minisgl_decode_attention(const float *q, const float *k, const float *v, const int32_t *page_rows, int64_t P,
                             const int32_t *seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t ps,
                             float scale, float *out) {
    return decode_attention(q, k, v, page_rows, P, seq_lens, B, Hq, Hkv, D, ps, scale, out, 0);
}

int minisgl_decode_attention_f16(const float *q, const uint16_t *k, const uint16_t *v, const int32_t *page_rows,
                                 int64_t P, const int32_t *seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                 int64_t ps, float scale, float *out) {
    return decode_attention(q, k, v, page_rows, P, seq_lens, B, Hq, Hkv, D, ps, scale, out, 1);
}

/* Attention of new tokens over the paged pool (prefill: a fresh prompt, or new tokens after a cached
 * prefix), request by request.
 *   q        (T, Hq, D)   the new tokens' queries, request b owning rows starts[b] .. starts[b + 1]
 *   k, v     the layer's pool (S, Hkv, D), float32 or float16 (half), which already holds the new tokens
 *   page_rows (B, P) int32, seq_lens (B,) int32: each request's pages and cached length, new tokens
 *            included; new token i of request b (of n_b) is at position seq_lens[b] - n_b + i and
 *            attends to positions 0 .. itself
 *   out      (T, Hq, D)
 * The decode kernel would read each token's K/V prefix again per query row (quadratic in bytes, and
 * converted from float16 each time); here a task is (request, KV head, block of EXT_QB query rows):
 * it converts the K/V its rows see once into float32 scratch, K transposed (D x L) so that a query's
 * scores come 16 positions per vector without horizontal sums, and runs the block's rows and the KV
 * head's G query heads against it. Each query row's sums follow one order whatever the batch, the
 * block or the thread (positions in blocks of 16 from 0). AVX2 builds run the same with 8 floats a
 * vector (before, each query row went through the decode kernel's helpers: a 2,048-token prompt's
 * prefill took 20.7 s on a 2-core Zen 1 EPYC, now 16.3 s). Returns 0, or -1 without scratch memory. */
#define EXT_QB 32
#define EXT_PAIRS 12 /* (query row, query head) pairs sharing each K/V vector loaded (8: 1.09-1.16x the time, 16: 1.01-1.03x) */
#if defined(__AVX512F__)
/* 16 x 16 floats: r[i] lane j -> r[j] lane i */
static inline void transpose16_ps(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* r[4 i + e]: element e of each 4 of rows 4 i .. 4 i + 3 */
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
    }
    for (int e = 0; e < 4; ++e) {
        const __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x44), b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xEE);
        const __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x44), d = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xEE);
        t[e] = _mm512_shuffle_f32x4(a, c, 0x88);
        t[4 + e] = _mm512_shuffle_f32x4(a, c, 0xDD);
        t[8 + e] = _mm512_shuffle_f32x4(b, d, 0x88);
        t[12 + e] = _mm512_shuffle_f32x4(b, d, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/* KV head h of positions 0 .. L (pages `pages`) as float32: kt (D x Lp) transposed, vs (Lp x D);
 * zeros past L */
static void ext_load_kv(const void *k, const void *v, const int32_t *pages, int64_t ps, int64_t row, int64_t h,
                        int64_t L, int64_t Lp, int64_t D, int half, float *kt, float *vs) {
    __m512 r[16];
    for (int64_t j0 = 0; j0 < Lp; j0 += 16) {
        int64_t offs[16];
        for (int u = 0; u < 16; ++u) {
            const int64_t j = j0 + u;
            offs[u] = j < L ? ((int64_t)pages[j / ps] * ps + j % ps) * row + h * D : -1;
        }
        for (int64_t c = 0; c < D; c += 16) {
            for (int u = 0; u < 16; ++u) {
                r[u] = offs[u] < 0 ? _mm512_setzero_ps() : kv16(k, offs[u] + c, half);
                _mm512_storeu_ps(vs + (j0 + u) * D + c, offs[u] < 0 ? _mm512_setzero_ps() : kv16(v, offs[u] + c, half));
            }
            transpose16_ps(r);
            for (int u = 0; u < 16; ++u) _mm512_storeu_ps(kt + (c + u) * Lp + j0, r[u]);
        }
    }
}
#elif defined(HAVE_KV8)
/* The same with 8 floats a vector: V's rows converted 8 at a time, K transposed by scalar stores (L x
 * D of them a task, against the task's ~EXT_QB x G x L x D / 4 FMAs) */
static void ext_load_kv(const void *k, const void *v, const int32_t *pages, int64_t ps, int64_t row, int64_t h,
                        int64_t L, int64_t Lp, int64_t D, int half, float *kt, float *vs) {
    for (int64_t j = 0; j < Lp; ++j) {
        const int64_t off = j < L ? ((int64_t)pages[j / ps] * ps + j % ps) * row + h * D : -1;
        for (int64_t c = 0; c < D; c += 8) {
            float kr[8];
            _mm256_storeu_ps(vs + j * D + c, off < 0 ? _mm256_setzero_ps() : kv8(v, off + c, half));
            _mm256_storeu_ps(kr, off < 0 ? _mm256_setzero_ps() : kv8(k, off + c, half));
            for (int u = 0; u < 8; ++u) kt[(c + u) * Lp + j] = kr[u];
        }
    }
}
#endif
#if defined(__AVX512F__) || defined(HAVE_KV8)

/* NP (query row, query head) pairs against the converted K/V: pair p's query qp[p], the positions it
 * sees Ls[p] (<= Lmax), its output op[p]; s: NP x Lp scratch. Each K or V vector loaded serves the
 * NP pairs (one load, NP FMAs: one query row at a time took a load per FMA). A pair's score of a
 * position and its output follow the one-row order: sums over d from 0, then over positions from 0
 * (past its own Ls[p] its weights are 0, which adds nothing), so a row's result is the same in any
 * group, block or batch. */
INLINE void ext_pairs(const int NP, const float *const *qp, const int64_t *Ls, int64_t Lmax, const float *kt,
                      const float *vs, int64_t Lp, int64_t D, float scale, float *s, float *const *op) {
    const int64_t LW = (Lmax + FV_W - 1) / FV_W * FV_W;
    fvec a[EXT_PAIRS];
    for (int64_t j = 0; j < LW; j += FV_W) { /* scores of positions j .. j + FV_W */
        for (int p = 0; p < NP; ++p) a[p] = fv_zero();
        for (int64_t d = 0; d < D; ++d) {
            const fvec kv = fv_load(kt + d * Lp + j);
            for (int p = 0; p < NP; ++p) a[p] = fv_fma(fv_set1(qp[p][d]), kv, a[p]);
        }
        for (int p = 0; p < NP; ++p) fv_store(s + p * Lp + j, a[p]);
    }
    for (int p = 0; p < NP; ++p) {
        softmax_inplace(s + p * Lp, Ls[p], scale);
        for (int64_t j = Ls[p]; j < Lmax; ++j) s[p * Lp + j] = 0.f;
    }
    for (int64_t c = 0; c < D; c += FV_W) {
        for (int p = 0; p < NP; ++p) a[p] = fv_zero();
        for (int64_t j = 0; j < Lmax; ++j) {
            const fvec vv = fv_load(vs + j * D + c);
            for (int p = 0; p < NP; ++p) a[p] = fv_fma(fv_set1(s[p * Lp + j]), vv, a[p]);
        }
        for (int p = 0; p < NP; ++p) fv_store(op[p] + c, a[p]);
    }
}

/* Query rows i0 .. i1 of one request (new token i at position pos0 + i) and KV head h's G query heads,
 * EXT_PAIRS (row, head) pairs at a time in row-major order; s: EXT_PAIRS x Lp scratch. */
static void ext_rows(const float *q, const float *kt, const float *vs, int64_t Lp, int64_t pos0, int64_t i0,
                     int64_t i1, int64_t h, int64_t G, int64_t Hq, int64_t D, float scale, float *s, float *out) {
    const int64_t total = (i1 - i0) * G;
    for (int64_t first = 0; first < total; first += EXT_PAIRS) {
        const int np = total - first < EXT_PAIRS ? (int)(total - first) : EXT_PAIRS;
        const float *qp[EXT_PAIRS];
        float *op[EXT_PAIRS];
        int64_t Ls[EXT_PAIRS], Lmax = 0;
        for (int p = 0; p < np; ++p) {
            const int64_t i = i0 + (first + p) / G, hq = h * G + (first + p) % G;
            qp[p] = q + (i * Hq + hq) * D;
            op[p] = out + (i * Hq + hq) * D;
            Ls[p] = pos0 + i + 1;
            Lmax = Ls[p] > Lmax ? Ls[p] : Lmax;
        }
        switch (np) { /* a constant NP (cases up to EXT_PAIRS): the sums stay in registers */
#define EXT_CASE(NP) \
    case NP: ext_pairs(NP, qp, Ls, Lmax, kt, vs, Lp, D, scale, s, op); break;
            EXT_CASE(12) EXT_CASE(11) EXT_CASE(10) EXT_CASE(9)
            EXT_CASE(8) EXT_CASE(7) EXT_CASE(6) EXT_CASE(5) EXT_CASE(4) EXT_CASE(3) EXT_CASE(2)
#undef EXT_CASE
        default: ext_pairs(1, qp, Ls, Lmax, kt, vs, Lp, D, scale, s, op); break;
        }
    }
}
#endif

INLINE int extend_attention(const float *q, const void *k, const void *v, const int32_t *page_rows, int64_t P,
                            const int32_t *seq_lens, const int64_t *starts, int64_t B, int64_t Hq, int64_t Hkv,
                            int64_t D, int64_t ps, float scale, float *out, int half) {
    const int64_t G = Hq / Hkv, row = Hkv * D;
    int64_t tasks = 0;
    for (int64_t b = 0; b < B; ++b) tasks += Hkv * ((starts[b + 1] - starts[b] + EXT_QB - 1) / EXT_QB);
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t t = 0; t < tasks; ++t) {
        int64_t b = 0, rest = t; /* task t -> (request b, KV head h, query block qb) */
        for (;; ++b) {
            const int64_t nt = Hkv * ((starts[b + 1] - starts[b] + EXT_QB - 1) / EXT_QB);
            if (rest < nt) break;
            rest -= nt;
        }
        const int64_t nblocks = (starts[b + 1] - starts[b] + EXT_QB - 1) / EXT_QB;
        const int64_t h = rest / nblocks, qb = rest % nblocks;
        const int64_t n = starts[b + 1] - starts[b], pos0 = seq_lens[b] - n;
        const int64_t i0 = qb * EXT_QB, i1 = i0 + EXT_QB < n ? i0 + EXT_QB : n;
        const int64_t L = pos0 + i1; /* positions the block's last row sees */
        const float *qb_q = q + starts[b] * Hq * D;
        float *qb_out = out + starts[b] * Hq * D;
#if defined(__AVX512F__) || defined(HAVE_KV8)
        if (D % FV_W == 0) {
            const int64_t Lp = (L + FV_W - 1) / FV_W * FV_W;
            float *kt = (float *)malloc(sizeof(float) * (size_t)(D * Lp + Lp * D + EXT_PAIRS * Lp));
            if (kt == NULL) {
                failed = 1;
                continue;
            }
            float *vs = kt + D * Lp, *s = vs + Lp * D;
            ext_load_kv(k, v, page_rows + b * P, ps, row, h, L, Lp, D, half, kt, vs);
            ext_rows(qb_q, kt, vs, Lp, pos0, i0, i1, h, G, Hq, D, scale, s, qb_out);
            free(kt);
            continue;
        }
#endif
        float *s;
        int64_t *offs;
        if (!paged_scratch(page_rows + b * P, ps, row, L, &s, &offs)) {
            failed = 1;
            continue;
        }
        for (int64_t i = i0; i < i1; ++i)
            for (int64_t g = 0; g < G; ++g) {
                const int64_t hq = h * G + g;
                attend_row(qb_q + (i * Hq + hq) * D, k, v, offs, pos0 + i + 1, h, D, scale, s, qb_out + (i * Hq + hq) * D, half);
            }
        free(s);
        free(offs);
    }
    return failed ? -1 : 0;
}

/* Causal attention of fresh prompts (nothing cached before them) over their own new tokens.
 *   q (T, Hq, D), k, v (T, Hkv, D): the batch's new tokens, request b owning rows starts[b] ..
 *   starts[b + 1]; out (T, Hq, D). Query row i of a request attends to its rows 0 .. i.
 * One task per (request, query head), each query row through the decode kernel's helpers: scores
 * against the rows so far, softmax, the weighted sum of V. Returns 0, or -1 without scratch memory. */
int minisgl_prefill_attention(const float *q, const float *k, const float *v, const int64_t *starts, int64_t B,
                              int64_t Hq, int64_t Hkv, int64_t D, float scale, float *out) {
    const int64_t G = Hq / Hkv, row = Hkv * D;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t t = 0; t < B * Hq; ++t) {
        const int64_t b = t / Hq, hq = t % Hq, h = hq / G;
        const int64_t base = starts[b], n = starts[b + 1] - starts[b];
        float *s = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
        int64_t *offs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
        if (s == NULL || offs == NULL) {
            free(s);
            free(offs);
            failed = 1;
            continue;
        }
        for (int64_t j = 0; j < n; ++j) offs[j] = (base + j) * row;
        for (int64_t i = 0; i < n; ++i)
            attend_row(q + ((base + i) * Hq + hq) * D, k, v, offs, i + 1, h, D, scale, s, out + ((base + i) * Hq + hq) * D, 0);
        free(s);
        free(offs);
    }
    return failed ? -1 : 0;
}

/* ---- element-wise kernels (rows in parallel when there are many) ----------------------------------
 * Built with -ffp-contract=off: a plain `a * b - c * d` rounds each product as torch does, so these
 * match torch's element-wise results; only the RMS statistic (a sum) is summed in another order. */

#define PAR_MIN_ELEMS 65536 /* below this many elements one thread does the work */

/* h (T, H) += delta (when not NULL); out (T, H) = w * (h * rsqrt(mean(h^2) + eps)) */
void minisgl_add_rmsnorm(float *restrict h, const float *restrict delta, const float *restrict w, float eps,
                         int64_t T, int64_t H, float *restrict out) {
#pragma omp parallel for if (T * H >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; ++t) {
        float *restrict x = h + t * H;
        if (delta != NULL) {
            const float *restrict dl = delta + t * H;
#pragma omp simd
            for (int64_t i = 0; i < H; ++i) x[i] += dl[i];
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
        const float r = 1.f / sqrtf(ss / (float)H + eps);
        float *restrict o = out + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) o[i] = w[i] * (x[i] * r);
    }
}

/* qkv (T, (Hq + 2 Hkv) D) -> q (T, Hq, D), k (T, Hkv, D) rotated (rotate-half RoPE with cos/sin
 * (T, D/2)), and v (T, Hkv, D) copied: x1 * c - x2 * s, x2 * c + x1 * s, as Hugging Face writes it. */
void minisgl_rope_split(const float *restrict qkv, const float *restrict cos, const float *restrict sin,
                        int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float *restrict q, float *restrict k,
                        float *restrict v) {
    const int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
#pragma omp parallel for if (T * width >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; ++t) {
        const float *x = qkv + t * width, *c = cos + t * half, *s = sin + t * half;
        for (int64_t hd = 0; hd < Hq + Hkv; ++hd) {
            const float *xh = x + hd * D;
            float *restrict o = hd < Hq ? q + (t * Hq + hd) * D : k + (t * Hkv + hd - Hq) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = xh[i], x2 = xh[i + half];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
        memcpy(v + t * Hkv * D, x + (Hq + Hkv) * D, sizeof(float) * (size_t)(Hkv * D));
    }
}

INLINE uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else /* round to nearest even, as torch's .to(float16) */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds past 65504: inf */
    if (ax < 0x38800000u) { /* a subnormal half (or zero): scale to its integer units, round */
        float m;
        const uint32_t abits = ax;
        memcpy(&m, &abits, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(m * 16777216.f)); /* 2^24 */
    }
    const uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1u); /* ties to even at bit 13 */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
#endif
}

/* RoPE and the KV store in one pass: qkv (T, (Hq + 2 Hkv) D) -> q (T, Hq, D) rotated (as
 * minisgl_rope_split), and k rotated and v written into the layer's pool at slots (T,) int64, as
 * float32 or rounded to float16 (`half`), as the pool keeps them. */
void minisgl_rope_store(const float *restrict qkv, const float *restrict cos, const float *restrict sin, int64_t T,
                        int64_t Hq, int64_t Hkv, int64_t D, const int64_t *restrict slots, void *restrict k_pool,
                        void *restrict v_pool, int half, float *restrict q) {
    const int64_t hd2 = D / 2, width = (Hq + 2 * Hkv) * D, row = Hkv * D;
    /* the new rows' cache lines, asked for first: in a decode step the weights streamed since the last
     * step have evicted them, and one miss at a time cost most of this call (20 us at 16 rows) */
    const int64_t esize = half ? 2 : 4;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= 0)
            for (int64_t off = 0; off < row * esize; off += 64) {
                __builtin_prefetch((const char *)k_pool + slots[t] * row * esize + off, 1, 3);
                __builtin_prefetch((const char *)v_pool + slots[t] * row * esize + off, 1, 3);
            }
#pragma omp parallel for if (T * width >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; ++t) {
        const float *x = qkv + t * width, *c = cos + t * hd2, *s = sin + t * hd2;
        float kr[D > 0 ? row : 1];
        for (int64_t hd = 0; hd < Hq + Hkv; ++hd) {
            const float *xh = x + hd * D;
            float *restrict o = hd < Hq ? q + (t * Hq + hd) * D : kr + (hd - Hq) * D;
#pragma omp simd
            for (int64_t i = 0; i < hd2; ++i) {
                const float x1 = xh[i], x2 = xh[i + hd2];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + hd2] = x2 * c[i] + x1 * s[i];
            }
        }
        const float *v = x + (Hq + Hkv) * D;
        if (slots[t] < 0) continue; /* a padding row: no KV slot */
        const int64_t at = slots[t] * row;
        if (half) {
            uint16_t *kp = (uint16_t *)k_pool + at, *vp = (uint16_t *)v_pool + at;
            int64_t i = 0;
#if defined(__F16C__)
            for (; i + 8 <= row; i += 8) { /* the same rounding as float_to_half's */
                _mm_storeu_si128((__m128i *)(kp + i), _mm256_cvtps_ph(_mm256_loadu_ps(kr + i), _MM_FROUND_TO_NEAREST_INT));
                _mm_storeu_si128((__m128i *)(vp + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
            }
#endif
            for (; i < row; ++i) kp[i] = float_to_half(kr[i]), vp[i] = float_to_half(v[i]);
        } else {
            memcpy((float *)k_pool + at, kr, sizeof(float) * (size_t)row);
            memcpy((float *)v_pool + at, v, sizeof(float) * (size_t)row);
        }
    }
}

/* gate_up (T, 2I) laid out [gate | up] -> out (T, I) = silu(gate) * up, silu(g) = g / (1 + exp(-g)) */
void minisgl_silu_mul(const float *restrict gate_up, int64_t T, int64_t I, float *restrict out) {
#pragma omp parallel for if (T * I >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; ++t) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#ifdef HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(zero, gv));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* ---- float32 matmul against a pre-packed weight -------------------------------------------------
 * y (M, N) = x (M, K) @ W^T (+ bias), W (N, K) packed once as (N / 8, K, 8): eight output columns'
 * weights interleaved per k, so the inner loop streams the weight in order, one 8-wide vector per k,
 * against broadcast activations. A block of R <= 12 rows keeps its R x 8 sums in registers; each
 * thread takes whole 8-column blocks. Every output element is one sum over k in increasing order,
 * so a row's result never depends on the batch it came in (batch-invariant) nor on the thread count.
 */

void minisgl_pack_weight(const float *restrict w, int64_t N, int64_t K, float *restrict out) {
#pragma omp parallel for
    for (int64_t nb = 0; nb < N / 8; ++nb)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t i = 0; i < 8; ++i) out[(nb * K + k) * 8 + i] = w[(nb * 8 + i) * K + k];
}

#ifdef HAVE_AVX2
/* R rows (m0 .. m0 + R of x^T (K, M)) times one packed 8-column block -> R x 8 sums into acc */
#define DEFINE_BLOCK(R)                                                                                \
    static inline void block##R(const float *restrict wb, const float *restrict xt, int64_t M,        \
                                int64_t K, float *restrict acc) {                                      \
        __m256 a[R];                                                                                   \
        for (int i = 0; i < R; ++i) a[i] = _mm256_setzero_ps();                                       \
        for (int64_t k = 0; k < K; ++k) {                                                              \
            const __m256 w = _mm256_loadu_ps(wb + k * 8);                                              \
            const float *xr = xt + k * M;                                                              \
            for (int i = 0; i < R; ++i) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + i), w, a[i]); \
        }                                                                                              \
        for (int i = 0; i < R; ++i) _mm256_storeu_ps(acc + i * 8, a[i]);                              \
    }
DEFINE_BLOCK(12)
DEFINE_BLOCK(8)
DEFINE_BLOCK(4)
DEFINE_BLOCK(2)
DEFINE_BLOCK(1)
#endif

#ifndef HAVE_AVX2
static void block_any(const float *restrict wb, const float *restrict xt, int64_t M, int64_t K, int64_t R,
                      float *restrict acc) {
    for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < 8; ++j) {
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s = fmaf(xt[k * M + i], wb[k * 8 + j], s);
            acc[i * 8 + j] = s;
        }
}
#endif

#if defined(HAVE_AVX2) && defined(__AVX512F__)
/* AVX-512: two adjacent packed blocks (16 output columns) per 512-bit vector, so each broadcast
 * activation feeds 16 columns instead of 8 (the broadcasts, not the FMAs, bound the 8-wide loop).
 * Same layout, and each output is the same FMA chain over k in the same order: bitwise the results
 * of the 8-wide blocks. */
#define HAVE_AVX512 1
#define DEFINE_BLOCK16(R)                                                                              \
    static inline void block16_##R(const float *restrict w0, const float *restrict xt, int64_t M,     \
                                   int64_t K, float *restrict acc) {                                   \
        const float *restrict w1 = w0 + K * 8; /* the next 8-column block */                          \
        __m512 a[R];                                                                                   \
        for (int i = 0; i < R; ++i) a[i] = _mm512_setzero_ps();                                       \
        for (int64_t k = 0; k < K; ++k) {                                                              \
            const __m512 lo = _mm512_castps256_ps512(_mm256_loadu_ps(w0 + k * 8));                    \
            const __m512 w = _mm512_castpd_ps(                                                         \
                _mm512_insertf64x4(_mm512_castps_pd(lo), _mm256_castps_pd(_mm256_loadu_ps(w1 + k * 8)), 1)); \
            const float *xr = xt + k * M;                                                              \
            for (int i = 0; i < R; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i]), w, a[i]);       \
        }                                                                                              \
        for (int i = 0; i < R; ++i) _mm512_storeu_ps(acc + i * 16, a[i]);                             \
    }
DEFINE_BLOCK16(24)
DEFINE_BLOCK16(16)
DEFINE_BLOCK16(8)
DEFINE_BLOCK16(4)
DEFINE_BLOCK16(2)
DEFINE_BLOCK16(1)

/* Rows m0 .. m0 + mc times packed column blocks nb and nb + 1 -> y */
static void rows_times_block_pair(const float *restrict wb, const float *restrict xt, int64_t mc, int64_t K,
                                  int64_t m0, int64_t nb, int64_t N, const float *restrict bias,
                                  float *restrict y) {
    float acc[24 * 16];
    for (int64_t r0 = 0; r0 < mc;) {
        const int64_t left = mc - r0;
        int64_t R;
        if (left >= 24) R = 24, block16_24(wb, xt + r0, mc, K, acc);
        else if (left >= 16) R = 16, block16_16(wb, xt + r0, mc, K, acc);
        else if (left >= 8) R = 8, block16_8(wb, xt + r0, mc, K, acc);
        else if (left >= 4) R = 4, block16_4(wb, xt + r0, mc, K, acc);
        else if (left >= 2) R = 2, block16_2(wb, xt + r0, mc, K, acc);
        else R = 1, block16_1(wb, xt + r0, mc, K, acc);
        for (int64_t i = 0; i < R; ++i) {
            float *yr = y + (m0 + r0 + i) * N + nb * 8;
            for (int64_t j = 0; j < 16; ++j) yr[j] = bias ? acc[i * 16 + j] + bias[nb * 8 + j] : acc[i * 16 + j];
        }
        r0 += R;
    }
}
#endif

#define ROW_CHUNK 120 /* rows per pass over the weight: their x^T (K x 120 floats) stays in L2 */

/* Rows m0 .. m0 + mc (x^T of those rows: xt, (K, mc)) times packed column block nb -> y */
static void rows_times_block(const float *restrict wb, const float *restrict xt, int64_t mc, int64_t K,
                             int64_t m0, int64_t nb, int64_t N, const float *restrict bias, float *restrict y) {
    float acc[12 * 8];
    for (int64_t r0 = 0; r0 < mc;) {
        const int64_t left = mc - r0;
        int64_t R;
#ifdef HAVE_AVX2
        /* the largest register block that fits what is left, but 16 rows as 8 + 8: a block needs
         * >= 8 independent sums to keep both FMA units busy (12 + 4 would stall on the 4) */
        if (left >= 12 && left != 16) R = 12, block12(wb, xt + r0, mc, K, acc);
        else if (left >= 8) R = 8, block8(wb, xt + r0, mc, K, acc);
        else if (left >= 4) R = 4, block4(wb, xt + r0, mc, K, acc);
        else if (left >= 2) R = 2, block2(wb, xt + r0, mc, K, acc);
        else R = 1, block1(wb, xt + r0, mc, K, acc);
#else
        R = left < 12 ? left : 12;
        block_any(wb, xt + r0, mc, K, R, acc);
#endif
        for (int64_t i = 0; i < R; ++i) {
            float *yr = y + (m0 + r0 + i) * N + nb * 8;
            for (int64_t j = 0; j < 8; ++j) yr[j] = bias ? acc[i * 8 + j] + bias[nb * 8 + j] : acc[i * 8 + j];
        }
        r0 += R;
    }
}

/* Rows go in chunks of ROW_CHUNK: per chunk the threads split the column blocks, each 8-column
 * block is read once per chunk (from memory, or L3 for the later chunks) and reused by the chunk's
 * row blocks from L1. Returns 0, or -1 when N is not a multiple of 8 or scratch memory is short. */
int minisgl_packed_matmul(const float *restrict x, int64_t M, int64_t K, const float *restrict wp, int64_t N,
                          const float *restrict bias, float *restrict y) {
    if (N % 8) return -1;
    const int64_t chunk = M < ROW_CHUNK ? M : ROW_CHUNK;
    float *xt = (float *)malloc(sizeof(float) * (size_t)(K * chunk)); /* one chunk's x^T (K, mc) */
    if (xt == NULL) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        for (int64_t m = 0; m < mc; ++m)
            for (int64_t k = 0; k < K; ++k) xt[k * mc + m] = x[(m0 + m) * K + k];
#ifdef HAVE_AVX512
        const int64_t pairs = N / 16; /* 16-column units; an odd last 8-column block goes alone */
#pragma omp parallel for schedule(static) if (N * K * mc >= 32768)
        for (int64_t p = 0; p < pairs; ++p)
            rows_times_block_pair(wp + 2 * p * K * 8, xt, mc, K, m0, 2 * p, N, bias, y);
        if ((N / 8) % 2) rows_times_block(wp + (N / 8 - 1) * K * 8, xt, mc, K, m0, N / 8 - 1, N, bias, y);
#else
#pragma omp parallel for schedule(static) if (N * K * mc >= 32768)
        for (int64_t nb = 0; nb < N / 8; ++nb) rows_times_block(wp + nb * K * 8, xt, mc, K, m0, nb, N, bias, y);
#endif
    }
    free(xt);
    return 0;
}

/* out (T, D2) = table[idx[t]] for t < T (the rotary cos/sin rows of each token's position) */
void minisgl_gather_rows(const float *restrict table, int64_t rows, const int64_t *restrict idx, int64_t T,
                         int64_t D2, float *restrict out) {
    for (int64_t t = 0; t < T; ++t) {
        const int64_t i = idx[t] < 0 ? 0 : (idx[t] >= rows ? rows - 1 : idx[t]);
        memcpy(out + t * D2, table + i * D2, sizeof(float) * (size_t)D2);
    }
}

/* The first index of row x's maximum (V > 0), as torch.argmax: a NaN counts as the maximum (its first
 * index wins). Two passes: the maximum ignoring NaN (and whether there is one), then the first index
 * holding it, 32 values a test. */
static int64_t argmax_row(const float *restrict x, int64_t V) {
    float m = x[0];
    int nan = 0;
    int64_t i = 0;
#ifdef HAVE_AVX2
    __m256 mx[4], un = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) mx[j] = _mm256_set1_ps(x[0]);
    for (; i + 32 <= V; i += 32)
        for (int j = 0; j < 4; ++j) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
            un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mx[j] = _mm256_max_ps(v, mx[j]); /* a NaN v keeps mx */
        }
    const __m256 m4 = _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3]));
    float lanes[8];
    _mm256_storeu_ps(lanes, m4);
    for (int l = 0; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
    nan = _mm256_movemask_ps(un) != 0;
#endif
    for (; i < V; ++i) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    if (nan) {
        for (int64_t j = 0; j < V; ++j)
            if (x[j] != x[j]) return j;
    }
    int64_t j = 0;
#ifdef HAVE_AVX2
    const __m256 mm = _mm256_set1_ps(m);
    for (; j + 32 <= V; j += 32) {
        __m256 eq = _mm256_cmp_ps(_mm256_loadu_ps(x + j), mm, _CMP_EQ_OQ);
        for (int k = 1; k < 4; ++k) eq = _mm256_or_ps(eq, _mm256_cmp_ps(_mm256_loadu_ps(x + j + 8 * k), mm, _CMP_EQ_OQ));
        if (_mm256_movemask_ps(eq)) break;
    }
#endif
    for (; j < V; ++j)
        if (x[j] == m) return j;
    return 0; /* not reached: m is one of the values */
}

/* out[b] = argmax(x[b, :V]) for b < B (a decode step's greedy tokens, from its logits) */
void minisgl_argmax_rows(const float *restrict x, int64_t B, int64_t V, int64_t *restrict out) {
#pragma omp parallel for schedule(static) if (B > 1 && B * V >= 65536)
    for (int64_t b = 0; b < B; ++b) out[b] = argmax_row(x + b * V, V);
}

/* ---- packed entry points (see cpu_quant.c) and the replay of a recorded program ---------------- */

INLINE float arg_float(int64_t a) {
    const int32_t bits = (int32_t)a;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#define P(i) ((void *)(intptr_t)a[i])

int minisgl_decode_attention_packed(const int64_t *a) { /* a[13]: the pool is float16 */
    return decode_attention(P(0), P(1), P(2), P(3), a[4], P(5), a[6], a[7], a[8], a[9], a[10], arg_float(a[11]), P(12),
                            (int)a[13]);
}

int minisgl_extend_attention_packed(const int64_t *a) { /* a[15]: the pool is float16 */
    return extend_attention(P(0), P(1), P(2), P(3), a[4], P(5), P(6), a[7], a[8], a[9], a[10], a[11], arg_float(a[12]),
                            P(13), (int)a[14]);
}

int minisgl_rope_store_packed(const int64_t *a) {
    minisgl_rope_store(P(0), P(1), P(2), a[3], a[4], a[5], a[6], P(7), P(8), P(9), (int)a[10], P(11));
    return 0;
}

int minisgl_add_rmsnorm_packed(const int64_t *a) {
    minisgl_add_rmsnorm(P(0), P(1), P(2), arg_float(a[3]), a[4], a[5], P(6));
    return 0;
}

int minisgl_gather_rows_packed(const int64_t *a) {
    minisgl_gather_rows(P(0), a[1], P(2), a[3], a[4], P(5));
    return 0;
}

int minisgl_argmax_rows_packed(const int64_t *a) {
    minisgl_argmax_rows(P(0), a[1], a[2], P(3));
    return 0;
}

/* Runs a recorded program: n ops laid out as [function, argument count, arguments...], each function
 * a packed entry point. Returns 0, or the first nonzero result (the ops after it are not run). */
typedef int (*packed_fn)(const int64_t *);
int minisgl_graph_run(const int64_t *prog, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const packed_fn fn = (packed_fn)(intptr_t)prog[0];
        const int rc = fn(prog + 2);
        if (rc != 0) return rc;
        prog += 2 + prog[1];
    }
    return 0;
}

/* The same, adding each op's wall time in nanoseconds to ns[i] (a profile of replayed steps). */
int minisgl_graph_profile(const int64_t *prog, int64_t n, int64_t *ns) {
    for (int64_t i = 0; i < n; ++i) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        const int rc = ((packed_fn)(intptr_t)prog[0])(prog + 2);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ns[i] += (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
        if (rc != 0) return rc;
        prog += 2 + prog[1];
    }
    return 0;
}

/* ---- mixture of experts -------------------------------------------------------------------------
 * T tokens, each routed to K of E experts: pair p = t * K + k goes to expert ids[p] with weight
 * weights[p]. The pairs come sorted by expert: order[s] for s < P = T * K, expert e owning
 * order[starts[e] .. starts[e + 1]). For each expert with tokens, each block of its weight rows is
 * read once while every token of its group is multiplied against it (the rows stay in L1, the
 * group's inputs in L2):
 *   act[s] (I) = silu(W13[e][0:I] x) * (W13[e][I:2I] x)      x = x[order[s] / K], rows [gate | up]
 *   y[s] (H)   = W2[e] act[s]
 *   out[t]     = sum of weights[p] * y[s(p)] over the token's pairs, in ascending expert order
 * Every element is one dot product in a fixed order: a token's result depends neither on the tokens
 * batched with it nor on the thread count. */


#define MOE_TOK 4  /* tokens multiplied against each weight row at once */
#define MOE_ROWS 16 /* weight rows per work item */
#define MOE_MAX_K 64 /* experts per token */

/* o0[r] = w0 . xs[r] and o1[r] = w1 . xs[r] for the MOE_TOK rows xs, over n elements */
static void moe_dots(const float *w0, const float *w1, const float *const *xs, int64_t n, float *o0, float *o1) {
    int64_t k = 0;
#ifdef FV_W
    fvec a0[MOE_TOK], a1[MOE_TOK];
    for (int r = 0; r < MOE_TOK; ++r) a0[r] = a1[r] = fv_zero();
    for (; k + FV_W <= n; k += FV_W) {
        const fvec v0 = fv_load(w0 + k), v1 = fv_load(w1 + k);
        for (int r = 0; r < MOE_TOK; ++r) {
            const fvec xv = fv_load(xs[r] + k);
            a0[r] = fv_fma(v0, xv, a0[r]);
            a1[r] = fv_fma(v1, xv, a1[r]);
        }
    }
    for (int r = 0; r < MOE_TOK; ++r) o0[r] = fv_sum(a0[r]), o1[r] = fv_sum(a1[r]);
#else
    for (int r = 0; r < MOE_TOK; ++r) o0[r] = o1[r] = 0.f;
#endif
    for (; k < n; ++k)
        for (int r = 0; r < MOE_TOK; ++r) o0[r] += w0[k] * xs[r][k], o1[r] += w1[k] * xs[r][k];
}

/* One work item: rows [j0, j1) of one expert's weights w against its group, sorted pairs s0 .. s1,
 * whose inputs are rows rows_of[s] of `in` (rows_of NULL: row s); results go to row s of out. gated: out[s][j] = silu(w[j] . in) * (w[j + half] . in), else
 * out[s][j] = w[j] . in for pairs of rows (j, j + 1). */
static void moe_item(const float *w, int64_t half, int64_t n, int64_t j0, int64_t j1, int gated,
                     const float *in, int64_t in_stride, const int64_t *rows_of, int64_t s0, int64_t s1,
                     float *out, int64_t out_stride) {
    const float *xs[MOE_TOK];
    float o0[MOE_TOK], o1[MOE_TOK];
    for (int64_t s = s0; s < s1; s += MOE_TOK) {
        const int64_t m = s1 - s < MOE_TOK ? s1 - s : MOE_TOK;
        for (int r = 0; r < MOE_TOK; ++r) { /* a short last tile repeats its last row */
            const int64_t sr = s + (r < m ? r : m - 1);
            xs[r] = in + (rows_of ? rows_of[sr] : sr) * in_stride;
        }
        for (int64_t j = j0; j < j1; j += gated ? 1 : 2) {
            const int64_t j2 = gated ? j + half : (j + 1 < j1 ? j + 1 : j);
            moe_dots(w + j * n, w + j2 * n, xs, n, o0, o1);
            for (int64_t r = 0; r < m; ++r) {
                float *o = out + (s + r) * out_stride;
                if (gated) o[j] = o0[r] / (1.f + expf(-o0[r])) * o1[r];
                else o[j] = o0[r], o[j2] = o1[r];
            }
        }
    }
}

/* x (T, H); w13 (E, 2I, H); w2 (E, H, I); order (P,), starts (E + 1,), ids (P,) int64; weights (P,);
 * scratch act (P, I), y (P, H); out (T, H). Returns 0, or -1 when scratch memory could not be had. */
int minisgl_moe(const float *x, int64_t T, int64_t H, const float *w13, const float *w2, int64_t E, int64_t I,
                int64_t K, const int64_t *order, const int64_t *starts, const int64_t *ids,
                const float *weights, float *act, float *y, float *out) {
    const int64_t P = T * K, up_blocks = (I + MOE_ROWS - 1) / MOE_ROWS;
    const int64_t down_blocks = (H + 2 * MOE_ROWS - 1) / (2 * MOE_ROWS);
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)(P + 1)); /* sorted pair s -> its token */
    int64_t *pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)(P + 1)); /* pair p -> sorted s */
    int64_t *active = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1)); /* experts with tokens */
    if (tok == NULL || pos == NULL || active == NULL) {
        free(tok), free(pos), free(active);
        return -1;
    }
    int64_t na = 0;
    for (int64_t e = 0; e < E; ++e)
        if (starts[e + 1] > starts[e]) active[na++] = e;
    for (int64_t s = 0; s < P; ++s) tok[s] = order[s] / K, pos[order[s]] = s;
    const int par = P * I * H >= PAR_MIN_ELEMS;
    /* act[s] = silu(gate x) * up x: items (active expert, block of I rows) */
#pragma omp parallel for schedule(dynamic, 1) if (par)
    for (int64_t it = 0; it < na * up_blocks; ++it) {
        const int64_t e = active[it / up_blocks], j0 = it % up_blocks * MOE_ROWS;
        const int64_t j1 = j0 + MOE_ROWS < I ? j0 + MOE_ROWS : I;
        moe_item(w13 + e * 2 * I * H, I, H, j0, j1, 1, x, H, tok, starts[e], starts[e + 1], act, I);
    }
    /* y[s] = W2 act[s]: items (active expert, block of H rows); act's rows are the sorted ones */
#pragma omp parallel for schedule(dynamic, 1) if (par)
    for (int64_t it = 0; it < na * down_blocks; ++it) {
        const int64_t e = active[it / down_blocks], j0 = it % down_blocks * 2 * MOE_ROWS;
        const int64_t j1 = j0 + 2 * MOE_ROWS < H ? j0 + 2 * MOE_ROWS : H;
        moe_item(w2 + e * H * I, 0, I, j0, j1, 0, act, I, NULL, starts[e], starts[e + 1], y, H);
    }
    free(active);
    /* out[t] = sum over its pairs in ascending expert order of weight * y */
#pragma omp parallel for if (T * K * H >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; ++t) {
        int64_t ks[MOE_MAX_K];
        const int64_t kk = K < MOE_MAX_K ? K : MOE_MAX_K; /* the wrapper refuses K > MOE_MAX_K */
        for (int64_t k = 0; k < kk; ++k) { /* insertion sort of the token's pairs by expert */
            int64_t i = k;
            for (; i > 0 && ids[t * K + ks[i - 1]] > ids[t * K + k]; --i) ks[i] = ks[i - 1];
            ks[i] = k;
        }
        float *o = out + t * H;
        for (int64_t h = 0; h < H; ++h) o[h] = 0.f;
        for (int64_t k = 0; k < kk; ++k) {
            const int64_t p = t * K + ks[k];
            const float wt = weights[p], *yr = y + pos[p] * H;
#pragma omp simd
            for (int64_t h = 0; h < H; ++h) o[h] = o[h] + wt * yr[h];
        }
    }
    free(tok), free(pos);
    return 0;
}
