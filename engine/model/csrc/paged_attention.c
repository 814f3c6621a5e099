/* Paged attention on the CPU, reading K/V blocks where they lie in the cache.
 *
 * One call per layer runs every non-fresh row of a step: decode rows (n = 1) and prompt
 * chunks that continue a cached prefix (n > 1). A work item is (sequence, query tile,
 * KV head): the tile's rows times the G query heads of that KV head (GQA without repeating
 * K/V) attend over the sequence's blocks with an online softmax, fp32 accumulation, and
 * causal + optional sliding-window masks. Work items run in an OpenMP loop (the process's
 * libgomp, the one torch uses). Inputs and output are fp32 (dtype 0) or bf16 (dtype 1).
 * Scores are q . k * scale, soft-capped when softcap > 0 (Gemma 2: softcap * tanh(s / softcap));
 * window > 0 keeps the keys of the last `window` positions (sliding window).
 *
 * Layouts: q[t, h, d] at q + t * q_tok_stride + h * D + d; k/v cache [S, Hkv, D];
 * out [T, H * D]; tables [nseq, table_stride] int32 block ids; row_start/num_new/ctx_len
 * [nseq] int32 (first step row, new tokens, context length after the step).
 * The caller (ops.cpp) has checked every shape, stride, dtype and block id.
 * Returns 0, or -1 when a buffer cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define MAX_TILE_QUERIES 64 /* query vectors (rows x heads of a group) per work item */

static inline void load_row(const void *base, int dtype, int64_t off, int D, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + off, (size_t)D * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(s[d]);
    }
}

#define KEY_CHUNK 64 /* keys scored together (within one visible range per query) */
#define KEY_SUB 16 /* keys per register block of the prompt-tile GEMMs */

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

/* Prompt tiles (many queries): all M queries against one chunk of cnt <= KEY_CHUNK keys as
 * two small GEMMs. K is transposed once per chunk, S = Q K^T runs 4 queries x 16 keys per
 * step, then the masked online softmax per query, then acc = acc * corr + P V runs
 * 4 queries x 16 dims per step. qpos: position of the tile's first row. */
#define HAVE_BLOCK_PATH 1
static void chunk_block(const float *qbuf, int M, int G, int D, int qpos, int c0, int cnt,
                        int window, float softcap, const float *const *krow,
                        const float *const *vrow, float *kT, float *P, float *cr, float *acc,
                        float *mx, float *ls) {
    for (int d = 0; d < D; d++)
        for (int j = cnt; j < KEY_CHUNK; j++) kT[d * KEY_CHUNK + j] = 0.0f; /* finite pads */
    for (int j = 0; j < cnt; j++)
        for (int d = 0; d < D; d++) kT[d * KEY_CHUNK + j] = krow[j][d];
    const int nsub = (cnt + KEY_SUB - 1) / KEY_SUB;
    int i = 0;
    for (; i + 4 <= M; i += 4) {
        const float *q0 = qbuf + (int64_t)i * D;
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
                float *pt = P + (int64_t)(i + t) * KEY_CHUNK + sb * KEY_SUB;
                _mm256_storeu_ps(pt, s[2 * t]);
                _mm256_storeu_ps(pt + 8, s[2 * t + 1]);
            }
        }
    }
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
    i = 0;
    for (; i + 4 <= M; i += 4) {
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            __m256 a[8];
            for (int t = 0; t < 4; t++) {
                const __m256 c = _mm256_set1_ps(cr[i + t]);
                a[2 * t] = _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)(i + t) * D + d), c);
                a[2 * t + 1] = _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)(i + t) * D + d + 8), c);
            }
            for (int j = 0; j < cnt; j++) {
                const __m256 v0 = _mm256_loadu_ps(vrow[j] + d), v1 = _mm256_loadu_ps(vrow[j] + d + 8);
                for (int t = 0; t < 4; t++) {
                    const __m256 b = _mm256_broadcast_ss(P + (int64_t)(i + t) * KEY_CHUNK + j);
                    a[2 * t] = _mm256_fmadd_ps(b, v0, a[2 * t]);
                    a[2 * t + 1] = _mm256_fmadd_ps(b, v1, a[2 * t + 1]);
                }
            }
            for (int t = 0; t < 4; t++) {
                _mm256_storeu_ps(acc + (int64_t)(i + t) * D + d, a[2 * t]);
                _mm256_storeu_ps(acc + (int64_t)(i + t) * D + d + 8, a[2 * t + 1]);
            }
        }
        for (; d < D; d++)
            for (int t = 0; t < 4; t++) {
                float a = acc[(int64_t)(i + t) * D + d] * cr[i + t];
                for (int j = 0; j < cnt; j++) a += P[(int64_t)(i + t) * KEY_CHUNK + j] * vrow[j][d];
                acc[(int64_t)(i + t) * D + d] = a;
            }
    }
    for (; i < M; i++) accumulate(acc + (int64_t)i * D, cr[i], P + (int64_t)i * KEY_CHUNK, vrow, cnt, D);
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

