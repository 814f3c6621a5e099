/* Weight-only int8 / int4 linear on the CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias).
 *
 * W is read in the kernel's own layout (repacked once at load, int_packed.py's
 * ``kernel_layout``): each row holds Kp = K rounded up to 32 values as blocks of 32,
 *   int8  32 signed bytes q[k] in k order;
 *   fp8   32 float8_e4m3fn bytes in k order (bits = LMX_WQ_FP8; widened exactly, zero 0);
 *   int4  16 bytes, byte j = u[j] | u[j + 16] << 4 (u = q + 8, unsigned), so one 16-byte load
 *         widened to 16 lanes gives k 0..15 (low nibbles) and k 16..31 (high nibbles).
 * The padding values of a row are multiplied by zero activations (the x buffer is padded).
 * scale and zero are fp32 [N, G], one per `group` values of a row (group a multiple of 32;
 * per channel: G = 1, group = Kp); zero is the offset of the stored value (int4: zp + 8,
 * int8: zp) or NULL (int4: 8, int8: 0). A weight is (stored - zero) * scale; no dequantized
 * weight exists outside registers. The vector variants widen each block of 32 stored values
 * to fp32 lanes and multiply them into MR x NR vector accumulators (MR rows of x, NR rows of
 * W; up to SPLITS independent partial sums each; one row of x on AVX2: tile_x1) per group,
 * then fold the group in as scale * (sum x * stored - zero * sum x) (the sums of x per group
 * computed once per call); the scalar variant dequantizes each weight. Every sum
 * is fp32. From GEMM_MIN_M rows of x (a prefill chunk) the vector variants instead dequantize
 * a tile of NT rows of W once into a per-thread fp32 buffer (NT x Kp, in L2) and run a
 * register-blocked GEMM over it (x transposed into panels of 2 vectors of rows, wq_gemm.h; 2
 * vectors of rows of x by GR rows of W), so the
 * widening is paid once per tile rather than once per 4 rows of x. x (fp32 or bf16) is first
 * copied to an fp32 [M, Kp] buffer; y (fp32 or bf16, rounded once) is contiguous [M, N]; bias
 * fp32 [N] or NULL.
 *
 * In the ISA variant built with AVX512_BF16, bf16 x below GEMM_MIN_M rows takes wq_bf16.h's
 * native bf16 dot products instead (the same weight layout; x repacked once per call). From a
 * variant's dense rows (quant_ops.cpp: 24 rows of bf16 x with a bf16 y where bf16 GEMMs are
 * native, 256 rows of any x in the avx2 and scalar variants) quant_ops.cpp does not call this
 * kernel: it dequantizes W a band of rows at a time (loramux_wq_dequantize, wq_dequant.h) and
 * hands each band to ATen's GEMM (bf16 bands to oneDNN, fp32 bands to MKL).
 *
 * Threads split the output rows in tiles of NT when the call has PARALLEL_MIN_MACS of work
 * (a decode call of 128 x 1024 weights and more: a decode step reads its weights from DRAM, and
 * one thread alone streams too few of them; the pool's fork costs a few microseconds).
 * Returns 0, or -1 when a work buffer cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "wq_kernels.h"

#define NT 16 /* output rows per work item: 16 int4 rows of K = 2048 are 16 KiB (L1) */
#define MR 4  /* rows of x per register tile */
#define PARALLEL_MIN_MACS ((int64_t)1 << 17)
/* A decode call reads each weight once, from DRAM: the rows the next register tile reads
 * (nr rows on, the same k) are prefetched as a tile reads its own, so their lines are in flight
 * while it computes (a tile's rows are too short a stream for the hardware prefetcher) */
#define PREFETCH_ROWS_AHEAD(p, nr, row_bytes) _mm_prefetch((const char *)(p) + (nr) * (row_bytes), _MM_HINT_T0)

/* a float8_e4m3fn byte's value, exactly: (8 + m) 2^(e - 10), subnormal m 2^-9, 0x7f: NaN */
static inline float fp8_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = (e == 15 && m == 7) ? NAN : e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return (b & 0x80) ? -v : v;
}

/* stored value k of a row */
static inline float stored(const uint8_t *row, int bits, int64_t k) {
    if (bits == 8) return (float)(int8_t)row[k];
    if (bits == LMX_WQ_FP8) return fp8_value(row[k]);
    uint8_t b = row[k / 32 * 16 + (k % 32) % 16];
    return (float)((k % 32) < 16 ? (b & 15) : (b >> 4));
}

