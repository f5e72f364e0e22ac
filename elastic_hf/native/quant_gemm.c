/* Weight-only quantized linear products on the CPU, for the layers precision morphing swaps in (layers/w8_linear.py,
 * layers/w4_linear.py): y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) with x and y fp32 or bf16, any number of rows,
 * and W one of
 *   W8  q int8, one scale per output channel:          W[n, k] = q[n, k] * scale[n]
 *   W4  q uint4, (scale, zero) per group of k:          W[n, k] = (q[n, k] - 8) * scale[k / g, n] + zero[k / g, n]
 *
 * Why: aten's int-pack kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) are vectorised for bf16
 * activations only, and even so run behind the fp32 dense product they replace from a few rows up (the default
 * model's linears, 1 thread: 0.5-0.9x fp32 at 16 rows, 0.4x at 256; benchmarks/quant_kernels.py), so a morphed layer
 * was smaller but slower. Here the weight is widened to fp32 in registers and multiplied with fp32 FMAs: at a decode
 * step's few rows the product streams a quarter (W8) or an eighth (W4) of the fp32 weight's bytes; at a prefill's
 * hundreds of rows each K chunk of the weight is widened once into an fp32 panel in L1 that all row tiles read.
 *
 * Layouts read ("blocked", written by the layers; N a multiple of 64, K of 16, a W4 group a multiple of 16):
 *   W8  [N/64][K/16][16 k][64 n] int8: one k of 64 outputs is one 64-byte line
 *   W4  [N/64][K/16][16 k][32 B]: byte i of a k-row holds output i in its low nibble, output 32 + i in its high one
 * so a block of 64 outputs is one contiguous stream; W8 scales [N] fp32; W4 scales_and_zeros [K/g][N][2] fp32
 * (aten's layout, kept so the state dict stays portable).
 *
 * Work split: the N/16 column strips (16 outputs, one zmm) are cut into one contiguous range per thread. Each thread
 * walks its strips block by block, up to 4 strips at a time. Few rows: every tile of rows runs the block's whole K,
 * widening as it goes (W8: 6 rows x 4 strips of accumulators; W4, which also holds its group's scales and zeros: 4
 * rows); the first tile streams the weight from DRAM, later ones read it again from L2. Many rows: K in chunks of 64,
 * each widened once into the panel (16 KiB) and run by every row tile, their sums kept between chunks in memory.
 * Two builds of the tiles: AVX-512 (a strip is one zmm) and AVX2 + FMA (a strip is two ymm, strips in smaller
 * groups: see the AVX2 section); same layouts, same arithmetic.
 *
 * Rounding: fp32 sums in k order; W8 multiplies the sum by the channel's scale, W4 dequantizes each weight with one
 * FMA (q * scale + (zero - 8 * scale), the offset rounded once a group) before it; the bias is added and a bf16
 * output rounded to nearest even once. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define STRIPS_PER_BLOCK 4       /* 64 outputs a block, 16 a strip */
#define ROW_CHUNK 256            /* rows per pass: bounds the partial sums (and bf16's widened x) at 256 rows */
#define PANEL_K 64               /* k per widened panel: 64 x 64 floats = 16 KiB, in L1 */
#define PANEL_FROM_ROWS 13       /* from this many rows on, the panel path (its widening amortised over 3+ tiles) */
#define PREFETCH_LINES 8         /* the first row tile prefetches W8 k-rows (a line each) this far ahead into L2 */
/* W4: a k-tile is 16 k-rows of 32 bytes, 8 lines; the first row tile prefetches every line of the tile two ahead. It
 * used to prefetch every other line from 8 lines ahead, leaving half of the stream to the hardware prefetcher: AVX2,
 * the default model's 30 layers in W4, 2 threads, 1 / 2 / 4 / 8 rows 14.6 / 19.3 / 20.6 / 30.5 -> 10.9 / 14.6 / 15.1 /
 * 25.7 ms (`python benchmarks/kernel_ab.py --kernel quant_gemm --bits 4 --base 3345370`). */
#define W4_PREFETCH_LINES 16

#if defined(__AVX512F__)
#define QG_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define QG_AVX2 1
#endif

