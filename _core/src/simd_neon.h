/*
 * simd.h's vocabulary on AArch64 Advanced SIMD (NEON): 128-bit vectors,
 * the base ISA only, so that it runs on every AArch64 CPU.  Raw bits are
 * uint32x4_t, reinterpreted for the 16-bit operations; VLD1/VST1 take any
 * address.  float16 goes through FCVTL/FCVTN, which convert exactly and
 * round to nearest-even with subnormal halves kept whatever FPCR.FZ says;
 * bfloat16 is rounded on the bits (BFCVTN is an optional extension).
 * Plain FMUL/FADD/FDIV/FSQRT (never FMLA) honour FPCR.FZ as the scalar
 * set's do; max is spelled out so that NaN picks the same operand as on
 * x86.  There are no masked loads and stores.
 */
#ifndef LOSSSCALE_SIMD_NEON_H
#define LOSSSCALE_SIMD_NEON_H

#include <arm_neon.h>
#include <stddef.h>
#include <stdint.h>

#define LS_SET neon
#define LS_V float32x4_t
#define LS_VD float64x2_t
#define LS_VU uint32x4_t
#define LS_VW 4
#define LS_V_MASKED 0
#define LS_V_RSQRT_X86 0
enum { LS_VBYTES = 16 };

/* ---------------------------------------------------------------- float32 */

static inline LS_V v_load(const float *p) { return vld1q_f32(p); }
static inline void v_store(float *p, LS_V v) { vst1q_f32(p, v); }
static inline LS_V v_set1(float x) { return vdupq_n_f32(x); }
static inline LS_V v_add(LS_V a, LS_V b) { return vaddq_f32(a, b); }
static inline LS_V v_sub(LS_V a, LS_V b) { return vsubq_f32(a, b); }
static inline LS_V v_mul(LS_V a, LS_V b) { return vmulq_f32(a, b); }
static inline LS_V v_div(LS_V a, LS_V b) { return vdivq_f32(a, b); }
static inline LS_V v_sqrt(LS_V a) { return vsqrtq_f32(a); }
static inline LS_V v_max(LS_V a, LS_V b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline LS_V v_min(LS_V a, LS_V b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
static inline LS_V v_abs(LS_V a) { return vabsq_f32(a); }

/* Maximum and Sign as TensorFlow's CPU kernels compute them (simd.h). */
static inline LS_V v_maximum(LS_V a, LS_V b) { return vbslq_f32(vceqq_f32(a, a), v_max(a, b), a); }

static inline LS_V v_sign(LS_V a)
{
    const LS_V m = vabsq_f32(a);
    const LS_V one = vbslq_f32(vdupq_n_u32(0x80000000u), a, vdupq_n_f32(1.0f));
    return vbslq_f32(vcltq_f32(vdupq_n_f32(0.0f), m), one, m);
}

static inline LS_VD vd_set1(double x) { return vdupq_n_f64(x); }
static inline LS_VD vd_mul(LS_VD a, LS_VD b) { return vmulq_f64(a, b); }

/* ------------------------------------------------------------------- bits */

static inline LS_VU vu_load(const void *p)
{
    return vreinterpretq_u32_u8(vld1q_u8((const uint8_t *)p));
}

static inline void vu_store(void *p, LS_VU v) { vst1q_u8((uint8_t *)p, vreinterpretq_u8_u32(v)); }
static inline LS_VU vu_zero(void) { return vdupq_n_u32(0); }
static inline LS_VU vu_and(LS_VU a, LS_VU b) { return vandq_u32(a, b); }
static inline LS_VU vu_set1_32(uint32_t x) { return vdupq_n_u32(x); }
static inline LS_VU vu_set1_64(uint64_t x) { return vreinterpretq_u32_u64(vdupq_n_u64(x)); }
static inline LS_VU vu_add32(LS_VU a, LS_VU b) { return vaddq_u32(a, b); }
static inline LS_VU vu_shr32_16(LS_VU v) { return vshrq_n_u32(v, 16); }

static inline uint16x8_t ls_neon_u16(LS_VU v) { return vreinterpretq_u16_u32(v); }

static inline LS_VU vu_max16(LS_VU a, LS_VU b)
{
    return vreinterpretq_u32_u16(vmaxq_u16(ls_neon_u16(a), ls_neon_u16(b)));
}

static inline LS_VU vu_max32(LS_VU a, LS_VU b) { return vmaxq_u32(a, b); }
static inline int vu_any_ge16(LS_VU v, uint16_t x) { return vmaxvq_u16(ls_neon_u16(v)) >= x; }
static inline int vu_any_ge32(LS_VU v, uint32_t x) { return vmaxvq_u32(v) >= x; }

static inline LS_VU v_bits(LS_V v) { return vreinterpretq_u32_f32(v); }
static inline LS_V v_of_bits(LS_VU v) { return vreinterpretq_f32_u32(v); }
static inline LS_VU vd_bits(LS_VD v) { return vreinterpretq_u32_f64(v); }
static inline LS_VD vd_of_bits(LS_VU v) { return vreinterpretq_f64_u32(v); }

/* ------------------------------------------------------ 16-bit conversions */

static inline LS_V v_load_f16(const uint16_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

static inline LS_V v_load_bf16(const uint16_t *p)
{
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* Both 16-bit types: the low four lanes, then the high four. */
static inline LS_V v_f16_lo(LS_VU v)
{
    return vcvt_f32_f16(vget_low_f16(vreinterpretq_f16_u32(v)));
}

static inline LS_V v_f16_hi(LS_VU v) { return vcvt_high_f32_f16(vreinterpretq_f16_u32(v)); }

static inline LS_VU vu_f16(LS_V lo, LS_V hi)
{
    return vreinterpretq_u32_f16(vcvt_high_f16_f32(vcvt_f16_f32(lo), hi));
}

static inline LS_V v_bf16_lo(LS_VU v)
{
    return vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(ls_neon_u16(v)), 16));
}

static inline LS_V v_bf16_hi(LS_VU v)
{
    return vreinterpretq_f32_u32(vshll_high_n_u16(ls_neon_u16(v), 16));
}

static inline LS_VU vu_pack_hi16(LS_VU a, LS_VU b)
{
    return vreinterpretq_u32_u16(vshrn_high_n_u32(vshrn_n_u32(a, 16), b, 16));
}

#endif /* LOSSSCALE_SIMD_NEON_H */
