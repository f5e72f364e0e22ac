/* The elementwise work of a Llama-family decoder layer in one pass each, for fp32 and bf16 rows:
 *
 *   RMSNorm (HF's LlamaRMSNorm): h = x in fp32, h * 1/sqrt(mean(h^2) + eps), rounded to x's dtype, times the weight
 *     (the product rounded to the weight's dtype). Eager torch spends 5-7 ops and as many passes over the rows.
 *   SwiGLU: silu(gate) * up over the [rows, 2 * inter] product of the fused gate/up GEMM, gate the first half of
 *     each row; silu rounded to the dtype before the product, as torch's two ops do. Eager torch reads the
 *     strided gate half once for silu and again for the product.
 *
 * bf16 arithmetic follows torch's CPU kernels: widen to fp32 exactly, compute in fp32, round to nearest even. The
 * sum of squares is taken in another order than torch's reduction, so fp32 results can differ in the last bit.
 *
 * Rows are spread over OpenMP threads (torch's runtime, see build.py) only when the work is large enough to pay
 * for waking them: a decode step's few rows run on the calling thread. */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#include "fast_exp.h"

#define PARALLEL_MIN_ELEMENTS 32768 /* torch's grain size for elementwise kernels */


#pragma omp declare simd
static inline float silu(float g)
{
    return g / (1.0f + exp_any(-g));
}

/* ------------------------------------------------------------------ RMSNorm */
static inline float inverse_rms_f32(const float *x, int64_t dim, float eps)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < dim; j++)
        sum += x[j] * x[j];
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

int elastic_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t out_stride,
                         int64_t rows, int64_t dim, float eps, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * x_stride;
        float *oi = out + i * out_stride;
        const float inv = inverse_rms_f32(xi, dim, eps);
#pragma omp simd
        for (int64_t j = 0; j < dim; j++)
            oi[j] = weight[j] * (xi[j] * inv);
    }
    return 0;
}

/* elements [start, dim) of a row from its inverse RMS, rounding in software (f32_to_bf16) */
static inline void rms_norm_bf16_span(const uint16_t *xi, const uint16_t *weight, uint16_t *oi, int64_t start,
                                      int64_t dim, float inv)
{
#pragma omp simd
    for (int64_t j = start; j < dim; j++) {
        const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xi[j]) * inv)); /* .to(input_dtype) */
        oi[j] = f32_to_bf16(bf16_to_f32(weight[j]) * normed);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_ROUNDING 1

static inline __m512 widen_bf16x16(__m256i v)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* One row with AVX512-BF16's vcvtneps2bf16 doing both roundings (nearest even, as f32_to_bf16; denormal results
 * become zero): the emulated rounding made this 3-4x slower. The sum of squares in 16 lanes, squares rounded
 * before they are added as torch's pow-then-mean does. */
static void rms_norm_bf16_row(const uint16_t *xi, const uint16_t *weight, uint16_t *oi, int64_t dim, float eps)
{
    __m512 squares = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= dim; j += 16) {
        const __m512 v = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(xi + j)));
        squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
    }
    float sum = _mm512_reduce_add_ps(squares);
    for (int64_t t = j; t < dim; t++) {
        const float v = bf16_to_f32(xi[t]);
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (j = 0; j + 16 <= dim; j += 16) {
        const __m512 v = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(xi + j)));
        const __m512 normed = widen_bf16x16((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, vinv)));
        const __m512 w = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(weight + j)));
        _mm256_storeu_si256((__m256i *)(oi + j), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(w, normed)));
    }
    rms_norm_bf16_span(xi, weight, oi, j, dim, inv);
}
#else
static void rms_norm_bf16_row(const uint16_t *xi, const uint16_t *weight, uint16_t *oi, int64_t dim, float eps)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < dim; j++) {
        const float v = bf16_to_f32(xi[j]);
        sum += v * v;
    }
    rms_norm_bf16_span(xi, weight, oi, 0, dim, 1.0f / sqrtf(sum / (float)dim + eps));
}
#endif

int elastic_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight, uint16_t *out,
                          int64_t out_stride, int64_t rows, int64_t dim, float eps, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < rows; i++)
        rms_norm_bf16_row(x + i * x_stride, weight, out + i * out_stride, dim, eps);
    return 0;
}

/* ------------------------------------------------------------------ SwiGLU */
int elastic_silu_mul_f32(const float *restrict gate_up, int64_t in_stride, float *restrict out, int64_t out_stride, int64_t rows,
                         int64_t inter, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < rows; i++) {
        const float *restrict gate = gate_up + i * in_stride;
        const float *restrict up = gate + inter;
        float *restrict oi = out + i * out_stride;
#pragma omp simd
        for (int64_t j = 0; j < inter; j++)
            oi[j] = silu(gate[j]) * up[j];
    }
    return 0;
}

/* silu(gate) * up for elements [start, end) of one row, rounding in software (f32_to_bf16) */
static inline void silu_mul_bf16_span(const uint16_t *restrict gate, const uint16_t *restrict up,
                                      uint16_t *restrict out, int64_t start, int64_t end)
{
#pragma omp simd
    for (int64_t j = start; j < end; j++) {
        const float activated = bf16_to_f32(f32_to_bf16(silu(bf16_to_f32(gate[j]))));
        out[j] = f32_to_bf16(activated * bf16_to_f32(up[j]));
    }
}

#if defined(HAVE_BF16_ROUNDING)
#define SILU_TILE 64

/* The same row with AVX512-BF16's vcvtneps2bf16 doing both roundings (nearest even, NaN stays a quiet NaN, as
 * f32_to_bf16) instead of the emulated rounding, which made this loop 2x its fp32 twin. The instruction treats
 * denormal inputs (|x| < 2^-126) as zero, where torch keeps them: results differ only there. */
static void silu_mul_bf16_row(const uint16_t *restrict gate, const uint16_t *restrict up, uint16_t *restrict out,
                              int64_t inter)
{
    float activated[SILU_TILE];
    int64_t j = 0;
    for (; j + SILU_TILE <= inter; j += SILU_TILE) {
#pragma omp simd
        for (int k = 0; k < SILU_TILE; k++)
            activated[k] = silu(bf16_to_f32(gate[j + k]));
        for (int k = 0; k < SILU_TILE; k += 16) {
            const __m256bh a = _mm512_cvtneps_pbh(_mm512_loadu_ps(activated + k));      /* .to(bf16) */
            const __m512 u = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(up + j + k)));
            const __m256bh product = _mm512_cvtneps_pbh(_mm512_mul_ps(widen_bf16x16((__m256i)a), u));
            _mm256_storeu_si256((__m256i *)(out + j + k), (__m256i)product);
        }
    }
    silu_mul_bf16_span(gate, up, out, j, inter);
}
#else
static void silu_mul_bf16_row(const uint16_t *restrict gate, const uint16_t *restrict up, uint16_t *restrict out,
                              int64_t inter)
{
    silu_mul_bf16_span(gate, up, out, 0, inter);
}
#endif

int elastic_silu_mul_bf16(const uint16_t *restrict gate_up, int64_t in_stride, uint16_t *restrict out, int64_t out_stride,
                          int64_t rows, int64_t inter, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *gate = gate_up + i * in_stride;
        silu_mul_bf16_row(gate, gate + inter, out + i * out_stride, inter);
    }
    return 0;
}