/* Rows a tile (W4's also holds its group's scales and offsets): AVX-512 has 32 registers, AVX2 16 (see the AVX2
 * section). */
#if defined(QG_AVX512)
#define ROW_TILE 6
#define ROW_TILE_W4 4
#else
#define ROW_TILE 3
#define ROW_TILE_W4 4
#endif

#if defined(QG_AVX512) || defined(QG_AVX2)
#define HAVE_QUANT_GEMM 1
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

typedef struct {
    const uint8_t *w;            /* blocked weight */
    int bits;                    /* 8 or 4 */
    const float *scale;          /* W8: [N] */
    const float *sz;             /* W4: [K/g][N][2] */
    int64_t group_tiles;         /* W4: g / 16 */
    int64_t n;                   /* N (the row stride of sz) */
    const float *bias;           /* [N] fp32 or NULL */
} QuantWeight;

#if defined(QG_AVX512)

/* 16 fp32 lanes -> 16 bf16, rounded to nearest even, NaN kept quiet (bf16.h's f32_to_bf16, vectorised: no
 * AVX512-BF16 instruction needed) */
AI __m256i f32_to_bf16_x16(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    return _mm512_cvtepi32_epi16(r);
}

/* Strip j's 16 weights of one W8 k-row (64 bytes), widened */
AI __m512 w8_strip(const uint8_t *row, int j)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * j))));
}

/* Strip j's 16 values q of one W4 k-row (32 bytes), widened: strips 0 and 1 are the low nibbles of bytes 0-15 and
 * 16-31, strips 2 and 3 their high nibbles */
AI __m512 w4_strip(const uint8_t *row, int j)
{
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * (j & 1))));
    v = j < 2 ? _mm512_and_si512(v, _mm512_set1_epi32(15)) : _mm512_srli_epi32(v, 4);
    return _mm512_cvtepi32_ps(v);
}

/* The scale and the offset zero - 8 * scale of group `grp` for 16 outputs from n0, out of the interleaved
 * [groups][N][2] (scale, zero): W = q * scale + offset is one FMA a weight, the - 8 folded in once a group */
AI void w4_group(const QuantWeight *qw, int64_t grp, int64_t n0, __m512 *s, __m512 *z)
{
    const float *p = qw->sz + (grp * qw->n + n0) * 2;
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *s = _mm512_permutex2var_ps(a, even, b);
    *z = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), *s, _mm512_permutex2var_ps(a, odd, b));
}

/* A tile's results: times the W8 scale (scale NULL: none), plus the bias, stored as fp32 or bf16 */
AI void store_tile(__m512 acc[][STRIPS_PER_BLOCK], void *y, int64_t ldy, int y_bf16, const float *scale,
                   const float *bias, int s0, int ns, int rows)
{
    for (int j = 0; j < ns; j++) {
        const __m512 sc = scale ? _mm512_loadu_ps(scale + 16 * (s0 + j)) : _mm512_set1_ps(1.0f);
        const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * (s0 + j)) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++) {
            const __m512 v = scale ? _mm512_fmadd_ps(acc[m][j], sc, b) : _mm512_add_ps(acc[m][j], b);
            if (y_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + m * ldy + 16 * (s0 + j)), f32_to_bf16_x16(v));
            else
                _mm512_storeu_ps((float *)y + m * ldy + 16 * (s0 + j), v);
        }
    }
}

/* ------------------------------------------------------------------------------------------- few rows: direct */
/* Rows [0, rows) of x against strips [s0, s0 + ns) of one W8 block (its k-rows from w); y, scale, bias at the
 * block's first output */
