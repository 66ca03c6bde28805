/* Products over weights kept in GGUF's block formats, and the formats' conversions (llm_api.kernels.cpu.quant
 * states the contract, the formats and why they are hand-written). Same build as kernels.c: one library,
 * -march=native (the AVX2 paths below where the compiler targets AVX2 + FMA + F16C, with VNNI's dot products in the
 * grouped rows' where it targets AVX512-VNNI or AVX-VNNI too: ROWS8_VNNI; scalar C elsewhere),
 * -ffp-contract=off (the de-quantization then rounds exactly where the gguf package's reference does).
 *
 * A product quantizes each input row once per call, per block of 32 values: one or two signed 8-bit digits a
 * value ("The product's input rows" below), a float32 unit, and the unit times the sum of each 16 and each 32
 * of the block's values (what the formats whose values are offset, q - 8 or d q + m, subtract or add). Each
 * weight block is unpacked once and multiplied with up to 4 input rows by integer dot products (maddubs: u8 x s8
 * pairs), the sub-block scales of the K formats applied as integers too (madd), then each block's sum times
 * (d_w d_x) is added to float32 sums kept per (weight row, input row): every row's result is computed by the
 * same instructions in the same order whatever the number of rows beside it, so a row's output never depends
 * on its batch (prefill chunks, decode batches, generate() and the engine give the same numbers). Changing a
 * kernel changes the key of the host's build cache (llm_api.kernels.cpu.library), so no stale library runs. */
#include "common.h"
#include "quant.h"

