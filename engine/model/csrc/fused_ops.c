/* The small ops of a decoder layer, fused: one pass over each row instead of one torch op
 * (and one temporary) per arithmetic step.
 *
 *   loramux_add_rms_norm  residual += delta (optional), out = rms_norm(residual) * weight
 *                         (Llama), or * (1 + weight) in fp32 (Gemma, unit_offset = 1)
 *   loramux_rope          rotary embedding (rotate-half, Llama/NeoX layout) in place on q|k heads
 *   loramux_act_mul       out = act(gate) * up over a [T, 2I] gate|up row; act 0 = SiLU,
 *                         1 = tanh-approximate GELU (GeGLU, gelu_pytorch_tanh)
 *
 * Numerics follow the eager torch ops they replace, rounding where those round: in bf16
 * (dtype 1) every elementwise result is rounded to bf16 as torch does after each op (the
 * Llama norm in fp32, Hugging Face's order: normalize, round, then scale by the weight; the
 * Gemma norm all in fp32, rounded once); in fp32 (dtype 0) the same expressions without
 * rounding. Outputs may be written as fp32 holding bf16-rounded values (out_dtype 0 under
 * dtype 1) for a matmul that runs in fp32.
 *
 * Rows are split over OpenMP threads (the process's libgomp, the one torch uses) when a call
 * has enough work. Layouts take a row stride in elements; the rows themselves are dense.
 * The caller (ops.cpp) has checked every shape, stride, dtype and index.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

static inline float round_bf16(float f) { /* f rounded to bf16 (nearest even), as a float */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        u |= 0x00400000u; /* quiet NaN */
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
    }
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static inline void store(void *base, int dtype, int64_t i, float v) {
    if (dtype == 0) {
        ((float *)base)[i] = v;
    } else {
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    }
}

/* v rounded to the model dtype (bf16), or v itself (fp32) */
static inline float rnd(float v, int dtype) { return dtype == 0 ? v : round_bf16(v); }

#define PARALLEL_MIN_ELEMS 32768 /* below this a call runs on one thread */

#if defined(__AVX2__) && defined(__FMA__)
/* glibc's libmvec: expf on 8 lanes (same accuracy class as scalar expf) */
__m256 _ZGVdN8v_expf(__m256 x);

static inline __m256 vrnd(__m256 v, int dtype) { return dtype == 0 ? v : vround_bf16(v); }

#endif
#if defined(VEC16) && defined(__AVX512DQ__)
/* the AVX-512 variants: 16 lanes first, the 8-lane loops take the rest (same expressions,
 * same rounding; the norm's sum of squares keeps the 8-lane order) */
#define WIDE 16
__m512 _ZGVeN16v_expf(__m512 x); /* libmvec, 16 lanes */

static inline __m512 vrnd16(__m512 v, int dtype) { return dtype == 0 ? v : vround16_bf16(v); }
#endif

/* residual[T, H] (row stride res_stride) += delta[T, H] (delta_dtype, stride delta_stride;
 * NULL = no add); out[T, H] (dense, out_dtype) = rms_norm(residual) * weight[H], or with
 * unit_offset (Gemma) rms_norm(residual) * (1 + weight[H]) computed in fp32, rounded once. */
int LMX_FN(loramux_add_rms_norm)(void *residual, int64_t res_stride, const void *delta,
                                 int64_t delta_stride, int delta_dtype, const void *weight,
                                 void *out, int out_dtype, int64_t T, int64_t H, float eps,
                                 int unit_offset, int dtype, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        int64_t r0 = t * res_stride, d0 = t * delta_stride, o0 = t * H, h = 0;
        float sum = 0.0f;
#ifdef VEC
        __m256 acc = _mm256_setzero_ps();
#ifdef WIDE
        for (; h + WIDE <= H; h += WIDE) {
            __m512 r = vload16(residual, dtype, r0 + h);
            if (delta != NULL) {
                r = vrnd16(_mm512_add_ps(r, vrnd16(vload16(delta, delta_dtype, d0 + h), dtype)), dtype);
                vstore16(residual, dtype, r0 + h, r);
            }
            const __m512 sq = _mm512_mul_ps(r, r); /* added as the 8-lane loop adds them */
            acc = _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(sq)), _mm512_extractf32x8_ps(sq, 1));
        }
#endif
        for (; h + VEC <= H; h += VEC) {
            __m256 r = vload8(residual, dtype, r0 + h);
            if (delta != NULL) {
                __m256 d = vrnd(vload8(delta, delta_dtype, d0 + h), dtype);
                r = vrnd(_mm256_add_ps(r, d), dtype);
                vstore(residual, dtype, r0 + h, r);
            }
            acc = _mm256_add_ps(acc, _mm256_mul_ps(r, r));
        }
        sum = hsum8(acc);
