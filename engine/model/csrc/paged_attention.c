/* Paged attention on the CPU, reading K/V blocks where they lie in the cache.
 *
 * One call per layer runs every non-fresh row of a step: decode rows (n = 1) and prompt
 * chunks that continue a cached prefix (n > 1). A work item is (sequence, query tile,
 * KV head): the tile's rows times the G query heads of that KV head (GQA without repeating
 * K/V) attend over the sequence's blocks with an online softmax, fp32 accumulation, and
 * causal + optional sliding-window masks. Work items run in an OpenMP loop (the process's
 * libgomp, the one torch uses). Inputs and output are fp32 (dtype 0) or bf16 (dtype 1).
 *
 * Layouts: q[t, h, d] at q + t * q_tok_stride + h * D + d; k/v cache [S, Hkv, D];
 * out [T, H * D]; tables [nseq, table_stride] int32 block ids; row_start/num_new/ctx_len
 * [nseq] int32 (first step row, new tokens, context length after the step).
 * Returns 0, or -1 when a buffer cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TILE_QUERIES 64 /* query vectors (rows x heads of a group) per work item */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch */
    return (uint16_t)(u >> 16);
}

static inline void load_row(const void *base, int dtype, int64_t off, int D, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + off, (size_t)D * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(s[d]);
    }
}

#define KEY_CHUNK 16 /* keys scored together (within one visible range per query) */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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
                     int dtype, float *qbuf, float *acc, float *kbuf, float *vbuf, float *mx,
                     float *ls) {
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
        for (int i = 0; i < M; i++) {
            const int pos = qpos0 + tile->r0 + i / G;
            const int jmax = pos < c1 ? pos : c1;
            int jmin = c0;
            if (window > 0 && pos - window + 1 > jmin) jmin = pos - window + 1;
            if (jmax < jmin) continue;
            const int cnt = jmax - jmin + 1;
            scores(qbuf + (int64_t)i * D, krow + (jmin - c0), cnt, D, sbuf);
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

int loramux_paged_attention(const void *q, int64_t q_tok_stride, const void *k_cache,
                            const void *v_cache, void *out, const int32_t *tables,
                            int64_t table_stride, const int32_t *row_start, const int32_t *num_new,
                            const int32_t *ctx_len, int nseq, int H, int Hkv, int D, int bs,
                            int window, float scale, int dtype, int nthreads) {
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
        const size_t per = (size_t)M * D * 2 + (size_t)KEY_CHUNK * D * 2 + (size_t)M * 2;
        float *buf = (float *)malloc(sizeof(float) * per);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        float *qbuf = buf, *acc = qbuf + (size_t)M * D, *kbuf = acc + (size_t)M * D;
        float *vbuf = kbuf + (size_t)KEY_CHUNK * D, *mx = vbuf + (size_t)KEY_CHUNK * D;
        float *ls = mx + M;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitems; it++) {
            if (!buf) continue;
            const Tile *tl = &tiles[it / Hkv];
            const int s = tl->seq;
            run_item(q, q_tok_stride, k_cache, v_cache, out, tables + (int64_t)s * table_stride,
                     row_start[s], num_new[s], ctx_len[s], tl, (int)(it % Hkv), H, Hkv, G, D, bs,
                     window, scale, dtype, qbuf, acc, kbuf, vbuf, mx, ls);
        }
        free(buf);
    }
    free(tiles);
    return failed ? -1 : 0;
}
