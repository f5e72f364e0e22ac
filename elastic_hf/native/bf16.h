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

#endif
