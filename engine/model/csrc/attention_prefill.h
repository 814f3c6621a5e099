/* Prompt tiles of the attention kernel (paged_attention.c): a tile's many queries against one
 * chunk of keys as two small register-blocked GEMMs (AVX2/FMA variants only; elsewhere the
 * per-query path of paged_attention.c runs). Included by paged_attention.c only. */
#ifndef LORAMUX_ATTENTION_PREFILL_H
#define LORAMUX_ATTENTION_PREFILL_H
#include "attention_vec.h"

#define KEY_SUB 16 /* keys per register block of the prompt-tile GEMMs */

#if defined(__AVX2__) && defined(__FMA__)
/* Prompt tiles (many queries): all M queries against one chunk of cnt <= KEY_CHUNK keys as
 * two small GEMMs. K is transposed once per chunk, S = Q K^T runs 4 queries x 16 keys per
 * step, then the masked online softmax per query, then acc = acc * corr + P V runs
 * 4 queries x 16 dims per step (x 64 keys and x 64 dims in attention_prefill_512.h's AVX-512
 * blocks). qpos: position of the tile's first row. */
#define HAVE_BLOCK_PATH 1

#include "attention_prefill_512.h"
#ifndef HAVE_TILES_512
/* The four queries at q0 (row stride D) against nsub blocks of 16 keys of kT (row d at
 * kT + d * KEY_CHUNK) into P's four rows, 4 queries x 16 keys per step. */
static inline void scores_quad(const float *q0, int D, int nsub, const float *kT, float *P) {
    for (int sb = 0; sb < nsub; sb++) {
        const float *kc = kT + sb * KEY_SUB;
        __m256 s[8];
        for (int t = 0; t < 8; t++) s[t] = _mm256_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m256 k0 = _mm256_loadu_ps(kc + d * KEY_CHUNK), k1 = _mm256_loadu_ps(kc + d * KEY_CHUNK + 8);
            for (int t = 0; t < 4; t++) {
                const __m256 b = _mm256_broadcast_ss(q0 + (int64_t)t * D + d);
                s[2 * t] = _mm256_fmadd_ps(b, k0, s[2 * t]);
                s[2 * t + 1] = _mm256_fmadd_ps(b, k1, s[2 * t + 1]);
            }
        }
        for (int t = 0; t < 4; t++) {
            float *pt = P + (int64_t)t * KEY_CHUNK + sb * KEY_SUB;
            _mm256_storeu_ps(pt, s[2 * t]);
            _mm256_storeu_ps(pt + 8, s[2 * t + 1]);
        }
    }
}

/* The four queries' acc (row stride D) = acc * cr + P V (P row stride KEY_CHUNK) over the
 * chunk's cnt values, 16 dims a step; returns the first dim left for the caller's scalar tail. */
static inline int accumulate_quad_vec(const float *cr, int D, int cnt, const float *const *vrow, const float *P,
                                      float *acc) {
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 a[8];
        for (int t = 0; t < 4; t++) {
            const __m256 c = _mm256_set1_ps(cr[t]);
            a[2 * t] = _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)t * D + d), c);
            a[2 * t + 1] = _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)t * D + d + 8), c);
        }
        for (int j = 0; j < cnt; j++) {
            const __m256 v0 = _mm256_loadu_ps(vrow[j] + d), v1 = _mm256_loadu_ps(vrow[j] + d + 8);
            for (int t = 0; t < 4; t++) {
                const __m256 b = _mm256_broadcast_ss(P + (int64_t)t * KEY_CHUNK + j);
                a[2 * t] = _mm256_fmadd_ps(b, v0, a[2 * t]);
                a[2 * t + 1] = _mm256_fmadd_ps(b, v1, a[2 * t + 1]);
            }
        }
        for (int t = 0; t < 4; t++) {
            _mm256_storeu_ps(acc + (int64_t)t * D + d, a[2 * t]);
            _mm256_storeu_ps(acc + (int64_t)t * D + d + 8, a[2 * t + 1]);
        }
    }
    return d;
}
#endif

/* P[i][j] = q_i . k_j (soft-capped when softcap > 0) for the tile's M queries and the chunk's
 * cnt keys, 4 queries x 16 keys per step over K transposed into kT (pads: finite zeros). */
