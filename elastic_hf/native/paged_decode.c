/* Paged decode attention on the CPU: one new query token per sequence, K/V read in place from the head-centric KV
 * arena (no gather copy, no padding to the longest context). The arena holds fp32 or bf16 K/V; queries, scores,
 * the softmax and the output accumulate in fp32 either way (a bf16 value widens exactly to fp32 by a 16-bit
 * shift), so the bf16 entry point differs from the fp32 one only in how it loads K/V.
 *
 * The arena is addressed as chunks: chunk c is one [block_size, head_dim] K or V slab of one (block, layer,
 * kv head), contiguous, at kv_chunks + c * block_size * head_dim. chunk_table lists, for layer 0, the chunk id of
 * every (sequence, kv head, K/V, block) of the batch; a layer adds layer_chunk_offset to each id.
 *
 * Work is split over (sequence, kv head) pairs across OpenMP threads. The `group` query heads that share a kv head
 * (HF's repeat_kv order: head = kv_head * group + g) are handled by the same thread, so their K/V stays in L1/L2.
 * The softmax is the two-pass one of the reference path: all scores, their max, exp and sum, then V. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 1024

#include "fast_exp.h"

/* Element i of a K/V slab as fp32. kv_bf16 is a compile-time constant at every call (see attend_pair); the memcpy
 * is the type pun the vectoriser turns into a widening shift. */
static inline __attribute__((always_inline)) float load_kv(const void *base, int64_t i, const int kv_bf16)
{
    if (!kv_bf16) return ((const float *)base)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float widened;
    memcpy(&widened, &bits, sizeof widened);
    return widened;
}

/* One (sequence, kv head) pair. Always inlined into calls with a constant head_dim and K/V type, so the d loops
 * unroll, the type test folds away and the output accumulator lives in registers. q: [group] rows of head_dim at
 * q_head_stride; out: [group, head_dim]; kv_chunks: fp32 or (kv_bf16) bf16 elements. */
static inline __attribute__((always_inline)) void attend_pair(
    const float *q, int64_t q_head_stride, const void *kv_chunks, const int64_t *k_chunks,
    const int64_t *v_chunks, int64_t layer_chunk_offset, int64_t ctx, float *out, int group, int block_size,
    const int head_dim, float scale, float *scores /* [ctx] scratch */, const int kv_bf16)
{
    const int64_t chunk_numel = (int64_t)block_size * head_dim;
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * q_head_stride;
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const int64_t kb = (k_chunks[t0 / block_size] + layer_chunk_offset) * chunk_numel;
            const int64_t tn = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int64_t t = 0; t < tn; t++) {
                const int64_t kt = kb + t * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++) dot += qg[d] * load_kv(kv_chunks, kt + d, kv_bf16);
                scores[t0 + t] = dot * scale;
            }
        }
        float max = -FLT_MAX;
#pragma omp simd reduction(max : max)
        for (int64_t t = 0; t < ctx; t++) max = scores[t] > max ? scores[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; t++) {
            scores[t] = exp_nonpositive(scores[t] - max);
            sum += scores[t];
        }

        float acc[MAX_HEAD_DIM];
        for (int d = 0; d < head_dim; d++) acc[d] = 0.0f;
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const int64_t vb = (v_chunks[t0 / block_size] + layer_chunk_offset) * chunk_numel;
            const int64_t tn = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int64_t t = 0; t < tn; t++) {
                const float p = scores[t0 + t];
                const int64_t vt = vb + t * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[d] += p * load_kv(kv_chunks, vt + d, kv_bf16);
            }
        }
        const float inv_sum = 1.0f / sum;
        float *og = out + (int64_t)g * head_dim;
        for (int d = 0; d < head_dim; d++) og[d] = acc[d] * inv_sum;
    }
}

/* Returns 0, -1 when a thread's score buffer cannot be allocated, -2 for head_dim > MAX_HEAD_DIM. */
static inline __attribute__((always_inline)) int paged_decode(
    const float *q,                 /* [num_seqs, num_heads, head_dim], strides q_seq_stride, q_head_stride, 1 */
    int64_t q_seq_stride, int64_t q_head_stride,
    const void *kv_chunks,          /* arena as [num_chunks, block_size, head_dim], fp32 or (kv_bf16) bf16 */
    const int64_t *chunk_table,     /* [num_seqs, num_kv_heads, 2, max_blocks] chunk ids of layer 0 */
    int64_t layer_chunk_offset,
    const int64_t *ctx_lens,        /* [num_seqs] tokens each sequence attends to, in [1, max_blocks * block_size] */
    float *out,                     /* [num_seqs, num_heads, head_dim], strides out_seq_stride, head_dim, 1 */
    int64_t out_seq_stride,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    float scale, int num_threads, const int kv_bf16)
{
    if (head_dim > MAX_HEAD_DIM) return -2;
    const int group = num_heads / num_kv_heads;
    const int64_t max_ctx = (int64_t)max_blocks * block_size;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)max_ctx);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)num_seqs * num_kv_heads; item++) {
            if (scores == NULL) continue;
            const int64_t s = item / num_kv_heads;
            const int h = (int)(item % num_kv_heads);
            const int64_t *k_chunks = chunk_table + (s * num_kv_heads + h) * 2 * max_blocks;
            const int64_t *v_chunks = k_chunks + max_blocks;
            const float *qh = q + s * q_seq_stride + (int64_t)h * group * q_head_stride;
            float *oh = out + s * out_seq_stride + (int64_t)h * group * head_dim;
            /* constant head_dim in the common cases and a constant K/V type: see attend_pair. The type is
             * tested here, inside the OpenMP body, because both entry points share one outlined body. */
#define ATTEND(HEAD_DIM, KV_BF16)                                                                           \
    attend_pair(qh, q_head_stride, kv_chunks, k_chunks, v_chunks, layer_chunk_offset, ctx_lens[s], oh, group, \
                block_size, HEAD_DIM, scale, scores, KV_BF16)
            if (kv_bf16) {
                if (head_dim == 64) ATTEND(64, 1);
                else if (head_dim == 128) ATTEND(128, 1);
                else ATTEND(head_dim, 1);
            } else {
                if (head_dim == 64) ATTEND(64, 0);
                else if (head_dim == 128) ATTEND(128, 0);
                else ATTEND(head_dim, 0);
            }
#undef ATTEND
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

#define PAGED_DECODE_PARAMS                                                                                     \
    const float *q, int64_t q_seq_stride, int64_t q_head_stride, const void *kv_chunks,                         \
    const int64_t *chunk_table, int64_t layer_chunk_offset, const int64_t *ctx_lens, float *out,                \
    int64_t out_seq_stride, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,        \
    int max_blocks, float scale, int num_threads
#define PAGED_DECODE_ARGS                                                                                       \
    q, q_seq_stride, q_head_stride, kv_chunks, chunk_table, layer_chunk_offset, ctx_lens, out, out_seq_stride,  \
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads

/* K/V fp32 */
int elastic_paged_decode_f32(PAGED_DECODE_PARAMS) { return paged_decode(PAGED_DECODE_ARGS, 0); }

/* K/V bf16 (uint16 bit patterns); q and out stay fp32 */
int elastic_paged_decode_bf16kv(PAGED_DECODE_PARAMS) { return paged_decode(PAGED_DECODE_ARGS, 1); }
