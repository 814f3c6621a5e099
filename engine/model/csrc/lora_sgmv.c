/* Multi-LoRA shrink + expand on the CPU for runs of tokens sharing an adapter slot (SGMV).
 *
 * For each run (start, end, slot) of a step's tokens: y[t] += (x[t] @ A[slot].T) @ B[slot]
 * for t in [start, end), with A pre-scaled ([S * R, K] per slot: S slices of R rows) and B
 * block-diagonal ([S * R, N] per slot: slice s's B.T in rows s*R.. and its own columns).
 * Only the first rank[slot] rows of each slice are read: an adapter of rank 8 in rank-32
 * slots costs rank 8. One call covers every run of a projection group, so a decode step of
 * many adapters costs one call per group instead of two GEMMs per adapter.
 *
 * Shrink: per token, S * rank dot products of length K (fp32 accumulation) into v, up to three
 * tokens of a run at a time (each load of A feeds them all; the sums are those of one token alone).
 * Expand: per column tile, each token's tile accumulates sum_j v[t, j] * B[j, tile] in fp32 over
 * the slices whose columns (slice_off) meet the tile and is added to y once (a bf16 y rounds once,
 * as a torch add of an fp32 delta does). Threads split the shrink by (tokens, slice) and the expand by
 * (tokens, column tile). x, A, B and y may each be fp32 (0) or bf16 (1).
 * The caller (ops.cpp) has checked every shape, stride, dtype, run and rank.
 * The shrink's dot products of x with A rows are sgmv_shrink.h's.
 * In the ISA variant built with AVX512_BF16 (sgmv_bf16.h), bf16 x and bf16 A / B take the
 * native bf16 dot products instead (VDPBF16PS, fp32 sums; v rounded to bf16 before the expand).
 * Returns 0, or -1 when the work buffer cannot be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "sgmv_shrink.h"
#include "sgmv_bf16.h"

#define TILE 64 /* output columns per expand work item */
#define SHRINK_TOKENS 3 /* tokens of a run per shrink work item (dot4x3) */
#define PF_TILES 3 /* the expand asks for the B tile this many (run, tile) pairs ahead */
/* Tokens of a run per expand work item: the item sweeps every column tile for them, so their
 * rows of y are walked in order (a tile-major sweep of a long run's rows, a row's size apart,
 * missed the cache at every row: half the kernel's time at 384 tokens) while the B tile stays
 * in L1 for the block's tokens. A multiple of both paths' token groups (3 and 4). */
#define EXPAND_BLOCK 12
/* A call is split over threads from this much work (tokens x S*R x (K+N)): every decode call of
 * the default model (one token's o projection is 2^15.2). The shrink's items are (3 tokens, one
 * slice), the expand's (12 tokens, one column tile), so even one token's call splits. A decode
 * call is a cold read of its adapters' weights, latency-bound on one core's outstanding misses:
 * two cores read them ~1.5-2x faster (4 tokens of 4 adapters, qkv of the default model, 20-28
 * against 37-40 us a call, bf16, 2-core AVX512-BF16 EPYC, 2026-12-08). Splitting used to lose in
 * the live server (bench/results/sgmv_parallel_ab_avx2_s53.json, lora_serving_threads.json: 3/4
 * of the kernel's time in libgomp's fork/barrier waits), but those servers ran a second OpenMP pool
 * beside the engine's, which throttles every team's wake-ups (docs/architecture.md); with one pool,
 * 4-adapter serving at 1.5 req/s (bench/results/s59ab_*.json, three alternated pairs) had TPOT p50
 * 44 (33.7-51.9) against 53 (45-60.5) ms unsplit. */
#define PARALLEL_MIN_MACS ((int64_t)1 << 15)

/* ask the memory for elements i .. i+n of an fp32 or bf16 array ahead of use: a hint only
 * (results do not change). Adapter weights come from DRAM at every layer (the base's weights
 * evict them) in short strided streams the hardware prefetchers pick up late. */
