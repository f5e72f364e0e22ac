/* Paged decode attention on the CPU: one new query token per sequence, K/V read in place from the head-centric KV
 * arena (no gather copy, no padding to the longest context). Two entry points: everything fp32, or everything
 * bf16 (queries, K/V and outputs, as the model hands them over: no widening copies around the call). Scores, the
 * softmax and the output accumulate in fp32 either way; a bf16 output is rounded to nearest even once.
 *
 * The arena is addressed as chunks: chunk c is one [block_size, head_dim] K or V slab of one (block, layer,
 * kv head), contiguous, at kv_chunks + c * block_size * head_dim. chunk_table lists, for layer 0, the chunk id of
 * every (sequence, kv head, K/V, block) of the batch; a layer adds layer_chunk_offset to each id.
 *
 * Work is split over (sequence, kv head) pairs across OpenMP threads; the `group` query heads that share a kv head
 * (HF's repeat_kv order: head = kv_head * group + g) are handled by the same thread. Softmax: all scores, their
 * max, exp and sum, then V. With fewer than two pairs per thread (one long decode: 3 pairs on 2 threads, one
 * thread doing two thirds of the work), the AVX-512 path also cuts each context into splits of >= 8 blocks and
 * combines their partial softmaxes (flash-decoding): one decode of 4,000 tokens on 2 threads, all 30 layers in turn,
 * bf16 163 -> 125 us a layer, fp32 287 -> 233 (benchmarks/paged_decode.py --seqs 1 --min-ctx 4000 --max-ctx 4000).
 *
 * Two implementations of one pair:
 *   - AVX-512 (head_dim 64 or 128, block_size a multiple of 16): the scores of a block's 16 keys for one head come
 *     from 16 register accumulators reduced together by one transpose-add tree (45 shuffles and adds for 16 dot
 *     products instead of a horizontal sum each); bf16 K with AVX512-BF16 goes through vdpbf16ps without being
 *     widened; each V row is loaded (and widened) once for up to 4 (head_dim 64) or 2 (128) query heads, whose
 *     accumulators stay in registers. At 32 decodes of ~100 tokens this is ~2.5x the portable loop. Pages are
 *     scattered, so each 2-4 KiB chunk starts with a DRAM miss the hardware prefetcher cannot foresee: K chunks
 *     are prefetched into L2 two blocks ahead and V chunks while their block is scored (a step reads all K/V,
 *     ~100 MB, from DRAM: all 30 layers in turn at 32 decodes of 64-160 tokens, bf16 177 -> 107-118 us a layer,
 *     fp32 258 -> 206-210; benchmarks/paged_decode.py).
 *   - portable C (any head_dim <= MAX_HEAD_DIM, any block size), one head at a time, vectorised by the compiler. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 1024
/* splitting a context (flash-decoding) when there are fewer (sequence, kv head) pairs than 2 per thread: aim at this
 * many work items per thread, each split at least MIN_SPLIT_BLOCKS blocks long */
#define SPLIT_ITEMS_PER_THREAD 4
#define MIN_SPLIT_BLOCKS 8

#include "bf16.h"
#include "fast_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Element i of an fp32 or (bf16) bf16 array as fp32. bf16 is a compile-time constant at every call; the memcpy
 * is the type pun the vectoriser turns into a widening shift. */
static inline __attribute__((always_inline)) float load_elem(const void *base, int64_t i, const int bf16)
{
    if (!bf16) return ((const float *)base)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float widened;
    memcpy(&widened, &bits, sizeof widened);
    return widened;
}


