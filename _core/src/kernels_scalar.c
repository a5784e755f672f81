/*
 * The scalar kernel set: the reference every SIMD set is tested against.
 *
 * Plain C, no ISA flags.  Half-precision conversions are done on the bits
 * so that they are exact and portable (round to nearest-even, subnormals
 * kept); float arithmetic is left to the hardware so that the caller's
 * FTZ/DAZ state (LS_FLUSH_DENORMALS) applies as it does in TensorFlow.
 */
#include <string.h>

#include "kernels.h"

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float ls_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) /* inf / NaN */
        return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return bits_f32(sign);
        /* subnormal half: man * 2^-24, exact in float32; built from bits so
         * that it does not depend on DAZ */
        int shift = 0;
        while (!(man & 0x400u)) {
            man <<= 1;
            shift++;
        }
        man &= 0x3ffu;
        return bits_f32(sign | ((uint32_t)(113 - shift) << 23) | (man << 13));
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t ls_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) /* inf or NaN (NaN kept quiet) */
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0));
    if (a >= 0x477ff000u) /* rounds to >= 65536: overflow */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below 2^-14: half subnormal or zero */
        if (a < 0x33000000u) /* below 2^-25: rounds to zero (2^-25 itself ties to even 0) */
            return sign;
        uint32_t exp = a >> 23;
        uint32_t man = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - exp; /* 14..24: value = man * 2^(exp-150), half unit 2^-24 */
        uint32_t q = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias exponent, round 13 dropped bits to nearest-even; a
     * carry into the exponent is the correct result */
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

float ls_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t ls_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---------------------------------------------------------------- checks */

/* Finite iff the exponent field is not all ones.  Elements are read
 * through ls_load_* (kernels.h): buffers may be misaligned. */
LS_INLINE int check_run(ls_dtype dtype, const void *src, size_t n)
{
    const char *x = (const char *)src;
    for (size_t i = 0; i < n; i++) {
        int bad;
        switch (dtype) {
        case LS_FLOAT16:
            bad = (ls_load_u16(x + 2 * i) & 0x7c00u) == 0x7c00u;
            break;
        case LS_BFLOAT16:
            bad = (ls_load_u16(x + 2 * i) & 0x7f80u) == 0x7f80u;
            break;
        case LS_FLOAT32:
            bad = (ls_load_u32(x + 4 * i) & 0x7f800000u) == 0x7f800000u;
            break;
        default:
            bad = (ls_load_u64(x + 8 * i) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
        }
        if (bad)
            return 0;
    }
    return 1;
}

/* -------------------------------------------------------------- unscale */

/* Each element is kernels.h's ls_unscale1_*, the arithmetic the vector
 * sets' heads and tails share; the finite test is folded into an OR so the
 * loop has no branch. */
LS_INLINE int unscale_run(ls_dtype dtype, const void *x, void *y, size_t n, double inv,
                          unsigned flags)
{
    const int check_inputs = (flags & LS_CHECK_INPUTS) != 0;
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        switch (dtype) {
        case LS_FLOAT16:
            bad |= ls_unscale1_f16(x, y, i, (float)inv, check_inputs);
            break;
        case LS_BFLOAT16:
            bad |= ls_unscale1_bf16(x, y, i, (float)inv, check_inputs);
            break;
        case LS_FLOAT32:
            bad |= ls_unscale1_f32(x, y, i, (float)inv, check_inputs);
            break;
        default:
            bad |= ls_unscale1_f64(x, y, i, inv, check_inputs);
        }
    }
    return !bad;
}

/* Both kernels of a dtype, the loops above specialised to it. */
#define SCALAR_KERNELS(dtname, dtype)                                                       \
    static int check_##dtname(const void *src, size_t n) { return check_run(dtype, src, n); } \
    static int unscale_##dtname(const void *src, void *dst, size_t n, double inv,            \
                                unsigned flags)                                              \
    {                                                                                        \
        return unscale_run(dtype, src, dst, n, inv, flags);                                  \
    }

SCALAR_KERNELS(f16, LS_FLOAT16)
SCALAR_KERNELS(bf16, LS_BFLOAT16)
SCALAR_KERNELS(f32, LS_FLOAT32)
SCALAR_KERNELS(f64, LS_FLOAT64)

const ls_kernel_set ls_kernels_scalar = {
    {check_f16, check_bf16, check_f32, check_f64},
    {unscale_f16, unscale_bf16, unscale_f32, unscale_f64},
};
