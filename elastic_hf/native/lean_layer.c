/* One decoder layer of a decode-only step (layers/lean_decode.py) as one C call: RMSNorm -> the q/k/v product(s)
 * -> rotary -> the K/V write -> paged decode attention -> o -> residual add -> RMSNorm -> the gate/up product(s)
 * [-> silu * up -> down -> residual add].
 *
 * Why: driven from Python, the same ten kernel calls cost ~80 us of interpreter and ctypes work a layer (a dozen
 * foreign calls of 10-20 converted arguments each, buffer lookups, two torch adds), ~2.4 ms of a default-model step
 * on a 2-core EPYC, a seventh of a batch-1 bf16 step. Here the layer's constants (weights, sizes, eps) sit in a
 * LeanLayer built once per layer and the step's addresses in a LeanStep built once per step, and the kernels are
 * the same entries Python calls (their addresses passed in), in the same order on the same bytes: the outputs are
 * the Python sequence's bit for bit. The residual adds round as torch's bf16 add does (the fp32 sum rounded to
 * nearest even), so the residual stream equals HF's too.
 *
 * The MLP's activation is the layer's own kind: SwiGLUMLP's native silu * up (native_silu = 1: the whole layer
 * here), or HF's act_fn(gate) * up in torch between two calls (native_silu = 0: this call stops after the gate/up
 * products, elastic_lean_mlp_down runs down and the residual add).
 *
 * Returns 0, or the first failing kernel's status with *failed_op its LEAN_OP_* (nothing after it ran). */
#include <stdint.h>
#include <time.h>

#include "bf16.h"

typedef int (*norm_fn)(const void *x, int64_t x_stride, const void *weight, void *out, int64_t out_stride,
                       int64_t rows, int64_t dim, float eps, int threads);
typedef int (*gemm_fn)(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy, int64_t m,
                       int64_t n, int64_t k, int threads);
typedef int (*silu_fn)(const void *gate_up, int64_t in_stride, void *out, int64_t out_stride, int64_t rows,
                       int64_t inter, int threads);
typedef int (*rotary_fn)(const void *q, int64_t q_head_stride, int64_t q_tok_stride, int64_t q_heads,
                         const void *k, int64_t k_head_stride, int64_t k_tok_stride, int64_t k_heads,
                         const void *cos, const void *sin, int64_t cs_tok_stride,
                         void *q_out, int64_t q_out_head_stride, int64_t q_out_tok_stride,
                         void *k_out, int64_t k_out_head_stride, int64_t k_out_tok_stride,
                         int64_t tokens, int64_t head_dim, int threads);
typedef int (*kv_write_fn)(char *rows, int64_t row_bytes, int64_t num_arena_rows, const int64_t *write_rows,
                           int64_t num_rows, int64_t layer_offset, int64_t v_offset, int num_kv_heads,
                           const char *key, int64_t k_tok_stride, int64_t k_head_stride,
                           const char *value, int64_t v_tok_stride, int64_t v_head_stride, int threads);
typedef int (*attend_fn)(const void *q, int64_t q_seq_stride, int64_t q_head_stride, const void *kv_chunks,
                         const int64_t *chunk_table, int64_t layer_chunk_offset, const int64_t *ctx_lens, void *out,
                         int64_t out_seq_stride, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, int max_blocks, float scale, int threads);

/* which kernel failed (layers/lean_decode.py maps each to its error) */
enum { LEAN_OP_NORM = 1, LEAN_OP_GEMM = 2, LEAN_OP_ROTARY = 3, LEAN_OP_KV_WRITE = 4, LEAN_OP_ATTEND = 5,
       LEAN_OP_SILU = 6, LEAN_OP_RESIDUAL = 7 };

/* The step's addresses and kernels: what every layer of the step shares. Workspace rows are `tokens` long, each
 * buffer [tokens, width] contiguous in the step's dtype. */
