/* CPU kernels for a decode step's products and its small per-layer ops (llm_api.kernels.cpu states the
 * contract, the build and why they are hand-written). Plain C with a C ABI, called through ctypes with raw
 * pointers: no torch headers, so a build takes about a second where a C compiler exists. Built with
 * -march=native on the host that runs it (the vector paths below are picked by the compiler's own macros)
 * and -ffp-contract=off (no multiply-add fused where torch's elementwise ops round twice).
 *
 * Tensors are row-major, sizes and strides in elements; bfloat16 travels as uint16_t. A product sums in
 * float32 and rounds once to its output's dtype (to nearest even), as torch's CPU products do; elementwise
 * ops round where transformers' code does (each torch op on a bfloat16 tensor computes in float32 and
 * rounds its result).
 */
#include "common.h"
#include "quant.h"

/* ---------------------------------------------------------------------------------------------------
 * Products, tile by tile: up to MR input rows against 4 weight rows, MR x 4 float32 sums kept in vector
 * registers over the whole of K. The 4 weight rows (4 x K elements: 4.5 KiB for K = 576 in bfloat16) stay
 * in L1 while every chunk of input rows passes over them, so each weight byte is read from memory once
 * per call, whatever the number of input rows. */

/* Weight rows ahead of the ones being read whose lines are prefetched: the next block of 4 rows (contiguous in
 * memory after this one). A row is only 1-3 KiB and a block reads 4 of them side by side, too short for the
 * hardware's stream prefetcher to ramp up: bfloat16 products read 11.6 GB/s without this. */
#define PREFETCH_ROWS 8

#if defined(__AVX512F__)
#define MR 4
#else
#define MR 2
#endif

/* The weight's 4 rows are passed as 4 pointers: a block of fewer rows repeats its first (not written). */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const float *const w[4],
                                                           int64_t k, const int mr, float out[MR][4]) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc[MR][4];
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) acc[a][b] = _mm512_setzero_ps();
    for (; i < k; i += 16) {
        __mmask16 mask = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        __m512 wv[4];
        for (int b = 0; b < 4; b++) {
            _mm_prefetch((const char *)(w[b] + PREFETCH_ROWS * k + i), _MM_HINT_T0);
            wv[b] = _mm512_maskz_loadu_ps(mask, w[b] + i);
        }
        for (int a = 0; a < mr; a++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + a * ldx + i);
            for (int b = 0; b < 4; b++) acc[a][b] = _mm512_fmadd_ps(wv[b], xv, acc[a][b]);
        }
    }
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) out[a][b] = _mm512_reduce_add_ps(acc[a][b]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[MR][4];
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) acc[a][b] = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
        __m256 wv[4];
        for (int b = 0; b < 4; b++) {
            _mm_prefetch((const char *)(w[b] + PREFETCH_ROWS * k + i), _MM_HINT_T0);
            wv[b] = _mm256_loadu_ps(w[b] + i);
        }
        for (int a = 0; a < mr; a++) {
            __m256 xv = _mm256_loadu_ps(x + a * ldx + i);
            for (int b = 0; b < 4; b++) acc[a][b] = _mm256_fmadd_ps(wv[b], xv, acc[a][b]);
        }
    }
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) out[a][b] = hsum256(acc[a][b]);
#else
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) out[a][b] = 0.0f;
#endif
    for (; i < k; i++)
        for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) out[a][b] += w[b][i] * x[a * ldx + i];
}

static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t ldx,
                                                            const uint16_t *const w[4], int64_t k, const int mr,
                                                            float out[MR][4]) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    __m512 acc[MR][4];
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) acc[a][b] = _mm512_setzero_ps();
    for (; i < k; i += 32) {
        __mmask32 mask = k - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - i)) - 1);
        __m512bh wv[4];
        for (int b = 0; b < 4; b++) {
            _mm_prefetch((const char *)(w[b] + PREFETCH_ROWS * k + i), _MM_HINT_T0);
            wv[b] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[b] + i);
        }
        for (int a = 0; a < mr; a++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + a * ldx + i);
            for (int b = 0; b < 4; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[b], xv);
        }
    }
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) out[a][b] = _mm512_reduce_add_ps(acc[a][b]);
#elif defined(__AVX512F__)
#define WIDEN16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
    __m512 acc[MR][4];
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) acc[a][b] = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        __m512 wv[4];
        for (int b = 0; b < 4; b++) {
            _mm_prefetch((const char *)(w[b] + PREFETCH_ROWS * k + i), _MM_HINT_T0);
            wv[b] = WIDEN16(w[b] + i);
        }
        for (int a = 0; a < mr; a++) {
            __m512 xv = WIDEN16(x + a * ldx + i);
            for (int b = 0; b < 4; b++) acc[a][b] = _mm512_fmadd_ps(wv[b], xv, acc[a][b]);
        }
    }
