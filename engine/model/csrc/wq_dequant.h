/* wq_linear.c's band dequantizer (included by it only, after its widen / stored / vector
 * macros): rows of W as (stored - zero) * scale, fp32 or bf16 rounded once -- the bands
 * quant_ops.cpp hands to ATen's GEMM from a variant's dense rows. */
#ifndef LORAMUX_WQ_DEQUANT_H
#define LORAMUX_WQ_DEQUANT_H

/* W rows n0..n1 dequantized, (stored - zero) * scale in fp32, into out [n1 - n0, K]: fp32 (od 0)
 * or bf16 rounded once (od 1) -- the band the large-M path hands to oneDNN (quant_ops.cpp) */
#if defined(__AVX512F__)
static inline void store_deq(void *out, int od, int64_t i, __m512 v) {
    if (od == 0) {
        _mm512_storeu_ps((float *)out + i, v);
        return;
    }
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), (__m256i)_mm512_cvtneps_pbh(v)); /* RNE */
#else
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(round_bf16_16(v))); /* as f32_to_bf16 */
#endif
}
#elif defined(WL)
static inline void store_deq(void *out, int od, int64_t i, __m256 v) {
    vstore(out, od, i, od == 0 ? v : vround_bf16(v));
}
#endif

static void dequant_row(const uint8_t *row, int bits, const float *scale, const float *zero, int G,
                        int group, int K, void *out, int od) {
    for (int g = 0; g < G; g++) {
        const float s = scale[g], z = zero ? zero[g] : (bits == 4 ? 8.0f : 0.0f);
        const int k1 = (g + 1) * group < K ? (g + 1) * group : K;
        int k = g * group;
#ifdef WL
        const vf vs = VSET(s), vz = VSET(z);
        for (; k + 32 <= k1; k += 32) {
            vf wv[NV];
            widen(row + k / 32 * LMX_WQ_WIDTH(bits) * 4, bits, wv);
            for (int i = 0; i < NV; i++) store_deq(out, od, k + XOFF[i], VDEQ(wv[i], vz, vs));
        }
#endif
        for (; k < k1; k++) { /* the scalar variant, and a row's last values past a block of 32 */
            const float v = (stored(row, bits, k) - z) * s;
            if (od == 0) ((float *)out)[k] = v;
            else ((uint16_t *)out)[k] = f32_to_bf16(v);
        }
    }
}

void LMX_FN(loramux_wq_dequantize)(const uint8_t *w, int bits, const float *scale, const float *zero,
                                   int G, int group, int n0, int n1, int K, int Kp, void *out, int od,
                                   int nthreads) {
    const int64_t row_bytes = (int64_t)Kp * LMX_WQ_WIDTH(bits) / 8, esize = od == 0 ? 4 : 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)(n1 - n0) * K >= PARALLEL_MIN_MACS)
    for (int n = n0; n < n1; n++)
        dequant_row(w + n * row_bytes, bits, scale + (int64_t)n * G, zero ? zero + (int64_t)n * G : NULL, G,
                    group, K, (char *)out + (n - n0) * K * esize, od);
}

#endif