/* ---------------------------------------------------------------------------------------------------
 * float16 (the blocks' scales), with F16C where the compiler targets it */

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0 && mantissa == 0) {
        bits = sign;
    } else if (exponent == 0) { /* subnormal: normalize the mantissa */
        int shift = 0;
        while (!(mantissa & 0x400u)) mantissa <<= 1, shift++;
        bits = sign | ((uint32_t)(127 - 14 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

static inline uint16_t f32_to_fp16(float f) { /* to nearest even, as numpy's astype(float16) */
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);   /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* 65520 and above round to infinity */
    if (ax < 0x38800000u) {                                     /* below 2^-14: a subnormal or zero */
        if (ax < 0x33000000u) return (uint16_t)sign;            /* below 2^-25 (2^-25 itself ties to 0) */
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e, q = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t h = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13), rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* (a carry moves into the exponent, as it should) */
    return (uint16_t)(sign | h);
#endif
}

static inline float half_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return fp16_to_f32(v);
}

static inline void put_half(uint8_t *p, float v) {
    uint16_t h = f32_to_fp16(v);
    memcpy(p, &h, 2);
}

/* ---------------------------------------------------------------------------------------------------
 * The formats (ggml-common.h's layouts, GGUF's type ids):
 *   Q4_0  32 values: fp16 d, 16 bytes of nibbles (value j low, j + 16 high)        w = d (q - 8)
 *   Q4_1  32 values: fp16 d, fp16 m, 16 bytes of nibbles                            w = d q + m
 *   Q5_0  32 values: fp16 d, 32 high bits, 16 bytes of nibbles                      w = d (q - 16)
 *   Q5_1  32 values: fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles              w = d q + m
 *   Q8_0  32 values: fp16 d, 32 int8                                                w = d q
 *   Q4_K 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, 128 bytes of
 *        nibbles (bytes 32 c .. 32 c + 31: sub-block 2c low, 2c + 1 high)         w = d sc q - dmin m
 *   Q5_K 256 values: Q4_K's, then 32 bytes of high bits (bit j of byte l: sub-block j's value l), then nibbles
 *   Q6_K 256 values: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (sub-blocks of 16),
 *        fp16 d                                                                    w = d sc (q - 32) */

static int format_of(int64_t type, int64_t *block, int64_t *bytes) {
    switch (type) {
        case LLM_Q4_0: *block = 32, *bytes = 18; return 1;
        case LLM_Q4_1: *block = 32, *bytes = 20; return 1;
        case LLM_Q5_0: *block = 32, *bytes = 22; return 1;
        case LLM_Q5_1: *block = 32, *bytes = 24; return 1;
        case LLM_Q8_0: *block = 32, *bytes = 34; return 1;
        case LLM_Q4_K: *block = 256, *bytes = 144; return 1;
        case LLM_Q5_K: *block = 256, *bytes = 176; return 1;
        case LLM_Q6_K: *block = 256, *bytes = 210; return 1;
        default: return 0;
    }
}

/* The block size (values) and bytes of a format; 0 where this library does not know it. */
int llm_q_format(int64_t type, int64_t *block, int64_t *bytes) { return format_of(type, block, bytes); }

/* Sub-block j's 6-bit scale and min of a Q4_K / Q5_K block's 12 scale bytes. */
static inline void scale_min_k4(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* One row of k values (k a multiple of the block size), in the reference's operations and order. */
static void dequantize_row(int64_t type, const uint8_t *row, int64_t k, float *out) {
    int64_t block = 0, bytes = 0;
    format_of(type, &block, &bytes);
    for (int64_t b = 0; b < k / block; b++) {
        const uint8_t *p = row + b * bytes;
        float *o = out + b * block;
        switch (type) {
            case LLM_Q4_0: {
                float d = half_at(p);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)((p[2 + j] & 15) - 8);
                    o[j + 16] = d * (float)((p[2 + j] >> 4) - 8);
                }
                break;
            }
            case LLM_Q4_1: {
                float d = half_at(p), m = half_at(p + 2);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (float)(p[4 + j] & 15) + m;
                    o[j + 16] = d * (float)(p[4 + j] >> 4) + m;
                }
                break;
            }
            case LLM_Q5_0:
            case LLM_Q5_1: {
                int offset = type == LLM_Q5_1;
                float d = half_at(p), m = offset ? half_at(p + 2) : 0.0f;
                uint32_t high;
                memcpy(&high, p + 2 + 2 * offset, 4);
                const uint8_t *qs = p + 6 + 2 * offset;
                for (int j = 0; j < 16; j++) {
                    int lo = (qs[j] & 15) | (((high >> j) & 1) << 4), hi = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
                    if (offset) {
                        o[j] = d * (float)lo + m;
                        o[j + 16] = d * (float)hi + m;
                    } else {
                        o[j] = d * (float)(lo - 16);
                        o[j + 16] = d * (float)(hi - 16);
                    }
                }
                break;
            }
            case LLM_Q8_0: {
                float d = half_at(p);
                for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)p[2 + j] * d;
                break;
            }
            case LLM_Q4_K:
            case LLM_Q5_K: {
                float d = half_at(p), dmin = half_at(p + 2);
                const uint8_t *high = p + 16, *qs = p + 16 + (type == LLM_Q5_K ? 32 : 0);
                for (int j = 0; j < 8; j++) {
                    int scale, min;
                    scale_min_k4(p + 4, j, &scale, &min);
                    float ds = d * (float)scale, dm = dmin * (float)min;
                    const uint8_t *q = qs + (j / 2) * 32;
                    for (int l = 0; l < 32; l++) {
                        int v = (q[l] >> (4 * (j & 1))) & 15;
                        if (type == LLM_Q5_K) v |= ((high[l] >> j) & 1) << 4;
                        o[j * 32 + l] = ds * (float)v - dm;
                    }
                }
                break;
            }
            case LLM_Q6_K: {
                const uint8_t *ql = p, *qh = p + 128;
                const int8_t *scales = (const int8_t *)(p + 192);
                float d = half_at(p + 208);
                for (int h = 0; h < 2; h++)
                    for (int g = 0; g < 4; g++)
                        for (int l = 0; l < 32; l++) {
                            int at = h * 128 + g * 32 + l;
                            int v = ((ql[h * 64 + (g & 1) * 32 + l] >> (4 * (g >> 1))) & 15) |
                                    (((qh[h * 32 + l] >> (2 * g)) & 3) << 4);
                            o[at] = (d * (float)scales[at / 16]) * (float)(v - 32);
                        }
                break;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------
 * Quantization of float32 weights (QUANTIZATION at load). Q8_0, Q4_0, Q4_1 and Q5_0 as the gguf package's
 * quantizers (llama.cpp's reference ones): the same values, bit for bit. Q4_K and Q6_K by a simpler rule
 * than llama.cpp's (no search for the scale that least squares the error): each sub-block's scale from its
 * range, the scales themselves quantized against the block's largest, the values rounded to nearest. */

/* The value bits of one block of `type` (its 32 or 256 integers as block_values below reads them back: unsigned,
 * Q8_0's signed) written into the block at p; its scale fields are left as they are. The quantizers and the
 * grouped layout's way back (from_rows8) share it. */
static void put_block_values(int64_t type, const int *values, uint8_t *p) {
    switch (type) {
        case LLM_Q4_0:
        case LLM_Q4_1:
        case LLM_Q5_0: {
            uint8_t *qs = p + (type == LLM_Q4_1 ? 4 : 2);
            if (type == LLM_Q5_0) {
                uint32_t high = 0;
                for (int j = 0; j < 32; j++) high |= (uint32_t)((values[j] >> 4) & 1) << j;
                memcpy(p + 2, &high, 4);
                qs = p + 6;
            }
            for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((values[j] & 15) | (values[j + 16] & 15) << 4);
            break;
        }
        case LLM_Q8_0:
            for (int j = 0; j < 32; j++) p[2 + j] = (uint8_t)(int8_t)values[j];
            break;
        case LLM_Q4_K:
        case LLM_Q5_K: {
            int five = type == LLM_Q5_K;
            uint8_t *qs = p + 16 + (five ? 32 : 0);
            memset(p + 16, 0, five ? 160 : 128);
            for (int j = 0; j < 8; j++)
                for (int l = 0; l < 32; l++) {
                    qs[(j / 2) * 32 + l] |= (uint8_t)((values[j * 32 + l] & 15) << (4 * (j & 1)));
                    if (five) p[16 + l] |= (uint8_t)(((values[j * 32 + l] >> 4) & 1) << j);
                }
            break;
        }
        case LLM_Q6_K: {
            uint8_t *ql = p, *qh = p + 128;
            memset(ql, 0, 192);
            for (int at = 0; at < 256; at++) {
                int v = values[at], h = at / 128, g = (at % 128) / 32, l = at % 32;
                ql[h * 64 + (g & 1) * 32 + l] |= (uint8_t)((v & 15) << (4 * (g >> 1)));
                qh[h * 32 + l] |= (uint8_t)(((v >> 4) & 3) << (2 * g));
            }
            break;
        }
    }
}

static void quantize_q8_0(const float *x, uint8_t *p) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    put_half(p, d);
    for (int j = 0; j < 32; j++) p[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* The value of largest magnitude, with its sign (the first such, as numpy's argmax). */
static float signed_max(const float *x, int n) {
    float best = 0.0f, most = -1.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(x[j]) > most) most = fabsf(x[j]), best = x[j];
    return best;
}

static void quantize_q4_0_or_q5_0(const float *x, uint8_t *p, int five) {
    float levels = five ? -16.0f : -8.0f, center = five ? 16.5f : 8.5f;
    int top = five ? 31 : 15;
    float d = signed_max(x, 32) / levels, id = d != 0.0f ? 1.0f / d : 0.0f;
    put_half(p, d);
    int q[32];
    for (int j = 0; j < 32; j++) {
        int v = (int)(x[j] * id + center);
        q[j] = v < 0 ? 0 : v > top ? top : v;
    }
    put_block_values(five ? LLM_Q5_0 : LLM_Q4_0, q, p);
}

static void quantize_q4_1(const float *x, uint8_t *p) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < 32; j++) lo = fminf(lo, x[j]), hi = fmaxf(hi, x[j]);
    float d = (hi - lo) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    put_half(p, d);
    put_half(p + 2, lo);
    int q[32];
    for (int j = 0; j < 32; j++) {
        int v = (int)((x[j] - lo) * id + 0.5f);
        q[j] = v < 0 ? 0 : v > 15 ? 15 : v;
    }
    put_block_values(LLM_Q4_1, q, p);
}

static inline int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static void quantize_q4_k(const float *x, uint8_t *p) {
    float scales[8], mins[8], most_scale = 0.0f, most_min = 0.0f;
    for (int j = 0; j < 8; j++) {
        float lo = 0.0f, hi = x[j * 32];
        for (int l = 0; l < 32; l++) lo = fminf(lo, x[j * 32 + l]), hi = fmaxf(hi, x[j * 32 + l]);
        scales[j] = (hi - lo) / 15.0f;
        mins[j] = -lo;
        most_scale = fmaxf(most_scale, scales[j]);
        most_min = fmaxf(most_min, mins[j]);
    }
    float d = most_scale / 63.0f, dmin = most_min / 63.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f, idmin = dmin != 0.0f ? 1.0f / dmin : 0.0f;
    int sc[8], mn[8];
    for (int j = 0; j < 8; j++) {
        sc[j] = clamp_int((int)nearbyintf(scales[j] * id), 0, 63);
        mn[j] = clamp_int((int)nearbyintf(mins[j] * idmin), 0, 63);
    }
    put_half(p, d);
    put_half(p + 2, dmin);
    uint8_t *s = p + 4;
    memset(s, 0, 12);
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)(mn[j] | ((mn[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
    float stored_d = half_at(p), stored_dmin = half_at(p + 2);
    int q[256];
    for (int j = 0; j < 8; j++) {
        float ds = stored_d * (float)sc[j], dm = stored_dmin * (float)mn[j];
        float ids = ds != 0.0f ? 1.0f / ds : 0.0f;
        for (int l = 0; l < 32; l++) q[j * 32 + l] = clamp_int((int)nearbyintf((x[j * 32 + l] + dm) * ids), 0, 15);
    }
    put_block_values(LLM_Q4_K, q, p);
}

static void quantize_q6_k(const float *x, uint8_t *p) {
    float scales[16], most = 0.0f;
    for (int j = 0; j < 16; j++) {
        scales[j] = signed_max(x + j * 16, 16) / -32.0f;
        most = fmaxf(most, fabsf(scales[j]));
    }
    float d = most / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int8_t *sc = (int8_t *)(p + 192);
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)clamp_int((int)nearbyintf(scales[j] * id), -128, 127);
    put_half(p + 208, d);
    float stored_d = half_at(p + 208);
    int q[256];
    for (int at = 0; at < 256; at++) {
        float ds = stored_d * (float)sc[at / 16], ids = ds != 0.0f ? 1.0f / ds : 0.0f;
        q[at] = clamp_int((int)nearbyintf(x[at] * ids) + 32, 0, 63);
    }
    put_block_values(LLM_Q6_K, q, p);
}

/* n rows of k float32 values into rows of `type` blocks at out (row after row). 2: a type this library does
 * not quantize to, or k not whole blocks. */
int llm_q_quantize(int64_t type, const float *x, int64_t n, int64_t k, void *out, int threads) {
    int64_t block, bytes;
    if (!format_of(type, &block, &bytes) || k <= 0 || k % block) return 2;
    if (type != LLM_Q8_0 && type != LLM_Q4_0 && type != LLM_Q4_1 && type != LLM_Q5_0 && type != LLM_Q4_K &&
        type != LLM_Q6_K)
        return 2;
    int64_t blocks = n * (k / block);
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const float *v = x + b * block;
        uint8_t *p = (uint8_t *)out + b * bytes;
        switch (type) {
            case LLM_Q8_0: quantize_q8_0(v, p); break;
            case LLM_Q4_0: quantize_q4_0_or_q5_0(v, p, 0); break;
            case LLM_Q5_0: quantize_q4_0_or_q5_0(v, p, 1); break;
            case LLM_Q4_1: quantize_q4_1(v, p); break;
            case LLM_Q4_K: quantize_q4_k(v, p); break;
            case LLM_Q6_K: quantize_q6_k(v, p); break;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * The product's input rows, quantized per block of 32 values, in one of two precisions (the product's `digits`,
 * QUANT_ACTIVATIONS at load):
 *   2 (the default): two signed 8-bit digits a value, x ~ unit (127 hi + lo): hi = x / (max|x| / 63) rounded
 *     (|hi| <= 63), lo the rest in units of unit = max|x| / (63 x 127) (|lo| <= 64): ~13 bits a block. hi keeps
 *     to 7 bits so that any unsigned weight byte (0..255) times a digit, summed in pairs, fits maddubs' 16 bits
 *     (Q8_0's values are stored with their sign bit flipped in the grouped layout and read as unsigned). Each
 *     product costs two integer dot products a value (the weights' bytes unpacked once for both digits).
 *   1: one signed 8-bit digit, x ~ unit hi, unit = max|x| / 127 (|hi| <= 127): llama.cpp's Q8_0 / Q8_1
 *     activations, one dot product a value. Q8_0's weights are then multiplied signed (maddubs of |w| and the
 *     digit given w's sign: 2 x 128 x 127 fits 16 bits), the other formats' values are unsigned below 64.
 * Why two below 1B parameters (QUANT_ACTIVATIONS=auto): with one digit the embedded model's greedy answers change
 * where large and small values share a block (SmolLM2-135M's Q4_1 file answers "What is the capital of France?"
 * with "L'Étoile, la Marseillaise..." as llama.cpp does on the same file, where two digits and float activations
 * answer "The capital of France is Paris."; docs/model-options.md); from 1B up the products are most of a step,
 * and one digit is llama.cpp's precision (its perplexity to 0.03% on the same file). Also stored: `unit`, and
 * unit x the digits' sum (127 hi + lo, or hi) of each half block and each block (what the formats whose values
 * are offset, q - 8 or d q + m, subtract or add). Rounding is to nearest even. A block holding an infinity or a
 * NaN gets unit = NaN (and digits 0): the row's outputs become NaN, as a float product's would, and the engine's
 * finiteness check sees them. */

typedef struct {
    int8_t *hi, *lo;      /* [m][k] each (lo all 0 with one digit) */
    float *d, *s32, *s16; /* unit, unit x digit sums: [m][k / 32], [m][k / 32], [m][k / 16] */
    int64_t k, blocks;    /* k / 32 */
} acts_t;

/* The factor of hi in a value: 127 with two digits, 1 with one. */
#define HI_WEIGHT(digits) ((digits) == 2 ? 127 : 1)

static void quantize_acts_row(const void *x, int bf16, int64_t k, int digits, int8_t *hi, int8_t *lo, float *d,
                              float *s32, float *s16) {
    for (int64_t b = 0; b < k / 32; b++) {
        float v[32];
        for (int j = 0; j < 32; j++) v[j] = load_as_f32(x, b * 32 + j, bf16);
        float amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < 32; j++) {
            if (!isfinite(v[j])) finite = 0;
            amax = fmaxf(amax, fabsf(v[j]));
        }
        int8_t *hb = hi + b * 32, *lb = lo + b * 32;
        if (!finite) {
            memset(hb, 0, 32);
            memset(lb, 0, 32);
            d[b] = s32[b] = s16[2 * b] = s16[2 * b + 1] = NAN;
            continue;
        }
        float scale = amax / (digits == 2 ? 63.0f : 127.0f), inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        float unit = scale / (float)HI_WEIGHT(digits), inverse_unit = unit != 0.0f ? 1.0f / unit : 0.0f;
        int sums[2] = {0, 0};
#if defined(__AVX2__)
        const __m256 iv = _mm256_set1_ps(inverse), sv = _mm256_set1_ps(scale), uv = _mm256_set1_ps(inverse_unit);
        __m256i h[4], l[4];
        const __m256i most = _mm256_set1_epi32(64), least = _mm256_set1_epi32(-64);
        for (int i = 0; i < 4; i++) {
            __m256 values = _mm256_loadu_ps(v + 8 * i);
            h[i] = _mm256_cvtps_epi32(_mm256_mul_ps(values, iv));
            __m256 rest = _mm256_sub_ps(values, _mm256_mul_ps(_mm256_cvtepi32_ps(h[i]), sv));
            l[i] = digits == 2 ? _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(rest, uv)), most), least)
                               : _mm256_setzero_si256();
        }
        /* (the packs interleave the 128-bit lanes: 4-value groups 0 4 1 5 2 6 3 7 back into order) */
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(h[0], h[1]), _mm256_packs_epi32(h[2], h[3]));
        _mm256_storeu_si256((__m256i *)hb, _mm256_permutevar8x32_epi32(packed, order));
        packed = _mm256_packs_epi16(_mm256_packs_epi32(l[0], l[1]), _mm256_packs_epi32(l[2], l[3]));
        _mm256_storeu_si256((__m256i *)lb, _mm256_permutevar8x32_epi32(packed, order));
#else
        for (int j = 0; j < 32; j++) {
            float whole = nearbyintf(v[j] * inverse), rest = nearbyintf((v[j] - whole * scale) * inverse_unit);
            hb[j] = (int8_t)whole;
            lb[j] = digits == 2 ? (int8_t)(rest > 64.0f ? 64.0f : rest < -64.0f ? -64.0f : rest) : 0;
        }
#endif
        for (int j = 0; j < 32; j++) sums[j / 16] += HI_WEIGHT(digits) * hb[j] + lb[j];
        d[b] = unit;
        s16[2 * b] = unit * (float)sums[0];
        s16[2 * b + 1] = unit * (float)sums[1];
        s32[b] = unit * (float)(sums[0] + sums[1]);
    }
}

/* ---------------------------------------------------------------------------------------------------
 * The tiles: NR weight rows x up to QMR input rows, over the whole of K. For each 32-value block of a
 * weight row: its values as 32 bytes `w` (unsigned, 0..63; Q8_0's signed), `mul` the 16-bit factors of
 * its pair sums (1, or the K formats' sub-block scales), `scale` the float factor of its integer sum (d),
 * and the constants of its offset term: `lo` times d_x sum(x) of its first 16 values plus `hi` times that
 * of its last 16 (equal for the formats whose offset covers 32: then times the block's sum). */

#define NR 2
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 512
#endif
#define QMR 4

/* How far ahead of its use, and into which cache, the grouped products (rows8_dot) fetch a weight's bytes. A
 * one-row product (decode) is bound by memory: what it reads once per token. On AVX2 builds 4 group blocks ahead
 * into L1 (tuned on the 2-core AMD EPYC Zen 3). On AVX-512 builds 3 KB ahead into L2 (T1): on the 2-core Intel Xeon
 * (SPR class) an L1 prefetch holds one of the core's few line-fill buffers until the line arrives, an L2 one leaves
 * the L2's deeper queue to wait; over 0.6 GB of Q4_K/Q6_K weights (a 1B model's layers) one-row products read
 * 16.5-17.1 GB/s against 15.0-15.2 (Q4_1: 21.1 against 17.6; the best of 7 alternating rounds, 2 threads). Zen 4,
 * also built with AVX-512, was not measured. */
#if defined(__AVX512F__)
#define ROWS8_PREFETCH_AHEAD(bytes) 3072
#define ROWS8_PREFETCH_HINT _MM_HINT_T1
#else
#define ROWS8_PREFETCH_AHEAD(bytes) (8 * (bytes) * PREFETCH_BLOCKS)
#define ROWS8_PREFETCH_HINT _MM_HINT_T0
#endif

typedef struct {
    float scale, lo, hi;
    int16_t mul_lo, mul_hi;
} block_terms_t;

/* Per format: the offset is per half block (Q6_K), per block, or none (Q8_0). */
#define OFFSET_NONE 0
#define OFFSET_BLOCK 1
#define OFFSET_HALVES 2
static inline int offset_kind(int64_t type) {
    return type == LLM_Q8_0 ? OFFSET_NONE : type == LLM_Q6_K ? OFFSET_HALVES : OFFSET_BLOCK;
}

/* Block b (of 32 values) of a weight row: its terms, and its values into `bytes` (scalar) or `w` (AVX2). */
static inline __attribute__((always_inline)) block_terms_t block_terms(const int64_t type, const uint8_t *row,
                                                                      int64_t b) {
    block_terms_t t = {0.0f, 0.0f, 0.0f, 1, 1};
    switch (type) {
        case LLM_Q4_0: { const uint8_t *p = row + b * 18; t.scale = half_at(p); t.lo = t.hi = -8.0f * t.scale; break; }
        case LLM_Q4_1: { const uint8_t *p = row + b * 20; t.scale = half_at(p); t.lo = t.hi = half_at(p + 2); break; }
        case LLM_Q5_0: { const uint8_t *p = row + b * 22; t.scale = half_at(p); t.lo = t.hi = -16.0f * t.scale; break; }
        case LLM_Q5_1: { const uint8_t *p = row + b * 24; t.scale = half_at(p); t.lo = t.hi = half_at(p + 2); break; }
        case LLM_Q8_0: { t.scale = half_at(row + b * 34); break; }
        case LLM_Q4_K:
        case LLM_Q5_K: {
            const uint8_t *p = row + (b / 8) * (type == LLM_Q4_K ? 144 : 176);
            int scale, min;
            scale_min_k4(p + 4, (int)(b % 8), &scale, &min);
            t.scale = half_at(p);
            t.lo = t.hi = -(half_at(p + 2) * (float)min);
            t.mul_lo = t.mul_hi = (int16_t)scale;
            break;
        }
        case LLM_Q6_K: {
            const uint8_t *p = row + (b / 8) * 210;
            const int8_t *scales = (const int8_t *)(p + 192);
            int at = (int)(b % 8) * 2; /* (sub-blocks of 16: this block's two) */
            t.scale = half_at(p + 208);
            t.mul_lo = scales[at];
            t.mul_hi = scales[at + 1];
            t.lo = -32.0f * (t.scale * (float)scales[at]);
            t.hi = -32.0f * (t.scale * (float)scales[at + 1]);
            break;
        }
    }
    return t;
}

/* The 32 values of block b as integers (unsigned, or Q8_0's signed): the scalar path's unpacking. */
static inline void block_values(const int64_t type, const uint8_t *row, int64_t b, int values[32]) {
    switch (type) {
        case LLM_Q4_0:
        case LLM_Q4_1: {
            const uint8_t *qs = row + b * (type == LLM_Q4_0 ? 18 : 20) + (type == LLM_Q4_0 ? 2 : 4);
            for (int j = 0; j < 16; j++) values[j] = qs[j] & 15, values[j + 16] = qs[j] >> 4;
            break;
        }
        case LLM_Q5_0:
        case LLM_Q5_1: {
            const uint8_t *p = row + b * (type == LLM_Q5_0 ? 22 : 24), *qh = p + (type == LLM_Q5_0 ? 2 : 4);
            uint32_t high;
            memcpy(&high, qh, 4);
            for (int j = 0; j < 16; j++) {
                values[j] = (qh[4 + j] & 15) | (((high >> j) & 1) << 4);
                values[j + 16] = (qh[4 + j] >> 4) | (((high >> (j + 16)) & 1) << 4);
            }
            break;
        }
        case LLM_Q8_0:
            for (int j = 0; j < 32; j++) values[j] = (int8_t)row[b * 34 + 2 + j];
            break;
        case LLM_Q4_K:
        case LLM_Q5_K: {
            int five = type == LLM_Q5_K;
            const uint8_t *p = row + (b / 8) * (five ? 176 : 144);
            int j = (int)(b % 8);
            const uint8_t *q = p + 16 + (five ? 32 : 0) + (j / 2) * 32;
            for (int l = 0; l < 32; l++) {
                values[l] = (q[l] >> (4 * (j & 1))) & 15;
                if (five) values[l] |= ((p[16 + l] >> j) & 1) << 4;
            }
            break;
        }
        case LLM_Q6_K: {
            const uint8_t *p = row + (b / 8) * 210;
            int h = (int)(b % 8) / 4, g = (int)(b % 4);
            for (int l = 0; l < 32; l++)
                values[l] = ((p[h * 64 + (g & 1) * 32 + l] >> (4 * (g >> 1))) & 15) |
                            (((p[128 + h * 32 + l] >> (2 * g)) & 3) << 4);
            break;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* Byte j of the result: 0x10 where bit j of `bits` is set, else 0 (Q5's fifth bits). */
static inline __m256i fifth_bits(uint32_t bits) {
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                         _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

static inline __m256i nibbles(const uint8_t *p) { /* 16 bytes -> 32 values: low nibbles first */
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

static inline __attribute__((always_inline)) __m256i block_vector(const int64_t type, const uint8_t *row, int64_t b) {
    const __m256i low = _mm256_set1_epi8(15);
    switch (type) {
        case LLM_Q4_0: return nibbles(row + b * 18 + 2);
        case LLM_Q4_1: return nibbles(row + b * 20 + 4);
        case LLM_Q5_0:
        case LLM_Q5_1: {
            const uint8_t *qh = row + b * (type == LLM_Q5_0 ? 22 : 24) + (type == LLM_Q5_0 ? 2 : 4);
            uint32_t high;
            memcpy(&high, qh, 4);
            return _mm256_or_si256(nibbles(qh + 4), fifth_bits(high));
        }
        case LLM_Q8_0: return _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2));
        case LLM_Q4_K:
        case LLM_Q5_K: {
            int five = type == LLM_Q5_K, j = (int)(b % 8);
            const uint8_t *p = row + (b / 8) * (five ? 176 : 144);
            __m256i q = _mm256_loadu_si256((const __m256i *)(p + 16 + (five ? 32 : 0) + (j / 2) * 32));
            __m256i v = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, low);
            if (five) {
                __m256i high = _mm256_loadu_si256((const __m256i *)(p + 16));
                high = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
                v = _mm256_or_si256(v, _mm256_slli_epi16(high, 4));
            }
            return v;
        }
        case LLM_Q6_K: {
            const uint8_t *p = row + (b / 8) * 210;
            int h = (int)(b % 8) / 4, g = (int)(b % 4);
            __m256i ql = _mm256_loadu_si256((const __m256i *)(p + h * 64 + (g & 1) * 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + h * 32));
            ql = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(ql, 4) : ql, low);
            qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
            return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
        }
    }
    return _mm256_setzero_si256();
}
#endif

/* sums[i][a] = weight row w[i] . input row r0 + a, for a < mr (mr and digits compile-time constants where
 * inlined). */
static inline __attribute__((always_inline)) void tile(const int64_t type, const int digits, const uint8_t *const w[NR],
                                                       const acts_t *x, int64_t r0, const int mr, float sums[NR][QMR]) {
    const int offsets = offset_kind(type);
    float offset[NR][QMR];
    for (int i = 0; i < NR; i++)
        for (int a = 0; a < mr; a++) offset[i][a] = 0.0f;
    const int8_t *xh[QMR], *xl[QMR];
    const float *xd[QMR], *x32[QMR], *x16[QMR];
    for (int a = 0; a < mr; a++) {
        xh[a] = x->hi + (r0 + a) * x->k;
        xl[a] = x->lo + (r0 + a) * x->k;
        xd[a] = x->d + (r0 + a) * x->blocks;
        x32[a] = x->s32 + (r0 + a) * x->blocks;
        x16[a] = x->s16 + (r0 + a) * 2 * x->blocks;
    }
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[NR][QMR];
    for (int i = 0; i < NR; i++)
        for (int a = 0; a < mr; a++) acc[i][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x->blocks; b++) {
        __m256i wv[NR], mul[NR], mul127[NR];
        block_terms_t t[NR];
        for (int i = 0; i < NR; i++) {
            _mm_prefetch((const char *)w[i] + PREFETCH_BYTES + b * 20, _MM_HINT_T0);
            t[i] = block_terms(type, w[i], b);
            wv[i] = block_vector(type, w[i], b);
            mul[i] = _mm256_set_m128i(_mm_set1_epi16(t[i].mul_hi), _mm_set1_epi16(t[i].mul_lo));
            mul127[i] = _mm256_mullo_epi16(mul[i], _mm256_set1_epi16(HI_WEIGHT(digits)));
        }
        for (int a = 0; a < mr; a++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xh[a] + b * 32));
            __m256i xr = _mm256_loadu_si256((const __m256i *)(xl[a] + b * 32));
            float dx = xd[a][b];
            for (int i = 0; i < NR; i++) {
                __m256i high, low;
                if (type == LLM_Q8_0) {
                    __m256i magnitude = _mm256_sign_epi8(wv[i], wv[i]);
                    high = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, wv[i]));
                    low = digits == 2 ? _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xr, wv[i])) : high;
                } else {
                    high = _mm256_maddubs_epi16(wv[i], xv);
                    low = digits == 2 ? _mm256_maddubs_epi16(wv[i], xr) : high;
                }
                __m256i whole = _mm256_madd_epi16(high, mul127[i]);
                if (digits == 2) whole = _mm256_add_epi32(whole, _mm256_madd_epi16(low, mul[i]));
                __m256 sum = _mm256_cvtepi32_ps(whole);
                acc[i][a] = _mm256_fmadd_ps(sum, _mm256_set1_ps(t[i].scale * dx), acc[i][a]);
                if (offsets == OFFSET_BLOCK) offset[i][a] += t[i].lo * x32[a][b];
                else if (offsets == OFFSET_HALVES) offset[i][a] += t[i].lo * x16[a][2 * b] + t[i].hi * x16[a][2 * b + 1];
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int a = 0; a < mr; a++) sums[i][a] = hsum256(acc[i][a]) + offset[i][a];
#else
    float acc[NR][QMR];
    for (int i = 0; i < NR; i++)
        for (int a = 0; a < mr; a++) acc[i][a] = 0.0f;
    for (int64_t b = 0; b < x->blocks; b++) {
        for (int i = 0; i < NR; i++) {
            block_terms_t t = block_terms(type, w[i], b);
            int values[32];
            block_values(type, w[i], b, values);
            for (int a = 0; a < mr; a++) {
                const int8_t *h = xh[a] + b * 32, *r = xl[a] + b * 32;
                int lo = 0, hi = 0;
                for (int l = 0; l < 16; l++) {
                    lo += values[l] * (HI_WEIGHT(digits) * h[l] + r[l]);
                    hi += values[l + 16] * (HI_WEIGHT(digits) * h[l + 16] + r[l + 16]);
                }
                acc[i][a] += (float)(lo * t.mul_lo + hi * t.mul_hi) * (t.scale * xd[a][b]);
                if (offsets == OFFSET_BLOCK) offset[i][a] += t.lo * x32[a][b];
                else if (offsets == OFFSET_HALVES) offset[i][a] += t.lo * x16[a][2 * b] + t.hi * x16[a][2 * b + 1];
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int a = 0; a < mr; a++) sums[i][a] = acc[i][a] + offset[i][a];
#endif
}

/* ---------------------------------------------------------------------------------------------------
 * Rows in groups of 8 (LLM_LAYOUT_ROWS8), repacked once at load: the same bytes as GGUF's blocks, reordered
 * so that one block of 8 rows is read side by side, 4 values of each row in a 32-bit lane: a 32-byte vector
 * holds values 4v .. 4v + 3 of the 8 rows (row r in lane r). One input block's 4 values broadcast to every
 * lane, a u8 x s8 dot product (maddubs) gives each row its part in its own lane, so the 8 rows' sums come out
 * as one vector without a horizontal reduction (the earlier layout, 32 values of one row in a vector, spent
 * more on the 6 horizontal adds a block than on the products), summed in 16 bits as far as the values allow
 * before they widen to 32. In GGUF's order each block of one row costs the product its scale conversions, its
 * unpacking and a float multiply-add per 32 values (~18 instructions on AVX2); here the 8 rows' scales are one
 * vector and there is one float multiply-add for the 8 rows. Group block b of a group (8 x the format's block
 * bytes, at group + b x 8 x bytes), each 32-value sub-block's values as `V`: 4 vectors of 32 bytes, byte 4 r + i
 * of vector v holding row r's value 4 v + i in its low nibble and value 16 + 4 v + i in its high nibble:
 *   Q4_0  8 d (fp16) | V
 *   Q4_1  8 d | 8 m | V
 *   Q5_0  8 d | 32 bytes of fifth bits (byte 4 r + i: bit v = that of row r's value 4 v + i, bit 4 + v = value
 *         16 + 4 v + i's) | V
 *   Q8_0  8 d | 8 vectors of 32 bytes: byte 4 r + i of vector v = row r's value 4 v + i + 128 (the sign bit
 *         flipped: read as unsigned, like the 4-bit formats, with two digits)
 *   Q4_K  8 d | 8 dmin | 12 x 8 scale bytes (scale byte i of row r at 8 i + r) | 8 sub-blocks x V
 *   Q5_K  Q4_K's scales | 8 sub-blocks x (V, then 32 bytes of fifth bits as Q5_0's)
 *   Q6_K  8 d | 8 blocks of 32 x (8 rows' first-half scales, 8 rows' second-half scales) | 8 blocks of 32 x
 *         (V, then 2 x 32 bytes of high bits: bits 2 v, 2 v + 1 of byte 4 r + i of the first = those of row r's
 *         value 4 v + i, of the second = value 16 + 4 v + i's)
 * Rows past the last whole group keep GGUF's layout (the generic tiles above compute them). */

static int rows8_known(int64_t type) {
    return type == LLM_Q4_0 || type == LLM_Q4_1 || type == LLM_Q5_0 || type == LLM_Q8_0 || type == LLM_Q4_K ||
           type == LLM_Q5_K || type == LLM_Q6_K;
}

/* The formats of 256 values in 8 sub-blocks of 32 (a group block holds 8 sub-blocks' V); of them, those with
 * Q4_K's scale fields (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins); and those with a fifth bit. */
static inline int k_format(int64_t type) { return type == LLM_Q4_K || type == LLM_Q5_K || type == LLM_Q6_K; }
static inline int k4_scales(int64_t type) { return type == LLM_Q4_K || type == LLM_Q5_K; }
static inline int five_bits(int64_t type) { return type == LLM_Q5_0 || type == LLM_Q5_K; }

/* Where a group block's values of sub-block c start, and (Q5_0, Q5_K, Q6_K) where their high bits are. */
static inline const uint8_t *rows8_values(const int64_t type, const uint8_t *g, int c) {
    switch (type) {
        case LLM_Q4_0: return g + 16;
        case LLM_Q4_1: return g + 32;
        case LLM_Q5_0: return g + 48;
        case LLM_Q8_0: return g + 16;
        case LLM_Q4_K: return g + 128 + 128 * c;
        case LLM_Q5_K: return g + 128 + 160 * c;
        default: return g + 144 + 192 * c; /* Q6_K */
    }
}
static inline const uint8_t *rows8_highs(const int64_t type, const uint8_t *g, int c) {
    return type == LLM_Q5_0 ? g + 16 : rows8_values(type, g, c) + 128;
}

/* 8 rows' values of one 32-value sub-block (values[r][l], GGUF's integers: Q8_0's signed) into its V (and its
 * high bits) at q (h). */
static void pack_values(int64_t type, int values[8][32], uint8_t *q, uint8_t *h) {
    if (type == LLM_Q8_0) {
        for (int v = 0; v < 8; v++)
            for (int r = 0; r < 8; r++)
                for (int i = 0; i < 4; i++) q[32 * v + 4 * r + i] = (uint8_t)(values[r][4 * v + i] + 128);
        return;
    }
    if (five_bits(type)) memset(h, 0, 32);
    if (type == LLM_Q6_K) memset(h, 0, 64);
    for (int v = 0; v < 4; v++)
        for (int r = 0; r < 8; r++)
            for (int i = 0; i < 4; i++) {
                int lo = values[r][4 * v + i], hi = values[r][16 + 4 * v + i], at = 4 * r + i;
                q[32 * v + at] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                if (five_bits(type)) h[at] |= (uint8_t)(((lo >> 4) & 1) << v | ((hi >> 4) & 1) << (4 + v));
                if (type == LLM_Q6_K) {
                    h[at] |= (uint8_t)(((lo >> 4) & 3) << (2 * v));
                    h[32 + at] |= (uint8_t)(((hi >> 4) & 3) << (2 * v));
                }
            }
}

/* Row `lane`'s values of one sub-block back from its V (and high bits): pack_values' inverse. */
static void unpack_values(int64_t type, const uint8_t *q, const uint8_t *h, int lane, int out[32]) {
    for (int v = 0; v < (type == LLM_Q8_0 ? 8 : 4); v++)
        for (int i = 0; i < 4; i++) {
            int at = 4 * lane + i;
            if (type == LLM_Q8_0) {
                out[4 * v + i] = (int)q[32 * v + at] - 128;
                continue;
            }
            int lo = q[32 * v + at] & 15, hi = q[32 * v + at] >> 4;
            if (five_bits(type)) {
                lo |= ((h[at] >> v) & 1) << 4;
                hi |= ((h[at] >> (4 + v)) & 1) << 4;
            } else if (type == LLM_Q6_K) {
                lo |= ((h[at] >> (2 * v)) & 3) << 4;
                hi |= ((h[32 + at] >> (2 * v)) & 3) << 4;
            }
            out[4 * v + i] = lo;
            out[16 + 4 * v + i] = hi;
        }
}

/* 8 rows' GGUF block b (rows[i] points at row i) -> the group block at g. */
static void to_rows8(int64_t type, const uint8_t *const rows[8], int64_t b, int64_t bytes, uint8_t *g) {
    int per = k_format(type) ? 8 : 1;
    const uint8_t *block[8];
    for (int r = 0; r < 8; r++) block[r] = rows[r] + b * bytes;
    switch (type) { /* the scales */
        case LLM_Q4_0: case LLM_Q5_0: case LLM_Q8_0:
            for (int r = 0; r < 8; r++) memcpy(g + 2 * r, block[r], 2);
            break;
        case LLM_Q4_1: case LLM_Q4_K: case LLM_Q5_K:
            for (int r = 0; r < 8; r++) memcpy(g + 2 * r, block[r], 2), memcpy(g + 16 + 2 * r, block[r] + 2, 2);
            if (k4_scales(type))
                for (int i = 0; i < 12; i++)
                    for (int r = 0; r < 8; r++) g[32 + 8 * i + r] = block[r][4 + i];
            break;
        case LLM_Q6_K:
            for (int r = 0; r < 8; r++) memcpy(g + 2 * r, block[r] + 208, 2);
            for (int c = 0; c < 8; c++)
                for (int r = 0; r < 8; r++) {
                    g[16 + 16 * c + r] = block[r][192 + 2 * c];
                    g[16 + 16 * c + 8 + r] = block[r][192 + 2 * c + 1];
                }
            break;
    }
    for (int c = 0; c < per; c++) {
        int values[8][32];
        for (int r = 0; r < 8; r++) block_values(type, block[r], c, values[r]);
        pack_values(type, values, (uint8_t *)rows8_values(type, g, c), (uint8_t *)rows8_highs(type, g, c));
    }
}

/* Row `lane` (0..7) of group block g as its GGUF block (at out): its scale fields copied back, its values
 * unpacked and written as GGUF stores them. */
static void from_rows8(int64_t type, const uint8_t *g, int lane, uint8_t *out) {
    int per = k_format(type) ? 8 : 1;
    int values[256];
    for (int c = 0; c < per; c++) unpack_values(type, rows8_values(type, g, c), rows8_highs(type, g, c), lane, values + 32 * c);
    switch (type) {
        case LLM_Q4_0: case LLM_Q5_0: case LLM_Q8_0:
            memcpy(out, g + 2 * lane, 2);
            break;
        case LLM_Q4_1: case LLM_Q4_K: case LLM_Q5_K:
            memcpy(out, g + 2 * lane, 2);
            memcpy(out + 2, g + 16 + 2 * lane, 2);
            if (k4_scales(type))
                for (int i = 0; i < 12; i++) out[4 + i] = g[32 + 8 * i + lane];
            break;
        case LLM_Q6_K:
            memcpy(out + 208, g + 2 * lane, 2);
            for (int c = 0; c < 8; c++) {
                out[192 + 2 * c] = g[16 + 16 * c + lane];
                out[192 + 2 * c + 1] = g[16 + 16 * c + 8 + lane];
            }
            break;
    }
    put_block_values(type, values, out);
}

/* A weight of `rows` rows of k values between the layouts: to_rows8 1 (GGUF's -> groups of 8), 0 (back).
 * Rows past the last whole group are copied as they are. 2: a type without a grouped layout, or k not whole
 * blocks. */
int llm_q_repack(int64_t type, const void *src, int64_t rows, int64_t k, void *dst, int to_rows8_layout, int threads) {
    int64_t block, bytes;
    if (!format_of(type, &block, &bytes) || !rows8_known(type) || k <= 0 || k % block || rows < 0) return 2;
    int64_t row_bytes = k / block * bytes, groups = rows / 8, blocks = k / block;
    const uint8_t *in = (const uint8_t *)src;
    uint8_t *out = (uint8_t *)dst;
#pragma omp parallel for num_threads(threads) schedule(static) if (groups * row_bytes >= 65536)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *base = in + g * 8 * row_bytes;
        uint8_t *target = out + g * 8 * row_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            if (to_rows8_layout) {
                const uint8_t *row_starts[8];
                for (int r = 0; r < 8; r++) row_starts[r] = base + r * row_bytes;
                to_rows8(type, row_starts, b, bytes, target + b * 8 * bytes);
            } else {
                for (int r = 0; r < 8; r++) from_rows8(type, base + b * 8 * bytes, r, target + r * row_bytes + b * bytes);
            }
        }
    }
    memcpy(out + groups * 8 * row_bytes, in + groups * 8 * row_bytes, (size_t)(rows - groups * 8) * row_bytes);
    return 0;
}