#undef WIDEN16
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) out[a][b] = _mm512_reduce_add_ps(acc[a][b]);
#elif defined(__AVX2__) && defined(__FMA__)
#define WIDEN8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
    __m256 acc[MR][4];
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) acc[a][b] = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
        __m256 wv[4];
        for (int b = 0; b < 4; b++) {
            _mm_prefetch((const char *)(w[b] + PREFETCH_ROWS * k + i), _MM_HINT_T0);
            wv[b] = WIDEN8(w[b] + i);
        }
        for (int a = 0; a < mr; a++) {
            __m256 xv = WIDEN8(x + a * ldx + i);
            for (int b = 0; b < 4; b++) acc[a][b] = _mm256_fmadd_ps(wv[b], xv, acc[a][b]);
        }
    }
#undef WIDEN8
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) out[a][b] = hsum256(acc[a][b]);
#else
    for (int a = 0; a < mr; a++) for (int b = 0; b < 4; b++) out[a][b] = 0.0f;
#endif
    for (; i < k; i++)
        for (int a = 0; a < mr; a++)
            for (int b = 0; b < 4; b++) out[a][b] += bf16_to_f32(w[b][i]) * bf16_to_f32(x[a * ldx + i]);
}

#define ROWS_PER_TASK 16
#define AT_MOST_MR(n) ((n) <= MR ? (n) : MR)

/* y[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]) for r < m, n < n_out; w contiguous [n_out, k]; the weight's
 * rows split in blocks of ROWS_PER_TASK over the threads. */
#define PRODUCT(NAME, T, TILE, TO_OUT, BIAS)                                                                     \
    int NAME(const T *x, int64_t ldx, const T *w, const T *bias, T *y, int64_t ldy, int64_t m, int64_t n_out,   \
             int64_t k, int threads) {                                                                           \
        int64_t tasks = (n_out + ROWS_PER_TASK - 1) / ROWS_PER_TASK;                                            \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                        \
        for (int64_t t = 0; t < tasks; t++) {                                                                    \
            int64_t end = (t + 1) * ROWS_PER_TASK < n_out ? (t + 1) * ROWS_PER_TASK : n_out;                     \
            for (int64_t j = t * ROWS_PER_TASK; j < end; j += 4) {                                               \
                int rows = end - j < 4 ? (int)(end - j) : 4;                                                     \
                const T *wr[4];                                                                                  \
                for (int b = 0; b < 4; b++) wr[b] = w + (j + (b < rows ? b : 0)) * k;                            \
                for (int64_t r = 0; r < m;) {                                                                    \
                    int take = m - r >= MR ? MR : (int)(m - r);                                                  \
                    float sums[MR][4];                                                                           \
                    const T *xr = x + r * ldx;                                                                   \
                    switch (take) {                                                                              \
                        case 1: TILE(xr, ldx, wr, k, 1, sums); break;                                            \
                        case 2: TILE(xr, ldx, wr, k, AT_MOST_MR(2), sums); break;                                \
                        case 3: TILE(xr, ldx, wr, k, AT_MOST_MR(3), sums); break;                                \
                        default: TILE(xr, ldx, wr, k, MR, sums); break;                                          \
                    }                                                                                            \
                    for (int a = 0; a < take; a++)                                                               \
                        for (int b = 0; b < rows; b++)                                                           \
                            y[(r + a) * ldy + j + b] = TO_OUT(bias ? sums[a][b] + BIAS(bias[j + b]) : sums[a][b]); \
                    r += take;                                                                                   \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        return 0;                                                                                                \
    }

#define IDENTITY(v) (v)
PRODUCT(llm_linear_f32, float, tile_f32, IDENTITY, IDENTITY)
PRODUCT(llm_linear_bf16_vectors, uint16_t, tile_bf16, f32_to_bf16, bf16_to_f32)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* bfloat16 products of 2..16 rows on Intel's AMX tiles (one tdpbf16ps multiplies 16 weight rows by 16 input
 * rows over 32 of K): the vector tiles above spend a multiply per input row, so a step of 16 rows cost ~16x
 * one row's compute, where AMX takes them for about the price of one. A = 16 weight rows x 32 of K (the
 * weight as it is, row-major), B = the input rows in AMX's pair layout (x_pairs[k / 2][m][2], made once a
 * call: m <= 16 rows), C = 16 weight rows x m float32 sums, two C tiles at a time. Tiles need the kernel's
 * permission once per process (arch_prctl ARCH_REQ_XCOMP_PERM; oneDNN asks the same) and a configuration
 * per thread; where either fails, or K is not a multiple of 32, the vector tiles run. The sums run in
 * AMX's order (pairs of K, then chunks of 32): equal to the vector tiles' up to the order of float32 sums. */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_MIN_ROWS 2
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config_t;

