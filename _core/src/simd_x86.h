/*
 * simd.h's vocabulary on x86, written once for both widths the x86 sets
 * use: LS_X86_BITS 256 is AVX2 + F16C (the avx2 set), 512 is AVX-512
 * F/BW/DQ/VL (avx512, and avx512bf16 with VCVTNE2PS2BF16).  Intel names
 * an operation alike at both widths but for the width (_mm256_add_ps,
 * _mm512_add_ps): LS_MM(add_ps) is the one at LS_X86_BITS (LS_MM_SI and
 * LS_MM_FROM_SI for the names that carry it twice).  Where the names
 * differ otherwise, LS_X86_PICK(256-bit form, 512-bit form) chooses;
 * what only AVX-512 has (masked loads and stores, compares into a mask
 * register) is under LS_X86_BITS == 512.
 *
 * Only plain multiplies, adds, divides and square roots (no FMA), so each
 * lane rounds as the scalar reference does.  F16C's conversions are exact
 * on the way in and round to nearest-even on the way out, subnormal halves
 * included, whatever MXCSR says.
 */
#ifndef LOSSSCALE_SIMD_X86_H
#define LOSSSCALE_SIMD_X86_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#if LS_X86_BITS == 256
#define LS_SET avx2
#elif LS_X86_BITS == 512
#define LS_SET avx512
#else
#error "define LS_X86_BITS as 256 or 512 before including simd_x86.h"
#endif

#define LS_X86_PASTE(a, b, c) a##b##c
#define LS_X86_CAT(a, b, c) LS_X86_PASTE(a, b, c)
/* _mm256_op, _mm256_op_si256 and _mm256_castsi256_to at 256 bits */
#define LS_MM(op) LS_X86_CAT(_mm, LS_X86_BITS, _##op)
#define LS_MM_SI(op) LS_X86_CAT(LS_MM(op), si, LS_X86_BITS)
#define LS_MM_FROM_SI(to) LS_X86_CAT(LS_MM(castsi), LS_X86_BITS, _##to)
#define LS_X86_PICK(at256, at512) LS_X86_CAT(LS_X86_PICK_, LS_X86_BITS, )(at256, at512)
#define LS_X86_PICK_256(at256, at512) at256
#define LS_X86_PICK_512(at256, at512) at512

#define LS_V LS_X86_CAT(__m, LS_X86_BITS, )
#define LS_VD LS_X86_CAT(__m, LS_X86_BITS, d)
#define LS_VU LS_X86_CAT(__m, LS_X86_BITS, i)
#define LS_VW (LS_X86_BITS / 32)
enum { LS_VBYTES = LS_X86_BITS / 8 };

/* Half a vector of bits: LS_VW 16-bit values. */
#define LS_X86_HALF LS_X86_PICK(__m128i, __m256i)
#define LS_X86_LOAD_HALF(p) \
    LS_X86_PICK(_mm_loadu_si128, _mm256_loadu_si256)((const LS_X86_HALF *)(p))
#define LS_X86_F16_ROUNDING (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* ---------------------------------------------------------------- float32 */

static inline LS_V v_load(const float *p) { return LS_MM(loadu_ps)(p); }
static inline void v_store(float *p, LS_V v) { LS_MM(storeu_ps)(p, v); }
static inline LS_V v_set1(float x) { return LS_MM(set1_ps)(x); }
static inline LS_V v_add(LS_V a, LS_V b) { return LS_MM(add_ps)(a, b); }
static inline LS_V v_sub(LS_V a, LS_V b) { return LS_MM(sub_ps)(a, b); }
static inline LS_V v_mul(LS_V a, LS_V b) { return LS_MM(mul_ps)(a, b); }
static inline LS_V v_div(LS_V a, LS_V b) { return LS_MM(div_ps)(a, b); }
static inline LS_V v_sqrt(LS_V a) { return LS_MM(sqrt_ps)(a); }
static inline LS_V v_max(LS_V a, LS_V b) { return LS_MM(max_ps)(a, b); }
static inline LS_V v_min(LS_V a, LS_V b) { return LS_MM(min_ps)(a, b); }
static inline LS_V v_abs(LS_V a) { return LS_MM(andnot_ps)(v_set1(-0.0f), a); }

