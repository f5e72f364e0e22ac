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
 * registers (rows_over_keys_avx512), with AVX2 + FMA in tiles of half a row group (rows_over_keys_avx2); elsewhere
 * on portable C the compiler vectorises.
 *
 * bf16 (elastic_causal_prefill_varlen_bf16, AVX512-BF16 builds, head_dim 64 or 128): q/k/v read and the output
 * written in bf16, no widened copies; both products on vdpbf16ps (one instruction: 16 lanes x a pair of bf16
 * products, half the fp32 kernel's FMAs). K^T is stored in key blocks of [head_dim / 2][KEY_BLOCK][2] (a zmm: 16
 * keys x one pair of dims) and V in key pairs [keys / 2][head_dim][2] (a zmm: 16 dims x one pair of keys); scores,
 * the online softmax and the accumulators stay fp32. A probability goes into the product with V as two bf16, hi +
 * lo (~16 bits of it, one more vdpbf16ps): rounded to one bf16 it made the outputs' mean error 1.4x the widened fp32
 * kernel's and flipped a random-weight model's greedy near-ties; as hi + lo the error is the fp32 kernel's. Kernel
 * alone against the fp32 one on widened copies (9 / 3 kv heads, head_dim 64, 2 threads): 1.27x at 8 x 64 tokens,
 * 1.30x at 128, 1.40x at 400, 1.47x at 1,024, 1.41x at 4,096; the widening copies go too. */
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

#include "bf16.h"
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
    float row_sums[ROWS * 16];   /* bf16 path: each row's sum as 16 partial sums, added up in finish_rows */
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
/* Rows r0 .. r0 + pv_rows - 1 of a row group's [head_dim] output accumulators into registers, each scaled by its
 * row's alpha (the online softmax's rescale for a new running max), and back. */
static inline __attribute__((always_inline)) void load_rescaled(__m512 acc[4][8], const struct row_group *g, int r0,
                                                                const int pv_rows, const float *alpha,
                                                                const int head_dim)
{
    for (int r = 0; r < pv_rows; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r0 + r]);
        for (int z = 0; z < head_dim / 16; z++)
            acc[r][z] = _mm512_mul_ps(_mm512_loadu_ps(g->acc + (r0 + r) * head_dim + 16 * z), a);
    }
}

static inline __attribute__((always_inline)) void store_accumulators(__m512 acc[4][8], struct row_group *g, int r0,
                                                                     const int pv_rows, const int head_dim)
{
    for (int r = 0; r < pv_rows; r++)
        for (int z = 0; z < head_dim / 16; z++) _mm512_storeu_ps(g->acc + (r0 + r) * head_dim + 16 * z, acc[r][z]);
}

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
            load_rescaled(acc, g, r0, pv_rows, alpha, head_dim);
            for (int64_t j = 0; j < num_keys; j++) {
                __m512 vz[8];
                for (int z = 0; z < zd; z++) vz[z] = _mm512_loadu_ps(vb + j * v_tok_stride + 16 * z);
                for (int r = 0; r < pv_rows; r++) {
                    const __m512 p = _mm512_set1_ps(s[r0 + r][j]);
                    for (int z = 0; z < zd; z++) acc[r][z] = _mm512_fmadd_ps(p, vz[z], acc[r][z]);
                }
            }
            store_accumulators(acc, g, r0, pv_rows, head_dim);
        }
    }
}
#endif

#if !defined(HAVE_AVX512_ROWS) && defined(__AVX2__) && defined(__FMA__) && KEY_BLOCK == 32 && ROWS == 8
#include <immintrin.h>
#define HAVE_AVX2_ROWS 1
/* Keeps two loaded vectors in registers: without it the compiler folds the load into every FMA that uses it (a
 * memory operand each), and with a broadcast per row the loops then issue more loads than two ports can serve. */
