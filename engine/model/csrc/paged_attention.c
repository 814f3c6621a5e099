/* Paged attention on the CPU, reading K/V blocks where they lie in the cache.
 *
 * One call per layer runs every row of a step: decode rows (n = 1) and prompt chunks (n > 1),
 * fresh or continuing a cached prefix. A work item is (sequence, query tile,
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
 * The inner loops over a chunk of keys are attention_vec.h's (attention_bh.h's for bf16 decode
 * rows in the avx512bf16 variant), the prompt tiles' GEMMs attention_prefill.h's
 * (attention_prefill_bh.h's over a bf16 cache there); this file is the tiling, the online
 * softmax and the OpenMP loop.
 * The caller (ops.cpp) has checked every shape, stride, dtype and block id.
 * Returns 0, or -1 when a buffer cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_bh.h"
#include "attention_prefill.h"
#include "attention_prefill_bh.h"
#include "attention_vec.h"
#include "bf16.h"
#include "kernels.h"

#define MAX_TILE_QUERIES 64 /* query vectors (rows x heads of a group) per work item */

typedef struct {
    int seq, r0, r1;
} Tile;

/* krow[j - c0], vrow[j - c0]: the KV head's key and value rows of positions c0..c1 (inclusive)
 * as fp32, in place in an fp32 cache, else converted into kbuf / vbuf; with bh (the bf16 path
 * of a bf16 cache) khrow / vhrow instead: the bf16 rows where they lie. */
static inline void gather_chunk(const void *k_cache, const void *v_cache, const int32_t *table, int bs,
                                int Hkv, int kvh, int D, int dtype, int c0, int c1, float *kbuf,
                                float *vbuf, const float **krow, const float **vrow, int bh,
                                const uint16_t **khrow, const uint16_t **vhrow) {
    int blk = c0 / bs, slot = c0 % bs; /* position j's block and slot, stepped along */
    for (int j = c0; j <= c1; j++) {
        const int64_t off = (((int64_t)table[blk] * bs + slot) * Hkv + kvh) * D;
        if (bh) {
            khrow[j - c0] = (const uint16_t *)k_cache + off;
            vhrow[j - c0] = (const uint16_t *)v_cache + off;
        } else if (dtype == 0) {
            krow[j - c0] = (const float *)k_cache + off;
            vrow[j - c0] = (const float *)v_cache + off;
        } else {
            load_row(k_cache, dtype, off, D, kbuf + (int64_t)(j - c0) * D);
            load_row(v_cache, dtype, off, D, vbuf + (int64_t)(j - c0) * D);
            krow[j - c0] = kbuf + (int64_t)(j - c0) * D;
            vrow[j - c0] = vbuf + (int64_t)(j - c0) * D;
        }
        if (++slot == bs) slot = 0, blk++;
    }
}

/* Prefetches the bf16 key and value rows of positions c0..c1 (inclusive) of KV head kvh: a
 * decode row's reads are latency bound (128 bytes here, 128 there), so the next chunk's are
 * requested while the current one is computed. */
static inline void prefetch_chunk(const void *k_cache, const void *v_cache, const int32_t *table, int bs,
                                  int Hkv, int kvh, int D, int c0, int c1) {
    int blk = c0 / bs, slot = c0 % bs;
    for (int j = c0; j <= c1; j++) {
        const int64_t off = (((int64_t)table[blk] * bs + slot) * Hkv + kvh) * D;
        for (int b = 0; b < D * 2; b += 64) {
            __builtin_prefetch((const char *)((const uint16_t *)k_cache + off) + b);
            __builtin_prefetch((const char *)((const uint16_t *)v_cache + off) + b);
        }
        if (++slot == bs) slot = 0, blk++;
    }
}

/* The avx512bf16 variant's bf16 path: a bf16 cache, tiles of fewer than 8 query vectors
 * (decode rows; not the block path's tiles) run attention_bh.h's row_chunk_bh on the bf16 rows
 * where they lie (no fp32 copies). */