/* Maximum and Sign as TensorFlow's CPU kernels compute them in their
 * vector body (Eigen's NaN-propagating pmax, and its generic psign): the
 * compares honour DAZ as theirs do. */
#if LS_X86_BITS == 512
static inline LS_V v_maximum(LS_V a, LS_V b)
{
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_max_ps(a, b), a);
}

static inline LS_V v_sign(LS_V a)
{
    const LS_V m = v_abs(a);
    const LS_V one = _mm512_or_ps(_mm512_and_ps(a, v_set1(-0.0f)), v_set1(1.0f));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_setzero_ps(), m, _CMP_LT_OQ), m, one);
}
#else
static inline LS_V v_maximum(LS_V a, LS_V b)
{
    return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

static inline LS_V v_sign(LS_V a)
{
    const LS_V m = v_abs(a);
    const LS_V one = _mm256_or_ps(_mm256_and_ps(a, v_set1(-0.0f)), v_set1(1.0f));
    return _mm256_blendv_ps(m, one, _mm256_cmp_ps(_mm256_setzero_ps(), m, _CMP_LT_OQ));
}
#endif

/* RSQRTPS is 256 bits wide at most: AVX-512's own estimate (VRSQRT14PS)
 * is another one, so the 512-bit set takes RSQRTPS on each half. */
#define LS_V_RSQRT_X86 1
#if LS_X86_BITS == 512
static inline LS_V v_rsqrt_estimate(LS_V a)
{
    const __m256 lo = _mm256_rsqrt_ps(_mm512_castps512_ps256(a)),
                 hi = _mm256_rsqrt_ps(_mm512_extractf32x8_ps(a, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
static inline LS_V v_nan_to(LS_V a, LS_V b)
{
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a, b);
}
#else
static inline LS_V v_rsqrt_estimate(LS_V a) { return _mm256_rsqrt_ps(a); }
static inline LS_V v_nan_to(LS_V a, LS_V b)
{
    return _mm256_blendv_ps(a, b, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
#endif

static inline LS_VD vd_set1(double x) { return LS_MM(set1_pd)(x); }
static inline LS_VD vd_mul(LS_VD a, LS_VD b) { return LS_MM(mul_pd)(a, b); }

/* ------------------------------------------------------------------- bits */

static inline LS_VU vu_load(const void *p) { return LS_MM_SI(loadu_)((const LS_VU *)p); }
static inline void vu_store(void *p, LS_VU v) { LS_MM_SI(storeu_)((LS_VU *)p, v); }
static inline LS_VU vu_zero(void) { return LS_MM_SI(setzero_)(); }
static inline LS_VU vu_and(LS_VU a, LS_VU b) { return LS_MM_SI(and_)(a, b); }
static inline LS_VU vu_set1_32(uint32_t x) { return LS_MM(set1_epi32)((int)x); }
static inline LS_VU vu_set1_64(uint64_t x)
{
    return LS_X86_PICK(_mm256_set1_epi64x, _mm512_set1_epi64)((long long)x);
}
static inline LS_VU vu_add32(LS_VU a, LS_VU b) { return LS_MM(add_epi32)(a, b); }
static inline LS_VU vu_shr32_16(LS_VU v) { return LS_MM(srli_epi32)(v, 16); }
static inline LS_VU vu_max16(LS_VU a, LS_VU b) { return LS_MM(max_epu16)(a, b); }
static inline LS_VU vu_max32(LS_VU a, LS_VU b) { return LS_MM(max_epu32)(a, b); }

/* Some lane >= x.  AVX2 compares only signed, into a vector: right
 * here, since a magnitude never has its lane's top bit set. */
#if LS_X86_BITS == 512
#define LS_X86_ANY_GE(bits, v, limit) \
    (LS_X86_CAT(_mm512_cmpge_epu, bits, _mask)(v, LS_X86_CAT(_mm512_set1_epi, bits, )(limit)) != 0)
#else
#define LS_X86_ANY_GE(bits, v, limit)                                  \
    (_mm256_movemask_epi8(LS_X86_CAT(_mm256_cmpgt_epi, bits, )(        \
         v, LS_X86_CAT(_mm256_set1_epi, bits, )(limit - 1))) != 0)
#endif
static inline int vu_any_ge16(LS_VU v, uint16_t x) { return LS_X86_ANY_GE(16, v, (short)x); }
static inline int vu_any_ge32(LS_VU v, uint32_t x) { return LS_X86_ANY_GE(32, v, (int)x); }

static inline LS_VU v_bits(LS_V v) { return LS_MM_SI(castps_)(v); }
static inline LS_V v_of_bits(LS_VU v) { return LS_MM_FROM_SI(ps)(v); }
static inline LS_VU vd_bits(LS_VD v) { return LS_MM_SI(castpd_)(v); }
static inline LS_VD vd_of_bits(LS_VU v) { return LS_MM_FROM_SI(pd)(v); }

/* ------------------------------------------------------ 16-bit conversions */

static inline LS_V v_load_f16(const uint16_t *p) { return LS_MM(cvtph_ps)(LS_X86_LOAD_HALF(p)); }

static inline LS_V v_load_bf16(const uint16_t *p)
{
    return v_of_bits(LS_MM(slli_epi32)(LS_MM(cvtepu16_epi32)(LS_X86_LOAD_HALF(p)), 16));
}

/* float16: the low half of the vector, then the high half. */
static inline LS_V v_f16_lo(LS_VU v)
{
    return LS_MM(cvtph_ps)(LS_X86_PICK(_mm256_castsi256_si128, _mm512_castsi512_si256)(v));
}

static inline LS_V v_f16_hi(LS_VU v)
{
    return LS_MM(cvtph_ps)(LS_X86_PICK(_mm256_extracti128_si256, _mm512_extracti64x4_epi64)(v, 1));
}

static inline LS_VU vu_f16(LS_V lo, LS_V hi)
{
    LS_VU low = LS_X86_PICK(_mm256_castsi128_si256, _mm512_castsi256_si512)(
        LS_MM(cvtps_ph)(lo, LS_X86_F16_ROUNDING));
    return LS_X86_PICK(_mm256_inserti128_si256, _mm512_inserti64x4)(
        low, LS_MM(cvtps_ph)(hi, LS_X86_F16_ROUNDING), 1);
}

/* bfloat16: interleaving with zeros widens within each 128-bit lane, and
 * packus narrows back within each lane the same way, so the element order
 * survives without a cross-lane shuffle. */
static inline LS_V v_bf16_lo(LS_VU v) { return v_of_bits(LS_MM(unpacklo_epi16)(vu_zero(), v)); }
static inline LS_V v_bf16_hi(LS_VU v) { return v_of_bits(LS_MM(unpackhi_epi16)(vu_zero(), v)); }

static inline LS_VU vu_pack_hi16(LS_VU a, LS_VU b)
{
    return LS_MM(packus_epi32)(vu_shr32_16(a), vu_shr32_16(b));
}

/* ---------------------------------------------------------- AVX-512 only */

#if LS_X86_BITS == 512
#define LS_V_MASKED 1

static inline __mmask64 ls_x86_first_bytes(size_t k) { return (__mmask64)((1ull << k) - 1u); }

static inline LS_VU vu_load_part(const void *p, size_t k)
{
    return _mm512_maskz_loadu_epi8(ls_x86_first_bytes(k), p);
}

static inline void vu_store_part(void *p, LS_VU v, size_t k)
{
    _mm512_mask_storeu_epi8(p, ls_x86_first_bytes(k), v);
}

#ifdef __AVX512BF16__
#define LS_V_BF16_NE 1

/* VCVTNE2PS2BF16 packs its two sources whole (hi above lo), where
 * v_bf16_lo/hi split within 128-bit lanes: its quarters are put back. */
static inline LS_VU vu_bf16_ne(LS_V lo, LS_V hi)
{
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), packed);
}

static inline __mmask16 ls_x86_subnormal_lanes(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f);
    const __mmask16 exponent_zero = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_test_epi32_mask(exponent_zero, u, _mm512_set1_epi32(0x007fffff));
}

static inline int v_has_subnormal(LS_V lo, LS_V hi)
{
    return (ls_x86_subnormal_lanes(lo) | ls_x86_subnormal_lanes(hi)) != 0;
}
#endif /* __AVX512BF16__ */

#else
#define LS_V_MASKED 0
#endif

#endif /* LOSSSCALE_SIMD_X86_H */
