/*
 * The AArch64 Advanced SIMD (NEON) kernel set: the scalar set's arithmetic
 * on 128-bit vectors, bit for bit, using only the base ISA so that it runs
 * on every AArch64 CPU.  float16 goes through FCVTL/FCVTN, which convert
 * exactly and round to nearest-even with subnormal halves kept whatever
 * FPCR.FZ says; bfloat16 is rounded on the bits (BFCVTN is an optional
 * extension).  Multiplies are plain, never fused, and honour FPCR.FZ as
 * the scalar set's do.  The finite test keeps the largest magnitude seen in
 * a register and looks at it once at the end, so the loops have no
 * data-dependent branch; a scalar tail uses the shared scalar conversions.
 */
#include <arm_neon.h>
#include <stdint.h>

#include "kernels.h"

/* Buffers are walked as bytes: a buffer need not be aligned to its element
 * size, so no pointer to one of its elements is ever formed except for the
 * vector loads and stores (VLD1/VST1 take any address); the scalar tails
 * go through kernels.h's ls_unscale1_* and ls_load_*. */

/* The finite test: a value is non-finite iff its magnitude bits (sign
 * cleared) reach the all-ones exponent, so the running unsigned maximum of
 * the magnitudes answers for a whole buffer. */
static inline uint32x4_t magnitude_f32(float32x4_t v)
{
    return vandq_u32(vreinterpretq_u32_f32(v), vdupq_n_u32(0x7fffffffu));
}

static inline uint16x8_t magnitude_16(uint16x8_t v)
{
    return vandq_u16(v, vdupq_n_u16(0x7fffu));
}

/* No 64-bit max in NEON: float64 lanes keep "reached the limit" flags
 * instead of the maximum itself. */
static inline uint64x2_t note_reached64(uint64x2_t flags, uint64x2_t bits)
{
    const uint64x2_t magnitude = vandq_u64(bits, vdupq_n_u64(0x7fffffffffffffffull));
    return vorrq_u64(flags, vcgeq_u64(magnitude, vdupq_n_u64(0x7ff0000000000000ull)));
}

static inline int any_reached64(uint64x2_t flags)
{
    return vmaxvq_u32(vreinterpretq_u32_u64(flags)) != 0;
}

/* Vectors of elements i.. of a buffer. */
static inline uint16x8_t load_u16(const char *p, size_t i)
{
    return vld1q_u16((const uint16_t *)(p + sizeof(uint16_t) * i));
}

static inline uint32x4_t load_u32(const char *p, size_t i)
{
    return vld1q_u32((const uint32_t *)(p + sizeof(uint32_t) * i));
}

static inline uint64x2_t load_u64(const char *p, size_t i)
{
    return vld1q_u64((const uint64_t *)(p + sizeof(uint64_t) * i));
}

/* ---------------------------------------------------------------- checks */

/* Blocks of 2 KiB keep the early exit off the per-vector path. */
enum { CHECK_BLOCK = 2048 };

static int check_16(const char *x, size_t n, uint16_t limit)
{
    uint16x8_t worst = vdupq_n_u16(0);
    size_t i = 0;
    const size_t block = CHECK_BLOCK / sizeof(uint16_t);
    while (n - i >= block) {
        for (size_t end = i + block; i < end; i += 32) {
            worst = vmaxq_u16(worst, magnitude_16(load_u16(x, i)));
            worst = vmaxq_u16(worst, magnitude_16(load_u16(x, i + 8)));
            worst = vmaxq_u16(worst, magnitude_16(load_u16(x, i + 16)));
            worst = vmaxq_u16(worst, magnitude_16(load_u16(x, i + 24)));
        }
        if (vmaxvq_u16(worst) >= limit)
            return 0;
    }
    for (; n - i >= 8; i += 8)
        worst = vmaxq_u16(worst, magnitude_16(load_u16(x, i)));
    int bad1 = 0;
    for (; i < n; i++)
        bad1 |= (ls_load_u16(x + sizeof(uint16_t) * i) & 0x7fffu) >= limit;
    return !bad1 && vmaxvq_u16(worst) < limit;
}

static int check_f16_neon(const void *src, size_t n) { return check_16(src, n, 0x7c00u); }
static int check_bf16_neon(const void *src, size_t n) { return check_16(src, n, 0x7f80u); }

static int check_f32_neon(const void *src, size_t n)
{
    const char *x = (const char *)src;
    const uint32x4_t mask = vdupq_n_u32(0x7fffffffu);
    uint32x4_t worst = vdupq_n_u32(0);
    size_t i = 0;
    const size_t block = CHECK_BLOCK / sizeof(uint32_t);
    while (n - i >= block) {
        for (size_t end = i + block; i < end; i += 16) {
            worst = vmaxq_u32(worst, vandq_u32(load_u32(x, i), mask));
            worst = vmaxq_u32(worst, vandq_u32(load_u32(x, i + 4), mask));
            worst = vmaxq_u32(worst, vandq_u32(load_u32(x, i + 8), mask));
            worst = vmaxq_u32(worst, vandq_u32(load_u32(x, i + 12), mask));
        }
        if (vmaxvq_u32(worst) >= 0x7f800000u)
            return 0;
    }
    for (; n - i >= 4; i += 4)
        worst = vmaxq_u32(worst, vandq_u32(load_u32(x, i), mask));
    int bad1 = 0;
    for (; i < n; i++)
        bad1 |= (ls_load_u32(x + sizeof(uint32_t) * i) & 0x7fffffffu) >= 0x7f800000u;
    return !bad1 && vmaxvq_u32(worst) < 0x7f800000u;
}

