/*
 * The AVX-512 kernel set (F/DQ/BW/VL): the scalar set's arithmetic on
 * 512-bit vectors, bit for bit.  Its checks and its float16, float32 and
 * float64 kernels serve the avx512bf16 set too (kernels_avx512bf16.c),
 * which only has a bfloat16 kernel of its own.  Half types are
 * widened to sixteen float32 lanes, multiplied (a plain multiply, never
 * fused), and rounded back to nearest-even; the finite test keeps the
 * largest magnitude seen in a register and looks at it once at the end, so
 * the loops have no data-dependent branch.  Ragged starts and ends use
 * masked loads and stores instead of scalar loops, and the head is peeled
 * so that stores to the destination do not straddle cache lines.
 */
#include <immintrin.h>
#include <stdint.h>

#include "kernels_avx512.h"

static inline __mmask8 first8(size_t k) { return (__mmask8)((1u << k) - 1u); }

/* The finite test: a value is non-finite iff its magnitude bits (sign
 * cleared) reach the all-ones exponent, so the running unsigned maximum of
 * the magnitudes answers for a whole buffer. */
static inline __m512i magnitude_f32(__m512 v)
{
    return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
}

static inline __m512i magnitude_f64(__m512d v)
{
    return _mm512_and_si512(_mm512_castpd_si512(v), _mm512_set1_epi64(INT64_MAX));
}

static inline __m256i magnitude_16(__m256i v)
{
    return _mm256_and_si256(v, _mm256_set1_epi16(0x7fff));
}

/* ---------------------------------------------------------------- checks */

/* One loop for all four dtypes: finiteness only looks at the bits, as
 * integers of the dtype's width.  Blocks of 2 KiB keep the early exit off
 * the per-vector path.  The loads are 256 bits wide: streaming from DRAM
 * measured about 20% faster that way than with 512-bit loads on Zen 4, and
 * AVX512VL still gives the masked head and tail.
 *
 * A large buffer is read as CHECK_STREAMS sequential streams, 512 bytes of
 * each in turn: a read-only pass is bound by the cache misses one core
 * keeps in flight, and the hardware prefetchers restart at every 4 KiB
 * page (TensorFlow's buffers are not on huge pages), so one stream leaves
 * bandwidth unused.  Measured on TensorFlow-allocated buffers (Xeon, 2
 * threads): 4 streams about 20% faster than 1; 8 no faster than 4. */
enum { CHECK_BLOCK = 2048, CHECK_STREAMS = 4, CHECK_STEP = CHECK_BLOCK / CHECK_STREAMS };
enum { CHECK_MIN_SPAN = 64 * 1024 }; /* bytes per stream before streams pay */

LS_INLINE __m256i max_magnitude(__m256i worst, __m256i v, int bits)
{
    switch (bits) {
    case 16:
        return _mm256_max_epu16(worst, _mm256_and_si256(v, _mm256_set1_epi16(0x7fff)));
    case 32:
        return _mm256_max_epu32(worst, _mm256_and_si256(v, _mm256_set1_epi32(0x7fffffff)));
    default:
        return _mm256_max_epu64(worst, _mm256_and_si256(v, _mm256_set1_epi64x(INT64_MAX)));
    }
}

LS_INLINE int reaches(__m256i worst, uint64_t limit, int bits)
{
    switch (bits) {
    case 16:
        return _mm256_cmpge_epu16_mask(worst, _mm256_set1_epi16((short)limit)) != 0;
    case 32:
        return _mm256_cmpge_epu32_mask(worst, _mm256_set1_epi32((int)limit)) != 0;
    default:
        return _mm256_cmpge_epu64_mask(worst, _mm256_set1_epi64x((long long)limit)) != 0;
    }
}

/* The largest magnitude of `len` bytes (a multiple of 128) from q. */
LS_INLINE __m256i check_bytes(__m256i worst, const char *q, size_t len, int bits)
{
    for (size_t k = 0; k < len; k += 4 * 32) {
        worst = max_magnitude(worst, _mm256_loadu_si256((const __m256i *)(q + k)), bits);
        worst = max_magnitude(worst, _mm256_loadu_si256((const __m256i *)(q + k + 32)), bits);
        worst = max_magnitude(worst, _mm256_loadu_si256((const __m256i *)(q + k + 64)), bits);
        worst = max_magnitude(worst, _mm256_loadu_si256((const __m256i *)(q + k + 96)), bits);
    }
    return worst;
}

