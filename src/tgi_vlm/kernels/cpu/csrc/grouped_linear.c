/* Linear layers whose weight is stored as int8 codes with a float32 scale (and optionally an offset) per group of
   `group` consecutive inputs: W[o, k] = scales[o, k / group] * codes[o, k] - offsets[o, k / group]. The op
   tgi_vlm::grouped_int8_linear computes y = x W^T for float32 or bfloat16 x (ops.py checks the inputs;
   tgi_vlm/quantization/grouped.py's `dequantize` + F.linear is the reference it is tested against).

   Why: a quantized checkpoint (a GGUF file's Q8_0 / Q5_0 / Q4_K / Q6_K blocks; quantization/gguf_blocks.py turns
   each into this form exactly) is read from memory at about a byte per weight here instead of two (bf16), and
   decode steps are memory-bound. torch's weight-only ops take per-channel int8 (`_weight_int8pack_mm`) or 4-bit
   codes (`_weight_int4pack_mm_for_cpu`); neither holds a 5-, 6- or 8-bit code with a scale per 16 or 32 inputs
   exactly, which is what these files carry.

   Sums, float32 in 16 lanes, lanes added at the end; not F.linear's order, within float32 rounding of the exact sum:
   1-2 rows: per group x * code, times the group's scale; 3+ rows: x * (scale * code), the weight's exact float32
   value; the offsets' term (sum over groups of offset times the group's sum of x) subtracted last. bf16 x of 12..32
   rows on AMX: the weight (offsets folded in) rounded to bf16 first (see amx_grouped).

   Codes of 4 or 5 bits may be stored packed (`Codes`, packed layout): per 32 inputs k0.., 16 bytes whose byte j holds
   code k0 + j + zero in its low nibble and code k0 + 16 + j + zero in its high one (the layout of a GGUF Q4_0 / Q5_0
   block's quants), and for 5-bit codes a 32-bit word whose bit j is bit 4 of code k0 + j + zero. A Q5_0 weight is then
   read at 0.625 bytes per weight instead of 1 (the decode products are bound by memory), unpacked to the same int8
   codes in registers (three to five byte operations per 16 codes), and summed exactly as above.

   Work: blocks of OUT_BLOCK outputs shared out by OpenMP over the thread pool torch uses; in a block, tiles of up
   to ROW_TILE rows; in a tile, each output's codes are converted to float32 once per 16 inputs and used for every
   row of the tile (the block's codes stay in L1/L2 for the next tile). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ROW_TILE 8
#define OUT_BLOCK 16
#define PREFETCH_BYTES 32768 /* codes ahead of their use, into L2: a block's codes are one contiguous stream */
#define DTYPE_FLOAT32 1
#define DTYPE_BFLOAT16 2

#if defined(__AVX512F__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* A weight's codes: int8 `bytes` [out, in], or packed (`nibbles` [out, in / 2], `high` [out, in / 32] or NULL for
   4-bit codes, `zero` added to every code before it was packed). */
typedef struct {
    const int8_t* bytes;
    const uint8_t* nibbles;
    const uint32_t* high;
    int zero;
    int64_t in;
} Codes;

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define PACKED_CODES 1
#else
#define PACKED_CODES 0
#endif

/* The 16 codes of output o for inputs [k, k + 16) (k a multiple of 16), as int8; prefetches the stream ahead. PACKED
   is a literal at every call, so each caller compiles to one layout's loop. */
ALWAYS_INLINE __m128i codes16(const int PACKED, const Codes* c, int64_t o, int64_t k) {
#if PACKED_CODES
    if (PACKED) {
        const uint8_t* p = c->nibbles + o * (c->in / 2) + (k >> 5) * 16;
        _mm_prefetch((const char*)p + PREFETCH_BYTES / 2, _MM_HINT_T1);
        __m128i v = _mm_loadu_si128((const __m128i*)p);
        if (k & 16) v = _mm_srli_epi16(v, 4);
        v = _mm_and_si128(v, _mm_set1_epi8(0x0F));
        if (c->high != NULL) {
            const uint32_t h = c->high[o * (c->in / 32) + (k >> 5)];
            v = _mm_mask_add_epi8(v, (__mmask16)((k & 16) ? h >> 16 : h & 0xFFFFu), v, _mm_set1_epi8(16));
        }
        return _mm_sub_epi8(v, _mm_set1_epi8((char)c->zero));
    }
#endif
    const int8_t* p = c->bytes + o * c->in + k;
    _mm_prefetch((const char*)p + PREFETCH_BYTES, _MM_HINT_T1);
    return _mm_loadu_si128((const __m128i*)p);
}

