/* The SGMV kernel's native-bf16 paths (lora_sgmv.c), compiled only into the ISA variant built
 * with -mavx512bf16 (isa.cpp runs it only where the CPU has AVX512_BF16): when x and the
 * adapter weights are bf16, the shrink and the expand use VDPBF16PS (_mm512_dpbf16_ps), which
 * multiplies pairs of bf16 values exactly (a bf16 x bf16 product fits in fp32) and adds them
 * into fp32 lanes (denormals flushed, round to nearest even).
 *
 * Shrink: v[t, j] = x[t] . A[j] over pairs of K, 32 values of K per instruction, fp32
 * accumulation: the same exact products as the fp32-FMA path, summed in another order.
 * Expand: y[t, tile] += sum_j v[t, j] * B[j, tile], v rounded to bf16 first (as a torch bf16
 * `(x @ A.T) @ B` rounds its intermediate), pairs of rows (j, j + 1) of B interleaved in
 * registers (unpacklo/hi_epi16: the fp32 lanes come out in a permuted column order, put back
 * once per tile), BH_TOKENS tokens sharing each load of B, each token's sums added to y straight from
 * the registers (16 lanes a time). Neither is bit-identical to the fp32-FMA path; both keep fp32 sums.
 * Included by lora_sgmv.c only (static functions, one copy per variant). */
#ifndef LORAMUX_SGMV_BF16_H
#define LORAMUX_SGMV_BF16_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#define LMX_SGMV_BH 1

static inline __m512bh bh_load(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

static inline __mmask32 bh_mask(int64_t left) { /* the first min(left, 32) lanes */
    return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
}

/* o[q][i] = token q's x . A row i (q < n <= 3, i < nr <= 4; rows K apart from ar) */
static inline __attribute__((always_inline)) void dot_bh(const uint16_t *const *xr, const int n,
                                                         const uint16_t *ar, const int nr, int K,
                                                         float *const *o, int j) {
    __m512 c[3][4];
    for (int q = 0; q < n; q++)
        for (int i = 0; i < nr; i++) c[q][i] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        const __mmask32 m = bh_mask(K - k);
        __m512bh w[4];
        for (int i = 0; i < nr; i++) w[i] = bh_load(ar + (int64_t)i * K + k, m);
        for (int q = 0; q < n; q++) {
            const __m512bh xv = bh_load(xr[q] + k, m);
            for (int i = 0; i < nr; i++) c[q][i] = _mm512_dpbf16_ps(c[q][i], xv, w[i]);
        }
    }
    for (int q = 0; q < n; q++)
        for (int i = 0; i < nr; i++) o[q][j + i] = _mm512_reduce_add_ps(c[q][i]);
}

/* shrink_tokens (lora_sgmv.c) for bf16 x and A: slice s of the v rows of tokens t .. t + n - 1
 * (n <= 3); then each row's pairs (v[2p], v[2p + 1]) of the slice rounded to bf16 into vb (Rh =
 * (R + 1) / 2 pairs a slice) */
static void shrink_tokens_bh(const uint16_t *x, int64_t x_stride, int64_t t, int n, const uint16_t *a,
                             int64_t slot, int rank, int s, int S, int R, int K, float *vi, uint32_t *vb) {
    const int SR = S * R, Rh = (R + 1) / 2;
    const uint16_t *xr[3] = {x + t * x_stride, x, x};
    for (int q = 1; q < n; q++) xr[q] = x + (t + q) * x_stride;
    const uint16_t *as = a + slot * (int64_t)SR * K + (int64_t)(s * R) * K;
    float *vq[3] = {vi + s * R, vi + SR + s * R, vi + 2 * SR + s * R};
    int j = 0;
    for (; j + 4 <= rank; j += 4) {
        const uint16_t *ar = as + (int64_t)j * K;
        if (n == 3) dot_bh(xr, 3, ar, 4, K, vq, j);
        else if (n == 2) dot_bh(xr, 2, ar, 4, K, vq, j);
        else dot_bh(xr, 1, ar, 4, K, vq, j);
    }
    for (; j < rank; j++) /* the rank's last rows, one at a time */
        for (int q = 0; q < n; q++) dot_bh(xr + q, 1, as + (int64_t)j * K, 1, K, vq + q, j);
    for (int q = 0; q < n; q++) {
        for (int z = rank; z < R; z++) vq[q][z] = 0.0f;
        uint32_t *pq = vb + (int64_t)q * S * Rh + s * Rh;
        for (int p = 0; p < Rh; p++) {
            const uint32_t lo = f32_to_bf16(vq[q][2 * p]);
            const uint32_t hi = 2 * p + 1 < R ? f32_to_bf16(vq[q][2 * p + 1]) : 0u;
            pq[p] = lo | hi << 16;
        }
    }
}

