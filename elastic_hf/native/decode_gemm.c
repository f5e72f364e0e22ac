/* Linear products (any number of rows) over a weight that oneDNN has already packed for its inner product
 * (layers/packed_linear.py), read in place: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).
 *
 * Why: at a decode step's few rows the product is a stream of the weight from DRAM, and oneDNN's brgemm does not keep
 * the memory system busy at those shapes; and its bf16 kernel is built on vdpbf16ps, which on the AVX-512 Xeon this
 * was measured on issues at half the rate of an fp32 FMA, so at 8+ rows it is compute-bound at ~4 GB/s of weights.
 * This kernel walks the packed weight once, front to back, with up to ROW_TILE rows of x in registers, widens bf16
 * weights to fp32 in registers (a mask and a shift) and multiplies with fp32 FMAs, or, where vdpbf16ps issues at an
 * FMA's rate (AMD Zen 4), multiplies bf16 pairs with vdpbf16ps itself (tile_bf16_dot). The default model's 30 layers
 * and head, 2 threads (benchmarks/decode_gemm.py): bf16 ~1.2x oneDNN at 1 row, ~1.3x at 32, ~1.5x at 128; fp32 ~1.2x at
 * 1 row (session 45, before the next-chunk prefetch below; see benchmarks/RESULTS.md for the figures after it).
 *
 * Packed layouts read (oneDNN's format tags for an [N, K] = "ab" weight; native/decode_gemm.py checks, for every
 * shape, that the bytes oneDNN writes are this layout before the kernel may read them):
 *   bf16  AB16b64a2b: [N/64][K/32][16 k-pairs][64 n][2 k]    one k-pair of 64 outputs = 4 zmm
 *   fp32  AB16b64a:   [N/64][K/16][16 k][64 n]               one k of 64 outputs = 4 zmm
 * so N must be a multiple of 64 and K of 32 (bf16) or 16 (fp32): no padding is ever read.
 *
 * Work split: the N/16 column strips (16 outputs, one zmm) are cut into one contiguous range per thread, so 9 blocks
 * of 64 outputs on 2 threads are 18 strips each, not 5 blocks against 4. Each thread walks its range block by block,
 * up to 4 strips at a time, for up to ROW_TILE rows of x at once (4 x 6 accumulators + 4 weight registers + one
 * broadcast fit the 32 zmm registers); more rows re-read the block's strips from L1/L2, not from DRAM.
 *
 * Rounding: fp32 accumulation in k order; for bf16 each k-pair adds its odd product, then its even one, each rounded
 * (vdpbf16ps's definition), and the output is rounded to nearest even once. oneDNN orders its sums differently, so a
 * bf16 output differs from oneDNN's (and F.linear's) by one last bit in ~0.05 % of outputs (tests/layers/
 * test_decode_gemm.py bounds it), enough for a long greedy bf16 generation to take another token at a near-tie. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define ROW_CHUNK 128           /* rows of x widened and multiplied per pass: bounds the bf16 scratch at 128 x K;
                                 * a 64-deep K chunk of 128 fp32 rows (32 KiB) stays in L1 beside its 16 KiB of
                                 * weight (256 rows did not): default model at 512 rows, ours / oneDNN, fp32
                                 * 0.88-0.92 -> 0.92-0.95, bf16 1.57 -> 1.61-1.63 (benchmarks/decode_gemm.py) */
#define ROW_TILE 6
#define STRIPS_PER_BLOCK 4       /* 64 outputs a block, 16 a strip */
/* K tiles per chunk when several row tiles share the weight (see DEFINE_STRIPS): fp32 in 16 KiB chunks that stay in
 * L1 for the later row tiles (the default model's linears at 32 rows: 36.6 ms against 46 ms in 128 KiB chunks); bf16,
 * compute-bound on widening, in 128 KiB chunks (the partial sums' loads and stores cost more than L1 saves) */
#define K_CHUNK_TILES_F32 4
#define K_CHUNK_TILES_BF16 32
#define K_CHUNK_TILES_BF16_DOT 4    /* vdpbf16ps: no widening, so L1-sized chunks as fp32 */
#define BF16_DOT_FROM_ROWS 3         /* fewer rows take the widened walk (see elastic_decode_gemm_bf16_dot) */
#define K_CHUNK_TILES_BF16_AVX2 4   /* the AVX2 tile walks strip by strip: 16 KiB chunks that stay in L1 */
#define PREFETCH_BYTES 8192      /* software prefetch into L2, two 4 KiB tiles ahead in the weight stream */
#define STREAM_AHEAD_BYTES 512  /* AVX2 bf16, one pass: each 64 B line of the weight prefetched 2 k-pairs ahead */

/* Which kernels this build has: fp32 on AVX-512, else on AVX2 + FMA (ymm registers, below); bf16 with AVX512-BF16's
 * conversion on AVX-512, else the AVX2 + FMA tile (an AVX-512 CPU without AVX512-BF16 takes that one too). */
#if defined(__AVX512F__)
#define HAVE_F32 1
#define F32_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_F32 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16 1
#define BF16_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_BF16 1
#endif

#if defined(HAVE_F32)
#include <immintrin.h>
#endif

#define AI static inline __attribute__((always_inline))

#if defined(HAVE_F32)
/* A row tile's accumulators across K chunks: zero at the first chunk, else the fp32 sums the previous chunk left in
 * `partial` ([rows][64], this block's outputs); all but the last chunk store them back and return (fp32 in memory is
 * exact, so chunking changes no bit). */
#define LOAD_PARTIAL(acc, partial, first, s0, ns, rows) \
    for (int m = 0; m < rows; m++) \
        for (int j = 0; j < ns; j++) \
            acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + m * 64 + 16 * (s0 + j));
