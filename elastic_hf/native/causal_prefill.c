/* Causal attention of prompt chunks (all of one step's, in one call), grouped-query heads, fp32: per sequence,
 * num_queries new tokens at the end of a context of num_keys tokens (num_queries == num_keys for a prompt whose
 * whole context is in the step), query row i at position num_keys - num_queries + i sees keys 0 .. its own
 * position. SDPA's CPU flash kernel does its products through the BLAS sgemm, which on CPUs without Intel's
 * dispatch runs far below the vector units' peak (3 ms a layer at 460 tokens on the 2-core test machine,
 * ~80 GFLOP/s); this kernel keeps every product in registers instead.
 *
 * Flash-style online softmax, per (sequence, kv head, block of QUERY_BLOCK query rows) work item, largest first:
 *   - K of each (sequence, kv head) is transposed once per call into key blocks of [head_dim][KEY_BLOCK] (scratch),
 *     so a block's scores are head_dim broadcast-FMAs into KEY_BLOCK-wide accumulators, no horizontal sums, and a
 *     block's K^T is one contiguous 8 KiB (head_dim 64) that the hardware prefetcher streams;
 *   - ROWS query rows of one head (a row group) go through the keys together, sharing every K^T and V load; each
 *     row keeps its running max, sum and [head_dim] accumulator; a key block rescales them once;
 *   - all row groups of an item (its `group` query heads x QUERY_BLOCK / ROWS) take turns over one span of KEY_SPAN
 *     keys before the next span, so a long context's K and V come from DRAM once an item, not once a row group.
 * Masked keys (after the row's own position) get probability exactly 0. The `group` query heads of a kv head
 * (HF's repeat_kv order: head = kv_head * group + g) are handled by the item that holds the kv head's K/V.
 * With AVX-512 and head_dim 64 or 128 a row group's products run on intrinsics with the scores and accumulators in
 * registers (rows_over_keys_avx512); elsewhere on portable C the compiler vectorises. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#ifndef KEY_BLOCK
#define KEY_BLOCK 32
#endif
#ifndef ROWS
#define ROWS 8
#endif
#ifndef QUERY_BLOCK
#define QUERY_BLOCK 32
#endif
#ifndef KEY_SPAN
#define KEY_SPAN 512           /* keys whose K^T and V (2 x 128 KiB at head_dim 64) stay in L2 for an item's row groups */
#endif
#define MAX_HEAD_DIM 256

#include "fast_exp.h"

/* The running state of ROWS consecutive query rows of one head (a "row group"): query rows pre-scaled, the online
 * softmax's running max and sum, and the [head_dim] output accumulator of each row; kept in a per-thread scratch so
 * that all row groups of a work item can take turns over one span of keys while it sits in L2. */
struct row_group {
    int64_t i0;          /* first query row (rows i0 .. i0 + rows - 1 of the chunk) */
    int rows;            /* <= ROWS; rows past it repeat the last row: computed, never written */
    int head;            /* query head */
    float *qs;           /* [ROWS][head_dim] */
    float *acc;          /* [ROWS][head_dim] */
    float row_max[ROWS], row_sum[ROWS];
};

static inline __attribute__((always_inline)) void start_rows(struct row_group *g, const float *q, int64_t q_tok_stride,
                                                             const int head_dim, float scale)
{
    for (int r = 0; r < ROWS; r++) {
        g->row_max[r] = -FLT_MAX;
        g->row_sum[r] = 0.0f;
        const float *qr = q + (g->i0 + (r < g->rows ? r : g->rows - 1)) * q_tok_stride;
        for (int d = 0; d < head_dim; d++) {
            g->acc[r * head_dim + d] = 0.0f;
            g->qs[r * head_dim + d] = qr[d] * scale;
        }
    }
}

/* The online softmax of one key block's scores s[ROWS][KEY_BLOCK] (row r sees keys j0 .. offset + i0 + r): the
 * scores become probabilities (0 where masked) and alpha[r] is what the row's accumulator must be scaled by. */
static inline __attribute__((always_inline)) void softmax_block(struct row_group *g, float s[ROWS][KEY_BLOCK],
                                                                int64_t offset, int64_t j0, float alpha[ROWS])
{
    for (int r = 0; r < ROWS; r++) {
        const int64_t visible = offset + g->i0 + r - j0 + 1;   /* keys j0 .. its position are visible to row r */
        float block_max = -FLT_MAX;
        for (int j = 0; j < KEY_BLOCK; j++)
            block_max = (j < visible && s[r][j] > block_max) ? s[r][j] : block_max;
        const float new_max = block_max > g->row_max[r] ? block_max : g->row_max[r];
        alpha[r] = exp_nonpositive(g->row_max[r] - new_max);
        float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
        for (int j = 0; j < KEY_BLOCK; j++) {
            const float p = j < visible ? exp_nonpositive(s[r][j] - new_max) : 0.0f;
            s[r][j] = p;
            block_sum += p;
        }
        g->row_sum[r] = g->row_sum[r] * alpha[r] + block_sum;
        g->row_max[r] = new_max;
    }
}

