/* The attention kernel's inner loops over one chunk of keys (paged_attention.c): load a row
 * of the cache as fp32, score a query against the chunk's keys, soft-cap, exponentiate for the
 * online softmax and accumulate p . v; AVX2/FMA vector code where the ISA variant has it,
 * scalar C otherwise (the avx512bf16 variant's decode path over a bf16 cache is
 * attention_bh.h's). Included by paged_attention.c only (static functions, one copy per ISA
 * variant). */
#ifndef LORAMUX_ATTENTION_VEC_H
#define LORAMUX_ATTENTION_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define KEY_CHUNK 64 /* keys scored together (within one visible range per query) */

static inline void load_row(const void *base, int dtype, int64_t off, int D, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + off, (size_t)D * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(s[d]);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>


/* s[j] = q . k[j] for j < cnt: four keys share each load of q */
static void scores(const float *q, const float *const *k, int cnt, int D, float *s) {
    int j = 0;
    for (; j + 4 <= cnt; j += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int d = 0;
        for (; d + 8 <= D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 1] + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 2] + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 3] + d), a3);
        }
        float r0 = hsum8(a0), r1 = hsum8(a1), r2 = hsum8(a2), r3 = hsum8(a3);
        for (; d < D; d++) {
            r0 += q[d] * k[j][d];
            r1 += q[d] * k[j + 1][d];
            r2 += q[d] * k[j + 2][d];
            r3 += q[d] * k[j + 3][d];
        }
        s[j] = r0, s[j + 1] = r1, s[j + 2] = r2, s[j + 3] = r3;
    }
    for (; j < cnt; j++) {
        __m256 a = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k[j] + d), a);
        float r = hsum8(a);
        for (; d < D; d++) r += q[d] * k[j][d];
        s[j] = r;
    }
}

/* exp(x) for x <= 0 (Cephes polynomial, ~1 ulp) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* s[j] = cap * tanh(s[j] / cap) for j < n (n a multiple of 8, or the tail is scalar):
 * tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2 |y|) <= 1, the sign put back */
static void softcap_scores(float *s, int n, float cap) {
    const __m256 m2 = _mm256_set1_ps(-2.0f / cap), c = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(s + j);
        const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, v), m2)); /* exp(-2|v|/cap) */
        const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        _mm256_storeu_ps(s + j, _mm256_or_ps(_mm256_mul_ps(c, t), _mm256_and_ps(sign, v)));
    }
    for (; j < n; j++) s[j] = cap * tanhf(s[j] / cap);
}

/* p[j] = exp(s[j] - m) for j < cnt (cnt <= KEY_CHUNK); returns the sum */
static float softmax_exp(float *s, int cnt, float m) {
    __m256 sum = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int j = 0; j < cnt; j += 8) {
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt - j), lane));
        __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)), keep);
        _mm256_storeu_ps(s + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    return hsum8(sum);
}

/* acc[d] = acc[d] * corr + sum_j p[j] v[j][d] */
static void accumulate(float *acc, float corr, const float *p, const float *const *v, int cnt, int D) {
    const __m256 c = _mm256_set1_ps(corr);
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
        for (int j = 0; j < cnt; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
    for (; d < D; d++) {
        float a = acc[d] * corr;
        for (int j = 0; j < cnt; j++) a += p[j] * v[j][d];
        acc[d] = a;
    }
}
#else
static void scores(const float *q, const float *const *k, int cnt, int D, float *s) {
    for (int j = 0; j < cnt; j++) {
        float r = 0.0f;
        for (int d = 0; d < D; d++) r += q[d] * k[j][d];
        s[j] = r;
    }
}

static void softcap_scores(float *s, int n, float cap) {
    for (int j = 0; j < n; j++) s[j] = cap * tanhf(s[j] / cap);
}

static float softmax_exp(float *s, int cnt, float m) {
    float sum = 0.0f;
    for (int j = 0; j < cnt; j++) sum += (s[j] = expf(s[j] - m));
    return sum;
}

static void accumulate(float *acc, float corr, const float *p, const float *const *v, int cnt, int D) {
    for (int d = 0; d < D; d++) {
        float a = acc[d] * corr;
        for (int j = 0; j < cnt; j++) a += p[j] * v[j][d];
        acc[d] = a;
    }
}
#endif
#endif