/* ------------------------------------------------------------------------------------------------ portable */
/* One (sequence, kv head) pair, one query head at a time. Always inlined with a constant head_dim and dtype. */
static inline __attribute__((always_inline)) void attend_pair_portable(
    const void *q, int64_t q_head_stride, const void *kv_chunks, const int64_t *k_chunks, const int64_t *v_chunks,
    int64_t layer_chunk_offset, int64_t ctx, void *out, int group, int block_size, const int head_dim, float scale,
    float *scores /* [ctx] scratch */, const int bf16)
{
    const int64_t chunk_numel = (int64_t)block_size * head_dim;
    for (int g = 0; g < group; g++) {
        float qg[MAX_HEAD_DIM];
        for (int d = 0; d < head_dim; d++) qg[d] = load_elem(q, g * q_head_stride + d, bf16);
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const int64_t kb = (k_chunks[t0 / block_size] + layer_chunk_offset) * chunk_numel;
            const int64_t tn = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int64_t t = 0; t < tn; t++) {
                const int64_t kt = kb + t * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++) dot += qg[d] * load_elem(kv_chunks, kt + d, bf16);
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
                for (int d = 0; d < head_dim; d++) acc[d] += p * load_elem(kv_chunks, vt + d, bf16);
            }
        }
        const float inv_sum = 1.0f / sum;
        for (int d = 0; d < head_dim; d++) {
            if (bf16) ((uint16_t *)out)[(int64_t)g * head_dim + d] = f32_to_bf16(acc[d] * inv_sum);
            else ((float *)out)[(int64_t)g * head_dim + d] = acc[d] * inv_sum;
        }
    }
}

/* ------------------------------------------------------------------------------------------------ AVX-512 */
#if defined(__AVX512F__)
#define HAVE_AVX512_PATH 1
#define KEYS 16   /* keys per score vector: one zmm of fp32 */

/* 16 fp32 elements of an fp32 or (bf16) bf16 array, widened */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t i, const int bf16)
{
    if (!bf16) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) void store16(void *base, int64_t i, __m512 x, const int bf16)
{
    if (!bf16) {
        _mm512_storeu_ps((float *)base + i, x);
        return;
    }
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), (__m256i)_mm512_cvtneps_pbh(x));
#else
    __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
#endif
}

/* r[t] = sum of the 16 lanes of v[t], t = 0..15: pairs interleave within 128-bit lanes (unpack ps, then pd), and
 * the four 128-bit lanes are summed by two rounds of lane shuffles. Tokens come out in order. */
static inline __attribute__((always_inline)) __m512 transpose_sum16(const __m512 v[KEYS])
{
    __m512 a[8], c[4];
    for (int j = 0; j < 8; j++)   /* a[j] lanes: (x0+x2, y0+y2, x1+x3, y1+y3) of v[2j], v[2j+1] */
        a[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) { /* c[j], per 128-bit lane: partial sums of tokens 4j..4j+3 */
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * j]), _mm512_castps_pd(a[2 * j + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * j]), _mm512_castps_pd(a[2 * j + 1]));
        c[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* lanes [c0.L0+L1, c0.L2+L3, c1.L0+L1, c1.L2+L3] and the same of c2, c3 */
    const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xdd));
}

/* scores[t0 .. t0 + 15] of one query head against one K chunk's 16 rows (rows past the context are computed from
 * whatever the page holds and not stored: lanes are independent). */
static inline __attribute__((always_inline)) void score_block16(
    const void *qh, const void *k_rows, float *scores, int64_t valid, const int head_dim, float scale,
    const int bf16)
{
    __m512 acc[KEYS];
#if defined(__AVX512BF16__)
    if (bf16) {   /* bf16 pairs straight into fp32 dot products: no widening of K or q */
        __m512bh qv[MAX_HEAD_DIM / 32];
        for (int c = 0; c < head_dim / 32; c++) qv[c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)qh + 32 * c);
        for (int t = 0; t < KEYS; t++) {
            const uint16_t *kt = (const uint16_t *)k_rows + (int64_t)t * head_dim;
            __m512 s = _mm512_setzero_ps();
            for (int c = 0; c < head_dim / 32; c++)
                s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_loadu_si512(kt + 32 * c));
            acc[t] = s;
        }
    } else