static int amx_permitted(void) {
    static int permitted = -1; /* (a benign race: every thread asks the same and gets the same answer) */
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

static int amx_linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                           int64_t ldy, int64_t m, int64_t n_out, int64_t k, int threads) {
    uint16_t *pairs = (uint16_t *)aligned_alloc(64, ((size_t)k * m * 2 + 63) / 64 * 64);
    if (!pairs) return 1;
    for (int64_t kk = 0; kk < k / 2; kk++)
        for (int64_t r = 0; r < m; r++) {
            pairs[(kk * m + r) * 2] = x[r * ldx + 2 * kk];
            pairs[(kk * m + r) * 2 + 1] = x[r * ldx + 2 * kk + 1];
        }
    int64_t blocks = n_out / 32;
#pragma omp parallel num_threads(threads)
    {
        tile_config_t config = {0};
        config.palette = 1;
        for (int t = 0; t < 5; t++) config.rows[t] = 16;
        config.colsb[0] = config.colsb[1] = config.colsb[4] = (uint16_t)(m * 4); /* C0, C1 and B: m columns */
        config.colsb[2] = config.colsb[3] = 64;                                   /* A0, A1: 32 of K */
        _tile_loadconfig(&config);
        float sums[2][16][16];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t j = b * 32;
            const uint16_t *w0 = w + j * k, *w1 = w + (j + 16) * k;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t c = 0; c < k; c += 32) {
                _tile_loadd(2, w0 + c, k * 2);
                _tile_loadd(3, w1 + c, k * 2);
                _tile_loadd(4, pairs + c * m, m * 4);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(1, 3, 4);
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 16; i++) {
                    int64_t o = j + h * 16 + i;
                    for (int64_t r = 0; r < m; r++)
                        y[r * ldy + o] = f32_to_bf16(bias ? sums[h][i][r] + bf16_to_f32(bias[o]) : sums[h][i][r]);
                }
        }
        _tile_release();
    }
    free(pairs);
    if (blocks * 32 < n_out) /* the last few weight rows */
        return llm_linear_bf16_vectors(x, ldx, w + blocks * 32 * k, bias ? bias + blocks * 32 : NULL,
                                       y + blocks * 32, ldy, m, n_out - blocks * 32, k, threads);
    return 0;
}
#endif

static int amx_wanted = 1;

/* Whether bfloat16 products of 2..16 rows may use AMX (on: 1, off: 0; a benchmark's switch); returns whether
 * they will: this build has AMX and the kernel permits its tiles. */
int llm_use_amx(int on) {
    amx_wanted = on;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return on && amx_permitted();
#else
    return 0;
#endif
}

int llm_linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t ldy,
                    int64_t m, int64_t n_out, int64_t k, int threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_wanted && m >= AMX_MIN_ROWS && m <= 16 && k % 32 == 0 && n_out >= 32 && amx_permitted())
        return amx_linear_bf16(x, ldx, w, bias, y, ldy, m, n_out, k, threads);
#endif
    return llm_linear_bf16_vectors(x, ldx, w, bias, y, ldy, m, n_out, k, threads);
}

/* ---------------------------------------------------------------------------------------------------
 * Elementwise ops, with transformers' rounding. dtype: 0 float32, 1 bfloat16 (every tensor of a call has it). */

/* Llama's RMSNorm of rows [m, d] (row strides ldx, ldo): weight * (x * rsqrt(mean(x^2) + eps)).to(dtype).
 * With residual (add_rms_norm): total = residual + x, rounded to the dtype and written to total (row stride
 * ldt), then normalized: a layer's residual sum and the next norm in one pass. */
int llm_rms_norm(const void *x, int64_t ldx, const void *residual, int64_t ldr, void *total, int64_t ldt,
                 const void *weight, void *out, int64_t ldo, int64_t m, int64_t d, float eps, int bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * d >= 65536)
    for (int64_t r = 0; r < m; r++) {
        float squares = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            float v = load_as_f32(x, r * ldx + i, bf16);
            if (residual) {
                v = rounded(load_as_f32(residual, r * ldr + i, bf16) + v, bf16);
                store_from_f32(total, r * ldt + i, v, bf16);
            }
            squares += v * v;
        }
        float scale = 1.0f / sqrtf(squares / (float)d + eps);
        for (int64_t i = 0; i < d; i++) {
            float v = residual ? load_as_f32(total, r * ldt + i, bf16) : load_as_f32(x, r * ldx + i, bf16);
            store_from_f32(out, r * ldo + i, load_as_f32(weight, i, bf16) * rounded(v * scale, bf16), bf16);
        }
    }
    return 0;
}

/* silu(gate) * up of rows [m, 2 * inter] (gate first, row stride ldx) into out [m, inter] (contiguous):
 * the activation rounded to the dtype, then the product rounded (Llama's MLP: act_fn(gate) * up). */
int llm_silu_and_mul(const void *gate_up, int64_t ldx, void *out, int64_t m, int64_t inter, int bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * inter >= 65536)
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < inter; i++) {
            float g = load_as_f32(gate_up, r * ldx + i, bf16);
            float activated = rounded(g / (1.0f + expf(-g)), bf16);
            store_from_f32(out, r * inter + i, activated * load_as_f32(gate_up, r * ldx + inter + i, bf16), bf16);
        }
    return 0;
}

