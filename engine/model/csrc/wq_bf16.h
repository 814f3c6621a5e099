/* wq_linear.c's native-bf16 path, compiled only into the ISA variant built with -mavx512bf16
 * (isa.cpp runs it only where the CPU has AVX512_BF16): bf16 activations, fewer than
 * GEMM_MIN_M rows of them (a decode step; from DENSE_MIN_M_BF16 rows quant_ops.cpp hands dequantized
 * bands to oneDNN instead), the weights in the kernel's unchanged layout: tile_bh works on the
 * stored values in registers.
 *
 * Each stored value becomes a bf16 exactly, then VDPBF16PS (_mm512_dpbf16_ps) multiplies pairs
 * of them by pairs of x (bf16 x bf16 products are exact in fp32) into fp32 accumulators:
 *   int4  a chunk of 128 values (4 blocks) is one 64-byte load of a row (masked past its end):
 *         its low and high nibbles (the bytes & 15 and >> 4 & 15) interleaved with the byte 0x43
 *         (VPUNPCKL/HBW, within 128-bit lanes) are the bf16s 128 + u (exponent of 128, u in the
 *         mantissa), 4 vectors of 32. x is repacked once per call into their order (vector j,
 *         word p: value 32 (p / 8) + 8 j + p % 8 of the chunk), so fp32 lane i of the sums holds
 *         block i / 4 of the chunk only: the per-lane scale and offset (128 + zero) of that
 *         block's group are gathered from up to 4 groups by one permute, and each lane's share
 *         of the offset, (128 + zero) * (its x values' sum, summed once per call), is taken off
 *         before the scale multiplies it in. 1 load and 7 integer ops per 128 values a row.
 *   int8  int8 -> int32 -> fp32 -> bf16 (_mm512_cvtne2ps_pbh): exact for |q| <= 256, k order;
 *   fp8   bits moved to bf16's (fp8_block_bh), exact (4 significant bits, exponents within
 *         bf16's), k order.
 * The sums are fp32 as on the fp32-FMA path, in another order (and int4's through the offset
 * of 128, taken off per lane and chunk): close to it, not bit-identical. Included by wq_linear.c only. */
#ifndef LORAMUX_WQ_BF16_H
#define LORAMUX_WQ_BF16_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

#define LMX_WQ_BH 1
#define NR_BH 4 /* weight rows per decode register tile at 1-2 rows of x (2 at 3-4 rows): four
                   independent accumulator chains hide VDPBF16PS's latency at batch 1 */

#define CH 128 /* int4 values per chunk: 64 bytes of a row */

/* x rows (bf16, row stride x_stride) -> xr [M, Kp] bf16 in k order, zero padded (int8, fp8) */
static void repack_x_bh(const uint16_t *x, int64_t x_stride, int64_t M, int K, int64_t Kp, uint16_t *xr) {
    for (int64_t m = 0; m < M; m++) {
        memcpy(xr + m * Kp, x + m * x_stride, (size_t)K * sizeof(uint16_t));
        memset(xr + m * Kp + K, 0, (size_t)(Kp - K) * sizeof(uint16_t));
    }
}

/* One call's int4 layout of x and of the groups (above): Kc = Kp rounded up to CH */
typedef struct {
    uint16_t *xr;   /* [M, Kc] bf16: each chunk's 4 vectors in the nibbles' order, zero padded */
    float *xl;      /* [M, Kc / CH, 16]: per chunk, each fp32 lane's sum of the x it multiplies */
    int32_t *gidx;  /* [Kc / CH, 16]: a lane's group less the chunk's first group (0..3) */
    int32_t *g0;    /* [Kc / CH]: the chunk's first group */
    int64_t Kc;
} x4_t;