#define HOLD_IN_REGISTERS(a, b) __asm__("" : "+x"(a), "+x"(b))
/* rows_over_keys_avx512's scheme for AVX2 builds (16 ymm registers, head_dim 64 or 128), in register tiles of half
 * a row group (4 rows, 8 accumulators): a key block's scores in tiles of 4 rows x 16 keys (a K^T load of 2 ymm feeds
 * 8 FMAs), the online softmax a row at a time on its 4 ymm of scores, then the probabilities through V in tiles of
 * 4 rows x 16 dims (a V row's 2 ymm feeding 8 FMAs). The portable loop keeps the scores and accumulators in memory,
 * a load and a store around every FMA: 1.5-2.1x slower on the 2-core AVX2 EPYC (142-2,048 tokens). Tiles of 6 rows
 * (row groups of 12) were no faster. */
static inline __attribute__((always_inline)) void rows_over_keys_avx2(
    struct row_group *g, int64_t offset, int64_t last, int64_t j_begin, int64_t j_end, const float *kt,
    const float *v, int64_t v_tok_stride, const int head_dim)
{
    enum { TILE = ROWS / 2 };   /* rows of a register tile */
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += KEY_BLOCK) {
        float s[ROWS][KEY_BLOCK] __attribute__((aligned(32))), alpha[ROWS];
        const float *ktb = kt + j0 * head_dim;   /* this key block's [head_dim][KEY_BLOCK] */
        for (int r0 = 0; r0 < ROWS; r0 += TILE)
            for (int k0 = 0; k0 < KEY_BLOCK; k0 += 16) {
                __m256 acc[TILE][2];
                for (int r = 0; r < TILE; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
                for (int d = 0; d < head_dim; d++) {
                    __m256 ka = _mm256_loadu_ps(ktb + d * KEY_BLOCK + k0);
                    __m256 kb = _mm256_loadu_ps(ktb + d * KEY_BLOCK + k0 + 8);
                    HOLD_IN_REGISTERS(ka, kb);
                    for (int r = 0; r < TILE; r++) {
                        const __m256 qd = _mm256_broadcast_ss(g->qs + (r0 + r) * head_dim + d);
                        acc[r][0] = _mm256_fmadd_ps(qd, ka, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(qd, kb, acc[r][1]);
                    }
                }
                for (int r = 0; r < TILE; r++) {
                    _mm256_store_ps(s[r0 + r] + k0, acc[r][0]);
                    _mm256_store_ps(s[r0 + r] + k0 + 8, acc[r][1]);
                }
            }
        /* the online softmax of the block (softmax_block's formula; its sums in another order) */
        for (int r = 0; r < ROWS; r++) {
            const int64_t visible = offset + g->i0 + r - j0 + 1;   /* keys j0 .. its position are visible to row r */
            const __m256 limit = _mm256_set1_ps(visible >= KEY_BLOCK ? (float)KEY_BLOCK : (float)visible);
            __m256 x[4], keep[4], m = lowest;
            for (int q = 0; q < 4; q++) {
                keep[q] = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.0f * q)), limit, _CMP_LT_OQ);
                x[q] = _mm256_blendv_ps(lowest, _mm256_load_ps(s[r] + 8 * q), keep[q]);
                m = _mm256_max_ps(m, x[q]);
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            const float block_max = _mm_cvtss_f32(m4);
            const float new_max = block_max > g->row_max[r] ? block_max : g->row_max[r];
            alpha[r] = exp_nonpositive(g->row_max[r] - new_max);
            const __m256 top = _mm256_set1_ps(new_max);
            __m256 sum = _mm256_setzero_ps();
            for (int q = 0; q < 4; q++) {
                const __m256 p = _mm256_and_ps(exp_nonpositive_avx2(_mm256_sub_ps(x[q], top)), keep[q]);
                _mm256_store_ps(s[r] + 8 * q, p);
                sum = _mm256_add_ps(sum, p);
            }
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
            g->row_sum[r] = g->row_sum[r] * alpha[r] + _mm_cvtss_f32(s4);
            g->row_max[r] = new_max;
        }
        const int64_t num_keys = last + 1 - j0 < KEY_BLOCK ? last + 1 - j0 : KEY_BLOCK;
        const float *vb = v + j0 * v_tok_stride;
        for (int r0 = 0; r0 < ROWS; r0 += TILE)
            for (int d0 = 0; d0 < head_dim; d0 += 16) {
                __m256 acc[TILE][2];
                for (int r = 0; r < TILE; r++) {
                    const __m256 a = _mm256_set1_ps(alpha[r0 + r]);
                    float *row = g->acc + (r0 + r) * head_dim + d0;
                    acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(row), a);
                    acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(row + 8), a);
                }
                for (int64_t j = 0; j < num_keys; j++) {
                    __m256 va = _mm256_loadu_ps(vb + j * v_tok_stride + d0);
                    __m256 vc = _mm256_loadu_ps(vb + j * v_tok_stride + d0 + 8);
                    HOLD_IN_REGISTERS(va, vc);
                    for (int r = 0; r < TILE; r++) {
                        const __m256 p = _mm256_broadcast_ss(&s[r0 + r][j]);
                        acc[r][0] = _mm256_fmadd_ps(p, va, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(p, vc, acc[r][1]);
                    }
                }
                for (int r = 0; r < TILE; r++) {
                    float *row = g->acc + (r0 + r) * head_dim + d0;
                    _mm256_storeu_ps(row, acc[r][0]);
                    _mm256_storeu_ps(row + 8, acc[r][1]);
                }
            }
    }
}
#endif