static inline void prefetch_span(const void *base, int dtype, int64_t i, int64_t n) {
#ifdef VEC
    int es = dtype ? 2 : 4;
    const char *p = (const char *)base + i * es;
    for (int64_t o = 0; o < n * es; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
#else
    (void)base, (void)dtype, (void)i, (void)n;
#endif
}

/* acc[0 .. c1-c0) = sum over slices s and j < rank of vi[s*R + j] * B[s*R + j, c0..c1);
 * slices whose columns [off[s], off[s+1]) miss the tile are skipped (their B rows are zero there) */
static void expand_tile(const float *vi, const void *b, int bd, int64_t b0, int S, int R, int rank,
                        int N, int c0, int c1, const int64_t *off, float *acc) {
#ifdef VEC
    if (c1 - c0 == TILE) { /* a full tile: 8 accumulators in registers */
        __m256 r[TILE / VEC];
#pragma GCC unroll 8
        for (int k = 0; k < TILE / VEC; k++) r[k] = _mm256_setzero_ps();
        for (int s = 0; s < S; s++) {
            if (off[s + 1] <= c0 || off[s] >= c1) continue;
            for (int j = 0; j < rank; j++) {
                __m256 vv = _mm256_set1_ps(vi[s * R + j]);
                int64_t bo = b0 + (int64_t)(s * R + j) * N + c0;
#pragma GCC unroll 8
                for (int k = 0; k < TILE / VEC; k++) r[k] = _mm256_fmadd_ps(vv, vload8(b, bd, bo + k * VEC), r[k]);
            }
        }
#pragma GCC unroll 8
        for (int k = 0; k < TILE / VEC; k++) _mm256_storeu_ps(acc + k * VEC, r[k]);
        return;
    }
#endif
    for (int c = 0; c < c1 - c0; c++) acc[c] = 0.0f;
    for (int s = 0; s < S; s++) {
        if (off[s + 1] <= c0 || off[s] >= c1) continue;
        for (int j = 0; j < rank; j++) {
            float vj = vi[s * R + j];
            int64_t bo = b0 + (int64_t)(s * R + j) * N;
            for (int c = c0; c < c1; c++) acc[c - c0] += vj * load_elem(b, bd, bo + c);
        }
    }
}

/* slice s of the v rows of tokens t .. t + n - 1 (n <= 3) of a run on `slot`: rank dot products
 * each (rows beyond the rank are zero) */
static void shrink_tokens(const void *x, int xd, int64_t x_stride, int64_t t, int n, int pf, const void *a,
                          int ad, int64_t slot, const int64_t *ranks, int s, int S, int R, int K, float *vi) {
    int rank = (int)ranks[slot];
    int SR = S * R;
    int64_t xo[3] = {t * x_stride, (t + 1) * x_stride, (t + 2) * x_stride};
    int64_t ao = slot * (int64_t)SR * K + (int64_t)(s * R) * K;
    float *vq[3] = {vi + s * R, vi + SR + s * R, vi + 2 * SR + s * R};
    int j = 0;
    if (pf) /* the run's first tokens: its A comes from DRAM, this slice's rows as one span */
        prefetch_span(a, ad, ao, (int64_t)rank * K);
    if (n == 3) {
        for (; j + 4 <= rank; j += 4) {
            float *o[3] = {vq[0] + j, vq[1] + j, vq[2] + j};
            dot4x3(x, xd, xo, a, ad, ao + (int64_t)j * K, K, o);
        }
    } else if (n == 2) {
        for (; j + 4 <= rank; j += 4) dot4x2(x, xd, xo[0], xo[1], a, ad, ao + (int64_t)j * K, K, vq[0] + j, vq[1] + j);
    } else {
        for (; j + 4 <= rank; j += 4) dot4(x, xd, xo[0], a, ad, ao + (int64_t)j * K, K, vq[0] + j);
    }
    for (; j < rank; j++)
        for (int q = 0; q < n; q++) vq[q][j] = dot(x, xd, xo[q], a, ad, ao + (int64_t)j * K, K);
    for (int q = 0; q < n; q++)
        for (int z = j; z < R; z++) vq[q][z] = 0.0f;
}

/* y[row, c0..c1) += acc (a bf16 y rounds once, as a torch add of an fp32 delta) */
static void add_tile(void *y, int yd, int64_t y0, int c0, int c1, const float *acc) {
    int c = c0;
#ifdef VEC
    if (yd == 0) {
        float *yr = (float *)y + y0;
        for (; c + VEC <= c1; c += VEC)
            _mm256_storeu_ps(yr + c, _mm256_add_ps(_mm256_loadu_ps(yr + c), _mm256_loadu_ps(acc + c - c0)));
    } else { /* 8 lanes at a time, rounded as f32_to_bf16 below */
        for (; c + VEC <= c1; c += VEC) {
            __m256 sum = _mm256_add_ps(vload8(y, 1, y0 + c), _mm256_loadu_ps(acc + c - c0));
            vstore(y, 1, y0 + c, vround_bf16(sum));
        }
    }
#endif
    for (; c < c1; c++) {
        if (yd == 0) {
            ((float *)y)[y0 + c] += acc[c - c0];
        } else {
            uint16_t *yp = (uint16_t *)y + y0 + c;
            *yp = f32_to_bf16(bf16_to_f32(*yp) + acc[c - c0]);
        }
    }
}

#ifdef VEC
/* expand_tile for two tokens over a full tile, in halves of 32 columns: 2 x 4 accumulators,
 * each load of B feeding two FMAs */
static void expand_tile2(const float *va, const float *vb, const void *b, int bd, int64_t b0, int S,
                         int R, int rank, int N, int c0, const int64_t *off, float *acc_a, float *acc_b) {
    for (int half = 0; half < TILE; half += TILE / 2) {
        __m256 ra[4], rb[4];
        for (int k = 0; k < 4; k++) ra[k] = rb[k] = _mm256_setzero_ps();
        int h0 = c0 + half;
        for (int s = 0; s < S; s++) {
            if (off[s + 1] <= h0 || off[s] >= h0 + TILE / 2) continue;
            for (int j = 0; j < rank; j++) {
                __m256 xa = _mm256_set1_ps(va[s * R + j]), xb = _mm256_set1_ps(vb[s * R + j]);
                int64_t bo = b0 + (int64_t)(s * R + j) * N + h0;
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m256 bk = vload8(b, bd, bo + k * VEC);
                    ra[k] = _mm256_fmadd_ps(xa, bk, ra[k]);
                    rb[k] = _mm256_fmadd_ps(xb, bk, rb[k]);
                }
            }
        }
        for (int k = 0; k < 4; k++) {
            _mm256_storeu_ps(acc_a + half + k * VEC, ra[k]);
            _mm256_storeu_ps(acc_b + half + k * VEC, rb[k]);
        }
    }
}
#endif

