/*
 * Lists of buffers: validation, and running a kernel over a range of the
 * concatenated elements.  A range is how work is split between threads
 * (ours or a host's pool): fixed costs are paid once per range, not once
 * per tensor, which is what makes thousands of tiny tensors cheap.
 */
#include <math.h>
#include <string.h>

#include "internal.h"

static const size_t elem_size[LS_NUM_DTYPES] = {2, 2, 4, 8};

int ls_validate(const ls_buffer *bufs, size_t count)
{
    if (count > 0 && bufs == NULL)
        return LS_ERR_ARG;
    for (size_t i = 0; i < count; i++) {
        if ((unsigned)bufs[i].dtype >= LS_NUM_DTYPES)
            return LS_ERR_DTYPE;
        if (bufs[i].length > 0 && bufs[i].src == NULL)
            return LS_ERR_ARG;
    }
    return LS_OK;
}

static int validate_for_unscale(const ls_buffer *bufs, size_t count)
{
    int rc = ls_validate(bufs, count);
    if (rc != LS_OK)
        return rc;
    for (size_t i = 0; i < count; i++) {
        const ls_buffer *b = &bufs[i];
        if (b->length == 0)
            continue;
        if (b->dst == NULL)
            return LS_ERR_ARG;
        /* in place, or disjoint */
        const char *s = (const char *)b->src, *d = (const char *)b->dst;
        size_t bytes = b->length * elem_size[b->dtype];
        if (s != d && s < d + bytes && d < s + bytes)
            return LS_ERR_ARG;
    }
    return LS_OK;
}

size_t ls_total_length(const ls_buffer *bufs, size_t count)
{
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        total += bufs[i].length;
    return total;
}

static const unsigned known_flags = LS_FLUSH_DENORMALS | LS_CHECK_INPUTS;

/* Runs the kernels over [begin, end); assumes validated arguments. */
int ls_run_range(const ls_kernel_set *k, const ls_buffer *bufs, size_t count,
                 const double *inv_by_dtype, unsigned flags, size_t begin, size_t end)
{
    ls_fpenv env;
    ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
    int finite = 1;
    size_t offset = 0; /* start of bufs[i] in the concatenation */
    for (size_t i = 0; i < count && offset < end; offset += bufs[i].length, i++) {
        const ls_buffer *b = &bufs[i];
        size_t lo = begin > offset ? begin - offset : 0;
        size_t hi = b->length < end - offset ? b->length : end - offset;
        if (lo >= hi)
            continue;
        size_t bytes = elem_size[b->dtype] * lo;
        const void *src = (const char *)b->src + bytes;
        if (inv_by_dtype) {
            void *dst = (char *)b->dst + bytes;
            finite &= k->unscale[b->dtype](src, dst, hi - lo, inv_by_dtype[b->dtype], flags);
        } else if (finite) {
            finite = k->check[b->dtype](src, hi - lo);
        }
        /* a check-only pass may stop at the first non-finite value */
        if (!finite && !inv_by_dtype)
            break;
    }
    ls_fpenv_leave(&env);
    return finite;
}

int ls_prepare(const ls_buffer *bufs, size_t count, const double *inv_scale, unsigned flags,
               double inv_by_dtype[LS_NUM_DTYPES], const ls_kernel_set **kernels)
{
    if (flags & ~known_flags)
        return LS_ERR_ARG;
    *kernels = ls_active_kernels();
    if (*kernels == NULL)
        return LS_ERR_SIMD;
    if (inv_scale == NULL)
        return ls_validate(bufs, count);
    if (!(*inv_scale == *inv_scale) || *inv_scale - *inv_scale != 0.0) /* NaN or inf */
        return LS_ERR_ARG;
    for (int t = 0; t < LS_NUM_DTYPES; t++)
        inv_by_dtype[t] = ls_round_to_dtype(*inv_scale, (ls_dtype)t);
    return validate_for_unscale(bufs, count);
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