#ifdef LMX_ATTN_BH
#define ATTN_BH(dtype, M) ((dtype) == 1 && (M) < 8)
#else /* no bf16 path in this variant: never called (ATTN_BH is 0) */
#define ATTN_BH(dtype, M) 0
static void row_chunk_bh(const uint16_t *q, int G, int D, float scale, float softcap, const uint16_t *const *k,
                         const uint16_t *const *v, int cnt, float *acc, float *mx, float *ls) {
    (void)q, (void)G, (void)D, (void)scale, (void)softcap, (void)k, (void)v, (void)cnt, (void)acc, (void)mx, (void)ls;
}
#endif

/* qbuf[i * G + g] = scale * (query row row0 + i, head kvh * G + g) as fp32, for m rows */
static inline void load_tile_queries(const void *q, int64_t q_tok_stride, int row0, int m, int kvh, int G, int D,
                                     float scale, int dtype, float *qbuf) {
    for (int i = 0; i < m; i++)
        for (int g = 0; g < G; g++) {
            float *dst = qbuf + (int64_t)(i * G + g) * D;
            load_row(q, dtype, (int64_t)(row0 + i) * q_tok_stride + (int64_t)(kvh * G + g) * D, D, dst);
            for (int d = 0; d < D; d++) dst[d] *= scale;
        }
}

/* out rows row0.. (m of them), heads kvh * G.. = acc / ls, in the output's dtype */
static inline void store_tile(void *out, const float *acc, const float *ls, int row0, int m, int kvh, int G, int H,
                              int D, int dtype) {
    for (int i = 0; i < m; i++)
        for (int g = 0; g < G; g++) {
            const float *ai = acc + (int64_t)(i * G + g) * D;
            const float inv = 1.0f / ls[i * G + g];
            const int64_t off = (int64_t)(row0 + i) * H * D + (int64_t)(kvh * G + g) * D;
            if (dtype == 0) {
                float *o = (float *)out + off;
                for (int d = 0; d < D; d++) o[d] = ai[d] * inv;
            } else {
                uint16_t *o = (uint16_t *)out + off;
                for (int d = 0; d < D; d++) o[d] = f32_to_bf16(ai[d] * inv);
            }
        }
}

/* The avx512bf16 variant's prompt tiles over a bf16 cache (attention_prefill_bh.h) */
#ifdef LMX_ATTN_BH_BLOCK
#define ATTN_BHB(dtype, M) ((dtype) == 1 && (M) >= 8)
#else
#define ATTN_BHB(dtype, M) 0
#endif

