/* AVX-512 register blocks of the fp32 prompt tiles' two GEMMs (attention_prefill.h): four
 * queries against up to 64 keys per step for the scores, four queries times up to 64 dims per
 * step for P V, in 512-bit registers (16 accumulators, where the AVX2 blocks hold 8 of 8 lanes),
 * and the masked online softmax 16 keys a step. The avx512 and avx512bf16 variants' fp32 path;
 * attention_prefill.h's AVX2 code elsewhere. Included by attention_prefill.h only. */
#ifndef LORAMUX_ATTENTION_PREFILL_512_H
#define LORAMUX_ATTENTION_PREFILL_512_H
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_TILES_512 1

_Static_assert(KEY_CHUNK == 64, "scores_quad covers a chunk with at most four blocks of 16 keys");

#define LMX_ALWAYS_INLINE static inline __attribute__((always_inline))

/* P[t][16z + j] = q_t . k_{16z + j} for the four queries at q0 (row stride D) and nz blocks of
 * 16 keys of kT (row d at kT + d * KEY_CHUNK); nz a constant after inlining. */
LMX_ALWAYS_INLINE void scores_quad_z(const float *q0, int D, const float *kT, float *P, const int nz) {
    __m512 s[4][4];
    for (int t = 0; t < 4; t++)
        for (int z = 0; z < nz; z++) s[t][z] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 k[4];
        for (int z = 0; z < nz; z++) k[z] = _mm512_loadu_ps(kT + (int64_t)d * KEY_CHUNK + 16 * z);
        for (int t = 0; t < 4; t++) {
            const __m512 b = _mm512_set1_ps(q0[(int64_t)t * D + d]);
            for (int z = 0; z < nz; z++) s[t][z] = _mm512_fmadd_ps(b, k[z], s[t][z]);
        }
    }
    for (int t = 0; t < 4; t++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(P + (int64_t)t * KEY_CHUNK + 16 * z, s[t][z]);
}

/* The four queries' scores over the chunk's nsub (1..4) blocks of 16 keys. */
static inline void scores_quad(const float *q0, int D, int nsub, const float *kT, float *P) {
    switch (nsub) {
    case 4: scores_quad_z(q0, D, kT, P, 4); break;
    case 3: scores_quad_z(q0, D, kT, P, 3); break;
    case 2: scores_quad_z(q0, D, kT, P, 2); break;
    default: scores_quad_z(q0, D, kT, P, 1); break;
    }
}

/* acc_t[d0 .. d0 + 16 nz) = acc_t * cr[t] + sum_j P[t][j] v_j for the four queries (acc row
 * stride D, P row stride KEY_CHUNK); nz a constant after inlining. */
LMX_ALWAYS_INLINE void accumulate_quad_z(const float *cr, int D, int d0, int cnt, const float *const *vrow,
                                         const float *P, float *acc, const int nz) {
    __m512 a[4][4];
    for (int t = 0; t < 4; t++) {
        const __m512 c = _mm512_set1_ps(cr[t]);
        for (int z = 0; z < nz; z++) a[t][z] = _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)t * D + d0 + 16 * z), c);
    }
    for (int j = 0; j < cnt; j++) {
        __m512 v[4];
        for (int z = 0; z < nz; z++) v[z] = _mm512_loadu_ps(vrow[j] + d0 + 16 * z);
        for (int t = 0; t < 4; t++) {
            const __m512 b = _mm512_set1_ps(P[(int64_t)t * KEY_CHUNK + j]);
            for (int z = 0; z < nz; z++) a[t][z] = _mm512_fmadd_ps(b, v[z], a[t][z]);
        }
    }
    for (int t = 0; t < 4; t++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(acc + (int64_t)t * D + d0 + 16 * z, a[t][z]);
}

/* The four queries' acc = acc * cr + P V over the chunk's cnt values, 64 dims a step, then 16;
 * returns the first dim left (D mod 16 of them) for the caller's scalar tail. */
static inline int accumulate_quad_vec(const float *cr, int D, int cnt, const float *const *vrow, const float *P,
                                      float *acc) {
    int d = 0;
    for (; d + 64 <= D; d += 64) accumulate_quad_z(cr, D, d, cnt, vrow, P, acc, 4);
    for (; d + 16 <= D; d += 16) accumulate_quad_z(cr, D, d, cnt, vrow, P, acc, 1);
    return d;
}
/* exp(x) for x <= 0: attention_vec.h's exp8 (Cephes polynomial, ~1 ulp) on 16 lanes */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 fx = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

/* attention_prefill.h's masked online softmax, 16 keys a step: each query's row of P becomes
 * exp(s - new max) on its visible keys jmin..jmax (causal from qpos, the sliding window) and 0
 * elsewhere; cr[i] the correction of its running max mx[i], ls[i] its running sum. */
static inline void tile_softmax(int M, int G, int qpos, int c0, int cnt, int window, float *P, float *cr,
                                float *mx, float *ls) {
    const int nsub = (cnt + 15) / 16;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < M; i++) {
        const int pos = qpos + i / G;
        const int jmax = pos - c0 < cnt - 1 ? pos - c0 : cnt - 1;
        const int jmin = window > 0 && pos - window + 1 - c0 > 0 ? pos - window + 1 - c0 : 0;
        float *p = P + (int64_t)i * KEY_CHUNK;
        cr[i] = 1.0f;
        if (jmax < jmin) {
            memset(p, 0, sizeof(float) * cnt);
            continue;
        }
        __mmask16 keep[4];
        __m512 bmax = _mm512_set1_ps(-INFINITY);
        for (int b = 0; b < nsub; b++) {
            const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * b));
            keep[b] = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(jmin)) &
                      _mm512_cmple_epi32_mask(idx, _mm512_set1_epi32(jmax));
            bmax = _mm512_mask_max_ps(bmax, keep[b], bmax, _mm512_loadu_ps(p + 16 * b));
        }
        const float top = _mm512_reduce_max_ps(bmax), newm = top > mx[i] ? top : mx[i];
        const __m512 mv = _mm512_set1_ps(newm);
        __m512 sum = _mm512_setzero_ps();
        for (int b = 0; b < nsub; b++) {
            const __m512 e = _mm512_maskz_mov_ps(keep[b], exp16(_mm512_sub_ps(_mm512_loadu_ps(p + 16 * b), mv)));
            _mm512_storeu_ps(p + 16 * b, e);
            sum = _mm512_add_ps(sum, e);
        }
        cr[i] = expf(mx[i] - newm); /* 0 when mx[i] is -inf */
        ls[i] = ls[i] * cr[i] + _mm512_reduce_add_ps(sum);
        mx[i] = newm;
    }
}
#endif
#endif
