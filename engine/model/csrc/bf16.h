/* Shared by the CPU kernels: bf16 <-> fp32 as torch converts (scalar, 8 and 16 lanes), the AVX2 helpers, and the
 * naming of each ISA variant's entry points.
 * dtype codes: 0 = fp32, 1 = bf16.
 *
 * setup.py compiles every kernel source once per ISA variant (its flags, e.g. -mavx2 -mfma)
 * with -DLMX_ISA=<variant>; LMX_FN(loramux_rope) then names that variant's entry point
 * (loramux_rope_avx2). Vector code is guarded by the compiler's ISA macros (__AVX2__), so
 * the scalar variant is the same source without them. */
#ifndef LORAMUX_BF16_H
#define LORAMUX_BF16_H
#include <stdint.h>
#include <string.h>

#ifndef LMX_ISA
#define LMX_ISA scalar
#endif
#define LMX_CAT_(a, b) a##_##b
#define LMX_CAT(a, b) LMX_CAT_(a, b)
#define LMX_FN(name) LMX_CAT(name, LMX_ISA)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* element i of an fp32 (dtype 0) or bf16 (dtype 1) array, as fp32 */
static inline float load_elem(const void *base, int dtype, int64_t i) {
    return dtype == 0 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 8

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* elements i..i+7 of an fp32 or bf16 array, as fp32 lanes */
static inline __m256 vload8(const void *base, int dtype, int64_t i) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 vround_bf16(__m256 v) { /* as f32_to_bf16 (kept in fp32 lanes), 8 lanes */
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256i nan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)),
                                   _mm256_set1_epi32((int)0xffff0000u));
    __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan), isnan);
}

/* elements i..i+7 of an fp32 or bf16 array = v (for bf16, v already bf16-rounded) */
static inline void vstore(void *base, int dtype, int64_t i, __m256 v) {
    if (dtype == 0) {
        _mm256_storeu_ps((float *)base + i, v);
        return;
    }
    __m256i u = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)base + i), packed);
}
#endif

#if defined(__AVX512F__)
/* the bf16 bits of each fp32 lane of v (in the low half of each 32-bit lane), rounded as
 * f32_to_bf16: to nearest even, a NaN stays a quiet NaN, denormals kept (16 lanes) */
static inline __m512i round_bf16_16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i qnan = _mm512_srli_epi32(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, qnan);
}

#define VEC16 16

/* elements i..i+15 of an fp32 or bf16 array, as fp32 lanes */
static inline __m512 vload16(const void *base, int dtype, int64_t i) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 vround16_bf16(__m512 v) { /* as f32_to_bf16 (kept in fp32 lanes), 16 lanes */
    return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16_16(v), 16));
}

/* elements i..i+15 of an fp32 or bf16 array = v (for bf16, v already bf16-rounded) */
static inline void vstore16(void *base, int dtype, int64_t i, __m512 v) {
    if (dtype == 0) {
        _mm512_storeu_ps((float *)base + i, v);
        return;
    }
    const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), _mm512_cvtepi32_epi16(u));
}
#endif
#endif
