/* The avx512bf16 variant's decode path of paged attention (paged_attention.c) over a bf16 KV
 * cache: one query row's G heads of one KV head against a chunk of keys, q . k and p . v by
 * VDPBF16PS on the cache rows where they lie (no fp32 copies).
 *
 * - Scores: four keys per pass share each load of q; their four 16-lane sums are reduced
 *   together (one unpack/add tree instead of four horizontal reductions), then scaled.
 * - Softmax: the online max and p = exp(s - max) per head in fp32; p rounded to bf16 (as
 *   torch's bf16 attention rounds it before p . v), 16 lanes at a time, torch-exact.
 * - p . v: each pair of value rows is loaded and interleaved once for every head of the row
 *   (the heads share the KV head's values), up to 4 heads per pass, their fp32 sums added to
 *   the accumulators with the online-softmax correction in vector registers.
 * Included by paged_attention.c only (static functions, one copy per ISA variant). */
#ifndef LORAMUX_ATTENTION_BH_H
#define LORAMUX_ATTENTION_BH_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_vec.h"
#include "bf16.h"

#define LMX_ATTN_BH 1
#define BH_MAX_HEADS 7 /* query heads of one KV head on this path (tiles of M < 8 vectors) */
#define BH_P_STRIDE (KEY_CHUNK + 16) /* bf16 p of one head (16-lane stores past cnt) */

static inline __mmask32 bh_dmask(int left) { /* the first min(left, 32) of 32 bf16 lanes */
    return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)] */
static inline __m128 bh_reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
    const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* s[j] = scale * (q . k[j]) for j < cnt: exact products of bf16 pairs, fp32 sums */
static void scores_bh(const uint16_t *q, const uint16_t *const *k, int cnt, int D, float scale, float *s) {
    const __m128 sc = _mm_set1_ps(scale);
    int j = 0;
    for (; j + 4 <= cnt; j += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int d = 0; d < D; d += 32) {
            const __mmask32 m = bh_dmask(D - d);
            const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + d);
            a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[j] + d));
            a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[j + 1] + d));
            a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[j + 2] + d));
            a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[j + 3] + d));
        }
        _mm_storeu_ps(s + j, _mm_mul_ps(sc, bh_reduce4(a0, a1, a2, a3)));
    }
    for (; j < cnt; j++) {
        __m512 a = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32) {
            const __mmask32 m = bh_dmask(D - d);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, q + d),
                                 (__m512bh)_mm512_maskz_loadu_epi16(m, k[j] + d));
        }
        s[j] = scale * _mm512_reduce_add_ps(a);
    }
}

static inline float bh_max(const float *s, int cnt) { /* max of s[0..cnt) */
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    __m512 m = lowest;
    for (int j = 0; j < cnt; j += 16) {
        const __mmask16 k = cnt - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cnt - j)) - 1u);
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(lowest, k, s + j));
    }
    return _mm512_reduce_max_ps(m);
}

/* p16[j] = bf16(p[j]) for j < cnt (as f32_to_bf16), zeros after it up to a multiple of 16 */
static inline void bh_round_p(const float *p, int cnt, uint16_t *p16) {
    for (int j = 0; j < cnt; j += 16) {
        const __mmask16 k = cnt - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cnt - j)) - 1u);
        const __m512i r = round_bf16_16(_mm512_maskz_loadu_ps(k, p + j));
        _mm256_storeu_si256((__m256i *)(p16 + j), _mm512_cvtepi32_epi16(_mm512_maskz_mov_epi32(k, r)));
    }
}

/* a[0..32) (the lanes m keeps) = a * corr + the 32 sums of lo / hi, accumulated over value row
 * pairs interleaved by unpacklo / unpackhi_epi16 (that lane order undone here) */
