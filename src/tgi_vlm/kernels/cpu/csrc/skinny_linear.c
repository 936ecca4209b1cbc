/* Float32 linear layers for few rows (decode batches) on x86-64 CPUs with AVX-512: y = x W^T + b for up to MAX_ROWS
   rows (the op tgi_vlm::skinny_linear; tgi_vlm/kernels/cpu/ops.py lays the weight out and checks the inputs;
   F.linear is the reference it is tested against).

   Why: a decode step multiplies a handful of rows by every weight once, so its speed is how fast the weights stream
   from memory. On the 2-core host measured, MKL's packed kernel streams the bench model's float32 decode weights at
   ~13-15 GB/s for 13 rows (oneDNN's alike), this loop at ~21-23 GB/s (~23-27 GB/s for one row): it has no work
   besides the products and prefetches the weights ahead of them (benchmarks/skinny_linear.py).

   Weight layout (made once, `ops.blocked_weight`): columns in blocks of 16, each block k-major
   ([N/16][K][16]), so one 64-byte load is 16 columns' weights for one k. N is padded to a multiple of 32 with zero
   columns.

   Work: pairs of column blocks (32 outputs), shared out by OpenMP over the thread pool torch uses. For a pair and a
   tile of up to ROW_TILE rows (rows split into equal tiles), 2 x ROW_TILE accumulators stay in registers over a
   chunk of K_CHUNK k: per k, two weight vectors times each row's x[k], broadcast, with FMAs. x is transposed once
   per call to xt[K][rows], so a k step reads consecutive floats. Sums are float32 in k order within a chunk, the
   chunks' sums added in order: not MKL's order, within float32 rounding of it (~1e-6 of the sum of the terms'
   magnitudes; the accuracy test holds each output to the worst-case bound of this order and the typical error to
   3x MKL's own against float64). Bias is added last. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_ROWS 32
#define ROW_TILE 14   /* 2 x 14 accumulators + 2 weight vectors + 1 broadcast = 31 of the 32 vector registers */
#define K_CHUNK 256   /* partial sums per chunk: rounding error grows with the chunk, not with K */
#define PREFETCH_K 64 /* k steps ahead (4 KB per block); without it the loop ran ~1.3x slower at 13 rows (ad hoc) */

#if defined(__AVX512F__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE __mmask16 columns_left(int64_t n, int64_t col) {
    int64_t left = n - col;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

/* Blocks w0, w1 (16 columns each, k-major) over kc steps, times R rows of xt (row stride `stride` floats per k). */
ALWAYS_INLINE void tile(const int R, const float* xt, int64_t stride, const float* w0, const float* w1, int64_t kc,
                        __m512* part0, __m512* part1) {
    __m512 a0[ROW_TILE], a1[ROW_TILE];
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kc; ++i) {
        _mm_prefetch((const char*)(w0 + (i + PREFETCH_K) * 16), _MM_HINT_T0);
        _mm_prefetch((const char*)(w1 + (i + PREFETCH_K) * 16), _MM_HINT_T0);
        __m512 v0 = _mm512_load_ps(w0 + i * 16), v1 = _mm512_load_ps(w1 + i * 16);
        const float* xk = xt + i * stride;
#pragma GCC unroll 14
        for (int r = 0; r < R; ++r) {
            __m512 b = _mm512_set1_ps(xk[r]);
            a0[r] = _mm512_fmadd_ps(v0, b, a0[r]);
            a1[r] = _mm512_fmadd_ps(v1, b, a1[r]);
        }
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
        part0[r] = a0[r];
        part1[r] = a1[r];
    }
}

/* `tile` with R a compile-time constant in each case, so its accumulators are registers. */
ALWAYS_INLINE void tile_rows(int R, const float* xt, int64_t stride, const float* w0, const float* w1, int64_t kc,
                             __m512* part0, __m512* part1) {
    switch (R) {
#define CASE(n) \
    case n: tile(n, xt, stride, w0, w1, kc, part0, part1); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13)
        CASE(14)
#undef CASE
    }
}