ALWAYS_INLINE __m512 code_floats(const int PACKED, const Codes* c, int64_t o, int64_t k) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes16(PACKED, c, o, k)));
}

/* The 32 codes of output o for inputs [k, k + 32) (k a multiple of 32) as float32: packed ones from one load of their
   16 bytes and one high-bit word. */
ALWAYS_INLINE void code_floats32(const int PACKED, const Codes* c, int64_t o, int64_t k, __m512* first,
                                 __m512* second) {
#if PACKED_CODES
    if (PACKED) {
        const uint8_t* p = c->nibbles + o * (c->in / 2) + (k >> 5) * 16;
        _mm_prefetch((const char*)p + PREFETCH_BYTES / 2, _MM_HINT_T1);
        const __m128i v = _mm_loadu_si128((const __m128i*)p), low = _mm_set1_epi8(0x0F);
        __m128i a = _mm_and_si128(v, low), b = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        if (c->high != NULL) {
            const uint32_t h = c->high[o * (c->in / 32) + (k >> 5)];
            const __m128i sixteen = _mm_set1_epi8(16);
            a = _mm_mask_add_epi8(a, (__mmask16)(h & 0xFFFFu), a, sixteen);
            b = _mm_mask_add_epi8(b, (__mmask16)(h >> 16), b, sixteen);
        }
        const __m128i zero = _mm_set1_epi8((char)c->zero);
        *first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(a, zero)));
        *second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(b, zero)));
        return;
    }
#endif
    *first = code_floats(0, c, o, k);
    *second = code_floats(0, c, o, k + 16);
}

/* R rows of x (float32, row stride `in`) against NO consecutive outputs' codes (row stride `in`); each output's
   results, before the offsets' term, in res[o * ROW_TILE + r]. Several outputs at once keep independent FMA
   chains in flight when there are few rows (one row, one output: every group waited on the last one's sum).

   Two ways, by rows. The codes' conversion to float32 (two instructions per 16) bounds the loop, not memory, at few
   rows: `dot_rows_grouped` (1-2 rows) sums x * code over a group and scales that sum once (one instruction less per
   16 weights: 26 vs 33 us for a cached 640 x 1024 weight, one row); `dot_rows_scaled` (3 rows and more) scales the
   codes first (scale * code, the format's exact float32 weight) and adds x * w straight into the totals: one FMA
   per row per 16 weights instead of one and a part, once the conversion is shared by enough rows. */
ALWAYS_INLINE void dot_rows_grouped(const int PACKED, const int R, const int NO, const float* x, int64_t in,
                                    const Codes* codes, int64_t o0, const float* scales, int64_t groups, int64_t group,
                                    float* res) {
    __m512 total[4][ROW_TILE];
#pragma GCC unroll 4
    for (int o = 0; o < NO; ++o)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) total[o][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 part[4][ROW_TILE]; /* x times codes over the group; times its scale once, into total */
        /* groups of 32s: codes two vectors at a time (packed: one load), summed in the same order */
        for (int64_t c = 0; (group & 31) == 0 && c < group; c += 32) {
            const int64_t k = g * group + c;
            __m512 w[4], v[4];
#pragma GCC unroll 4
            for (int o = 0; o < NO; ++o) code_floats32(PACKED, codes, o0 + o, k, &w[o], &v[o]);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512 xv = _mm512_loadu_ps(x + r * in + k), xw = _mm512_loadu_ps(x + r * in + k + 16);
#pragma GCC unroll 4
                for (int o = 0; o < NO; ++o) {
                    part[o][r] = c == 0 ? _mm512_mul_ps(xv, w[o]) : _mm512_fmadd_ps(xv, w[o], part[o][r]);
                    part[o][r] = _mm512_fmadd_ps(xw, v[o], part[o][r]);
                }
            }
        }
        for (int64_t c = 0; (group & 31) != 0 && c < group; c += 16) {
            const int64_t k = g * group + c;
            __m512 w[4];
#pragma GCC unroll 4
            for (int o = 0; o < NO; ++o) w[o] = code_floats(PACKED, codes, o0 + o, k);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512 xv = _mm512_loadu_ps(x + r * in + k);
#pragma GCC unroll 4
                for (int o = 0; o < NO; ++o)
                    part[o][r] = c == 0 ? _mm512_mul_ps(xv, w[o]) : _mm512_fmadd_ps(xv, w[o], part[o][r]);
            }
        }