static int check_f64_neon(const void *src, size_t n)
{
    const char *x = (const char *)src;
    uint64x2_t reached = vdupq_n_u64(0);
    size_t i = 0;
    const size_t block = CHECK_BLOCK / sizeof(uint64_t);
    while (n - i >= block) {
        for (size_t end = i + block; i < end; i += 8) {
            reached = note_reached64(reached, load_u64(x, i));
            reached = note_reached64(reached, load_u64(x, i + 2));
            reached = note_reached64(reached, load_u64(x, i + 4));
            reached = note_reached64(reached, load_u64(x, i + 6));
        }
        if (any_reached64(reached))
            return 0;
    }
    for (; n - i >= 2; i += 2)
        reached = note_reached64(reached, load_u64(x, i));
    int bad1 = 0;
    for (; i < n; i++)
        bad1 |= (ls_load_u64(x + sizeof(uint64_t) * i) & 0x7fffffffffffffffull) >=
                0x7ff0000000000000ull;
    return !bad1 && !any_reached64(reached);
}

/* --------------------------------------------------------------- float32 */

LS_INLINE uint32x4_t unscale4_f32(const char *x, char *y, size_t i, float32x4_t s,
                                  int check_inputs)
{
    float32x4_t in = vld1q_f32((const float *)(x + sizeof(float) * i));
    float32x4_t out = vmulq_f32(in, s);
    vst1q_f32((float *)(y + sizeof(float) * i), out);
    return magnitude_f32(check_inputs ? in : out);
}

LS_INLINE int unscale_f32_run(const char *x, char *y, size_t n, float inv, int check_inputs)
{
    const float32x4_t s = vdupq_n_f32(inv);
    uint32x4_t worst = vdupq_n_u32(0);
    size_t i = 0;
    for (; n - i >= 16; i += 16) {
        worst = vmaxq_u32(worst, unscale4_f32(x, y, i, s, check_inputs));
        worst = vmaxq_u32(worst, unscale4_f32(x, y, i + 4, s, check_inputs));
        worst = vmaxq_u32(worst, unscale4_f32(x, y, i + 8, s, check_inputs));
        worst = vmaxq_u32(worst, unscale4_f32(x, y, i + 12, s, check_inputs));
    }
    for (; n - i >= 4; i += 4)
        worst = vmaxq_u32(worst, unscale4_f32(x, y, i, s, check_inputs));
    int bad1 = 0;
    for (; i < n; i++)
        bad1 |= ls_unscale1_f32(x, y, i, inv, check_inputs);
    return !bad1 && vmaxvq_u32(worst) < 0x7f800000u;
}

static int unscale_f32_neon(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f32_run((const char *)src, (char *)dst, n, (float)inv, 1);
    return unscale_f32_run((const char *)src, (char *)dst, n, (float)inv, 0);
}

/* --------------------------------------------------------------- float64 */

LS_INLINE uint64x2_t unscale2_f64(const char *x, char *y, size_t i, float64x2_t s,
                                  int check_inputs)
{
    float64x2_t in = vld1q_f64((const double *)(x + sizeof(double) * i));
    float64x2_t out = vmulq_f64(in, s);
    vst1q_f64((double *)(y + sizeof(double) * i), out);
    return vreinterpretq_u64_f64(check_inputs ? in : out);
}

LS_INLINE int unscale_f64_run(const char *x, char *y, size_t n, double inv, int check_inputs)
{
    const float64x2_t s = vdupq_n_f64(inv);
    uint64x2_t reached = vdupq_n_u64(0);
    size_t i = 0;
    for (; n - i >= 8; i += 8) {
        reached = note_reached64(reached, unscale2_f64(x, y, i, s, check_inputs));
        reached = note_reached64(reached, unscale2_f64(x, y, i + 2, s, check_inputs));
        reached = note_reached64(reached, unscale2_f64(x, y, i + 4, s, check_inputs));
        reached = note_reached64(reached, unscale2_f64(x, y, i + 6, s, check_inputs));
    }
    for (; n - i >= 2; i += 2)
        reached = note_reached64(reached, unscale2_f64(x, y, i, s, check_inputs));
    int bad1 = 0;
    for (; i < n; i++)
        bad1 |= ls_unscale1_f64(x, y, i, inv, check_inputs);
    return !bad1 && !any_reached64(reached);
}

static int unscale_f64_neon(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f64_run((const char *)src, (char *)dst, n, inv, 1);
    return unscale_f64_run((const char *)src, (char *)dst, n, inv, 0);
}