/* Output columns [32 pair, 32 pair + 32) for every row. */
static void pair_of_blocks(const float* xt, int64_t rows, int64_t k, const float* w, int64_t n, int64_t pair,
                           const float* bias, float* y) {
    const float* w0 = w + (size_t)(2 * pair) * (size_t)k * 16;
    const float* w1 = w0 + (size_t)k * 16;
    const int64_t col = pair * 32;
    const __mmask16 mask0 = columns_left(n, col), mask1 = columns_left(n, col + 16);
    const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(mask0, bias + col) : _mm512_setzero_ps();
    const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(mask1, bias + col + 16) : _mm512_setzero_ps();
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE, per_tile = (rows + tiles - 1) / tiles;
    for (int64_t r0 = 0; r0 < rows; r0 += per_tile) {
        const int R = (int)(rows - r0 < per_tile ? rows - r0 : per_tile);
        __m512 acc0[ROW_TILE], acc1[ROW_TILE], part0[ROW_TILE], part1[ROW_TILE];
        for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < k; k0 += K_CHUNK) {
            const int64_t kc = k - k0 < K_CHUNK ? k - k0 : K_CHUNK;
            tile_rows(R, xt + k0 * rows + r0, rows, w0 + k0 * 16, w1 + k0 * 16, kc, part0, part1);
            for (int r = 0; r < R; ++r) {
                acc0[r] = _mm512_add_ps(acc0[r], part0[r]);
                acc1[r] = _mm512_add_ps(acc1[r], part1[r]);
            }
        }
        for (int r = 0; r < R; ++r) {
            float* yr = y + (size_t)(r0 + r) * (size_t)n;
            _mm512_mask_storeu_ps(yr + col, mask0, _mm512_add_ps(acc0[r], bias0));
            _mm512_mask_storeu_ps(yr + col + 16, mask1, _mm512_add_ps(acc1[r], bias1));
        }
    }
}

/* y[rows][n] = x[rows][k] W^T (+ bias[n]), float32; x, y row-major and contiguous; w in the blocked layout above
   (n padded to a multiple of 32, 64-byte aligned), on `threads` OpenMP threads. Returns 0; -1 for rows outside 1..MAX_ROWS or an empty k or n;
   -2 when memory for xt cannot be had. */
int tgi_vlm_skinny_linear(const float* x, int64_t rows, int64_t k, const float* w, int64_t n, const float* bias,
                          float* y, int threads) {
    if (rows < 1 || rows > MAX_ROWS || k < 1 || n < 1) return -1;
    float* xt = (float*)aligned_alloc(64, ((size_t)(k * rows) * 4 + 63) / 64 * 64);
    if (xt == NULL) return -2;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < k; ++i) xt[i * rows + r] = x[r * k + i];
    const int64_t pairs = (n + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t p = 0; p < pairs; ++p) pair_of_blocks(xt, rows, k, w, n, p, bias, y);
    free(xt);
    return 0;
}

int tgi_vlm_skinny_max_rows(void) { return MAX_ROWS; }

#if defined(__AVX512BF16__)
/* bfloat16 linears for few rows, on CPUs with AVX512-BF16 (the op tgi_vlm::skinny_linear_bf16).

   Why: a bf16 decode step of Gemma 3 270M streamed its decoder weights through oneDNN's packed kernel at ~12 GB/s
   and its tied 262k-row lm-head at ~21 GB/s, where the host reads ~26 GB/s (benchmarks/results/cpu-profile.md).

   Layout (`ops.blocked_weight_bf16`): columns in blocks of 16, each block k-pair-major ([N/16][K/2][16][2]): one
   64-byte load is 16 columns' weights for two consecutive k, what one VDPBF16PS multiplies by a broadcast pair
   (x[k], x[k+1]). N is padded to a multiple of 32 and K to an even count with zeros.

   Sums: each VDPBF16PS adds the two exact products of a pair to the float32 accumulator (round to nearest even;
   the instruction treats bf16 denormals as zero and flushes denormal results), pairs in k order within a chunk of
   K_CHUNK k, chunks added in order; the bias (bf16, widened) is added last and the float32 result rounded to bf16
   once, as oneDNN's bf16 product rounds it. Not oneDNN's summation order: outputs may differ from it by an ulp of
   bf16 (tests/unit/test_skinny_linear_bf16.py holds them to float64's within the bound of float32 sums). */
ALWAYS_INLINE void tile_bf16(const int R, const uint32_t* xt, int64_t stride, const uint16_t* w0, const uint16_t* w1,
                             int64_t pairs, __m512* part0, __m512* part1) {
    __m512 a0[ROW_TILE], a1[ROW_TILE];
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
        _mm_prefetch((const char*)(w0 + (i + PREFETCH_K) * 32), _MM_HINT_T0);
        _mm_prefetch((const char*)(w1 + (i + PREFETCH_K) * 32), _MM_HINT_T0);
        __m512bh v0 = (__m512bh)_mm512_load_si512((const void*)(w0 + i * 32));
        __m512bh v1 = (__m512bh)_mm512_load_si512((const void*)(w1 + i * 32));
        const uint32_t* xk = xt + i * stride;
#pragma GCC unroll 14
        for (int r = 0; r < R; ++r) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)xk[r]);
            a0[r] = _mm512_dpbf16_ps(a0[r], v0, b);
            a1[r] = _mm512_dpbf16_ps(a1[r], v1, b);
        }
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
        part0[r] = a0[r];
        part1[r] = a1[r];
    }
}

