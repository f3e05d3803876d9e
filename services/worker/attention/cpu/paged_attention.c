/* Paged attention of short query rows (decode, speculative verification) on the CPU.
 *
 * One task per (query row, KV head): the row's G = num_heads / num_kv_heads query heads read
 * each visible key and value of their KV head once, straight from the paged cache (no gather,
 * no padding), with an online softmax over chunks of positions. Row r attends to positions
 * starts[r] .. ends[r] - 1 of sequence seqs[r], whose blocks are block_tables[seqs[r]].
 * Each row is computed alone, in a fixed order: its result does not depend on the batch.
 *
 * Layouts (float32, or bfloat16 in the _bf16 variant; a float32 query and out over bfloat16 caches
 * in the _f32_bf16_cache one): query [num_tokens, num_heads, head_dim]
 * with rows query_row_stride apart (a view into the fused QKV projection), its heads contiguous;
 * out the same shape, contiguous; key_cache and value_cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
 * block_tables [num_seqs, table_stride] int32. A row's every visible position must map to a
 * block of its table: nothing else of the cache is read, so unused slots may hold anything.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define CHUNK 32
#define MAX_GROUP 16
#define MAX_HEAD_DIM 512

/* e^x for x <= 0, to within 2 ulp: 2^n * e^f with n = round(x / ln 2), |f| <= ln(2) / 2, e^f
 * from Cephes' polynomial. Inline and branch-free, so the softmax's loops vectorise (libm's
 * expf is a call per element; its vector variants need -ffast-math, whose start-up code would
 * set flush-to-zero for the whole process). Below -87, 2^-126 or so: nothing beside the 1 of
 * the running maximum. */
static inline float exp_nonpositive(float x) {
    const float low = (float)(x < -87.0f);   /* a blend, not a branch, so the softmax's loop vectorises (x finite) */
    x = x * (1.0f - low) - 87.0f * low;
    const int n = (int)(x * 1.44269504089f - 0.5f);          /* round, for x <= 0 */
    const float f = (x - (float)n * 0.693359375f) + (float)n * 2.12194440e-4f;   /* ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    union { int32_t i; float f; } scale = { .i = (n + 127) << 23 };
    return p * scale.f;
}

/* Sums are taken over LANES partial sums, added as a fixed tree: a reduction's chain of scalar
 * adds (what `omp simd reduction` compiles to without -ffast-math, which may not reorder) held
 * the kernel to a fraction of its speed. The order is fixed, so results stay batch-independent. */
#define LANES 16

static inline float lane_total(const float part[LANES]) {   /* halves added pairwise, unrolled */
    float eight[8], four[4];
    for (int i = 0; i < 8; i++)
        eight[i] = part[i] + part[i + 8];
    for (int i = 0; i < 4; i++)
        four[i] = eight[i] + eight[i + 4];
    return (four[0] + four[2]) + (four[1] + four[3]);
}

static inline float sum_of(const float *v, int n) {
    float part[LANES] = {0.0f};
    int x = 0;
    for (; x + LANES <= n; x += LANES)
        for (int i = 0; i < LANES; i++)
            part[i] += v[x + i];
    for (int i = 0; x + i < n; i++)
        part[i] += v[x + i];
    return lane_total(part);
}

int llmserve_paged_attention_limits(int group, int head_dim) {
    return group >= 1 && group <= MAX_GROUP && head_dim >= 1 && head_dim <= MAX_HEAD_DIM;
}

/* bfloat16 is float32's upper half: widening is a shift; narrowing rounds to nearest even, as
 * torch does, and keeps NaN a NaN. */
static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    if (f != f)
        return 0x7fc0;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#define QUERY_T float
#define CACHE_T float
#define LOAD_Q(x) (x)
#define STORE_Q(x) (x)
#define LOAD_KV(x) (x)
#define ROWS_FUNCTION llmserve_paged_attention_rows
#include "paged_attention_rows.h"
#undef CACHE_T
#undef LOAD_KV
#undef ROWS_FUNCTION

/* A float32 model over a bfloat16 cache (engine.kv_cache_dtype): half the bytes read a step. */
#define CACHE_T uint16_t
#define LOAD_KV(x) bf16_to_float(x)
#define ROWS_FUNCTION llmserve_paged_attention_rows_f32_bf16_cache
#include "paged_attention_rows.h"
#undef QUERY_T
#undef LOAD_Q
#undef STORE_Q
#undef ROWS_FUNCTION

#define QUERY_T uint16_t
#define LOAD_Q(x) bf16_to_float(x)
#define STORE_Q(x) float_to_bf16(x)
#define ROWS_FUNCTION llmserve_paged_attention_rows_bf16
#include "paged_attention_rows.h"