AI void tile_w8(const uint8_t *w, int64_t k_tiles, const float *x, int64_t ldx, void *y, int64_t ldy, int y_bf16,
                const float *scale, const float *bias, int prefetch, int s0, const int ns, const int rows)
{
    __m512 acc[ROW_TILE][STRIPS_PER_BLOCK];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < ns; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        const uint8_t *tile = w + kt * 16 * 64;
        if (prefetch)
            for (int r = 0; r < 16; r++) _mm_prefetch((const char *)tile + (PREFETCH_LINES + r) * 64, _MM_HINT_T1);
        for (int kk = 0; kk < 16; kk++) {
            __m512 wv[STRIPS_PER_BLOCK];
            for (int j = 0; j < ns; j++) wv[j] = w8_strip(tile + kk * 64, s0 + j);
            const int64_t k = kt * 16 + kk;
            for (int m = 0; m < rows; m++) {
                const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
                for (int j = 0; j < ns; j++) acc[m][j] = _mm512_fmadd_ps(wv[j], xb, acc[m][j]);
            }
        }
    }
    store_tile(acc, y, ldy, y_bf16, scale, bias, s0, ns, rows);
}

/* The same for a W4 block; n0: the block's first output (for its groups' scales and zeros) */
AI void tile_w4(const uint8_t *w, int64_t k_tiles, const QuantWeight *qw, int64_t n0, const float *x, int64_t ldx,
                void *y, int64_t ldy, int y_bf16, const float *bias, int prefetch, int s0, const int ns,
                const int rows)
{
    __m512 acc[ROW_TILE_W4][STRIPS_PER_BLOCK], s[STRIPS_PER_BLOCK], z[STRIPS_PER_BLOCK];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < ns; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        if (kt % qw->group_tiles == 0)
            for (int j = 0; j < ns; j++) w4_group(qw, kt / qw->group_tiles, n0 + 16 * (s0 + j), &s[j], &z[j]);
        const uint8_t *tile = w + kt * 16 * 32;
        if (prefetch)
            for (int r = 0; r < 8; r++)
                _mm_prefetch((const char *)tile + (W4_PREFETCH_LINES + r) * 64, _MM_HINT_T1);
        for (int kk = 0; kk < 16; kk++) {
            __m512 wv[STRIPS_PER_BLOCK];
            for (int j = 0; j < ns; j++) wv[j] = _mm512_fmadd_ps(w4_strip(tile + kk * 32, s0 + j), s[j], z[j]);
            const int64_t k = kt * 16 + kk;
            for (int m = 0; m < rows; m++) {
                const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
                for (int j = 0; j < ns; j++) acc[m][j] = _mm512_fmadd_ps(wv[j], xb, acc[m][j]);
            }
        }
    }
    store_tile(acc, y, ldy, y_bf16, NULL, bias, s0, ns, rows);
}

/* -------------------------------------------------------------------------------------------- many rows: panel */
/* K tiles [kt0, kt0 + kts) of strips [s0, s0 + ns) of one block, widened (and for W4 dequantized) into
 * panel[k][64] */
AI void widen_panel(const QuantWeight *qw, const uint8_t *w, int64_t n0, int64_t kt0, int64_t kts, float *panel,
                    int s0, int ns)
{
    for (int64_t kt = 0; kt < kts; kt++) {
        if (qw->bits == 8) {
            for (int kk = 0; kk < 16; kk++)
                for (int j = s0; j < s0 + ns; j++)
                    _mm512_store_ps(panel + (kt * 16 + kk) * 64 + 16 * j, w8_strip(w + ((kt0 + kt) * 16 + kk) * 64, j));
            continue;
        }
        __m512 s[STRIPS_PER_BLOCK], z[STRIPS_PER_BLOCK];
        for (int j = s0; j < s0 + ns; j++) w4_group(qw, (kt0 + kt) / qw->group_tiles, n0 + 16 * j, &s[j], &z[j]);
        for (int kk = 0; kk < 16; kk++)
            for (int j = s0; j < s0 + ns; j++)
                _mm512_store_ps(panel + (kt * 16 + kk) * 64 + 16 * j,
                                _mm512_fmadd_ps(w4_strip(w + ((kt0 + kt) * 16 + kk) * 32, j), s[j], z[j]));
    }
}

/* Rows [0, rows) of x against the panel's kn k of strips [s0, s0 + ns); the sums cross K chunks in `partial`
 * ([rows][64], exact in memory, so chunking changes no bit) and are stored at the last chunk */