LS_INLINE int check_avx512(const void *src, size_t n, int bits, uint64_t limit)
{
    const char *p = (const char *)src;
    const size_t esize = (size_t)bits / 8;
    const size_t bytes = n * esize;
    __m256i worst = _mm256_setzero_si256();
    /* byte masks: whole elements only, so a lane never mixes two values */
    size_t i = ls_elems_to_boundary(p, esize, 32, n) * esize;
    if (i)
        worst = max_magnitude(worst, _mm256_maskz_loadu_epi8((1u << i) - 1u, p), bits);
    const size_t span = (bytes - i) / (CHECK_STREAMS * CHECK_BLOCK) * CHECK_BLOCK;
    if (span >= CHECK_MIN_SPAN) {
        for (size_t b = 0; b < span; b += CHECK_STEP) {
            for (size_t s = 0; s < CHECK_STREAMS; s++)
                worst = check_bytes(worst, p + i + s * span + b, CHECK_STEP, bits);
            if (reaches(worst, limit, bits))
                return 0;
        }
        i += CHECK_STREAMS * span;
    }
    for (; bytes - i >= CHECK_BLOCK; i += CHECK_BLOCK) {
        worst = check_bytes(worst, p + i, CHECK_BLOCK, bits);
        if (reaches(worst, limit, bits))
            return 0;
    }
    for (; bytes - i >= 32; i += 32)
        worst = max_magnitude(worst, _mm256_loadu_si256((const __m256i *)(p + i)), bits);
    if (i < bytes)
        worst = max_magnitude(worst, _mm256_maskz_loadu_epi8((1u << (bytes - i)) - 1u, p + i),
                              bits);
    return !reaches(worst, limit, bits);
}

int ls_avx512_check_f16(const void *src, size_t n) { return check_avx512(src, n, 16, 0x7c00u); }
int ls_avx512_check_bf16(const void *src, size_t n) { return check_avx512(src, n, 16, 0x7f80u); }
int ls_avx512_check_f32(const void *src, size_t n) { return check_avx512(src, n, 32, 0x7f800000u); }
int ls_avx512_check_f64(const void *src, size_t n)
{
    return check_avx512(src, n, 64, 0x7ff0000000000000ull);
}

/* --------------------------------------------------------------- float32 */

/* A lane masked off on load is zero, so it can never look non-finite. */
LS_INLINE __m512i unscale_f32_part(const float *x, float *y, __m512 s, __mmask16 m, int check_inputs)
{
    __m512 in = _mm512_maskz_loadu_ps(m, x);
    __m512 out = _mm512_mul_ps(in, s);
    _mm512_mask_storeu_ps(y, m, out);
    return magnitude_f32(check_inputs ? in : out);
}

LS_INLINE __m512i unscale_f32_vec(const float *x, float *y, __m512 s, int check_inputs)
{
    __m512 in = _mm512_loadu_ps(x);
    __m512 out = _mm512_mul_ps(in, s);
    _mm512_storeu_ps(y, out);
    return magnitude_f32(check_inputs ? in : out);
}

LS_INLINE int unscale_f32_run(const float *x, float *y, size_t n, float inv, int check_inputs)
{
    const __m512 s = _mm512_set1_ps(inv);
    __m512i worst = _mm512_setzero_si512();
    size_t i = ls_elems_to_boundary(y, sizeof *y, CACHE_LINE, n);
    if (i)
        worst = unscale_f32_part(x, y, s, first16(i), check_inputs);
    for (; n - i >= 64; i += 64) {
        worst = _mm512_max_epu32(worst, unscale_f32_vec(x + i, y + i, s, check_inputs));
        worst = _mm512_max_epu32(worst, unscale_f32_vec(x + i + 16, y + i + 16, s, check_inputs));
        worst = _mm512_max_epu32(worst, unscale_f32_vec(x + i + 32, y + i + 32, s, check_inputs));
        worst = _mm512_max_epu32(worst, unscale_f32_vec(x + i + 48, y + i + 48, s, check_inputs));
    }
    for (; n - i >= 16; i += 16)
        worst = _mm512_max_epu32(worst, unscale_f32_vec(x + i, y + i, s, check_inputs));
    if (i < n)
        worst = _mm512_max_epu32(worst,
                                 unscale_f32_part(x + i, y + i, s, first16(n - i), check_inputs));
    return !_mm512_cmpge_epu32_mask(worst, _mm512_set1_epi32(0x7f800000));
}

int ls_avx512_unscale_f32(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f32_run((const float *)src, (float *)dst, n, (float)inv, 1);
    return unscale_f32_run((const float *)src, (float *)dst, n, (float)inv, 0);
}

/* --------------------------------------------------------------- float64 */

LS_INLINE __m512i unscale_f64_part(const double *x, double *y, __m512d s, __mmask8 m, int check_inputs)
{
    __m512d in = _mm512_maskz_loadu_pd(m, x);
    __m512d out = _mm512_mul_pd(in, s);
    _mm512_mask_storeu_pd(y, m, out);
    return magnitude_f64(check_inputs ? in : out);
}

LS_INLINE __m512i unscale_f64_vec(const double *x, double *y, __m512d s, int check_inputs)
{
    __m512d in = _mm512_loadu_pd(x);
    __m512d out = _mm512_mul_pd(in, s);
    _mm512_storeu_pd(y, out);
    return magnitude_f64(check_inputs ? in : out);
}

