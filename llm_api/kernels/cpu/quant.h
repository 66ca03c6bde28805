/* A product's weights as kernels.c's layer functions and quant.c's products read them. The Python side
 * (llm_api.kernels.cpu.quant: _Weight, _Product) fills these through ctypes: keep the two in step. */
#ifndef LLM_API_CPU_QUANT_H
#define LLM_API_CPU_QUANT_H
#include <stdint.h>

/* A weight's type: LLM_DENSE (rows of K elements of the activations' dtype, float32 or bfloat16) or the id
 * GGUF gives a block format (ggml's enum ggml_type). */
#define LLM_DENSE (-1)
enum { LLM_Q4_0 = 2, LLM_Q4_1 = 3, LLM_Q5_0 = 6, LLM_Q5_1 = 7, LLM_Q8_0 = 8, LLM_Q4_K = 12, LLM_Q5_K = 13, LLM_Q6_K = 14 };
#define LLM_MAX_PARTS 3

/* How a quantized weight's blocks are laid out: as GGUF stores them (row after row), or repacked at load in
 * groups of 8 rows (quant.c, "Rows in groups of 8"; the rows past the last whole group stay as GGUF's). */
#define LLM_LAYOUT_GGUF 0
#define LLM_LAYOUT_ROWS8 1

typedef struct {
    const void *data; /* rows x (K / block size) blocks of `type`, row after row; or rows x K dense elements */
    int64_t type;
    int64_t rows;
    int64_t layout; /* LLM_LAYOUT_GGUF or LLM_LAYOUT_ROWS8 (dense: GGUF) */
} llm_weight_t;

/* One input's product over 1..LLM_MAX_PARTS weights of K inputs each (a merged q/k/v or gate/up whose parts
 * may differ in format), the parts' outputs side by side in part order; its input rows quantized to `digits`
 * (1 or 2) signed 8-bit digits a value per block of 32 for the quantized parts (quant.c says how). */
typedef struct {
    llm_weight_t part[LLM_MAX_PARTS];
    int64_t parts;
    int64_t digits;
} llm_product_t;

int llm_q_product(const void *x, int64_t ldx, const llm_product_t *w, const void *bias, void *y, int64_t ldy,
                  int64_t m, int64_t k, int bf16, int threads);
int llm_linear_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy, int64_t m,
                   int64_t n_out, int64_t k, int threads);
int llm_linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t ldy,
                    int64_t m, int64_t n_out, int64_t k, int threads);

#endif
