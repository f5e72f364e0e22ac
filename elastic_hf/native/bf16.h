/* bf16 <-> fp32 as torch's CPU kernels do it: a bf16 widens exactly by a 16-bit shift; fp32 rounds to nearest
 * even, NaN stays a (quiet) NaN. Shared by the kernels that take bf16 tensors. */
#ifndef ELASTIC_HF_BF16_H
#define ELASTIC_HF_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t v)
{
    union { uint32_t i; float f; } u = { .i = (uint32_t)v << 16 };
    return u.f;
}

static inline uint16_t f32_to_bf16(float f)
{
    union { float f; uint32_t i; } u = { .f = f };
    if ((u.i & 0x7fffffffu) > 0x7f800000u)  /* NaN stays NaN (quiet) */
        return (uint16_t)((u.i >> 16) | 0x0040u);
    u.i += 0x7fffu + ((u.i >> 16) & 1u);    /* round to nearest even */
    return (uint16_t)(u.i >> 16);
}

#if defined(__AVX2__)
#include <immintrin.h>

/* 8 fp32 lanes -> 8 bf16, f32_to_bf16's rule in integer ops (an AVX2 CPU has no bf16 conversion instruction) */
static inline __attribute__((always_inline)) __m128i f32x8_to_bf16(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                                              16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);          /* [8] 32-bit lanes, each < 2^16 */
    /* packus interleaves the two 128-bit lanes: qwords 0 and 2 hold outputs 0-3 and 4-7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
#endif

#endif