#ifdef VEC
/* expand_tile for three tokens over a full tile, in halves of 32 columns: 3 x 4 accumulators
 * (twelve independent FMA chains: eight barely cover the FMA latency), each load of B feeding
 * three FMAs; each token's sums are those of expand_tile alone */
static void expand_tile3(const float *const *vt, const void *b, int bd, int64_t b0, int S, int R, int rank,
                         int N, int c0, const int64_t *off, float *const *acc) {
    for (int half = 0; half < TILE; half += TILE / 2) {
        __m256 r0[4], r1[4], r2[4];
        for (int k = 0; k < 4; k++) r0[k] = r1[k] = r2[k] = _mm256_setzero_ps();
        int h0 = c0 + half;
        for (int s = 0; s < S; s++) {
            if (off[s + 1] <= h0 || off[s] >= h0 + TILE / 2) continue;
            for (int j = 0; j < rank; j++) {
                __m256 x0 = _mm256_set1_ps(vt[0][s * R + j]), x1 = _mm256_set1_ps(vt[1][s * R + j]);
                __m256 x2 = _mm256_set1_ps(vt[2][s * R + j]);
                int64_t bo = b0 + (int64_t)(s * R + j) * N + h0;
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m256 bk = vload8(b, bd, bo + k * VEC);
                    r0[k] = _mm256_fmadd_ps(x0, bk, r0[k]);
                    r1[k] = _mm256_fmadd_ps(x1, bk, r1[k]);
                    r2[k] = _mm256_fmadd_ps(x2, bk, r2[k]);
                }
            }
        }
        for (int k = 0; k < 4; k++) {
            _mm256_storeu_ps(acc[0] + half + k * VEC, r0[k]);
            _mm256_storeu_ps(acc[1] + half + k * VEC, r1[k]);
            _mm256_storeu_ps(acc[2] + half + k * VEC, r2[k]);
        }
    }
}
#endif

