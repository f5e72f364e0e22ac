/* Causal attention of one prompt chunk, grouped-query heads, fp32: num_queries new tokens at the end of a context
 * of num_keys tokens (num_queries == num_keys for a prompt whose whole context is in the step), query row i at
 * position num_keys - num_queries + i sees keys 0 .. its own position. SDPA's CPU flash kernel does its products through the BLAS sgemm, which on CPUs
 * without Intel's dispatch runs far below the vector units' peak (3 ms a layer at 460 tokens on the 2-core test
 * machine, ~80 GFLOP/s); this kernel keeps every product in registers instead.
 *
 * Flash-style online softmax, per (kv head, block of QUERY_BLOCK query rows) work item:
 *   - K of the kv head is transposed once per call into kt[head_dim][T] (scratch), so a score row for KEY_BLOCK
 *     keys is head_dim broadcast-FMAs into KEY_BLOCK-wide accumulators, no horizontal sums;
 *   - ROWS query rows go through the keys together, sharing every K^T and V load;
 *   - each row keeps its running max, sum and [head_dim] accumulator; a key block rescales them once.
 * Masked keys (after the row's own position) get probability exactly 0. The `group` query heads of a kv head
 * (HF's repeat_kv order: head = kv_head * group + g) are handled by the item that holds the kv head's K/V. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef KEY_BLOCK
#define KEY_BLOCK 32
#endif
#ifndef ROWS
#define ROWS 8
#endif
#ifndef QUERY_BLOCK
#define QUERY_BLOCK 16
#endif
#define MAX_HEAD_DIM 256

#include "fast_exp.h"

/* ROWS consecutive query rows (i0 .. i0 + rows - 1, at positions offset + i) of one head against keys 0 .. their
 * own positions. Always inlined with a constant head_dim so the d loops unroll and the accumulators stay in
 * registers. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, int64_t q_tok_stride, int64_t i0, int rows, int64_t offset, const float *kt, int64_t kt_stride,
    const float *v, int64_t v_tok_stride, float *out, int64_t out_tok_stride, const int head_dim, float scale)
{
    float acc[ROWS][MAX_HEAD_DIM];
    float qs[ROWS][MAX_HEAD_DIM];
    float row_max[ROWS], row_sum[ROWS];
    for (int r = 0; r < ROWS; r++) {
        row_max[r] = -FLT_MAX;
        row_sum[r] = 0.0f;
        for (int d = 0; d < head_dim; d++) {
            acc[r][d] = 0.0f;
            /* rows past the block's end repeat its last row: computed, never written */
            qs[r][d] = q[(i0 + (r < rows ? r : rows - 1)) * q_tok_stride + d] * scale;
        }
    }
    const int64_t last = offset + i0 + rows - 1;   /* the block's last row sees keys 0 .. last */
    for (int64_t j0 = 0; j0 <= last; j0 += KEY_BLOCK) {
        float s[ROWS][KEY_BLOCK];
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < KEY_BLOCK; j++) s[r][j] = 0.0f;
        for (int d = 0; d < head_dim; d++) {
            const float *ktd = kt + d * kt_stride + j0;   /* padded: KEY_BLOCK readable past T */
            for (int r = 0; r < ROWS; r++) {
                const float qd = qs[r][d];
#pragma omp simd
                for (int j = 0; j < KEY_BLOCK; j++) s[r][j] += qd * ktd[j];
            }
        }
        const int64_t num_keys = last + 1 - j0 < KEY_BLOCK ? last + 1 - j0 : KEY_BLOCK;
        for (int r = 0; r < ROWS; r++) {
            const int64_t visible = offset + i0 + r - j0 + 1;   /* keys j0 .. its position are visible to row r */
            float block_max = -FLT_MAX;
            for (int j = 0; j < KEY_BLOCK; j++)
                block_max = (j < visible && s[r][j] > block_max) ? s[r][j] : block_max;
            const float new_max = block_max > row_max[r] ? block_max : row_max[r];
            const float alpha = exp_nonpositive(row_max[r] - new_max);
            float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
            for (int j = 0; j < KEY_BLOCK; j++) {
                const float p = j < visible ? exp_nonpositive(s[r][j] - new_max) : 0.0f;
                s[r][j] = p;
                block_sum += p;
            }
            row_sum[r] = row_sum[r] * alpha + block_sum;
            row_max[r] = new_max;
            for (int d = 0; d < head_dim; d++) acc[r][d] *= alpha;
        }
        for (int64_t j = 0; j < num_keys; j++) {
            const float *vj = v + (j0 + j) * v_tok_stride;
            for (int r = 0; r < ROWS; r++) {
                const float p = s[r][j];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[r][d] += p * vj[d];
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / row_sum[r];
        float *o = out + (i0 + r) * out_tok_stride;
        for (int d = 0; d < head_dim; d++) o[d] = acc[r][d] * inv;
    }
}