/* Rows ids[i] (i where ids is NULL) of n_rows rows of `type` blocks (in `layout`), k values each, into out (row
 * stride ldo, float32, or bfloat16 rounded once): an embedding lookup, or a whole tensor for a test. 2: an unknown
 * type or layout, k not whole blocks, or an id outside [0, n_rows); 1: out of memory. */
int llm_q_dequantize(int64_t type, int64_t layout, const void *blocks, int64_t n_rows, const int64_t *ids, int64_t n,
                     int64_t k, void *out, int64_t ldo, int bf16, int threads) {
    int64_t block, bytes;
    if (!format_of(type, &block, &bytes) || k <= 0 || k % block || n < 0) return 2;
    if (layout != LLM_LAYOUT_GGUF && (layout != LLM_LAYOUT_ROWS8 || !rows8_known(type))) return 2;
    for (int64_t i = 0; i < n; i++)
        if (ids && (ids[i] < 0 || ids[i] >= n_rows)) return 2;
    if (!ids && n > n_rows) return 2;
    int64_t row_bytes = k / block * bytes, grouped = layout == LLM_LAYOUT_ROWS8 ? n_rows / 8 * 8 : 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (n * k >= 65536)
    {
        float *values = (float *)malloc((size_t)k * sizeof(float));
        uint8_t *row_blocks = (uint8_t *)malloc((size_t)row_bytes);
        if (!values || !row_blocks) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (!values || !row_blocks) continue;
            int64_t id = ids ? ids[i] : i;
            const uint8_t *row = (const uint8_t *)blocks + id * row_bytes;
            if (id < grouped) { /* (row id's blocks, back in GGUF's layout from its group) */
                const uint8_t *group = (const uint8_t *)blocks + (id / 8) * 8 * row_bytes;
                for (int64_t b = 0; b < k / block; b++) from_rows8(type, group + b * 8 * bytes, (int)(id % 8), row_blocks + b * bytes);
                row = row_blocks;
            }
            dequantize_row(type, row, k, values);
            for (int64_t j = 0; j < k; j++) store_from_f32(out, i * ldo + j, values[j], bf16);
        }
        free(values);
        free(row_blocks);
    }
    return failed;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