static inline __attribute__((always_inline)) void bh_add_pair_sums(float *a, __m512 lo, __m512 hi, float corr,
                                                                   __mmask32 m) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __mmask16 k0 = (__mmask16)(m & 0xffffu), k1 = (__mmask16)(m >> 16);
    const __m512 c = _mm512_set1_ps(corr);
    _mm512_mask_storeu_ps(a, k0, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k0, a), c, _mm512_permutex2var_ps(lo, first, hi)));
    _mm512_mask_storeu_ps(a + 16, k1,
                          _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k1, a + 16), c, _mm512_permutex2var_ps(lo, second, hi)));
}

/* acc[h][d] = acc[h][d] * corr[h] + sum_j p[h][j] v[j][d] for NH heads (a constant at each
 * call site: the accumulators stay in registers); rows j, j+1 interleaved once for all heads */
static inline __attribute__((always_inline)) void bh_accumulate_heads(
    float *acc, const float *corr, const uint16_t *p16, const int NH, const uint16_t *const *v, int cnt, int D) {
    for (int d = 0; d < D; d += 32) {
        const __mmask32 m = bh_dmask(D - d);
        __m512 lo[4], hi[4];
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++) lo[h] = hi[h] = _mm512_setzero_ps();
        for (int j = 0; j < cnt; j += 2) {
            const __m512i e = _mm512_maskz_loadu_epi16(m, v[j] + d);
            const __m512i o = j + 1 < cnt ? _mm512_maskz_loadu_epi16(m, v[j + 1] + d) : _mm512_setzero_si512();
            const __m512bh ul = (__m512bh)_mm512_unpacklo_epi16(e, o), uh = (__m512bh)_mm512_unpackhi_epi16(e, o);
#pragma GCC unroll 4
            for (int h = 0; h < NH; h++) {
                int32_t pair; /* p[h][j] | p[h][j + 1] << 16 */
                memcpy(&pair, p16 + h * BH_P_STRIDE + j, sizeof pair);
                const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
                lo[h] = _mm512_dpbf16_ps(lo[h], pv, ul);
                hi[h] = _mm512_dpbf16_ps(hi[h], pv, uh);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++) bh_add_pair_sums(acc + (int64_t)h * D + d, lo[h], hi[h], corr[h], m);
    }
}

static void bh_accumulate(float *acc, const float *corr, const uint16_t *p16, int G, const uint16_t *const *v,
                          int cnt, int D) {
    for (int h = 0; h < G; h += 4) {
        float *a = acc + (int64_t)h * D;
        const uint16_t *p = p16 + h * BH_P_STRIDE;
        switch (G - h) {
        case 1: bh_accumulate_heads(a, corr + h, p, 1, v, cnt, D); break;
        case 2: bh_accumulate_heads(a, corr + h, p, 2, v, cnt, D); break;
        case 3: bh_accumulate_heads(a, corr + h, p, 3, v, cnt, D); break;
        default: bh_accumulate_heads(a, corr + h, p, 4, v, cnt, D); break;
        }
    }
}

/* One query row's G heads (q: the first, heads D apart) over cnt keys k / values v of their KV
 * head: the online softmax's max mx[G] and sum ls[G] and the accumulators acc[G][D] updated */
static void row_chunk_bh(const uint16_t *q, int G, int D, float scale, float softcap, const uint16_t *const *k,
                         const uint16_t *const *v, int cnt, float *acc, float *mx, float *ls) {
    float s[KEY_CHUNK], corr[BH_MAX_HEADS];
    uint16_t p16[BH_MAX_HEADS * BH_P_STRIDE] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) {
        scores_bh(q + (int64_t)g * D, k, cnt, D, scale, s);
        if (softcap > 0.0f) softcap_scores(s, cnt, softcap);
        const float bmax = bh_max(s, cnt);
        const float newm = bmax > mx[g] ? bmax : mx[g];
        corr[g] = expf(mx[g] - newm); /* 0 when mx[g] is -inf */
        ls[g] = ls[g] * corr[g] + softmax_exp(s, cnt, newm);
        mx[g] = newm;
        bh_round_p(s, cnt, p16 + g * BH_P_STRIDE);
    }
    bh_accumulate(acc, corr, p16, G, v, cnt, D);
}
#endif
#endif