#if defined(HAVE_AVX512_ROWS) && defined(__AVX512BF16__)
#define HAVE_BF16_ROWS 1
/* rows_over_keys_avx512 for bf16 q/K/V on vdpbf16ps. qs: the row group's query rows as bf16 [ROWS][head_dim]
 * (unscaled: the scores are scaled in fp32 after the product); kt: K^T blocks of [head_dim / 2][KEY_BLOCK][2];
 * vp: V as key pairs [keys / 2][head_dim][2]. A key pair past the row's last visible key gets probability 0, and
 * the pairs' padding past the context is zeros, so it adds nothing. */
static inline __attribute__((always_inline)) void rows_over_keys_bf16(
    struct row_group *g, int64_t offset, int64_t last, int64_t j_begin, int64_t j_end, const uint16_t *kt,
    const uint16_t *vp, const int head_dim, float scale)
{
    const int zd = head_dim / 16;               /* zmm accumulators a row of head_dim */
    const int pv_rows = 256 / head_dim;         /* 4 at head_dim 64, 2 at 128: 16 accumulators */
    const int pairs = head_dim / 2;
    const uint32_t *q_pairs = (const uint32_t *)g->qs;   /* [ROWS][head_dim / 2] pairs of bf16 */
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 sums[ROWS];
    for (int r = 0; r < ROWS; r++) sums[r] = _mm512_loadu_ps(g->row_sums + 16 * r);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += KEY_BLOCK) {
        __m512 s0[ROWS], s1[ROWS];
        for (int r = 0; r < ROWS; r++) s0[r] = s1[r] = _mm512_setzero_ps();
        const uint16_t *ktb = kt + j0 * head_dim;   /* this key block's [head_dim / 2][KEY_BLOCK][2] */
        for (int d2 = 0; d2 < pairs; d2++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(ktb + d2 * 2 * KEY_BLOCK);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(ktb + d2 * 2 * KEY_BLOCK + 32);
            for (int r = 0; r < ROWS; r++) {
                const __m512bh qd = (__m512bh)_mm512_set1_epi32((int)q_pairs[r * pairs + d2]);
                s0[r] = _mm512_dpbf16_ps(s0[r], qd, k0);
                s1[r] = _mm512_dpbf16_ps(s1[r], qd, k1);
            }
        }
        /* the online softmax in registers, as rows_over_keys_avx512 (the rows' rescale factors on one vector); the
         * probabilities then as bf16 pairs */
        uint16_t p_hi[ROWS][KEY_BLOCK] __attribute__((aligned(64))), p_lo[ROWS][KEY_BLOCK] __attribute__((aligned(64)));
        float block_max[16] __attribute__((aligned(64))), alpha[16] __attribute__((aligned(64)));
        __mmask16 m0[ROWS], m1[ROWS];
        const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
        for (int r = 0; r < ROWS; r++) {
            s0[r] = _mm512_mul_ps(s0[r], vscale);
            s1[r] = _mm512_mul_ps(s1[r], vscale);
            const int64_t visible = offset + g->i0 + r - j0 + 1;   /* keys j0 .. its position are visible to row r */
            const uint32_t bits = visible >= KEY_BLOCK ? 0xffffffffu : visible <= 0 ? 0u : (1u << visible) - 1u;
            m0[r] = (__mmask16)bits;
            m1[r] = (__mmask16)(bits >> 16);
            /* one horizontal max for both halves (masked lanes at -FLT_MAX, below every visible score) */
            block_max[r] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(lowest, m0[r], s0[r]),
                                                              _mm512_mask_mov_ps(lowest, m1[r], s1[r])));
        }
        const __mmask16 row_lanes = (__mmask16)((1u << ROWS) - 1u);
        const __m512 old_max = _mm512_mask_loadu_ps(lowest, row_lanes, g->row_max);
        const __m512 new_max = _mm512_max_ps(old_max, _mm512_mask_load_ps(lowest, row_lanes, block_max));
        _mm512_store_ps(alpha, exp_nonpositive_avx512(_mm512_sub_ps(old_max, new_max)));
        _mm512_mask_storeu_ps(g->row_max, row_lanes, new_max);
        for (int r = 0; r < ROWS; r++) {
            const __m512 top = _mm512_set1_ps(g->row_max[r]);
            const __m512 p0 = _mm512_maskz_mov_ps(m0[r], exp_nonpositive_avx512(_mm512_sub_ps(s0[r], top)));
            const __m512 p1 = _mm512_maskz_mov_ps(m1[r], exp_nonpositive_avx512(_mm512_sub_ps(s1[r], top)));
            /* the row's sum stays 16 partial sums until finish_rows (no horizontal add a block) */
            sums[r] = _mm512_fmadd_ps(sums[r], _mm512_set1_ps(alpha[r]), _mm512_add_ps(p0, p1));
            /* p = hi + lo, two bf16 (keys 0-15 in the low half, 16-31 in the high): p to ~16 bits, not bf16's 8 */
            const __m512bh hi = _mm512_cvtne2ps_pbh(p1, p0);
            const __m512 hi0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_castsi512_si256((__m512i)hi)), 16));
            const __m512 hi1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64((__m512i)hi, 1)), 16));
            _mm512_store_si512(p_hi[r], (__m512i)hi);
            _mm512_store_si512(p_lo[r], (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, hi1), _mm512_sub_ps(p0, hi0)));
        }
        const int64_t num_keys = last + 1 - j0 < KEY_BLOCK ? last + 1 - j0 : KEY_BLOCK;
        const int64_t key_pairs = (num_keys + 1) / 2;
        const uint16_t *vb = vp + j0 * head_dim;     /* key pairs from j0 (j0 is even) */
        for (int r0 = 0; r0 < ROWS; r0 += pv_rows) {
            __m512 acc[4][8];
            load_rescaled(acc, g, r0, pv_rows, alpha, head_dim);
            for (int64_t jp = 0; jp < key_pairs; jp++) {
                __m512bh vz[8];
                for (int z = 0; z < zd; z++)
                    vz[z] = (__m512bh)_mm512_loadu_si512(vb + jp * 2 * head_dim + 32 * z);
                for (int r = 0; r < pv_rows; r++) {
                    const __m512bh hi = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)p_hi[r0 + r])[jp]);
                    const __m512bh lo = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)p_lo[r0 + r])[jp]);
                    for (int z = 0; z < zd; z++)
                        acc[r][z] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][z], lo, vz[z]), hi, vz[z]);
                }
            }
            store_accumulators(acc, g, r0, pv_rows, head_dim);
        }
    }
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(g->row_sums + 16 * r, sums[r]);
}
#endif