#endif
    {
        __m512 qv[MAX_HEAD_DIM / 16];
        for (int c = 0; c < head_dim / 16; c++) qv[c] = load16(qh, 16 * c, bf16);
        for (int t = 0; t < KEYS; t++) {
            __m512 s = _mm512_mul_ps(qv[0], load16(k_rows, (int64_t)t * head_dim, bf16));
            for (int c = 1; c < head_dim / 16; c++)
                s = _mm512_fmadd_ps(qv[c], load16(k_rows, (int64_t)t * head_dim + 16 * c, bf16), s);
            acc[t] = s;
        }
    }
    const __m512 r = _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores, valid >= KEYS ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u), r);
}

#define PREFETCH_BLOCKS 2   /* K blocks requested ahead of the one being scored */

/* prefetched bytes of a chunk; the rest streams behind it (large blocks must not flood the miss queues) */
#define PREFETCH_MAX_BYTES 4096

/* Into L2 (T1), not L1 (T0): a thread asks for up to 3 chunks of 32 lines at once, more misses than the L1's
 * miss buffers hold, so T0 requests queued behind each other and a thread read DRAM at ~6.5 GB/s (it scaled with
 * threads, not with the machine's ~29.5 GB/s). On the 2-core AVX-512 EPYC, all 30 layers in turn, bf16
 * (benchmarks/paged_decode.py): 32 x ~134 tokens 251-263 -> 176-198 us a layer, 32 x ~1,050 2.4-3.0 -> 1.40 ms,
 * 1 x 4,000 264-282 -> 172-179 us; fp32 32 x ~134 412 -> 316 us. The first use of each line then hits L2. */
static inline __attribute__((always_inline)) void prefetch_chunk(const char *p, int64_t bytes)
{
    if (bytes > PREFETCH_MAX_BYTES) bytes = PREFETCH_MAX_BYTES;
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

/* `heads` (<= 4 for head_dim 64, <= 2 for 128; a constant) query heads of one kv head: scores, softmax, then one
 * pass over V with every head's [head_dim] accumulator in registers. q rows at q_head_stride; out rows
 * contiguous. scores: [heads, ctx rounded up to KEYS] scratch. With `partial` (a split of a longer context), the
 * output is not normalised: per head, [head_dim] accumulator, then the split's score max and its sum of exps, at
 * partial + g * (head_dim + 2); `out` is not written. */
static inline __attribute__((always_inline)) void attend_heads_avx512(
    const void *q, int64_t q_head_stride, const void *kv_chunks, const int64_t *k_chunks, const int64_t *v_chunks,
    int64_t layer_chunk_offset, int64_t ctx, void *out, float *partial, int block_size, const int head_dim,
    float scale, float *scores, int64_t scores_stride, const int heads, const int bf16)
{
    const int64_t chunk_numel = (int64_t)block_size * head_dim;
    const int elem = bf16 ? 2 : 4;
    const int64_t chunk_bytes = chunk_numel * elem;
    const int64_t num_blocks = (ctx + block_size - 1) / block_size;
    for (int64_t b = 0; b < PREFETCH_BLOCKS && b < num_blocks; b++)
        prefetch_chunk((const char *)kv_chunks + (k_chunks[b] + layer_chunk_offset) * chunk_bytes, chunk_bytes);
    for (int g = 0; g < heads; g++) {
        const char *qh = (const char *)q + g * q_head_stride * elem;
        float *sg = scores + g * scores_stride;
        for (int64_t t0 = 0; t0 < ctx; t0 += KEYS) {
            if (g == 0 && t0 % block_size == 0) {
                /* pages are scattered: each chunk's first miss is a full DRAM latency the hardware prefetcher
                 * cannot hide. Ask for K a few blocks ahead, and for this block's V, which the pass over V reads
                 * after the softmax. */
                const int64_t b = t0 / block_size;
                if (b + PREFETCH_BLOCKS < num_blocks)
                    prefetch_chunk((const char *)kv_chunks
                                   + (k_chunks[b + PREFETCH_BLOCKS] + layer_chunk_offset) * chunk_bytes, chunk_bytes);
                prefetch_chunk((const char *)kv_chunks + (v_chunks[b] + layer_chunk_offset) * chunk_bytes,
                               chunk_bytes);
            }
            const int64_t chunk = k_chunks[t0 / block_size] + layer_chunk_offset;
            const char *rows = (const char *)kv_chunks + (chunk * chunk_numel + (t0 % block_size) * head_dim) * elem;
            score_block16(qh, rows, sg + t0, ctx - t0, head_dim, scale, bf16);
        }
        float max = -FLT_MAX;
#pragma omp simd reduction(max : max)
        for (int64_t t = 0; t < ctx; t++) max = sg[t] > max ? sg[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; t++) {
            sg[t] = exp_nonpositive(sg[t] - max);
            sum += sg[t];
        }
        sg[ctx] = sum;   /* the scratch row has room: ctx + 1 < scores_stride */
        sg[ctx + 1] = max;
    }

    __m512 acc[4][MAX_HEAD_DIM / 16];
    for (int g = 0; g < heads; g++)
        for (int c = 0; c < head_dim / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const int64_t vb = (v_chunks[t0 / block_size] + layer_chunk_offset) * chunk_numel;
        const int64_t tn = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t t = 0; t < tn; t++) {
            const int64_t vt = vb + t * head_dim;
            __m512 p[4];
            for (int g = 0; g < heads; g++) p[g] = _mm512_set1_ps(scores[g * scores_stride + t0 + t]);
            for (int c = 0; c < head_dim / 16; c++) {
                const __m512 v = load16(kv_chunks, vt + 16 * c, bf16);
                for (int g = 0; g < heads; g++) acc[g][c] = _mm512_fmadd_ps(p[g], v, acc[g][c]);
            }
        }
    }
    for (int g = 0; g < heads; g++) {
        const float *sg = scores + g * scores_stride;
        if (partial != NULL) {
            float *pg = partial + g * (head_dim + 2);
            for (int c = 0; c < head_dim / 16; c++) _mm512_storeu_ps(pg + 16 * c, acc[g][c]);
            pg[head_dim] = sg[ctx + 1];
            pg[head_dim + 1] = sg[ctx];
            continue;
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sg[ctx]);
        for (int c = 0; c < head_dim / 16; c++)
            store16(out, (int64_t)g * head_dim + 16 * c, _mm512_mul_ps(acc[g][c], inv), bf16);
    }
}

