/* Vectorisable expf: Cephes' range reduction and polynomial (~1 ulp), shared by the kernels.
 *   exp_nonpositive: x <= 0 (a score minus its row max, in the attention kernels); inputs below -87.3 give
 *                    exp(-87.3) ~ 1e-38, a probability that rounds away in the sum.
 *   exp_any:         the whole float range (SiLU); above 88.7 it gives FLT_MAX's neighbourhood, not inf.
 *   exp_nonpositive_avx512: exp_nonpositive on 16 lanes of intrinsics (where the compiler's vectorised loop would
 *                    leave the kernel's registers), with the same constants; exp_nonpositive_avx2 the same on 8. */
#ifndef ELASTIC_HF_FAST_EXP_H
#define ELASTIC_HF_FAST_EXP_H

#include <math.h>
#include <stdint.h>

/* the constants of both widths: log2(e), ln 2 in two parts, the polynomial's coefficients, the clamps */
#define FAST_EXP_LOG2E 1.44269504088896341f
#define FAST_EXP_LN2_HI 0.693359375f
#define FAST_EXP_LN2_LO 2.12194440e-4f
#define FAST_EXP_P0 1.9875691500e-4f
#define FAST_EXP_P1 1.3981999507e-3f
#define FAST_EXP_P2 8.3334519073e-3f
#define FAST_EXP_P3 4.1665795894e-2f
#define FAST_EXP_P4 1.6666665459e-1f
#define FAST_EXP_P5 5.0000001201e-1f
#define FAST_EXP_MIN -87.3f
#define FAST_EXP_MAX 88.7f

/* x in [FAST_EXP_MIN, FAST_EXP_MAX] */
#pragma omp declare simd
static inline float exp_in_range(float x)
{
    const float n = floorf(x * FAST_EXP_LOG2E + 0.5f);
    const float r = x - n * FAST_EXP_LN2_HI + n * FAST_EXP_LN2_LO;  /* x - n ln2 in two parts */
    float p = FAST_EXP_P0;
    p = p * r + FAST_EXP_P1;
    p = p * r + FAST_EXP_P2;
    p = p * r + FAST_EXP_P3;
    p = p * r + FAST_EXP_P4;
    p = p * r + FAST_EXP_P5;
    p = p * r * r + r + 1.0f;
    const union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

#pragma omp declare simd
static inline float exp_nonpositive(float x)
{
    return exp_in_range(x < FAST_EXP_MIN ? FAST_EXP_MIN : x);
}

#pragma omp declare simd
static inline float exp_any(float x)
{
    return exp_in_range(x < FAST_EXP_MIN ? FAST_EXP_MIN : (x > FAST_EXP_MAX ? FAST_EXP_MAX : x));
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 exp_nonpositive_avx512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(FAST_EXP_MIN));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(FAST_EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(FAST_EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(FAST_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(FAST_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(FAST_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(FAST_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(FAST_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(FAST_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(FAST_EXP_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_nonpositive on 8 lanes (AVX2 + FMA), the same constants and steps as exp_nonpositive_avx512 */
static inline __attribute__((always_inline)) __m256 exp_nonpositive_avx2(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(FAST_EXP_MIN));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(FAST_EXP_LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(FAST_EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(FAST_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(FAST_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FAST_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FAST_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FAST_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FAST_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(FAST_EXP_P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

#endif