static void repack_x_bh4(const uint16_t *x, int64_t x_stride, int64_t M, int K, int Kp, int group, x4_t *o) {
    const int64_t chunks = o->Kc / CH;
    for (int64_t c = 0; c < chunks; c++) {
        o->g0[c] = (int32_t)(c * CH / group);
        for (int b = 0; b < 4; b++) { /* lanes 4b..4b+3: block b of the chunk (its last value in range) */
            const int64_t k = c * CH + 32 * b;
            const int32_t gi = (int32_t)((k < Kp ? k : Kp - 1) / group) - o->g0[c];
            for (int l = 0; l < 4; l++) o->gidx[c * 16 + 4 * b + l] = gi;
        }
    }
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80); /* bf16 1.0 */
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < chunks; c++) {
            __m512i s[4]; /* the chunk's 4 blocks of x, zero past K */
            for (int q = 0; q < 4; q++) {
                const int64_t k = c * CH + 32 * q, n = K - k;
                const __mmask32 mk = n >= 32 ? ~(__mmask32)0 : n <= 0 ? 0 : (((__mmask32)1 << n) - 1);
                s[q] = _mm512_maskz_loadu_epi16(mk, x + m * x_stride + (n > 0 ? k : 0));
            }
            /* vector j = 128-bit lane j of each block: a 4 x 4 transpose of 128-bit lanes */
            const __m512i t0 = _mm512_shuffle_i64x2(s[0], s[1], 0x44), t1 = _mm512_shuffle_i64x2(s[0], s[1], 0xEE);
            const __m512i t2 = _mm512_shuffle_i64x2(s[2], s[3], 0x44), t3 = _mm512_shuffle_i64x2(s[2], s[3], 0xEE);
            const __m512i v[4] = {_mm512_shuffle_i64x2(t0, t2, 0x88), _mm512_shuffle_i64x2(t0, t2, 0xDD),
                                  _mm512_shuffle_i64x2(t1, t3, 0x88), _mm512_shuffle_i64x2(t1, t3, 0xDD)};
            __m512 sum = _mm512_setzero_ps(); /* x * 1.0, exact products, fp32 sums */
            for (int j = 0; j < 4; j++) {
                _mm512_storeu_si512(o->xr + m * o->Kc + c * CH + 32 * j, v[j]);
                sum = _mm512_dpbf16_ps(sum, (__m512bh)v[j], ones);
            }
            _mm512_storeu_ps(o->xl + (m * chunks + c) * 16, sum);
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

/* one block of 32 stored int8 or fp8 values (at p) as 32 bf16 lanes in k order */
static inline __m512bh block_bh(const uint8_t *p, int bits) {
    if (bits == LMX_WQ_FP8) return fp8_block_bh(p);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* the int4 register tile: y rows m0..m0+mr of output rows n0..n0+nr, before the bias */
static inline __attribute__((always_inline)) void tile_bh4(const x4_t *xa, int64_t m0, const uint8_t *w,
                                                           int64_t row_bytes, const float *scale,
                                                           const float *zero, int G, int Kp, int n0,
                                                           const int nr, const int mr, float out[MR][NR_BH]) {
    const __m512i m15 = _mm512_set1_epi8(15), c43 = _mm512_set1_epi8(0x43);
    const __m512 off = _mm512_set1_ps(128.0f), sym = _mm512_set1_ps(128.0f + 8.0f);
    const int64_t chunks = xa->Kc / CH;
    __m512 tot[MR][NR_BH];
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) tot[m][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t bytes = (Kp - c * CH) / 2; /* of this chunk in a row */
        const __mmask64 bm = bytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1);
        const int g0 = xa->g0[c];
        const __mmask16 gm = (__mmask16)((1u << (G - g0 < 4 ? G - g0 : 4)) - 1);
        const __m512i gi = _mm512_loadu_si512(xa->gidx + c * 16);
        /* every row's 4 vectors, scales and offsets first, then each row of x once against them
         * (its 4 vectors and sums loaded once for all rows of W: from 2 rows of x the loads of x
         * outnumbered the weights') */
        __m512bh wv[NR_BH][4];
        __m512 sv[NR_BH], zv[NR_BH];
        for (int r = 0; r < nr; r++) {
            const uint8_t *p = w + (int64_t)(n0 + r) * row_bytes + c * (CH / 2);
            PREFETCH_ROWS_AHEAD(p, nr, row_bytes);
            const __m512i b = _mm512_maskz_loadu_epi8(bm, p);
            const __m512i lo = _mm512_and_si512(b, m15), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m15);
            wv[r][0] = (__m512bh)_mm512_unpacklo_epi8(lo, c43);
            wv[r][1] = (__m512bh)_mm512_unpackhi_epi8(lo, c43);
            wv[r][2] = (__m512bh)_mm512_unpacklo_epi8(hi, c43);
            wv[r][3] = (__m512bh)_mm512_unpackhi_epi8(hi, c43);
            const int64_t at = (int64_t)(n0 + r) * G + g0;
            sv[r] = _mm512_permutexvar_ps(gi, _mm512_maskz_loadu_ps(gm, scale + at));
            zv[r] = zero ? _mm512_add_ps(off, _mm512_permutexvar_ps(gi, _mm512_maskz_loadu_ps(gm, zero + at))) : sym;
        }
        for (int m = 0; m < mr; m++) {
            const uint16_t *xc = xa->xr + (m0 + m) * xa->Kc + c * CH;
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xc), x1 = (__m512bh)_mm512_loadu_si512(xc + 32);
            const __m512bh x2 = (__m512bh)_mm512_loadu_si512(xc + 64), x3 = (__m512bh)_mm512_loadu_si512(xc + 96);
            const __m512 xl = _mm512_loadu_ps(xa->xl + ((m0 + m) * chunks + c) * 16);
            for (int r = 0; r < nr; r++) {
                __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), x0, wv[r][0]);
                a = _mm512_dpbf16_ps(a, x1, wv[r][1]);
                a = _mm512_dpbf16_ps(a, x2, wv[r][2]);
                a = _mm512_dpbf16_ps(a, x3, wv[r][3]);
                tot[m][r] = _mm512_fmadd_ps(sv[r], _mm512_fnmadd_ps(zv[r], xl, a), tot[m][r]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) out[m][r] = _mm512_reduce_add_ps(tot[m][r]);
}

/* tile (wq_linear.c) for bf16 x, int8 and fp8 (k order): y rows m0..m0+mr of output rows
 * n0..n0+nr, before the bias */