/* Llama's rotary embedding of x [b, h, t, dim] (element strides xs[3], last dimension contiguous) into out
 * (strides os[3]) by cos and sin [b or 1, t, dim] (strides cs[2]: batch, token):
 *   out[:half] = x[:half] * cos[:half] - x[half:] * sin[:half],  out[half:] = x[half:] * cos[half:] + x[:half] * sin[half:]
 * each product rounded to the dtype before the sum (the reference's separate elementwise ops). */
int llm_rotary(const void *x, const int64_t *xs, void *out, const int64_t *os, const void *cos, const void *sin,
               const int64_t *cs, int64_t b, int64_t h, int64_t t, int64_t dim, int bf16, int threads) {
    int64_t half = dim / 2;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (b * h * t * dim >= 65536)
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t hi = 0; hi < h; hi++)
            for (int64_t ti = 0; ti < t; ti++) {
                int64_t xo = bi * xs[0] + hi * xs[1] + ti * xs[2], oo = bi * os[0] + hi * os[1] + ti * os[2];
                int64_t co = bi * cs[0] + ti * cs[1];
                for (int64_t i = 0; i < half; i++) {
                    float x1 = load_as_f32(x, xo + i, bf16), x2 = load_as_f32(x, xo + half + i, bf16);
                    float c1 = load_as_f32(cos, co + i, bf16), c2 = load_as_f32(cos, co + half + i, bf16);
                    float s1 = load_as_f32(sin, co + i, bf16), s2 = load_as_f32(sin, co + half + i, bf16);
                    store_from_f32(out, oo + i, rounded(x1 * c1, bf16) - rounded(x2 * s1, bf16), bf16);
                    store_from_f32(out, oo + half + i, rounded(x2 * c2, bf16) + rounded(x1 * s2, bf16), bf16);
                }
            }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * A Llama decoder layer at a decode step's few rows, in two calls around the attention (which stays with
 * the engine's paged-attention code): every product and elementwise op of the layer, with the same
 * rounding as the ops above one by one, and no tensor handed back to Python that Python does not use. */

/* A product of the layer (quant.h: one weight of the activations' dtype, or 1..3 parts of any format); n its
 * outputs, checked against its parts (2 where they differ). */
static int product(const void *x, int64_t ldx, const llm_product_t *w, const void *bias, void *y, int64_t ldy, int64_t m,
                   int64_t n, int64_t k, int bf16, int threads) {
    int64_t rows = 0;
    for (int64_t p = 0; p < w->parts && p < LLM_MAX_PARTS; p++) rows += w->part[p].rows;
    if (w->parts < 1 || w->parts > LLM_MAX_PARTS || rows != n) return 2;
    if (w->parts == 1 && w->part[0].type == LLM_DENSE) {
        if (bf16) return llm_linear_bf16(x, ldx, w->part[0].data, bias, y, ldy, m, n, k, threads);
        return llm_linear_f32(x, ldx, w->part[0].data, bias, y, ldy, m, n, k, threads);
    }
    return llm_q_product(x, ldx, w, bias, y, ldy, m, k, bf16, threads);
}

static inline float dot_f32(const float *a, const void *b, int64_t n, int bf16);

/* LoRA deltas of a step whose rows run under different adapters (llm_api.lora.ops' CPU layout): for one
 * product, the resident adapters' A concatenated along the rank (a [c, k]) and their B, transposed (bt
 * [c, n]); for the step, each row's own columns (offset, width; width 0: the base model, no delta) and
 * its adapter's scaling. y[t] += ((x[t] . A[off..off+w]) rounded) . B[:, off..off+w] rounded, times
 * scaling rounded, the sum rounded: PEFT's order (lora_B(lora_A(x)) * scaling) and the torch path's
 * rounding. A row never reads another adapter's columns, which keeps one tenant's numbers (an infinite
 * one included) out of another's rows. The expand runs along bt's rows (n at a time, vectorized). */
typedef struct {
    const void *a, *bt; /* NULL a: no adapter adapts this product */
    int64_t c;
} llm_lora_t;

typedef struct {
    const int64_t *offset, *width;
    const float *scaling;
} llm_lora_rows_t;

#define LORA_CHUNK 256 /* outputs per task of the expand */

static int lora_delta(const void *x, int64_t ldx, const llm_lora_t *lora, const llm_lora_rows_t *rows, void *y,
                      int64_t ldy, int64_t m, int64_t n, int64_t k, int bf16, int threads) {
    if (!lora || !lora->a || !rows) return 0;
    int64_t most = 0;
    for (int64_t t = 0; t < m; t++)
        if (rows->width[t] > most) most = rows->width[t];
    if (!most) return 0;
    float *inputs = (float *)malloc(((size_t)m * k + (size_t)m * most) * sizeof(float));
    if (!inputs) return 1;
    float *shrunk = inputs + m * k;
    size_t es = size_of(bf16);
    int64_t chunks = (n + LORA_CHUNK - 1) / LORA_CHUNK;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++)
            for (int64_t i = 0; i < k; i++) inputs[t * k + i] = load_as_f32(x, t * ldx + i, bf16);