/* --------------------------------------------------------------- float16 */

/* A product of two halves is never a float32 subnormal (the smallest is
 * 2^-48), so FPCR.FZ cannot change it. */
LS_INLINE uint16x8_t unscale8_f16(const char *x, char *y, size_t i, float32x4_t s,
                                  int check_inputs)
{
    uint16x8_t in = load_u16(x, i);
    float16x8_t h = vreinterpretq_f16_u16(in);
    float32x4_t lo = vmulq_f32(vcvt_f32_f16(vget_low_f16(h)), s);
    float32x4_t hi = vmulq_f32(vcvt_high_f32_f16(h), s);
    uint16x8_t out = vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(lo), hi));
    vst1q_u16((uint16_t *)(y + sizeof(uint16_t) * i), out);
    return magnitude_16(check_inputs ? in : out);
}

LS_INLINE int unscale_f16_run(const char *x, char *y, size_t n, float inv, int check_inputs)
{
    const float32x4_t s = vdupq_n_f32(inv);
    uint16x8_t worst = vdupq_n_u16(0);
    size_t i = 0;
    for (; n - i >= 32; i += 32) {
        worst = vmaxq_u16(worst, unscale8_f16(x, y, i, s, check_inputs));
        worst = vmaxq_u16(worst, unscale8_f16(x, y, i + 8, s, check_inputs));
        worst = vmaxq_u16(worst, unscale8_f16(x, y, i + 16, s, check_inputs));
        worst = vmaxq_u16(worst, unscale8_f16(x, y, i + 24, s, check_inputs));
    }
    for (; n - i >= 8; i += 8)
        worst = vmaxq_u16(worst, unscale8_f16(x, y, i, s, check_inputs));
    int bad1 = 0;
    for (; i < n; i++)
        bad1 |= ls_unscale1_f16(x, y, i, inv, check_inputs);
    return !bad1 && vmaxvq_u16(worst) < 0x7c00u;
}

static int unscale_f16_neon(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_f16_run((const char *)src, (char *)dst, n, (float)inv, 1);
    return unscale_f16_run((const char *)src, (char *)dst, n, (float)inv, 0);
}

/* -------------------------------------------------------------- bfloat16 */

/* ls_f32_to_bf16 on four lanes, before the narrowing shift.  Its NaN case
 * is not needed: a NaN product of a bfloat16 has its low 16 bits clear (the
 * multiply only quiets the NaN it was given, or makes the default NaN), so
 * rounding never carries it into infinity. */
static inline uint32x4_t round_bf16(float32x4_t f)
{
    const uint32x4_t u = vreinterpretq_u32_f32(f);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    return vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fffu)));
}

LS_INLINE uint16x8_t unscale8_bf16(const char *x, char *y, size_t i, float32x4_t s,
                                   int check_inputs)
{
    uint16x8_t in = load_u16(x, i);
    float32x4_t lo = vmulq_f32(vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(in), 16)), s);
    float32x4_t hi = vmulq_f32(vreinterpretq_f32_u32(vshll_high_n_u16(in, 16)), s);
    uint16x8_t out = vshrn_high_n_u32(vshrn_n_u32(round_bf16(lo), 16), round_bf16(hi), 16);
    vst1q_u16((uint16_t *)(y + sizeof(uint16_t) * i), out);
    return magnitude_16(check_inputs ? in : out);
}

LS_INLINE int unscale_bf16_run(const char *x, char *y, size_t n, float inv,
                               int check_inputs)
{
    const float32x4_t s = vdupq_n_f32(inv);
    uint16x8_t worst = vdupq_n_u16(0);
    size_t i = 0;
    for (; n - i >= 32; i += 32) {
        worst = vmaxq_u16(worst, unscale8_bf16(x, y, i, s, check_inputs));
        worst = vmaxq_u16(worst, unscale8_bf16(x, y, i + 8, s, check_inputs));
        worst = vmaxq_u16(worst, unscale8_bf16(x, y, i + 16, s, check_inputs));
        worst = vmaxq_u16(worst, unscale8_bf16(x, y, i + 24, s, check_inputs));
    }
    for (; n - i >= 8; i += 8)
        worst = vmaxq_u16(worst, unscale8_bf16(x, y, i, s, check_inputs));
    int bad1 = 0;
    for (; i < n; i++)
        bad1 |= ls_unscale1_bf16(x, y, i, inv, check_inputs);
    return !bad1 && vmaxvq_u16(worst) < 0x7f80u;
}

static int unscale_bf16_neon(const void *src, void *dst, size_t n, double inv, unsigned flags)
{
    if (flags & LS_CHECK_INPUTS)
        return unscale_bf16_run((const char *)src, (char *)dst, n, (float)inv, 1);
    return unscale_bf16_run((const char *)src, (char *)dst, n, (float)inv, 0);
}

const ls_kernel_set ls_kernels_neon = {
    {check_f16_neon, check_bf16_neon, check_f32_neon, check_f64_neon},
    {unscale_f16_neon, unscale_bf16_neon, unscale_f32_neon, unscale_f64_neon},
};