/* Prefetch the B rows that expand work item ``item`` (run item / ntiles, column tile
 * item % ntiles; maybe the next run's slot) reads: its slot's rank rows of each slice the
 * tile overlaps. */
static inline void prefetch_item(const void *b, int w_dtype, const int64_t *runs, const int64_t *ranks,
                                 const int64_t *slice_off, int64_t item, int ntiles, int S, int R,
                                 int N) {
    int64_t pslot = runs[3 * (item / ntiles) + 2];
    int prank = (int)ranks[pslot];
    int p0 = (int)(item % ntiles) * TILE, p1 = p0 + TILE < N ? p0 + TILE : N;
    for (int sl = 0; sl < S; sl++) {
        if (slice_off[sl + 1] <= p0 || slice_off[sl] >= p1) continue;
        for (int j = 0; j < prank; j++)
            prefetch_span(b, w_dtype, pslot * ((int64_t)S * R * N) + (int64_t)(sl * R + j) * N + p0,
                          p1 - p0);
    }
}

/* the expand of a run's tokens t .. end on columns c0..c1 (fp32 v; v0 + t * SR: token t's row):
 * three, then two tokens at a time share each B load over a full tile, then one at a time */
static void expand_run(const float *v0, int64_t t, int64_t end, const void *b, int bd, int64_t b0, int S,
                       int R, int rank, int N, int c0, int c1, const int64_t *off, void *y, int yd,
                       int64_t y_stride) {
    const int SR = S * R;
    float acc[TILE];
#ifdef VEC
    float acc2[TILE], acc3[TILE];
    for (; t + 3 <= end && c1 - c0 == TILE; t += 3) {
        const float *vt[3] = {v0 + t * SR, v0 + (t + 1) * SR, v0 + (t + 2) * SR};
        float *at[3] = {acc, acc2, acc3};
        expand_tile3(vt, b, bd, b0, S, R, rank, N, c0, off, at);
        for (int q = 0; q < 3; q++) add_tile(y, yd, (t + q) * y_stride, c0, c1, at[q]);
    }
    for (; t + 2 <= end && c1 - c0 == TILE; t += 2) {
        expand_tile2(v0 + t * SR, v0 + (t + 1) * SR, b, bd, b0, S, R, rank, N, c0, off, acc, acc2);
        add_tile(y, yd, t * y_stride, c0, c1, acc);
        add_tile(y, yd, (t + 1) * y_stride, c0, c1, acc2);
    }
#endif
    for (; t < end; t++) {
        expand_tile(v0 + t * SR, b, bd, b0, S, R, rank, N, c0, c1, off, acc);
        add_tile(y, yd, t * y_stride, c0, c1, acc);
    }
}

#ifdef LMX_SGMV_BH
/* expand_run by the bf16 path (sgmv_bf16.h): vb0 + t * SRh is token t's row of bf16 pairs of v;
 * BH_TOKENS tokens at a time share each B load, masked loads and stores past c1 */
static void expand_run_bh(const uint32_t *vb0, int64_t SRh, int64_t t, int64_t end, const void *b, int64_t b0,
                          int S, int R, int rank, int N, int c0, int c1, const int64_t *off, void *y, int yd,
                          int64_t y_stride) {
    const uint16_t *bb = (const uint16_t *)b;
    for (; t < end; t += BH_TOKENS) {
        const uint32_t *vq[BH_TOKENS];
        int64_t rows[BH_TOKENS];
        const int n = end - t < BH_TOKENS ? (int)(end - t) : BH_TOKENS;
        for (int q = 0; q < n; q++) vq[q] = vb0 + (t + q) * SRh, rows[q] = (t + q) * y_stride;
        switch (n) { /* a constant n for each inlined copy: the accumulators stay in registers */
        case 4: expand_bh(vq, 4, bb, b0, S, R, rank, N, c0, c1, off, y, yd, rows); break;
        case 3: expand_bh(vq, 3, bb, b0, S, R, rank, N, c0, c1, off, y, yd, rows); break;
        case 2: expand_bh(vq, 2, bb, b0, S, R, rank, N, c0, c1, off, y, yd, rows); break;
        default: expand_bh(vq, 1, bb, b0, S, R, rank, N, c0, c1, off, y, yd, rows); break;
        }
    }
}

/* shrink_tokens by the bf16 path: n tokens from t of a run on `slot` into v and vb rows (the
 * run's first group asks for its A rows ahead: they come from DRAM) */
static void shrink_group_bh(const void *x, int64_t x_stride, int64_t t, int n, int first, const void *a,
                            int64_t slot, const int64_t *ranks, int s, int S, int R, int K, float *vi, uint32_t *vb) {
    if (first)
        prefetch_span(a, 1, (slot * S * R + s * R) * (int64_t)K, ranks[slot] * K);
    shrink_tokens_bh((const uint16_t *)x, x_stride, t, n, (const uint16_t *)a, slot, (int)ranks[slot], s, S, R, K,
                     vi, vb);
}
#define SGMV_BH(x_dtype, w_dtype) ((x_dtype) == 1 && (w_dtype) == 1)
#else /* no bf16 path in this variant: never called (SGMV_BH is 0) */
static void expand_run_bh(const uint32_t *vb0, int64_t SRh, int64_t t, int64_t end, const void *b, int64_t b0,
                          int S, int R, int rank, int N, int c0, int c1, const int64_t *off, void *y, int yd,
                          int64_t y_stride) {
    (void)vb0, (void)SRh, (void)t, (void)end, (void)b, (void)b0, (void)S, (void)R, (void)rank, (void)N;
    (void)c0, (void)c1, (void)off, (void)y, (void)yd, (void)y_stride;
}
static void shrink_group_bh(const void *x, int64_t x_stride, int64_t t, int n, int first, const void *a,
                            int64_t slot, const int64_t *ranks, int s, int S, int R, int K, float *vi, uint32_t *vb) {
    (void)x, (void)x_stride, (void)t, (void)n, (void)first, (void)a, (void)slot, (void)ranks, (void)s, (void)S;
    (void)R, (void)K, (void)vi, (void)vb;
}
#define SGMV_BH(x_dtype, w_dtype) 0
#endif

int LMX_FN(loramux_lora_sgmv)(const void *x, int64_t x_stride, int x_dtype, const void *a,
                              const void *b, int w_dtype, void *y, int64_t y_stride, int y_dtype,
                              const int64_t *runs, int nruns, const int64_t *ranks, int S, int R,
                              int K, int N, const int64_t *slice_off, int nthreads) {
    int64_t ntok = 0;
    for (int r = 0; r < nruns; r++) ntok += runs[3 * r + 1] - runs[3 * r];
    if (ntok == 0) return 0;
    int SR = S * R;
    /* bf16 x and slots in the avx512bf16 variant: the bf16 path, v's rows also as bf16 pairs */
    const int bh = SGMV_BH(x_dtype, w_dtype);
    const int64_t SRh = bh ? (int64_t)S * ((R + 1) / 2) : 0;
    /* v[row, s*R + i], then vb[row, s*Rh + p]: v[row, s*R + 2p .. 2p+1] as two bf16 */
    float *v = (float *)malloc((size_t)ntok * (SR + SRh) * sizeof(float));
    uint32_t *vb = (uint32_t *)(v + ntok * SR);
    /* row_of_run[r]: the run's first row of v; pair_of_run[r]: its first group of SHRINK_TOKENS;
     * block_of_run[r]: its first expand block of EXPAND_BLOCK tokens */
    int64_t *row_of_run = (int64_t *)malloc((size_t)nruns * 3 * sizeof(int64_t));
    if (v == NULL || row_of_run == NULL) {
        free(v);
        free(row_of_run);
        return -1;
    }
    int64_t *pair_of_run = row_of_run + nruns, *block_of_run = pair_of_run + nruns;
    int64_t row = 0, npairs = 0, nblocks = 0;
    for (int r = 0; r < nruns; r++) {
        int64_t len = runs[3 * r + 1] - runs[3 * r];
        row_of_run[r] = row, pair_of_run[r] = npairs, block_of_run[r] = nblocks;
        row += len, npairs += (len + SHRINK_TOKENS - 1) / SHRINK_TOKENS;
        nblocks += (len + EXPAND_BLOCK - 1) / EXPAND_BLOCK;
    }
    int64_t w_slot_b = (int64_t)SR * N;
    int big = ntok * (int64_t)SR * (K + N) >= PARALLEL_MIN_MACS;

#pragma omp parallel num_threads(nthreads) if (big)
    {
        /* each thread's static chunk of items is ascending: its run index only moves forward
         * (one pass over the runs per loop, not one per item) */
        int r = 0;
        /* shrink: one slice of SHRINK_TOKENS tokens of one run per item (a run's last ones fewer) */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < npairs * S; item++) {
            const int64_t p = item / S;
            const int s = (int)(item % S);
            while (r + 1 < nruns && pair_of_run[r + 1] <= p) r++;
            int64_t k = SHRINK_TOKENS * (p - pair_of_run[r]); /* the group's first token in the run */
            int64_t t = runs[3 * r] + k;
            int64_t left = runs[3 * r + 1] - t;
            int n = left < SHRINK_TOKENS ? (int)left : SHRINK_TOKENS;
            int64_t row0 = row_of_run[r] + k;
            if (bh)
                shrink_group_bh(x, x_stride, t, n, k == 0, a, runs[3 * r + 2], ranks, s, S, R, K, v + row0 * SR,
                                vb + row0 * SRh);
            else
                shrink_tokens(x, x_dtype, x_stride, t, n, k == 0, a, w_dtype, runs[3 * r + 2], ranks, s, S, R, K,
                              v + row0 * SR);
        }
        /* expand: one column tile of EXPAND_BLOCK tokens of one run per item, a block's tiles in
         * order; rows of B beyond the rank are skipped */
        int ntiles = (N + TILE - 1) / TILE;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nblocks * ntiles; item++) {
            const int64_t blk = item / ntiles;
            const int tile = (int)(item % ntiles);
            if (block_of_run[r] > blk) r = 0; /* a chunk behind the shrink's last run */
            while (r + 1 < nruns && block_of_run[r + 1] <= blk) r++;
            int64_t slot = runs[3 * r + 2];
            int rank = (int)ranks[slot];
            int64_t t = runs[3 * r] + EXPAND_BLOCK * (blk - block_of_run[r]);
            int64_t end = t + EXPAND_BLOCK < runs[3 * r + 1] ? t + EXPAND_BLOCK : runs[3 * r + 1];
            int64_t first = row_of_run[r] + (t - runs[3 * r]); /* token t's row of v */
            int c0 = tile * TILE, c1 = c0 + TILE < N ? c0 + TILE : N;
            int64_t ahead = (int64_t)r * ntiles + tile + PF_TILES; /* the item PF_TILES on */
            if (ahead < (int64_t)nruns * ntiles)
                prefetch_item(b, w_dtype, runs, ranks, slice_off, ahead, ntiles, S, R, N);
            if (bh) /* vb + (first - t) * SRh + t * SRh: token t's row */
                expand_run_bh(vb + (first - t) * SRh, SRh, t, end, b, slot * w_slot_b, S, R, rank, N, c0, c1,
                              slice_off, y, y_dtype, y_stride);
            else /* v0 + t * SR: token t's row */
                expand_run(v + (first - t) * SR, t, end, b, w_dtype, slot * w_slot_b, S, R, rank, N, c0, c1,
                           slice_off, y, y_dtype, y_stride);
        }
    }
    free(v);
    free(row_of_run);
    return 0;
}