/* Key blocks j0 = j_begin, j_begin + KEY_BLOCK, ... below j_end of one row group (whose last row sees keys up to
 * `last`), portable C vectorised by the compiler. kt: K^T in key blocks of [head_dim][KEY_BLOCK]. */
static inline __attribute__((always_inline)) void rows_over_keys(
    struct row_group *g, int64_t offset, int64_t last, int64_t j_begin, int64_t j_end, const float *kt,
    const float *v, int64_t v_tok_stride, const int head_dim)
{
    for (int64_t j0 = j_begin; j0 < j_end; j0 += KEY_BLOCK) {
        float s[ROWS][KEY_BLOCK], alpha[ROWS];
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < KEY_BLOCK; j++) s[r][j] = 0.0f;
        const float *ktb = kt + j0 * head_dim;   /* this key block's [head_dim][KEY_BLOCK] */
        for (int d = 0; d < head_dim; d++) {
            const float *ktd = ktb + d * KEY_BLOCK;
            for (int r = 0; r < ROWS; r++) {
                const float qd = g->qs[r * head_dim + d];
#pragma omp simd
                for (int j = 0; j < KEY_BLOCK; j++) s[r][j] += qd * ktd[j];
            }
        }
        softmax_block(g, s, offset, j0, alpha);
        for (int r = 0; r < ROWS; r++)
            for (int d = 0; d < head_dim; d++) g->acc[r * head_dim + d] *= alpha[r];
        const int64_t num_keys = last + 1 - j0 < KEY_BLOCK ? last + 1 - j0 : KEY_BLOCK;
        for (int64_t j = 0; j < num_keys; j++) {
            const float *vj = v + (j0 + j) * v_tok_stride;
            for (int r = 0; r < ROWS; r++) {
                const float p = s[r][j];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) g->acc[r * head_dim + d] += p * vj[d];
            }
        }
    }
}

#if defined(__AVX512F__) && KEY_BLOCK == 32 && ROWS == 8
#include <immintrin.h>
#define HAVE_AVX512_ROWS 1
/* rows_over_keys with every product in registers (head_dim 64 or 128): a key block's scores are ROWS x 2 zmm
 * accumulators (one K^T load of 2 zmm feeds 16 FMAs); the probabilities then go through V PV_ROWS rows at a time
 * (PV_ROWS x head_dim / 16 accumulators, one V row of head_dim / 16 zmm feeding them all). The compiler keeps the
 * portable loop's [ROWS][KEY_BLOCK] scores and [ROWS][head_dim] accumulators in memory, a load and a store around
 * every FMA. */