typedef struct {
    int seq, r0, r1;
} Tile;

static void run_item(const void *q, int64_t q_tok_stride, const void *k_cache, const void *v_cache,
                     void *out, const int32_t *table, int row0, int n, int ctx, const Tile *tile,
                     int kvh, int H, int Hkv, int G, int D, int bs, int window, float scale,
                     float softcap, int dtype, float *qbuf, float *acc, float *kbuf, float *vbuf, float *mx,
                     float *ls, float *kT, float *P, float *cr) {
    const int m = tile->r1 - tile->r0, M = m * G;
    const int qpos0 = ctx - n; /* position of the sequence's first new row */
    const float *krow[KEY_CHUNK], *vrow[KEY_CHUNK];
    float sbuf[KEY_CHUNK];
    for (int i = 0; i < m; i++)
        for (int g = 0; g < G; g++) {
            float *dst = qbuf + (int64_t)(i * G + g) * D;
            load_row(q, dtype, (int64_t)(row0 + tile->r0 + i) * q_tok_stride + (int64_t)(kvh * G + g) * D, D, dst);
            for (int d = 0; d < D; d++) dst[d] *= scale;
        }
    memset(acc, 0, sizeof(float) * (size_t)M * D);
    for (int i = 0; i < M; i++) {
        mx[i] = -INFINITY;
        ls[i] = 0.0f;
    }
    const int hi = qpos0 + tile->r1 - 1; /* last key any row of the tile sees */
    int lo = 0;
    if (window > 0) {
        lo = qpos0 + tile->r0 - window + 1;
        if (lo < 0) lo = 0;
    }
    for (int c0 = lo; c0 <= hi; c0 += KEY_CHUNK) {
        const int c1 = c0 + KEY_CHUNK - 1 < hi ? c0 + KEY_CHUNK - 1 : hi; /* inclusive */
        for (int j = c0; j <= c1; j++) {
            const int64_t off = (((int64_t)table[j / bs] * bs + j % bs) * Hkv + kvh) * D;
            if (dtype == 0) {
                krow[j - c0] = (const float *)k_cache + off;
                vrow[j - c0] = (const float *)v_cache + off;
            } else {
                load_row(k_cache, dtype, off, D, kbuf + (int64_t)(j - c0) * D);
                load_row(v_cache, dtype, off, D, vbuf + (int64_t)(j - c0) * D);
                krow[j - c0] = kbuf + (int64_t)(j - c0) * D;
                vrow[j - c0] = vbuf + (int64_t)(j - c0) * D;
            }
        }
#ifdef HAVE_BLOCK_PATH
        if (M >= 8) {
            chunk_block(qbuf, M, G, D, qpos0 + tile->r0, c0, c1 - c0 + 1, window, softcap, krow,
                        vrow, kT, P, cr, acc, mx, ls);
            continue;
        }
#else
        (void)kT, (void)P, (void)cr;
#endif
        for (int i = 0; i < M; i++) {
            const int pos = qpos0 + tile->r0 + i / G;
            const int jmax = pos < c1 ? pos : c1;
            int jmin = c0;
            if (window > 0 && pos - window + 1 > jmin) jmin = pos - window + 1;
            if (jmax < jmin) continue;
            const int cnt = jmax - jmin + 1;
            scores(qbuf + (int64_t)i * D, krow + (jmin - c0), cnt, D, sbuf);
            if (softcap > 0.0f) softcap_scores(sbuf, cnt, softcap);
            float bmax = sbuf[0];
            for (int j = 1; j < cnt; j++) bmax = sbuf[j] > bmax ? sbuf[j] : bmax;
            const float newm = bmax > mx[i] ? bmax : mx[i];
            const float corr = expf(mx[i] - newm); /* 0 when mx[i] is -inf */
            const float sum = softmax_exp(sbuf, cnt, newm);
            accumulate(acc + (int64_t)i * D, corr, sbuf, vrow + (jmin - c0), cnt, D);
            ls[i] = ls[i] * corr + sum;
            mx[i] = newm;
        }
    }
    for (int i = 0; i < m; i++)
        for (int g = 0; g < G; g++) {
            const float *ai = acc + (int64_t)(i * G + g) * D;
            const float inv = 1.0f / ls[i * G + g];
            const int64_t off = (int64_t)(row0 + tile->r0 + i) * H * D + (int64_t)(kvh * G + g) * D;
            if (dtype == 0) {
                float *o = (float *)out + off;
                for (int d = 0; d < D; d++) o[d] = ai[d] * inv;
            } else {
                uint16_t *o = (uint16_t *)out + off;
                for (int d = 0; d < D; d++) o[d] = f32_to_bf16(ai[d] * inv);
            }
        }
}