#define STORE_PARTIAL(acc, partial, last, s0, ns, rows) \
    if (!last) { \
        for (int m = 0; m < rows; m++) \
            for (int j = 0; j < ns; j++) _mm512_storeu_ps(partial + m * 64 + 16 * (s0 + j), acc[m][j]); \
        return; \
    }

/* The weight a row tile prefetches into L2 while it computes: the thread's next K chunk, spread evenly over all the
 * row tiles of the current chunk and, within a tile, over all its iterations (every kt of every strip group of the
 * AVX2 tiles), so that the DRAM stream runs at an even rate while they compute. Else each chunk's first row tile
 * waits on DRAM and the others on nothing, and the two add up; and where the prefetches ran in the first strip group
 * only, the memory sat idle during the other groups (AVX2, default model's linears, 2 threads, fp32 4 / 8 / 16 rows:
 * 66.8 / 71.8 / 82.3 -> 45.0 / 43.8 / 60.5 ms; bf16 4 / 8 rows 40.8 / 43.7 -> 27.1 / 30.1 ms; 32+ rows level:
 * python benchmarks/kernel_ab.py --base 7370041).
 * k-rows [r0, r1) of the next chunk (256 B each: 64 fp32 outputs, or 64 bf16 outputs x one k-pair) are this row
 * tile's share, of `ns` strips from `s0`, at `base`; `first`: the chunk's first row tile. base NULL: no next chunk
 * (one row tile, or the thread's last chunk). */
typedef struct { const char *base; int64_t r0, r1; int s0, ns, first; } NextChunk;

/* k-rows of the next chunk a row tile prefetches per iteration when it runs `iters` of them: its share, rounded up
 * (one division a tile, not one an iteration: in the AVX2 bf16 tile's loop a division an iteration took 268 ms
 * where the walk takes 174, default model at 64 rows). */
AI int64_t prefetch_rows_per_iteration(const NextChunk *pf, int64_t iters)
{
    return pf->base ? (pf->r1 - pf->r0 + iters - 1) / iters : 0;
}

/* Prefetches of iteration `it` of a row tile's walk over the chunk: `per_it` k-rows of its share of the next chunk,
 * and for the chunk's first row tile, while it walks the chunk's tile (4 KiB, [16 k or k-pairs][64 n]) at `tile` for
 * the first time (`ahead`), also the stream two tiles ahead within this chunk (what the later row tiles then re-read
 * is in L1/L2 already). */
AI void prefetch_weight(const NextChunk *pf, int64_t it, int64_t per_it, const char *tile, int s0, int ahead)
{
    const int64_t begin = pf->r0 + it * per_it, end = begin + per_it < pf->r1 ? begin + per_it : pf->r1;
    for (int64_t r = begin; r < end; r++)
        for (int j = 0; j < pf->ns; j++) _mm_prefetch(pf->base + r * 256 + 64 * (pf->s0 + j), _MM_HINT_T1);
    if (ahead && pf->first) {
        _mm_prefetch(tile + PREFETCH_BYTES + 64 * s0, _MM_HINT_T1);
        _mm_prefetch(tile + PREFETCH_BYTES + 64 * s0 + 2048, _MM_HINT_T1);
    }
}

/* The AVX2 tiles (the fp32 one below where there is no AVX-512, the bf16 one where there is no AVX512-BF16): strips
 * in groups of STRIP_GROUP(rows) (see the AVX2 fp32 tile), and the order of broadcasts and weight loads. */
#define STRIP_GROUP(rows) ((rows) == 1 ? 4 : (rows) <= 3 ? 2 : 1)
/* Every loop of the AVX2 tiles over rows and vectors is unrolled: otherwise gcc 12 kept their accumulator arrays in
 * memory, a store of each per k (native/quant_gemm.c's AVX2 tiles ran at half speed that way). */
#define UNROLL _Pragma("GCC unroll 8")
/* Broadcast every row's input once and stream the group's weight registers past them where accumulators, inputs and
 * a weight register fit the 16 registers; else (one strip, 6 rows) hold the strip's 2 weight registers and broadcast
 * row by row: the other order spilled accumulators (32 rows: 77 -> 97 ms). */
#define BROADCASTS_FIRST(rows, g) ((rows) * (2 * (g) + 1) + 1 <= 16)

/* The AVX2 tiles' version of LOAD_PARTIAL, 8 outputs of one row: zero at the first K chunk, else the sums the
 * previous chunk left in `partial` ([rows][64]). */
AI __m256 partial_or_zero(const float *partial, int first)
{
    return first ? _mm256_setzero_ps() : _mm256_loadu_ps(partial);
}

/* ---------------------------------------------------------------------------------------------------------- fp32 */
#if defined(F32_AVX512)
/* Rows [0, rows) of x against strips [s0, s0 + ns) of one block (64 outputs) whose K/16 tiles start at w. */
AI void tile_f32(const float *w, int64_t k_tiles, const float *x, int64_t ldx, float *y, int64_t ldy,
                 const float *bias, float *partial, int first, int last, const NextChunk *pf, int s0, const int ns,
                 const int rows)
{
    __m512 acc[ROW_TILE][STRIPS_PER_BLOCK];
    LOAD_PARTIAL(acc, partial, first, s0, ns, rows)
    const int64_t per_it = prefetch_rows_per_iteration(pf, k_tiles);
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        const float *tile = w + kt * 16 * 64;               /* [16 k][64 n] */
        prefetch_weight(pf, kt, per_it, (const char *)tile, s0, 1);
        for (int kk = 0; kk < 16; kk++) {
            __m512 wv[STRIPS_PER_BLOCK];
            for (int j = 0; j < ns; j++) wv[j] = _mm512_loadu_ps(tile + kk * 64 + 16 * (s0 + j));
            const int64_t k = kt * 16 + kk;
            for (int m = 0; m < rows; m++) {
                const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
                for (int j = 0; j < ns; j++) acc[m][j] = _mm512_fmadd_ps(wv[j], xb, acc[m][j]);
            }
        }
    }
    STORE_PARTIAL(acc, partial, last, s0, ns, rows)
    for (int j = 0; j < ns; j++) {
        const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * (s0 + j)) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++) _mm512_storeu_ps(y + m * ldy + 16 * (s0 + j), _mm512_add_ps(acc[m][j], b));
    }
}

