/*
 * The fused optimizer kernels on AArch64 Advanced SIMD: four float32
 * lanes.  Plain FMUL/FADD/FDIV/FSQRT (never FMLA), so each lane rounds as
 * the scalar reference does; max is spelled out so that NaN picks the
 * same operand as on x86.
 */
#include <arm_neon.h>

#include "optim.h"

#define LS_V float32x4_t
#define LS_VW 4
#define LS_OPTIM_SET neon
#define LS_OPTIM_NAME "neon"

static inline float32x4_t v_load(const float *p) { return vld1q_f32(p); }
static inline void v_store(float *p, float32x4_t v) { vst1q_f32(p, v); }
static inline float32x4_t v_load_f16(const uint16_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
static inline float32x4_t v_load_bf16(const uint16_t *p)
{
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
static inline float32x4_t v_set1(float x) { return vdupq_n_f32(x); }
static inline float32x4_t v_add(float32x4_t a, float32x4_t b) { return vaddq_f32(a, b); }
static inline float32x4_t v_sub(float32x4_t a, float32x4_t b) { return vsubq_f32(a, b); }
static inline float32x4_t v_mul(float32x4_t a, float32x4_t b) { return vmulq_f32(a, b); }
static inline float32x4_t v_div(float32x4_t a, float32x4_t b) { return vdivq_f32(a, b); }
static inline float32x4_t v_sqrt(float32x4_t a) { return vsqrtq_f32(a); }
static inline float32x4_t v_max(float32x4_t a, float32x4_t b)
{
    return vbslq_f32(vcgtq_f32(a, b), a, b);
}

#include "optim_body.h"