#pragma GCC unroll 4
        for (int o = 0; o < NO; ++o) {
            const __m512 s = _mm512_set1_ps(scales[o * groups + g]);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) total[o][r] = _mm512_fmadd_ps(part[o][r], s, total[o][r]);
        }
    }
#pragma GCC unroll 4
    for (int o = 0; o < NO; ++o)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) res[o * ROW_TILE + r] = _mm512_reduce_add_ps(total[o][r]);
}

ALWAYS_INLINE void dot_rows_scaled(const int PACKED, const int R, const int NO, const float* x, int64_t in,
                                   const Codes* codes, int64_t o0, const float* scales, int64_t groups, int64_t group,
                                   float* res) {
    __m512 total[4][ROW_TILE];
#pragma GCC unroll 4
    for (int o = 0; o < NO; ++o)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) total[o][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 s[4];
#pragma GCC unroll 4
        for (int o = 0; o < NO; ++o) s[o] = _mm512_set1_ps(scales[o * groups + g]);
        for (int64_t c = 0; c < group; c += 16) {
            const int64_t k = g * group + c;
            __m512 w[4]; /* the weight itself, scale * code: exactly the format's float32 value */
#pragma GCC unroll 4
            for (int o = 0; o < NO; ++o) w[o] = _mm512_mul_ps(code_floats(PACKED, codes, o0 + o, k), s[o]);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512 xv = _mm512_loadu_ps(x + r * in + k);
#pragma GCC unroll 4
                for (int o = 0; o < NO; ++o) total[o][r] = _mm512_fmadd_ps(xv, w[o], total[o][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int o = 0; o < NO; ++o)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) res[o * ROW_TILE + r] = _mm512_reduce_add_ps(total[o][r]);
}

/* Outputs [o, o + NO) for R rows: res[(o - first) * ROW_TILE + r]. */
#define DOT(R_, NO_)                                                                                               \
    ((R_) <= 2 ? dot_rows_grouped(PACKED, R_, NO_, x, in, codes, o, scales + o * groups, groups, group, res)       \
               : dot_rows_scaled(PACKED, R_, NO_, x, in, codes, o, scales + o * groups, groups, group, res))
#define DEFINE_OUTPUTS(NAME, PACKED_VALUE)                                                                         \
    static void NAME(int R, int NO, const float* x, int64_t in, const Codes* codes, const float* scales,            \
                     int64_t groups, int64_t group, int64_t o, float* res) {                                       \
        const int PACKED = PACKED_VALUE;                                                                           \
        if (NO == 4) { /* 1..4 rows */                                                                             \
            switch (R) { /* literal R and NO: dot_rows unrolls and keeps its accumulators in registers */          \
                case 4: DOT(4, 4); return;                                                                         \
                case 3: DOT(3, 4); return;                                                                         \
                case 2: DOT(2, 4); return;                                                                         \
                default: DOT(1, 4); return;                                                                        \
            }                                                                                                      \
        }                                                                                                          \
        if (NO == 2) { /* block() takes two outputs at a time only for 5..8 rows */                                \
            switch (R) {                                                                                           \
                case 8: DOT(8, 2); return;                                                                         \
                case 7: DOT(7, 2); return;                                                                         \
                case 6: DOT(6, 2); return;                                                                         \
                default: DOT(5, 2); return;                                                                        \
            }                                                                                                      \
        }                                                                                                          \
        switch (R) { /* one output: a block's last outputs when fewer than NO are left */                          \
            case 8: DOT(8, 1); return;                                                                             \
            case 7: DOT(7, 1); return;                                                                             \
            case 6: DOT(6, 1); return;                                                                             \
            case 5: DOT(5, 1); return;                                                                             \
            case 4: DOT(4, 1); return;                                                                             \
            case 3: DOT(3, 1); return;                                                                             \
            case 2: DOT(2, 1); return;                                                                             \
            default: DOT(1, 1); return;                                                                            \
        }                                                                                                          \
    }
DEFINE_OUTPUTS(outputs_int8, 0)
#if PACKED_CODES
DEFINE_OUTPUTS(outputs_packed, 1)
#endif
static void outputs(int R, int NO, const float* x, int64_t in, const Codes* codes, const float* scales,
                    int64_t groups, int64_t group, int64_t o, float* res) {
#if PACKED_CODES
    if (codes->nibbles != NULL) {
        outputs_packed(R, NO, x, in, codes, scales, groups, group, o, res);
        return;
    }
#endif
    outputs_int8(R, NO, x, in, codes, scales, groups, group, o, res);
}
#undef DEFINE_OUTPUTS
#undef DOT

/* Up to 16 float32 values -> bfloat16, rounded to nearest even (NaN kept a NaN), stored at y. */
static inline void store_bf16(uint16_t* y, const float* values, int count) {
    const __mmask16 mask = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
    const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, values));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm512_mask_cvtepi32_storeu_epi16(y, mask, rounded);
}

/* One block of outputs [first, last) for rows [r0, r0 + R): the products, the offsets' term, the stores. */
static void block(int R, const float* x, int dtype, int64_t r0, int64_t in, const Codes* codes, const float* scales,
                  const float* offsets, const float* xsum, int64_t groups, int64_t group, int64_t first, int64_t last,
                  int64_t out, void* y) {
    float res[OUT_BLOCK * ROW_TILE]; /* [output - first][row] */
    const int NO = R <= 4 ? 4 : 2;
    int64_t o = first;
    for (; o + NO <= last; o += NO) outputs(R, NO, x, in, codes, scales, groups, group, o, res + (o - first) * ROW_TILE);
    for (; o < last; ++o) outputs(R, 1, x, in, codes, scales, groups, group, o, res + (o - first) * ROW_TILE);
    if (offsets != NULL) {
        for (o = first; o < last; ++o) {
            const float* off = offsets + o * groups;
            for (int r = 0; r < R; ++r) {
                float term = 0.0f;
                for (int64_t g = 0; g < groups; ++g) term += off[g] * xsum[r * groups + g];
                res[(o - first) * ROW_TILE + r] -= term;
            }
        }
    }
    const int count = (int)(last - first);
    for (int r = 0; r < R; ++r) {
        float row[OUT_BLOCK];
        for (int i = 0; i < count; ++i) row[i] = res[i * ROW_TILE + r];
        if (dtype == DTYPE_FLOAT32)
            memcpy((float*)y + (r0 + r) * out + first, row, (size_t)count * sizeof(float));
        else
            store_bf16((uint16_t*)y + (r0 + r) * out + first, row, count);
    }
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* bfloat16 rows on AMX tiles (AMX_MIN_ROWS..AMX_MAX_ROWS rows, in a multiple of 32).

   Why: past a few rows the FMA loop above is bound by its instructions (one FMA per 16 weights per row); a tile
   product (TDPBF16PS) multiplies 16 weights' rows by 32 inputs for 16 rows at once. The weight is the A tile: 16
   outputs x 32 inputs, de-quantized for each step of 32 inputs into bf16, scale * code - offset rounded once (what
   a bf16 model holds for the same weight: transformers' bf16 model of the de-quantized checkpoint rounds it so too);
   x, transposed once per call into k-pairs, is the B tile; the C tile is 16 outputs x 16 rows in float32, summed
   over all inputs (k in order) and rounded to bf16 once. */
#define AMX_MIN_ROWS 12 /* fewer rows: the FMA loop is faster (4096 x 640, 4 rows: 0.14 vs 0.33 ms; AMX ~flat to 32 rows) */
#define AMX_MAX_ROWS 32
#include "amx.h"

static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette_id = 1;
    for (int t = 0; t < 5; ++t) { /* 0: A (16 outputs x 32 bf16); 1, 3: B (16 k-pairs x 16 rows x 2); 2, 4: C */
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* Outputs [o0, o0 + 16) (fewer at the end: the missing ones zero) for inputs [k0, k0 + 32) as bf16 into a[16][32]. */
static inline void weight_tile(const Codes* codes, const float* scales, const float* offsets, int64_t in,
                               int64_t groups, int64_t group, int64_t o0, int64_t count, int64_t k0, uint16_t* a) {
    (void)in;
    for (int64_t i = 0; i < 16; ++i) {
        if (i >= count) {
            memset(a + i * 32, 0, 64);
            continue;
        }
        const int64_t o = o0 + i;
        const int64_t g0 = k0 / group, g1 = (k0 + 16) / group;
        __m512 c0, c1;
        if (codes->nibbles != NULL)
            code_floats32(1, codes, o, k0, &c0, &c1);
        else
            code_floats32(0, codes, o, k0, &c0, &c1);
        __m512 w0 = _mm512_mul_ps(c0, _mm512_set1_ps(scales[o * groups + g0]));
        __m512 w1 = _mm512_mul_ps(c1, _mm512_set1_ps(scales[o * groups + g1]));
        if (offsets != NULL) {
            w0 = _mm512_sub_ps(w0, _mm512_set1_ps(offsets[o * groups + g0]));
            w1 = _mm512_sub_ps(w1, _mm512_set1_ps(offsets[o * groups + g1]));
        }
        _mm512_storeu_si512((void*)(a + i * 32), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
}

static int amx_grouped(const uint16_t* x, int64_t rows, int64_t in, const Codes* codes, int64_t out,
                       const float* scales, const float* offsets, int64_t group, uint16_t* y, int threads) {
    const int64_t groups = in / group, pairs = in / 2;
    /* x as B tiles: xt[k / 2][row][k % 2], rows padded to 32 with zeros (two B tiles of 16 rows) */
    uint32_t* xt = (uint32_t*)aligned_alloc(64, (size_t)pairs * 32 * 4);
    if (xt == NULL) return -2;
    memset(xt, 0, (size_t)pairs * 32 * 4);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t p = 0; p < pairs; ++p)
            xt[p * 32 + r] = (uint32_t)x[r * in + 2 * p] | ((uint32_t)x[r * in + 2 * p + 1] << 16);
    const int two = rows > 16;
    const int64_t blocks = (out + 15) / 16;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        configure_tiles();
        uint16_t a[16 * 32] __attribute__((aligned(64)));
        float c[2][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t o0 = b * 16, count = out - o0 < 16 ? out - o0 : 16;
            _tile_zero(2);
            _tile_zero(4);
            for (int64_t k0 = 0; k0 < in; k0 += 32) {
                weight_tile(codes, scales, offsets, in, groups, group, o0, count, k0, a);
                _tile_loadd(0, a, 64);
                _tile_loadd(1, xt + (k0 / 2) * 32, 128);
                _tile_dpbf16ps(2, 0, 1);
                if (two) {
                    _tile_loadd(3, xt + (k0 / 2) * 32 + 16, 128);
                    _tile_dpbf16ps(4, 0, 3);
                }
            }
            _tile_stored(2, c[0], 64);
            if (two) _tile_stored(4, c[1], 64);
            for (int64_t r = 0; r < rows; ++r) {
                const float* from = c[r >> 4] + (r & 15); /* c[half][output][row] */
                float row[16];
                for (int64_t i = 0; i < count; ++i) row[i] = from[i * 16];
                store_bf16(y + r * out + o0, row, (int)count);
            }
        }
        _tile_release();
    }
    free(xt);
    return 0;
}

static int amx_takes(int dtype, int64_t rows, int64_t in) {
    return dtype == DTYPE_BFLOAT16 && rows >= AMX_MIN_ROWS && rows <= AMX_MAX_ROWS && in % 32 == 0 && amx_permitted();
}
#else
static int amx_takes(int dtype, int64_t rows, int64_t in) {
    (void)dtype, (void)rows, (void)in;
    return 0;
}
static int amx_grouped(const uint16_t* x, int64_t rows, int64_t in, const Codes* codes, int64_t out,
                       const float* scales, const float* offsets, int64_t group, uint16_t* y, int threads) {
    (void)x, (void)rows, (void)in, (void)codes, (void)out, (void)scales, (void)offsets, (void)group, (void)y;
    (void)threads;
    return -1;
}
#endif

/* 16 weights into y (float32, or bfloat16 rounded once) at element `at`. */
static inline void store_weights(void* y, int dtype, int64_t at, __m512 w) {
    if (dtype == DTYPE_FLOAT32) {
        _mm512_storeu_ps((float*)y + at, w);
    } else {
        float values[16];
        _mm512_storeu_ps(values, w);
        store_bf16((uint16_t*)y + at, values, 16);
    }
}

/* x [rows, in] (dtype) times the weight of `codes`, scales / offsets [out, in / group] float32 (offsets may be NULL),
   into y [rows, out] (dtype). Returns 0, -1 for inputs it does not take, -2 without memory for its float32 copy of x. */
static int grouped_linear(const void* x, int dtype, int64_t rows, int64_t in, const Codes* codes, int64_t out,
                          const float* scales, const float* offsets, int64_t group, void* y, int threads) {
    if (rows < 1 || out < 1 || group < 16 || group % 16 != 0 || in < group || in % group != 0
        || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16))
        return -1;
    if (amx_takes(dtype, rows, in))
        return amx_grouped((const uint16_t*)x, rows, in, codes, out, scales, offsets, group, (uint16_t*)y, threads);
    const int64_t groups = in / group;
    float* xf = (float*)malloc((size_t)(rows * in) * sizeof(float));
    float* xsum = offsets != NULL ? (float*)malloc((size_t)(rows * groups) * sizeof(float)) : NULL;
    if (xf == NULL || (offsets != NULL && xsum == NULL)) {
        free(xf), free(xsum);
        return -2;
    }
    if (dtype == DTYPE_FLOAT32) {
        memcpy(xf, x, (size_t)(rows * in) * sizeof(float));
    } else {
        const uint16_t* xb = (const uint16_t*)x;
        for (int64_t i = 0; i < rows * in; ++i) {
            const uint32_t bits = (uint32_t)xb[i] << 16;
            memcpy(xf + i, &bits, 4);
        }
    }
    if (xsum != NULL) {
        for (int64_t i = 0; i < rows * groups; ++i) {
            float sum = 0.0f;
            for (int64_t k = 0; k < group; ++k) sum += xf[i * group + k];
            xsum[i] = sum;
        }
    }
    const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * OUT_BLOCK, last = first + OUT_BLOCK < out ? first + OUT_BLOCK : out;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int R = (int)(rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE);
            block(R, xf + r0 * in, dtype, r0, in, codes, scales, offsets, xsum ? xsum + r0 * groups : NULL, groups,
                  group, first, last, out, y);
        }
    }
    free(xf);
    free(xsum);
    return 0;
}

/* The whole weight, W[o, k] = scales * codes - offsets in float32 (the format's exact values: one product and one
   difference, rounded as the gguf package rounds them), written as float32 or bfloat16 (rounded once) into y
   [out, in]: prefill-sized products multiply it with torch's kernels. Returns 0, or -1 for inputs it does not
   take. */
static int grouped_dequantize(const Codes* codes, int64_t out, int64_t in, const float* scales, const float* offsets,
                              int64_t group, void* y, int dtype, int threads) {
    if (out < 1 || group < 16 || group % 16 != 0 || in < group || in % group != 0
        || (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16))
        return -1;
    const int64_t groups = in / group;
    const int packed = codes->nibbles != NULL, by32 = packed && group % 32 == 0; /* packed: one load per 32 */
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t o = 0; o < out; ++o) {
        for (int64_t g = 0; g < groups; ++g) {
            const __m512 s = _mm512_set1_ps(scales[o * groups + g]);
            const __m512 m = _mm512_set1_ps(offsets != NULL ? offsets[o * groups + g] : 0.0f);
            for (int64_t c = 0; by32 && c < group; c += 32) {
                const int64_t k = g * group + c;
                __m512 q0, q1;
                code_floats32(1, codes, o, k, &q0, &q1);
                __m512 w0 = _mm512_mul_ps(q0, s), w1 = _mm512_mul_ps(q1, s);
                if (offsets != NULL) w0 = _mm512_sub_ps(w0, m), w1 = _mm512_sub_ps(w1, m);
                store_weights(y, dtype, o * in + k, w0);
                store_weights(y, dtype, o * in + k + 16, w1);
            }
            for (int64_t c = 0; !by32 && c < group; c += 16) {
                const int64_t k = g * group + c;
                __m512 w = _mm512_mul_ps(packed ? code_floats(1, codes, o, k) : code_floats(0, codes, o, k), s);
                if (offsets != NULL) w = _mm512_sub_ps(w, m);
                store_weights(y, dtype, o * in + k, w);
            }
        }
    }
    return 0;
}

/* codes [out, in] int8. */
int tgi_vlm_grouped_int8_linear(const void* x, int dtype, int64_t rows, int64_t in, const int8_t* codes, int64_t out,
                                const float* scales, const float* offsets, int64_t group, void* y, int threads) {
    const Codes c = {codes, NULL, NULL, 0, in};
    return grouped_linear(x, dtype, rows, in, &c, out, scales, offsets, group, y, threads);
}

int tgi_vlm_grouped_int8_dequantize(const int8_t* codes, int64_t out, int64_t in, const float* scales,
                                    const float* offsets, int64_t group, void* y, int dtype, int threads) {
    const Codes c = {codes, NULL, NULL, 0, in};
    return grouped_dequantize(&c, out, in, scales, offsets, group, y, dtype, threads);
}

/* Whether this build reads packed codes (AVX512-BW and -VL: byte-wise masked adds). */
int tgi_vlm_grouped_packed_supported(void) { return PACKED_CODES; }

/* Packed codes (see the top of this file): nibbles [out, in / 2], high [out, in / 32] or NULL, in a multiple of 32,
   zero 0..16. Otherwise as tgi_vlm_grouped_int8_linear. */
int tgi_vlm_grouped_packed_linear(const void* x, int dtype, int64_t rows, int64_t in, const uint8_t* nibbles,
                                  const uint32_t* high, int zero, int64_t out, const float* scales,
                                  const float* offsets, int64_t group, void* y, int threads) {
    if (!PACKED_CODES || in % 32 != 0 || zero < 0 || zero > 16 || nibbles == NULL) return -1;
    const Codes c = {NULL, nibbles, high, zero, in};
    return grouped_linear(x, dtype, rows, in, &c, out, scales, offsets, group, y, threads);
}

int tgi_vlm_grouped_packed_dequantize(const uint8_t* nibbles, const uint32_t* high, int zero, int64_t out, int64_t in,
                                      const float* scales, const float* offsets, int64_t group, void* y, int dtype,
                                      int threads) {
    if (!PACKED_CODES || in % 32 != 0 || zero < 0 || zero > 16 || nibbles == NULL) return -1;
    const Codes c = {NULL, nibbles, high, zero, in};
    return grouped_dequantize(&c, out, in, scales, offsets, group, y, dtype, threads);
}
#else /* no AVX-512: not built into a library that loads (build.py), kept so the file always compiles */
int tgi_vlm_grouped_int8_linear(const void* x, int dtype, int64_t rows, int64_t in, const int8_t* codes, int64_t out,
                                const float* scales, const float* offsets, int64_t group, void* y, int threads) {
    (void)x, (void)dtype, (void)rows, (void)in, (void)codes, (void)out, (void)scales, (void)offsets, (void)group;
    (void)y, (void)threads;
    return -1;
}
int tgi_vlm_grouped_int8_dequantize(const int8_t* codes, int64_t out, int64_t in, const float* scales,
                                    const float* offsets, int64_t group, void* y, int dtype, int threads) {
    (void)codes, (void)out, (void)in, (void)scales, (void)offsets, (void)group, (void)y, (void)dtype, (void)threads;
    return -1;
}
int tgi_vlm_grouped_packed_supported(void) { return 0; }
int tgi_vlm_grouped_packed_linear(const void* x, int dtype, int64_t rows, int64_t in, const uint8_t* nibbles,
                                  const uint32_t* high, int zero, int64_t out, const float* scales,
                                  const float* offsets, int64_t group, void* y, int threads) {
    (void)x, (void)dtype, (void)rows, (void)in, (void)nibbles, (void)high, (void)zero, (void)out, (void)scales;
    (void)offsets, (void)group, (void)y, (void)threads;
    return -1;
}
int tgi_vlm_grouped_packed_dequantize(const uint8_t* nibbles, const uint32_t* high, int zero, int64_t out, int64_t in,
                                      const float* scales, const float* offsets, int64_t group, void* y, int dtype,
                                      int threads) {
    (void)nibbles, (void)high, (void)zero, (void)out, (void)in, (void)scales, (void)offsets, (void)group, (void)y;
    (void)dtype, (void)threads;
    return -1;
}
#endif