#pragma omp for collapse(2) schedule(static)
        for (int64_t t = 0; t < m; t++)
            for (int64_t j = 0; j < most; j++)
                if (j < rows->width[t])
                    shrunk[t * most + j] = rounded(
                        dot_f32(inputs + t * k, (const char *)lora->a + (rows->offset[t] + j) * k * es, k, bf16), bf16);
#pragma omp for collapse(2) schedule(static)
        for (int64_t t = 0; t < m; t++)
            for (int64_t chunk = 0; chunk < chunks; chunk++) {
                int64_t width = rows->width[t], offset = rows->offset[t];
                if (!width) continue;
                int64_t first = chunk * LORA_CHUNK, count = n - first < LORA_CHUNK ? n - first : LORA_CHUNK;
                float sums[LORA_CHUNK];
                for (int64_t o = 0; o < count; o++) sums[o] = 0.0f;
                for (int64_t j = 0; j < width; j++) {
                    float s = shrunk[t * most + j];
                    int64_t row = (offset + j) * n + first;
                    if (bf16) {
                        const uint16_t *b = (const uint16_t *)lora->bt + row;
                        for (int64_t o = 0; o < count; o++) sums[o] += s * bf16_to_f32(b[o]);
                    } else {
                        const float *b = (const float *)lora->bt + row;
                        for (int64_t o = 0; o < count; o++) sums[o] += s * b[o];
                    }
                }
                float scaling = rows->scaling[t];
                for (int64_t o = 0; o < count; o++) {
                    float delta = rounded(rounded(sums[o], bf16) * scaling, bf16);
                    store_from_f32(y, t * ldy + first + o, load_as_f32(y, t * ldy + first + o, bf16) + delta, bf16);
                }
            }
    }
    free(inputs);
    return 0;
}

/* Before the attention: normed = input norm of hidden [m, d] (or normed_in, handed over by the layer before);
 * qkv [m, n_q + 2 n_kv] = normed x w_qkv (+ b_qkv) (+ with lora, lora[0..2]: q's, k's and v's deltas);
 * with q_norm and k_norm (Qwen3; NULL: none), an RMSNorm of each head of q and of k in place, weights
 * [head_dim]; q_out [m, n_q] and k_out [m, n_kv] rotated by cos and sin [m, head_dim] (row stride cos_ld); v
 * stays in qkv. */
int llm_layer_in(const void *hidden, const void *normed_in, const void *norm_weight, float eps, const llm_product_t *w_qkv,
                 const void *b_qkv, int64_t n_q, int64_t n_kv, int64_t head_dim, const void *q_norm, const void *k_norm,
                 float q_eps, float k_eps, const void *cos, const void *sin,
                 int64_t cos_ld, void *qkv, void *q_out, void *k_out, int64_t m, int64_t d,
                 const llm_lora_t *lora, const llm_lora_rows_t *lora_rows, int bf16, int threads) {
    size_t es = size_of(bf16);
    void *scratch = NULL;
    const void *normed = normed_in;
    if (!normed) {
        scratch = malloc(m * d * es);
        if (!scratch) return 1;
        llm_rms_norm(hidden, d, NULL, 0, NULL, 0, norm_weight, scratch, d, m, d, eps, bf16, 1);
        normed = scratch;
    }
    int64_t width = n_q + 2 * n_kv;
    int failed = product(normed, d, w_qkv, b_qkv, qkv, width, m, width, d, bf16, threads);
    if (lora) { /* q, k and v, each on its own columns of the merged output */
        failed |= lora_delta(normed, d, &lora[0], lora_rows, qkv, width, m, n_q, d, bf16, threads);
        failed |= lora_delta(normed, d, &lora[1], lora_rows, (char *)qkv + n_q * es, width, m, n_kv, d, bf16, threads);
        failed |= lora_delta(normed, d, &lora[2], lora_rows, (char *)qkv + (n_q + n_kv) * es, width, m, n_kv, d, bf16,
                             threads);
    }
    free(scratch);
    for (int64_t r = 0; r < m && (q_norm || k_norm); r++) { /* each head's norm, in place: heads rows of head_dim */
        char *row = (char *)qkv + r * width * es;
        if (q_norm)
            llm_rms_norm(row, head_dim, NULL, 0, NULL, 0, q_norm, row, head_dim, n_q / head_dim, head_dim, q_eps, bf16, 1);
        if (k_norm)
            llm_rms_norm(row + n_q * es, head_dim, NULL, 0, NULL, 0, k_norm, row + n_q * es, head_dim, n_kv / head_dim,
                         head_dim, k_eps, bf16, 1);
    }
    int64_t cs[2] = {0, cos_ld};
    int64_t qs[3] = {0, head_dim, width}, qo[3] = {0, head_dim, n_q};
    llm_rotary(qkv, qs, q_out, qo, cos, sin, cs, 1, n_q / head_dim, m, head_dim, bf16, 1);
    int64_t ko[3] = {0, head_dim, n_kv};
    llm_rotary((const char *)qkv + n_q * es, qs, k_out, ko, cos, sin, cs, 1, n_kv / head_dim, m, head_dim, bf16, 1);
    return failed;
}