static inline __attribute__((always_inline)) void tile_bh(const uint16_t *xr, int64_t Kp, const float *xs,
                                                          const uint8_t *w, int64_t row_bytes, int bits,
                                                          const float *scale, const float *zero, int G,
                                                          int group, int n0, const int nr, const int mr,
                                                          float out[MR][NR_BH]) {
    __m512 tot[MR][NR_BH];
    float corr[MR][NR_BH] = {{0}};
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) tot[m][r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512 acc[MR][NR_BH];
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++) acc[m][r] = _mm512_setzero_ps();
        for (int64_t k = (int64_t)g * group; k < (int64_t)(g + 1) * group; k += 32) {
            __m512bh wv[NR_BH];
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = w + (int64_t)(n0 + r) * row_bytes + k;
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
            const float sc = scale[at];
            const __m512 vs = _mm512_set1_ps(sc);
            for (int m = 0; m < mr; m++) {
                tot[m][r] = _mm512_fmadd_ps(vs, acc[m][r], tot[m][r]);
                if (zero) corr[m][r] += sc * zero[at] * xs[m * G + g]; /* xs exists only then */
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) out[m][r] = _mm512_reduce_add_ps(tot[m][r]) - corr[m][r];
}

/* rows_tile (wq_linear.c) on the bf16 tiles: output rows n0..n1 for every row of x (xa: int4's
 * layout, else xr in k order and xs the sums of x per group) */
static void rows_tile_bh(const x4_t *xa, const uint16_t *xr, const float *xs, int64_t M, int64_t Kp,
                         const uint8_t *w, int bits, const float *scale, const float *zero, int G,
                         int group, const float *bias, void *y, int yd, int N, int n0, int n1) {
    const int64_t row_bytes = Kp * LMX_WQ_WIDTH(bits) / 8;
    float out[MR][NR_BH];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = M - m0 < MR ? (int)(M - m0) : MR;
        const uint16_t *xm = xr + m0 * Kp;
        const float *xsm = xs + m0 * G;
        for (int n = n0, nr; n < n1; n += nr) {
            nr = n1 - n >= 4 && mr <= 2 ? 4 : n1 - n >= 2 ? 2 : 1;
#define LMX_TILE_BH(NR, MRC)                                                                                \
    (bits == 4 ? tile_bh4(xa, m0, w, row_bytes, scale, zero, G, (int)Kp, n, NR, MRC, out)                    \
               : tile_bh(xm, Kp, xsm, w, row_bytes, bits, scale, zero, G, group, n, NR, MRC, out))
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

/* the bf16-x call (wq_linear.c's entry, below GEMM_MIN_M rows): x repacked once (int8 / fp8 with
 * a zero point: also its sums per group, xs), then the output rows' tiles over the threads.
 * Returns 0, or -1 when the buffer cannot be allocated */
static int bh_call(const uint16_t *x, int64_t x_stride, int64_t M, int K, int Kp, const uint8_t *w, int bits,
                   const float *scale, const float *zero, int G, int group, const float *bias, void *y, int yd,
                   int N, int tiles, int nthreads) {
    x4_t xa = {0};
    xa.Kc = (Kp + CH - 1) / CH * CH;
    const int64_t chunks = xa.Kc / CH, xlen = bits == 4 ? M * xa.Kc : M * (int64_t)Kp;
    /* one buffer: xr, then xl, gidx, g0 (int4) or xs (int8 / fp8), each 64-byte aligned */
    const size_t xr_b = ((size_t)xlen * 2 + 63) / 64 * 64, xl_b = (size_t)(M * chunks * 16) * 4;
    char *buf = (char *)malloc(xr_b + (bits == 4 ? xl_b + (size_t)chunks * 17 * 4 : (size_t)(M * G) * 4));
    if (buf == NULL) return -1;
    xa.xr = (uint16_t *)buf;
    float *xs = (float *)(buf + xr_b);
    if (bits == 4) {
        xa.xl = xs;
        xa.gidx = (int32_t *)(buf + xr_b + xl_b);
        xa.g0 = xa.gidx + chunks * 16;
        repack_x_bh4(x, x_stride, M, K, Kp, group, &xa);
    } else {
        repack_x_bh(x, x_stride, M, K, Kp, xa.xr);
        for (int64_t m = 0; zero != NULL && m < M; m++) /* the zero point's share needs them */
            for (int g = 0; g < G; g++) {
                float t = 0.0f;
                for (int64_t k = (int64_t)g * group; k < (int64_t)(g + 1) * group; k++)
                    t += bf16_to_f32(xa.xr[m * Kp + k]);
                xs[m * G + g] = t;
            }
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N * (int64_t)K >= PARALLEL_MIN_MACS)
    for (int t = 0; t < tiles; t++) {
        int n0 = t * NT, n1 = n0 + NT < N ? n0 + NT : N;
        rows_tile_bh(&xa, xa.xr, xs, M, Kp, w, bits, scale, zero, G, group, bias, y, yd, N, n0, n1);
    }
    free(buf);
    return 0;
}

#endif
#endif