typedef struct {
    norm_fn norm;
    gemm_fn gemm;
    silu_fn silu;
    rotary_fn rotary;
    kv_write_fn kv_write;
    attend_fn attend;
    int64_t elem;                 /* bytes an element: 4 (fp32) or 2 (bf16) */
    int64_t tokens;               /* decode rows (one token of one sequence each) */
    int64_t threads;
    const void *cos, *sin;        /* [tokens, head_dim] at cs_tok_stride elements a token */
    int64_t cs_tok_stride;
    char *arena_rows;             /* the KV arena: [arena_row_count, head_dim] rows */
    int64_t arena_row_count;
    const int64_t *write_rows;    /* [tokens * kv_heads]: the arena row of each new K (V: + block_size) */
    const void *chunks;           /* the arena as chunks (paged_decode.c) */
    const int64_t *chunk_ids;     /* [tokens, kv_heads, 2, max_blocks] */
    int64_t chunk_id_count;       /* its elements: max_blocks follows from a layer's kv_heads */
    const int64_t *lens;          /* [tokens] context lengths */
    int64_t block_size, rows_per_layer, chunks_per_layer;
    void *h, *qkv, *q, *k, *att, *o, *gate_up, *act, *down;   /* workspace */
    double *op_seconds;           /* NULL, or [8]: seconds spent in each LEAN_OP_* kind, added to (a profiler's view:
                                   * benchmarks/step_profile.py; none of these kernels is a torch op it could see) */
} LeanStep;

typedef struct {
    const void *weight;           /* packed as native/decode_gemm.c reads it */
    const void *bias;             /* [n] or NULL */
    int64_t n;                    /* outputs */
    int64_t column;               /* first output column in the destination buffer */
} LeanProduct;

typedef struct {
    const void *norm1, *norm2;    /* [hidden] RMSNorm weights */
    float eps1, eps2, scaling;
    int64_t hidden, q_size, kv_size, head_dim, inter;
    int64_t n_qkv, n_gate_up;     /* 1 (one fused product) or 3 / 2 (one product per projection) */
    LeanProduct qkv[3], o, gate_up[2], down;
} LeanLayer;

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* run one kernel call (timed where the step asks for it); a non-zero status stops the layer */
#define CHECK(op, call) do { \
        const double start_ = s->op_seconds ? seconds_now() : 0.0; \
        const int status_ = (call); \
        if (s->op_seconds) s->op_seconds[op] += seconds_now() - start_; \
        if (status_) { *failed_op = (op); return status_; } \
    } while (0)

/* out = a + b over n elements, each sum rounded to the dtype as torch's add rounds it; returns 0 */
static int residual_add(void *out, const void *a, const void *b, int64_t n, int64_t elem)
{
    if (elem == 4) {
        float *y = out;
        const float *x = a, *z = b;
        for (int64_t i = 0; i < n; i++) y[i] = x[i] + z[i];
    } else {
        uint16_t *y = out;
        const uint16_t *x = a, *z = b;
        for (int64_t i = 0; i < n; i++) y[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(z[i]));
    }
    return 0;
}

static int products(const LeanStep *s, const LeanProduct *p, int64_t count, const void *x, int64_t k, char *y,
                    int64_t ldy)
{
    for (int64_t i = 0; i < count; i++) {
        const int status = s->gemm(x, k, p[i].weight, p[i].bias, y + p[i].column * s->elem, ldy, s->tokens, p[i].n,
                                   k, (int)s->threads);
        if (status) return status;
    }
    return 0;
}

