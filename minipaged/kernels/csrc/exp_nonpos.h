/* exp(x) for x <= 0, shared by the attention kernel (softmax numerators) and the layer ops
 * (the sigmoid of SiLU). */
#ifndef MINIPAGED_EXP_NONPOS_H
#define MINIPAGED_EXP_NONPOS_H

#include <stdint.h>

/* 2^n * p(r) with r = x - n ln2, |r| <= ln2 / 2
 * (Cody-Waite reduction, degree-6 polynomial). Branch-free, so the loop over keys vectorizes;
 * below -87 the result is ~0 anyway (smallest normal float ~ exp(-87.3)). */
static inline float exp_nonpos(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(x * 1.44269504088896341f); /* x / ln2 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } u = { .f = p };
    u.i += (int32_t)n * (1 << 23); /* times 2^n: add n to the exponent bits (n >= -126) */
    return u.f;
}

#endif
