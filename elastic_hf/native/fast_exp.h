/* exp for x <= 0 (a score minus its row max), vectorisable: Cephes' expf range reduction and polynomial (~1 ulp),
 * shared by the attention kernels. Inputs below -87.3 give exp(-87.3) ~ 1e-38, a probability that rounds away in
 * the sum. */
#ifndef ELASTIC_HF_FAST_EXP_H
#define ELASTIC_HF_FAST_EXP_H

#include <math.h>
#include <stdint.h>

#pragma omp declare simd
static inline float exp_nonpositive(float x)
{
    x = x < -87.3f ? -87.3f : x;
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

#endif
