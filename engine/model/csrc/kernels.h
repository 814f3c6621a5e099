/* The C entry points of the CPU kernels, one set per ISA variant.
 *
 * setup.py compiles each kernel source (fused_ops.c, paged_attention.c, lora_sgmv.c) once per
 * variant with that variant's flags and -DLMX_ISA=<variant> (bf16.h's LMX_FN appends the
 * suffix), and ops.cpp picks one variant at load time (the best the CPU runs). These functions
 * trust their arguments: ops.cpp checks every tensor before it calls them.
 * dtype codes: 0 = fp32, 1 = bf16. Each returns 0, or -1 when a work buffer cannot be allocated.
 */
#ifndef LORAMUX_KERNELS_H
#define LORAMUX_KERNELS_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LMX_DECLARE_KERNELS(isa)                                                                   \
    int loramux_paged_attention_##isa(const void *q, int64_t q_tok_stride, const void *k_cache,    \
                                      const void *v_cache, void *out, const int32_t *tables,       \
                                      int64_t table_stride, const int32_t *row_start,              \
                                      const int32_t *num_new, const int32_t *ctx_len, int nseq,    \
                                      int H, int Hkv, int D, int bs, int window, float scale,      \
                                      float softcap, int dtype, int nthreads);                     \
    int loramux_add_rms_norm_##isa(void *residual, int64_t res_stride, const void *delta,          \
                                   int64_t delta_stride, int delta_dtype, const void *weight,      \
                                   void *out, int out_dtype, int64_t T, int64_t H, float eps,      \
                                   int unit_offset, int dtype, int nthreads);                      \
    int loramux_rope_##isa(void *x, int64_t tok_stride, const int64_t *positions, const void *cos, \
                           const void *sin, int64_t T, int nheads, int D, int dtype, int nthreads); \
    int loramux_act_mul_##isa(const void *gu, int64_t gu_stride, void *out, int out_dtype,         \
                              int64_t T, int64_t I, int act, int dtype, int nthreads);             \
    int loramux_lora_sgmv_##isa(const void *x, int64_t x_stride, int x_dtype, const void *a,       \
                                const void *b, int w_dtype, void *y, int64_t y_stride,             \
                                int y_dtype, const int64_t *runs, int nruns,                       \
                                const int64_t *ranks, int S, int R, int K, int N,                  \
                                const int64_t *slice_off, int nthreads);

LMX_DECLARE_KERNELS(scalar)
#ifdef LMX_HAVE_AVX2
LMX_DECLARE_KERNELS(avx2)
#endif
#ifdef LMX_HAVE_AVX512
LMX_DECLARE_KERNELS(avx512)
#endif
#ifdef LMX_HAVE_AVX512BF16
LMX_DECLARE_KERNELS(avx512bf16)
#endif
#ifdef LMX_ISA /* compiling a kernel source: its definitions must match these */
#define LMX_DECLARE_FOR(isa) LMX_DECLARE_KERNELS(isa)
LMX_DECLARE_FOR(LMX_ISA)
#endif

#ifdef __cplusplus
}
#endif
#endif
