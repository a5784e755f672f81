/*
 * What the two AVX-512 kernel sets share: kernels_avx512.c's kernels,
 * which the avx512bf16 set reuses for everything but bfloat16 unscaling,
 * and the bfloat16 unscale loop, which each set instantiates with its own
 * rounding (on the bits in avx512; with VCVTNE2PS2BF16 in avx512bf16, the
 * only file compiled with -mavx512bf16).
 */
#ifndef LOSSSCALE_KERNELS_AVX512_H
#define LOSSSCALE_KERNELS_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"

/* Destination stores are aligned to this so that none straddles two lines. */
enum { CACHE_LINE = 64 };

int ls_avx512_check_f16(const void *src, size_t n);
int ls_avx512_check_bf16(const void *src, size_t n);
int ls_avx512_check_f32(const void *src, size_t n);
int ls_avx512_check_f64(const void *src, size_t n);
int ls_avx512_unscale_f16(const void *src, void *dst, size_t n, double inv, unsigned flags);
int ls_avx512_unscale_f32(const void *src, void *dst, size_t n, double inv, unsigned flags);
int ls_avx512_unscale_f64(const void *src, void *dst, size_t n, double inv, unsigned flags);

static inline __mmask16 first16(size_t k) { return (__mmask16)((1u << k) - 1u); }
static inline __mmask32 first32(size_t k) { return (__mmask32)((1u << k) - 1u); }

/* ------------------------------------------------------ bfloat16 unscale */

/* How a float32 product goes back to bfloat16.  VCVTNEPS2BF16 rounds to
 * nearest-even but always reads float32 subnormals as zero, whatever MXCSR
 * says: right when flushing (FTZ already made every product normal or
 * zero), wrong for IEEE results, where ml_dtypes keeps subnormals.  So in
 * IEEE mode it is used only on vectors that hold no subnormal product. */
enum bf16_rounding {
    BF16_INTEGER,     /* round on the bits (the avx512 set) */
    BF16_CVTNE,       /* flushing: every product is normal or zero */
    BF16_CVTNE_GUARD, /* IEEE: the instruction where no lane is subnormal */
};

/* ls_f32_to_bf16 on sixteen lanes, the result in the low half of each
 * 32-bit lane.  Its NaN case is not needed: a NaN product of a bfloat16
 * has its low 16 bits clear (the multiply only quiets the NaN it was
 * given, or makes the default NaN), so rounding never carries it into
 * infinity. */
static inline __m512i round_bf16(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    return _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
}

static inline __mmask16 subnormal_lanes(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f);
    const __mmask16 exponent_zero = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_test_epi32_mask(exponent_zero, u, _mm512_set1_epi32(0x007fffff));
}

/* Interleaving with zeros widens within each 128-bit lane, and packus
 * narrows back within each lane the same way, so the integer path keeps
 * the element order without a shuffle.  VCVTNE2PS2BF16 packs its two
 * sources whole instead, so its quarters are put back in order. */
LS_INLINE __m512i unscale32_bf16(__m512i h, __m512 s, enum bf16_rounding rounding)
{
    const __m512i zero = _mm512_setzero_si512();
    __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, h)), s);
    __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, h)), s);
#ifdef __AVX512BF16__
    if (rounding != BF16_INTEGER &&
        !(rounding == BF16_CVTNE_GUARD && (subnormal_lanes(lo) | subnormal_lanes(hi)))) {
        const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), packed);
    }
#endif
    return _mm512_packus_epi32(round_bf16(lo), round_bf16(hi));
}

LS_INLINE __m512i unscale_bf16_part(const uint16_t *x, uint16_t *y, __m512 s, __mmask32 m,
                                    int check_inputs, enum bf16_rounding rounding)
{
    __m512i in = _mm512_maskz_loadu_epi16(m, x);
    __m512i out = unscale32_bf16(in, s, rounding);
    _mm512_mask_storeu_epi16(y, m, out);
    return _mm512_and_si512(check_inputs ? in : out, _mm512_set1_epi16(0x7fff));
}

LS_INLINE __m512i unscale_bf16_vec(const uint16_t *x, uint16_t *y, __m512 s, int check_inputs,
                                   enum bf16_rounding rounding)
{
    __m512i in = _mm512_loadu_si512(x);
    __m512i out = unscale32_bf16(in, s, rounding);
    _mm512_storeu_si512(y, out);
    return _mm512_and_si512(check_inputs ? in : out, _mm512_set1_epi16(0x7fff));
}

LS_INLINE int unscale_bf16_run(const uint16_t *x, uint16_t *y, size_t n, float inv,
                               int check_inputs, enum bf16_rounding r)
{
    const __m512 s = _mm512_set1_ps(inv);
    __m512i worst = _mm512_setzero_si512();
    size_t i = ls_elems_to_boundary(y, sizeof *y, CACHE_LINE, n);
    if (i)
        worst = unscale_bf16_part(x, y, s, first32(i), check_inputs, r);
    for (; n - i >= 64; i += 64) {
        worst = _mm512_max_epu16(worst, unscale_bf16_vec(x + i, y + i, s, check_inputs, r));
        worst = _mm512_max_epu16(worst, unscale_bf16_vec(x + i + 32, y + i + 32, s, check_inputs, r));
    }
    for (; n - i >= 32; i += 32)
        worst = _mm512_max_epu16(worst, unscale_bf16_vec(x + i, y + i, s, check_inputs, r));
    if (i < n)
        worst = _mm512_max_epu16(
            worst, unscale_bf16_part(x + i, y + i, s, first32(n - i), check_inputs, r));
    return !_mm512_cmpge_epu16_mask(worst, _mm512_set1_epi16(0x7f80));
}

#endif /* LOSSSCALE_KERNELS_AVX512_H */