static inline __m256i sll16(__m256i v, int n) { return _mm256_sll_epi16(v, _mm_cvtsi32_si128(n)); }

static inline __m256i broadcast4(const int8_t *p) { /* 4 input values into every 32-bit lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Sub-block c of group block g as 8 vectors: w[v] the 8 rows' values 4 v .. 4 v + 3 (lane r: row r), unsigned
 * (Q8_0's stored + 128; signed again with one digit). */
static inline __attribute__((always_inline)) void rows8_unpack(const int64_t type, const int digits, const uint8_t *g,
                                                              int c, __m256i w[8]) {
    const uint8_t *q = rows8_values(type, g, c);
    if (type == LLM_Q8_0) {
        for (int v = 0; v < 8; v++) {
            w[v] = _mm256_loadu_si256((const __m256i *)(q + 32 * v));
            if (digits == 1) w[v] = _mm256_xor_si256(w[v], _mm256_set1_epi8((char)0x80));
        }
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int v = 0; v < 4; v++) {
        __m256i n = _mm256_loadu_si256((const __m256i *)(q + 32 * v));
        w[v] = _mm256_and_si256(n, low);
        w[4 + v] = _mm256_and_si256(_mm256_srli_epi16(n, 4), low);
    }
    if (five_bits(type)) { /* (bit v of a byte to bit 4 for value 4 v + i, bit 4 + v for 16 + 4 v + i) */
        const __m256i h = _mm256_loadu_si256((const __m256i *)rows8_highs(type, g, c)), bit = _mm256_set1_epi8(0x10);
        for (int v = 0; v < 4; v++) {
            w[v] = _mm256_or_si256(w[v], _mm256_and_si256(sll16(h, 4 - v), bit));
            w[4 + v] = _mm256_or_si256(w[4 + v], _mm256_and_si256(srl16(h, v), bit));
        }
    } else if (type == LLM_Q6_K) { /* (bits 2 v, 2 v + 1 to bits 4, 5) */
        const uint8_t *hp = rows8_highs(type, g, c);
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)hp), h1 = _mm256_loadu_si256((const __m256i *)(hp + 32));
        const __m256i three = _mm256_set1_epi8(3);
        for (int v = 0; v < 4; v++) {
            w[v] = _mm256_or_si256(w[v], sll16(_mm256_and_si256(srl16(h0, 2 * v), three), 4));
            w[4 + v] = _mm256_or_si256(w[4 + v], sll16(_mm256_and_si256(srl16(h1, 2 * v), three), 4));
        }
    }
}

/* The 8 rows' dot products (lane r: row r) of vectors w[v0 .. v0 + n) with one digit of an input block (x: its 32
 * int8): each vector against its 4 input values broadcast, summed in 16 bits in runs of `run` vectors (as many as
 * run x 2 x max|w| x max|digit| < 2^15 allows), each run widened by madd with `mul` (per lane: the row's integer
 * factor in both 16-bit halves) and added in 32 bits. is_signed: w signed (Q8_0 with one digit), multiplied as
 * |w| and the digits given w's signs. */
static inline __attribute__((always_inline)) __m256i rows8_sum(const __m256i w[8], const int v0, const int n,
                                                              const int8_t *x, const int run, const int is_signed,
                                                              __m256i mul) {
    __m256i total = _mm256_setzero_si256();
    for (int v = v0; v < v0 + n; v += run) {
        __m256i part = _mm256_setzero_si256();
        for (int u = v; u < v + run; u++) {
            __m256i xv = broadcast4(x + 4 * u);
            __m256i p = is_signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(w[u], w[u]), _mm256_sign_epi8(xv, w[u]))
                                  : _mm256_maddubs_epi16(w[u], xv);
            part = u == v ? p : _mm256_add_epi16(part, p);
        }
        total = _mm256_add_epi32(total, _mm256_madd_epi16(part, mul));
    }
    return total;
}