#else
/* ------------------------------------------------------------------------------------------------ AVX2 + FMA */
/* The same walk with 16 ymm registers: a strip of 16 outputs is 2 ymm, so 4 strips x 6 rows of accumulators do not
 * fit. The strips go in groups of STRIP_GROUP(rows), as many as keep rows x group x 2 accumulators, the rows' inputs
 * and a weight register within 16: one row takes all 4 strips at once (each k-row of the tile read once, in order),
 * 2-3 rows 2 strips, 4-6 rows one; a later group re-reads its bytes of the K chunk from L1, not DRAM (the chunk is
 * cut to 16 KiB: DEFINE_STRIPS's STRIP_BY_STRIP). Strip by strip at 2 rows ran the default model's linears at half
 * the speed of one row (the weight's k-rows read a quarter at a time). Sums in k order in fp32, as the AVX-512 tile. */

AI void tile_f32(const float *w, int64_t k_tiles, const float *x, int64_t ldx, float *y, int64_t ldy,
                 const float *bias, float *partial, int first, int last, const NextChunk *pf, int s0, const int ns,
                 const int rows)
{
    const int group = STRIP_GROUP(rows);
    const int64_t per_it = prefetch_rows_per_iteration(pf, (ns + group - 1) / group * k_tiles);
    for (int j0 = 0; j0 < ns; j0 += group) {
        const int g = ns - j0 < group ? ns - j0 : group;   /* strips in this group */
        const int c = 16 * (s0 + j0);                       /* the group's first output in the block */
        __m256 acc[ROW_TILE][STRIPS_PER_BLOCK * 2];
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++) acc[m][v] = partial_or_zero(partial + m * 64 + c + 8 * v, first);
        for (int64_t kt = 0; kt < k_tiles; kt++) {
            const float *tile = w + kt * 16 * 64;           /* [16 k][64 n] */
            prefetch_weight(pf, j0 / group * k_tiles + kt, per_it, (const char *)tile, s0, j0 == 0);
            for (int kk = 0; kk < 16; kk++) {
                const int64_t k = kt * 16 + kk;
                if (BROADCASTS_FIRST(rows, g)) {
                    __m256 xb[ROW_TILE];
                    UNROLL for (int m = 0; m < rows; m++) xb[m] = _mm256_broadcast_ss(x + m * ldx + k);
                    UNROLL for (int v = 0; v < 2 * g; v++) {
                        const __m256 wv = _mm256_loadu_ps(tile + kk * 64 + c + 8 * v);
                        UNROLL for (int m = 0; m < rows; m++) acc[m][v] = _mm256_fmadd_ps(wv, xb[m], acc[m][v]);
                    }
                } else {
                    __m256 wv[2];
                    UNROLL for (int v = 0; v < 2; v++) wv[v] = _mm256_loadu_ps(tile + kk * 64 + c + 8 * v);
                    UNROLL for (int m = 0; m < rows; m++) {
                        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
                        UNROLL for (int v = 0; v < 2; v++) acc[m][v] = _mm256_fmadd_ps(wv[v], xb, acc[m][v]);
                    }
                }
            }
        }
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++) {
                if (!last) _mm256_storeu_ps(partial + m * 64 + c + 8 * v, acc[m][v]);
                else _mm256_storeu_ps(y + m * ldy + c + 8 * v,
                                      bias ? _mm256_add_ps(acc[m][v], _mm256_loadu_ps(bias + c + 8 * v)) : acc[m][v]);
            }
    }
}
#endif

/* dispatch to an instance with constant strip and row counts, so every loop above unrolls into registers */
#define DISPATCH_ROWS(FN, NS, ...) \
    switch (rows) { case 1: FN(__VA_ARGS__, NS, 1); break; case 2: FN(__VA_ARGS__, NS, 2); break; \
                    case 3: FN(__VA_ARGS__, NS, 3); break; case 4: FN(__VA_ARGS__, NS, 4); break; \
                    case 5: FN(__VA_ARGS__, NS, 5); break; default: FN(__VA_ARGS__, NS, 6); break; }
#define DISPATCH(FN, ...) \
    switch (ns) { case 1: DISPATCH_ROWS(FN, 1, __VA_ARGS__) break; case 2: DISPATCH_ROWS(FN, 2, __VA_ARGS__) break; \
                  case 3: DISPATCH_ROWS(FN, 3, __VA_ARGS__) break; default: DISPATCH_ROWS(FN, 4, __VA_ARGS__) break; }

/* A thread's strips [first, last) for all rows of x: block by block, up to 4 strips at a time, rows in balanced tiles
 * (8 rows are 4 + 4, not 6 + 2). K_TILE: k elements per packed tile (16 fp32, 32 bf16), each 64 outputs wide and 4 KiB.
 * With more than one row tile, K is cut into chunks of K_CHUNK_TILES tiles, every row tile runs one chunk before the
 * next chunk starts: the rows after the first re-read the chunk from L1/L2, where a whole column (1 MiB at K = 8192)
 * would have left L2 and come from DRAM again. Meanwhile every row tile prefetches its share of the thread's next
 * chunk into L2 (NextChunk), so the weight streams from DRAM while the rows compute: without it each chunk's first
 * row tile waited on DRAM and the DRAM sat idle during the others (default model, 32 rows: fp32 50 -> 37 ms, bf16
 * 44 -> 36 ms). */