#else
        /* 8 partial sums added as hsum8 adds its lanes: every variant sums in one order */
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (; h + 8 <= H; h += 8) {
            for (int j = 0; j < 8; j++) {
                float r = load_elem(residual, dtype, r0 + h + j);
                if (delta != NULL) {
                    r = rnd(r + rnd(load_elem(delta, delta_dtype, d0 + h + j), dtype), dtype);
                    store(residual, dtype, r0 + h + j, r);
                }
                acc[j] = acc[j] + r * r;
            }
        }
        sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
#endif
        for (; h < H; h++) {
            float r = load_elem(residual, dtype, r0 + h);
            if (delta != NULL) {
                r = rnd(r + rnd(load_elem(delta, delta_dtype, d0 + h), dtype), dtype);
                store(residual, dtype, r0 + h, r);
            }
            sum += r * r;
        }
        float inv = 1.0f / sqrtf(sum / (float)H + eps);
        h = 0;
        if (unit_offset) {
#ifdef VEC
            __m256 vinv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f);
#ifdef WIDE
            for (; h + WIDE <= H; h += WIDE) {
                __m512 n = _mm512_mul_ps(vload16(residual, dtype, r0 + h), _mm512_set1_ps(inv));
                __m512 w = _mm512_add_ps(_mm512_set1_ps(1.0f), vload16(weight, dtype, h));
                vstore16(out, out_dtype, o0 + h, vrnd16(_mm512_mul_ps(n, w), dtype));
            }
#endif
            for (; h + VEC <= H; h += VEC) {
                __m256 n = _mm256_mul_ps(vload8(residual, dtype, r0 + h), vinv);
                __m256 w = _mm256_add_ps(one, vload8(weight, dtype, h));
                vstore(out, out_dtype, o0 + h, vrnd(_mm256_mul_ps(n, w), dtype));
            }
#endif
            for (; h < H; h++) {
                float n = load_elem(residual, dtype, r0 + h) * inv;
                store(out, out_dtype, o0 + h, rnd(n * (1.0f + load_elem(weight, dtype, h)), dtype));
            }
            continue;
        }
#ifdef VEC
        __m256 vinv = _mm256_set1_ps(inv);
#ifdef WIDE
        for (; h + WIDE <= H; h += WIDE) {
            __m512 n = vrnd16(_mm512_mul_ps(vload16(residual, dtype, r0 + h), _mm512_set1_ps(inv)), dtype);
            vstore16(out, out_dtype, o0 + h, vrnd16(_mm512_mul_ps(vload16(weight, dtype, h), n), dtype));
        }
#endif
        for (; h + VEC <= H; h += VEC) {
            __m256 n = vrnd(_mm256_mul_ps(vload8(residual, dtype, r0 + h), vinv), dtype);
            vstore(out, out_dtype, o0 + h, vrnd(_mm256_mul_ps(vload8(weight, dtype, h), n), dtype));
        }
#endif
        for (; h < H; h++) {
            float n = rnd(load_elem(residual, dtype, r0 + h) * inv, dtype);
            store(out, out_dtype, o0 + h, rnd(load_elem(weight, dtype, h) * n, dtype));
        }
    }
    return 0;
}

/* x[t, h, :] for h < nheads (token stride tok_stride, heads dense, D each) rotated in place:
 * x * cos + rotate_half(x) * sin with cos/sin rows [P, D] picked by positions[t]. */
int LMX_FN(loramux_rope)(void *x, int64_t tok_stride, const int64_t *positions, const void *cos,
                         const void *sin, int64_t T, int nheads, int D, int dtype, int nthreads) {
    int half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * nheads * D >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        int64_t p = positions[t] * D;
        for (int h = 0; h < nheads; h++) {
            int64_t b = t * tok_stride + (int64_t)h * D;
            int i = 0;
#ifdef WIDE
            for (; i + WIDE <= half; i += WIDE) {
                __m512 x1 = vload16(x, dtype, b + i), x2 = vload16(x, dtype, b + half + i);
                __m512 c1 = vload16(cos, dtype, p + i), s1 = vload16(sin, dtype, p + i);
                __m512 c2 = vload16(cos, dtype, p + half + i), s2 = vload16(sin, dtype, p + half + i);
                __m512 nx2 = _mm512_xor_ps(x2, _mm512_set1_ps(-0.0f));
                __m512 o1 = vrnd16(_mm512_add_ps(vrnd16(_mm512_mul_ps(x1, c1), dtype),
                                                 vrnd16(_mm512_mul_ps(nx2, s1), dtype)), dtype);
                __m512 o2 = vrnd16(_mm512_add_ps(vrnd16(_mm512_mul_ps(x2, c2), dtype),
                                                 vrnd16(_mm512_mul_ps(x1, s2), dtype)), dtype);
                vstore16(x, dtype, b + i, o1);
                vstore16(x, dtype, b + half + i, o2);
            }
#endif
#ifdef VEC
            for (; i + VEC <= half; i += VEC) {
                __m256 x1 = vload8(x, dtype, b + i), x2 = vload8(x, dtype, b + half + i);
                __m256 c1 = vload8(cos, dtype, p + i), s1 = vload8(sin, dtype, p + i);
                __m256 c2 = vload8(cos, dtype, p + half + i), s2 = vload8(sin, dtype, p + half + i);
                __m256 nx2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.0f));
                __m256 o1 = vrnd(_mm256_add_ps(vrnd(_mm256_mul_ps(x1, c1), dtype),
                                               vrnd(_mm256_mul_ps(nx2, s1), dtype)), dtype);
                __m256 o2 = vrnd(_mm256_add_ps(vrnd(_mm256_mul_ps(x2, c2), dtype),
                                               vrnd(_mm256_mul_ps(x1, s2), dtype)), dtype);
                vstore(x, dtype, b + i, o1);
                vstore(x, dtype, b + half + i, o2);
            }
