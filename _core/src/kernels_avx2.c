/*
 * The AVX2 + F16C kernel set: the scalar set's arithmetic on 256-bit
 * vectors, bit for bit.  Half types are widened to float32, multiplied (a
 * plain multiply, never fused) and rounded back to nearest-even: float16
 * with F16C, bfloat16 on the bits since AVX2 has no bfloat16 instruction.
 * The finite test keeps the largest magnitude seen in a register and looks
 * at it once at the end, so the loops have no data-dependent branch.  A
 * scalar head brings the destination to a 32-byte boundary (so vector
 * stores never straddle cache lines) and a scalar tail finishes; both use
 * the shared scalar conversions, so every element rounds exactly as in the
 * scalar set.
 */
#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"

enum { VECTOR_BYTES = 32 };

/* Buffers are walked as bytes: a buffer need not be aligned to its element
 * size, so no pointer to one of its elements is ever formed except for the
 * vector intrinsics' explicitly unaligned loads and stores; the scalar
 * heads and tails go through kernels.h's ls_unscale1_* and ls_load_*. */

/* The finite test: a value is non-finite iff its magnitude bits (sign
 * cleared) reach the all-ones exponent, so the running unsigned maximum of
 * the magnitudes answers for a whole buffer.  Magnitudes never have their
 * top bit set, so signed compares order them correctly. */
static inline __m256i magnitude_f32(__m256 v)
{
    return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
}

static inline __m256i magnitude_f64(__m256d v)
{
    return _mm256_and_si256(_mm256_castpd_si256(v), _mm256_set1_epi64x(INT64_MAX));
}

static inline __m256i magnitude_16(__m256i v)
{
    return _mm256_and_si256(v, _mm256_set1_epi16(0x7fff));
}

static inline int any_above16(__m256i v, int16_t limit)
{
    return _mm256_movemask_epi8(_mm256_cmpgt_epi16(v, _mm256_set1_epi16(limit))) != 0;
}

static inline int any_above32(__m256i v, int32_t limit)
{
    return _mm256_movemask_epi8(_mm256_cmpgt_epi32(v, _mm256_set1_epi32(limit))) != 0;
}

/* No 64-bit max before AVX-512: float64 lanes keep "reached the limit"
 * flags instead of the maximum itself. */
static inline __m256i note_reached64(__m256i flags, __m256i magnitude, int64_t limit)
{
    return _mm256_or_si256(flags, _mm256_cmpgt_epi64(magnitude, _mm256_set1_epi64x(limit - 1)));
}

/* ---------------------------------------------------------------- checks */

/* One loop for all four dtypes: finiteness only looks at the bits, as
 * integers of the dtype's width.  Blocks of 2 KiB keep the early exit off
 * the per-vector path.  A large buffer is read as CHECK_STREAMS streams, as
 * the AVX-512 set does (kernels_avx512.c says why). */
enum { CHECK_BLOCK = 2048, CHECK_STREAMS = 4, CHECK_STEP = CHECK_BLOCK / CHECK_STREAMS };
enum { CHECK_MIN_SPAN = 64 * 1024 }; /* bytes per stream before streams pay */

LS_INLINE uint64_t magnitude1_bits(const char *p, int bits)
{
    switch (bits) {
    case 16:
        return ls_load_u16(p) & 0x7fffu;
    case 32:
        return ls_load_u32(p) & 0x7fffffffu;
    default:
        return ls_load_u64(p) & 0x7fffffffffffffffull;
    }
}

LS_INLINE __m256i note_magnitude(__m256i acc, __m256i v, int bits, uint64_t limit)
{
    switch (bits) {
    case 16:
        return _mm256_max_epu16(acc, magnitude_16(v));
    case 32:
        return _mm256_max_epu32(acc, _mm256_and_si256(v, _mm256_set1_epi32(0x7fffffff)));
    default:
        return note_reached64(acc, _mm256_and_si256(v, _mm256_set1_epi64x(INT64_MAX)),
                              (int64_t)limit);
    }
}

