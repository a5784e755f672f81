/*
 * The vector vocabulary every vector kernel is written over, once, as
 * NumPy's universal intrinsics are: the kernel bodies (optim_body.h,
 * check_body.h, unscale_body.h) use only the names below, and a kernel
 * set's header defines them for its ISA (simd_x86.h at 256 and 512 bits,
 * simd_neon.h) before a set's file includes a body.  What a set defines:
 *
 *   LS_SET               the set's name, a token (avx2): names its kernels
 *   LS_V, LS_VW          float32 vector, its lane count
 *   LS_VD                float64 vector of the same width
 *   LS_VU, LS_VBYTES     the same width as raw bits, its size in bytes
 *
 *   v_load, v_store      unaligned float32 loads and stores
 *   v_load_f16, v_load_bf16   LS_VW 16-bit values widened (exactly)
 *   v_set1, v_add, v_sub, v_mul, v_div, v_sqrt   IEEE, each rounded once
 *   v_max(a, b)          (a > b) ? a : b
 *   v_min(a, b)          (a < b) ? a : b
 *   v_abs(a)             a with its sign bit cleared (NaN too)
 *   v_maximum(a, b)      TensorFlow's Maximum: a where a is NaN, else v_max
 *   v_sign(a)            TensorFlow's Sign: copysign(1, a) where 0 < |a|,
 *                        else |a| (so +0 for -0, |NaN| for NaN; a subnormal
 *                        that a flushing CPU compares as zero stays |a|)
 *   vd_set1, vd_mul      the same for float64
 *
 *   vu_load, vu_store    LS_VBYTES bytes at any address
 *   vu_zero, vu_and, vu_set1_32, vu_set1_64, vu_add32
 *   vu_shr32_16          each 32-bit lane shifted right by 16
 *   vu_max16, vu_max32   unsigned lane maximum
 *   vu_any_ge16, vu_any_ge32(v, limit)   some lane >= limit (unsigned)
 *   v_bits, v_of_bits, vd_bits, vd_of_bits   reinterpretation
 *   v_f16_lo, v_f16_hi   a vector of float16 bits as two float32
 *                        vectors (exactly), in an order vu_f16 undoes;
 *   vu_f16(lo, hi)       rounded back to float16 (nearest-even)
 *   v_bf16_lo, v_bf16_hi, vu_pack_hi16(a, b)   the same for bfloat16: the
 *                        high halves of a's and b's 32-bit lanes
 *
 *   LS_V_MASKED          1 where the ISA has masked loads and stores:
 *   vu_load_part(p, k), vu_store_part(p, v, k)   the first k < LS_VBYTES
 *                        bytes, the other lanes loaded as zero (simd.h
 *                        defines them through the stack where it has not)
 *
 * and where it rounds to bfloat16 in one instruction (LS_V_BF16_NE):
 * vu_bf16_ne(lo, hi) and v_has_subnormal(lo, hi) (see unscale_body.h).
 *
 * and where it has x86's reciprocal square root estimate (LS_V_RSQRT_X86):
 *   v_rsqrt_estimate(a)  RSQRTPS's estimate, lane for lane as RSQRTSS gives
 *                        it, at any width (what TensorFlow's Rsqrt refines)
 *   v_nan_to(a, b)       b where a is NaN, else a
 *
 * Each operation is the one IEEE operation (multiplies are never fused),
 * so every lane rounds as the scalar reference does, whatever the width.
 */
#ifndef LOSSSCALE_SIMD_H
#define LOSSSCALE_SIMD_H

#ifndef LS_SET
#error "include a set's vocabulary (simd_x86.h, simd_neon.h) before simd.h"
#endif

#include "kernels.h"

#define LS_CAT2(a, b) a##b
#define LS_CAT(a, b) LS_CAT2(a, b)
#define LS_STR2(x) #x
#define LS_STR(x) LS_STR2(x)
/* name_<set>: a body's helper; ls_<set>_name: a kernel; the set's name */
#define LS_FN(name) LS_CAT(name##_, LS_SET)
#define LS_KFN(name) LS_CAT(LS_CAT(ls_, LS_SET), _##name)
#define LS_SET_NAME LS_STR(LS_SET)

