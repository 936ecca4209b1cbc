/* Decode attention over the paged KV cache, for x86-64 CPUs with AVX-512 (the op tgi_vlm::decode_attention:
   tgi_vlm/kernels/cpu/ builds, loads and checks the inputs of this file; the torch backend is the reference it is
   tested against).

   One query token per sequence (B sequences), each attending to its cached positions [start, end), read straight
   from the paged cache through the sequence's slot list: no gathered copy, no padding to the longest sequence.
   Work items are sequences, shared out by OpenMP (the same libgomp torch loaded: one thread pool), when there are
   at least two per thread; else (sequence, kv head) pairs, so one long sequence still uses every thread. An item
   runs each kv head's G = Hq / Hkv query heads in groups of up to MAX_GROUP, each group reading each cached K and
   V row once. In a serving step the cache comes from memory, not from cache (the weights streamed through since
   the last layer): with whole sequences as items, the first group's pass prefetches whole slots (all heads,
   contiguous) while the sequence fits in L2, and the later heads find their rows there. Items of one
   (sequence, kv head), each prefetching only its own 128-byte rows of 512-byte slots, ran 25% slower with a cold
   cache (13 sequences, 2 threads).

   Per group: scores for 16 positions at a time (a dot product per position and head, then one transposing add
   tree for the 16 sums), the softmax in float (max, exp, sum), then the weighted sum of V rows in float,
   normalized and rounded to the output dtype once. bfloat16 rows are widened by shift/mask: a 32-element chunk
   becomes its even and its odd elements as floats, multiplied with float FMAs (on the cores measured,
   VDPBF16PS ran at half the FMA rate with twice its latency) and, for V, summed separately and interleaved
   back at the end. So products and sums are float32 in both dtypes.

   Built with -ffast-math (the vector expf of glibc's libmvec needs it): no code here relies on infinities or
   NaNs; -FLT_MAX stands for "no score". */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ABI_VERSION 1
#define DTYPE_FLOAT32 1
#define DTYPE_BFLOAT16 2
#define MAX_HEAD_DIM 256
#define PREFETCH_AHEAD 8 /* positions; cached rows are 16-slot runs of a block in a random place */

int tgi_vlm_abi_version(void) { return ABI_VERSION; }

#if defined(__AVX512F__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* out[i] = sum of the 16 lanes of v[i]: four levels of two-source permutes, each halving the lanes per vector. */
ALWAYS_INLINE __m512 sum_lanes_16(const __m512* v) {
    const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i hi3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i hi4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)  /* a[i]: lanes 0-7 hold v[2i]'s pair sums, lanes 8-15 v[2i+1]'s */
        a[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], lo1, v[2 * i + 1]),
                             _mm512_permutex2var_ps(v[2 * i], hi1, v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  /* b[i]: four lanes for each of v[4i .. 4i+3] */
        b[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], lo2, a[2 * i + 1]),
                             _mm512_permutex2var_ps(a[2 * i], hi2, a[2 * i + 1]));
    for (int i = 0; i < 2; ++i)  /* c[i]: two lanes for each of v[8i .. 8i+7] */
        c[i] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * i], lo3, b[2 * i + 1]),
                             _mm512_permutex2var_ps(b[2 * i], hi3, b[2 * i + 1]));
    return _mm512_add_ps(_mm512_permutex2var_ps(c[0], lo4, c[1]), _mm512_permutex2var_ps(c[0], hi4, c[1]));
}

/* Every cache line of one head's row (`bytes` from p): the rows of a sequence are 16-slot runs in blocks anywhere
   in the cache, and only this head's part of each slot is read, so the hardware prefetchers see short strided runs. */
ALWAYS_INLINE void prefetch_row(const void* p, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char*)p + offset, _MM_HINT_T0);
}

/* Each float rounded to bfloat16 (nearest, ties to even, as torch rounds), in the low 16 bits of its 32-bit lane.
   Integer arithmetic, so AVX-512F is enough; values are finite here. */
ALWAYS_INLINE __m512i bf16_bits(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}

/* scores[0, n) (already scaled) -> exp(score - max) in place; returns their sum. */
ALWAYS_INLINE float softmax_numerators(float* scores, int64_t n, float max) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
        scores[i] = expf(scores[i] - max);
        sum += scores[i];
    }
    return sum;
}

/* Scores of GN query heads against positions [blk, blk + 16) (m of them real), scaled, into scores[g * stride + ..]:
   LOAD_ROW(kp) reads position i's K row once, DOT(g) gives query head g's 16 partial sums for it. Keeps vmax[g]. */
#define SCORE_BLOCKS(LOAD_ROW, DOT)                                                                                  \
    for (int64_t blk = 0; blk < n; blk += 16) {                                                                      \
        const int64_t m = n - blk < 16 ? n - blk : 16;                                                               \
        for (int64_t i = 0; i < m; ++i) {                                                                            \
            if (blk + i + PREFETCH_AHEAD < n)                                                                        \
                prefetch_row(pf_k + slots[blk + i + PREFETCH_AHEAD] * slot_stride * (int64_t)sizeof(*kh), pf_bytes); \
            LOAD_ROW(kh + slots[blk + i] * slot_stride);                                                             \
            for (int g = 0; g < GN; ++g) part[g * 16 + i] = DOT(g);                                                  \
        }                                                                                                            \
        for (int g = 0; g < GN; ++g) {                                                                               \
            for (int64_t i = m; i < 16; ++i) part[g * 16 + i] = _mm512_setzero_ps();                                 \
            __m512 r = _mm512_mul_ps(sum_lanes_16(part + g * 16), _mm512_set1_ps(scale));                            \
            r = _mm512_mask_blend_ps((__mmask16)((1u << m) - 1), _mm512_set1_ps(-FLT_MAX), r);                       \
            vmax[g] = _mm512_max_ps(vmax[g], r);                                                                     \
            _mm512_storeu_ps(scores + g * stride + blk, r);                                                          \
        }                                                                                                            \
    }

/* A group of GN query heads that share one kv head, over n cached positions: each K and V row is read once for
   the group, and the group's accumulators are independent chains (the weighted V sum is latency-bound with
   fewer). DC chunks per head; GN * DC accumulators (times two for bf16's even/odd halves) must fit in
   registers: the dispatch below picks GN for DC. `stride`: scores per query head in `scores`. */
#define MAX_GROUP 4

/* ---- float32: chunks of 16 elements (one cache line); DC = D / 16 ---- */
#define LOAD_F32(kp) for (int c = 0; c < DC; ++c) kv[c] = _mm512_loadu_ps((kp) + 16 * c)
#define DOT_F32(g) ({                                                                                                \
        __m512 s_ = _mm512_mul_ps(qv[g][0], kv[0]);                                                                  \
        for (int c = 1; c < DC; ++c) s_ = _mm512_fmadd_ps(qv[g][c], kv[c], s_);                                      \
        s_; })
#define GROUP_F32_BODY                                                                                               \
    __m512 qv[GN][DC], kv[DC], vmax[GN];                                                                             \
    for (int g = 0; g < GN; ++g) {                                                                                   \
        vmax[g] = _mm512_set1_ps(-FLT_MAX);                                                                          \
        for (int c = 0; c < DC; ++c) qv[g][c] = _mm512_loadu_ps(qs[g] + 16 * c);                                     \
    }                                                                                                                \
    SCORE_BLOCKS(LOAD_F32, DOT_F32)                                                                                  \
    float inv[GN];                                                                                                   \
    for (int g = 0; g < GN; ++g)                                                                                     \
        inv[g] = 1.f / softmax_numerators(scores + g * stride, n, _mm512_reduce_max_ps(vmax[g]));                    \
    __m512 acc[GN][DC];                                                                                              \
    for (int g = 0; g < GN; ++g)                                                                                     \
        for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();                                                \
    for (int64_t i = 0; i < n; ++i) {                                                                                \
        if (i + PREFETCH_AHEAD < n)                                                                                  \
            prefetch_row(pf_v + slots[i + PREFETCH_AHEAD] * slot_stride * (int64_t)sizeof(*vh), pf_bytes);           \
        const float* vp = vh + slots[i] * slot_stride;                                                               \
        for (int c = 0; c < DC; ++c) {                                                                               \
            const __m512 x = _mm512_loadu_ps(vp + 16 * c);                                                           \
            for (int g = 0; g < GN; ++g)                                                                             \
                acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * stride + i]), x, acc[g][c]);                   \
        }                                                                                                            \
    }                                                                                                                \
    for (int g = 0; g < GN; ++g)                                                                                     \
        for (int c = 0; c < DC; ++c) _mm512_storeu_ps(os[g] + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g]))); \


/* ---- bfloat16: chunks of 32 elements (the last one may hold 16: D % 32 == 16); DC = ceil(D / 32) ---- */
/* Chunk c of a bf16 row: 32 elements, or 16 (zero-extended) when it is the last and `half_last`. Plain loads, not
   masked ones: GCC keeps an accumulator array in registers across a loop only when the loop's loads are ordinary
   memory reads (with the masked-load builtin it stores the whole array back every iteration). */
#define LOAD_CHUNK(p, c) ((half_last && (c) == DC - 1) ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(p))) \
                                                      : _mm512_loadu_si512(p))
#define LOAD_BF16(kp) for (int c = 0; c < DC; ++c) {                                                                 \
        const __m512i x_ = LOAD_CHUNK((kp) + 32 * c, c);                                                             \
        ke[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x_, 16));                                                      \
        ko[c] = _mm512_castsi512_ps(_mm512_and_si512(x_, high));                                                     \
    }
#define DOT_BF16(g) ({                                                                                               \
        __m512 s_ = _mm512_mul_ps(qe[g][0], ke[0]);                                                                  \
        s_ = _mm512_fmadd_ps(qo[g][0], ko[0], s_);                                                                   \
        for (int c = 1; c < DC; ++c) {                                                                               \
            s_ = _mm512_fmadd_ps(qe[g][c], ke[c], s_);                                                               \
            s_ = _mm512_fmadd_ps(qo[g][c], ko[c], s_);                                                               \
        }                                                                                                            \
        s_; })
#define GROUP_BF16_BODY                                                                                              \
    /* q widened to float once, as its even and odd elements; each K chunk split the same way: products in           \
       float FMAs (on these cores VDPBF16PS runs at half the FMA rate, with twice the latency) */                    \
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);                                                        \
    __m512 qe[GN][DC], qo[GN][DC], ke[DC], ko[DC];                                                                   \
    __m512 vmax[GN];                                                                                                 \
    for (int g = 0; g < GN; ++g) {                                                                                   \
        vmax[g] = _mm512_set1_ps(-FLT_MAX);                                                                          \
        for (int c = 0; c < DC; ++c) {                                                                               \
            const __m512i x = LOAD_CHUNK(qs[g] + 32 * c, c);                                                         \
            qe[g][c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));                                                \
            qo[g][c] = _mm512_castsi512_ps(_mm512_and_si512(x, high));                                               \
        }                                                                                                            \
    }                                                                                                                \
    SCORE_BLOCKS(LOAD_BF16, DOT_BF16)                                                                                \
    float inv[GN];                                                                                                   \
    for (int g = 0; g < GN; ++g)                                                                                     \
        inv[g] = 1.f / softmax_numerators(scores + g * stride, n, _mm512_reduce_max_ps(vmax[g]));                    \
    __m512 ev[GN][DC], od[GN][DC];  /* even / odd elements */                                                        \
    for (int g = 0; g < GN; ++g)                                                                                     \
        for (int c = 0; c < DC; ++c) ev[g][c] = od[g][c] = _mm512_setzero_ps();                                      \
    for (int64_t i = 0; i < n; ++i) {                                                                                \
        if (i + PREFETCH_AHEAD < n)                                                                                  \
            prefetch_row(pf_v + slots[i + PREFETCH_AHEAD] * slot_stride * (int64_t)sizeof(*vh), pf_bytes);           \
        const uint16_t* vp = vh + slots[i] * slot_stride;                                                            \
        for (int c = 0; c < DC; ++c) {                                                                               \
            const __m512i x = LOAD_CHUNK(vp + 32 * c, c);                                                            \
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));                                       \
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, high));                                       \
            for (int g = 0; g < GN; ++g) {                                                                           \
                const __m512 w = _mm512_set1_ps(scores[g * stride + i]);                                             \
                ev[g][c] = _mm512_fmadd_ps(w, even, ev[g][c]);                                                       \
                od[g][c] = _mm512_fmadd_ps(w, odd, od[g][c]);                                                        \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
    for (int g = 0; g < GN; ++g)                                                                                     \
        for (int c = 0; c < DC; ++c) {                                                                               \
            /* round each half to bf16 and put odd above even */                                                     \
            const __m512 scale_back = _mm512_set1_ps(inv[g]);                                                        \
            const __m512i eb = bf16_bits(_mm512_mul_ps(ev[g][c], scale_back));                                       \
            const __m512i ob = bf16_bits(_mm512_mul_ps(od[g][c], scale_back));                                       \
            const __m512i both = _mm512_or_si512(eb, _mm512_slli_epi32(ob, 16));                                     \
            if (half_last && c == DC - 1) _mm256_storeu_si256((__m256i*)(os[g] + 32 * c), _mm512_castsi512_si256(both)); \
            else _mm512_storeu_si512(os[g] + 32 * c, both);                                                          \
        }                                                                                                            \


/* Specializations: (chunks per head, group size) as constants, so the loops unroll and the accumulator arrays
   become registers (with sizes that are not constants they stay on the stack, and the weighted V sum waits on
   store-to-load forwarding: 2-3x slower); the `_any` variants take other head sizes one query head at a time. */
#define GROUP_F32_PARAMS const float* const* qs, float* const* os, const float* kh, const float* vh, int64_t slot_stride, \
    const int64_t* slots, int64_t n, float scale, __m512* part, float* scores, int64_t stride,                       \
    const char* pf_k, const char* pf_v, int64_t pf_bytes
#define GROUP_F32(DC_, GN_)                                                                                          \
    static void group_f32_##DC_##_##GN_(GROUP_F32_PARAMS) { enum { DC = DC_, GN = GN_ }; GROUP_F32_BODY }
GROUP_F32(4, 1) GROUP_F32(4, 2) GROUP_F32(4, 3) GROUP_F32(4, 4)
GROUP_F32(8, 1) GROUP_F32(8, 2)
GROUP_F32(16, 1)
static void group_f32_any(const int DC, GROUP_F32_PARAMS) { enum { GN = 1 }; GROUP_F32_BODY }

/* Query heads [j, j + count) of one kv head; count <= MAX_GROUP. Returns how many were done. */
static int run_group_f32(int64_t D, int count, const float* const* qs, float* const* os, const float* kh, const float* vh,
                         int64_t ss, const int64_t* sl, int64_t n, float sc, __m512* p, float* s, int64_t st,
                         const char* pk, const char* pv, int64_t pb) {
    if (D == 64) {
        switch (count) {
            case 1: group_f32_4_1(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 1;
            case 2: group_f32_4_2(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 2;
            case 3: group_f32_4_3(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 3;
            default: group_f32_4_4(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 4;
        }
    }
    if (D == 128) {
        if (count >= 2) { group_f32_8_2(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 2; }
        group_f32_8_1(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb);
        return 1;
    }
    if (D == 256) { group_f32_16_1(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 1; }
    group_f32_any((int)(D / 16), qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb);
    return 1;
}

#define GROUP_BF16_PARAMS const uint16_t* const* qs, uint16_t* const* os, const uint16_t* kh, const uint16_t* vh,    \
    int64_t slot_stride, const int64_t* slots, int64_t n, float scale, __m512* part, float* scores, int64_t stride,  \
    const char* pf_k, const char* pf_v, int64_t pf_bytes
#define GROUP_BF16(DC_, GN_)                                                                                         \
    static void group_bf16_##DC_##_##GN_(GROUP_BF16_PARAMS) { enum { DC = DC_, GN = GN_, half_last = 0 };            \
                                                              GROUP_BF16_BODY }
GROUP_BF16(2, 1) GROUP_BF16(2, 2) GROUP_BF16(2, 3) GROUP_BF16(2, 4)
GROUP_BF16(4, 1) GROUP_BF16(4, 2)
GROUP_BF16(8, 1)
static void group_bf16_any(const int DC, const int half_last, GROUP_BF16_PARAMS) { enum { GN = 1 }; GROUP_BF16_BODY }

static int run_group_bf16(int64_t D, int count, const uint16_t* const* qs, uint16_t* const* os, const uint16_t* kh,
                          const uint16_t* vh, int64_t ss, const int64_t* sl, int64_t n, float sc, __m512* p, float* s,
                          int64_t st, const char* pk, const char* pv, int64_t pb) {
    if (D == 64) {
        switch (count) {
            case 1: group_bf16_2_1(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 1;
            case 2: group_bf16_2_2(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 2;
            case 3: group_bf16_2_3(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 3;
            default: group_bf16_2_4(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 4;
        }
    }
    if (D == 128) {
        if (count >= 2) { group_bf16_4_2(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 2; }
        group_bf16_4_1(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb);
        return 1;
    }
    if (D == 256) { group_bf16_8_1(qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb); return 1; }
    group_bf16_any((int)((D + 31) / 32), D % 32 != 0, qs, os, kh, vh, ss, sl, n, sc, p, s, st, pk, pv, pb);
    return 1;
}
#endif /* __AVX512F__ */

/* Which dtypes this build computes (DTYPE_* bits): none without AVX-512. */
int tgi_vlm_decode_attention_dtypes(void) {
    int dtypes = 0;
#if defined(__AVX512F__)
    dtypes |= DTYPE_FLOAT32 | DTYPE_BFLOAT16;
#endif
    return dtypes;
}

/* q: query rows (row stride, head stride; elements contiguous). k_cache / v_cache: [slots, Hkv, D] contiguous.
   slot_index: [B, width] int64, the cache slot of each position of each sequence; rows[b]: the query/output row
   of sequence b; positions [starts[b], ends[b]) are attended. Strides are in elements. Returns 0; -1 when
   the dtype or head size is not supported by this build (nothing written); -2 when a thread's scratch memory
   could not be allocated (its items are not written). */
int tgi_vlm_decode_attention(int dtype, const void* q, int64_t q_row_stride, int64_t q_head_stride,
                             const void* k_cache, const void* v_cache, const int64_t* slot_index, int64_t width,
                             const int64_t* rows, const int64_t* starts, const int64_t* ends, void* out,
                             int64_t out_row_stride, int64_t out_head_stride, int64_t B, int64_t Hq,
                             int64_t Hkv, int64_t D, float scale, int num_threads) {
    if (!(tgi_vlm_decode_attention_dtypes() & dtype) || D % 16 != 0 || D > MAX_HEAD_DIM || D <= 0 || Hkv <= 0
        || Hq % Hkv != 0)
        return -1;
#if defined(__AVX512F__)
    const int64_t G = Hq / Hkv, slot_stride = Hkv * D, padded_width = (width + 15) / 16 * 16 + 16;
    const size_t esize = dtype == DTYPE_FLOAT32 ? 4 : 2;
    /* Items: whole sequences when there are enough of them to keep every thread busy (then the first kv head's
       pass can prefetch whole slots for the others), else (sequence, kv head) pairs. */
    const int per_sequence = B >= 2 * (int64_t)num_threads;
    const int64_t items = per_sequence ? B : B * Hkv, heads_per_item = per_sequence ? Hkv : 1;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        __m512* part = aligned_alloc(64, sizeof(__m512) * 16 * MAX_GROUP);
        float* scores = aligned_alloc(64, sizeof(float) * padded_width * MAX_GROUP);
        if (part == NULL || scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            if (part == NULL || scores == NULL) continue;  /* reported as -2: nothing else is left unwritten */
            const int64_t b = per_sequence ? item : item / Hkv;
            const int64_t n = ends[b] - starts[b];
            const int64_t* slots = slot_index + b * width + starts[b];
            if (n <= 0) {  /* nothing visible (not produced by the engine: kv_len >= 1): zeros, not 0/0 */
                for (int64_t j = 0; j < (per_sequence ? Hq : G); ++j) {
                    char* o = (char*)out + (rows[b] * out_row_stride + ((per_sequence ? 0 : (item % Hkv) * G) + j)
                                            * out_head_stride) * esize;
                    memset(o, 0, D * esize);
                }
                continue;
            }
            /* whole-slot prefetch (every head's row of a slot, contiguous) while the sequence's K and V fit in
               this core's L2 (~2 MB here; half of it, to leave room), else each pass its own rows */
            const int whole_slots = per_sequence && 2 * n * slot_stride * (int64_t)esize <= (1 << 20);
            for (int64_t h = per_sequence ? 0 : item % Hkv, last = h + heads_per_item; h < last; ++h) {
                for (int64_t j = h * G; j < (h + 1) * G;) {
                    const int count = (int)((h + 1) * G - j < MAX_GROUP ? (h + 1) * G - j : MAX_GROUP);
                    const int prefetch_whole = whole_slots && h == 0 && j == 0;  /* once, by the first group */
                    const char* pk = (const char*)k_cache + (prefetch_whole ? 0 : h * D * esize);
                    const char* pv = (const char*)v_cache + (prefetch_whole ? 0 : h * D * esize);
                    const int64_t pb = (prefetch_whole ? slot_stride : D) * (int64_t)esize;
                    const void* qs[MAX_GROUP];
                    void* os[MAX_GROUP];
                    for (int g = 0; g < count; ++g) {
                        qs[g] = (const char*)q + (rows[b] * q_row_stride + (j + g) * q_head_stride) * esize;
                        os[g] = (char*)out + (rows[b] * out_row_stride + (j + g) * out_head_stride) * esize;
                    }
                    if (dtype == DTYPE_FLOAT32)
                        j += run_group_f32(D, count, (const float* const*)qs, (float* const*)os,
                                           (const float*)k_cache + h * D, (const float*)v_cache + h * D, slot_stride,
                                           slots, n, scale, part, scores, padded_width, pk, pv, pb);
                    else
                        j += run_group_bf16(D, count, (const uint16_t* const*)qs, (uint16_t* const*)os,
                                            (const uint16_t*)k_cache + h * D, (const uint16_t*)v_cache + h * D,
                                            slot_stride, slots, n, scale, part, scores, padded_width, pk, pv, pb);
                }
            }
        }
        free(part);
        free(scores);
    }
    if (failed) return -2;
    return 0;
#else
    (void)q; (void)q_row_stride; (void)q_head_stride; (void)k_cache; (void)v_cache; (void)slot_index; (void)width;
    (void)rows; (void)starts; (void)ends; (void)out; (void)out_row_stride; (void)out_head_stride; (void)B;
    (void)scale; (void)num_threads;
    return -1;
#endif
}