/* x: [tokens, hidden] in; out: [tokens, hidden], x + attention (+ MLP where native_silu) */
int elastic_lean_layer(const LeanStep *s, const LeanLayer *l, int64_t local_layer, const void *x, void *out,
                       int native_silu, int *failed_op)
{
    const int threads = (int)s->threads;
    const int64_t t = s->tokens, e = s->elem, hidden = l->hidden, hd = l->head_dim;
    const int64_t heads = l->q_size / hd, kv_heads = l->kv_size / hd, width = l->q_size + 2 * l->kv_size;
    const int64_t max_blocks = s->chunk_id_count / (t * kv_heads * 2);
    char *qkv = s->qkv;
    const char *k_new = qkv + l->q_size * e, *v_new = qkv + (l->q_size + l->kv_size) * e;

    CHECK(LEAN_OP_NORM, s->norm(x, hidden, l->norm1, s->h, hidden, t, hidden, l->eps1, threads));
    CHECK(LEAN_OP_GEMM, products(s, l->qkv, l->n_qkv, s->h, hidden, qkv, width));
    CHECK(LEAN_OP_ROTARY, s->rotary(qkv, hd, width, heads, k_new, hd, width, kv_heads, s->cos, s->sin,
                                    s->cs_tok_stride, s->q, hd, l->q_size, s->k, hd, l->kv_size, t, hd, threads));
    CHECK(LEAN_OP_KV_WRITE, s->kv_write(s->arena_rows, hd * e, s->arena_row_count, s->write_rows, t * kv_heads,
                                        local_layer * s->rows_per_layer, s->block_size, (int)kv_heads, s->k,
                                        l->kv_size * e, hd * e, v_new, width * e, hd * e, threads));
    CHECK(LEAN_OP_ATTEND, s->attend(s->q, l->q_size, hd, s->chunks, s->chunk_ids, local_layer * s->chunks_per_layer,
                                    s->lens, s->att, l->q_size, (int)t, (int)heads, (int)kv_heads, (int)hd,
                                    (int)s->block_size, (int)max_blocks, l->scaling, threads));
    CHECK(LEAN_OP_GEMM, products(s, &l->o, 1, s->att, l->q_size, s->o, hidden));
    CHECK(LEAN_OP_RESIDUAL, residual_add(out, x, s->o, t * hidden, e));
    CHECK(LEAN_OP_NORM, s->norm(out, hidden, l->norm2, s->h, hidden, t, hidden, l->eps2, threads));
    CHECK(LEAN_OP_GEMM, products(s, l->gate_up, l->n_gate_up, s->h, hidden, s->gate_up, 2 * l->inter));
    if (!native_silu) return 0;
    CHECK(LEAN_OP_SILU, s->silu(s->gate_up, 2 * l->inter, s->act, l->inter, t, l->inter, threads));
    CHECK(LEAN_OP_GEMM, products(s, &l->down, 1, s->act, l->inter, s->down, hidden));
    CHECK(LEAN_OP_RESIDUAL, residual_add(out, out, s->down, t * hidden, e));
    return 0;
}

/* The MLP's tail where its activation ran elsewhere: out += act [tokens, inter] @ down */
int elastic_lean_mlp_down(const LeanStep *s, const LeanLayer *l, const void *act, void *out, int *failed_op)
{
    CHECK(LEAN_OP_GEMM, products(s, &l->down, 1, act, l->inter, s->down, l->hidden));
    CHECK(LEAN_OP_RESIDUAL, residual_add(out, out, s->down, s->tokens * l->hidden, s->elem));
    return 0;
}

/* A run of consecutive decoder layers of native silu (layers/lean_decode.py): layers[j] at local index
 * local_layers[j], j = 0 .. count-1, each a whole elastic_lean_layer, in one call. Why: between two layer calls
 * Python spends ~50-80 us a layer in a real step (the weights each layer streams leave the interpreter's code and
 * data cold), ~2 ms of a 30-layer step; HF's loop then only passes the run's output through the other layers.
 * The residual stream alternates between `out` and `spare` ([tokens, hidden] each) so that the last layer writes
 * `out`. On a failure *failed_index is the run's index of the failing layer (nothing after it ran). */
int elastic_lean_layers(const LeanStep *s, const LeanLayer *const *layers, const int64_t *local_layers,
                        int64_t count, const void *x, void *out, void *spare, int *failed_op, int64_t *failed_index)
{
    const void *src = x;
    for (int64_t j = 0; j < count; j++) {
        void *dst = (count - 1 - j) % 2 == 0 ? out : spare;
        const int status = elastic_lean_layer(s, layers[j], local_layers[j], src, dst, 1, failed_op);
        if (status) { *failed_index = j; return status; }
        src = dst;
    }
    return 0;
}