int LMX_FN(loramux_paged_attention)(const void *q, int64_t q_tok_stride, const void *k_cache,
                                    const void *v_cache, void *out, const int32_t *tables,
                                    int64_t table_stride, const int32_t *row_start,
                                    const int32_t *num_new, const int32_t *ctx_len, int nseq,
                                    int H, int Hkv, int D, int bs, int window, float scale,
                                    float softcap, int dtype, int nthreads) {
    const int G = H / Hkv;
    int rows_per_tile = MAX_TILE_QUERIES / G;
    if (rows_per_tile < 1) rows_per_tile = 1;
    const int M = rows_per_tile * G;
    int ntiles = 0;
    for (int s = 0; s < nseq; s++) ntiles += (num_new[s] + rows_per_tile - 1) / rows_per_tile;
    Tile *tiles = (Tile *)malloc(sizeof(Tile) * (size_t)(ntiles > 0 ? ntiles : 1));
    if (!tiles) return -1;
    int t = 0;
    for (int s = 0; s < nseq; s++)
        for (int r0 = 0; r0 < num_new[s]; r0 += rows_per_tile) {
            tiles[t].seq = s;
            tiles[t].r0 = r0;
            tiles[t].r1 = r0 + rows_per_tile < num_new[s] ? r0 + rows_per_tile : num_new[s];
            t++;
        }
    const int64_t nitems = (int64_t)ntiles * Hkv;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nitems > 1 && nthreads > 1)
    {
        const size_t per = (size_t)M * D * 2 + (size_t)KEY_CHUNK * D * 3 + (size_t)M * (3 + KEY_CHUNK);
        float *buf = (float *)malloc(sizeof(float) * per);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        float *qbuf = buf, *acc = qbuf + (size_t)M * D, *kbuf = acc + (size_t)M * D;
        float *vbuf = kbuf + (size_t)KEY_CHUNK * D, *mx = vbuf + (size_t)KEY_CHUNK * D;
        float *ls = mx + M, *kT = ls + M, *P = kT + (size_t)KEY_CHUNK * D, *cr = P + (size_t)M * KEY_CHUNK;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitems; it++) {
            if (!buf) continue;
            const Tile *tl = &tiles[it / Hkv];
            const int s = tl->seq;
            run_item(q, q_tok_stride, k_cache, v_cache, out, tables + (int64_t)s * table_stride,
                     row_start[s], num_new[s], ctx_len[s], tl, (int)(it % Hkv), H, Hkv, G, D, bs,
                     window, scale, softcap, dtype, qbuf, acc, kbuf, vbuf, mx, ls, kT, P, cr);
        }
        free(buf);
    }
    free(tiles);
    return failed ? -1 : 0;
}