static void row_group_over_keys(struct row_group *g, int64_t offset, int64_t last, int64_t j_begin, int64_t j_end,
                                const float *kt, const float *v, int64_t v_tok_stride, int head_dim)
{
#ifdef HAVE_AVX512_ROWS
    if (head_dim == 64) { rows_over_keys_avx512(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 64); return; }
    if (head_dim == 128) { rows_over_keys_avx512(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 128); return; }
#elif defined(HAVE_AVX2_ROWS)
    if (head_dim == 64) { rows_over_keys_avx2(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 64); return; }
    if (head_dim == 128) { rows_over_keys_avx2(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 128); return; }
#else
    if (head_dim == 64) { rows_over_keys(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 64); return; }
    if (head_dim == 128) { rows_over_keys(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, 128); return; }
#endif
    rows_over_keys(g, offset, last, j_begin, j_end, kt, v, v_tok_stride, head_dim);
}

/* start_rows for bf16 query rows: copied as they are into qs (as bf16 pairs), the scale goes on the scores */
static void start_rows_bf16(struct row_group *g, const uint16_t *q, int64_t q_tok_stride, int head_dim)
{
    uint16_t *qs = (uint16_t *)g->qs;
    memset(g->row_sums, 0, sizeof(g->row_sums));
    memset(g->acc, 0, sizeof(float) * ROWS * (size_t)head_dim);
    for (int r = 0; r < ROWS; r++) {
        g->row_max[r] = -FLT_MAX;
        g->row_sum[r] = 0.0f;
        memcpy(qs + r * head_dim, q + (g->i0 + (r < g->rows ? r : g->rows - 1)) * q_tok_stride,
               sizeof(uint16_t) * (size_t)head_dim);
    }
}