ALWAYS_INLINE void tile_rows_bf16(int R, const uint32_t* xt, int64_t stride, const uint16_t* w0, const uint16_t* w1,
                                  int64_t pairs, __m512* part0, __m512* part1) {
    switch (R) {
#define CASE(n) \
    case n: tile_bf16(n, xt, stride, w0, w1, pairs, part0, part1); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13)
        CASE(14)
#undef CASE
    }
}

ALWAYS_INLINE __m512 bias_bf16(const uint16_t* bias, __mmask16 mask, int64_t col) {
    if (!bias) return _mm512_setzero_ps();
    __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + col);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Output columns [32 pair, 32 pair + 32) for every row; k2 = K / 2 (K padded even). */
static void pair_of_blocks_bf16(const uint32_t* xt, int64_t rows, int64_t k2, const uint16_t* w, int64_t n,
                                int64_t pair, const uint16_t* bias, uint16_t* y) {
    const uint16_t* w0 = w + (size_t)(2 * pair) * (size_t)k2 * 32;
    const uint16_t* w1 = w0 + (size_t)k2 * 32;
    const int64_t col = pair * 32;
    const __mmask16 mask0 = columns_left(n, col), mask1 = columns_left(n, col + 16);
    const __m512 b0 = bias_bf16(bias, mask0, col), b1 = bias_bf16(bias, mask1, col + 16);
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE, per_tile = (rows + tiles - 1) / tiles;
    const int64_t chunk = K_CHUNK / 2;
    for (int64_t r0 = 0; r0 < rows; r0 += per_tile) {
        const int R = (int)(rows - r0 < per_tile ? rows - r0 : per_tile);
        __m512 acc0[ROW_TILE], acc1[ROW_TILE], part0[ROW_TILE], part1[ROW_TILE];
        for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
        for (int64_t p0 = 0; p0 < k2; p0 += chunk) {
            const int64_t pc = k2 - p0 < chunk ? k2 - p0 : chunk;
            tile_rows_bf16(R, xt + p0 * rows + r0, rows, w0 + p0 * 32, w1 + p0 * 32, pc, part0, part1);
            for (int r = 0; r < R; ++r) {
                acc0[r] = _mm512_add_ps(acc0[r], part0[r]);
                acc1[r] = _mm512_add_ps(acc1[r], part1[r]);
            }
        }
        for (int r = 0; r < R; ++r) {
            uint16_t* yr = y + (size_t)(r0 + r) * (size_t)n;
            _mm256_mask_storeu_epi16(yr + col, mask0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc0[r], b0)));
            _mm256_mask_storeu_epi16(yr + col + 16, mask1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc1[r], b1)));
        }
    }
}

/* The VDPBF16PS loop over every row (1..MAX_ROWS, checked by the caller). */
static int vnni_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n,
                            const uint16_t* bias, uint16_t* y, int threads) {
    const int64_t k2 = (k + 1) / 2;
    uint32_t* xt = (uint32_t*)aligned_alloc(64, ((size_t)(k2 * rows) * 4 + 63) / 64 * 64);
    if (xt == NULL) return -2;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < k2; ++i) {
            const uint32_t lo = x[r * k + 2 * i], hi = 2 * i + 1 < k ? x[r * k + 2 * i + 1] : 0;
            xt[i * rows + r] = lo | (hi << 16);
        }
    const int64_t pairs = (n + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t p = 0; p < pairs; ++p) pair_of_blocks_bf16(xt, rows, k2, w, n, p, bias, y);
    free(xt);
    return 0;
}

int tgi_vlm_skinny_bf16_max_rows(void) { return MAX_ROWS; }

static int amx_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n,
                           const uint16_t* bias, uint16_t* y, int threads);
static int amx_takes(int64_t rows, int64_t k);