AI void tile_panel(const float *panel, int64_t kn, const float *x, int64_t ldx, void *y, int64_t ldy, int y_bf16,
                   const float *scale, const float *bias, float *partial, int first, int last, int s0, const int ns,
                   const int rows)
{
    __m512 acc[ROW_TILE][STRIPS_PER_BLOCK];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < ns; j++)
            acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + m * 64 + 16 * (s0 + j));
    for (int64_t k = 0; k < kn; k++) {
        __m512 wv[STRIPS_PER_BLOCK];
        for (int j = 0; j < ns; j++) wv[j] = _mm512_load_ps(panel + k * 64 + 16 * (s0 + j));
        for (int m = 0; m < rows; m++) {
            const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
            for (int j = 0; j < ns; j++) acc[m][j] = _mm512_fmadd_ps(wv[j], xb, acc[m][j]);
        }
    }
    if (!last) {
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < ns; j++) _mm512_storeu_ps(partial + m * 64 + 16 * (s0 + j), acc[m][j]);
        return;
    }
    store_tile(acc, y, ldy, y_bf16, scale, bias, s0, ns, rows);
}

#else
/* ------------------------------------------------------------------------------------------------ AVX2 + FMA */
/* The same walks with 16 ymm registers: a strip of 16 outputs is 2 ymm of 8, so 4 strips x 6 rows of accumulators
 * do not fit. Tiles of up to 3 rows (ROW_TILE), the strips in groups that keep the accumulators, the rows' broadcast
 * inputs and one weight register within 16: W8 and the panel one row 4 strips (8 + 1 + 1), 2-3 rows 2 (12 + 3 + 1).
 * W4 also holds each vector's scale and offset, and its tiles take up to 4 rows (ROW_TILE_W4: the unpacking, redone
 * by every row tile, is its larger cost): one row 2 strips (4 + 1 + 8 + 1), 2-4 rows one strip (4 rows: 8 + 4 held,
 * the strip's 2 weight registers held and the rows broadcast in turn). A later group re-reads the block's k-rows (the
 * panel's) from cache, not DRAM. The arithmetic is the AVX-512 tiles' (same FMAs in the same k order), so both give
 * the same bits. Every loop over rows and vectors is unrolled (UNROLL): otherwise gcc 12 kept the accumulator arrays
 * in memory, a store of each per k (1536 x 576, 256 rows, 2 threads: 51 -> 100 GFLOP/s for W8). */
#define UNROLL _Pragma("GCC unroll 8")
#define STRIP_GROUP_W8(rows) ((rows) == 1 ? 4 : 2)
#define STRIP_GROUP_W4(rows) ((rows) == 1 ? 2 : 1)

/* Outputs o .. o + 7 of one W8 k-row (64 bytes), widened */
AI __m256 w8_vec(const uint8_t *row, int o)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + o))));
}

/* The values q of outputs o .. o + 7 (o a multiple of 8) of one W4 k-row (32 bytes), widened: outputs below 32 are
 * the low nibbles of bytes o .., the others the high nibbles of bytes o - 32 .. */
AI __m256 w4_vec(const uint8_t *row, int o)
{
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + (o & 31))));
    v = o < 32 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
    return _mm256_cvtepi32_ps(v);
}

/* w4_group's scale and offset for 8 outputs from n0: shuffle_ps takes the even (scale) or odd (zero) floats of two
 * ymm of (scale, zero) pairs, lane by lane ([s0 s1 s4 s5 | s2 s3 s6 s7]); permute4x64 puts their halves in order */
AI void w4_group8(const QuantWeight *qw, int64_t grp, int64_t n0, __m256 *s, __m256 *z)
{
    const float *p = qw->sz + (grp * qw->n + n0) * 2;
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    const __m256d even = _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88));
    const __m256d odd = _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD));
    const __m256 scale = _mm256_castpd_ps(_mm256_permute4x64_pd(even, 0xD8));
    const __m256 zero = _mm256_castpd_ps(_mm256_permute4x64_pd(odd, 0xD8));
    *s = scale;
    *z = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
}