/* After the attention: o = attn [m, n_attn] (row stride lda) x w_o; h = hidden + o; the MLP of
 * post-norm(h): down(silu(gate) * up); hidden_out = h + mlp, and with next_weight, normed_out = the next
 * norm of hidden_out (the next layer's input norm, or the model's final norm). With lora, lora[0..3]: the
 * deltas of o, gate, up and down. */
int llm_layer_out(const void *attn, int64_t lda, const void *hidden, const llm_product_t *w_o, const void *b_o,
                  const void *post_weight, float post_eps, const llm_product_t *w_gate_up, const void *b_gate_up,
                  const llm_product_t *w_down, const void *b_down, const void *next_weight, float next_eps, void *hidden_out,
                  void *normed_out, int64_t m, int64_t d, int64_t n_attn, int64_t inter, const llm_lora_t *lora,
                  const llm_lora_rows_t *lora_rows, int bf16, int threads) {
    size_t es = size_of(bf16);
    char *scratch = (char *)malloc((size_t)m * (4 * d + 3 * inter) * es);
    if (!scratch) return 1;
    char *o = scratch, *h = o + m * d * es, *normed = h + m * d * es, *gate_up = normed + m * d * es;
    char *act = gate_up + 2 * m * inter * es, *down = act + m * inter * es;
    int failed = product(attn, lda, w_o, b_o, o, d, m, d, n_attn, bf16, threads);
    if (lora) failed |= lora_delta(attn, lda, &lora[0], lora_rows, o, d, m, d, n_attn, bf16, threads);
    llm_rms_norm(o, d, hidden, d, h, d, post_weight, normed, d, m, d, post_eps, bf16, 1);
    failed |= product(normed, d, w_gate_up, b_gate_up, gate_up, 2 * inter, m, 2 * inter, d, bf16, threads);
    if (lora) {
        failed |= lora_delta(normed, d, &lora[1], lora_rows, gate_up, 2 * inter, m, inter, d, bf16, threads);
        failed |= lora_delta(normed, d, &lora[2], lora_rows, gate_up + inter * es, 2 * inter, m, inter, d, bf16,
                             threads);
    }
    llm_silu_and_mul(gate_up, 2 * inter, act, m, inter, bf16, 1);
    failed |= product(act, inter, w_down, b_down, down, d, m, d, inter, bf16, threads);
    if (lora) failed |= lora_delta(act, inter, &lora[3], lora_rows, down, d, m, d, inter, bf16, threads);
    if (next_weight) {
        llm_rms_norm(down, d, h, d, hidden_out, d, next_weight, normed_out, d, m, d, next_eps, bf16, 1);
    } else {
        for (int64_t i = 0; i < m * d; i++)
            store_from_f32(hidden_out, i, load_as_f32(h, i, bf16) + load_as_f32(down, i, bf16), bf16);
    }
    free(scratch);
    return failed;
}

/* ---------------------------------------------------------------------------------------------------
 * Paged attention of a decode step: each of b sequences has one new token. Its key and value rows
 * (k_new, v_new [b, h_kv, dim], row strides ld_k, ld_v) are stored at the pool row slots[s] (< 0: stored nowhere)
 * of key_cache / value_cache [blocks, block_size, h_kv, dim] (contiguous), then its query heads q [b, h_q,
 * dim] (row stride ld_q) attend to its context_lens[s] tokens, found through block_tables[s, :] (row stride
 * ld_bt): softmax(q . k * scaling) . v in float32, out [b, h_q, dim] (contiguous) rounded once. The query
 * heads h_kv * group .. h_kv * group + group - 1 share key/value head h_kv (transformers' repeat_kv order).
 * With window > 0 a row attends only the last window of its tokens (positions context_lens[s] - window ..
 * context_lens[s] - 1: the engine's torch backend's sliding-window mask). */

static inline float dot_f32(const float *a, const void *b, int64_t n, int bf16) {
    float sum = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    if (bf16) {
        for (; i + 16 <= n; i += 16) {
            __m512 bv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)b + i))), 16));
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), bv, acc);
        }
    } else {
        for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps((const float *)b + i), acc);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    if (bf16) {
        for (; i + 8 <= n; i += 8) {
            __m256 bv = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)b + i))), 16));
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), bv, acc);
        }
    } else {
        for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps((const float *)b + i), acc);
    }
    sum = hsum256(acc);
#endif
    for (; i < n; i++) sum += a[i] * load_as_f32(b, i, bf16);
    return sum;
}