#define DEFINE_STRIPS(NAME, TILE_FN, W_T, X_T, Y_T, K_TILE, K_CHUNK_TILES, STRIP_BY_STRIP) \
static void NAME(const W_T *w, int64_t k, const X_T *x, int64_t ldx, Y_T *y, int64_t ldy, const Y_T *bias, \
                 float *partial, int64_t rows_total, int64_t first, int64_t last) \
{ \
    const int64_t k_tiles = k / (K_TILE); \
    const int64_t tiles = (rows_total + ROW_TILE - 1) / ROW_TILE; \
    /* (a tile that walks strip by strip re-reads the chunk once a strip: chunked from 2 rows on, as several tiles) */ \
    const int chunked = tiles > 1 || ((STRIP_BY_STRIP) && rows_total > 1); \
    const int64_t chunk_tiles = chunked ? K_CHUNK_TILES : k_tiles; \
    for (int64_t s = first; s < last;) { \
        const int64_t block = s / STRIPS_PER_BLOCK; \
        const int s0 = (int)(s % STRIPS_PER_BLOCK); \
        const int ns = (int)((last - s) < STRIPS_PER_BLOCK - s0 ? (last - s) : STRIPS_PER_BLOCK - s0); \
        const W_T *wb = w + block * k_tiles * (K_TILE) * 64; \
        const Y_T *bias_b = bias ? bias + block * 64 : NULL; \
        for (int64_t kt0 = 0; kt0 < k_tiles; kt0 += chunk_tiles) { \
            const int64_t kts = k_tiles - kt0 < chunk_tiles ? k_tiles - kt0 : chunk_tiles; \
            const int first_chunk = kt0 == 0, last_chunk = kt0 + kts == k_tiles; \
            /* the next chunk: this block's next K range, else the first chunk of the thread's next block */ \
            NextChunk pf = {NULL, 0, 0, s0, ns, 1}; \
            int64_t pf_rows = 0; \
            if (chunked && !last_chunk) { \
                pf.base = (const char *)(wb + (kt0 + kts) * (K_TILE) * 64); \
                pf_rows = (k_tiles - kt0 - kts < chunk_tiles ? k_tiles - kt0 - kts : chunk_tiles) * 16; \
            } else if (chunked && s + ns < last) { \
                pf.base = (const char *)(wb + k_tiles * (K_TILE) * 64); \
                pf_rows = (k_tiles < chunk_tiles ? k_tiles : chunk_tiles) * 16; \
                pf.s0 = 0; \
                pf.ns = (int)(last - s - ns < STRIPS_PER_BLOCK ? last - s - ns : STRIPS_PER_BLOCK); \
            } \
            for (int64_t t = 0; t < tiles; t++) { \
                const int64_t m0 = rows_total * t / tiles; \
                const int rows = (int)(rows_total * (t + 1) / tiles - m0); \
                pf.r0 = pf_rows * t / tiles; \
                pf.r1 = pf_rows * (t + 1) / tiles; \
                pf.first = t == 0; \
                DISPATCH(TILE_FN, wb + kt0 * (K_TILE) * 64, kts, x + m0 * ldx + kt0 * (K_TILE), ldx, \
                         y + m0 * ldy + block * 64, ldy, bias_b, partial + m0 * 64, first_chunk, last_chunk, \
                         &pf, s0) \
            } \
        } \
        s += ns; \
    } \
}

#if defined(F32_AVX512)
DEFINE_STRIPS(strips_f32, tile_f32, float, float, float, 16, K_CHUNK_TILES_F32, 0)
#else
DEFINE_STRIPS(strips_f32, tile_f32, float, float, float, 16, K_CHUNK_TILES_F32, 1)
#endif

/* ---------------------------------------------------------------------------------------------------------- bf16 */
#if defined(BF16_AVX512)
/* A bf16 row tile's outputs after its last K chunk: the fp32 sums plus the bias, rounded to nearest even once. */
AI void store_bf16_tile(__m512 acc[ROW_TILE][STRIPS_PER_BLOCK], uint16_t *y, int64_t ldy, const uint16_t *bias,
                        int s0, const int ns, const int rows)
{
    for (int j = 0; j < ns; j++) {
        __m512 b = _mm512_setzero_ps();
        if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(bias + 16 * (s0 + j)))), 16));
        for (int m = 0; m < rows; m++)
            _mm256_storeu_si256((void *)(y + m * ldy + 16 * (s0 + j)),
                                (__m256i)_mm512_cvtneps_pbh(bias ? _mm512_add_ps(acc[m][j], b) : acc[m][j]));
    }
}

/* x arrives widened to fp32 (xf, [rows, k]); each packed weight register (16 outputs x one k-pair) is split into its
 * odd and even halves, widened by a mask and a shift, and goes through two fp32 FMAs: the odd product first, then the
 * even one, each rounded, which is vdpbf16ps's own definition (so results equal oneDNN's), at the FMA ports' rate.
 * On the Xeon of session 45 vdpbf16ps itself issues at half the FMA rate, so at 4+ rows it would be the bound there
 * (where it issues at the full rate, tile_bf16_dot below is the faster walk). */