/* One row's 8 results at output o of the block: times the W8 scale (NULL: none), plus the bias, fp32 or bf16 */
AI void store_vec(__m256 acc, void *y, int64_t at, int y_bf16, const float *scale, const float *bias, int o)
{
    const __m256 b = bias ? _mm256_loadu_ps(bias + o) : _mm256_setzero_ps();
    const __m256 v = scale ? _mm256_fmadd_ps(acc, _mm256_loadu_ps(scale + o), b) : _mm256_add_ps(acc, b);
    if (y_bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)y + at), f32x8_to_bf16(v));
    else
        _mm256_storeu_ps((float *)y + at, v);
}

/* ------------------------------------------------------------------------------------------- few rows: direct */
AI void tile_w8(const uint8_t *w, int64_t k_tiles, const float *x, int64_t ldx, void *y, int64_t ldy, int y_bf16,
                const float *scale, const float *bias, int prefetch, int s0, const int ns, const int rows)
{
    const int group = STRIP_GROUP_W8(rows);
    for (int j0 = 0; j0 < ns; j0 += group) {
        const int g = ns - j0 < group ? ns - j0 : group;   /* strips in this group */
        const int c = 16 * (s0 + j0);                       /* its first output in the block */
        __m256 acc[ROW_TILE][2 * STRIPS_PER_BLOCK];
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++) acc[m][v] = _mm256_setzero_ps();
        for (int64_t kt = 0; kt < k_tiles; kt++) {
            const uint8_t *tile = w + kt * 16 * 64;
            if (prefetch && j0 == 0)
                for (int r = 0; r < 16; r++) _mm_prefetch((const char *)tile + (PREFETCH_LINES + r) * 64, _MM_HINT_T1);
            for (int kk = 0; kk < 16; kk++) {
                const uint8_t *row = tile + kk * 64;
                const float *xk = x + kt * 16 + kk;
                __m256 xb[ROW_TILE];
                UNROLL for (int m = 0; m < rows; m++) xb[m] = _mm256_broadcast_ss(xk + m * ldx);
                UNROLL for (int v = 0; v < 2 * g; v++) {
                    const __m256 wv = w8_vec(row, c + 8 * v);
                    UNROLL for (int m = 0; m < rows; m++) acc[m][v] = _mm256_fmadd_ps(wv, xb[m], acc[m][v]);
                }
            }
        }
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++)
                store_vec(acc[m][v], y, m * ldy + c + 8 * v, y_bf16, scale, bias, c + 8 * v);
    }
}

AI void tile_w4(const uint8_t *w, int64_t k_tiles, const QuantWeight *qw, int64_t n0, const float *x, int64_t ldx,
                void *y, int64_t ldy, int y_bf16, const float *bias, int prefetch, int s0, const int ns,
                const int rows)
{
    const int group = STRIP_GROUP_W4(rows);
    for (int j0 = 0; j0 < ns; j0 += group) {
        const int g = ns - j0 < group ? ns - j0 : group;
        const int c = 16 * (s0 + j0);
        __m256 acc[ROW_TILE_W4][4], s[4], z[4];
        for (int v = 0; v < 4; v++) s[v] = z[v] = _mm256_setzero_ps();   /* set at kt 0; gcc cannot see it */
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++) acc[m][v] = _mm256_setzero_ps();
        for (int64_t kt = 0; kt < k_tiles; kt++) {
            if (kt % qw->group_tiles == 0)
                UNROLL for (int v = 0; v < 2 * g; v++)
                    w4_group8(qw, kt / qw->group_tiles, n0 + c + 8 * v, &s[v], &z[v]);
            const uint8_t *tile = w + kt * 16 * 32;
            if (prefetch && j0 == 0)
                for (int r = 0; r < 8; r++)
                    _mm_prefetch((const char *)tile + (W4_PREFETCH_LINES + r) * 64, _MM_HINT_T1);
            for (int kk = 0; kk < 16; kk++) {
                const uint8_t *row = tile + kk * 32;
                const float *xk = x + kt * 16 + kk;
                if (g == 1 && rows * 3 + 4 + 1 > 16) {   /* 4 rows: the inputs do not fit beside what is held */
                    const __m256 wv[2] = {_mm256_fmadd_ps(w4_vec(row, c), s[0], z[0]),
                                          _mm256_fmadd_ps(w4_vec(row, c + 8), s[1], z[1])};
                    UNROLL for (int m = 0; m < rows; m++) {   /* its two weight registers held, rows in turn */
                        const __m256 xb = _mm256_broadcast_ss(xk + m * ldx);
                        UNROLL for (int v = 0; v < 2; v++) acc[m][v] = _mm256_fmadd_ps(wv[v], xb, acc[m][v]);
                    }
                } else {
                    __m256 xb[ROW_TILE_W4];
                    UNROLL for (int m = 0; m < rows; m++) xb[m] = _mm256_broadcast_ss(xk + m * ldx);
                    UNROLL for (int v = 0; v < 2 * g; v++) {
                        const __m256 wv = _mm256_fmadd_ps(w4_vec(row, c + 8 * v), s[v], z[v]);
                        UNROLL for (int m = 0; m < rows; m++) acc[m][v] = _mm256_fmadd_ps(wv, xb[m], acc[m][v]);
                    }
                }
            }
        }
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++)
                store_vec(acc[m][v], y, m * ldy + c + 8 * v, y_bf16, NULL, bias, c + 8 * v);
    }
}