#if defined(__AVX512F__)
#define WL 16 /* lanes */
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET(s) _mm512_set1_ps(s)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VDEQ(v, z, s) _mm512_mul_ps(_mm512_sub_ps(v, z), s)
#define VHSUM(v) _mm512_reduce_add_ps(v)
static const int XOFF[32 / WL] = {0, 16}; /* k offset of each widened vector of a block */
/* 16 float8_e4m3fn bytes as fp32 lanes, exactly (fp8_value): the exponent and mantissa bits
 * moved to fp32's, the exponent rebiased (+120); subnormals m 2^-9; NaN; the sign */
static inline __m512 fp8_widen(__m128i bytes) {
    const __m512i b = _mm512_cvtepi8_epi32(bytes), mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    __m512 v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    v = _mm512_mask_mul_ps(v, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), _mm512_cvtepi32_ps(mag),
                           _mm512_set1_ps(1.0f / 512));
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), _mm512_set1_ps(NAN));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v),
                                               _mm512_and_si512(b, _mm512_set1_epi32((int)0x80000000u))));
}
static inline void widen(const uint8_t *p, int bits, vf *o) { /* one block: o[32 / WL] */
    if (bits == LMX_WQ_FP8) {
        o[0] = fp8_widen(_mm_loadu_si128((const __m128i *)p));
        o[1] = fp8_widen(_mm_loadu_si128((const __m128i *)(p + 16)));
        return;
    }
    if (bits == 8) {
        o[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        o[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        return;
    }
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    o[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    o[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define WL 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET(s) _mm256_set1_ps(s)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VDEQ(v, z, s) _mm256_mul_ps(_mm256_sub_ps(v, z), s)
#define VHSUM(v) hsum8(v)
static const int XOFF[32 / WL] = {0, 16, 8, 24};
static inline __m128i load8(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
/* 8 float8_e4m3fn bytes as fp32 lanes, exactly (as the AVX-512 fp8_widen) */
static inline __m256 fp8_widen(__m128i bytes) {
    const __m256i b = _mm256_cvtepi8_epi32(bytes), mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    __m256 v = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512));
    v = _mm256_blendv_ps(v, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
    v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN),
                         _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
    return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u))));
}
static inline void widen(const uint8_t *p, int bits, vf *o) {
    if (bits == 8 || bits == LMX_WQ_FP8) {
        for (int i = 0; i < 4; i++) { /* k order: offsets 0, 8, 16, 24 -> o[0], o[2], o[1], o[3] */
            const __m128i b = load8(p + 8 * i);
            o[(i & 1) * 2 + (i >> 1)] = bits == 8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)) : fp8_widen(b);
        }
        return;
    }
    for (int h = 0; h < 2; h++) { /* bytes 8h..8h+7: k 8h.. (low) and 16 + 8h.. (high) */
        __m256i b = _mm256_cvtepu8_epi32(load8(p + 8 * h));
        o[2 * h] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
        o[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    }
}
#endif

#ifdef WL
#define NV (32 / WL) /* vectors per block of 32 */
#if WL == 16
#define NR_MAX 2 /* weight rows per register tile: 16 accumulators of 32 registers */
#else
#define NR_MAX 1 /* 8 accumulators of 16 registers */
#endif
/* weight rows per register tile at one row of x in the AVX-512 variant (AVX2 takes tile_x1) */
#define NR_ONE_ROW 2

/* independent accumulators per (row of x, row of W): a block's NV products go round-robin into
 * them, so the FMAs of one output do not wait on each other (one chain holds a tile to one FMA
 * latency per vector: at 1 row of x, 4 ns a block of 32 int4 on an AVX2 Zen 3, one thread); as
 * many as the registers hold beside the widened weights (ACC_REGS accumulators in all) */
#if WL == 16
#define ACC_REGS 16
#else
#define ACC_REGS 8
#endif
#define SPLITS(mr, nr) ((mr) * (nr) * NV <= ACC_REGS ? NV : (mr) * (nr) * 2 <= ACC_REGS ? 2 : 1)