/* out rows (fp32, or bf16 rounded to nearest even) of a finished row group */
static void finish_rows(const struct row_group *g, void *out, int64_t out_tok_stride, int head_dim, int bf16)
{
    for (int r = 0; r < g->rows; r++) {
        float sum = g->row_sum[r];
        if (bf16) {
            sum = 0.0f;
            for (int l = 0; l < 16; l++) sum += g->row_sums[16 * r + l];
        }
        const float inv = 1.0f / sum;
        const float *acc = g->acc + r * head_dim;
        if (bf16) {
            uint16_t *o = (uint16_t *)out + (g->i0 + r) * out_tok_stride;
#if defined(HAVE_BF16_ROWS)
            /* nearest even, as f32_to_bf16 (vcvtneps2bf16: denormal outputs become zero) */
            const __m512 vinv = _mm512_set1_ps(inv);
            for (int d = 0; d < head_dim; d += 16)
                _mm256_storeu_si256((__m256i *)(o + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), vinv)));
#else
            for (int d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc[d] * inv);
#endif
        } else {
            float *o = (float *)out + (g->i0 + r) * out_tok_stride;
            for (int d = 0; d < head_dim; d++) o[d] = acc[d] * inv;
        }
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
 * head_dim]. All fp32, or all bf16 (bf16 a compile-time constant at both entry points).
 * Returns 0, -1 when scratch cannot be allocated, -2 for head_dim > MAX_HEAD_DIM, heads that do not divide or a
 * sequence with no queries or more queries than keys, -3 for bf16 where this build or head_dim has no bf16 path. */
