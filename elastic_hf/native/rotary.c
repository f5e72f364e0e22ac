/* HF's apply_rotary_pos_emb (Llama, Qwen2, Mistral: q * cos + rotate_half(q) * sin, rotate_half(x) = [-x2, x1])
 * for the queries and keys of one layer in one pass, fp32 or bf16, bit for bit what eager torch computes.
 *
 * Eager torch spends ~12 ops on it (two slices, neg, cat, two muls and an add, for q and for k), each over a
 * strided [heads, tokens, head_dim] view: 2.7 ms a layer for a 2,048-token bf16 prefill on the 2-core test
 * machine, ~1 ms in fp32, and ~35 us a layer at a 32-sequence decode step. This reads each element once.
 *
 * Exactness: torch rounds each product to the dtype, then the sum: out = round(round(x * c) + round(r * s)). In
 * fp32 that is plain float arithmetic as long as the compiler does not contract it into an FMA (this file is built
 * with -ffp-contract=off and without fast-math flags); in bf16 the product of two bf16 values is exact in fp32, so
 * rounding it to bf16 gives torch's product, and the fp32 sum of two bf16 values rounded to bf16 gives torch's sum.
 * rotate_half's negation is exact, and round(-a) = -round(a), so x * c + (-x2) * s is computed as x * c - x2 * s. */
#include <stdint.h>

#include "bf16.h"

#define PARALLEL_MIN_ELEMENTS 32768 /* torch's grain size for elementwise kernels */

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* One [head_dim] row. */
static inline void rotate_row_f32(const float *x, const float *c, const float *s, float *out, int64_t half)
{
#pragma omp simd
    for (int64_t d = 0; d < half; d++) {
        const float a = x[d] * c[d];
        const float b = x[d + half] * s[d];
        out[d] = a - b;
    }
#pragma omp simd
    for (int64_t d = half; d < 2 * half; d++) {
        const float a = x[d] * c[d];
        const float b = x[d - half] * s[d];
        out[d] = a + b;
    }
}

static inline void rotate_row_bf16(const uint16_t *x, const uint16_t *c, const uint16_t *s, uint16_t *out,
                                   int64_t half)
{
#pragma omp simd
    for (int64_t d = 0; d < half; d++) {
        const float a = round_bf16(bf16_to_f32(x[d]) * bf16_to_f32(c[d]));
        const float b = round_bf16(bf16_to_f32(x[d + half]) * bf16_to_f32(s[d]));
        out[d] = f32_to_bf16(a - b);
    }
#pragma omp simd
    for (int64_t d = half; d < 2 * half; d++) {
        const float a = round_bf16(bf16_to_f32(x[d]) * bf16_to_f32(c[d]));
        const float b = round_bf16(bf16_to_f32(x[d - half]) * bf16_to_f32(s[d]));
        out[d] = f32_to_bf16(a + b);
    }
}

/* Tensors, all with head_dim contiguous (strides in elements):
 *   q [q_heads, tokens, head_dim] at (q_head_stride, q_tok_stride), k [k_heads, tokens, head_dim] likewise;
 *   cos, sin [tokens, head_dim] at cs_tok_stride (shared by every head);
 *   q_out, k_out like q and k at their own strides.
 * head_dim must be even. Rows (token, head) of q and k are spread over OpenMP threads when there are enough. */
#define ROTARY_PARAMS(T)                                                                                        \
    const T *q, int64_t q_head_stride, int64_t q_tok_stride, int64_t q_heads,                                   \
    const T *k, int64_t k_head_stride, int64_t k_tok_stride, int64_t k_heads,                                   \
    const T *cos, const T *sin, int64_t cs_tok_stride,                                                          \
    T *q_out, int64_t q_out_head_stride, int64_t q_out_tok_stride,                                              \
    T *k_out, int64_t k_out_head_stride, int64_t k_out_tok_stride,                                              \
    int64_t tokens, int64_t head_dim, int num_threads

/* Row `item` of the (token, head) rows, q's heads before k's: its input, output and table offsets. */
#define ROTARY_ROW(ROTATE)                                                                                      \
    const int64_t t = item / heads, h = item % heads;                                                          \
    if (h < q_heads)                                                                                            \
        ROTATE(q + h * q_head_stride + t * q_tok_stride, cos + t * cs_tok_stride, sin + t * cs_tok_stride,     \
               q_out + h * q_out_head_stride + t * q_out_tok_stride, head_dim / 2);                             \
    else                                                                                                        \
        ROTATE(k + (h - q_heads) * k_head_stride + t * k_tok_stride, cos + t * cs_tok_stride,                   \
               sin + t * cs_tok_stride, k_out + (h - q_heads) * k_out_head_stride + t * k_out_tok_stride,       \
               head_dim / 2);

int elastic_rotary_f32(ROTARY_PARAMS(float))
{
    const int64_t heads = q_heads + k_heads;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t item = 0; item < tokens * heads; item++) {
        ROTARY_ROW(rotate_row_f32)
    }
    return 0;
}

int elastic_rotary_bf16(ROTARY_PARAMS(uint16_t))
{
    const int64_t heads = q_heads + k_heads;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t item = 0; item < tokens * heads; item++) {
        ROTARY_ROW(rotate_row_bf16)
    }
    return 0;
}