/* y rows m0..m0+mr of output rows n0..n0+nr, before the bias. Per group, acc sums x * stored
 * over its blocks (widened values, no dequantize per weight; SPLITS partial sums each); then
 * tot += scale * acc and the zero's share scale * zero * sum(x over the group) (xs) is taken off
 * once per row */
static inline __attribute__((always_inline)) void tile(const float *xp, int64_t Kp, const float *xs,
                                                       const uint8_t *w, int64_t row_bytes, int bits,
                                                       const float *scale, const float *zero, int G,
                                                       int group, int n0, const int nr, const int mr,
                                                       float out[MR][2]) {
    const int S = SPLITS(mr, nr);
    vf tot[MR][2];
    float corr[MR][2] = {{0}};
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) tot[m][r] = VZERO();
    const int bpb = LMX_WQ_WIDTH(bits) * 4; /* bytes per block */
    for (int g = 0; g < G; g++) {
        vf acc[MR][2][NV];
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++)
                for (int s = 0; s < S; s++) acc[m][r][s] = VZERO();
        for (int64_t k = (int64_t)g * group; k < (int64_t)(g + 1) * group; k += 32) {
            vf wv[2][NV];
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = w + (int64_t)(n0 + r) * row_bytes + k / 32 * bpb;
                PREFETCH_ROWS_AHEAD(p, nr, row_bytes);
                widen(p, bits, wv[r]);
            }
            for (int m = 0; m < mr; m++)
                for (int i = 0; i < NV; i++) {
                    vf xv = VLOAD(xp + m * Kp + k + XOFF[i]);
                    for (int r = 0; r < nr; r++) acc[m][r][i % S] = VFMA(xv, wv[r][i], acc[m][r][i % S]);
                }
        }
        for (int r = 0; r < nr; r++) {
            const int64_t at = (int64_t)(n0 + r) * G + g;
            const float sc = scale[at], z = zero ? zero[at] : (bits == 4 ? 8.0f : 0.0f);
            const vf vs = VSET(sc);
            for (int m = 0; m < mr; m++) {
                vf sum = acc[m][r][0];
                for (int s = 1; s < S; s++) sum = VADD(sum, acc[m][r][s]);
                tot[m][r] = VFMA(vs, sum, tot[m][r]);
                corr[m][r] += sc * z * xs[m * G + g];
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) out[m][r] = VHSUM(tot[m][r]) - corr[m][r];
}
#if WL == 8
/* vectors 2h and 2h + 1 of a block (k offsets XOFF[2h], XOFF[2h + 1]) as fp32 lanes: the half of
 * widen's work that one half of the block's bytes needs (int4: bytes 8h.., both nibbles) */
static inline __attribute__((always_inline)) void widen_half(const uint8_t *p, const int bits, const int h,
                                                              vf *o) {
    if (bits == 4) {
        const __m256i u = _mm256_cvtepu8_epi32(load8(p + 8 * h));
        o[0] = _mm256_cvtepi32_ps(_mm256_and_si256(u, _mm256_set1_epi32(15)));
        o[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(u, 4));
        return;
    }
    for (int j = 0; j < 2; j++) {
        const __m128i b = load8(p + 8 * h + 16 * j);
        o[j] = bits == 8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)) : fp8_widen(b);
    }
}

#define NR_X1 4 /* weight rows per tile at one row of x */
/* tile's sums at one row of x, AVX2: the block's NV vectors of x stay in registers and each of
 * nr <= NR_X1 weight rows is widened a half at a time into two partial sums (a: even vectors,
 * b: odd), so a block of x is loaded once for nr rows (tile loads x again for each weight row:
 * at one row of x its loads, not its FMAs, bound it). SmolLM2-135M's four projections at one
 * row, one thread, AVX2 Zen 3, alternated calls: int4 g64 1.2x, int8 1.2-1.3x faster than tile */
