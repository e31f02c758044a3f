/* y (m, n) = x (m, k) fp32 times int8 weights q (n, k) with fp32 channel scales, plus a bias.
 *
 * Every output is one dot product computed in one fixed order: two 8-lane fp32 accumulators over
 * k (k mod 16 < 8 and >= 8), added lane-wise, then summed across lanes in a fixed tree, then
 * the k % 16 tail in order, then times its scale, plus its bias. The rows of a call are taken
 * four at a time only so that a weight's 16 converted values serve four rows' FMAs; no row's
 * arithmetic depends on the other rows of its call, on how many there are, or on the thread
 * that computes it. So every row of a call comes out bit for bit as its one-row call.
 * Built with -mavx2 -mfma, no -ffast-math (gcc keeps the order written here).
 */
#include <immintrin.h>
#include <stdint.h>

#define ROWS 4   /* rows sharing one converted weight block */
#define BLOCK 16 /* output channels a thread takes at a time (a block of weights stays in cache) */

static inline __m256 load8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float lanes_sum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[r] = sum_k w[k] x[r][k] for r < R (R a constant at each call site, so the loops unroll) */
static inline __attribute__((always_inline)) void dots(const int R, const int8_t *w, const float *x,
                                                       long ldx, long K, float *out) {
    __m256 a0[ROWS], a1[ROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = load8(w + k), w1 = load8(w + k + 8);
        for (int r = 0; r < R; r++) {
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), a0[r]);
            a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = lanes_sum(_mm256_add_ps(a0[r], a1[r]));
        for (long j = k; j < K; j++) s = s + (float)w[j] * x[r * ldx + j];
        out[r] = s;
    }
}

void weight_int8_mm(const float *x, long M, long K, const int8_t *q, const float *scale,
                    const float *bias, long N, float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long nb = 0; nb < N; nb += BLOCK) {
        long ne = nb + BLOCK < N ? nb + BLOCK : N;
        for (long m = 0; m < M; m += ROWS) {
            long R = M - m < ROWS ? M - m : ROWS;
            const float *xm = x + m * K;
            for (long n = nb; n < ne; n++) {
                float out[ROWS];
                const int8_t *w = q + n * K;
                switch (R) {
                    case 4: dots(4, w, xm, K, K, out); break;
                    case 3: dots(3, w, xm, K, K, out); break;
                    case 2: dots(2, w, xm, K, K, out); break;
                    default: dots(1, w, xm, K, K, out);
                }
                for (long r = 0; r < R; r++)
                    y[(m + r) * N + n] = bias ? out[r] * scale[n] + bias[n] : out[r] * scale[n];
            }
        }
    }
}