/* How many vectors rows8_sum may sum in 16 bits: pairs of |w| <= 15 (4-bit), 31 (Q5_0), 63 (Q6_K), 128 / 255
 * (Q8_0 signed / + 128) times digits of |d| <= 127 (one digit) or 64 (two). */
static inline int rows8_run(const int64_t type, const int digits) {
    if (type == LLM_Q8_0) return 1;
    if (type == LLM_Q6_K) return digits == 1 ? 2 : 4;
    if (five_bits(type)) return digits == 1 ? 4 : 8;
    return 8;
}

static inline __m256i pairs16(__m256i v32) { /* each int32 lane's low 16 bits into both its halves */
    return _mm256_or_si256(_mm256_and_si256(v32, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v32, 16));
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
/* With VNNI (AVX512-VNNI on the Intel kinds and Zen 4, AVX-VNNI on later Intel cores), one instruction (dpbusd)
 * multiplies the u8 x s8 pairs and adds each lane's 4 products to its 32-bit sum: no 16-bit partial sums, so no
 * runs and no widening madd, half the instructions of rows8_sum's maddubs + add per vector. The integers are
 * the AVX2 path's to the bit (its 16-bit sums never saturate, rows8_run), and so are the results. */
#define ROWS8_VNNI 1
static inline __m256i dpbusd(__m256i sum, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(sum, u, s);
#else
    return _mm256_dpbusd_avx_epi32(sum, u, s);
#endif
}

/* The 8 rows' dot products (lane r: row r) of w[v0 .. v0 + n) with one digit of an input block, in 32 bits. */
static inline __attribute__((always_inline)) __m256i rows8_dp(const __m256i w[8], const int v0, const int n, const int8_t *x,
                                                             const int is_signed) {
    __m256i total = _mm256_setzero_si256();
    for (int u = v0; u < v0 + n; u++) {
        __m256i xv = broadcast4(x + 4 * u);
        total = is_signed ? dpbusd(total, _mm256_sign_epi8(w[u], w[u]), _mm256_sign_epi8(xv, w[u])) : dpbusd(total, w[u], xv);
    }
    return total;
}

/* The same with both digits of the input block (h: the high digits, l: the low), as HI_WEIGHT x high + low. */
static inline __attribute__((always_inline)) __m256i rows8_dp_digits(const __m256i w[8], const int v0, const int n,
                                                                    const int8_t *h, const int8_t *l, const int digits,
                                                                    const int is_signed) {
    __m256i high = rows8_dp(w, v0, n, h, is_signed);
    if (digits == 1) return high;
    /* (127 x high as 128 x high - high) */
    return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(high, 7), high), rows8_dp(w, v0, n, l, 0));
}
#endif

/* out[a][r] = row r of the group . input row r0 + a of x (a < mr; mr and digits compile-time constants where
 * inlined), for the 8 rows of `group` (format blocks of 8 x bytes): each block's 8 rows unpacked once for the mr
 * input rows. */
