/* RMSNorm of transformers' Llama-family layers in one pass per row (the op tgi_vlm::rms_norm,
   tgi_vlm/kernels/cpu/ops.py, which the lean decoder layer calls; torch's operations are the reference it is
   tested against).

   Why: on CPU, torch runs this norm as ~6 operations (pow, mean, add, rsqrt, mul, casts), each a dispatch and, for a
   decode batch of a few rows, an OpenMP region for a few microseconds of work: ~100 us per call, 24 calls per step
   of the bench model (~2.4 ms of a ~30 ms decode step). Here it is one call.

   What it computes, per row of H values: variance = mean of x^2 (x widened to float), n = x * 1 / sqrt(variance +
   eps) in float, then out = weight * n as transformers' `weight * hidden.to(input_dtype)` rounds it (float32: one
   float product; bfloat16: n rounded to bf16, the product of two bf16 values rounded to bf16). Every step is
   transformers' except the sum of squares, accumulated here in double, then rounded to float (torch sums floats
   in its own vectorized order, a few ulps from the exact sum): the variance may differ from torch's in its last
   bits, and so may the outputs (tests/unit/test_cpu_decoder.py holds them within 4 ulps of torch's and of a
   float64 norm). Compiled without -ffast-math and without contraction, so every other operation rounds as
   torch's does. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define DTYPE_FLOAT32 1
#define DTYPE_BFLOAT16 2

/* The sum of squares in double, in LANES independent partial sums (one dependency chain each, added in order at
   the end): deterministic, and at least as accurate as a float sum in any order. */
#define LANES 8
#define SUM_OF_SQUARES(x, H, WIDEN)                                        \
    double part[LANES] = {0};                                              \
    int64_t i = 0;                                                         \
    for (; i + LANES <= (H); i += LANES)                                   \
        for (int l = 0; l < LANES; ++l) {                                  \
            const double v = (double)WIDEN((x)[i + l]);                    \
            part[l] += v * v;                                              \
        }                                                                  \
    for (; i < (H); ++i) {                                                 \
        const double v = (double)WIDEN((x)[i]);                            \
        part[0] += v * v;                                                  \
    }                                                                      \
    double squares = 0.0;                                                  \
    for (int l = 0; l < LANES; ++l) squares += part[l];

#define AS_FLOAT(v) (v)

static void row_f32(const float* x, const float* weight, float* out, int64_t H, float eps) {
    SUM_OF_SQUARES(x, H, AS_FLOAT)
    const float inv = 1.0f / sqrtf((float)(squares / (double)H) + eps);
    for (int64_t i = 0; i < H; ++i) out[i] = weight[i] * (x[i] * inv);
}

static void row_bf16(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t H, float eps) {
    SUM_OF_SQUARES(x, H, bf16_to_f32)
    const float inv = 1.0f / sqrtf((float)(squares / (double)H) + eps);
    for (int64_t i = 0; i < H; ++i) {
        const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * inv));
        out[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
    }
}

/* x, out: [T, H] rows (row strides in elements; out may not overlap x), weight: [H], all of `dtype`. Returns 0, or
   -1 for an unknown dtype. */
int tgi_vlm_rms_norm(int dtype, const void* x, int64_t x_row_stride, const void* weight, void* out,
                     int64_t out_row_stride, int64_t T, int64_t H, float eps, int num_threads) {
    if (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16) return -1;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (T * H >= 65536)
    for (int64_t t = 0; t < T; ++t) {
        if (dtype == DTYPE_FLOAT32)
            row_f32((const float*)x + t * x_row_stride, (const float*)weight, (float*)out + t * out_row_stride, H, eps);
        else
            row_bf16((const uint16_t*)x + t * x_row_stride, (const uint16_t*)weight, (uint16_t*)out + t * out_row_stride,
                     H, eps);
    }
    return 0;
}

/* Gemma's RMSNorm (transformers' Gemma3RMSNorm, also Gemma 2's): out = (n * (1 + weight)) cast to the input dtype,
   n = x * 1 / sqrt(mean(x^2) + eps), every step in float and one rounding at the end (Llama's rounds n first and
   multiplies in the input dtype). The sum of squares is in double as above.

   Rows are (token, head) pairs, so one call normalizes the query or key heads of a fused q/k/v product in place:
   row (t, g) starts at x + t * x_token_stride + g * H (out likewise); H values each. `out` may be `x` itself (each
   row is read whole for its sum before any of it is written, then element by element), but no other overlap. */