/* The query heads of one pair in passes of as many heads as fit the registers, each pass inlined with constants. */
static inline __attribute__((always_inline)) void attend_pair_avx512(
    const void *q, int64_t q_head_stride, const void *kv_chunks, const int64_t *k_chunks, const int64_t *v_chunks,
    int64_t layer_chunk_offset, int64_t ctx, void *out, float *partial, int group, int block_size,
    const int head_dim, float scale, float *scores, int64_t scores_stride, const int bf16)
{
    const int per_pass = head_dim == 64 ? 4 : 2;
    const int elem = bf16 ? 2 : 4;
    for (int g0 = 0; g0 < group; g0 += per_pass) {
        const void *qg = (const char *)q + g0 * q_head_stride * elem;
        void *og = (char *)out + (int64_t)g0 * head_dim * elem;
        float *pg = partial == NULL ? NULL : partial + g0 * (head_dim + 2);
        const int heads = group - g0 < per_pass ? group - g0 : per_pass;
#define PASS(HEADS) attend_heads_avx512(qg, q_head_stride, kv_chunks, k_chunks, v_chunks, layer_chunk_offset, ctx, \
                                        og, pg, block_size, head_dim, scale, scores, scores_stride, HEADS, bf16)
        if (heads == 1) PASS(1);
        else if (heads == 2) PASS(2);
        else if (heads == 3) PASS(3);
        else PASS(4);
#undef PASS
    }
}
#endif