static inline __attribute__((always_inline)) int causal_prefill_varlen(
    int num_seqs, const int64_t *q_addr, const int64_t *k_addr, const int64_t *v_addr, const int64_t *out_addr,
    const int64_t *strides, const int64_t *num_queries, const int64_t *num_keys,
    int num_heads, int num_kv_heads, int head_dim, float scale, int num_threads, const int bf16)
{
    if (head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_threads < 1)
        return -2;
#if defined(HAVE_BF16_ROWS)
    if (bf16 && head_dim != 64 && head_dim != 128)
        return -3;
#else
    if (bf16)
        return -3;
#endif
    const int group = num_heads / num_kv_heads;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
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
    /* K^T per (sequence, kv head) in key blocks of [head_dim][KEY_BLOCK] (bf16: [head_dim / 2][KEY_BLOCK][2]), the
     * last block zero-padded; bf16 also V in key pairs [padded keys / 2][head_dim][2], zero-padded */
    char *kt = (char *)calloc((size_t)kt_total, elem);
    uint16_t *vp = bf16 ? (uint16_t *)calloc((size_t)kt_total, sizeof(uint16_t)) : NULL;
    int64_t *kt_offset = (int64_t *)malloc((size_t)num_seqs * sizeof(int64_t));
    struct work_item *items = (struct work_item *)malloc((size_t)num_items * sizeof(struct work_item));
    struct row_group *row_groups = (struct row_group *)malloc((size_t)num_threads * groups_per_item *
                                                              sizeof(struct row_group));
    float *state = (float *)aligned_alloc(64, ((size_t)num_threads * groups_per_item * group_floats * sizeof(float)
                                               + 63) / 64 * 64);
    if (kt == NULL || (bf16 && vp == NULL) || kt_offset == NULL || items == NULL || row_groups == NULL
            || state == NULL) {
        free(kt);
        free(vp);
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
            const int64_t k_tok_stride = strides[8 * s + 2], k_head_stride = strides[8 * s + 3];
            const int64_t v_tok_stride = strides[8 * s + 4], v_head_stride = strides[8 * s + 5];
            const int64_t head_elems = (int64_t)head_dim * padded_keys(num_keys[s]);
            if (bf16) {   /* a pair of tokens an item: both K rows into K^T, the two V rows interleaved */
                const int64_t token_pairs = (num_keys[s] + 1) / 2;
#pragma omp for schedule(static) nowait
                for (int64_t item = 0; item < num_kv_heads * token_pairs; item++) {
                    const int h = (int)(item / token_pairs);
                    const int64_t t0 = 2 * (item % token_pairs);
                    const int second = t0 + 1 < num_keys[s];   /* else the pair's second token is padding */
                    for (int u = 0; u < 1 + second; u++) {
                        const int64_t t = t0 + u;
                        /* K's dims in pairs (one uint32 each) go KEY_BLOCK pairs apart */
                        const uint32_t *kr = (const uint32_t *)((const uint16_t *)(intptr_t)k_addr[s]
                                                                + t * k_tok_stride + h * k_head_stride);
                        uint32_t *kdst = (uint32_t *)((uint16_t *)kt + kt_offset[s] + h * head_elems
                                                      + (t / KEY_BLOCK) * head_dim * KEY_BLOCK) + t % KEY_BLOCK;
                        for (int d2 = 0; d2 < head_dim / 2; d2++) kdst[d2 * KEY_BLOCK] = kr[d2];
                    }
                    const uint16_t *v0 = (const uint16_t *)(intptr_t)v_addr[s] + t0 * v_tok_stride
                                         + h * v_head_stride;
                    const uint16_t *v1 = v0 + v_tok_stride;
                    uint32_t *vdst = (uint32_t *)(vp + kt_offset[s] + h * head_elems + t0 * head_dim);
                    for (int d = 0; d < head_dim; d++)
                        vdst[d] = (uint32_t)v0[d] | (second ? (uint32_t)v1[d] << 16 : 0u);
                }
            } else {
#pragma omp for schedule(static) nowait
                for (int64_t item = 0; item < num_kv_heads * num_keys[s]; item++) {
                    const int h = (int)(item / num_keys[s]);
                    const int64_t t = item % num_keys[s];
                    const float *kr = (const float *)(intptr_t)k_addr[s] + t * k_tok_stride + h * k_head_stride;
                    float *dst = (float *)kt + kt_offset[s] + h * head_elems + (t / KEY_BLOCK) * head_dim * KEY_BLOCK
                                 + t % KEY_BLOCK;
                    for (int d = 0; d < head_dim; d++) dst[d * KEY_BLOCK] = kr[d];
                }
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
            const int64_t head_start = kt_offset[s] + (int64_t)h * head_dim * padded_keys(num_keys[s]);
            int used = 0;
            for (int g = 0; g < group; g++)
                for (int64_t i0 = first; i0 < end; i0 += ROWS) {
                    struct row_group *rg = groups + used;
                    rg->i0 = i0;
                    rg->rows = end - i0 < ROWS ? (int)(end - i0) : ROWS;
                    rg->head = h * group + g;
                    rg->qs = thread_state + (size_t)used * group_floats;
                    rg->acc = rg->qs + (size_t)ROWS * head_dim;
                    if (bf16)
                        start_rows_bf16(rg, (const uint16_t *)(intptr_t)q_addr[s] + rg->head * st[1], st[0], head_dim);
                    else
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
                    if (span >= span_end)
                        continue;
#if defined(HAVE_BF16_ROWS)
                    if (bf16) {
                        const uint16_t *kth = (const uint16_t *)kt + head_start, *vph = vp + head_start;
                        if (head_dim == 64) rows_over_keys_bf16(rg, offset, last, span, span_end, kth, vph, 64, scale);
                        else rows_over_keys_bf16(rg, offset, last, span, span_end, kth, vph, 128, scale);
                        continue;
                    }
#endif
                    const float *vh = (const float *)(intptr_t)v_addr[s] + h * st[5];
                    row_group_over_keys(rg, offset, last, span, span_end, (const float *)kt + head_start, vh, st[4],
                                        head_dim);
                }
            for (int u = 0; u < used; u++)
                finish_rows(groups + u, (char *)(intptr_t)out_addr[s] + groups[u].head * st[7] * (int64_t)elem, st[6],
                            head_dim, bf16);
        }
    }
    free(kt);
    free(vp);
    free(kt_offset);
    free(items);
    free(row_groups);
    free(state);
    return 0;
}