/* -------------------------------------------------------------------------------------------- many rows: panel */
AI void widen_panel(const QuantWeight *qw, const uint8_t *w, int64_t n0, int64_t kt0, int64_t kts, float *panel,
                    int s0, int ns)
{
    for (int64_t kt = 0; kt < kts; kt++) {
        for (int o = 16 * s0; o < 16 * (s0 + ns); o += 8) {
            if (qw->bits == 8) {
                for (int kk = 0; kk < 16; kk++)
                    _mm256_store_ps(panel + (kt * 16 + kk) * 64 + o, w8_vec(w + ((kt0 + kt) * 16 + kk) * 64, o));
                continue;
            }
            __m256 s, z;
            w4_group8(qw, (kt0 + kt) / qw->group_tiles, n0 + o, &s, &z);
            for (int kk = 0; kk < 16; kk++)
                _mm256_store_ps(panel + (kt * 16 + kk) * 64 + o,
                                _mm256_fmadd_ps(w4_vec(w + ((kt0 + kt) * 16 + kk) * 32, o), s, z));
        }
    }
}

AI void tile_panel(const float *panel, int64_t kn, const float *x, int64_t ldx, void *y, int64_t ldy, int y_bf16,
                   const float *scale, const float *bias, float *partial, int first, int last, int s0, const int ns,
                   const int rows)
{
    const int group = STRIP_GROUP_W8(rows);
    for (int j0 = 0; j0 < ns; j0 += group) {
        const int g = ns - j0 < group ? ns - j0 : group;
        const int c = 16 * (s0 + j0);
        __m256 acc[ROW_TILE][2 * STRIPS_PER_BLOCK];
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++)
                acc[m][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(partial + m * 64 + c + 8 * v);
        for (int64_t k = 0; k < kn; k++) {
            const float *pk = panel + k * 64 + c;
            __m256 xb[ROW_TILE];
            UNROLL for (int m = 0; m < rows; m++) xb[m] = _mm256_broadcast_ss(x + m * ldx + k);
            UNROLL for (int v = 0; v < 2 * g; v++) {
                const __m256 wv = _mm256_load_ps(pk + 8 * v);
                UNROLL for (int m = 0; m < rows; m++) acc[m][v] = _mm256_fmadd_ps(wv, xb[m], acc[m][v]);
            }
        }
        UNROLL for (int m = 0; m < rows; m++)
            UNROLL for (int v = 0; v < 2 * g; v++) {
                if (!last) _mm256_storeu_ps(partial + m * 64 + c + 8 * v, acc[m][v]);
                else store_vec(acc[m][v], y, m * ldy + c + 8 * v, y_bf16, scale, bias, c + 8 * v);
            }
    }
}
#endif

/* dispatch to an instance with constant strip and row counts, so every loop above unrolls into registers */
#if defined(QG_AVX512)
#define DISPATCH_ROWS(FN, NS, ...) \
    switch (rows) { case 1: FN(__VA_ARGS__, NS, 1); break; case 2: FN(__VA_ARGS__, NS, 2); break; \
                    case 3: FN(__VA_ARGS__, NS, 3); break; case 4: FN(__VA_ARGS__, NS, 4); break; \
                    case 5: FN(__VA_ARGS__, NS, 5); break; default: FN(__VA_ARGS__, NS, 6); break; }