int llm_paged_decode(const void *q, int64_t ld_q, const void *k_new, int64_t ld_k, const void *v_new, int64_t ld_v,
                     void *key_cache,
                     void *value_cache, const int64_t *slots, const int64_t *block_tables, int64_t ld_bt,
                     const int64_t *context_lens, void *out, int64_t b, int64_t h_q, int64_t h_kv, int64_t dim,
                     int64_t block_size, float scaling, int64_t window, int bf16, int threads) {
    size_t es = size_of(bf16);
    size_t row_bytes = (size_t)h_kv * dim * es;
    for (int64_t s = 0; s < b; s++) {
        if (slots[s] < 0) continue;
        memcpy((char *)key_cache + slots[s] * row_bytes, (const char *)k_new + s * ld_k * es, row_bytes);
        memcpy((char *)value_cache + slots[s] * row_bytes, (const char *)v_new + s * ld_v * es, row_bytes);
    }
    int64_t group = h_q / h_kv;
    int failed = 0;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(dynamic, 1)
    for (int64_t s = 0; s < b; s++) {
        for (int64_t h = 0; h < h_kv; h++) {
            int64_t end = context_lens[s];
            /* a sliding window (window > 0): the last window positions up to the row's own (Mistral's, Qwen2's) */
            int64_t first = window > 0 && end > window ? end - window : 0, length = end - first;
            if (length <= 0) { /* (nothing to attend: a zero row, not 0 / 0) */
                for (int64_t i = 0; i < group * dim; i++) store_from_f32(out, (s * h_q + h * group) * dim + i, 0.0f, bf16);
                continue;
            }
            float *scratch = (float *)malloc(((size_t)length * group + (size_t)dim * 2 * group) * sizeof(float));
            if (!scratch) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float *scores = scratch, *query = scratch + length * group, *acc = query + dim * group;
            for (int64_t g = 0; g < group; g++)
                for (int64_t i = 0; i < dim; i++) {
                    query[g * dim + i] = load_as_f32(q, s * ld_q + (h * group + g) * dim + i, bf16);
                    acc[g * dim + i] = 0.0f;
                }
            float top[64], total[64];
            float *maxima = group <= 64 ? top : (float *)malloc(group * sizeof(float));
            float *sums = group <= 64 ? total : (float *)malloc(group * sizeof(float));
            if (!maxima || !sums) { /* (out of memory: this row's heads are left unwritten, the call fails) */
                if (maxima != top) free(maxima);
                if (sums != total) free(sums);
                free(scratch);
#pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int64_t g = 0; g < group; g++) maxima[g] = -INFINITY, sums[g] = 0.0f;
            for (int64_t p = 0; p < length; p++) {
                int64_t at = first + p;
                int64_t row = block_tables[s * ld_bt + at / block_size] * block_size + at % block_size;
                const char *key = (const char *)key_cache + (row * h_kv + h) * dim * es;
                for (int64_t g = 0; g < group; g++) {
                    float score = dot_f32(query + g * dim, key, dim, bf16) * scaling;
                    scores[g * length + p] = score;
                    if (score > maxima[g]) maxima[g] = score;
                }
            }
            for (int64_t g = 0; g < group; g++)
                for (int64_t p = 0; p < length; p++) {
                    float e = expf(scores[g * length + p] - maxima[g]);
                    scores[g * length + p] = e;
                    sums[g] += e;
                }
            for (int64_t p = 0; p < length; p++) {
                int64_t at = first + p;
                int64_t row = block_tables[s * ld_bt + at / block_size] * block_size + at % block_size;
                const char *value = (const char *)value_cache + (row * h_kv + h) * dim * es;
                for (int64_t g = 0; g < group; g++) {
                    float weight = scores[g * length + p];
                    float *a = acc + g * dim;
                    if (bf16) for (int64_t i = 0; i < dim; i++) a[i] += weight * bf16_to_f32(((const uint16_t *)value)[i]);
                    else for (int64_t i = 0; i < dim; i++) a[i] += weight * ((const float *)value)[i];
                }
            }
            for (int64_t g = 0; g < group; g++)
                for (int64_t i = 0; i < dim; i++)
                    store_from_f32(out, (s * h_q + h * group + g) * dim + i, acc[g * dim + i] / sums[g], bf16);
            if (maxima != top) free(maxima);
            if (sums != total) free(sums);
            free(scratch);
        }
    }
    return failed;
}

/* ---------------------------------------------------------------------------------------------------
 * A step of a few rows through every decoder layer in one call: per layer, layer_in, paged_decode and
 * layer_out above, in that order, each layer's output (and its next norm's, handed over) the next one's
 * input; with lora, lora[7 i .. 7 i + 6] are layer i's q, k, v, o, gate, up and down. The same calls as the
 * layer by layer path, so the same numbers; what it saves is the Python between them (~150 us a layer on a
 * 2-core CPU). llm_layer_t is filled by the wrapper (ctypes.Structure: keep the two in step). hidden_out
 * and normed_out [m, d] receive the last layer's output and its next norm's (normed_out untouched where
 * the last layer has none). */

typedef struct {
    const void *input_norm, *post_norm, *next_norm, *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    llm_product_t qkv, o, gate_up, down;
    void *key_cache, *value_cache;
    int64_t n_q, n_kv, head_dim, inter;
    float input_eps, post_eps, next_eps, scaling;
    const void *q_norm, *k_norm; /* (Qwen3's per-head norms of q and k, or NULL) */
    float q_eps, k_eps;
    int64_t window; /* (the layer's sliding window, 0: none) */
} llm_layer_t;

int llm_decode_layers(const llm_layer_t *layers, int64_t n_layers, const void *hidden_in, void *hidden_out,
                      void *normed_out, const void *cos, const void *sin, int64_t cos_ld, const int64_t *slots,
                      const int64_t *block_tables, int64_t ld_bt, const int64_t *context_lens, int64_t m, int64_t d,
                      int64_t block_size, const llm_lora_t *lora, const llm_lora_rows_t *lora_rows, int bf16,
                      int threads) {
    size_t es = size_of(bf16);
    int64_t most_q = 0, most_width = 0;
    for (int64_t i = 0; i < n_layers; i++) {
        int64_t width = layers[i].n_q + 2 * layers[i].n_kv;
        if (layers[i].n_q > most_q) most_q = layers[i].n_q;
        if (width > most_width) most_width = width;
    }
    /* qkv, q, k (<= width), the attention's output, and two (hidden, normed) pairs taken in turn */
    char *scratch = (char *)malloc((size_t)m * (2 * most_width + 2 * most_q + 4 * d) * es);
    if (!scratch) return 1;
    char *qkv = scratch, *q = qkv + m * most_width * es, *k = q + m * most_q * es, *attn = k + m * most_width * es;
    char *pairs[2][2] = {{attn + m * most_q * es, attn + (m * most_q + m * d) * es},
                         {attn + (m * most_q + 2 * m * d) * es, attn + (m * most_q + 3 * m * d) * es}};
    const void *hidden = hidden_in, *normed = NULL;
    int failed = 0;
    for (int64_t i = 0; i < n_layers && !failed; i++) {
        const llm_layer_t *L = &layers[i];
        int64_t width = L->n_q + 2 * L->n_kv;
        int last = i == n_layers - 1;
        void *h_out = last ? hidden_out : pairs[i % 2][0];
        void *n_out = L->next_norm ? (last ? normed_out : pairs[i % 2][1]) : NULL;
        failed |= llm_layer_in(hidden, normed, L->input_norm, L->input_eps, &L->qkv, L->qkv_bias, L->n_q, L->n_kv,
                               L->head_dim, L->q_norm, L->k_norm, L->q_eps, L->k_eps, cos, sin, cos_ld, qkv, q, k, m,
                               d, lora ? lora + 7 * i : NULL, lora_rows, bf16, threads);
        failed |= llm_paged_decode(q, L->n_q, k, L->n_kv, qkv + (L->n_q + L->n_kv) * es, width, L->key_cache,
                                   L->value_cache, slots, block_tables, ld_bt, context_lens, attn, m,
                                   L->n_q / L->head_dim, L->n_kv / L->head_dim, L->head_dim, block_size, L->scaling,
                                   L->window, bf16, threads);
        failed |= llm_layer_out(attn, L->n_q, hidden, &L->o, L->o_bias, L->post_norm, L->post_eps, &L->gate_up,
                                L->gate_up_bias, &L->down, L->down_bias, L->next_norm, L->next_eps, h_out, n_out, m, d,
                                L->n_q, L->inter, lora ? lora + 7 * i + 3 : NULL, lora_rows, bf16, threads);
        hidden = h_out;
        normed = n_out;
    }
    free(scratch);
    return failed;
}

/* ---------------------------------------------------------------------------------------------------
 * A greedy step's pick: for each of b rows of logits [b, v] (row stride ld), out[r] = the first index of
 * the row's largest value (torch's argmax on finite rows) and out[b + r] = 1 if every value of the row is
 * finite, else 0 (the engine then takes its full path, which ends non-finite rows). One pass over the
 * logits where torch makes two (argmax, then isfinite + all: ~3 ms for 16 rows of a 49k vocabulary on a
 * 2-core Xeon, against ~0.2 ms here). */
int llm_greedy_pick(const void *logits, int64_t ld, int64_t b, int64_t v, int64_t *out, int bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (b > 1)
    for (int64_t r = 0; r < b; r++) {
        float best = -INFINITY;
        int64_t at = 0;
        int finite = 1;
        for (int64_t i = 0; i < v; i++) {
            float x = load_as_f32(logits, r * ld + i, bf16);
            if (!isfinite(x)) finite = 0;
            if (x > best) best = x, at = i;
        }
        out[r] = at;
        out[b + r] = finite;
    }
    return 0;
}
