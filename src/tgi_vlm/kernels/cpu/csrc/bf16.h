/* bfloat16 <-> float conversions shared by the scalar native files (rotary_kv.c, rms_norm.c), matching torch's:
   widening is exact; narrowing rounds to nearest even, and a NaN stays a (quiet) NaN. */
#ifndef TGI_VLM_BF16_H
#define TGI_VLM_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif
