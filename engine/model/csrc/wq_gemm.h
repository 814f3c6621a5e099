/* wq_linear.c's large-M path (included by it only, after its widen / vector macros): from
 * GEMM_MIN_M rows of x a tile of NT rows of W is dequantized once into a per-thread fp32 buffer
 * and a register-blocked GEMM runs over it (x transposed once per call into panels). */
#ifndef LORAMUX_WQ_GEMM_H
#define LORAMUX_WQ_GEMM_H

#ifdef WL
/* from this many rows of x: dequantize a tile once, then a GEMM over it. AVX2: 12 (the
 * default model's 4 projections of a layer, 2 threads, Zen 3, medians of 7 alternated passes,
 * tiles vs GEMM: int4 g64 at 8 rows 1.22 / 1.32 ms, 12: 1.60 / 1.30, 16: 1.71 / 1.19; int8 at 8
 * 0.73 / 1.01, 12: 1.33 / 1.33, 16: 1.76 / 1.38) */
#if WL == 16
#define GEMM_MIN_M 32
#else
#define GEMM_MIN_M 12
#endif
#define GR (WL / 2)   /* weight rows per GEMM register tile (by 2 vectors of WL rows of x) */

static inline void store_y(void *y, int yd, int64_t i, float v) {
    if (yd == 0) ((float *)y)[i] = v;
    else ((uint16_t *)y)[i] = f32_to_bf16(v);
}

/* y[m0 .. m0+2WL, n .. n+nr] from xt's panel of rows m0.. (xt + m0 * Kp: [Kp, 2WL], x
 * transposed, zero padded) and wr [nr, Kp] */
static inline __attribute__((always_inline)) void gemm_block(const float *xt, int64_t M, int64_t Kp,
                                                             const float *wr, int64_t m0, const int nr,
                                                             const float *bias, void *y, int yd, int N,
                                                             int n) {
    const float *panel = xt + m0 * Kp;
    vf acc[GR][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = VZERO();
    for (int64_t k = 0; k < Kp; k++) {
        vf x0 = VLOAD(panel + k * 2 * WL), x1 = VLOAD(panel + k * 2 * WL + WL);
        for (int r = 0; r < nr; r++) {
            vf wk = VSET(wr[r * Kp + k]);
            acc[r][0] = VFMA(x0, wk, acc[r][0]);
            acc[r][1] = VFMA(x1, wk, acc[r][1]);
        }
    }
    float lanes[2 * WL];
    for (int r = 0; r < nr; r++) {
        VSTORE(lanes, acc[r][0]);
        VSTORE(lanes + WL, acc[r][1]);
        for (int l = 0; l < 2 * WL && m0 + l < M; l++)
            store_y(y, yd, (m0 + l) * N + n + r, lanes[l] + (bias ? bias[n + r] : 0.0f));
    }
}

/* one work item of a large-M call: rows n0..n1 of W dequantized once into wr [NT, Kp] (L2),
 * (stored - zero) * scale in fp32, then every row of x multiplied against them */
static void rows_tile_gemm(const float *xt, int64_t Mp, int64_t M, int64_t Kp, const uint8_t *w,
                           int bits, const float *scale, const float *zero, int G, int group,
                           const float *bias, void *y, int yd, int N, int n0, int n1, float *wr) {
    const int64_t row_bytes = Kp * LMX_WQ_WIDTH(bits) / 8;
    for (int n = n0; n < n1; n++)
        for (int g = 0; g < G; g++) {
            const int64_t at = (int64_t)n * G + g;
            const vf s = VSET(scale[at]), z = VSET(zero ? zero[at] : (bits == 4 ? 8.0f : 0.0f));
            for (int64_t k = (int64_t)g * group; k < (int64_t)(g + 1) * group; k += 32) {
                vf wv[NV];
                widen(w + n * row_bytes + k / 32 * LMX_WQ_WIDTH(bits) * 4, bits, wv);
                for (int i = 0; i < NV; i++) VSTORE(wr + (n - n0) * Kp + k + XOFF[i], VDEQ(wv[i], z, s));
            }
        }
    for (int64_t m0 = 0; m0 < Mp; m0 += 2 * WL) {
        int n = n0;
        for (; n + GR <= n1; n += GR) gemm_block(xt, M, Kp, wr + (n - n0) * Kp, m0, GR, bias, y, yd, N, n);
        for (; n < n1; n++) gemm_block(xt, M, Kp, wr + (n - n0) * Kp, m0, 1, bias, y, yd, N, n);
    }
}

/* a large-M call: x transposed once into panels of 2 WL rows, each [Kp, 2 WL] (Mp = M rounded up
 * to 2 WL, zero padded): a panel's k-th vectors are adjacent, so a block streams its panel in
 * order (a transposed [Kp, Mp] put each k of a block on its own cache line, Mp floats apart: on
 * an AVX2 Zen 3 the register tile ran at ~40 % of its FMA rate), each thread dequantizing its
 * tiles into its own wr buffer */
static int gemm_call(const float *xp, int64_t M, int64_t Kp, const uint8_t *w, int bits,
                     const float *scale, const float *zero, int G, int group, const float *bias,
                     void *y, int yd, int N, int K, int tiles, int nthreads) {
    const int64_t Mp = (M + 2 * WL - 1) / (2 * WL) * (2 * WL);
    float *xt = (float *)calloc((size_t)(Kp * Mp), sizeof(float));
    if (xt == NULL) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < Kp; k++) xt[m / (2 * WL) * (2 * WL) * Kp + k * 2 * WL + m % (2 * WL)] = xp[m * Kp + k];
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (M * N * (int64_t)K >= PARALLEL_MIN_MACS)
    {
        float *wr = (float *)malloc((size_t)(NT * Kp) * sizeof(float));
        if (wr == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            int n0 = t * NT, n1 = n0 + NT < N ? n0 + NT : N;
            if (wr != NULL)
                rows_tile_gemm(xt, Mp, M, Kp, w, bits, scale, zero, G, group, bias, y, yd, N, n0, n1, wr);
        }
        free(wr);
    }
    free(xt);
    return failed ? -1 : 0;
}
#endif

#endif
