/* The shrink's dot products (lora_sgmv.c): x . one A row, and x . four A rows for one, two or
 * three tokens at a time (each load of A feeds every token; each token's sums are those it
 * would get alone), fp32 accumulation; AVX2/FMA where the ISA variant has it (bf16.h's VEC),
 * scalar C otherwise. Included by lora_sgmv.c only (static functions, one copy per variant). */
#ifndef LORAMUX_SGMV_SHRINK_H
#define LORAMUX_SGMV_SHRINK_H
#include <stdint.h>

#include "bf16.h"

/* x . one A row of K elements */
static float dot(const void *x, int xd, int64_t xo, const void *a, int ad, int64_t ao, int K) {
    int k = 0;
    float s = 0.0f;
#ifdef VEC
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; k + 2 * VEC <= K; k += 2 * VEC) {
        acc0 = _mm256_fmadd_ps(vload8(x, xd, xo + k), vload8(a, ad, ao + k), acc0);
        acc1 = _mm256_fmadd_ps(vload8(x, xd, xo + k + VEC), vload8(a, ad, ao + k + VEC), acc1);
    }
    for (; k + VEC <= K; k += VEC) acc0 = _mm256_fmadd_ps(vload8(x, xd, xo + k), vload8(a, ad, ao + k), acc0);
    s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; k < K; k++) s += load_elem(x, xd, xo + k) * load_elem(a, ad, ao + k);
    return s;
}

/* out[0..3] = x . A rows 0..3 (rows K apart from ao): one load of x serves four rows */
static void dot4(const void *x, int xd, int64_t xo, const void *a, int ad, int64_t ao, int K, float *out) {
    int k = 0;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#ifdef VEC
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
    for (; k + VEC <= K; k += VEC) {
        __m256 xv = vload8(x, xd, xo + k);
        c0 = _mm256_fmadd_ps(xv, vload8(a, ad, ao + k), c0);
        c1 = _mm256_fmadd_ps(xv, vload8(a, ad, ao + K + k), c1);
        c2 = _mm256_fmadd_ps(xv, vload8(a, ad, ao + 2 * (int64_t)K + k), c2);
        c3 = _mm256_fmadd_ps(xv, vload8(a, ad, ao + 3 * (int64_t)K + k), c3);
    }
    s0 = hsum8(c0), s1 = hsum8(c1), s2 = hsum8(c2), s3 = hsum8(c3);
#endif
    for (; k < K; k++) {
        float xk = load_elem(x, xd, xo + k);
        s0 += xk * load_elem(a, ad, ao + k);
        s1 += xk * load_elem(a, ad, ao + K + k);
        s2 += xk * load_elem(a, ad, ao + 2 * (int64_t)K + k);
        s3 += xk * load_elem(a, ad, ao + 3 * (int64_t)K + k);
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* oa[0..3] = xa . A rows 0..3 and ob[0..3] = xb . A rows 0..3 (rows K apart from ao): two tokens
 * of one run, so each load of A feeds two FMAs and eight independent accumulators hide the FMA
 * latency (dot4 alone keeps four chains: half the FMA rate); A is read once for both tokens */
static void dot4x2(const void *x, int xd, int64_t xa, int64_t xb, const void *a, int ad, int64_t ao, int K,
                   float *oa, float *ob) {
    int k = 0;
    float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef VEC
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    for (; k + VEC <= K; k += VEC) {
        __m256 xv = vload8(x, xd, xa + k), xw = vload8(x, xd, xb + k);
        __m256 w = vload8(a, ad, ao + k);
        a0 = _mm256_fmadd_ps(xv, w, a0), b0 = _mm256_fmadd_ps(xw, w, b0);
        w = vload8(a, ad, ao + K + k);
        a1 = _mm256_fmadd_ps(xv, w, a1), b1 = _mm256_fmadd_ps(xw, w, b1);
        w = vload8(a, ad, ao + 2 * (int64_t)K + k);
        a2 = _mm256_fmadd_ps(xv, w, a2), b2 = _mm256_fmadd_ps(xw, w, b2);
        w = vload8(a, ad, ao + 3 * (int64_t)K + k);
        a3 = _mm256_fmadd_ps(xv, w, a3), b3 = _mm256_fmadd_ps(xw, w, b3);
    }
    sa[0] = hsum8(a0), sa[1] = hsum8(a1), sa[2] = hsum8(a2), sa[3] = hsum8(a3);
    sb[0] = hsum8(b0), sb[1] = hsum8(b1), sb[2] = hsum8(b2), sb[3] = hsum8(b3);
#endif
    for (; k < K; k++) {
        float xk = load_elem(x, xd, xa + k), xl = load_elem(x, xd, xb + k);
        for (int i = 0; i < 4; i++) {
            float w = load_elem(a, ad, ao + i * (int64_t)K + k);
            sa[i] += xk * w, sb[i] += xl * w;
        }
    }
    for (int i = 0; i < 4; i++) oa[i] = sa[i], ob[i] = sb[i];
}

/* o[q][0..3] = token q's x . A rows 0..3, q < 3 (rows K apart from ao): three tokens of one
 * run, each load of A feeding three FMAs, twelve accumulator chains; each token's sums are
 * those of dot4 alone */
static void dot4x3(const void *x, int xd, const int64_t *xo, const void *a, int ad, int64_t ao, int K,
                   float *const *o) {
    int k = 0;
    float sm[3][4] = {{0.0f}};
#ifdef VEC
    __m256 c[3][4];
    for (int q = 0; q < 3; q++)
        for (int i = 0; i < 4; i++) c[q][i] = _mm256_setzero_ps();
    for (; k + VEC <= K; k += VEC) {
        __m256 x0 = vload8(x, xd, xo[0] + k), x1 = vload8(x, xd, xo[1] + k), x2 = vload8(x, xd, xo[2] + k);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m256 w = vload8(a, ad, ao + i * (int64_t)K + k);
            c[0][i] = _mm256_fmadd_ps(x0, w, c[0][i]);
            c[1][i] = _mm256_fmadd_ps(x1, w, c[1][i]);
            c[2][i] = _mm256_fmadd_ps(x2, w, c[2][i]);
        }
    }
    for (int q = 0; q < 3; q++)
        for (int i = 0; i < 4; i++) sm[q][i] = hsum8(c[q][i]);
#endif
    for (; k < K; k++) {
        for (int i = 0; i < 4; i++) {
            float w = load_elem(a, ad, ao + i * (int64_t)K + k);
            for (int q = 0; q < 3; q++) sm[q][i] += load_elem(x, xd, xo[q] + k) * w;
        }
    }
    for (int q = 0; q < 3; q++)
        for (int i = 0; i < 4; i++) o[q][i] = sm[q][i];
}

#endif