#if !LS_V_MASKED
/* Without masked loads and stores, a ragged end goes through a vector's
 * worth of stack: the bytes beyond it are zero, as a masked load's. */
static inline LS_VU vu_load_part(const void *p, size_t k)
{
    unsigned char lanes[LS_VBYTES] = {0};
    memcpy(lanes, p, k);
    return vu_load(lanes);
}

static inline void vu_store_part(void *p, LS_VU v, size_t k)
{
    unsigned char lanes[LS_VBYTES];
    vu_store(lanes, v);
    memcpy(p, lanes, k);
}
#endif

/* The bodies peel a head off a buffer so that the vector loop's loads
 * and stores fall on vector boundaries (none straddles two cache lines),
 * from the size where the head costs less than the straddles it saves:
 * 2 KiB for the 16-bit types, whose conversions make a ragged end dear,
 * 512 bytes for the others (measured on Zen 4). */
LS_INLINE size_t ls_head_bytes(const void *p, size_t n, ls_dtype dt)
{
    const size_t esize = ls_dtype_size(dt);
    if (n * esize < (esize == 2 ? 2048u : 512u))
        return 0;
    return ls_elems_to_boundary(p, esize, LS_VBYTES, n) * esize;
}

/* ------------------------------------------------------------- finiteness */

/* A value is non-finite iff its magnitude bits (sign cleared) reach the
 * all-ones exponent, so the running unsigned maximum of the magnitudes
 * answers for a whole buffer, looked at once at the end.  A float64 is
 * decided by its high 32 bits alone (the limit's low half is zero), so
 * every dtype needs only a 16- or a 32-bit maximum: its low half is
 * masked off with the sign. */
LS_INLINE LS_VU ls_note_magnitudes(LS_VU worst, LS_VU bits, ls_dtype dt)
{
    switch (dt) {
    case LS_FLOAT16:
    case LS_BFLOAT16:
        return vu_max16(worst, vu_and(bits, vu_set1_64(0x7fff7fff7fff7fffull)));
    case LS_FLOAT32:
        return vu_max32(worst, vu_and(bits, vu_set1_64(0x7fffffff7fffffffull)));
    default:
        return vu_max32(worst, vu_and(bits, vu_set1_64(0x7fffffff00000000ull)));
    }
}

/* Two records of magnitudes as one. */
LS_INLINE LS_VU ls_merge_magnitudes(LS_VU a, LS_VU b, ls_dtype dt)
{
    return dt == LS_FLOAT16 || dt == LS_BFLOAT16 ? vu_max16(a, b) : vu_max32(a, b);
}

/* Whether the magnitudes noted in `worst` include a non-finite value. */
LS_INLINE int ls_any_nonfinite(LS_VU worst, ls_dtype dt)
{
    switch (dt) {
    case LS_FLOAT16:
        return vu_any_ge16(worst, 0x7c00u);
    case LS_BFLOAT16:
        return vu_any_ge16(worst, 0x7f80u);
    case LS_FLOAT32:
        return vu_any_ge32(worst, 0x7f800000u);
    default:
        return vu_any_ge32(worst, 0x7ff00000u);
    }
}

/* The element at p, one at a time, as the scalar set tests it. */
LS_INLINE int ls_nonfinite1(const char *p, ls_dtype dt)
{
    switch (dt) {
    case LS_FLOAT16:
        return (ls_load_u16(p) & 0x7c00u) == 0x7c00u;
    case LS_BFLOAT16:
        return (ls_load_u16(p) & 0x7f80u) == 0x7f80u;
    case LS_FLOAT32:
        return (ls_load_u32(p) & 0x7f800000u) == 0x7f800000u;
    default:
        return (ls_load_u64(p) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    }
}

#endif /* LOSSSCALE_SIMD_H */
