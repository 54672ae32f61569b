/* PagedAttention on a CPU, in C: the "cpu" attention backend (minipaged/kernels/cpu.py).
 *
 * The CPU counterpart of vLLM's csrc/cpu/attention.cpp and of the original PagedAttention V1
 * CUDA kernel: one query per sequence (decode), all of the sequence's logits kept in a buffer,
 * softmax over that buffer in passes, then the weighted sum of the values. No gather: keys and
 * values are read in place, block by block, through the block table.
 *
 * Layouts (row-major, float32; q's rows q_stride floats apart, the rest contiguous):
 *   q, out          [num_seqs, num_heads, head_dim]
 *   k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables    [num_seqs, max_blocks] int32     seq_lens [num_seqs] int32
 * Query head h reads kv head h / (num_heads / num_kv_heads) (GQA).
 * Built with -O3 -ffast-math so that the dot products and sums vectorize; the library is linked
 * without -ffast-math, so loading it leaves the process's floating-point mode alone.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpos.h"

/* Token i's key and value go to slot slot_mapping[i] (block = slot / block_size, offset =
 * slot % block_size); slots < 0 are padding and skipped. key, value [T, num_kv_heads, head_dim]
 * with key_stride / value_stride floats between rows. Returns 0, or i + 1 when token i's slot
 * is outside the cache (nothing is written from that token on). */
int64_t reshape_and_cache_f32(const float *key, int64_t key_stride, const float *value,
                              int64_t value_stride, float *k_cache, float *v_cache,
                              int64_t num_slots, const int64_t *slot_mapping, int64_t num_tokens,
                              int64_t token_size)
{
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slot_mapping[i];
        if (slot < 0)
            continue;
        if (slot >= num_slots)
            return i + 1;
        memcpy(k_cache + slot * token_size, key + i * key_stride, token_size * sizeof(float));
        memcpy(v_cache + slot * token_size, value + i * value_stride, token_size * sizeof(float));
    }
    return 0;
}

/* Ask for token row t of a sequence (block table `table`) to be brought into the L2 cache. Every
 * block is its own 4 KiB region somewhere in the pool, so the hardware prefetcher, which follows
 * one address stream within a page, stops at every block: software says where the next rows are.
 * Into L2, not L1 (locality hint 1): a whole sequence's rows do not fit in L1 until they are used. */
static inline void prefetch_row(const float *cache, const int32_t *table, int64_t t,
                                int64_t block_size, int64_t block_stride, int64_t token_stride)
{
    const float *row = cache + (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t off = 0; off < token_stride; off += 16) /* one 64-byte line at a time */
        __builtin_prefetch(row + off, 0, 1);
}

/* The number of token rows of sequence b that may be prefetched: its length, or 0 when b is past
 * the batch or its table does not check out (nothing is read then). */
static inline int64_t prefetchable(const int32_t *block_tables, const int32_t *seq_lens, int64_t b,
                                   int64_t num_seqs, int64_t block_size, int64_t max_blocks,
                                   int64_t num_cache_blocks)
{
    if (b >= num_seqs || seq_lens[b] < 0)
        return 0;
    const int64_t num_blocks = (seq_lens[b] + block_size - 1) / block_size;
    if (num_blocks > max_blocks)
        return 0;
    for (int64_t j = 0; j < num_blocks; j++)
        if (block_tables[b * max_blocks + j] < 0 || block_tables[b * max_blocks + j] >= num_cache_blocks)
            return 0;
    return seq_lens[b];
}

/* -- Grouped-query heads, four at a time ------------------------------------------------------
 * With GQA, num_heads / num_kv_heads query heads read the same keys and values. When that group
 * is a multiple of 4 (and head_dim of 16), the two passes below take four query heads at once:
 * each key or value row is loaded once for four heads, in 16-float vectors (GCC/clang vector
 * extensions: AVX-512, AVX2 or NEON, whatever the CPU has), and the four dot products are summed
 * together. Same arithmetic as the loops in decode(), fewer loads: a test holds them equal. */
typedef float v16 __attribute__((vector_size(64)));
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else /* older GCC: the same permutation through __builtin_shuffle and an index vector */
typedef int32_t i16 __attribute__((vector_size(64)));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif

static inline v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

