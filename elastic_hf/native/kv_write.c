/* One layer's new K and V rows into their pages, in one call: row i of the step (token t = i / num_kv_heads, kv head
 * h = i % num_kv_heads) goes to arena row write_rows[i] + layer_offset (K) and that + v_offset (V). The torch path
 * needs, per layer, a copy of each strided [T, kv_heads, head_dim] view of HF's projections into a contiguous
 * tensor and two index_copy_ (~35 us a layer at 32 decodes on the 2-core test machine); this reads the strided views
 * in place. A row id < 0 is padding: skipped (as the GPU kernel does). Row ids must be distinct (the engine's are:
 * each token of a step owns its own slot); two rows copied to one arena row would race. */
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN_BYTES (256 * 1024)   /* below this the copy is shorter than waking the OpenMP team */

/* Returns 0, or -1 without writing anything when a row falls outside the arena's num_arena_rows rows. */
int elastic_paged_kv_write(char *rows, int64_t row_bytes, int64_t num_arena_rows, const int64_t *write_rows,
                           int64_t num_rows, int64_t layer_offset, int64_t v_offset, int num_kv_heads,
                           const char *key, int64_t k_tok_stride, int64_t k_head_stride,
                           const char *value, int64_t v_tok_stride, int64_t v_head_stride, int num_threads)
{
    for (int64_t i = 0; i < num_rows; i++)
        if (write_rows[i] >= 0 && write_rows[i] + layer_offset + v_offset >= num_arena_rows) return -1;
    /* strides in bytes; row_bytes = head_dim * element size, head_dim contiguous in key, value and rows */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (2 * num_rows * row_bytes >= PARALLEL_MIN_BYTES)
    for (int64_t i = 0; i < num_rows; i++) {
        if (write_rows[i] < 0) continue;
        const int64_t t = i / num_kv_heads, h = i % num_kv_heads;
        const int64_t r = write_rows[i] + layer_offset;
        memcpy(rows + r * row_bytes, key + t * k_tok_stride + h * k_head_stride, (size_t)row_bytes);
        memcpy(rows + (r + v_offset) * row_bytes, value + t * v_tok_stride + h * v_head_stride, (size_t)row_bytes);
    }
    return 0;
}