AI void tile_bf16(const uint16_t *w, int64_t k_tiles, const float *xf, int64_t ldx, uint16_t *y, int64_t ldy,
                  const uint16_t *bias, float *partial, int first, int last, const NextChunk *pf, int s0,
                  const int ns, const int rows)
{
    __m512 acc[ROW_TILE][STRIPS_PER_BLOCK];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    LOAD_PARTIAL(acc, partial, first, s0, ns, rows)
    const int64_t per_it = prefetch_rows_per_iteration(pf, k_tiles);
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        const uint16_t *tile = w + kt * 16 * 64 * 2;          /* [16 k-pairs][64 n][2] */
        prefetch_weight(pf, kt, per_it, (const char *)tile, s0, 1);
        for (int kp = 0; kp < 16; kp++) {
            __m512i packed[STRIPS_PER_BLOCK];
            __m512 wv[STRIPS_PER_BLOCK];
            for (int j = 0; j < ns; j++) {
                packed[j] = _mm512_loadu_si512((const void *)(tile + (kp * 64 + 16 * (s0 + j)) * 2));
                wv[j] = _mm512_castsi512_ps(_mm512_and_si512(packed[j], high));        /* W[n, 2kp + 1] */
            }
            const int64_t k = (kt * 16 + kp) * 2;
            for (int m = 0; m < rows; m++) {
                const __m512 xb = _mm512_set1_ps(xf[m * ldx + k + 1]);
                for (int j = 0; j < ns; j++) acc[m][j] = _mm512_fmadd_ps(wv[j], xb, acc[m][j]);
            }
            for (int j = 0; j < ns; j++) wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(packed[j], 16));   /* 2kp */
            for (int m = 0; m < rows; m++) {
                const __m512 xb = _mm512_set1_ps(xf[m * ldx + k]);
                for (int j = 0; j < ns; j++) acc[m][j] = _mm512_fmadd_ps(wv[j], xb, acc[m][j]);
            }
        }
    }
    STORE_PARTIAL(acc, partial, last, s0, ns, rows)
    store_bf16_tile(acc, y, ldy, bias, s0, ns, rows);
}

DEFINE_STRIPS(strips_bf16, tile_bf16, uint16_t, float, uint16_t, 32, K_CHUNK_TILES_BF16, 0)

/* The same walk on vdpbf16ps itself: x stays bf16 (no widening pass), each broadcast is one row's k-pair and one
 * instruction adds both products of 16 outputs, odd then even, each rounded: the emulation above bit for bit, except
 * that vdpbf16ps treats denormal inputs and outputs as zero. Where it issues at an FMA's rate (AMD Zen 4: 32
 * multiply-adds an instruction against the emulation's 16 plus a mask or shift), this is twice the arithmetic rate;
 * where it issues at half that (the Xeon above) it is no faster. Which of the two a process runs is measured once,
 * at first use (native/decode_gemm.py). */
AI void tile_bf16_dot(const uint16_t *w, int64_t k_tiles, const uint16_t *x, int64_t ldx, uint16_t *y,
                      int64_t ldy, const uint16_t *bias, float *partial, int first, int last, const NextChunk *pf,
                      int s0, const int ns, const int rows)
{
    __m512 acc[ROW_TILE][STRIPS_PER_BLOCK];
    LOAD_PARTIAL(acc, partial, first, s0, ns, rows)
    const int64_t per_it = prefetch_rows_per_iteration(pf, k_tiles);
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        const uint16_t *tile = w + kt * 16 * 64 * 2;          /* [16 k-pairs][64 n][2] */
        prefetch_weight(pf, kt, per_it, (const char *)tile, s0, 1);
        for (int kp = 0; kp < 16; kp++) {
            __m512bh wv[STRIPS_PER_BLOCK];
            for (int j = 0; j < ns; j++)
                wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(tile + (kp * 64 + 16 * (s0 + j)) * 2));
            const int64_t k = (kt * 16 + kp) * 2;
            for (int m = 0; m < rows; m++) {
                int32_t pair;                                   /* x[m, k] and x[m, k + 1] */
                memcpy(&pair, x + m * ldx + k, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < ns; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
            }
        }
    }
    STORE_PARTIAL(acc, partial, last, s0, ns, rows)
    store_bf16_tile(acc, y, ldy, bias, s0, ns, rows);
}

DEFINE_STRIPS(strips_bf16_dot, tile_bf16_dot, uint16_t, uint16_t, uint16_t, 32, K_CHUNK_TILES_BF16_DOT, 0)
#elif defined(HAVE_BF16)
/* AVX2 + FMA: as the AVX-512 tile, a ymm of packed weight (8 outputs x one k-pair) splits into its odd and even
 * halves by a mask and a shift, the odd product first, then the even one, in fp32 FMAs; strips in groups as the AVX2
 * fp32 tile takes them (STRIP_GROUP, BROADCASTS_FIRST). The output rounds to nearest even in integer ops
 * (bf16.h's f32x8_to_bf16: no AVX512-BF16 conversion here). */
AI __m256 bf16x8_to_f32(const uint16_t *v)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)v)), 16));
}

AI void store_bf16(uint16_t *y, __m256 acc, const uint16_t *bias)
{
    _mm_storeu_si128((__m128i *)y, f32x8_to_bf16(bias ? _mm256_add_ps(acc, bf16x8_to_f32(bias)) : acc));
}