LS_INLINE int reached(__m256i acc, int bits, uint64_t limit)
{
    switch (bits) {
    case 16:
        return any_above16(acc, (int16_t)(limit - 1));
    case 32:
        return any_above32(acc, (int32_t)(limit - 1));
    default:
        return _mm256_movemask_epi8(acc) != 0;
    }
}

/* `len` bytes (a multiple of 128) from q noted into acc. */
LS_INLINE __m256i check_bytes(__m256i acc, const char *q, size_t len, int bits, uint64_t limit)
{
    for (size_t k = 0; k < len; k += 4 * 32) {
        acc = note_magnitude(acc, _mm256_loadu_si256((const __m256i *)(q + k)), bits, limit);
        acc = note_magnitude(acc, _mm256_loadu_si256((const __m256i *)(q + k + 32)), bits, limit);
        acc = note_magnitude(acc, _mm256_loadu_si256((const __m256i *)(q + k + 64)), bits, limit);
        acc = note_magnitude(acc, _mm256_loadu_si256((const __m256i *)(q + k + 96)), bits, limit);
    }
    return acc;
}

LS_INLINE int check_avx2(const void *src, size_t n, int bits, uint64_t limit)
{
    const char *p = (const char *)src;
    const size_t esize = (size_t)bits / 8;
    const size_t bytes = n * esize;
    int bad1 = 0;
    __m256i acc = _mm256_setzero_si256();
    size_t i = 0;
    for (size_t head = ls_elems_to_boundary(p, esize, VECTOR_BYTES, n) * esize; i < head; i += esize)
        bad1 |= magnitude1_bits(p + i, bits) >= limit;
    const size_t span = (bytes - i) / (CHECK_STREAMS * CHECK_BLOCK) * CHECK_BLOCK;
    if (span >= CHECK_MIN_SPAN) {
        for (size_t b = 0; b < span; b += CHECK_STEP) {
            for (size_t s = 0; s < CHECK_STREAMS; s++)
                acc = check_bytes(acc, p + i + s * span + b, CHECK_STEP, bits, limit);
            if (reached(acc, bits, limit))
                return 0;
        }
        i += CHECK_STREAMS * span;
    }
    for (; bytes - i >= CHECK_BLOCK; i += CHECK_BLOCK) {
        acc = check_bytes(acc, p + i, CHECK_BLOCK, bits, limit);
        if (reached(acc, bits, limit))
            return 0;
    }
    for (; bytes - i >= 32; i += 32)
        acc = note_magnitude(acc, _mm256_loadu_si256((const __m256i *)(p + i)), bits, limit);
    for (; i < bytes; i += esize)
        bad1 |= magnitude1_bits(p + i, bits) >= limit;
    return !bad1 && !reached(acc, bits, limit);
}

static int check_f16_avx2(const void *src, size_t n) { return check_avx2(src, n, 16, 0x7c00u); }
static int check_bf16_avx2(const void *src, size_t n) { return check_avx2(src, n, 16, 0x7f80u); }
static int check_f32_avx2(const void *src, size_t n) { return check_avx2(src, n, 32, 0x7f800000u); }
static int check_f64_avx2(const void *src, size_t n)
{
    return check_avx2(src, n, 64, 0x7ff0000000000000ull);
}

/* --------------------------------------------------------------- float32 */

/* Elements i.. of x and y: a vector load and store need no alignment. */
LS_INLINE __m256i unscale8_f32(const char *x, char *y, size_t i, __m256 s, int check_inputs)
{
    __m256 in = _mm256_loadu_ps((const float *)(x + sizeof(float) * i));
    __m256 out = _mm256_mul_ps(in, s);
    _mm256_storeu_ps((float *)(y + sizeof(float) * i), out);
    return magnitude_f32(check_inputs ? in : out);
}

