/* The small layers of a decoder step in C: the "cpu" backend's forward_cpu of RMSNorm, RoPE and
 * SiLU-and-mul (minipaged/model/layers.py), as vLLM's CPU backend has them in csrc/cpu/
 * (layernorm.cpp, pos_encoding.cpp, activation.cpp). Each replaces a handful of torch ops, each
 * a pass over memory and a few microseconds of dispatch, by one pass; at decode on a CPU those
 * ops cost about as much as the attention itself.
 *
 * float32, rows contiguous unless a stride is given. Built with -O3 -ffast-math (the sums of
 * squares vectorize); the results equal the torch forms to float rounding (tests/model/test_layers_cpu.py).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "exp_nonpos.h"

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows x [rows, hidden].
 * With residual != NULL, first residual[r] += x[r], and the norm is of that sum (vLLM's
 * fused_add_rms_norm: the residual stream of a pre-norm decoder is added and normalised in
 * one pass). out may be x. */
void rms_norm_f32(float *out, float *x, float *residual, const float *weight, int64_t rows,
                  int64_t hidden, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        if (residual != NULL) {
            float *res = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++)
                res[i] += xr[i];
            xr = res;
        }
        float sum_sq = 0.0f;
        for (int64_t i = 0; i < hidden; i++)
            sum_sq += xr[i] * xr[i];
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        float *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++)
            o[i] = weight[i] * (xr[i] * inv_rms);
    }
}

/* Neox-style RoPE in place: x [rows, num_heads, head_dim] with rows row_stride floats apart;
 * each head's halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin) at the row's position,
 * cos/sin looked up in the caches [max_positions, head_dim / 2]. Returns 0, or r + 1 when row
 * r's position is outside the caches (then nothing is rotated). */
int64_t rotary_neox_f32(float *x, int64_t row_stride, int64_t rows, int64_t num_heads,
                        int64_t head_dim, const int64_t *positions, const float *cos_cache,
                        const float *sin_cache, int64_t max_positions)
{
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_positions)
            return r + 1;
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_cache + positions[r] * half, *s = sin_cache + positions[r] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x1 = x + r * row_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
    return 0;
}

/* out[r] = silu(x[r, :n]) * x[r, n:] for x [rows, 2n] (gate and up side by side, as the fused
 * gate_up_proj writes them); silu(a) = a * sigmoid(a), with sigmoid from e = exp(-|a|) <= 1
 * (no overflow on either side): 1 / (1 + e) for a >= 0, e / (1 + e) for a < 0. */
void silu_and_mul_f32(float *out, const float *x, int64_t rows, int64_t n)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float a = gate[i];
            const float e = exp_nonpos(a < 0.0f ? a : -a);
            const float sigmoid = (a < 0.0f ? e : 1.0f) / (1.0f + e);
            o[i] = a * sigmoid * up[i];
        }
    }
}