/* y[row, c .. c + 16) (lanes of m only) += d: a bf16 y (yd 1) rounds once, as add_tile */
static inline void add16_bh(void *y, int yd, int64_t row, int c, __mmask16 m, __m512 d) {
    if (yd == 0) {
        float *yp = (float *)y + row + c;
        _mm512_mask_storeu_ps(yp, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, yp), d));
        return;
    }
    uint16_t *yp = (uint16_t *)y + row + c;
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, yp));
    const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), d);
    _mm256_mask_storeu_epi16(yp, m, _mm512_cvtepi32_epi16(round_bf16_16(sum)));
}

static inline __mmask16 lanes16(int left) { /* the first min(max(left, 0), 16) lanes */
    return left >= 16 ? (__mmask16)0xffffu : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

#define BH_TOKENS 4 /* tokens of a run per expand_bh call: each B load feeds 4 x this many VDPBF16PS
                     * (6 spilled the accumulators to the stack) */

/* y[row q, c0..c1) += sum over slices s and j < rank of vb's bf16 v[q][s*R + j] * B[s*R + j, c0..c1)
 * for n <= BH_TOKENS tokens (rows[q]: token q's offset in y) and a tile of up to 64 columns
 * (masked loads and stores past c1), each token's sums added to y once as add_tile does;
 * slices whose columns [off[s], off[s+1]) miss the tile are skipped; B rows past the rank are
 * never read (zero lanes stand in for the odd row of the last pair) */
static inline __attribute__((always_inline)) void expand_bh(const uint32_t *const *vq, const int n,
                                                            const uint16_t *b, int64_t b0, int S, int R,
                                                            int rank, int N, int c0, int c1,
                                                            const int64_t *off, void *y, int yd,
                                                            const int64_t *rows) {
    const int Rh = (R + 1) / 2;
    const __mmask32 m0 = bh_mask(c1 - c0), m1 = bh_mask(c1 - c0 - 32 > 0 ? c1 - c0 - 32 : 0);
    __m512 lo[BH_TOKENS][2], hi[BH_TOKENS][2];
#pragma GCC unroll 4
    for (int q = 0; q < n; q++)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) lo[q][h] = hi[q][h] = _mm512_setzero_ps();
    for (int s = 0; s < S; s++) {
        if (off[s + 1] <= c0 || off[s] >= c1) continue;
        for (int j = 0; j < rank; j += 2) {
            const uint16_t *r0 = b + b0 + (int64_t)(s * R + j) * N + c0;
            const int two = j + 1 < rank;
            __m512bh pl[2], ph[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __mmask32 m = h ? m1 : m0;
                const __m512i e = _mm512_maskz_loadu_epi16(m, r0 + 32 * h);
                const __m512i o = two ? _mm512_maskz_loadu_epi16(m, r0 + N + 32 * h) : _mm512_setzero_si512();
                pl[h] = (__m512bh)_mm512_unpacklo_epi16(e, o);
                ph[h] = (__m512bh)_mm512_unpackhi_epi16(e, o);
            }
#pragma GCC unroll 4
            for (int q = 0; q < n; q++) {
                const __m512bh vp = (__m512bh)_mm512_set1_epi32((int)vq[q][s * Rh + j / 2]);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    lo[q][h] = _mm512_dpbf16_ps(lo[q][h], vp, pl[h]);
                    hi[q][h] = _mm512_dpbf16_ps(hi[q][h], vp, ph[h]);
                }
            }
        }
    }
    /* lane 4L + i of lo holds column 8L + i, of hi column 8L + 4 + i (L: 128-bit lane) */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const int w = c1 - c0;
#pragma GCC unroll 4
    for (int q = 0; q < n; q++)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int c = c0 + 32 * h;
            add16_bh(y, yd, rows[q], c, lanes16(w - 32 * h), _mm512_permutex2var_ps(lo[q][h], first, hi[q][h]));
            add16_bh(y, yd, rows[q], c + 16, lanes16(w - 32 * h - 16),
                     _mm512_permutex2var_ps(lo[q][h], second, hi[q][h]));
        }
}

#endif
#endif