AI void tile_bf16(const uint16_t *w, int64_t k_tiles, const float *xf, int64_t ldx, uint16_t *y, int64_t ldy,
                  const uint16_t *bias, float *partial, int first, int last, const NextChunk *pf, int s0,
                  const int ns, const int rows)
{
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const int group = STRIP_GROUP(rows);
    const int64_t per_it = prefetch_rows_per_iteration(pf, (ns + group - 1) / group * k_tiles);
    for (int j0 = 0; j0 < ns; j0 += group) {
        const int g = ns - j0 < group ? ns - j0 : group;
        const int c = 16 * (s0 + j0);
        __m256 acc[ROW_TILE][STRIPS_PER_BLOCK * 2];
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++) acc[m][v] = partial_or_zero(partial + m * 64 + c + 8 * v, first);
        for (int64_t kt = 0; kt < k_tiles; kt++) {
            const uint16_t *tile = w + kt * 16 * 64 * 2;      /* [16 k-pairs][64 n][2] */
            /* With no next chunk to fetch (one row: a single pass over the weight; or a thread's last chunk, whose
             * first row tile streams it for the others, as prefetch_weight's `ahead` does) the two lines a tile that
             * prefetch_weight fetches two tiles ahead slowed the stream down, and every line fetched 512 B ahead sped
             * it up: Llama-3.2-1B's linears and head at 1 row on the 2-core AVX2 EPYC, 2 threads, 114.2 -> 105.5 ms
             * (x1.082, 25 rounds; 2.47 GB at 23.4 GB/s; `python benchmarks/kernel_ab.py --base 588749f --dtype bfloat16
             * --rows 1 --shape llama-3.2-1b --rounds 25`). 256 B and 1-2 KiB ahead gained less, L1 (T0) about as much
             * as L2 (x1.024 against x1.033-1.102). The AVX2 fp32 tile keeps prefetch_weight's: per-line prefetches made
             * its one-row walk slower (x0.89-0.90, the same benchmark at --dtype float32). */
            const int stream = !pf->base && pf->first;
            prefetch_weight(pf, j0 / group * k_tiles + kt, per_it, (const char *)tile, s0, j0 == 0 && pf->base);
            for (int kp = 0; kp < 16; kp++) {
                const int64_t k = (kt * 16 + kp) * 2;
                const uint16_t *row = tile + (kp * 64 + c) * 2;   /* 8 outputs x one k-pair a ymm */
                if (stream)
                    UNROLL for (int j = 0; j < g; j++)      /* strip j's 16 outputs x one k-pair: one 64 B line */
                        _mm_prefetch((const char *)(row + 32 * j) + STREAM_AHEAD_BYTES, _MM_HINT_T1);
                if (BROADCASTS_FIRST(rows, g)) {
                    __m256 xb[ROW_TILE];
                    UNROLL for (int m = 0; m < rows; m++) xb[m] = _mm256_broadcast_ss(xf + m * ldx + k + 1);
                    UNROLL for (int v = 0; v < 2 * g; v++) {                                /* W[n, 2kp + 1] */
                        const __m256 wv = _mm256_castsi256_ps(
                            _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + 16 * v)), high));
                        UNROLL for (int m = 0; m < rows; m++) acc[m][v] = _mm256_fmadd_ps(wv, xb[m], acc[m][v]);
                    }
                    UNROLL for (int m = 0; m < rows; m++) xb[m] = _mm256_broadcast_ss(xf + m * ldx + k);
                    UNROLL for (int v = 0; v < 2 * g; v++) {                                /* W[n, 2kp] */
                        const __m256 wv = _mm256_castsi256_ps(
                            _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(row + 16 * v)), 16));
                        UNROLL for (int m = 0; m < rows; m++) acc[m][v] = _mm256_fmadd_ps(wv, xb[m], acc[m][v]);
                    }
                } else {
                    __m256 wv[2];
                    UNROLL for (int v = 0; v < 2; v++)
                        wv[v] = _mm256_castsi256_ps(
                            _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + 16 * v)), high));
                    UNROLL for (int m = 0; m < rows; m++) {
                        const __m256 xb = _mm256_broadcast_ss(xf + m * ldx + k + 1);
                        UNROLL for (int v = 0; v < 2; v++) acc[m][v] = _mm256_fmadd_ps(wv[v], xb, acc[m][v]);
                    }
                    UNROLL for (int v = 0; v < 2; v++)
                        wv[v] = _mm256_castsi256_ps(
                            _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(row + 16 * v)), 16));
                    UNROLL for (int m = 0; m < rows; m++) {
                        const __m256 xb = _mm256_broadcast_ss(xf + m * ldx + k);
                        UNROLL for (int v = 0; v < 2; v++) acc[m][v] = _mm256_fmadd_ps(wv[v], xb, acc[m][v]);
                    }
                }
            }
        }
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++) {
                if (!last) _mm256_storeu_ps(partial + m * 64 + c + 8 * v, acc[m][v]);
                else store_bf16(y + m * ldy + c + 8 * v, acc[m][v], bias ? bias + c + 8 * v : NULL);
            }
    }
}

DEFINE_STRIPS(strips_bf16, tile_bf16, uint16_t, float, uint16_t, 32, K_CHUNK_TILES_BF16_AVX2, 1)
#endif
#endif

/* The thread's contiguous share of `strips` strips. */
#define SHARE(strips, first, last) \
    const int nt = omp_get_num_threads(), t = omp_get_thread_num(); \
    const int64_t first = (strips) * t / nt, last = (strips) * (t + 1) / nt;

#include <omp.h>

/* This OpenMP thread's fp32 sums between K chunks: ROW_CHUNK rows x 64 outputs (32 KiB), allocated on first use and
 * kept for the thread's life; NULL if that allocation failed. */
static float *partial_sums(void)
{
    static _Thread_local float *sums;
    if (!sums) sums = malloc(sizeof(float) * ROW_CHUNK * 64);
    return sums;
}

/* A product whose strips read x as it is (fp32; bf16 on vdpbf16ps), in passes of ROW_CHUNK rows, each on all the
 * threads, each thread its share of the strips. Returns 0, or -2 where a thread's partial sums could not be had. */
#define DEFINE_PASSES(NAME, STRIPS_FN, T) \
static int NAME(const T *x, int64_t ldx, const T *w, const T *bias, T *y, int64_t ldy, int64_t m, int64_t n, \
                int64_t k, int threads) \
{ \
    const int64_t strips = n / 16; \
    int failed = 0; \
    for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) { \
        const int64_t rows = m - m0 < ROW_CHUNK ? m - m0 : ROW_CHUNK; \
        _Pragma("omp parallel num_threads(threads > 1 && strips > 1 ? threads : 1) reduction(|: failed)") \
        { \
            float *partial = partial_sums(); \
            SHARE(strips, first, last) \
            if (partial) STRIPS_FN(w, k, x + m0 * ldx, ldx, y + m0 * ldy, ldy, bias, partial, rows, first, last); \
            else failed = 1; \
        } \
    } \
    return failed ? -2 : 0; \
}
#if defined(HAVE_F32)
DEFINE_PASSES(passes_f32, strips_f32, float)
#endif
#if defined(BF16_AVX512)
DEFINE_PASSES(passes_bf16_dot, strips_bf16_dot, uint16_t)
#endif

