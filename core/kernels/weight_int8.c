/* y (m, n) = x (m, k) fp32 times int8 weights with fp32 channel scales, plus a bias.
 *
 * The weights come packed in panels of 16 output channels, k-major: p[panel][k][16] (int8),
 * channels past n zero, panels padded to a multiple of GROUP. Every output is one chain of fused
 * multiply-adds over k in order (acc = fma(w[k], x[k], acc), from 0), then times its scale, plus
 * its bias: a GEMM micro-kernel's order, where a tile of R rows x C panels keeps its 2RC
 * accumulators in registers and a weight vector, converted once, serves R rows. Tiles share
 * converted weights and nothing of their arithmetic, so every row of a call comes out bit for bit
 * as its one-row call, whatever the number of rows, the tile or the thread that computes it.
 * Built with -mavx2 -mfma, no -ffast-math (gcc keeps the order written here).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 16       /* output channels of a panel: two 8-lane vectors */
#define GROUP 4        /* panels a thread takes at a time */
#define ROWS 6         /* rows of a tile: 6 x 2 accumulators, 2 weight vectors, a broadcast: 15 registers */
#define PANEL_ROWS 96  /* rows whose activations one pass over the weights shares (they stay in cache) */
#define CONVERT_ROWS 12 /* calls of more rows convert each panel to fp32 once, then run fp32 tiles on it */

/* The layout the caller packs the weights in (weight_int8.py reads these, so it is written once). */
const long weight_int8_panel = LANES, weight_int8_group = GROUP;

static inline __m256 low8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
static inline __m256 high8(__m128i v) { return low8(_mm_unpackhi_epi64(v, v)); }

/* out[r][c * LANES + j] = sum_k w_c[k][j] x[r][k] for r < R, c < C: one function per (R, C), its
 * accumulators an array of exactly that size, so that the compiler keeps them all in registers.
 * With few rows, several panels keep enough chains of FMAs in flight. */