/* Lanes 0, 4, 8 and 12 of the result hold the sums of a, b, c and d: halve, halve, halve, halve. */
static inline v16 sum4(v16 a, v16 b, v16 c, v16 d)
{
    const v16 ab = SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                 + SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16 cd = SHUFFLE(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                 + SHUFFLE(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    v16 e = SHUFFLE(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
          + SHUFFLE(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    e += SHUFFLE(e, e, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return e + SHUFFLE(e, e, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}

/* Pass 1 for query heads h0 .. h0 + 3, whose keys start `off` floats into each token row:
 * scores[h * len + t] = scale * q[h] . k[t]. With next_rows > 0, also prefetches those rows of the
 * next sequence (block table `next`), one per row read here, as decode() does. */
static inline void logits_x4(const float *qb, const float *k_cache, const int32_t *table,
                             int64_t len, int64_t h0, int64_t off, int64_t head_dim,
                             int64_t block_size, int64_t block_stride, int64_t token_stride,
                             float scale, float *scores, const int32_t *next, int64_t next_rows)
{
    const int64_t nx = head_dim / 16;
    v16 q0[8], q1[8], q2[8], q3[8]; /* the four queries stay in registers */
    for (int64_t x = 0; x < nx; x++) {
        q0[x] = load16(qb + h0 * head_dim + 16 * x);
        q1[x] = load16(qb + (h0 + 1) * head_dim + 16 * x);
        q2[x] = load16(qb + (h0 + 2) * head_dim + 16 * x);
        q3[x] = load16(qb + (h0 + 3) * head_dim + 16 * x);
    }
    for (int64_t j = 0; j * block_size < len; j++) {
        const float *kb = k_cache + (int64_t)table[j] * block_stride + off;
        const int64_t n = len - j * block_size < block_size ? len - j * block_size : block_size;
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = j * block_size + i;
            if (t < next_rows)
                prefetch_row(k_cache, next, t, block_size, block_stride, token_stride);
            v16 a = {0}, b = {0}, c = {0}, d = {0};
            for (int64_t x = 0; x < nx; x++) {
                const v16 k = load16(kb + i * token_stride + 16 * x); /* one load, four heads */
                a += q0[x] * k;
                b += q1[x] * k;
                c += q2[x] * k;
                d += q3[x] * k;
            }
            const v16 s = sum4(a, b, c, d) * scale;
            scores[h0 * len + t] = s[0];
            scores[(h0 + 1) * len + t] = s[4];
            scores[(h0 + 2) * len + t] = s[8];
            scores[(h0 + 3) * len + t] = s[12];
        }
    }
}

/* Pass 3 for query heads h0 .. h0 + 3: out[h] = sum over t of p[h, t] * v[t]. */
static inline void values_x4(const float *v_cache, const int32_t *table, const float *scores,
                             int64_t len, int64_t h0, int64_t off, int64_t head_dim,
                             int64_t block_size, int64_t block_stride, int64_t token_stride,
                             float *ob)
{
    const int64_t nx = head_dim / 16;
    const float *p0 = scores + h0 * len, *p1 = p0 + len, *p2 = p1 + len, *p3 = p2 + len;
    v16 a0[8], a1[8], a2[8], a3[8]; /* the four sums stay in registers */
    for (int64_t x = 0; x < nx; x++)
        a0[x] = a1[x] = a2[x] = a3[x] = (v16){0};
    for (int64_t j = 0; j * block_size < len; j++) {
        const float *vb = v_cache + (int64_t)table[j] * block_stride + off;
        const int64_t n = len - j * block_size < block_size ? len - j * block_size : block_size;
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = j * block_size + i;
            for (int64_t x = 0; x < nx; x++) {
                const v16 v = load16(vb + i * token_stride + 16 * x); /* one load, four heads */
                a0[x] += p0[t] * v;
                a1[x] += p1[t] * v;
                a2[x] += p2[t] * v;
                a3[x] += p3[t] * v;
            }
        }
    }
    for (int64_t x = 0; x < nx; x++) {
        memcpy(ob + h0 * head_dim + 16 * x, &a0[x], sizeof(v16));
        memcpy(ob + (h0 + 1) * head_dim + 16 * x, &a1[x], sizeof(v16));
        memcpy(ob + (h0 + 2) * head_dim + 16 * x, &a2[x], sizeof(v16));
        memcpy(ob + (h0 + 3) * head_dim + 16 * x, &a3[x], sizeof(v16));
    }
}

/* The kernel body; paged_attention_decode_f32 (below) calls it with head_dim a constant for
 * the usual sizes, so that the compiler unrolls the loops over d. */
static inline __attribute__((always_inline)) int64_t decode(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
    int64_t num_cache_blocks, const int32_t *block_tables, const int32_t *seq_lens, float *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale)
{
    int64_t max_len = 0;
    for (int64_t b = 0; b < num_seqs; b++)
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    float *scores = malloc((size_t)(num_heads * max_len + 1) * sizeof(float)); /* the logits */
    if (scores == NULL)
        return -1;
    const int64_t group = num_heads / num_kv_heads;
    const int x4 = group % 4 == 0 && head_dim % 16 == 0 && head_dim <= 128; /* four heads at a time */
    const int64_t token_stride = num_kv_heads * head_dim; /* floats between two slots */
    const int64_t block_stride = block_size * token_stride; /* floats between two blocks */
    for (int64_t b = 0; b < num_seqs; b++) {
        const int32_t *table = block_tables + b * max_blocks;
        const int64_t len = seq_lens[b];
        const int64_t num_blocks = (len + block_size - 1) / block_size;
        for (int64_t j = 0; j < num_blocks; j++) {
            if (num_blocks > max_blocks || table[j] < 0 || table[j] >= num_cache_blocks) {
                free(scores);
                return b + 1;
            }
        }
        const float *qb = q + b * q_stride;
        float *ob = out + b * num_heads * head_dim;
        /* While this sequence computes, the next one's rows are prefetched: for each row read
         * here, the same row of sequence b + 1 (then the rows it has beyond this one's length). */
        const int32_t *next = table + max_blocks;
        const int64_t next_rows = prefetchable(block_tables, seq_lens, b + 1, num_seqs, block_size,
                                               max_blocks, num_cache_blocks);

        /* 1. Logits: every query head against every key, block by block (physical block
         *    table[j] holds the sequence's tokens j * block_size ...); with x4, four query
         *    heads per key row (logits_x4, above), else the plain loops. */
        if (x4)
            for (int64_t h0 = 0; h0 < num_heads; h0 += 4)
                logits_x4(qb, k_cache, table, len, h0, (h0 / group) * head_dim, head_dim, block_size,
                          block_stride, token_stride, scale, scores, next, h0 == 0 ? next_rows : 0);
        else
            for (int64_t j = 0; j < num_blocks; j++) {
                const float *kb = k_cache + (int64_t)table[j] * block_stride;
                const int64_t n = len - j * block_size < block_size ? len - j * block_size : block_size;
                for (int64_t i = 0; i < n; i++) {
                    const int64_t t = j * block_size + i;
                    if (t < next_rows)
                        prefetch_row(k_cache, next, t, block_size, block_stride, token_stride);
                    for (int64_t h = 0; h < num_heads; h++) {
                        const float *k = kb + i * token_stride + (h / group) * head_dim;
                        const float *qh = qb + h * head_dim;
                        float s = 0.0f;
                        for (int64_t d = 0; d < head_dim; d++)
                            s += qh[d] * k[d];
                        scores[h * len + t] = s * scale;
                    }
                }
            }
        for (int64_t t = len; t < next_rows; t++)
            prefetch_row(k_cache, next, t, block_size, block_stride, token_stride);

        /* 2. Softmax of each head's logits, in three passes: max, exp and sum, normalise. */
        for (int64_t h = 0; h < num_heads; h++) {
            if (len == 0)
                break; /* (a loop condition `&& len > 0` here stops the inner loops vectorizing) */
            float *sh = scores + h * len;
            float m = sh[0], l = 0.0f;
            for (int64_t t = 1; t < len; t++)
                m = sh[t] > m ? sh[t] : m;
            for (int64_t t = 0; t < len; t++) {
                sh[t] = exp_nonpos(sh[t] - m);
                l += sh[t];
            }
            const float inv = 1.0f / l; /* l >= 1: the max's own term is exp(0) */
            for (int64_t t = 0; t < len; t++)
                sh[t] *= inv;
        }

        /* 3. out[h] = sum over keys t of p[h, t] * v[t], block by block again: four heads per
         *    value row with x4 (values_x4), else one head at a time, so that its sum stays in
         *    registers (acc). An empty sequence gets zeros. */
        for (int64_t t = 0; t < next_rows; t++)
            prefetch_row(v_cache, next, t, block_size, block_stride, token_stride);
        if (x4)
            for (int64_t h0 = 0; h0 < num_heads; h0 += 4)
                values_x4(v_cache, table, scores, len, h0, (h0 / group) * head_dim, head_dim, block_size,
                          block_stride, token_stride, ob);
        else
            for (int64_t h = 0; h < num_heads; h++) {
                float acc[head_dim];
                for (int64_t d = 0; d < head_dim; d++)
                    acc[d] = 0.0f;
                const float *ph = scores + h * len;
                for (int64_t j = 0; j < num_blocks; j++) {
                    const float *vb = v_cache + (int64_t)table[j] * block_stride + (h / group) * head_dim;
                    const int64_t n = len - j * block_size < block_size ? len - j * block_size : block_size;
                    for (int64_t i = 0; i < n; i++) {
                        const float p = ph[j * block_size + i];
                        for (int64_t d = 0; d < head_dim; d++)
                            acc[d] += p * vb[i * token_stride + d];
                    }
                }
                for (int64_t d = 0; d < head_dim; d++) /* a loop, not memcpy: acc stays in registers */
                    ob[h * head_dim + d] = acc[d];
            }
    }
    free(scores);
    return 0;
}

/* Returns 0; b + 1 when sequence b's table names a block outside the cache or its seq_len
 * needs more than max_blocks blocks (out[b:] is then not written); -1 when out of memory. */
int64_t paged_attention_decode_f32(const float *q, int64_t q_stride, const float *k_cache,
                                   const float *v_cache, int64_t num_cache_blocks,
                                   const int32_t *block_tables, const int32_t *seq_lens,
                                   float *out, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                   int64_t max_blocks, float scale)
{
#define DECODE(D)                                                                                  \
    decode(q, q_stride, k_cache, v_cache, num_cache_blocks, block_tables, seq_lens, out, num_seqs, \
           num_heads, num_kv_heads, D, block_size, max_blocks, scale)
    switch (head_dim) {
    case 32: return DECODE(32);
    case 64: return DECODE(64);
    case 128: return DECODE(128);
    default: return DECODE(head_dim);
    }
#undef DECODE
}

/* -- An 8-bit cache (kv_cache_dtype "int8" or "fp8") -------------------------------------------
 * The same decode over a cache whose elements are single bytes. A byte means nothing by itself:
 * k_table[byte] is the float it stands for, already times the layer's k_scale (cpu.py builds the
 * two 256-entry tables from torch's own int8 / float8_e4m3fn decoding, so the C kernel and the
 * torch reference read bit for bit the same values). Each token row (num_kv_heads * head_dim
 * bytes) is dequantized once into `row`, then every query head of the row's kv heads reads it:
 * the fp32 loops of decode() without the four-head vectors. Same return values as
 * paged_attention_decode_f32. */
int64_t paged_attention_decode_q8(const float *q, int64_t q_stride, const uint8_t *k_cache,
                                  const uint8_t *v_cache, const float *k_table,
                                  const float *v_table, int64_t num_cache_blocks,
                                  const int32_t *block_tables, const int32_t *seq_lens, float *out,
                                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                  float scale)
{
    int64_t max_len = 0;
    for (int64_t b = 0; b < num_seqs; b++)
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    const int64_t token_stride = num_kv_heads * head_dim; /* bytes between two slots */
    const int64_t block_stride = block_size * token_stride; /* bytes between two blocks */
    float *scores = malloc((size_t)(num_heads * max_len + 1) * sizeof(float)); /* the logits */
    float *row = malloc((size_t)token_stride * sizeof(float)); /* one token row, dequantized */
    if (scores == NULL || row == NULL) {
        free(scores);
        free(row);
        return -1;
    }
    const int64_t group = num_heads / num_kv_heads;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int32_t *table = block_tables + b * max_blocks;
        const int64_t len = seq_lens[b];
        const int64_t num_blocks = (len + block_size - 1) / block_size;
        for (int64_t j = 0; j < num_blocks; j++) {
            if (num_blocks > max_blocks || table[j] < 0 || table[j] >= num_cache_blocks) {
                free(scores);
                free(row);
                return b + 1;
            }
        }
        const float *qb = q + b * q_stride;
        float *ob = out + b * num_heads * head_dim;

        /* 1. Logits: token t's key row, dequantized, against every query head. */
        for (int64_t t = 0; t < len; t++) {
            const uint8_t *k = k_cache + (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
            for (int64_t x = 0; x < token_stride; x++)
                row[x] = k_table[k[x]];
            for (int64_t h = 0; h < num_heads; h++) {
                const float *kh = row + (h / group) * head_dim, *qh = qb + h * head_dim;
                float s = 0.0f;
                for (int64_t d = 0; d < head_dim; d++)
                    s += qh[d] * kh[d];
                scores[h * len + t] = s * scale;
            }
        }

        /* 2. Softmax of each head's logits: max, exp and sum, normalise. */
        for (int64_t h = 0; h < num_heads && len > 0; h++) {
            float *sh = scores + h * len;
            float m = sh[0], l = 0.0f;
            for (int64_t t = 1; t < len; t++)
                m = sh[t] > m ? sh[t] : m;
            for (int64_t t = 0; t < len; t++) {
                sh[t] = exp_nonpos(sh[t] - m);
                l += sh[t];
            }
            for (int64_t t = 0; t < len; t++)
                sh[t] /= l;
        }

        /* 3. out[h] = sum over t of p[h, t] * v[t]: token t's value row, dequantized once. */
        for (int64_t x = 0; x < num_heads * head_dim; x++)
            ob[x] = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            const uint8_t *v = v_cache + (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
            for (int64_t x = 0; x < token_stride; x++)
                row[x] = v_table[v[x]];
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * len + t], *vh = row + (h / group) * head_dim;
                for (int64_t d = 0; d < head_dim; d++)
                    ob[h * head_dim + d] += p * vh[d];
            }
        }
    }
    free(scores);
    free(row);
    return 0;
}
