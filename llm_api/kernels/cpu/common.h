/* What the CPU kernels' C files share (kernels.c, quant.c): bfloat16 conversions, a value of a tensor's
 * dtype read or written as float, and the horizontal sum of an AVX2 register. Static inline, so each file
 * compiles its own copy and the library exports nothing from here. */
#ifndef LLM_API_CPU_COMMON_H
#define LLM_API_CPU_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline uint16_t f32_to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* a NaN stays a NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* A value of the tensor's dtype (dtype 0: float32, 1: bfloat16) as float, and a float rounded into one. */
static inline float load_as_f32(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void store_from_f32(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v); else ((float *)p)[i] = v;
}
static inline float rounded(float v, int bf16) { return bf16 ? round_bf16(v) : v; }

#if defined(__AVX2__)
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

static inline size_t size_of(int bf16) { return bf16 ? 2 : 4; }

#endif
