/*
 * The unscale kernel of one buffer, written once over simd.h's
 * vocabulary and compiled by each kernel set's file: the scalar set's
 * arithmetic (kernels.h's ls_unscale1_*) on whole vectors, bit for bit.
 * 16-bit types are widened to two float32 vectors, multiplied (a plain
 * multiply, never fused) and rounded back to nearest-even: float16 by the
 * ISA's conversion, bfloat16 on the bits (or by VCVTNE2PS2BF16, below).
 * The finite test keeps the largest magnitude of the probed values in
 * registers and looks at it once at the end (simd.h), so the loop has no
 * data-dependent branch.
 */
#ifndef LOSSSCALE_UNSCALE_BODY_H
#define LOSSSCALE_UNSCALE_BODY_H

#include "simd.h"

/* How a float32 product goes back to bfloat16.  VCVTNE2PS2BF16 rounds to
 * nearest-even but always reads float32 subnormals as zero, whatever MXCSR
 * says: right when flushing (FTZ already made every product normal or
 * zero), wrong for IEEE results, where ml_dtypes keeps subnormals.  So in
 * IEEE mode it is used only on vectors that hold no subnormal product. */
enum bf16_rounding {
    BF16_INTEGER,     /* round on the bits (every set) */
    BF16_CVTNE,       /* flushing: every product is normal or zero */
    BF16_CVTNE_GUARD, /* IEEE: the instruction where no lane is subnormal */
};

/* ls_f32_to_bf16 on every 32-bit lane, the result in the high half.  Its
 * NaN case is not needed: a NaN product of a bfloat16 has its low 16 bits
 * clear (the multiply only quiets the NaN it was given, or makes the
 * default NaN), so rounding never carries it into infinity. */
LS_INLINE LS_VU LS_FN(round_bf16)(LS_V f)
{
    const LS_VU u = v_bits(f);
    const LS_VU lsb = vu_and(vu_shr32_16(u), vu_set1_32(1));
    return vu_add32(u, vu_add32(lsb, vu_set1_32(0x7fff)));
}

LS_INLINE LS_VU LS_FN(to_bf16)(LS_V lo, LS_V hi, enum bf16_rounding rounding)
{
#ifdef LS_V_BF16_NE
    if (rounding == BF16_CVTNE || (rounding == BF16_CVTNE_GUARD && !v_has_subnormal(lo, hi)))
        return vu_bf16_ne(lo, hi);
#endif
    (void)rounding;
    return vu_pack_hi16(LS_FN(round_bf16)(lo), LS_FN(round_bf16)(hi));
}

/* One vector of elements times the scale, rounded to the dtype.  A
 * product of two halves is never a float32 subnormal (the smallest is
 * 2^-48), so DAZ/FTZ cannot change a float16 result. */
LS_INLINE LS_VU LS_FN(unscale_bits)(LS_VU in, ls_dtype dt, LS_V s, LS_VD sd,
                                    enum bf16_rounding rounding)
{
    switch (dt) {
    case LS_FLOAT16:
        return vu_f16(v_mul(v_f16_lo(in), s), v_mul(v_f16_hi(in), s));
    case LS_BFLOAT16:
        return LS_FN(to_bf16)(v_mul(v_bf16_lo(in), s), v_mul(v_bf16_hi(in), s), rounding);
    case LS_FLOAT32:
        return v_bits(v_mul(v_of_bits(in), s));
    default:
        return vd_bits(vd_mul(vd_of_bits(in), sd));
    }
}

/* The parameters every step of one run shares. */
typedef struct LS_FN(unscale_ctx) {
    LS_V s;
    LS_VD sd;
    ls_dtype dt;
    int check_inputs;
    enum bf16_rounding rounding;
} LS_FN(unscale_ctx);