#define CAUSAL_PREFILL_PARAMS                                                                                     \
    int num_seqs, const int64_t *q_addr, const int64_t *k_addr, const int64_t *v_addr, const int64_t *out_addr,   \
    const int64_t *strides, const int64_t *num_queries, const int64_t *num_keys, int num_heads, int num_kv_heads, \
    int head_dim, float scale, int num_threads
#define CAUSAL_PREFILL_ARGS                                                                                       \
    num_seqs, q_addr, k_addr, v_addr, out_addr, strides, num_queries, num_keys, num_heads, num_kv_heads, head_dim, \
    scale, num_threads

/* q, k, v and out fp32 */
int elastic_causal_prefill_varlen_f32(CAUSAL_PREFILL_PARAMS) { return causal_prefill_varlen(CAUSAL_PREFILL_ARGS, 0); }

/* q, k, v and out bf16 (uint16 bit patterns), on vdpbf16ps; -3 where this build or head_dim has no such path */
int elastic_causal_prefill_varlen_bf16(CAUSAL_PREFILL_PARAMS) { return causal_prefill_varlen(CAUSAL_PREFILL_ARGS, 1); }

/* Whether elastic_causal_prefill_varlen_bf16 takes this head_dim in this build. */
int elastic_causal_prefill_bf16_takes(int head_dim)
{
#if defined(HAVE_BF16_ROWS)
    return head_dim == 64 || head_dim == 128;
#else
    (void)head_dim;
    return 0;
#endif
}