/* y[rows][n] = x[rows][k] W^T (+ bias[n]), bfloat16 in and out; x, y row-major and contiguous; w in the blocked
   layout above (k padded to even, n to a multiple of 32, 64-byte aligned), on `threads` OpenMP threads. With `amx`
   and where the AMX tiles take the product (an AMX CPU, 1..AMX_MAX_ROWS rows, k a multiple of 32): the tile kernel
   below, else the VDPBF16PS loop (1..MAX_ROWS rows). Returns 0; -1 for a row count neither takes or an empty k or n;
   -2 when memory for a scratch copy of x cannot be had. */
int tgi_vlm_skinny_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n,
                               const uint16_t* bias, uint16_t* y, int threads, int amx) {
    if (k < 1 || n < 1) return -1;
    if (amx && amx_takes(rows, k)) return amx_linear_bf16(x, rows, k, w, n, bias, y, threads);
    if (rows < 1 || rows > MAX_ROWS) return -1;
    return vnni_linear_bf16(x, rows, k, w, n, bias, y, threads);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* bfloat16 linears on CPUs with AMX (tgi_vlm::skinny_linear_bf16 with amx), over the same blocked weight as the loop
   above.

   Why: oneDNN's packed bf16 product streamed Gemma 3 270M's 72 decoder products at ~13-14 GB/s whatever the row
   count (1-16 rows, ~200 us a product: its per-call work dominates at these sizes), where the host reads ~26 GB/s;
   the VDPBF16PS loop is compute-bound past a few rows. One AMX tile product (TDPBF16PS) multiplies 16 rows by 32 k
   for 16 columns; the blocked layout's 16 k-pairs x 16 columns x 2 is exactly a B tile (rows 64 bytes apart), and
   x's rows give the A tile as they are.

   Work: pairs of column blocks (32 outputs), shared out by OpenMP; per pair and tile of 16 rows, two float32
   accumulator tiles over all K in steps of 32, then rounded to bf16 once with the bias, as oneDNN does. K must be a multiple of 32 (the caller
   checks). Sums: each TDPBF16PS adds its pair products into float32 (round to nearest even, bf16 denormal inputs as
   zero), k in order: not oneDNN's order, within float32 rounding of it. */
#define AMX_TILE_ROWS 16
#define AMX_MAX_ROWS 512 /* rows past one tile: loops of 16-row tiles over the cached pair */
#include "amx.h"

static void configure_tiles(int rows) {
    tile_config config;
    memset(&config, 0, sizeof(config));
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        /* 0, 1: A (row tiles: rows x 32 bf16); 2, 3: B (16 k-pairs x 16 columns x 2); 4..7: C (rows x 16 float) */
        config.rows[t] = (uint8_t)(t == 2 || t == 3 ? 16 : rows);
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

static void store_bf16_row(const float* acc, const __m512 bias, __mmask16 mask, uint16_t* out) {
    _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(acc), bias)));
}

static void store_tile_rows(const float* acc, int64_t r0, int64_t r1, const __m512 bias, __mmask16 mask,
                            uint16_t* y, int64_t n, int64_t col) {
    for (int64_t r = r0; r < r1; ++r) store_bf16_row(acc + (r - r0) * 16, bias, mask, y + r * n + col);
}

/* Output columns [32 pair, 32 pair + 32) of every row; x holds `tiles` x 16 rows (padded where rows is not a
   multiple of 16), of which the first `rows` are stored. Row tiles go two at a time (A tiles 0 and 1, four
   accumulators), so each B tile loaded serves 32 rows; the pair's weights (2 x K x 32 bytes) come from memory for
   the first two row tiles and from cache for the others. */