LS_INLINE LS_VU LS_FN(unscale_vec)(LS_VU worst, const char *x, char *y,
                                   const LS_FN(unscale_ctx) *c)
{
    LS_VU in = vu_load(x);
    LS_VU out = LS_FN(unscale_bits)(in, c->dt, c->s, c->sd, c->rounding);
    vu_store(y, out);
    return ls_note_magnitudes(worst, c->check_inputs ? in : out, c->dt);
}

/* Bytes [from, to) of x and y, less than one vector: one vector through
 * vu_load_part and vu_store_part (a lane beyond the end is zero, so it
 * never looks non-finite) where the set has masked loads and stores, and
 * for the 16-bit types, whose scalar conversions cost more than simd.h's
 * trip through the stack; else the scalar reference element by element.
 * Every vector lane equals the scalar reference bit for bit. */
LS_INLINE LS_VU LS_FN(unscale_edge)(LS_VU worst, int *bad, const char *x, char *y, size_t from,
                                    size_t to, double inv, const LS_FN(unscale_ctx) *c)
{
    const size_t esize = ls_dtype_size(c->dt);
    if (LS_V_MASKED || esize == 2) {
        if (from < to) {
            LS_VU in = vu_load_part(x + from, to - from);
            LS_VU out = LS_FN(unscale_bits)(in, c->dt, c->s, c->sd, c->rounding);
            vu_store_part(y + from, out, to - from);
            worst = ls_note_magnitudes(worst, c->check_inputs ? in : out, c->dt);
        }
        return worst;
    }
    for (size_t b = from; b < to; b += esize) {
        if (c->dt == LS_FLOAT32)
            *bad |= ls_unscale1_f32(x + b, y + b, 0, (float)inv, c->check_inputs);
        else
            *bad |= ls_unscale1_f64(x + b, y + b, 0, inv, c->check_inputs);
    }
    return worst;
}

/* The kernel: n elements of src times inv into dst (kernels.h's
 * ls_unscale_fn), for a dtype and a check_inputs known when it is inlined.
 * Each pass of the main loop does four float32 vectors' worth of
 * arithmetic, each vector noting into a record of its own (one record
 * alone would make the loop wait on its every maximum).  The head that
 * aligns a large buffer aligns its destination (simd.h). */
LS_INLINE int LS_FN(unscale_run)(const void *src, void *dst, size_t n, double inv,
                                 int check_inputs, ls_dtype dt, enum bf16_rounding rounding)
{
    const char *x = (const char *)src;
    char *y = (char *)dst;
    const LS_FN(unscale_ctx) c = {v_set1((float)inv), vd_set1(inv), dt, check_inputs, rounding};
    const size_t esize = ls_dtype_size(dt), bytes = n * esize;
    const size_t per_pass = esize == 2 ? 2 : 4, pass = per_pass * LS_VBYTES;
    LS_VU worst = vu_zero();
    int bad = 0;
    size_t i = ls_head_bytes(y, n, dt);
    worst = LS_FN(unscale_edge)(worst, &bad, x, y, 0, i, inv, &c);
    if (bytes - i >= pass) {
        LS_VU w[4] = {worst, vu_zero(), vu_zero(), vu_zero()};
        for (; bytes - i >= pass; i += pass)
            for (size_t k = 0; k < per_pass; k++)
                w[k] = LS_FN(unscale_vec)(w[k], x + i + k * LS_VBYTES, y + i + k * LS_VBYTES, &c);
        worst = w[0];
        for (size_t k = 1; k < per_pass; k++)
            worst = ls_merge_magnitudes(worst, w[k], dt);
    }
    for (; bytes - i >= LS_VBYTES; i += LS_VBYTES)
        worst = LS_FN(unscale_vec)(worst, x + i, y + i, &c);
    worst = LS_FN(unscale_edge)(worst, &bad, x, y, i, bytes, inv, &c);
    return !bad && !ls_any_nonfinite(worst, dt);
}

#endif /* LOSSSCALE_UNSCALE_BODY_H */
