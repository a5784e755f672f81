/*
 * The public entry points of unscaling and checking, as the header lists
 * them: whole lists, split over the library's threads (threads.c), and
 * ranges, for hosts with their own pool.  Each validates its arguments
 * (lists.c) before any buffer is touched, so a rejected call writes
 * nothing.
 */
#include <math.h>
#include <string.h>

#include "internal.h"

int ls_unscale(const ls_buffer *bufs, size_t count, double inv_scale, unsigned flags)
{
    double inv[LS_NUM_DTYPES];
    const ls_kernel_set *k;
    int rc = ls_prepare(bufs, count, &inv_scale, flags, inv, &k);
    if (rc != LS_OK)
        return rc;
    return ls_run_split(k, bufs, count, inv, flags);
}

int ls_all_finite(const ls_buffer *bufs, size_t count, unsigned flags)
{
    const ls_kernel_set *k;
    int rc = ls_prepare(bufs, count, NULL, flags, NULL, &k);
    if (rc != LS_OK)
        return rc;
    return ls_run_split(k, bufs, count, NULL, flags);
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

double ls_round_to_dtype(double value, ls_dtype dtype)
{
    /* Conversions from double are done in IEEE mode: a caller's FTZ must not
     * flush a subnormal float32 inv_scale here. */
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
        /* double -> float32 -> bfloat16, two roundings: what ml_dtypes'
         * bfloat16(x) and TensorFlow's tf.cast(float64 -> bfloat16) give,
         * so that both oracles of the bfloat16 results agree with us. */
        r = (double)ls_bf16_to_f32(ls_f32_to_bf16((float)value));
        break;
    case LS_FLOAT16: {
        /* double -> half in one rounding, as numpy's float16(x): round to
         * float32 with the bits below half precision folded into a sticky
         * bit, so the second rounding cannot meet a false tie. */
        float f = (float)value;
        if ((double)f != value && f == f) {
            uint32_t u;
            memcpy(&u, &f, sizeof u);
            /* move towards the true value's side if float rounding crossed it,
             * then set the sticky (lowest) bit */
            if (fabs((double)f) > fabs(value))
                u -= 1; /* f rounded away from zero: step back towards it
                           (never from zero itself, which would wrap to NaN) */
            u |= 1u;
            memcpy(&f, &u, sizeof f);
        }
        r = (double)ls_f16_to_f32(ls_f32_to_f16(f));
        break;
    }
    default:
        r = value;
    }
    ls_fpenv_leave(&env);
    return r;
}