LS_INLINE int unscale_f32_run(const char *x, char *y, size_t n, float inv, int check_inputs)
{
    const __m256 s = _mm256_set1_ps(inv);
    int bad1 = 0;
    __m256i worst = _mm256_setzero_si256();
    size_t i = 0;
    for (size_t head = ls_elems_to_boundary(y, sizeof(float), VECTOR_BYTES, n); i < head; i++)
        bad1 |= ls_unscale1_f32(x, y, i, inv, check_inputs);
    for (; n - i >= 32; i += 32) {
        worst = _mm256_max_epu32(worst, unscale8_f32(x, y, i, s, check_inputs));
        worst = _mm256_max_epu32(worst, unscale8_f32(x, y, i + 8, s, check_inputs));
        worst = _mm256_max_epu32(worst, unscale8_f32(x, y, i + 16, s, check_inputs));
        worst = _mm256_max_epu32(worst, unscale8_f32(x, y, i + 24, s, check_inputs));
    }
    for (; n - i >= 8; i += 8)
        worst = _mm256_max_epu32(worst, unscale8_f32(x, y, i, s, check_inputs));
    for (; i < n; i++)
        bad1 |= ls_unscale1_f32(x, y, i, inv, check_inputs);
    return !bad1 && !any_above32(worst, 0x7f7fffff);
}

static int unscale_f32_avx2(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f32_run((const char *)src, (char *)dst, n, (float)inv, 1);
    return unscale_f32_run((const char *)src, (char *)dst, n, (float)inv, 0);
}

/* --------------------------------------------------------------- float64 */

LS_INLINE __m256i unscale4_f64(const char *x, char *y, size_t i, __m256d s, int check_inputs)
{
    __m256d in = _mm256_loadu_pd((const double *)(x + sizeof(double) * i));
    __m256d out = _mm256_mul_pd(in, s);
    _mm256_storeu_pd((double *)(y + sizeof(double) * i), out);
    return magnitude_f64(check_inputs ? in : out);
}

LS_INLINE int unscale_f64_run(const char *x, char *y, size_t n, double inv, int check_inputs)
{
    const int64_t limit = 0x7ff0000000000000ll;
    const __m256d s = _mm256_set1_pd(inv);
    int bad1 = 0;
    __m256i reached = _mm256_setzero_si256();
    size_t i = 0;
    for (size_t head = ls_elems_to_boundary(y, sizeof(double), VECTOR_BYTES, n); i < head; i++)
        bad1 |= ls_unscale1_f64(x, y, i, inv, check_inputs);
    for (; n - i >= 16; i += 16) {
        reached = note_reached64(reached, unscale4_f64(x, y, i, s, check_inputs), limit);
        reached = note_reached64(reached, unscale4_f64(x, y, i + 4, s, check_inputs), limit);
        reached = note_reached64(reached, unscale4_f64(x, y, i + 8, s, check_inputs), limit);
        reached = note_reached64(reached, unscale4_f64(x, y, i + 12, s, check_inputs), limit);
    }
    for (; n - i >= 4; i += 4)
        reached = note_reached64(reached, unscale4_f64(x, y, i, s, check_inputs), limit);
    for (; i < n; i++)
        bad1 |= ls_unscale1_f64(x, y, i, inv, check_inputs);
    return !bad1 && !_mm256_movemask_epi8(reached);
}

static int unscale_f64_avx2(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f64_run((const char *)src, (char *)dst, n, inv, 1);
    return unscale_f64_run((const char *)src, (char *)dst, n, inv, 0);
}

/* --------------------------------------------------------------- float16 */

/* F16C conversions are exact on the way in and round to nearest-even on
 * the way out, subnormal halves included.  A product of two halves is
 * never a float32 subnormal (the smallest is 2^-48), so DAZ/FTZ cannot
 * change it either. */
LS_INLINE __m128i unscale8_f16(const char *x, char *y, size_t i, __m256 s, int check_inputs)
{
    __m128i in = _mm_loadu_si128((const __m128i *)(x + sizeof(uint16_t) * i));
    __m256 product = _mm256_mul_ps(_mm256_cvtph_ps(in), s);
    __m128i out = _mm256_cvtps_ph(product, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(y + sizeof(uint16_t) * i), out);
    return _mm_and_si128(check_inputs ? in : out, _mm_set1_epi16(0x7fff));
}