/* Returns 0, -1 when a thread's score buffer cannot be allocated, -2 for head_dim > MAX_HEAD_DIM. */
static inline __attribute__((always_inline)) int paged_decode(
    const void *q,                  /* [num_seqs, num_heads, head_dim], strides q_seq_stride, q_head_stride, 1 */
    int64_t q_seq_stride, int64_t q_head_stride,
    const void *kv_chunks,          /* arena as [num_chunks, block_size, head_dim] */
    const int64_t *chunk_table,     /* [num_seqs, num_kv_heads, 2, max_blocks] chunk ids of layer 0 */
    int64_t layer_chunk_offset,
    const int64_t *ctx_lens,        /* [num_seqs] tokens each sequence attends to, in [1, max_blocks * block_size] */
    void *out,                      /* [num_seqs, num_heads, head_dim], strides out_seq_stride, head_dim, 1 */
    int64_t out_seq_stride,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    float scale, int num_threads, const int bf16)
{
    if (head_dim > MAX_HEAD_DIM) return -2;
    const int group = num_heads / num_kv_heads;
    const int elem = bf16 ? 2 : 4;
    /* a score row per query head of a pass (at most 4), padded to whole score vectors plus one slot (1 / sum) */
    const int64_t scores_stride = (int64_t)max_blocks * block_size + 16 + 1;
#if defined(HAVE_AVX512_PATH)
    const int vector_path = (head_dim == 64 || head_dim == 128) && block_size % KEYS == 0;
#else
    const int vector_path = 0;
#endif
    /* Few (sequence, kv head) pairs cannot keep every thread busy to the end (one decode: 3 pairs on 2 threads).
     * Then each pair's context is cut into `splits` ranges of whole blocks, attended separately and combined
     * (flash-decoding): a split keeps its unnormalised output, score max and sum of exps in `partials`. */
    const int64_t pairs = (int64_t)num_seqs * num_kv_heads;
    int64_t splits = 1;
    if (vector_path && num_threads > 1 && pairs < 2 * num_threads) {
        splits = (SPLIT_ITEMS_PER_THREAD * num_threads + pairs - 1) / pairs;
        if (splits > max_blocks / MIN_SPLIT_BLOCKS) splits = max_blocks / MIN_SPLIT_BLOCKS;
        if (splits < 1) splits = 1;
    }
    const int64_t partial_stride = (int64_t)group * (head_dim + 2);   /* floats of one split's output */
    float *partials = NULL;
    if (splits > 1) {
        partials = (float *)malloc(sizeof(float) * (size_t)(pairs * splits * partial_stride));
        if (partials == NULL) return -1;
    }
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(4 * scores_stride));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < pairs * splits; item++) {
            if (scores == NULL) continue;
            const int64_t pair = item / splits, split = item % splits;
            const int64_t s = pair / num_kv_heads;
            const int h = (int)(pair % num_kv_heads);
            const int64_t *k_chunks = chunk_table + pair * 2 * max_blocks;
            const int64_t *v_chunks = k_chunks + max_blocks;
            const void *qh = (const char *)q + (s * q_seq_stride + (int64_t)h * group * q_head_stride) * elem;
            void *oh = (char *)out + (s * out_seq_stride + (int64_t)h * group * head_dim) * elem;
            /* constant head_dim and dtype inside each branch. The dtype is tested here, inside the OpenMP body,
             * because both entry points share one outlined body. */
#if defined(HAVE_AVX512_PATH)
            if (vector_path) {
                int64_t first_block = 0, ctx = ctx_lens[s];
                float *partial = NULL;
                if (splits > 1) {   /* this split's blocks: [first_block, first_block + per_split) of the context */
                    const int64_t blocks = (ctx + block_size - 1) / block_size;
                    const int64_t per_split = (blocks + splits - 1) / splits;
                    first_block = split * per_split;
                    const int64_t end = (first_block + per_split) * block_size < ctx
                                        ? (first_block + per_split) * block_size : ctx;
                    partial = partials + item * partial_stride;
                    if (first_block * block_size >= end) {   /* a short context leaves this split empty */
                        for (int g = 0; g < group; g++) {
                            partial[g * (head_dim + 2) + head_dim] = -FLT_MAX;
                            partial[g * (head_dim + 2) + head_dim + 1] = 0.0f;
                        }
                        continue;
                    }
                    ctx = end - first_block * block_size;
                }
#define ATTEND(HEAD_DIM, BF16) attend_pair_avx512(qh, q_head_stride, kv_chunks, k_chunks + first_block,           \
                                                  v_chunks + first_block, layer_chunk_offset, ctx, oh, partial,  \
                                                  group, block_size, HEAD_DIM, scale, scores, scores_stride, BF16)
                if (head_dim == 64) { if (bf16) ATTEND(64, 1); else ATTEND(64, 0); }
                else { if (bf16) ATTEND(128, 1); else ATTEND(128, 0); }
#undef ATTEND
                continue;
            }
