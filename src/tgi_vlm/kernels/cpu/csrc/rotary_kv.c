/* Rotary embedding of the query and key heads of a fused q/k/v product, and the step's keys and values stored
   into the paged cache, in one pass (the op tgi_vlm::rotary_and_store, tgi_vlm/kernels/cpu/ops.py).

   Bit for bit what the lean decoder layer's torch operations compute (layers/cpu_decoder.py `_rotate` and the
   torch backend's `write_kv`): out = x * cos + rotate_half(x) * sin, each product and the sum rounded to the
   tensor's dtype as torch rounds them (float32: IEEE single operations, no fused multiply-add; bfloat16: the
   product of two bf16 values is exact in float32, then rounded to nearest even, as torch converts). So this file
   is compiled without -ffast-math and with -ffp-contract=off. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define DTYPE_FLOAT32 1
#define DTYPE_BFLOAT16 2

/* qkv: [T, (Hq + 2 Hkv) * D] rows (row stride in elements), heads of D contiguous: Hq query, Hkv key, Hkv value.
   cos / sin: [T, D] rows (row stride). q_out: [T, Hq, D], k_out: [T, Hkv, D] contiguous. k_cache / v_cache:
   [slots, Hkv, D] contiguous; slots[t]: where row t's key and value go. Returns 0, or -1 for an unknown dtype or
   an odd head size. */
int tgi_vlm_rotary_kv(int dtype, const void* qkv, int64_t qkv_row_stride, int64_t T, int64_t Hq, int64_t Hkv,
                      int64_t D, const void* cos, const void* sin, int64_t cs_row_stride, void* q_out, void* k_out,
                      void* k_cache, void* v_cache, const int64_t* slots, int num_threads) {
    if ((dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16) || D % 2 != 0) return -1;
    const int64_t half = D / 2, heads = Hq + Hkv;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (T * heads * D >= 65536)
    for (int64_t t = 0; t < T; ++t) {
        if (dtype == DTYPE_FLOAT32) {
            const float* row = (const float*)qkv + t * qkv_row_stride;
            const float* c = (const float*)cos + t * cs_row_stride;
            const float* s = (const float*)sin + t * cs_row_stride;
            for (int64_t h = 0; h < heads; ++h) {
                const float* x = row + h * D;
                float* o = h < Hq ? (float*)q_out + (t * Hq + h) * D : (float*)k_out + (t * Hkv + h - Hq) * D;
                for (int64_t i = 0; i < half; ++i) {
                    const float a = x[i] * c[i], b = -x[i + half] * s[i];
                    o[i] = a + b;
                }
                for (int64_t i = half; i < D; ++i) {
                    const float a = x[i] * c[i], b = x[i - half] * s[i];
                    o[i] = a + b;
                }
            }
            memcpy((float*)k_cache + slots[t] * Hkv * D, (float*)k_out + t * Hkv * D, sizeof(float) * Hkv * D);
            memcpy((float*)v_cache + slots[t] * Hkv * D, row + heads * D, sizeof(float) * Hkv * D);
        } else {
            const uint16_t* row = (const uint16_t*)qkv + t * qkv_row_stride;
            const uint16_t* c = (const uint16_t*)cos + t * cs_row_stride;
            const uint16_t* s = (const uint16_t*)sin + t * cs_row_stride;
            for (int64_t h = 0; h < heads; ++h) {
                const uint16_t* x = row + h * D;
                uint16_t* o = h < Hq ? (uint16_t*)q_out + (t * Hq + h) * D : (uint16_t*)k_out + (t * Hkv + h - Hq) * D;
                for (int64_t i = 0; i < D; ++i) {
                    const float xr = i < half ? -bf16_to_f32(x[i + half]) : bf16_to_f32(x[i - half]);
                    const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])));
                    const float b = bf16_to_f32(f32_to_bf16(xr * bf16_to_f32(s[i])));
                    o[i] = f32_to_bf16(a + b);
                }
            }
            memcpy((uint16_t*)k_cache + slots[t] * Hkv * D, (uint16_t*)k_out + t * Hkv * D, 2 * Hkv * D);
            memcpy((uint16_t*)v_cache + slots[t] * Hkv * D, row + heads * D, 2 * Hkv * D);
        }
    }
    return 0;
}