LS_INLINE int unscale_f16_run(const char *x, char *y, size_t n, float inv, int check_inputs)
{
    const __m256 s = _mm256_set1_ps(inv);
    int bad1 = 0;
    __m128i worst = _mm_setzero_si128();
    size_t i = 0;
    for (size_t head = ls_elems_to_boundary(y, sizeof(uint16_t), VECTOR_BYTES, n); i < head; i++)
        bad1 |= ls_unscale1_f16(x, y, i, inv, check_inputs);
    for (; n - i >= 32; i += 32) {
        worst = _mm_max_epu16(worst, unscale8_f16(x, y, i, s, check_inputs));
        worst = _mm_max_epu16(worst, unscale8_f16(x, y, i + 8, s, check_inputs));
        worst = _mm_max_epu16(worst, unscale8_f16(x, y, i + 16, s, check_inputs));
        worst = _mm_max_epu16(worst, unscale8_f16(x, y, i + 24, s, check_inputs));
    }
    for (; n - i >= 8; i += 8)
        worst = _mm_max_epu16(worst, unscale8_f16(x, y, i, s, check_inputs));
    for (; i < n; i++)
        bad1 |= ls_unscale1_f16(x, y, i, inv, check_inputs);
    return !bad1 && !_mm_movemask_epi8(_mm_cmpgt_epi16(worst, _mm_set1_epi16(0x7bff)));
}

static int unscale_f16_avx2(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f16_run((const char *)src, (char *)dst, n, (float)inv, 1);
    return unscale_f16_run((const char *)src, (char *)dst, n, (float)inv, 0);
}

/* -------------------------------------------------------------- bfloat16 */

/* ls_f32_to_bf16 on eight lanes, the result in the low half of each 32-bit
 * lane.  Its NaN case is not needed: a NaN product of a bfloat16 has its
 * low 16 bits clear (the multiply only quiets the NaN it was given, or
 * makes the default NaN), so rounding never carries it into infinity. */
static inline __m256i round_bf16(__m256 f)
{
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
    return _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
}

/* Interleaving with zeros widens within each 128-bit lane, and packus
 * narrows back within each lane the same way, so the element order
 * survives without a cross-lane shuffle. */
LS_INLINE __m256i unscale16_bf16(const char *x, char *y, size_t i, __m256 s, int check_inputs)
{
    const __m256i zero = _mm256_setzero_si256();
    __m256i in = _mm256_loadu_si256((const __m256i *)(x + sizeof(uint16_t) * i));
    __m256 lo = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, in)), s);
    __m256 hi = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, in)), s);
    __m256i out = _mm256_packus_epi32(round_bf16(lo), round_bf16(hi));
    _mm256_storeu_si256((__m256i *)(y + sizeof(uint16_t) * i), out);
    return magnitude_16(check_inputs ? in : out);
}

LS_INLINE int unscale_bf16_run(const char *x, char *y, size_t n, float inv,
                               int check_inputs)
{
    const __m256 s = _mm256_set1_ps(inv);
    int bad1 = 0;
    __m256i worst = _mm256_setzero_si256();
    size_t i = 0;
    for (size_t head = ls_elems_to_boundary(y, sizeof(uint16_t), VECTOR_BYTES, n); i < head; i++)
        bad1 |= ls_unscale1_bf16(x, y, i, inv, check_inputs);
    for (; n - i >= 32; i += 32) {
        worst = _mm256_max_epu16(worst, unscale16_bf16(x, y, i, s, check_inputs));
        worst = _mm256_max_epu16(worst, unscale16_bf16(x, y, i + 16, s, check_inputs));
    }
    for (; n - i >= 16; i += 16)
        worst = _mm256_max_epu16(worst, unscale16_bf16(x, y, i, s, check_inputs));
    for (; i < n; i++)
        bad1 |= ls_unscale1_bf16(x, y, i, inv, check_inputs);
    return !bad1 && !any_above16(worst, 0x7f7f);
}

static int unscale_bf16_avx2(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_bf16_run((const char *)src, (char *)dst, n, (float)inv, 1);
    return unscale_bf16_run((const char *)src, (char *)dst, n, (float)inv, 0);
}

const ls_kernel_set ls_kernels_avx2 = {
    {check_f16_avx2, check_bf16_avx2, check_f32_avx2, check_f64_avx2},
    {unscale_f16_avx2, unscale_bf16_avx2, unscale_f32_avx2, unscale_f64_avx2},
};
