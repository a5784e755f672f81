/*
 * The public entry points of unscaling and checking, as the header lists
 * them: whole lists, split over the library's threads (threads.c) or a
 * host's parallel-for, and ranges.  Each validates its arguments
 * (lists.c) before any buffer is touched, so a rejected call writes
 * nothing.
 */
#include <math.h>
#include <string.h>

#include "internal.h"

int ls_unscale_with(const ls_buffer *bufs, size_t count, double inv_scale, unsigned flags,
                    ls_parallel_fn parallel, void *host)
{
    double inv[LS_NUM_DTYPES];
    const ls_kernel_set *k;
    int rc = ls_prepare(bufs, count, &inv_scale, flags, inv, &k);
    if (rc != LS_OK)
        return rc;
    return ls_run_split(k, bufs, count, inv, flags, parallel, host);
}

int ls_all_finite_with(const ls_buffer *bufs, size_t count, unsigned flags,
                       ls_parallel_fn parallel, void *host)
{
    const ls_kernel_set *k;
    int rc = ls_prepare(bufs, count, NULL, flags, NULL, &k);
    if (rc != LS_OK)
        return rc;
    return ls_run_split(k, bufs, count, NULL, flags, parallel, host);
}

int ls_unscale(const ls_buffer *bufs, size_t count, double inv_scale, unsigned flags)
{
    return ls_unscale_with(bufs, count, inv_scale, flags, NULL, NULL);
}

int ls_all_finite(const ls_buffer *bufs, size_t count, unsigned flags)
{
    return ls_all_finite_with(bufs, count, flags, NULL, NULL);
}

int ls_unscale_range(const ls_buffer *bufs, size_t count, double inv_scale, unsigned flags,
                     size_t begin, size_t end)
{
    double inv[LS_NUM_DTYPES];
    const ls_kernel_set *k;
    int rc = ls_prepare(bufs, count, &inv_scale, flags, inv, &k);
    if (rc != LS_OK)
        return rc;
    if (begin > end || end > ls_total_length(bufs, count))
        return LS_ERR_ARG;
    return ls_run_range(k, bufs, count, inv, flags, begin, end);
}

int ls_all_finite_range(const ls_buffer *bufs, size_t count, unsigned flags, size_t begin,
                        size_t end)
{
    const ls_kernel_set *k;
    int rc = ls_prepare(bufs, count, NULL, flags, NULL, &k);
    if (rc != LS_OK)
        return rc;
    if (begin > end || end > ls_total_length(bufs, count))
        return LS_ERR_ARG;
    return ls_run_range(k, bufs, count, NULL, flags, begin, end);
}

/* |value| (finite, non-zero) rounded to nearest-even in a binary format with
 * `digits` significand bits (the implicit one included) whose smallest
 * normal exponent is `emin`, in one rounding: the quantum at value's binade
 * (the subnormal one below 2^emin) scales value to an integer part that a
 * double holds exactly, whose fraction decides.  Returns the rounded
 * magnitude, +inf where it exceeds `max_finite`. */
static double round_binary(double a, int digits, int emin, double max_finite)
{
    int e;
    (void)frexp(a, &e); /* a = m * 2^e, m in [0.5, 1): a's binade is 2^(e-1) */
    int q = (e - 1 > emin ? e - 1 : emin) - (digits - 1);
    double t = ldexp(a, -q); /* exact: a power-of-two scaling within range */
    double n = floor(t);
    double frac = t - n; /* exact: t < 2^54 */
    if (frac > 0.5 || (frac == 0.5 && fmod(n, 2.0) != 0.0))
        n += 1.0;
    double r = ldexp(n, q);
    return r > max_finite ? INFINITY : r;
}

double ls_round_to_dtype(double value, ls_dtype dtype)
{
    /* Conversions from double are done in IEEE mode: a caller's FTZ must not
     * flush a subnormal result here.  Every case is one rounding of the
     * double itself, never through float32 (two roundings differ from one
     * just above a 16-bit tie). */
    ls_fpenv env;
    ls_fpenv_enter(&env, 0);
    double r;
    switch (dtype) {
    case LS_FLOAT64:
        r = value;
        break;
    case LS_FLOAT32:
        r = (double)(float)value;
        break;
    case LS_BFLOAT16:
    case LS_FLOAT16:
        if (value != value || value == 0.0 || fabs(value) == INFINITY) {
            r = value;
        } else {
            /* bfloat16: 8 significand bits, float32's exponent range;
             * float16: 11 bits, normals from 2^-14, largest 65504. */
            double a = dtype == LS_BFLOAT16
                           ? round_binary(fabs(value), 8, -126, 0x1.fep127)
                           : round_binary(fabs(value), 11, -14, 65504.0);
            r = copysign(a, value);
        }
        break;
    default:
        r = value;
    }
    ls_fpenv_leave(&env);
    return r;
}

float ls_reciprocal_f32(float scale, unsigned flags)
{
    ls_fpenv env;
    ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
    const float r = ls_f32_div(1.0f, scale);
    ls_fpenv_leave(&env);
    return r;
}

int ls_exact_reciprocal(float scale)
{
    uint32_t bits;
    memcpy(&bits, &scale, sizeof bits);
    const unsigned exponent = bits >> 23; /* a set sign bit makes it > 255 */
    return (bits & 0x7fffffu) == 0 && exponent >= 1 && exponent <= 253;
}
