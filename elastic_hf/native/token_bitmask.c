/* Structured output's token mask: logits[rows[k], t] = -inf wherever bit t of bitmask row k is 0 (bit i of word w
 * stands for token 32 w + i, llguidance's layout), and beyond the mask's 32 W tokens. torch ops need a [rows, V]
 * expansion of the bits first (~7 ms at 64 rows of a 49k vocabulary on the 2-core test machine); this reads each
 * word once and skips words that allow all 32 tokens. */
#include <math.h>
#include <stdint.h>

void elastic_apply_token_bitmask_f32(float *logits, int64_t row_stride, int64_t vocab, const int64_t *rows,
                                     int64_t num_rows, const int32_t *bitmask, int64_t words, int num_threads)
{
    const int64_t covered = words * 32 < vocab ? words * 32 : vocab;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows * vocab >= 262144)
    for (int64_t k = 0; k < num_rows; k++) {
        float *x = logits + rows[k] * row_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + k * words);
        for (int64_t w = 0; w * 32 < covered; w++) {
            uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, end = base + 32 < covered ? base + 32 : covered;
            if (bits == 0) {
                for (int64_t t = base; t < end; t++) x[t] = -INFINITY;
                continue;
            }
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) x[t] = -INFINITY;
        }
        for (int64_t t = covered; t < vocab; t++) x[t] = -INFINITY;
    }
}