#define DISPATCH_ROWS4(FN, NS, ...) \
    switch (rows) { case 1: FN(__VA_ARGS__, NS, 1); break; case 2: FN(__VA_ARGS__, NS, 2); break; \
                    case 3: FN(__VA_ARGS__, NS, 3); break; default: FN(__VA_ARGS__, NS, 4); break; }
#else
#define DISPATCH_ROWS(FN, NS, ...) \
    switch (rows) { case 1: FN(__VA_ARGS__, NS, 1); break; case 2: FN(__VA_ARGS__, NS, 2); break; \
                    default: FN(__VA_ARGS__, NS, 3); break; }
#define DISPATCH_ROWS4(FN, NS, ...) \
    switch (rows) { case 1: FN(__VA_ARGS__, NS, 1); break; case 2: FN(__VA_ARGS__, NS, 2); break; \
                    case 3: FN(__VA_ARGS__, NS, 3); break; default: FN(__VA_ARGS__, NS, 4); break; }
#endif
#define DISPATCH(ROWS, FN, ...) \
    switch (ns) { case 1: ROWS(FN, 1, __VA_ARGS__) break; case 2: ROWS(FN, 2, __VA_ARGS__) break; \
                  case 3: ROWS(FN, 3, __VA_ARGS__) break; default: ROWS(FN, 4, __VA_ARGS__) break; }

/* A thread's strips [first, last) for rows [0, rows_total) of x: block by block, up to 4 strips at a time, rows in
 * balanced tiles (8 rows are 4 + 4, not 6 + 2). */
static void strips(const QuantWeight *qw, int64_t k, const float *x, int64_t ldx, void *y, int64_t ldy, int y_bf16,
                   float *panel, float *partial, int64_t rows_total, int64_t first, int64_t last)
{
    const int64_t k_tiles = k / 16;
    const int panel_path = rows_total >= PANEL_FROM_ROWS;
    const int row_tile = panel_path || qw->bits == 8 ? ROW_TILE : ROW_TILE_W4;
    const int64_t tiles = (rows_total + row_tile - 1) / row_tile;
    const size_t y_item = y_bf16 ? 2 : 4;
    const int64_t block_bytes = k * (qw->bits == 8 ? 64 : 32);
    for (int64_t s = first; s < last;) {
        const int64_t block = s / STRIPS_PER_BLOCK;
        const int s0 = (int)(s % STRIPS_PER_BLOCK);
        const int ns = (int)((last - s) < STRIPS_PER_BLOCK - s0 ? (last - s) : STRIPS_PER_BLOCK - s0);
        const uint8_t *wb = qw->w + block * block_bytes;
        const float *sc = qw->bits == 8 ? qw->scale + block * 64 : NULL;
        const float *bb = qw->bias ? qw->bias + block * 64 : NULL;
        for (int64_t kt0 = 0; kt0 < k_tiles; kt0 += panel_path ? PANEL_K / 16 : k_tiles) {
            const int64_t kts = panel_path ? (k_tiles - kt0 < PANEL_K / 16 ? k_tiles - kt0 : PANEL_K / 16) : k_tiles;
            if (panel_path) widen_panel(qw, wb, block * 64, kt0, kts, panel, s0, ns);
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t m0 = rows_total * t / tiles;
                const int rows = (int)(rows_total * (t + 1) / tiles - m0);
                char *yb = (char *)y + (m0 * ldy + block * 64) * y_item;
                if (panel_path)
                    DISPATCH(DISPATCH_ROWS, tile_panel, panel, kts * 16, x + m0 * ldx + kt0 * 16, ldx, yb, ldy, y_bf16,
                             sc, bb, partial + m0 * 64, kt0 == 0, kt0 + kts == k_tiles, s0)
                else if (qw->bits == 8)
                    DISPATCH(DISPATCH_ROWS, tile_w8, wb, k_tiles, x + m0 * ldx, ldx, yb, ldy, y_bf16, sc, bb, t == 0,
                             s0)
                else
                    DISPATCH(DISPATCH_ROWS4, tile_w4, wb, k_tiles, qw, block * 64, x + m0 * ldx, ldx, yb, ldy, y_bf16,
                             bb, t == 0, s0)
            }
        }
        s += ns;
    }
}