static void gemma_row_f32(const float* x, const float* weight, float* out, int64_t H, float eps) {
    SUM_OF_SQUARES(x, H, AS_FLOAT)
    const float inv = 1.0f / sqrtf((float)(squares / (double)H) + eps);
    for (int64_t i = 0; i < H; ++i) out[i] = (x[i] * inv) * (1.0f + weight[i]);
}

static void gemma_row_bf16(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t H, float eps) {
    SUM_OF_SQUARES(x, H, bf16_to_f32)
    const float inv = 1.0f / sqrtf((float)(squares / (double)H) + eps);
    for (int64_t i = 0; i < H; ++i)
        out[i] = f32_to_bf16((bf16_to_f32(x[i]) * inv) * (1.0f + bf16_to_f32(weight[i])));
}

/* x, out: [T, G, H] (token strides in elements, heads of H contiguous), weight: [H], all of `dtype`. Returns 0, or
   -1 for an unknown dtype. */
int tgi_vlm_gemma_rms_norm(int dtype, const void* x, int64_t x_token_stride, const void* weight, void* out,
                           int64_t out_token_stride, int64_t T, int64_t G, int64_t H, float eps, int num_threads) {
    if (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16) return -1;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (T * G * H >= 65536)
    for (int64_t r = 0; r < T * G; ++r) {
        const int64_t t = r / G, g = r % G;
        if (dtype == DTYPE_FLOAT32)
            gemma_row_f32((const float*)x + t * x_token_stride + g * H, (const float*)weight,
                          (float*)out + t * out_token_stride + g * H, H, eps);
        else
            gemma_row_bf16((const uint16_t*)x + t * x_token_stride + g * H, (const uint16_t*)weight,
                           (uint16_t*)out + t * out_token_stride + g * H, H, eps);
    }
    return 0;
}

/* A Gemma 3 sandwich norm and its residual add in one pass: out[t] = residual[t] + gemma_norm(x[t]), the norm rounded
   to the dtype first and the sum rounded again, as transformers' `residual + post_norm(x)` of two tensors in the
   dtype rounds them (bfloat16: the float sum of the two bf16 values, rounded once; float32: one float sum). Rows are
   contiguous: x, residual and out [T, H]. `out` may be `residual` (each element read before it is written) but must
   not overlap x otherwise. Returns 0, or -1 for an unknown dtype. */
static void gemma_add_row_f32(const float* x, const float* weight, const float* residual, float* out, int64_t H,
                              float eps) {
    SUM_OF_SQUARES(x, H, AS_FLOAT)
    const float inv = 1.0f / sqrtf((float)(squares / (double)H) + eps);
    for (int64_t i = 0; i < H; ++i) out[i] = residual[i] + (x[i] * inv) * (1.0f + weight[i]);
}

static void gemma_add_row_bf16(const uint16_t* x, const uint16_t* weight, const uint16_t* residual, uint16_t* out,
                               int64_t H, float eps) {
    SUM_OF_SQUARES(x, H, bf16_to_f32)
    const float inv = 1.0f / sqrtf((float)(squares / (double)H) + eps);
    for (int64_t i = 0; i < H; ++i) {
        const float normed = bf16_to_f32(f32_to_bf16((bf16_to_f32(x[i]) * inv) * (1.0f + bf16_to_f32(weight[i]))));
        out[i] = f32_to_bf16(bf16_to_f32(residual[i]) + normed);
    }
}

int tgi_vlm_gemma_rms_norm_add(int dtype, const void* x, const void* weight, const void* residual, void* out,
                               int64_t T, int64_t H, float eps, int num_threads) {
    if (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16) return -1;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (T * H >= 65536)
    for (int64_t t = 0; t < T; ++t) {
        if (dtype == DTYPE_FLOAT32)
            gemma_add_row_f32((const float*)x + t * H, (const float*)weight, (const float*)residual + t * H,
                              (float*)out + t * H, H, eps);
        else
            gemma_add_row_bf16((const uint16_t*)x + t * H, (const uint16_t*)weight, (const uint16_t*)residual + t * H,
                               (uint16_t*)out + t * H, H, eps);
    }
    return 0;
}