LS_INLINE int unscale_f64_run(const double *x, double *y, size_t n, double inv, int check_inputs)
{
    const __m512d s = _mm512_set1_pd(inv);
    __m512i worst = _mm512_setzero_si512();
    size_t i = ls_elems_to_boundary(y, sizeof *y, CACHE_LINE, n);
    if (i)
        worst = unscale_f64_part(x, y, s, first8(i), check_inputs);
    for (; n - i >= 32; i += 32) {
        worst = _mm512_max_epu64(worst, unscale_f64_vec(x + i, y + i, s, check_inputs));
        worst = _mm512_max_epu64(worst, unscale_f64_vec(x + i + 8, y + i + 8, s, check_inputs));
        worst = _mm512_max_epu64(worst, unscale_f64_vec(x + i + 16, y + i + 16, s, check_inputs));
        worst = _mm512_max_epu64(worst, unscale_f64_vec(x + i + 24, y + i + 24, s, check_inputs));
    }
    for (; n - i >= 8; i += 8)
        worst = _mm512_max_epu64(worst, unscale_f64_vec(x + i, y + i, s, check_inputs));
    if (i < n)
        worst = _mm512_max_epu64(worst,
                                 unscale_f64_part(x + i, y + i, s, first8(n - i), check_inputs));
    return !_mm512_cmpge_epu64_mask(worst, _mm512_set1_epi64(0x7ff0000000000000ll));
}

int ls_avx512_unscale_f64(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f64_run((const double *)src, (double *)dst, n, inv, 1);
    return unscale_f64_run((const double *)src, (double *)dst, n, inv, 0);
}

/* --------------------------------------------------------------- float16 */

/* F16C conversions are exact on the way in and round to nearest-even on
 * the way out, subnormal halves included.  A product of two halves is
 * never a float32 subnormal (the smallest is 2^-48), so DAZ/FTZ cannot
 * change it either. */
static inline __m256i unscale16_f16(__m256i h, __m512 s)
{
    __m512 product = _mm512_mul_ps(_mm512_cvtph_ps(h), s);
    return _mm512_cvtps_ph(product, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

LS_INLINE __m256i unscale_f16_part(const uint16_t *x, uint16_t *y, __m512 s, __mmask16 m,
                                   int check_inputs)
{
    __m256i in = _mm256_maskz_loadu_epi16(m, x);
    __m256i out = unscale16_f16(in, s);
    _mm256_mask_storeu_epi16(y, m, out);
    return magnitude_16(check_inputs ? in : out);
}

LS_INLINE __m256i unscale_f16_vec(const uint16_t *x, uint16_t *y, __m512 s, int check_inputs)
{
    __m256i in = _mm256_loadu_si256((const __m256i *)x);
    __m256i out = unscale16_f16(in, s);
    _mm256_storeu_si256((__m256i *)y, out);
    return magnitude_16(check_inputs ? in : out);
}

LS_INLINE int unscale_f16_run(const uint16_t *x, uint16_t *y, size_t n, float inv, int check_inputs)
{
    const __m512 s = _mm512_set1_ps(inv);
    __m256i worst = _mm256_setzero_si256();
    size_t i = ls_elems_to_boundary(y, sizeof *y, 32, n);
    if (i)
        worst = unscale_f16_part(x, y, s, first16(i), check_inputs);
    for (; n - i >= 64; i += 64) {
        worst = _mm256_max_epu16(worst, unscale_f16_vec(x + i, y + i, s, check_inputs));
        worst = _mm256_max_epu16(worst, unscale_f16_vec(x + i + 16, y + i + 16, s, check_inputs));
        worst = _mm256_max_epu16(worst, unscale_f16_vec(x + i + 32, y + i + 32, s, check_inputs));
        worst = _mm256_max_epu16(worst, unscale_f16_vec(x + i + 48, y + i + 48, s, check_inputs));
    }
    for (; n - i >= 16; i += 16)
        worst = _mm256_max_epu16(worst, unscale_f16_vec(x + i, y + i, s, check_inputs));
    if (i < n)
        worst = _mm256_max_epu16(worst,
                                 unscale_f16_part(x + i, y + i, s, first16(n - i), check_inputs));
    return !_mm256_cmpge_epu16_mask(worst, _mm256_set1_epi16(0x7c00));
}

int ls_avx512_unscale_f16(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f16_run((const uint16_t *)src, (uint16_t *)dst, n, (float)inv, 1);
    return unscale_f16_run((const uint16_t *)src, (uint16_t *)dst, n, (float)inv, 0);
}

/* -------------------------------------------------------------- bfloat16 */

static int unscale_bf16_avx512(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    const uint16_t *x = (const uint16_t *)src;
    uint16_t *y = (uint16_t *)dst;
    if (flags & LS_CHECK_INPUTS)
        return unscale_bf16_run(x, y, n, (float)inv, 1, BF16_INTEGER);
    return unscale_bf16_run(x, y, n, (float)inv, 0, BF16_INTEGER);
}

const ls_kernel_set ls_kernels_avx512 = {
    {ls_avx512_check_f16, ls_avx512_check_bf16, ls_avx512_check_f32, ls_avx512_check_f64},
    {ls_avx512_unscale_f16, unscale_bf16_avx512, ls_avx512_unscale_f32, ls_avx512_unscale_f64},
};