static inline __attribute__((always_inline)) void tile_x1(const float *xp, const float *xs, const uint8_t *w,
                                                          int64_t row_bytes, const int bits, const float *scale,
                                                          const float *zero, int G, int group, int n0,
                                                          const int nr, float *out) {
    const int bpb = LMX_WQ_WIDTH(bits) * 4;
    vf tot[NR_X1];
    float corr[NR_X1] = {0};
    for (int r = 0; r < nr; r++) tot[r] = VZERO();
    for (int g = 0; g < G; g++) {
        vf a[NR_X1], b[NR_X1];
        for (int r = 0; r < nr; r++) a[r] = b[r] = VZERO();
        for (int64_t k = (int64_t)g * group; k < (int64_t)(g + 1) * group; k += 32) {
            vf xv[NV];
            for (int i = 0; i < NV; i++) xv[i] = VLOAD(xp + k + XOFF[i]);
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = w + (int64_t)(n0 + r) * row_bytes + k / 32 * bpb;
                PREFETCH_ROWS_AHEAD(p, nr, row_bytes);
                for (int h = 0; h < NV / 2; h++) {
                    vf wv[2];
                    widen_half(p, bits, h, wv);
                    a[r] = VFMA(xv[2 * h], wv[0], a[r]);
                    b[r] = VFMA(xv[2 * h + 1], wv[1], b[r]);
                }
            }
        }
        for (int r = 0; r < nr; r++) {
            const int64_t at = (int64_t)(n0 + r) * G + g;
            const float sc = scale[at], z = zero ? zero[at] : (bits == 4 ? 8.0f : 0.0f);
            tot[r] = VFMA(VSET(sc), VADD(a[r], b[r]), tot[r]);
            corr[r] += sc * z * xs[g];
        }
    }
    for (int r = 0; r < nr; r++) out[r] = VHSUM(tot[r]) - corr[r];
}
#endif
#else
/* the plain C tile: value k of a row (stored), then the same sums one lane at a time */
static void tile(const float *xp, int64_t Kp, const float *xs, const uint8_t *w, int64_t row_bytes,
                 int bits, const float *scale, const float *zero, int G, int group, int n0, int nr,
                 int mr, float out[MR][2]) {
    (void)xs; /* dequantizes each weight: (stored - zero) * scale */
    for (int r = 0; r < nr; r++) {
        const uint8_t *row = w + (int64_t)(n0 + r) * row_bytes;
        float acc[MR] = {0};
        for (int g = 0; g < G; g++) {
            float s = scale[(int64_t)(n0 + r) * G + g];
            float z = zero ? zero[(int64_t)(n0 + r) * G + g] : (bits == 4 ? 8.0f : 0.0f);
            for (int64_t k = (int64_t)g * group; k < (int64_t)(g + 1) * group; k++) {
                float wk = (stored(row, bits, k) - z) * s;
                for (int m = 0; m < mr; m++) acc[m] += xp[m * Kp + k] * wk;
            }
        }
        for (int m = 0; m < mr; m++) out[m][r] = acc[m];
    }
}
#define NR_MAX 2
#define NR_ONE_ROW 2
#endif

/* y[i] = v, fp32 or bf16 rounded once */
static inline void put_y(void *y, int yd, int64_t i, float v) {
    if (yd == 0) ((float *)y)[i] = v;
    else ((uint16_t *)y)[i] = f32_to_bf16(v);
}

/* one work item: output rows n0..n1 for every row of x */
static inline __attribute__((always_inline)) void rows_tile_of(const float *xp, const float *xs, int64_t M,
                                                               int64_t Kp, const uint8_t *w, const int bits,
                                                               const float *scale, const float *zero, int G,
                                                               int group, const float *bias, void *y, int yd,
                                                               int N, int n0, int n1) {
    const int64_t row_bytes = Kp * LMX_WQ_WIDTH(bits) / 8;
    float out[MR][2];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = M - m0 < MR ? (int)(M - m0) : MR;
        const float *xm = xp + m0 * Kp, *xsm = xs + m0 * G;
#if defined(WL) && WL == 8
        if (mr == 1) { /* one row of x: tile_x1, NR_X1 weight rows at a time */
            float o1[NR_X1];
            for (int n = n0, nr; n < n1; n += nr) {
                nr = n1 - n < NR_X1 ? n1 - n : NR_X1;
#define LMX_TILE1(NR) tile_x1(xm, xsm, w, row_bytes, bits, scale, zero, G, group, n, NR, o1)
                if (nr == 4) LMX_TILE1(4); else if (nr == 3) LMX_TILE1(3); else if (nr == 2) LMX_TILE1(2); else LMX_TILE1(1);
#undef LMX_TILE1
                for (int r = 0; r < nr; r++) put_y(y, yd, m0 * N + n + r, o1[r] + (bias ? bias[n + r] : 0.0f));
            }
            continue;
        }
#endif
        const int nr_most = mr == 1 ? NR_ONE_ROW : NR_MAX;
        for (int n = n0, nr; n < n1; n += nr) {
            nr = n1 - n >= 2 ? nr_most : 1;
#define LMX_TILE(NR, MRC) tile(xm, Kp, xsm, w, row_bytes, bits, scale, zero, G, group, n, NR, MRC, out)
            if (nr == 2) {
                if (mr == 4) LMX_TILE(2, 4); else if (mr == 3) LMX_TILE(2, 3);
                else if (mr == 2) LMX_TILE(2, 2); else LMX_TILE(2, 1);
            } else {
                if (mr == 4) LMX_TILE(1, 4); else if (mr == 3) LMX_TILE(1, 3);
                else if (mr == 2) LMX_TILE(1, 2); else LMX_TILE(1, 1);
            }
#undef LMX_TILE
            for (int m = 0; m < mr; m++)
                for (int r = 0; r < nr; r++) put_y(y, yd, (m0 + m) * N + n + r, out[m][r] + (bias ? bias[n + r] : 0.0f));
        }
    }
}

