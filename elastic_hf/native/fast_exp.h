/* Vectorisable expf: Cephes' range reduction and polynomial (~1 ulp), shared by the kernels.
 *   exp_nonpositive: x <= 0 (a score minus its row max, in the attention kernels); inputs below -87.3 give
 *                    exp(-87.3) ~ 1e-38, a probability that rounds away in the sum.
 *   exp_any:         the whole float range (SiLU); above 88.7 it gives FLT_MAX's neighbourhood, not inf. */
#ifndef ELASTIC_HF_FAST_EXP_H
#define ELASTIC_HF_FAST_EXP_H

#include <math.h>
#include <stdint.h>

/* x in [-87.3, 88.7] */
#pragma omp declare simd
static inline float exp_in_range(float x)
{
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* x - n ln2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

#pragma omp declare simd
static inline float exp_nonpositive(float x)
{
    return exp_in_range(x < -87.3f ? -87.3f : x);
}

#pragma omp declare simd
static inline float exp_any(float x)
{
    return exp_in_range(x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x));
}

#endif
