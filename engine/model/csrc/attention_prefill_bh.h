/* The avx512bf16 variant's prompt tiles over a bf16 KV cache (paged_attention.c, tiles of
 * M >= 8 query vectors: prompt chunks, fresh or over a cached prefix): attention_prefill.h's
 * two GEMMs with VDPBF16PS on bf16 operands instead of fp32 FMAs on widened copies.
 *
 * - Scores: the chunk's keys packed once per tile as dimension pairs (kP[dp][j] = k_j[2dp] |
 *   k_j[2dp+1] << 16, zeros past the chunk), 4 queries x 64 keys per pass, each query's pair
 *   broadcast; q . k exact bf16 products summed in fp32, then scaled (q is not pre-scaled).
 * - Softmax: attention_prefill.h's masked online softmax on the fp32 scores; p rounded to
 *   bf16 as torch's bf16 attention rounds it before p . v (the decode path's bh_round_p).
 * - p . v: value rows interleaved in pairs once per tile (the decode path's unpack order,
 *   undone when the sums are added), 8 queries x 32 dims per pass, each query's p pair
 *   broadcast. Included by paged_attention.c only. */
#ifndef LORAMUX_ATTENTION_PREFILL_BH_H
#define LORAMUX_ATTENTION_PREFILL_BH_H
#include "attention_bh.h"
#include "attention_prefill.h"

#if defined(LMX_ATTN_BH) && defined(HAVE_BLOCK_PATH)
#define LMX_ATTN_BH_BLOCK 1
#define BHB_DP(D) (((D) + 31) / 32 * 32) /* head dims padded to whole 32-lane blocks */
/* floats of a thread's buffer for the packed keys, values, queries and p of one tile */
#define BHB_FLOATS(M, D)                                                                      \
    ((size_t)KEY_CHUNK * (((D) + 1) / 2) + (size_t)KEY_CHUNK * BHB_DP(D) / 2 +              \
     (size_t)(M) * BHB_DP(D) / 2 + (size_t)(M) * BH_P_STRIDE / 2 + 64)

typedef struct {
    uint32_t *kP;  /* [(D + 1) / 2][KEY_CHUNK] key dimension pairs */
    uint16_t *vP;  /* [D / 32 blocks][KEY_CHUNK / 2 pairs][64] interleaved value pairs */
    uint16_t *qh;  /* [M][BHB_DP(D)] the tile's bf16 queries, zero padded */
    uint16_t *pP;  /* [M][BH_P_STRIDE] bf16 p */
} BhbBuffers;

static inline BhbBuffers bhb_buffers(float *buf, int M, int D) {
    BhbBuffers b;
    b.kP = (uint32_t *)buf;
    b.vP = (uint16_t *)(b.kP + (size_t)KEY_CHUNK * ((D + 1) / 2));
    b.qh = b.vP + (size_t)KEY_CHUNK * BHB_DP(D);
    b.pP = b.qh + (size_t)M * BHB_DP(D);
    return b;
}

static inline uint32_t bhb_pair(const uint16_t *p) { /* p[0] | p[1] << 16 */
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

/* qh[i * G + g] = query row row0 + i, head kvh * G + g (bf16, unscaled), for the tile's m rows */
static inline void bhb_load_queries(const uint16_t *q, int64_t q_tok_stride, int row0, int m, int kvh, int G,
                                    int D, uint16_t *qh) {
    const int Dp = BHB_DP(D);
    for (int i = 0; i < m; i++)
        for (int g = 0; g < G; g++) {
            uint16_t *dst = qh + (int64_t)(i * G + g) * Dp;
            memcpy(dst, q + (int64_t)(row0 + i) * q_tok_stride + (int64_t)(kvh * G + g) * D, sizeof(uint16_t) * D);
            memset(dst + D, 0, sizeof(uint16_t) * (Dp - D));
        }
}

static inline void bhb_pack_keys(const uint16_t *const *k, int cnt, int D, uint32_t *kP) {
    const int D2 = (D + 1) / 2;
    for (int j = 0; j < KEY_CHUNK; j++) {
        if (j >= cnt) {
            for (int dp = 0; dp < D2; dp++) kP[dp * KEY_CHUNK + j] = 0; /* finite pads */
            continue;
        }
        for (int dp = 0; dp < D / 2; dp++) kP[dp * KEY_CHUNK + j] = bhb_pair(k[j] + 2 * dp);
        if (D & 1) kP[(D / 2) * KEY_CHUNK + j] = k[j][D - 1];
    }
}

/* P[i][j] = scale * (q_i . k_j) for the tile's M queries and the chunk's KEY_CHUNK (packed) keys */
static void bhb_scores(const uint16_t *qh, int M, int D, float scale, const uint32_t *kP, float *P) {
    const int D2 = (D + 1) / 2, Dp = BHB_DP(D);
    const __m512 sc = _mm512_set1_ps(scale);
    int i = 0;
    for (; i < M; i += 4) {
        const int nq = M - i < 4 ? M - i : 4;
        __m512 s[4][4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++)
            for (int b = 0; b < 4; b++) s[t][b] = _mm512_setzero_ps();
        for (int dp = 0; dp < D2; dp++) {
            const uint32_t *kr = kP + dp * KEY_CHUNK;
            __m512bh kb[4];
            for (int b = 0; b < 4; b++) kb[b] = (__m512bh)_mm512_loadu_si512(kr + 16 * b);
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                if (t >= nq) break;
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)bhb_pair(qh + (int64_t)(i + t) * Dp + 2 * dp));
                for (int b = 0; b < 4; b++) s[t][b] = _mm512_dpbf16_ps(s[t][b], qv, kb[b]);
            }
        }
        for (int t = 0; t < nq; t++)
            for (int b = 0; b < 4; b++)
                _mm512_storeu_ps(P + (int64_t)(i + t) * KEY_CHUNK + 16 * b, _mm512_mul_ps(s[t][b], sc));
    }
}