static inline __attribute__((always_inline)) void rows_over_keys_avx512(
    struct row_group *g, int64_t offset, int64_t last, int64_t j_begin, int64_t j_end, const float *kt,
    const float *v, int64_t v_tok_stride, const int head_dim)
{
    const int zd = head_dim / 16;               /* zmm registers a row of head_dim */
    const int pv_rows = 256 / head_dim;         /* 4 at head_dim 64, 2 at 128: 16 accumulators */
    for (int64_t j0 = j_begin; j0 < j_end; j0 += KEY_BLOCK) {
        __m512 s0[ROWS], s1[ROWS];
        for (int r = 0; r < ROWS; r++) s0[r] = s1[r] = _mm512_setzero_ps();
        const float *ktb = kt + j0 * head_dim;
        for (int d = 0; d < head_dim; d++) {
            const __m512 k0 = _mm512_loadu_ps(ktb + d * KEY_BLOCK), k1 = _mm512_loadu_ps(ktb + d * KEY_BLOCK + 16);
            for (int r = 0; r < ROWS; r++) {
                const __m512 qd = _mm512_set1_ps(g->qs[r * head_dim + d]);
                s0[r] = _mm512_fmadd_ps(qd, k0, s0[r]);
                s1[r] = _mm512_fmadd_ps(qd, k1, s1[r]);
            }
        }
        /* the online softmax of the block in registers (softmax_block's formula; its sums in another order) */
        float s[ROWS][KEY_BLOCK] __attribute__((aligned(64))), alpha[ROWS];
        for (int r = 0; r < ROWS; r++) {
            const int64_t visible = offset + g->i0 + r - j0 + 1;   /* keys j0 .. its position are visible to row r */
            const uint32_t bits = visible >= KEY_BLOCK ? 0xffffffffu : visible <= 0 ? 0u : (1u << visible) - 1u;
            const __mmask16 m0 = (__mmask16)bits, m1 = (__mmask16)(bits >> 16);
            const float b0 = _mm512_mask_reduce_max_ps(m0, s0[r]), b1 = _mm512_mask_reduce_max_ps(m1, s1[r]);
            const float block_max = b0 > b1 ? b0 : b1;
            const float new_max = block_max > g->row_max[r] ? block_max : g->row_max[r];
            alpha[r] = exp_nonpositive(g->row_max[r] - new_max);
            const __m512 top = _mm512_set1_ps(new_max);
            const __m512 p0 = _mm512_maskz_mov_ps(m0, exp_nonpositive_avx512(_mm512_sub_ps(s0[r], top)));
            const __m512 p1 = _mm512_maskz_mov_ps(m1, exp_nonpositive_avx512(_mm512_sub_ps(s1[r], top)));
            g->row_sum[r] = g->row_sum[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
            g->row_max[r] = new_max;
            _mm512_store_ps(s[r], p0);
            _mm512_store_ps(s[r] + 16, p1);
        }
        const int64_t num_keys = last + 1 - j0 < KEY_BLOCK ? last + 1 - j0 : KEY_BLOCK;
        const float *vb = v + j0 * v_tok_stride;
        for (int r0 = 0; r0 < ROWS; r0 += pv_rows) {
            __m512 acc[4][8];
            for (int r = 0; r < pv_rows; r++) {
                const __m512 a = _mm512_set1_ps(alpha[r0 + r]);
                for (int z = 0; z < zd; z++)
                    acc[r][z] = _mm512_mul_ps(_mm512_loadu_ps(g->acc + (r0 + r) * head_dim + 16 * z), a);
            }
            for (int64_t j = 0; j < num_keys; j++) {
                __m512 vz[8];
                for (int z = 0; z < zd; z++) vz[z] = _mm512_loadu_ps(vb + j * v_tok_stride + 16 * z);
                for (int r = 0; r < pv_rows; r++) {
                    const __m512 p = _mm512_set1_ps(s[r0 + r][j]);
                    for (int z = 0; z < zd; z++) acc[r][z] = _mm512_fmadd_ps(p, vz[z], acc[r][z]);
                }
            }
            for (int r = 0; r < pv_rows; r++)
                for (int z = 0; z < zd; z++) _mm512_storeu_ps(g->acc + (r0 + r) * head_dim + 16 * z, acc[r][z]);
        }
    }
}
#endif

static void row_group_over_keys(struct row_group *g, int64_t offset, int64_t last, int64_t j_begin, int64_t j_end,
                                const float *kt, const float *v, int64_t v_tok_stride, int head_dim)
{
#ifdef HAVE_AVX512_ROWS
    if (head_dim == 64) { rows_over_keys_avx512(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 64); return; }
    if (head_dim == 128) { rows_over_keys_avx512(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 128); return; }
#else
    if (head_dim == 64) { rows_over_keys(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 64); return; }
    if (head_dim == 128) { rows_over_keys(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 128); return; }
#endif
    rows_over_keys(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, head_dim);
}

static void finish_rows(const struct row_group *g, float *out, int64_t out_tok_stride, int head_dim)
{
    for (int r = 0; r < g->rows; r++) {
        const float inv = 1.0f / g->row_sum[r];
        float *o = out + (g->i0 + r) * out_tok_stride;
        for (int d = 0; d < head_dim; d++) o[d] = g->acc[r * head_dim + d] * inv;
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

static int64_t padded_keys(int64_t num_keys)
{
    return (num_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
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
    if (head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_threads < 1)
        return -2;
    const int group = num_heads / num_kv_heads;
    int64_t kt_total = 0, num_items = 0;
    for (int s = 0; s < num_seqs; s++) {
        if (num_queries[s] < 1 || num_queries[s] > num_keys[s])
            return -2;
        kt_total += (int64_t)num_kv_heads * head_dim * padded_keys(num_keys[s]);
        num_items += num_kv_heads * ((num_queries[s] + QUERY_BLOCK - 1) / QUERY_BLOCK);
    }
    /* the row groups of one item: its query heads x its rows in ROWS */
    const int groups_per_item = group * ((QUERY_BLOCK + ROWS - 1) / ROWS);
    const size_t group_floats = (size_t)2 * ROWS * head_dim;   /* qs and acc */
    /* K^T per (sequence, kv head) in key blocks of [head_dim][KEY_BLOCK], the last block zero-padded */
    float *kt = (float *)calloc((size_t)kt_total, sizeof(float));
    int64_t *kt_offset = (int64_t *)malloc((size_t)num_seqs * sizeof(int64_t));
    struct work_item *items = (struct work_item *)malloc((size_t)num_items * sizeof(struct work_item));
    struct row_group *row_groups = (struct row_group *)malloc((size_t)num_threads * groups_per_item *
                                                              sizeof(struct row_group));
    float *state = (float *)aligned_alloc(64, ((size_t)num_threads * groups_per_item * group_floats * sizeof(float)
                                               + 63) / 64 * 64);
    if (kt == NULL || kt_offset == NULL || items == NULL || row_groups == NULL || state == NULL) {
        free(kt);
        free(kt_offset);
        free(items);
        free(row_groups);
        free(state);
        return -1;
    }
    int64_t n = 0, offset_total = 0;
    for (int s = 0; s < num_seqs; s++) {
        kt_offset[s] = offset_total;
        offset_total += (int64_t)num_kv_heads * head_dim * padded_keys(num_keys[s]);
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
            const int64_t head_floats = (int64_t)head_dim * padded_keys(num_keys[s]);
            float *kts = kt + kt_offset[s];
#pragma omp for schedule(static) nowait
            for (int64_t item = 0; item < num_kv_heads * num_keys[s]; item++) {
                const int h = (int)(item / num_keys[s]);
                const int64_t t = item % num_keys[s];
                const float *kr = k + t * k_tok_stride + h * k_head_stride;
                float *dst = kts + h * head_floats + (t / KEY_BLOCK) * head_dim * KEY_BLOCK + t % KEY_BLOCK;
                for (int d = 0; d < head_dim; d++) dst[d * KEY_BLOCK] = kr[d];
            }
        }
        const int thread = omp_get_thread_num();
        struct row_group *groups = row_groups + (size_t)thread * groups_per_item;
        float *thread_state = state + (size_t)thread * groups_per_item * group_floats;
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            const struct work_item it = items[i];
            const int s = it.seq, h = it.kv_head;
            const int64_t *st = strides + 8 * s;
            const int64_t offset = num_keys[s] - num_queries[s];     /* position of query row 0 */
            const int64_t first = it.block * QUERY_BLOCK;
            const int64_t end = first + QUERY_BLOCK < num_queries[s] ? first + QUERY_BLOCK : num_queries[s];
            const float *kth = kt + kt_offset[s] + (int64_t)h * head_dim * padded_keys(num_keys[s]);
            const float *vh = (const float *)(intptr_t)v_addr[s] + h * st[5];
            int used = 0;
            for (int g = 0; g < group; g++)
                for (int64_t i0 = first; i0 < end; i0 += ROWS) {
                    struct row_group *rg = groups + used;
                    rg->i0 = i0;
                    rg->rows = end - i0 < ROWS ? (int)(end - i0) : ROWS;
                    rg->head = h * group + g;
                    rg->qs = thread_state + (size_t)used * group_floats;
                    rg->acc = rg->qs + (size_t)ROWS * head_dim;
                    start_rows(rg, (const float *)(intptr_t)q_addr[s] + rg->head * st[1], st[0], head_dim, scale);
                    used++;
                }
            /* every row group of the item over one span of keys before the next span: the span's K^T and V are read
             * from DRAM once and from L2 by the other row groups (a long context's K and V outgrow L2) */
            const int64_t item_last = offset + end - 1;
            for (int64_t span = 0; span <= item_last; span += KEY_SPAN)
                for (int u = 0; u < used; u++) {
                    struct row_group *rg = groups + u;
                    const int64_t last = offset + rg->i0 + rg->rows - 1;   /* the group's last row sees 0 .. last */
                    const int64_t span_end = span + KEY_SPAN < last + 1 ? span + KEY_SPAN : last + 1;
                    if (span < span_end)
                        row_group_over_keys(rg, offset, last, span, span_end, kth, vh, st[4], head_dim);
                }
            for (int u = 0; u < used; u++)
                finish_rows(groups + u, (float *)(intptr_t)out_addr[s] + groups[u].head * st[7], st[6], head_dim);
        }
    }
    free(kt);
    free(kt_offset);
    free(items);
    free(row_groups);
    free(state);
    return 0;
}
