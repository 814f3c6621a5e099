/* The C entry points of the weight-only int8 / int4 linear (wq_linear.c), one per ISA variant
 * (setup.py compiles wq_linear.c once per variant with -DLMX_ISA=<variant>). They trust their
 * arguments: quant_ops.cpp checks every tensor first. dtype codes: 0 = fp32, 1 = bf16.
 * Returns 0, or -1 when the x buffer cannot be allocated. */
#ifndef LORAMUX_WQ_KERNELS_H
#define LORAMUX_WQ_KERNELS_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* `bits` is 4 or 8 (integers) or LMX_WQ_FP8: float8_e4m3fn weights, one byte each in k order as
 * int8's (scale per row, no zero point) */
#define LMX_WQ_FP8 9
#define LMX_WQ_WIDTH(bits) ((bits) == LMX_WQ_FP8 ? 8 : (bits)) /* bits a weight */

#define LMX_DECLARE_WQ(isa)                                                                       \
    int loramux_wq_linear_##isa(const void *x, int64_t x_stride, int xd, const uint8_t *w,        \
                                int bits, const float *scale, const float *zero, int G, int group, \
                                const float *bias, void *y, int yd, int64_t M, int N, int K,      \
                                int Kp, int nthreads);                                            \
    void loramux_wq_dequantize_##isa(const uint8_t *w, int bits, const float *scale,               \
                                     const float *zero, int G, int group, int n0, int n1, int K,   \
                                     int Kp, void *out, int od, int nthreads);

LMX_DECLARE_WQ(scalar)
#ifdef LMX_HAVE_AVX2
LMX_DECLARE_WQ(avx2)
#endif
#ifdef LMX_HAVE_AVX512
LMX_DECLARE_WQ(avx512)
#endif
#ifdef LMX_HAVE_AVX512BF16
LMX_DECLARE_WQ(avx512bf16)
#endif
#ifdef LMX_ISA /* compiling wq_linear.c: its definition must match */
#define LMX_DECLARE_WQ_FOR(isa) LMX_DECLARE_WQ(isa)
LMX_DECLARE_WQ_FOR(LMX_ISA)
#endif

#ifdef __cplusplus
}
#endif
#endif