#endif
#define ATTEND(HEAD_DIM, BF16) attend_pair_portable(qh, q_head_stride, kv_chunks, k_chunks, v_chunks,            \
                                                    layer_chunk_offset, ctx_lens[s], oh, group, block_size,      \
                                                    HEAD_DIM, scale, scores, BF16)
            if (bf16) {
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
        if (splits > 1) {
            /* after the loop's barrier: every split is done. Each query head's output is its splits' accumulators
             * rescaled to the largest max, over their rescaled sums. */
#pragma omp for schedule(static)
            for (int64_t row = 0; row < pairs * group; row++) {
                const int64_t pair = row / group;
                const int g = (int)(row % group);
                const int64_t s = pair / num_kv_heads;
                const int h = (int)(pair % num_kv_heads);
                const float *first = partials + pair * splits * partial_stride + g * (head_dim + 2);
                float max = -FLT_MAX;
                for (int64_t j = 0; j < splits; j++) {
                    const float m = first[j * partial_stride + head_dim];
                    max = m > max ? m : max;
                }
                float acc[MAX_HEAD_DIM], sum = 0.0f;
                for (int d = 0; d < head_dim; d++) acc[d] = 0.0f;
                for (int64_t j = 0; j < splits; j++) {
                    const float *pj = first + j * partial_stride;
                    if (pj[head_dim + 1] == 0.0f) continue;   /* an empty split */
                    const float w = exp_nonpositive(pj[head_dim] - max);
                    sum += w * pj[head_dim + 1];
                    for (int d = 0; d < head_dim; d++) acc[d] += w * pj[d];
                }
                const float inv = 1.0f / sum;
                char *o = (char *)out + (s * out_seq_stride + ((int64_t)h * group + g) * head_dim) * elem;
                for (int d = 0; d < head_dim; d++) {
                    if (bf16) ((uint16_t *)o)[d] = f32_to_bf16(acc[d] * inv);
                    else ((float *)o)[d] = acc[d] * inv;
                }
            }
        }
    }
    free(partials);
    return failed ? -1 : 0;
}

#define PAGED_DECODE_PARAMS                                                                                     \
    const void *q, int64_t q_seq_stride, int64_t q_head_stride, const void *kv_chunks,                          \
    const int64_t *chunk_table, int64_t layer_chunk_offset, const int64_t *ctx_lens, void *out,                 \
    int64_t out_seq_stride, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,        \
    int max_blocks, float scale, int num_threads
#define PAGED_DECODE_ARGS                                                                                       \
    q, q_seq_stride, q_head_stride, kv_chunks, chunk_table, layer_chunk_offset, ctx_lens, out, out_seq_stride,  \
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads

/* q, K/V and out fp32 */
int elastic_paged_decode_f32(PAGED_DECODE_PARAMS) { return paged_decode(PAGED_DECODE_ARGS, 0); }

/* q, K/V and out bf16 (uint16 bit patterns); computed in fp32 */
int elastic_paged_decode_bf16(PAGED_DECODE_PARAMS) { return paged_decode(PAGED_DECODE_ARGS, 1); }