static void run_item(const void *q, int64_t q_tok_stride, const void *k_cache, const void *v_cache,
                     void *out, const int32_t *table, int row0, int n, int ctx, const Tile *tile,
                     int kvh, int H, int Hkv, int G, int D, int bs, int window, float scale,
                     float softcap, int dtype, float *qbuf, float *acc, float *kbuf, float *vbuf, float *mx,
                     float *ls, float *kT, float *P, float *cr, float *bhbuf) {
    const int m = tile->r1 - tile->r0, M = m * G;
    const int qpos0 = ctx - n; /* position of the sequence's first new row */
    const float *krow[KEY_CHUNK], *vrow[KEY_CHUNK];
    float sbuf[KEY_CHUNK];
    const int bh = ATTN_BH(dtype, M), bhb = ATTN_BHB(dtype, M);
    const uint16_t *khrow[KEY_CHUNK], *vhrow[KEY_CHUNK];
    if (!bh && !bhb) /* the bf16 paths read q where it lies */
        load_tile_queries(q, q_tok_stride, row0 + tile->r0, m, kvh, G, D, scale, dtype, qbuf);
    memset(acc, 0, sizeof(float) * (size_t)M * D);
    for (int i = 0; i < M; i++) {
        mx[i] = -INFINITY;
        ls[i] = 0.0f;
    }
#ifdef LMX_ATTN_BH_BLOCK
    const BhbBuffers bb = bhb_buffers(bhbuf, M, D);
    if (bhb) bhb_load_queries((const uint16_t *)q, q_tok_stride, row0 + tile->r0, m, kvh, G, D, bb.qh);
#else
    (void)bhbuf;
#endif
    const int hi = qpos0 + tile->r1 - 1; /* last key any row of the tile sees */
    int lo = 0;
    if (window > 0) {
        lo = qpos0 + tile->r0 - window + 1;
        if (lo < 0) lo = 0;
    }
    for (int c0 = lo; c0 <= hi; c0 += KEY_CHUNK) {
        const int c1 = c0 + KEY_CHUNK - 1 < hi ? c0 + KEY_CHUNK - 1 : hi; /* inclusive */
        gather_chunk(k_cache, v_cache, table, bs, Hkv, kvh, D, dtype, c0, c1, kbuf, vbuf, krow, vrow, bh || bhb,
                     khrow, vhrow);
        if (bh && c1 < hi) /* the next chunk's rows on their way while this one is computed */
            prefetch_chunk(k_cache, v_cache, table, bs, Hkv, kvh, D, c1 + 1,
                           c1 + KEY_CHUNK < hi ? c1 + KEY_CHUNK : hi);
#ifdef HAVE_BLOCK_PATH
        if (M >= 8) {
#ifdef LMX_ATTN_BH_BLOCK
            if (bhb) {
                chunk_block_bh(bb, M, G, D, qpos0 + tile->r0, c0, c1 - c0 + 1, window, scale, softcap, khrow, vhrow,
                               P, cr, acc, mx, ls);
                continue;
            }
#endif
            chunk_block(qbuf, M, G, D, qpos0 + tile->r0, c0, c1 - c0 + 1, window, softcap, krow,
                        vrow, kT, P, cr, acc, mx, ls);
            continue;
        }
#else
        (void)kT, (void)P, (void)cr;
#endif
        for (int i = 0; i < M; i += bh ? G : 1) { /* bh: the row's G heads together */
            const int pos = qpos0 + tile->r0 + i / G;
            const int jmax = pos < c1 ? pos : c1;
            int jmin = c0;
            if (window > 0 && pos - window + 1 > jmin) jmin = pos - window + 1;
            if (jmax < jmin) continue;
            const int cnt = jmax - jmin + 1;
            const int64_t qo = (int64_t)(row0 + tile->r0 + i / G) * q_tok_stride + (int64_t)(kvh * G + i % G) * D;
            if (bh) {
                row_chunk_bh((const uint16_t *)q + qo, G, D, scale, softcap, khrow + (jmin - c0),
                             vhrow + (jmin - c0), cnt, acc + (int64_t)i * D, mx + i, ls + i);
                continue;
            }
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
    store_tile(out, acc, ls, row0 + tile->r0, m, kvh, G, H, D, dtype);
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
    while (rows_per_tile > 4 && rows_per_tile * G % 4) rows_per_tile--; /* whole 4-query blocks */
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
        const size_t per = (size_t)M * D * 2 + (size_t)KEY_CHUNK * D * 3 + (size_t)M * (3 + KEY_CHUNK) +
                           BHB_FLOATS(M, D);
        float *buf = (float *)malloc(sizeof(float) * per);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        float *qbuf = buf, *acc = qbuf + (size_t)M * D, *kbuf = acc + (size_t)M * D;
        float *vbuf = kbuf + (size_t)KEY_CHUNK * D, *mx = vbuf + (size_t)KEY_CHUNK * D;
        float *ls = mx + M, *kT = ls + M, *P = kT + (size_t)KEY_CHUNK * D, *cr = P + (size_t)M * KEY_CHUNK;
        float *bhbuf = cr + M; /* attention_prefill_bh.h's packed tiles (none in other variants) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitems; it++) {
            if (!buf) continue;
            const Tile *tl = &tiles[it / Hkv];
            const int s = tl->seq;
            run_item(q, q_tok_stride, k_cache, v_cache, out, tables + (int64_t)s * table_stride,
                     row_start[s], num_new[s], ctx_len[s], tl, (int)(it % Hkv), H, Hkv, G, D, bs,
                     window, scale, softcap, dtype, qbuf, acc, kbuf, vbuf, mx, ls, kT, P, cr, bhbuf);
        }
        free(buf);
    }
    free(tiles);
    return failed ? -1 : 0;
}
