/*
 * The fused optimizer kernels on AVX-512 F: sixteen float32 lanes.  Only
 * plain vector multiply, add, divide and square root, so each lane rounds
 * exactly as the scalar reference does.
 */
#include <immintrin.h>

#include "optim.h"

#define LS_V __m512
#define LS_VW 16
#define LS_OPTIM_SET avx512
#define LS_OPTIM_NAME "avx512"

static inline __m512 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 v_load_f16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline __m512 v_load_bf16(const uint16_t *p)
{
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __m512 v_set1(float x) { return _mm512_set1_ps(x); }
static inline __m512 v_add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static inline __m512 v_sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
static inline __m512 v_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
static inline __m512 v_div(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
static inline __m512 v_sqrt(__m512 a) { return _mm512_sqrt_ps(a); }
static inline __m512 v_max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }

#include "optim_body.h"