#define TILE(R, C)                                                                                  \
    static void tile_##R##_##C(const int8_t *w, long K, const float *x, float *out) {              \
        __m256 a[R][2 * C];                                                                         \
        for (int r = 0; r < R; r++)                                                                 \
            for (int c = 0; c < 2 * C; c++) a[r][c] = _mm256_setzero_ps();                          \
        for (long k = 0; k < K; k++) {                                                              \
            for (int c = 0; c < C; c++) {                                                           \
                __m128i b = _mm_loadu_si128((const __m128i *)(w + (c * K + k) * LANES));            \
                __m256 w0 = low8(b), w1 = high8(b);                                                 \
                for (int r = 0; r < R; r++) {                                                       \
                    __m256 xv = _mm256_broadcast_ss(x + r * K + k);                                 \
                    a[r][2 * c] = _mm256_fmadd_ps(w0, xv, a[r][2 * c]);                             \
                    a[r][2 * c + 1] = _mm256_fmadd_ps(w1, xv, a[r][2 * c + 1]);                     \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int c = 0; c < 2 * C; c++) _mm256_storeu_ps(out + r * GROUP * LANES + c * 8, a[r][c]); \
    }
TILE(6, 1) TILE(5, 1) TILE(4, 1) TILE(3, 2) TILE(2, 2) TILE(1, 4)

/* The same chains on a panel converted to fp32 once (`weight_int8_mm` does that for calls of many
 * rows): the conversion of an int8 to fp32 is exact, so the sums are those of `tile_R_C`, bit for
 * bit, without converting the weights again for every tile of rows. */
#define FTILE(R)                                                                                    \
    static void ftile_##R(const float *w, long K, const float *x, float *out) {                     \
        __m256 a[R][2];                                                                             \
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();                        \
        for (long k = 0; k < K; k++) {                                                              \
            __m256 w0 = _mm256_loadu_ps(w + k * LANES), w1 = _mm256_loadu_ps(w + k * LANES + 8);     \
            for (int r = 0; r < R; r++) {                                                           \
                __m256 xv = _mm256_broadcast_ss(x + r * K + k);                                     \
                a[r][0] = _mm256_fmadd_ps(w0, xv, a[r][0]);                                         \
                a[r][1] = _mm256_fmadd_ps(w1, xv, a[r][1]);                                         \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++) {                                                               \
            _mm256_storeu_ps(out + r * LANES, a[r][0]);                                             \
            _mm256_storeu_ps(out + r * LANES + 8, a[r][1]);                                         \
        }                                                                                           \
    }
FTILE(6) FTILE(5) FTILE(4) FTILE(3) FTILE(2) FTILE(1)

static void panel_rows(long R, const float *w, long K, const float *x, float *out) {
    switch (R) {
        case 6: ftile_6(w, K, x, out); break;
        case 5: ftile_5(w, K, x, out); break;
        case 4: ftile_4(w, K, x, out); break;
        case 3: ftile_3(w, K, x, out); break;
        case 2: ftile_2(w, K, x, out); break;
        default: ftile_1(w, K, x, out);
    }
}

/* One group of GROUP panels for rows [m, m + R): C panels at a time. */
static void group_rows(long R, const int8_t *w, long K, const float *x, float *out) {
    long step = K * LANES;
    switch (R) {
        case 6: for (int c = 0; c < GROUP; c++) tile_6_1(w + c * step, K, x, out + c * LANES); break;
        case 5: for (int c = 0; c < GROUP; c++) tile_5_1(w + c * step, K, x, out + c * LANES); break;
        case 4: for (int c = 0; c < GROUP; c++) tile_4_1(w + c * step, K, x, out + c * LANES); break;
        case 3: for (int c = 0; c < GROUP; c += 2) tile_3_2(w + c * step, K, x, out + c * LANES); break;
        case 2: for (int c = 0; c < GROUP; c += 2) tile_2_2(w + c * step, K, x, out + c * LANES); break;
        default: tile_1_4(w, K, x, out);
    }
}

static inline void store(const float *out, long ld, long R, long m, long n0, long width, const float *scale,
                         const float *bias, long N, float *y) {
    for (long r = 0; r < R; r++)
        for (long j = 0, n = n0; j < width && n < N; j++, n++) {
            float s = out[r * ld + j] * scale[n];
            y[(m + r) * N + n] = bias ? s + bias[n] : s;
        }
}

void weight_int8_mm(const float *x, long M, long K, const int8_t *p, const float *scale,
                    const float *bias, long N, float *y, int threads) {
    long groups = (N + GROUP * LANES - 1) / (GROUP * LANES);
    for (long m0 = 0; m0 < M; m0 += PANEL_ROWS) {
        long m1 = m0 + PANEL_ROWS < M ? m0 + PANEL_ROWS : M;
        int convert = m1 - m0 > CONVERT_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long g = 0; g < groups; g++) {
            const int8_t *w = p + g * GROUP * K * LANES;
            float out[ROWS * GROUP * LANES];
            if (!convert) {
                for (long m = m0; m < m1; m += ROWS) {
                    long R = m1 - m < ROWS ? m1 - m : ROWS;
                    group_rows(R, w, K, x + m * K, out);
                    store(out, GROUP * LANES, R, m, g * GROUP * LANES, GROUP * LANES, scale, bias, N, y);
                }
                continue;
            }
            static __thread float *panel = 0;
            static __thread long room = 0;
            if (room < K * LANES) {
                free(panel);
                panel = aligned_alloc(64, ((K * LANES * sizeof(float) + 63) / 64) * 64);
                room = K * LANES;
            }
            for (long c = 0; c < GROUP; c++) {
                const int8_t *wc = w + c * K * LANES;
                for (long i = 0; i < K * LANES; i += 16) {
                    __m128i b = _mm_loadu_si128((const __m128i *)(wc + i));
                    _mm256_store_ps(panel + i, low8(b));
                    _mm256_store_ps(panel + i + 8, high8(b));
                }
                for (long m = m0; m < m1; m += ROWS) {
                    long R = m1 - m < ROWS ? m1 - m : ROWS;
                    panel_rows(R, panel, K, x + m * K, out);
                    store(out, LANES, R, m, (g * GROUP + c) * LANES, LANES, scale, bias, N, y);
                }
            }
        }
    }
}
