/* Paged attention of short query rows (decode, speculative verification) on the CPU.
 *
 * One task per (query row, KV head): the row's G = num_heads / num_kv_heads query heads read
 * each visible key and value of their KV head once, straight from the paged cache (no gather,
 * no padding), with an online softmax over chunks of positions. Row r attends to positions
 * starts[r] .. ends[r] - 1 of sequence seqs[r], whose blocks are block_tables[seqs[r]].
 * Each row is computed alone, in a fixed order: its result does not depend on the batch.
 *
 * Layouts (float32): query [num_tokens, num_heads, head_dim] with rows query_row_stride apart
 * (a view into the fused QKV projection), its heads contiguous; out the same shape, contiguous;
 * key_cache and value_cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
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
    x = x < -87.0f ? -87.0f : x;
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

int llmserve_paged_attention_limits(int group, int head_dim) {
    return group >= 1 && group <= MAX_GROUP && head_dim >= 1 && head_dim <= MAX_HEAD_DIM;
}

void llmserve_paged_attention_rows(
        const float *query, int64_t query_row_stride, float *out, const float *key_cache, const float *value_cache,
        const int32_t *block_tables, int64_t table_stride,
        const int32_t *rows, const int32_t *seqs, const int32_t *starts, const int32_t *ends,
        int64_t num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
        float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_heads * head_dim;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t num_tasks = num_rows * num_kv_heads;

    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_tasks; task++) {
        const int64_t r = task / num_kv_heads;
        const int h = (int)(task % num_kv_heads);
        const float *q = query + rows[r] * query_row_stride + (int64_t)h * group * head_dim;
        float *o = out + rows[r] * token_stride + (int64_t)h * group * head_dim;
        const int32_t *table = block_tables + seqs[r] * table_stride;
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][CHUNK];
        float acc[MAX_GROUP * MAX_HEAD_DIM];
        for (int g = 0; g < group; g++) {
            m[g] = -FLT_MAX;
            l[g] = 0.0f;
        }
        for (int x = 0; x < group * head_dim; x++)
            acc[x] = 0.0f;

        for (int p0 = starts[r]; p0 < ends[r]; p0 += CHUNK) {
            const int n = ends[r] - p0 < CHUNK ? ends[r] - p0 : CHUNK;
            for (int j = 0; j < n; j++) {
                const int p = p0 + j;
                const float *k = key_cache + ((int64_t)table[p / block_size] * block_size + p % block_size)
                                 * slot_stride + (int64_t)h * head_dim;
                const int pn = p + CHUNK;   /* the next chunk's rows, fetched while this one computes */
                if (pn < ends[r]) {
                    const int64_t next = ((int64_t)table[pn / block_size] * block_size + pn % block_size) * slot_stride
                                         + (int64_t)h * head_dim;
                    for (int x = 0; x < head_dim; x += 16) {
                        __builtin_prefetch(key_cache + next + x);
                        __builtin_prefetch(value_cache + next + x);
                    }
                }
                for (int g = 0; g < group; g++) {
                    const float *qg = q + g * head_dim;
                    float dot = 0.0f;
                    #pragma omp simd reduction(+:dot)
                    for (int x = 0; x < head_dim; x++)
                        dot += qg[x] * k[x];
                    s[g][j] = dot * scale;
                }
            }
            for (int g = 0; g < group; g++) {
                float mx = m[g];
                #pragma omp simd reduction(max:mx)
                for (int j = 0; j < n; j++)
                    mx = s[g][j] > mx ? s[g][j] : mx;
                const float correction = exp_nonpositive(m[g] - mx);   /* 0 on the first chunk (m = -FLT_MAX) */
                float sum = 0.0f;
                #pragma omp simd reduction(+:sum)
                for (int j = 0; j < n; j++) {
                    s[g][j] = exp_nonpositive(s[g][j] - mx);
                    sum += s[g][j];
                }
                l[g] = l[g] * correction + sum;
                m[g] = mx;
                float *a = acc + g * head_dim;
                #pragma omp simd
                for (int x = 0; x < head_dim; x++)
                    a[x] *= correction;
            }
            for (int j = 0; j < n; j++) {
                const int p = p0 + j;
                const float *v = value_cache + ((int64_t)table[p / block_size] * block_size + p % block_size)
                                 * slot_stride + (int64_t)h * head_dim;
                for (int g = 0; g < group; g++) {
                    const float w = s[g][j];
                    float *a = acc + g * head_dim;
                    #pragma omp simd
                    for (int x = 0; x < head_dim; x++)
                        a[x] += w * v[x];
                }
            }
        }
        for (int g = 0; g < group; g++) {
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int x = 0; x < head_dim; x++)
                o[g * head_dim + x] = acc[g * head_dim + x] * inv;
        }
    }
}