#endif
            for (; i < half; i++) {
                float x1 = load_elem(x, dtype, b + i), x2 = load_elem(x, dtype, b + half + i);
                float c1 = load_elem(cos, dtype, p + i), s1 = load_elem(sin, dtype, p + i);
                float c2 = load_elem(cos, dtype, p + half + i), s2 = load_elem(sin, dtype, p + half + i);
                float o1 = rnd(rnd(x1 * c1, dtype) + rnd(-x2 * s1, dtype), dtype);
                float o2 = rnd(rnd(x2 * c2, dtype) + rnd(x1 * s2, dtype), dtype);
                store(x, dtype, b + i, o1);
                store(x, dtype, b + half + i, o2);
            }
        }
    }
    return 0;
}

/* act(g) for one gate value: SiLU g * sigmoid(g), or the tanh-approximate GELU
 * 0.5 g (1 + tanh(k (g + 0.044715 g^3))) written as g * sigmoid(2 k (g + 0.044715 g^3)), which
 * never subtracts nearly equal numbers (torch's 1 + tanh does for very negative g). */
#define GELU_2K 1.5957691216057308f /* 2 * sqrt(2 / pi) */
#define GELU_C 0.044715f
static inline float act_scalar(float g, int act) {
    if (act == 0) return g / (1.0f + expf(-g));
    return g / (1.0f + expf(-GELU_2K * (g + GELU_C * g * g * g)));
}

/* out[T, I] (dense, out_dtype) = act(gu[t, :I]) * gu[t, I:] for gu [T, 2I] (row stride);
 * act 0 = SiLU, 1 = tanh-approximate GELU. */
int LMX_FN(loramux_act_mul)(const void *gu, int64_t gu_stride, void *out, int out_dtype, int64_t T,
                            int64_t I, int act, int dtype, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        int64_t g0 = t * gu_stride, o0 = t * I;
        int64_t i = 0;
#ifdef WIDE
        for (; i + WIDE <= I; i += WIDE) {
            const __m512 g = vload16(gu, dtype, g0 + i), c = _mm512_set1_ps(GELU_C);
            const __m512 z = act == 0 ? _mm512_xor_ps(g, _mm512_set1_ps(-0.0f))
                                      : _mm512_mul_ps(_mm512_set1_ps(-GELU_2K),
                                                      _mm512_fmadd_ps(_mm512_mul_ps(c, g), _mm512_mul_ps(g, g), g));
            const __m512 a = vrnd16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), _ZGVeN16v_expf(z))), dtype);
            vstore16(out, out_dtype, o0 + i, vrnd16(_mm512_mul_ps(a, vload16(gu, dtype, g0 + I + i)), dtype));
        }
#endif
#ifdef VEC
        __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
        __m256 k2 = _mm256_set1_ps(-GELU_2K), c = _mm256_set1_ps(GELU_C);
        for (; i + VEC <= I; i += VEC) {
            __m256 g = vload8(gu, dtype, g0 + i);
            __m256 z = act == 0 ? _mm256_xor_ps(g, neg)  /* -g */
                                : _mm256_mul_ps(k2, _mm256_fmadd_ps(_mm256_mul_ps(c, g), _mm256_mul_ps(g, g), g));
            __m256 e = _ZGVdN8v_expf(z);
            __m256 a = vrnd(_mm256_div_ps(g, _mm256_add_ps(one, e)), dtype);
            vstore(out, out_dtype, o0 + i, vrnd(_mm256_mul_ps(a, vload8(gu, dtype, g0 + I + i)), dtype));
        }
#endif
        for (; i < I; i++) {
            float a = rnd(act_scalar(load_elem(gu, dtype, g0 + i), act), dtype);
            store(out, out_dtype, o0 + i, rnd(a * load_elem(gu, dtype, g0 + I + i), dtype));
        }
    }
    return 0;
}