/* rows_tile_of compiled once per weight format: with `bits` a constant, each tile's loops hold
 * only its own widening (one generic copy set up the fp8 constants at every group, and its
 * register tiles spilled; int4 g64 3072 x 576 at 1 row: 222 -> 174 us, one thread, AVX2 Zen 3) */
static void rows_tile(const float *xp, const float *xs, int64_t M, int64_t Kp, const uint8_t *w, int bits,
                      const float *scale, const float *zero, int G, int group, const float *bias,
                      void *y, int yd, int N, int n0, int n1) {
    if (bits == 4) rows_tile_of(xp, xs, M, Kp, w, 4, scale, zero, G, group, bias, y, yd, N, n0, n1);
    else if (bits == 8) rows_tile_of(xp, xs, M, Kp, w, 8, scale, zero, G, group, bias, y, yd, N, n0, n1);
    else rows_tile_of(xp, xs, M, Kp, w, LMX_WQ_FP8, scale, zero, G, group, bias, y, yd, N, n0, n1);
}

#include "wq_dequant.h" /* loramux_wq_dequantize: bands of W for quant_ops.cpp's ATen GEMM path */

#include "wq_bf16.h" /* the avx512bf16 variant's bf16-activation tile (rows_tile_bh) */

#include "wq_gemm.h" /* from GEMM_MIN_M rows: a dequantized tile of W, then a GEMM over it */

int LMX_FN(loramux_wq_linear)(const void *x, int64_t x_stride, int xd, const uint8_t *w, int bits,
                              const float *scale, const float *zero, int G, int group,
                              const float *bias, void *y, int yd, int64_t M, int N, int K, int Kp,
                              int nthreads) {
    const int tiles = (N + NT - 1) / NT;
#ifdef LMX_WQ_BH
    if (xd == 1 && M < GEMM_MIN_M) /* bf16 x, decode: the native bf16 dot products over x repacked once */
        return bh_call((const uint16_t *)x, x_stride, M, K, Kp, w, bits, scale, zero, G, group, bias, y, yd, N,
                       tiles, nthreads);
#endif
    /* [M, Kp] zero padded, then xs [M, G]: the sums of x over each group */
    float *xp = (float *)calloc((size_t)(M * Kp + M * G), sizeof(float)), *xs = xp + M * Kp;
    if (xp == NULL) return -1;
    for (int64_t m = 0; m < M; m++) {
        for (int k = 0; k < K; k++) xp[m * Kp + k] = load_elem(x, xd, m * x_stride + k);
        for (int g = 0; g < G; g++)
            for (int64_t k = (int64_t)g * group; k < (int64_t)(g + 1) * group; k++) xs[m * G + g] += xp[m * Kp + k];
    }
#ifdef WL
    if (M >= GEMM_MIN_M) {
        int rc = gemm_call(xp, M, Kp, w, bits, scale, zero, G, group, bias, y, yd, N, K, tiles, nthreads);
        free(xp);
        return rc;
    }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N * (int64_t)K >= PARALLEL_MIN_MACS)
    for (int t = 0; t < tiles; t++) {
        int n0 = t * NT, n1 = n0 + NT < N ? n0 + NT : N;
        rows_tile(xp, xs, M, Kp, w, bits, scale, zero, G, group, bias, y, yd, N, n0, n1);
    }
    free(xp);
    return 0;
}
