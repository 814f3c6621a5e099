/* wq_linear.c's native-bf16 path, compiled only into the ISA variant built with -mavx512bf16
 * (isa.cpp runs it only where the CPU has AVX512_BF16): bf16 activations, fewer than
 * GEMM_MIN_M rows of them (a decode step; from DENSE_MIN_M rows quant_ops.cpp hands dequantized
 * bands to oneDNN instead), the weights in the kernel's unchanged layout: tile_bh works on the
 * stored values in registers.
 *
 * Each stored value becomes a bf16 exactly, then VDPBF16PS (_mm512_dpbf16_ps) multiplies pairs
 * of them by pairs of x (bf16 x bf16 products are exact in fp32) into fp32 accumulators:
 *   int4  u | 0x4300 is the bf16 128 + u (exponent of 128, u in the 7 mantissa bits), so the
 *         sum is over x * (128 + u); the 128 is folded into the zero-point correction
 *         scale * (zero + 128) * sum(x). 32 bytes (two blocks) widened to 32 u16 lanes give the
 *         low nibbles of both blocks (k 0..15 of each) and the high nibbles (k 16..31 of each):
 *         x is repacked once per call into that order (each 64 values of a group as
 *         x[0..15], x[32..47], x[16..31], x[48..63]; a group's lone last block, when its length
 *         is an odd number of blocks, stays in k order: its nibbles are put back in order).
 *   int8  int8 -> int32 -> fp32 -> bf16 (_mm512_cvtne2ps_pbh): exact for |q| <= 256, k order;
 *   fp8   bits moved to bf16's (fp8_block_bh), exact (4 significant bits, exponents within
 *         bf16's), k order.
 * The sums are fp32 as on the fp32-FMA path, in another order (and int4's through the offset
 * of 128): close to it, not bit-identical. Included by wq_linear.c only. */
#ifndef LORAMUX_WQ_BF16_H
#define LORAMUX_WQ_BF16_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

#define LMX_WQ_BH 1
#define NR_BH 4 /* weight rows per decode register tile at 1-2 rows of x (2 at 3-4 rows): four
                   independent accumulator chains hide VDPBF16PS's latency at batch 1 */

/* x rows (bf16, row stride x_stride) -> xr [M, Kp] bf16, zero padded, in the order of the
 * weight vectors of `bits` (above) */
static void repack_x_bh(const uint16_t *x, int64_t x_stride, int64_t M, int K, int64_t Kp, int group,
                        int bits, uint16_t *xr) {
    for (int64_t m = 0; m < M; m++) {
        uint16_t *d = xr + m * Kp;
        memcpy(d, x + m * x_stride, (size_t)K * sizeof(uint16_t));
        memset(d + K, 0, (size_t)(Kp - K) * sizeof(uint16_t));
        if (bits != 4) continue;
        for (int64_t g0 = 0; g0 < Kp; g0 += group)
            for (int64_t k = g0; k + 64 <= g0 + group; k += 64)
                for (int i = 0; i < 16; i++) { /* swap x[k+16..31] and x[k+32..47] */
                    uint16_t t = d[k + 16 + i];
                    d[k + 16 + i] = d[k + 32 + i];
                    d[k + 32 + i] = t;
                }
    }
}

/* bf16 bits of m 2^-9, m = 0..7: the float8_e4m3fn subnormals (a permutexvar table) */
static const uint16_t FP8_SUBNORMAL_BF16[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};

/* 32 float8_e4m3fn bytes as 32 bf16 lanes, exactly (wq_linear.c's fp8_value; an fp8 value has 4
 * significant bits): the exponent and mantissa bits moved to bf16's, the exponent rebiased
 * (+120); subnormals from the table; 0x7f NaN; the sign */
static inline __m512bh fp8_block_bh(const uint8_t *p) {
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epi16_mask(mag, _mm512_set1_epi16(8)), mag,
                                      _mm512_loadu_si512((const void *)FP8_SUBNORMAL_BF16));
    v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)),
                              _mm512_set1_epi16(0x7fc0));
    return (__m512bh)_mm512_or_si512(v, _mm512_and_si512(b, _mm512_set1_epi16((short)0x8000)));
}

/* one block of 32 stored values (at p) as 32 bf16 lanes in k order */
static inline __m512bh block_bh(const uint8_t *p, int bits) {
    if (bits == LMX_WQ_FP8) return fp8_block_bh(p);
    if (bits == 8) {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        return _mm512_cvtne2ps_pbh(hi, lo);
    }
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i o = _mm256_set1_epi16(0x4300);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16(15)), o);
    const __m256i hi = _mm256_or_si256(_mm256_srli_epi16(b, 4), o);
    return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* tile (wq_linear.c) for bf16 x: y rows m0..m0+mr of output rows n0..n0+nr, before the bias */