/* This OpenMP thread's scratch, allocated on first use and kept for the thread's life: the panel (PANEL_K x 64
 * floats, 16 KiB) and the row tiles' sums between K chunks (ROW_CHUNK x 64 floats, 64 KiB); NULL if the allocation
 * failed. */
static float *thread_scratch(void)
{
    static _Thread_local float *scratch;
    if (!scratch) scratch = aligned_alloc(64, sizeof(float) * (PANEL_K + ROW_CHUNK) * 64);
    return scratch;
}
#endif

#include <omp.h>

/* Entry point. x: [m, k] with row stride ldx, fp32 or (x_bf16) bf16; y: [m, n] with row stride ldy, x's dtype;
 * w: blocked as above, bits 8 or 4; scale (W8) [n] fp32; sz (W4) [k/group][n][2] fp32; bias [n] fp32 or NULL.
 * Returns 0; -1 where this build or these shapes have no kernel (the caller keeps aten's); -2 when scratch could
 * not be allocated. */
int elastic_quant_gemm(const void *x, int64_t ldx, int x_bf16, const uint8_t *w, int bits, const float *scale,
                       const float *sz, int64_t group, const float *bias, void *y, int64_t ldy, int64_t m, int64_t n,
                       int64_t k, int threads)
{
#if defined(HAVE_QUANT_GEMM)
    if (m < 1 || n % 64 || k % 16 || (bits != 8 && bits != 4) || (bits == 4 && (group < 16 || group % 16 ||
                                                                                   k % group)))
        return -1;
    const QuantWeight qw = {w, bits, scale, sz, bits == 4 ? group / 16 : 1, n, bias};
    const int64_t num_strips = n / 16;
    const int nthreads = threads > 1 && num_strips > 1 ? threads : 1;
    /* bf16 x is widened, ROW_CHUNK rows at a time, into the calling thread's scratch (kept between calls) */
    static _Thread_local float *xf;
    static _Thread_local int64_t xf_capacity;
    const int64_t chunk = m < ROW_CHUNK ? m : ROW_CHUNK;
    if (x_bf16 && chunk * k > xf_capacity) {
        float *grown = realloc(xf, (size_t)(chunk * k) * sizeof(float));
        if (!grown) return -2;
        xf = grown;
        xf_capacity = chunk * k;
    }
    float *const widened = xf;
    const size_t y_item = x_bf16 ? 2 : 4;
    int failed = 0;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t rows = m - m0 < chunk ? m - m0 : chunk;
        void *yc = (char *)y + m0 * ldy * y_item;
        #pragma omp parallel num_threads(nthreads) reduction(|: failed)
        {
            const float *xc = (const float *)x + m0 * ldx;
            int64_t ldxc = ldx;
            if (x_bf16) {
                const uint16_t *xs = (const uint16_t *)x + m0 * ldx;
                #pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t i = 0; i < k; i++) widened[r * k + i] = bf16_to_f32(xs[r * ldx + i]);
                xc = widened;
                ldxc = k;
            }
            float *scratch = thread_scratch();
            const int nt = omp_get_num_threads(), t = omp_get_thread_num();
            if (scratch)
                strips(&qw, k, xc, ldxc, yc, ldy, x_bf16, scratch, scratch + PANEL_K * 64, rows,
                       num_strips * t / nt, num_strips * (t + 1) / nt);
            else
                failed = 1;
        }
    }
    return failed ? -2 : 0;
#else
    (void)x; (void)ldx; (void)x_bf16; (void)w; (void)bits; (void)scale; (void)sz; (void)group; (void)bias; (void)y;
    (void)ldy; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

/* Whether this build has the kernel at all (a CPU without AVX-512 or AVX2 + FMA compiles it out). */
int elastic_quant_gemm_has(void)
{
#if defined(HAVE_QUANT_GEMM)
    return 1;
#else
    return 0;
#endif
}