static inline __attribute__((always_inline)) void rows8_dot(const int64_t type, const int digits, const uint8_t *group,
                                                           int64_t bytes, const acts_t *x, int64_t r0, const int mr,
                                                           float out[QMR][8]) {
    const int per = k_format(type) ? 8 : 1, run = rows8_run(type, digits);
    const int is_signed = type == LLM_Q8_0 && digits == 1;
    const int64_t format_blocks = x->blocks / per;
    const int8_t *xh[QMR], *xl[QMR];
    const float *xd[QMR], *x32[QMR], *x16[QMR];
    __m256 acc[QMR], off[QMR];
    for (int a = 0; a < mr; a++) {
        xh[a] = x->hi + (r0 + a) * x->k;
        xl[a] = x->lo + (r0 + a) * x->k;
        xd[a] = x->d + (r0 + a) * x->blocks;
        x32[a] = x->s32 + (r0 + a) * x->blocks;
        x16[a] = x->s16 + (r0 + a) * 2 * x->blocks;
        acc[a] = off[a] = _mm256_setzero_ps();
    }
    const __m256i one = _mm256_set1_epi16(1), hi_weight = _mm256_set1_epi16(HI_WEIGHT(digits));
    for (int64_t fb = 0; fb < format_blocks; fb++) {
        const uint8_t *g = group + fb * 8 * bytes;
        /* (every cache line of a group block ahead of its use: a block of 8 rows is 144-1680 bytes, and the
         * hardware's stream prefetcher alone read ~16 GB/s of the ~28 two cores can; ROWS8_PREFETCH says how far) */
        for (int64_t line = 0; line < 8 * bytes; line += 64)
            _mm_prefetch((const char *)(g + ROWS8_PREFETCH_AHEAD(bytes) + line), ROWS8_PREFETCH_HINT);
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        __m256 offset8 = _mm256_setzero_ps(); /* (the 32-value formats' offset factor of each row) */
        if (type == LLM_Q4_0) offset8 = _mm256_mul_ps(d8, _mm256_set1_ps(-8.0f));
        if (type == LLM_Q5_0) offset8 = _mm256_mul_ps(d8, _mm256_set1_ps(-16.0f));
        if (type == LLM_Q8_0 && digits == 2) offset8 = _mm256_mul_ps(d8, _mm256_set1_ps(-128.0f)); /* (stored + 128) */
        if (type == LLM_Q4_1) offset8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
        __m256i scale8[8], scale32[8];
        __m256 min8[8];
        if (k4_scales(type)) { /* the 8 sub-blocks' 6-bit scales and mins of the 8 rows */
            const __m256 dmin8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
            __m128i s[12];
            for (int i = 0; i < 12; i++) s[i] = _mm_loadl_epi64((const __m128i *)(g + 32 + 8 * i));
            const __m128i six = _mm_set1_epi8(63), four = _mm_set1_epi8(15), two = _mm_set1_epi8(3);
            for (int j = 0; j < 8; j++) {
                __m128i sc, mn;
                if (j < 4) {
                    sc = _mm_and_si128(s[j], six);
                    mn = _mm_and_si128(s[j + 4], six);
                } else {
                    __m128i top_sc = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(s[j - 4], 6), two), 4);
                    __m128i top_mn = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(s[j], 6), two), 4);
                    sc = _mm_or_si128(_mm_and_si128(s[j + 4], four), top_sc);
                    mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s[j + 4], 4), four), top_mn);
                }
                scale32[j] = _mm256_cvtepu8_epi32(sc);
                scale8[j] = pairs16(scale32[j]);
                min8[j] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn))));
            }
        }
        for (int c = 0; c < per; c++) {
            const int64_t b = fb * per + c;
            __m256i w[8];
            rows8_unpack(type, digits, g, c, w);
            __m256i mul_lo = one, mul_hi = one, sc_lo = one, sc_hi = one;
            __m256 off_lo = _mm256_setzero_ps(), off_hi = _mm256_setzero_ps();
            if (type == LLM_Q6_K) {
                sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + 16 + 16 * c)));
                sc_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + 16 + 16 * c + 8)));
                __m256 d32 = _mm256_mul_ps(d8, _mm256_set1_ps(-32.0f));
                off_lo = _mm256_mul_ps(d32, _mm256_cvtepi32_ps(sc_lo));
                off_hi = _mm256_mul_ps(d32, _mm256_cvtepi32_ps(sc_hi));
                mul_lo = pairs16(sc_lo);
                mul_hi = pairs16(sc_hi);
            } else if (k4_scales(type)) {
                mul_lo = mul_hi = scale8[c];
            }
            const __m256i hi_lo = _mm256_mullo_epi16(mul_lo, hi_weight), hi_hi = _mm256_mullo_epi16(mul_hi, hi_weight);
            for (int a = 0; a < mr; a++) {
                const int8_t *h = xh[a] + b * 32, *l = xl[a] + b * 32;
                __m256i total;
                if (type == LLM_Q6_K) {
#ifdef ROWS8_VNNI
                    total = _mm256_add_epi32(_mm256_mullo_epi32(rows8_dp_digits(w, 0, 4, h, l, digits, 0), sc_lo),
                                             _mm256_mullo_epi32(rows8_dp_digits(w, 4, 4, h, l, digits, 0), sc_hi));
#else
                    total = _mm256_add_epi32(rows8_sum(w, 0, 4, h, run, 0, hi_lo), rows8_sum(w, 4, 4, h, run, 0, hi_hi));
                    if (digits == 2)
                        total = _mm256_add_epi32(total, _mm256_add_epi32(rows8_sum(w, 0, 4, l, run, 0, mul_lo),
                                                                         rows8_sum(w, 4, 4, l, run, 0, mul_hi)));
#endif
                    off[a] = _mm256_fmadd_ps(off_lo, _mm256_set1_ps(x16[a][2 * b]), off[a]);
                    off[a] = _mm256_fmadd_ps(off_hi, _mm256_set1_ps(x16[a][2 * b + 1]), off[a]);
                } else {
#ifdef ROWS8_VNNI
                    total = rows8_dp_digits(w, 0, 8, h, l, digits, is_signed);
                    if (k4_scales(type)) total = _mm256_mullo_epi32(total, scale32[c]);
#else
                    total = rows8_sum(w, 0, 8, h, run, is_signed, hi_lo);
                    if (digits == 2) total = _mm256_add_epi32(total, rows8_sum(w, 0, 8, l, run, 0, mul_lo));
#endif
                    off[a] = _mm256_fmadd_ps(k4_scales(type) ? min8[c] : offset8, _mm256_set1_ps(x32[a][b]), off[a]);
                }
                acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d8, _mm256_set1_ps(xd[a][b])), acc[a]);
            }
        }
    }
    for (int a = 0; a < mr; a++) _mm256_storeu_ps(out[a], _mm256_add_ps(acc[a], off[a]));
}
#else
/* Without AVX2: the grouped rows are unpacked block by block into GGUF's layout and computed as the tiles do. */
static inline void rows8_dot(const int64_t type, const int digits, const uint8_t *group, int64_t bytes, const acts_t *x,
                             int64_t r0, const int mr, float out[QMR][8]) {
    int64_t block = k_format(type) ? 256 : 32, blocks = x->k / block;
    uint8_t rows[8][210];
    float sums[QMR][8] = {{0}}, offsets[QMR][8] = {{0}};
    int offsets_kind = offset_kind(type);
    for (int64_t fb = 0; fb < blocks; fb++) {
        for (int r = 0; r < 8; r++) from_rows8(type, group + fb * 8 * bytes, r, rows[r]);
        for (int64_t c = 0; c < block / 32; c++) {
            int64_t b = fb * (block / 32) + c;
            for (int r = 0; r < 8; r++) {
                block_terms_t t = block_terms(type, rows[r], c);
                int values[32];
                block_values(type, rows[r], c, values);
                for (int a = 0; a < mr; a++) {
                    const int8_t *xh = x->hi + (r0 + a) * x->k + b * 32, *xl = x->lo + (r0 + a) * x->k + b * 32;
                    const float *xd = x->d + (r0 + a) * x->blocks, *x32 = x->s32 + (r0 + a) * x->blocks;
                    const float *x16 = x->s16 + (r0 + a) * 2 * x->blocks;
                    int lo = 0, hi = 0;
                    for (int l = 0; l < 16; l++) {
                        lo += values[l] * (HI_WEIGHT(digits) * xh[l] + xl[l]);
                        hi += values[l + 16] * (HI_WEIGHT(digits) * xh[l + 16] + xl[l + 16]);
                    }
                    sums[a][r] += (float)(lo * t.mul_lo + hi * t.mul_hi) * (t.scale * xd[b]);
                    if (offsets_kind == OFFSET_BLOCK) offsets[a][r] += t.lo * x32[b];
                    else if (offsets_kind == OFFSET_HALVES) offsets[a][r] += t.lo * x16[2 * b] + t.hi * x16[2 * b + 1];
                }
            }
        }
    }
    for (int a = 0; a < mr; a++)
        for (int r = 0; r < 8; r++) out[a][r] = sums[a][r] + offsets[a][r];
}
#endif

/* One task: weight rows [j0, j1) of a part of `rows` rows (GGUF's layout, or groups of 8 then GGUF's rows) against
 * input rows [r0, r1) quantized to `digits` digits, written to y's columns col + j (with bias[col + j] where there
 * is a bias). */
