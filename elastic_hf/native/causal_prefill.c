/* Causal attention of prompt chunks (all of one step's, in one call), grouped-query heads, fp32: per sequence,
 * num_queries new tokens at the end of a context of num_keys tokens (num_queries == num_keys for a prompt whose
 * whole context is in the step), query row i at position num_keys - num_queries + i sees keys 0 .. its own
 * position. SDPA's CPU flash kernel does its products through the BLAS sgemm, which on CPUs without Intel's
 * dispatch runs far below the vector units' peak (3 ms a layer at 460 tokens on the 2-core test machine,
 * ~80 GFLOP/s); this kernel keeps every product in registers instead.
 *
 * Flash-style online softmax, per (sequence, kv head, block of QUERY_BLOCK query rows) work item, largest first:
 *   - K of each (sequence, kv head) is transposed once per call into kt[head_dim][T] (scratch), so a score row for KEY_BLOCK
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

/* One work item: a block of QUERY_BLOCK query rows of one sequence and one kv head (with its query heads). */
struct work_item {
    int32_t seq;
    int32_t kv_head;
    int64_t block;
    int64_t cost;       /* keys the block's last row sees: the item's work, for largest-first scheduling */
};

static int by_cost_descending(const void *a, const void *b)
{
    const int64_t ca = ((const struct work_item *)a)->cost, cb = ((const struct work_item *)b)->cost;
    return (ca < cb) - (ca > cb);
}

/* Causal attention of num_seqs prompt chunks in one call (one step's prefills of one layer), so the threads share
 * one pool of work items across sequences instead of a parallel region per sequence. Sequence s has
 * num_queries[s] query rows at the end of its num_keys[s] keys; its tensors are at the addresses q/k/v/out[s] with
 * strides[8 s .. 8 s + 7] = q token, q head, k token, k head, v token, v head, out token, out head (in elements;
 * within a row head_dim is contiguous): q/out [num_queries, num_heads, head_dim], k/v [num_keys, num_kv_heads,
 * head_dim].
 * Returns 0, -1 when scratch cannot be allocated, -2 for head_dim > MAX_HEAD_DIM, heads that do not divide or a
 * sequence with no queries or more queries than keys. */
int elastic_causal_prefill_varlen_f32(
    int num_seqs, const int64_t *q_addr, const int64_t *k_addr, const int64_t *v_addr, const int64_t *out_addr,
    const int64_t *strides, const int64_t *num_queries, const int64_t *num_keys,
    int num_heads, int num_kv_heads, int head_dim, float scale, int num_threads)
{
    if (head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads != 0)
        return -2;
    const int group = num_heads / num_kv_heads;
    int64_t kt_total = 0, num_items = 0;
    for (int s = 0; s < num_seqs; s++) {
        if (num_queries[s] < 1 || num_queries[s] > num_keys[s])
            return -2;
        kt_total += (int64_t)num_kv_heads * head_dim * (num_keys[s] + KEY_BLOCK);
        num_items += num_kv_heads * ((num_queries[s] + QUERY_BLOCK - 1) / QUERY_BLOCK);
    }
    /* K^T per (sequence, kv head), each row padded by a key block so a block's loads never leave the buffer */
    float *kt = (float *)calloc((size_t)kt_total, sizeof(float));
    int64_t *kt_offset = (int64_t *)malloc((size_t)num_seqs * sizeof(int64_t));
    struct work_item *items = (struct work_item *)malloc((size_t)num_items * sizeof(struct work_item));
    if (kt == NULL || kt_offset == NULL || items == NULL) {
        free(kt);
        free(kt_offset);
        free(items);
        return -1;
    }
    int64_t n = 0, offset_total = 0;
    for (int s = 0; s < num_seqs; s++) {
        kt_offset[s] = offset_total;
        offset_total += (int64_t)num_kv_heads * head_dim * (num_keys[s] + KEY_BLOCK);
        const int64_t first_position = num_keys[s] - num_queries[s];
        for (int64_t block = 0; block * QUERY_BLOCK < num_queries[s]; block++) {
            const int64_t end = (block + 1) * QUERY_BLOCK < num_queries[s] ? (block + 1) * QUERY_BLOCK : num_queries[s];
            for (int h = 0; h < num_kv_heads; h++)
                items[n++] = (struct work_item){ s, h, block, first_position + end };
        }
    }
    qsort(items, (size_t)num_items, sizeof(struct work_item), by_cost_descending);

#pragma omp parallel num_threads(num_threads)
    {
        for (int s = 0; s < num_seqs; s++) {
            const float *k = (const float *)(intptr_t)k_addr[s];
            const int64_t k_tok_stride = strides[8 * s + 2], k_head_stride = strides[8 * s + 3];
            const int64_t kt_stride = num_keys[s] + KEY_BLOCK;
            float *kts = kt + kt_offset[s];
#pragma omp for schedule(static) nowait
            for (int64_t item = 0; item < num_kv_heads * num_keys[s]; item++) {
                const int h = (int)(item / num_keys[s]);
                const int64_t t = item % num_keys[s];
                const float *kr = k + t * k_tok_stride + h * k_head_stride;
                float *dst = kts + (int64_t)h * head_dim * kt_stride + t;
                for (int d = 0; d < head_dim; d++) dst[d * kt_stride] = kr[d];
            }
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            const struct work_item it = items[i];
            const int s = it.seq, h = it.kv_head;
            const int64_t *st = strides + 8 * s;
            const int64_t kt_stride = num_keys[s] + KEY_BLOCK;
            const int64_t offset = num_keys[s] - num_queries[s];     /* position of query row 0 */
            const int64_t first = it.block * QUERY_BLOCK;
            const int64_t end = first + QUERY_BLOCK < num_queries[s] ? first + QUERY_BLOCK : num_queries[s];
            const float *kth = kt + kt_offset[s] + (int64_t)h * head_dim * kt_stride;
            const float *vh = (const float *)(intptr_t)v_addr[s] + h * st[5];
            for (int g = 0; g < group; g++) {
                const int head = h * group + g;
                const float *qh = (const float *)(intptr_t)q_addr[s] + head * st[1];
                float *oh = (float *)(intptr_t)out_addr[s] + head * st[7];
                for (int64_t i0 = first; i0 < end; i0 += ROWS) {
                    const int rows = end - i0 < ROWS ? (int)(end - i0) : ROWS;
#define ATTEND(HEAD_DIM) attend_rows(qh, st[0], i0, rows, offset, kth, kt_stride, vh, st[4], oh, st[6], \
                                     HEAD_DIM, scale)
                    if (head_dim == 64) ATTEND(64);
                    else if (head_dim == 128) ATTEND(128);
                    else ATTEND(head_dim);
#undef ATTEND
                }
            }
        }
    }
    free(kt);
    free(kt_offset);
    free(items);
    return 0;
}