static void amx_pair(const uint16_t* x, int64_t rows, int64_t tiles, int64_t k, const uint16_t* w, int64_t n,
                     int64_t pair, const uint16_t* bias, uint16_t* y) {
    const int64_t k2 = k / 2;
    const uint16_t* w0 = w + (size_t)(2 * pair) * (size_t)k2 * 32;
    const uint16_t* w1 = w0 + (size_t)k2 * 32;
    const int64_t col = pair * 32;
    const __mmask16 mask0 = columns_left(n, col), mask1 = columns_left(n, col + 16);
    const __m512 b0 = bias_bf16(bias, mask0, col), b1 = bias_bf16(bias, mask1, col + 16);
    float acc[4][AMX_TILE_ROWS * 16];
    for (int64_t t = 0; t < tiles; t += 2) {
        const int two = t + 1 < tiles;
        const uint16_t* xa = x + (size_t)t * AMX_TILE_ROWS * (size_t)k;
        const uint16_t* xb = two ? xa + (size_t)AMX_TILE_ROWS * (size_t)k : xa;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t k0 = 0; k0 < k; k0 += 32) {
            _tile_loadd(2, w0 + (k0 / 2) * 32, 64);
            _tile_loadd(3, w1 + (k0 / 2) * 32, 64);
            _tile_loadd(0, xa + k0, k * 2);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            if (two) {
                _tile_loadd(1, xb + k0, k * 2);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, acc[0], 64);
        _tile_stored(5, acc[1], 64);
        const int64_t r0 = t * AMX_TILE_ROWS, r1 = rows < r0 + AMX_TILE_ROWS ? rows : r0 + AMX_TILE_ROWS;
        store_tile_rows(acc[0], r0, r1, b0, mask0, y, n, col);
        store_tile_rows(acc[1], r0, r1, b1, mask1, y, n, col + 16);
        if (two) {
            _tile_stored(6, acc[2], 64);
            _tile_stored(7, acc[3], 64);
            const int64_t r2 = r1 + AMX_TILE_ROWS < rows ? r1 + AMX_TILE_ROWS : rows;
            store_tile_rows(acc[2], r1, r2, b0, mask0, y, n, col);
            store_tile_rows(acc[3], r1, r2, b1, mask1, y, n, col + 16);
        }
    }
}

static int amx_takes(int64_t rows, int64_t k) {
    return rows >= 1 && rows <= AMX_MAX_ROWS && k >= 32 && k % 32 == 0 && amx_permitted();
}

/* The tile kernel: 1..AMX_MAX_ROWS rows, k a multiple of 32 (`amx_takes`). Up to 16 rows x is read as it is (the
   tiles configured for that many rows); more rows are copied into tiles of 16, the last one zero-padded. */
static int amx_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n,
                           const uint16_t* bias, uint16_t* y, int threads) {
    const int64_t pairs = (n + 31) / 32;
    const int64_t tiles = (rows + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS;
    uint16_t* padded = NULL;
    if (tiles > 1) {
        const size_t bytes = (size_t)(tiles * AMX_TILE_ROWS * k) * 2;
        padded = (uint16_t*)aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (padded == NULL) return -2;
        memcpy(padded, x, (size_t)(rows * k) * 2);
        memset(padded + rows * k, 0, bytes - (size_t)(rows * k) * 2);
    }
    const uint16_t* source = padded ? padded : x;
    const int tile_rows = (int)(tiles > 1 ? AMX_TILE_ROWS : rows);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        configure_tiles(tile_rows);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; ++p) amx_pair(source, rows, tiles, k, w, n, p, bias, y);
        _tile_release();
    }
    free(padded);
    return 0;
}

int tgi_vlm_amx_max_rows(void) { return amx_permitted() ? AMX_MAX_ROWS : 0; }
#else /* no AMX: the loop serves every row count */
static int amx_takes(int64_t rows, int64_t k) {
    (void)rows, (void)k;
    return 0;
}
static int amx_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n,
                           const uint16_t* bias, uint16_t* y, int threads) {
    (void)x, (void)rows, (void)k, (void)w, (void)n, (void)bias, (void)y, (void)threads;
    return -1;
}
int tgi_vlm_amx_max_rows(void) { return 0; }
#endif
#else /* AVX-512 without its BF16 extension: the bf16 loop is not built (max rows 0) */
int tgi_vlm_skinny_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n,
                               const uint16_t* bias, uint16_t* y, int threads, int amx) {
    (void)x, (void)rows, (void)k, (void)w, (void)n, (void)bias, (void)y, (void)threads, (void)amx;
    return -1;
}
int tgi_vlm_skinny_bf16_max_rows(void) { return 0; }
int tgi_vlm_amx_max_rows(void) { return 0; }
#endif

#else /* no AVX-512: nothing runs here (the loader reads max rows 0) */
int tgi_vlm_skinny_linear(const float* x, int64_t rows, int64_t k, const float* w, int64_t n, const float* bias,
                          float* y, int threads) {
    (void)x, (void)rows, (void)k, (void)w, (void)n, (void)bias, (void)y, (void)threads;
    return -1;
}
int tgi_vlm_skinny_max_rows(void) { return 0; }
int tgi_vlm_skinny_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n,
                               const uint16_t* bias, uint16_t* y, int threads, int amx) {
    (void)x, (void)rows, (void)k, (void)w, (void)n, (void)bias, (void)y, (void)threads, (void)amx;
    return -1;
}
int tgi_vlm_skinny_bf16_max_rows(void) { return 0; }
int tgi_vlm_amx_max_rows(void) { return 0; }
#endif