static inline __attribute__((always_inline)) void tile_bh(const uint16_t *xr, int64_t Kp, const float *xs,
                                                          const uint8_t *w, int64_t row_bytes, int bits,
                                                          const float *scale, const float *zero, int G,
                                                          int group, int n0, const int nr, const int mr,
                                                          float out[MR][NR_BH]) {
    const float off = bits == 4 ? 128.0f : 0.0f; /* the value the stored one stands for, less */
    const __m512i m15 = _mm512_set1_epi16(15), o4 = _mm512_set1_epi16(0x4300);
    __m512 tot[MR][NR_BH];
    float corr[MR][NR_BH] = {{0}};
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) tot[m][r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512 acc[MR][NR_BH];
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++) acc[m][r] = _mm512_setzero_ps();
        int64_t k = (int64_t)g * group;
        const int64_t ge = k + group;
        if (bits == 4)
            for (; k + 64 <= ge; k += 64) { /* two blocks: low nibbles, then high nibbles */
                __m512bh lo[NR_BH], hi[NR_BH];
                for (int r = 0; r < nr; r++) {
                    const uint8_t *p = w + (int64_t)(n0 + r) * row_bytes + k / 2;
                    PREFETCH_ROWS_AHEAD(p, nr, row_bytes);
                    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
                    lo[r] = (__m512bh)_mm512_or_si512(_mm512_and_si512(b, m15), o4);
                    hi[r] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), o4);
                }
                for (int m = 0; m < mr; m++) {
                    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xr + m * Kp + k);
                    const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xr + m * Kp + k + 32);
                    for (int r = 0; r < nr; r++)
                        acc[m][r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[m][r], x0, lo[r]), x1, hi[r]);
                }
            }
        for (; k < ge; k += 32) { /* int8, or int4's lone last block: k order */
            __m512bh wv[NR_BH];
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = w + (int64_t)(n0 + r) * row_bytes + k / 32 * LMX_WQ_WIDTH(bits) * 4;
                PREFETCH_ROWS_AHEAD(p, nr, row_bytes);
                wv[r] = block_bh(p, bits);
            }
            for (int m = 0; m < mr; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + m * Kp + k);
                for (int r = 0; r < nr; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            const int64_t at = (int64_t)(n0 + r) * G + g;
            const float sc = scale[at], z = (zero ? zero[at] : (bits == 4 ? 8.0f : 0.0f)) + off;
            const __m512 vs = _mm512_set1_ps(sc);
            for (int m = 0; m < mr; m++) {
                tot[m][r] = _mm512_fmadd_ps(vs, acc[m][r], tot[m][r]);
                corr[m][r] += sc * z * xs[m * G + g];
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) out[m][r] = _mm512_reduce_add_ps(tot[m][r]) - corr[m][r];
}

/* rows_tile (wq_linear.c) on the bf16 tile: output rows n0..n1 for every row of x */
static void rows_tile_bh(const uint16_t *xr, const float *xs, int64_t M, int64_t Kp, const uint8_t *w,
                         int bits, const float *scale, const float *zero, int G, int group,
                         const float *bias, void *y, int yd, int N, int n0, int n1) {
    const int64_t row_bytes = Kp * LMX_WQ_WIDTH(bits) / 8;
    float out[MR][NR_BH];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = M - m0 < MR ? (int)(M - m0) : MR;
        const uint16_t *xm = xr + m0 * Kp;
        const float *xsm = xs + m0 * G;
        for (int n = n0, nr; n < n1; n += nr) {
            nr = n1 - n >= 4 && mr <= 2 ? 4 : n1 - n >= 2 ? 2 : 1;
#define LMX_TILE_BH(NR, MRC) tile_bh(xm, Kp, xsm, w, row_bytes, bits, scale, zero, G, group, n, NR, MRC, out)
            if (nr == 4) {
                if (mr == 2) LMX_TILE_BH(4, 2); else LMX_TILE_BH(4, 1);
            } else if (nr == 2) {
                if (mr == 4) LMX_TILE_BH(2, 4); else if (mr == 3) LMX_TILE_BH(2, 3);
                else if (mr == 2) LMX_TILE_BH(2, 2); else LMX_TILE_BH(2, 1);
            } else {
                if (mr == 4) LMX_TILE_BH(1, 4); else if (mr == 3) LMX_TILE_BH(1, 3);
                else if (mr == 2) LMX_TILE_BH(1, 2); else LMX_TILE_BH(1, 1);
            }
#undef LMX_TILE_BH
            for (int m = 0; m < mr; m++)
                for (int r = 0; r < nr; r++) {
                    float v = out[m][r] + (bias ? bias[n + r] : 0.0f);
                    int64_t i = (m0 + m) * N + n + r;
                    if (yd == 0) ((float *)y)[i] = v;
                    else ((uint16_t *)y)[i] = f32_to_bf16(v);
                }
        }
    }
}

#endif
#endif