/* ------------------------------------------------------------------- AVX2: a bf16 prefill's rows in panels */
#if defined(HAVE_BF16) && !defined(BF16_AVX512)
#define HAVE_BF16_PANELS 1
/* From this many rows a bf16 product on AVX2 runs in panels (bf16_panels below) instead of the walk, which widens
 * every weight once per row tile and re-reads x from 6 row streams in 64-deep K chunks. The default model's 30 layers
 * and head on a 2-core AVX2 EPYC, 2 threads, walk / panels (benchmarks/kernel_ab.py, outputs bit-identical): 64 and
 * 96 rows 1.13x in one run (67 rows 1.00x in another: so from 96), 128 rows 1.14x, 300 rows 1.18-1.33x, 400 rows
 * 1.20x, 512 rows 1.29x. fp32 stays on the walk: the same panels were level with it there (0.79-1.04x). */
#define PANEL_FROM_ROWS 96
#define PANEL_KC 256        /* k of a panel: one strip's 256 x 16 fp32 (16 KiB) stays in L1 while every row tile reads it */
#define PANEL_MC 384        /* rows of x packed at a time: 384 x 256 fp32 (384 KiB) stay in L2 */
#define PANEL_NS 64         /* strips (1,024 outputs) whose fp32 sums a thread keeps between panels */

/* 6 rows x 16 outputs over kc k: ap packed [kc][6] (rows), bp [kc][16] (the strip's weights), c the 6 x 16 fp32
 * sums (row stride ldc): zero at the first panel, else what the previous panels left there. */
AI void panel_tile(const float *ap, const float *bp, float *c, int64_t ldc, int64_t kc, int first)
{
    __m256 acc[6][2];
    UNROLL for (int m = 0; m < 6; m++)
        UNROLL for (int v = 0; v < 2; v++)
            acc[m][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + m * ldc + 8 * v);
    for (int64_t kk = 0; kk < kc; kk++) {
        const __m256 w0 = _mm256_load_ps(bp + kk * 16), w1 = _mm256_load_ps(bp + kk * 16 + 8);
        UNROLL for (int m = 0; m < 6; m++) {
            const __m256 xb = _mm256_broadcast_ss(ap + kk * 6 + m);
            acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
        }
    }
    UNROLL for (int m = 0; m < 6; m++)
        UNROLL for (int v = 0; v < 2; v++) _mm256_storeu_ps(c + m * ldc + 8 * v, acc[m][v]);
}

/* Rows [m0, m0 + rows) of x, k in [k0, k0 + kc), widened into `tiles` tiles of [kc][6] (rows past the end zero), in
 * tile_bf16's order of summing: each k-pair's odd k, then its even one (packed index kk holds k0 + (kk ^ 1)). */
static void pack_rows(const uint16_t *x, int64_t ldx, int64_t m0, int64_t rows, int64_t k0, int64_t kc,
                      int64_t tiles, float *ap)
{
    for (int64_t t = 0; t < tiles; t++)
        for (int r = 0; r < 6; r++) {
            float *out = ap + t * kc * 6 + r;
            if (6 * t + r >= rows) {
                for (int64_t kk = 0; kk < kc; kk++) out[kk * 6] = 0.0f;
                continue;
            }
            const uint16_t *in = x + (m0 + 6 * t + r) * ldx + k0;
            for (int64_t kk = 0; kk < kc; kk++) out[kk * 6] = bf16_to_f32(in[kk ^ 1]);
        }
}

/* Strip s's weights (AB16b64a2b: [N/64][K/32][16 k-pairs][64 n][2 k]), k in [k0, k0 + kc), widened into [kc][16]
 * in the same order as pack_rows. */
static void pack_strip(const uint16_t *w, int64_t k, int64_t s, int64_t k0, int64_t kc, float *bp)
{
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const uint16_t *ws = w + (s / STRIPS_PER_BLOCK) * k * 64 + 32 * (s % STRIPS_PER_BLOCK);
    for (int64_t kk = 0; kk < kc; kk += 2) {          /* a k-pair of 16 outputs: 2 ymm of (even, odd) pairs */
        const uint16_t *pair = ws + ((k0 + kk) / 2) * 128;
        UNROLL for (int v = 0; v < 2; v++) {
            const __m256i both = _mm256_loadu_si256((const __m256i *)(pair + 16 * v));
            _mm256_store_ps(bp + kk * 16 + 8 * v, _mm256_castsi256_ps(_mm256_and_si256(both, high)));   /* odd k */
            _mm256_store_ps(bp + (kk + 1) * 16 + 8 * v, _mm256_castsi256_ps(_mm256_slli_epi32(both, 16)));
        }
    }
}

/* y[m, n] = x W^T (+ bias), bf16, for many rows on AVX2. Each thread takes its share of the strips, PANEL_NS at a
 * time; per block of PANEL_MC rows and panel of PANEL_KC k it widens the rows once and each strip's weights once,
 * then runs every 6-row tile over them; the fp32 sums wait in the thread's scratch between panels (exact) and are
 * rounded once after the last, with the bias (store_bf16). Every output is the walk's FMA chain (tile_bf16):
 * bit-identical. Returns 0, or -2 where a thread's buffers could not be had. */