static inline void bhb_pack_values(const uint16_t *const *v, int cnt, int D, uint16_t *vP) {
    for (int d = 0; d < D; d += 32) {
        const __mmask32 m = bh_dmask(D - d);
        uint16_t *dst = vP + (int64_t)(d / 32) * (KEY_CHUNK / 2) * 64;
        for (int j = 0; j < cnt; j += 2) {
            const __m512i e = _mm512_maskz_loadu_epi16(m, v[j] + d);
            const __m512i o = j + 1 < cnt ? _mm512_maskz_loadu_epi16(m, v[j + 1] + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + (j / 2) * 64, _mm512_unpacklo_epi16(e, o));
            _mm512_storeu_si512(dst + (j / 2) * 64 + 32, _mm512_unpackhi_epi16(e, o));
        }
    }
}

/* acc[t][d] = acc[t][d] * cr[t] + sum_j p[t][j] v[j][d] for NQ queries (a constant at each call
 * site: the accumulators stay in registers) over npairs packed value pairs */
static inline __attribute__((always_inline)) void bhb_accumulate_q(float *acc, const float *cr, const uint16_t *pP,
                                                                   const int NQ, const uint16_t *vP, int npairs,
                                                                   int D) {
    for (int d = 0; d < D; d += 32) {
        const uint16_t *vb = vP + (int64_t)(d / 32) * (KEY_CHUNK / 2) * 64;
        __m512 lo[8], hi[8];
#pragma GCC unroll 8
        for (int t = 0; t < NQ; t++) lo[t] = hi[t] = _mm512_setzero_ps();
        for (int jp = 0; jp < npairs; jp++) {
            const __m512bh ul = (__m512bh)_mm512_loadu_si512(vb + jp * 64);
            const __m512bh uh = (__m512bh)_mm512_loadu_si512(vb + jp * 64 + 32);
#pragma GCC unroll 8
            for (int t = 0; t < NQ; t++) {
                const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)bhb_pair(pP + t * BH_P_STRIDE + 2 * jp));
                lo[t] = _mm512_dpbf16_ps(lo[t], pv, ul);
                hi[t] = _mm512_dpbf16_ps(hi[t], pv, uh);
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < NQ; t++) bh_add_pair_sums(acc + (int64_t)t * D + d, lo[t], hi[t], cr[t], bh_dmask(D - d));
    }
}

static void bhb_accumulate(float *acc, const float *cr, const uint16_t *pP, int M, const uint16_t *vP, int npairs,
                           int D) {
    int i = 0;
    for (; i + 8 <= M; i += 8)
        bhb_accumulate_q(acc + (int64_t)i * D, cr + i, pP + (int64_t)i * BH_P_STRIDE, 8, vP, npairs, D);
    for (; i < M; i++)
        bhb_accumulate_q(acc + (int64_t)i * D, cr + i, pP + (int64_t)i * BH_P_STRIDE, 1, vP, npairs, D);
}

/* One chunk of cnt keys (k / v: the bf16 rows where they lie) for the tile's M query vectors
 * (b.qh, loaded by bhb_load_queries): scores, the masked online softmax (mx, ls, cr), p . v
 * into acc. qpos: position of the tile's first row; c0: the chunk's first key position. */
static void chunk_block_bh(BhbBuffers b, int M, int G, int D, int qpos, int c0, int cnt, int window, float scale,
                           float softcap, const uint16_t *const *k, const uint16_t *const *v, float *P, float *cr,
                           float *acc, float *mx, float *ls) {
    bhb_pack_keys(k, cnt, D, b.kP);
    bhb_scores(b.qh, M, D, scale, b.kP, P);
    const int width = (cnt + KEY_SUB - 1) / KEY_SUB * KEY_SUB;
    if (softcap > 0.0f)
        for (int i = 0; i < M; i++) softcap_scores(P + (int64_t)i * KEY_CHUNK, width, softcap);
    tile_softmax(M, G, qpos, c0, cnt, window, P, cr, mx, ls);
    for (int i = 0; i < M; i++) bh_round_p(P + (int64_t)i * KEY_CHUNK, cnt, b.pP + (int64_t)i * BH_P_STRIDE);
    bhb_pack_values(v, cnt, D, b.vP);
    bhb_accumulate(acc, cr, b.pP, M, b.vP, (cnt + 1) / 2, D);
}
#else
#define BHB_FLOATS(M, D) 0
#endif
#endif