static inline void tile_scores(const float *qbuf, int M, int D, int cnt, float softcap,
                               const float *const *krow, float *kT, float *P) {
    for (int d = 0; d < D; d++)
        for (int j = cnt; j < KEY_CHUNK; j++) kT[d * KEY_CHUNK + j] = 0.0f; /* finite pads */
    for (int j = 0; j < cnt; j++)
        for (int d = 0; d < D; d++) kT[d * KEY_CHUNK + j] = krow[j][d];
    const int nsub = (cnt + KEY_SUB - 1) / KEY_SUB;
    int i = 0;
    for (; i + 4 <= M; i += 4) scores_quad(qbuf + (int64_t)i * D, D, nsub, kT, P + (int64_t)i * KEY_CHUNK);
    for (; i < M; i++) {
        const float *qi = qbuf + (int64_t)i * D;
        for (int sb = 0; sb < nsub; sb++) {
            const float *kc = kT + sb * KEY_SUB;
            __m256 s0 = _mm256_setzero_ps(), s1 = s0;
            for (int d = 0; d < D; d++) {
                const __m256 b = _mm256_broadcast_ss(qi + d);
                s0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(kc + d * KEY_CHUNK), s0);
                s1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(kc + d * KEY_CHUNK + 8), s1);
            }
            _mm256_storeu_ps(P + (int64_t)i * KEY_CHUNK + sb * KEY_SUB, s0);
            _mm256_storeu_ps(P + (int64_t)i * KEY_CHUNK + sb * KEY_SUB + 8, s1);
        }
    }
    if (softcap > 0.0f) /* the columns scored above (pads are the finite 0 . q) */
        for (i = 0; i < M; i++) softcap_scores(P + (int64_t)i * KEY_CHUNK, nsub * KEY_SUB, softcap);
}

#ifndef HAVE_TILES_512
/* The masked online softmax of each query's row of P (causal from qpos, the sliding window):
 * P becomes exp(s - new max) where visible and 0 elsewhere; cr[i] the correction of the
 * query's running max mx[i], ls[i] its running sum. */
static inline void tile_softmax(int M, int G, int qpos, int c0, int cnt, int window, float *P,
                                float *cr, float *mx, float *ls) {
    const int nsub = (cnt + KEY_SUB - 1) / KEY_SUB;
    int i;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (i = 0; i < M; i++) {
        const int pos = qpos + i / G;
        int jmax = pos - c0;
        if (jmax > cnt - 1) jmax = cnt - 1;
        int jmin = 0;
        if (window > 0 && pos - window + 1 - c0 > 0) jmin = pos - window + 1 - c0;
        float *p = P + (int64_t)i * KEY_CHUNK;
        cr[i] = 1.0f;
        if (jmax < jmin) {
            memset(p, 0, sizeof(float) * cnt);
            continue;
        }
        float bmax = p[jmin];
        for (int j = jmin + 1; j <= jmax; j++) bmax = p[j] > bmax ? p[j] : bmax;
        const float newm = bmax > mx[i] ? bmax : mx[i];
        const __m256 mv = _mm256_set1_ps(newm);
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < nsub * KEY_SUB; j += 8) {
            const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(j));
            const __m256i keep = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(jmin), idx),
                                                     _mm256_cmpgt_epi32(_mm256_set1_epi32(jmax + 1), idx));
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv)), _mm256_castsi256_ps(keep));
            _mm256_storeu_ps(p + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        cr[i] = expf(mx[i] - newm); /* 0 when mx[i] is -inf */
        ls[i] = ls[i] * cr[i] + hsum8(sum);
        mx[i] = newm;
    }
}
#endif

/* acc_i = acc_i * cr[i] + sum_j P[i][j] v_j, 4 queries x 16 dims per step. */
static inline void tile_accumulate(int M, int D, int cnt, const float *const *vrow, const float *P,
                                   const float *cr, float *acc) {
    int i = 0;
    for (; i + 4 <= M; i += 4) {
        float *a = acc + (int64_t)i * D;
        const float *p = P + (int64_t)i * KEY_CHUNK;
        for (int d = accumulate_quad_vec(cr + i, D, cnt, vrow, p, a); d < D; d++)
            for (int t = 0; t < 4; t++) {
                float x = a[(int64_t)t * D + d] * cr[i + t];
                for (int j = 0; j < cnt; j++) x += p[(int64_t)t * KEY_CHUNK + j] * vrow[j][d];
                a[(int64_t)t * D + d] = x;
            }
    }
    for (; i < M; i++) accumulate(acc + (int64_t)i * D, cr[i], P + (int64_t)i * KEY_CHUNK, vrow, cnt, D);
}

static void chunk_block(const float *qbuf, int M, int G, int D, int qpos, int c0, int cnt,
                        int window, float softcap, const float *const *krow,
                        const float *const *vrow, float *kT, float *P, float *cr, float *acc,
                        float *mx, float *ls) {
    tile_scores(qbuf, M, D, cnt, softcap, krow, kT, P);
    tile_softmax(M, G, qpos, c0, cnt, window, P, cr, mx, ls);
    tile_accumulate(M, D, cnt, vrow, P, cr, acc);
}
#endif
#endif