static int bf16_panels(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t ldy, int64_t m, int64_t n, int64_t k, int threads)
{
    const int64_t strips = n / 16;
    int failed = 0;
    #pragma omp parallel num_threads(threads > 1 && strips > 1 ? threads : 1) reduction(|: failed)
    {
        static _Thread_local float *ap, *bp, *sums;   /* kept for the thread's life: 384 KiB, 16 KiB, 1.5 MiB */
        if (!ap) ap = aligned_alloc(64, sizeof(float) * PANEL_MC * PANEL_KC);
        if (!bp) bp = aligned_alloc(64, sizeof(float) * PANEL_KC * 16);
        if (!sums) sums = malloc(sizeof(float) * PANEL_MC * PANEL_NS * 16);
        SHARE(strips, first, last)
        failed = !ap || !bp || !sums;
        for (int64_t g0 = first; !failed && g0 < last; g0 += PANEL_NS) {
            const int64_t g1 = last - g0 < PANEL_NS ? last : g0 + PANEL_NS, width = 16 * (g1 - g0);
            for (int64_t m0 = 0; m0 < m; m0 += PANEL_MC) {
                const int64_t rows = m - m0 < PANEL_MC ? m - m0 : PANEL_MC, tiles = (rows + 5) / 6;
                for (int64_t k0 = 0; k0 < k; k0 += PANEL_KC) {
                    const int64_t kc = k - k0 < PANEL_KC ? k - k0 : PANEL_KC;
                    pack_rows(x, ldx, m0, rows, k0, kc, tiles, ap);
                    for (int64_t s = g0; s < g1; s++) {
                        pack_strip(w, k, s, k0, kc, bp);
                        for (int64_t t = 0; t < tiles; t++) {
                            float *c = sums + 6 * t * width + 16 * (s - g0);
                            if (rows - 6 * t >= 6) {
                                panel_tile(ap + t * kc * 6, bp, c, width, kc, k0 == 0);
                                continue;
                            }
                            float scratch[6 * 16];     /* the block's last rows: through a 6 x 16 scratch */
                            for (int64_t r = 0; r < rows - 6 * t && k0; r++)
                                memcpy(scratch + 16 * r, c + r * width, 16 * sizeof(float));
                            panel_tile(ap + t * kc * 6, bp, scratch, 16, kc, k0 == 0);
                            for (int64_t r = 0; r < rows - 6 * t; r++)
                                memcpy(c + r * width, scratch + 16 * r, 16 * sizeof(float));
                        }
                    }
                }
                for (int64_t r = 0; r < rows; r++)         /* the block's sums, plus the bias, rounded once */
                    for (int64_t j = 0; j < width; j += 8)
                        store_bf16(y + (m0 + r) * ldy + 16 * g0 + j, _mm256_loadu_ps(sums + r * width + j),
                                   bias ? bias + 16 * g0 + j : NULL);
            }
        }
    }
    return failed ? -2 : 0;
}
#endif

/* Entry points. x: [m, k] with row stride ldx; y: [m, n] with row stride ldy; bias: [n] or NULL; w: packed as
 * above. Returns 0, or -1 where this build or these shapes have no kernel (the caller then runs oneDNN). */
int elastic_decode_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy,
                            int64_t m, int64_t n, int64_t k, int threads)
{
#if defined(HAVE_F32)
    if (m < 1 || n % 64 || k % 16) return -1;
    return passes_f32(x, ldx, w, bias, y, ldy, m, n, k, threads);
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)ldy; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

int elastic_decode_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                             int64_t ldy, int64_t m, int64_t n, int64_t k, int threads)
{
#if defined(HAVE_BF16)
    if (m < 1 || n % 64 || k % 32) return -1;
#if defined(HAVE_BF16_PANELS)
    if (m >= PANEL_FROM_ROWS) return bf16_panels(x, ldx, w, bias, y, ldy, m, n, k, threads);
#endif
    /* x widened, ROW_CHUNK rows at a time, into this thread's scratch (kept between calls, never more than
     * ROW_CHUNK x k floats) */
    static _Thread_local float *xf;
    static _Thread_local int64_t xf_capacity;
    const int64_t chunk = m < ROW_CHUNK ? m : ROW_CHUNK;
    if (chunk * k > xf_capacity) {
        float *grown = realloc(xf, (size_t)(chunk * k) * sizeof(float));
        if (!grown) return -2;
        xf = grown;
        xf_capacity = chunk * k;
    }
    float *const widened = xf;
    const int64_t strips = n / 16;
    int failed = 0;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t rows = m - m0 < chunk ? m - m0 : chunk;
        const uint16_t *xc = x + m0 * ldx;
        #pragma omp parallel num_threads(threads > 1 && strips > 1 ? threads : 1) reduction(|: failed)
        {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < k; i++) widened[r * k + i] = bf16_to_f32(xc[r * ldx + i]);
            float *partial = partial_sums();
            SHARE(strips, first, last)
            if (partial) strips_bf16(w, k, widened, k, y + m0 * ldy, ldy, bias, partial, rows, first, last);
            else failed = 1;
        }
    }
    return failed ? -2 : 0;
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)ldy; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

/* The bf16 product on vdpbf16ps (tile_bf16_dot): x read as it is, no widened copy. Returns -1 where this build
 * has no AVX512-BF16. */
int elastic_decode_gemm_bf16_dot(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                                 uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int threads)
{
#if defined(BF16_AVX512)
    if (m < 1 || n % 64 || k % 32) return -1;
    if (m < BF16_DOT_FROM_ROWS)              /* the same bits, and at 1-2 rows the widened walk streams faster */
        return elastic_decode_gemm_bf16(x, ldx, w, bias, y, ldy, m, n, k, threads);
    return passes_bf16_dot(x, ldx, w, bias, y, ldy, m, n, k, threads);
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)ldy; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

/* Whether this build has each kernel at all (a CPU without AVX-512 or AVX2 + FMA compiles them out). */
int elastic_decode_gemm_has(int bf16)
{
#if defined(HAVE_BF16) && defined(HAVE_F32)
    (void)bf16;
    return 1;
#elif defined(HAVE_F32)
    return !bf16;
#else
    (void)bf16;
    return 0;
#endif
}