static inline __attribute__((always_inline)) void task(const int64_t type, const int digits, const uint8_t *data,
                                                       int64_t row_bytes,
                                                       int64_t rows, int64_t layout, int64_t j0, int64_t j1, int64_t r0,
                                                       int64_t r1, const acts_t *x, const void *bias, void *y, int64_t ldy,
                                                       int64_t col, int bf16) {
    int64_t block = 0, bytes = 0;
    format_of(type, &block, &bytes);
    int64_t grouped = layout == LLM_LAYOUT_ROWS8 ? rows / 8 * 8 : 0, j = j0;
    for (; j < j1 && j + 8 <= grouped; j += 8)
        for (int64_t r = r0; r < r1; r += QMR) {
            int take = r1 - r >= QMR ? QMR : (int)(r1 - r);
            float sums[QMR][8];
            const uint8_t *group = data + j * row_bytes;
            switch (take) {
                case 1: rows8_dot(type, digits, group, bytes, x, r, 1, sums); break;
                case 2: rows8_dot(type, digits, group, bytes, x, r, 2, sums); break;
                case 3: rows8_dot(type, digits, group, bytes, x, r, 3, sums); break;
                default: rows8_dot(type, digits, group, bytes, x, r, QMR, sums); break;
            }
            for (int a = 0; a < take; a++)
                for (int i = 0; i < 8; i++) {
                    float v = sums[a][i];
                    if (bias) v += load_as_f32(bias, col + j + i, bf16);
                    store_from_f32(y, (r + a) * ldy + col + j + i, v, bf16);
                }
        }
    for (; j < j1; j += NR) {
        const uint8_t *w[NR];
        for (int i = 0; i < NR; i++) w[i] = data + (j + i < j1 ? j + i : j) * row_bytes;
        for (int64_t r = r0; r < r1; r += QMR) {
            int take = r1 - r >= QMR ? QMR : (int)(r1 - r);
            float sums[NR][QMR];
            switch (take) {
                case 1: tile(type, digits, w, x, r, 1, sums); break;
                case 2: tile(type, digits, w, x, r, 2, sums); break;
                case 3: tile(type, digits, w, x, r, 3, sums); break;
                default: tile(type, digits, w, x, r, QMR, sums); break;
            }
            for (int i = 0; i < NR && j + i < j1; i++)
                for (int a = 0; a < take; a++) {
                    float v = sums[i][a];
                    if (bias) v += load_as_f32(bias, col + j + i, bf16);
                    store_from_f32(y, (r + a) * ldy + col + j + i, v, bf16);
                }
        }
    }
}

/* One function per format and input precision (the format's and the digits' branches resolved at compile time). */
#define TASK_FOR(TYPE, DIGITS, NAME)                                                                              \
    static void NAME(const uint8_t *data, int64_t row_bytes, int64_t rows, int64_t layout, int64_t j0, int64_t j1,  \
                     int64_t r0, int64_t r1, const acts_t *x, const void *bias, void *y, int64_t ldy, int64_t col,    \
                     int bf16) {                                                                                  \
        task(TYPE, DIGITS, data, row_bytes, rows, layout, j0, j1, r0, r1, x, bias, y, ldy, col, bf16);            \
    }
#define TASKS_FOR(TYPE, NAME) TASK_FOR(TYPE, 1, NAME##_1) TASK_FOR(TYPE, 2, NAME##_2)
TASKS_FOR(LLM_Q4_0, task_q4_0)
TASKS_FOR(LLM_Q4_1, task_q4_1)
TASKS_FOR(LLM_Q5_0, task_q5_0)
TASKS_FOR(LLM_Q5_1, task_q5_1)
TASKS_FOR(LLM_Q8_0, task_q8_0)
TASKS_FOR(LLM_Q4_K, task_q4_k)
TASKS_FOR(LLM_Q5_K, task_q5_k)
TASKS_FOR(LLM_Q6_K, task_q6_k)

typedef void (*task_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const acts_t *,
                        const void *, void *, int64_t, int64_t, int);

static task_fn task_of(int64_t type, int64_t digits) {
    switch (type) {
        case LLM_Q4_0: return digits == 1 ? task_q4_0_1 : task_q4_0_2;
        case LLM_Q4_1: return digits == 1 ? task_q4_1_1 : task_q4_1_2;
        case LLM_Q5_0: return digits == 1 ? task_q5_0_1 : task_q5_0_2;
        case LLM_Q5_1: return digits == 1 ? task_q5_1_1 : task_q5_1_2;
        case LLM_Q8_0: return digits == 1 ? task_q8_0_1 : task_q8_0_2;
        case LLM_Q4_K: return digits == 1 ? task_q4_k_1 : task_q4_k_2;
        case LLM_Q5_K: return digits == 1 ? task_q5_k_1 : task_q5_k_2;
        case LLM_Q6_K: return digits == 1 ? task_q6_k_1 : task_q6_k_2;
        default: return NULL;
    }
}

/* ---------------------------------------------------------------------------------------------------
 * The product: y[r, c] = x[r] . W[c] (+ bias[c]) for the m rows of x (row stride ldx, the activations' dtype)
 * and the columns of every part of w side by side (y's row stride ldy). Dense parts are kernels.c's products;
 * the quantized ones share one quantization of x and one parallel loop over tasks of Q_ROWS_PER_TASK weight
 * rows x Q_INPUTS_PER_TASK input rows (the weight rows of a task stay in L1 while its input rows pass).
 * 0: done; 1: out of memory; 2: a part of a type this library does not know, or k not whole blocks of it. */

#define Q_ROWS_PER_TASK 16
#define Q_INPUTS_PER_TASK 64

int llm_q_product(const void *x, int64_t ldx, const llm_product_t *w, const void *bias, void *y, int64_t ldy,
                  int64_t m, int64_t k, int bf16, int threads) {
    if (w->parts < 1 || w->parts > LLM_MAX_PARTS || k <= 0 || k % 32 || (w->digits != 1 && w->digits != 2)) return 2;
    int64_t cols[LLM_MAX_PARTS], row_bytes[LLM_MAX_PARTS], tasks[LLM_MAX_PARTS], col = 0, total = 0;
    int64_t chunks = (m + Q_INPUTS_PER_TASK - 1) / Q_INPUTS_PER_TASK;
    size_t es = size_of(bf16);
    for (int64_t p = 0; p < w->parts; p++) {
        const llm_weight_t *part = &w->part[p];
        int64_t block, bytes;
        if (part->rows < 0 || (part->type != LLM_DENSE && (!format_of(part->type, &block, &bytes) || k % block)) ||
            (part->layout != LLM_LAYOUT_GGUF && (part->layout != LLM_LAYOUT_ROWS8 || !rows8_known(part->type))))
            return 2;
        cols[p] = col;
        row_bytes[p] = part->type == LLM_DENSE ? 0 : k / block * bytes;
        tasks[p] = part->type == LLM_DENSE ? 0 : (part->rows + Q_ROWS_PER_TASK - 1) / Q_ROWS_PER_TASK * chunks;
        total += tasks[p];
        col += part->rows;
    }
    int failed = 0;
    for (int64_t p = 0; p < w->parts; p++) {
        if (w->part[p].type != LLM_DENSE || m <= 0) continue;
        const char *b = bias ? (const char *)bias + cols[p] * es : NULL;
        if (bf16)
            failed |= llm_linear_bf16((const uint16_t *)x, ldx, (const uint16_t *)w->part[p].data, (const uint16_t *)b,
                                      (uint16_t *)y + cols[p], ldy, m, w->part[p].rows, k, threads);
        else
            failed |= llm_linear_f32((const float *)x, ldx, (const float *)w->part[p].data, (const float *)b,
                                     (float *)y + cols[p], ldy, m, w->part[p].rows, k, threads);
    }
    if (total == 0) return failed;
    acts_t acts;
    acts.k = k;
    acts.blocks = k / 32;
    size_t q_bytes = ((size_t)m * k + 63) / 64 * 64;
    /* (aligned_alloc's size must be a multiple of the alignment: C11, and AddressSanitizer refuses it) */
    char *scratch = (char *)aligned_alloc(64, (2 * q_bytes + (size_t)m * acts.blocks * 4 * sizeof(float) + 63) / 64 * 64);
    if (!scratch) return 1;
    acts.hi = (int8_t *)scratch;
    acts.lo = (int8_t *)(scratch + q_bytes);
    acts.d = (float *)(scratch + 2 * q_bytes);
    acts.s32 = acts.d + m * acts.blocks;
    acts.s16 = acts.s32 + m * acts.blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; r++)
        quantize_acts_row((const char *)x + r * ldx * es, bf16, k, (int)w->digits, acts.hi + r * k, acts.lo + r * k, acts.d + r * acts.blocks,
                          acts.s32 + r * acts.blocks, acts.s16 + r * 2 * acts.blocks);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < total; t++) {
        int64_t p = 0, local = t;
        while (local >= tasks[p]) local -= tasks[p++];
        const llm_weight_t *part = &w->part[p];
        int64_t j0 = local / chunks * Q_ROWS_PER_TASK, r0 = local % chunks * Q_INPUTS_PER_TASK;
        int64_t j1 = j0 + Q_ROWS_PER_TASK < part->rows ? j0 + Q_ROWS_PER_TASK : part->rows;
        int64_t r1 = r0 + Q_INPUTS_PER_TASK < m ? r0 + Q_INPUTS_PER_TASK : m;
        task_of(part->type, w->digits)((const uint8_t *)part->data, row_bytes[p], part->rows, part->layout, j0, j1, r0, r1, &acts,
                            bias, y, ldy, cols[p], bf16);
    }
    free(scratch);
    return failed;
}