/* Returns 0, -1 when the K^T scratch cannot be allocated, -2 for head_dim > MAX_HEAD_DIM, heads that do not
 * divide or more queries than keys. Strides are in elements; within a row head_dim is contiguous. */
int elastic_causal_prefill_f32(
    const float *q, int64_t q_tok_stride, int64_t q_head_stride,    /* [num_queries, num_heads, head_dim] */
    const float *k, int64_t k_tok_stride, int64_t k_head_stride,    /* [num_keys, num_kv_heads, head_dim] */
    const float *v, int64_t v_tok_stride, int64_t v_head_stride,    /* [num_keys, num_kv_heads, head_dim] */
    float *out, int64_t out_tok_stride, int64_t out_head_stride,    /* [num_queries, num_heads, head_dim] */
    int64_t num_queries, int64_t num_keys, int num_heads, int num_kv_heads, int head_dim, float scale,
    int num_threads)
{
    if (head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_queries > num_keys)
        return -2;
    const int64_t num_tokens = num_keys;                /* K^T covers the whole context */
    const int64_t offset = num_keys - num_queries;      /* position of query row 0 */
    const int group = num_heads / num_kv_heads;
    /* K^T per kv head, each row padded by a key block so a block's loads never leave the buffer */
    const int64_t kt_stride = num_tokens + KEY_BLOCK;
    float *kt = (float *)calloc((size_t)num_kv_heads * head_dim * kt_stride, sizeof(float));
    if (kt == NULL) return -1;
    const int64_t num_query_blocks = (num_queries + QUERY_BLOCK - 1) / QUERY_BLOCK;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_kv_heads * num_tokens; item++) {
            const int h = (int)(item / num_tokens);
            const int64_t t = item % num_tokens;
            const float *kr = k + t * k_tok_stride + h * k_head_stride;
            float *dst = kt + (int64_t)h * head_dim * kt_stride + t;
            for (int d = 0; d < head_dim; d++) dst[d * kt_stride] = kr[d];
        }
        /* the blocks at the end of the prompt see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_kv_heads * num_query_blocks; item++) {
            const int h = (int)(item % num_kv_heads);
            const int64_t block = num_query_blocks - 1 - item / num_kv_heads;
            const int64_t first = block * QUERY_BLOCK;
            const int64_t end = first + QUERY_BLOCK < num_queries ? first + QUERY_BLOCK : num_queries;
            const float *kth = kt + (int64_t)h * head_dim * kt_stride;
            const float *vh = v + h * v_head_stride;
            for (int g = 0; g < group; g++) {
                const int head = h * group + g;
                const float *qh = q + head * q_head_stride;
                float *oh = out + head * out_head_stride;
                for (int64_t i0 = first; i0 < end; i0 += ROWS) {
                    const int rows = end - i0 < ROWS ? (int)(end - i0) : ROWS;
#define ATTEND(HEAD_DIM) attend_rows(qh, q_tok_stride, i0, rows, offset, kth, kt_stride, vh, v_tok_stride, oh, \
                                     out_tok_stride, HEAD_DIM, scale)
                    if (head_dim == 64) ATTEND(64);
                    else if (head_dim == 128) ATTEND(128);
                    else ATTEND(head_dim);
#undef ATTEND
                }
            }
        }
    }
    free(kt);
    return 0;
}
