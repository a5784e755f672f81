/*
 * The fused optimizer kernels on AVX2 + F16C: eight float32 lanes.  Only
 * plain vector multiply, add, divide and square root (no FMA), so each
 * lane rounds exactly as the scalar reference does.
 */
#include <immintrin.h>

#include "optim.h"

#define LS_V __m256
#define LS_VW 8
#define LS_OPTIM_SET avx2
#define LS_OPTIM_NAME "avx2"

static inline __m256 v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline __m256 v_load_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline __m256 v_load_bf16(const uint16_t *p)
{
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __m256 v_set1(float x) { return _mm256_set1_ps(x); }
static inline __m256 v_add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static inline __m256 v_sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
static inline __m256 v_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
static inline __m256 v_div(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
static inline __m256 v_sqrt(__m256 a) { return _mm256_sqrt_ps(a); }
static inline __m256 v_max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }

#include "optim_body.h"
