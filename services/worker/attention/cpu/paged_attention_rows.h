/* The rows kernel over one pair of element types, included once per pair by paged_attention.c
 * (C's form of a template). The includer defines QUERY_T (the storage type of query and out),
 * CACHE_T (of the caches), LOAD_Q(query element) -> float, STORE_Q(float) -> query element,
 * LOAD_KV(cache element) -> float, and ROWS_FUNCTION (the exported name). Arithmetic is float32
 * whatever the types are: each query row is widened once, each key and value as it is read, and
 * out is rounded once at the end. */
void ROWS_FUNCTION(
        const QUERY_T *query, int64_t query_row_stride, QUERY_T *out, const CACHE_T *key_cache,
        const CACHE_T *value_cache, const int32_t *block_tables, int64_t table_stride,
        const int32_t *rows, const int32_t *seqs, const int32_t *starts, const int32_t *ends,
        int64_t num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
        float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_heads * head_dim;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t num_tasks = num_rows * num_kv_heads;
    const int line = 64 / (int)sizeof(CACHE_T);      /* elements per cache line, for the prefetch */

    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_tasks; task++) {
        const int64_t r = task / num_kv_heads;
        const int h = (int)(task % num_kv_heads);
        const QUERY_T *q_row = query + rows[r] * query_row_stride + (int64_t)h * group * head_dim;
        QUERY_T *o = out + rows[r] * token_stride + (int64_t)h * group * head_dim;
        const int32_t *table = block_tables + seqs[r] * table_stride;
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][CHUNK];
        float q[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM];
        for (int g = 0; g < group; g++) {
            m[g] = -FLT_MAX;
            l[g] = 0.0f;
        }
        for (int x = 0; x < group * head_dim; x++) {
            q[x] = LOAD_Q(q_row[x]);
            acc[x] = 0.0f;
        }

        for (int p0 = starts[r]; p0 < ends[r]; p0 += CHUNK) {
            const int n = ends[r] - p0 < CHUNK ? ends[r] - p0 : CHUNK;
            for (int j = 0; j < n; j++) {
                const int p = p0 + j;
                const CACHE_T *k = key_cache + ((int64_t)table[p / block_size] * block_size + p % block_size)
                                   * slot_stride + (int64_t)h * head_dim;
                const int pn = p + CHUNK;   /* the next chunk's rows, fetched while this one computes */
                if (pn < ends[r]) {
                    const int64_t next = ((int64_t)table[pn / block_size] * block_size + pn % block_size) * slot_stride
                                         + (int64_t)h * head_dim;
                    for (int x = 0; x < head_dim; x += line) {
                        __builtin_prefetch(key_cache + next + x);
                        __builtin_prefetch(value_cache + next + x);
                    }
                }
                for (int g = 0; g < group; g++) {
                    const float *qg = q + g * head_dim;
                    float part[LANES] = {0.0f};
                    int x = 0;
                    for (; x + LANES <= head_dim; x += LANES)
                        for (int i = 0; i < LANES; i++)
                            part[i] += qg[x + i] * LOAD_KV(k[x + i]);
                    for (int i = 0; x + i < head_dim; i++)
                        part[i] += qg[x + i] * LOAD_KV(k[x + i]);
                    s[g][j] = lane_total(part) * scale;
                }
            }
            for (int g = 0; g < group; g++) {
                float mx = m[g];
                #pragma omp simd reduction(max:mx)
                for (int j = 0; j < n; j++)
                    mx = s[g][j] > mx ? s[g][j] : mx;
                const float correction = exp_nonpositive(m[g] - mx);   /* 0 on the first chunk (m = -FLT_MAX) */
                #pragma omp simd
                for (int j = 0; j < n; j++)
                    s[g][j] = exp_nonpositive(s[g][j] - mx);
                l[g] = l[g] * correction + sum_of(s[g], n);
                m[g] = mx;
                float *a = acc + g * head_dim;
                #pragma omp simd
                for (int x = 0; x < head_dim; x++)
                    a[x] *= correction;
            }
            for (int j = 0; j < n; j++) {
                const int p = p0 + j;
                const CACHE_T *v = value_cache + ((int64_t)table[p / block_size] * block_size + p % block_size)
                                   * slot_stride + (int64_t)h * head_dim;
                for (int g = 0; g < group; g++) {
                    const float w = s[g][j];
                    float *a = acc + g * head_dim;
                    #pragma omp simd
                    for (int x = 0; x < head_dim; x++)
                        a[x] += w * LOAD_KV(v[x]);
                }
            }
        }
        for (int g = 0; g < group; g++) {
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int x = 0; x < head_dim; x++)
                o[g * head_dim + x] = STORE_Q(acc[g * head_dim + x] * inv);
        }
    }
}
