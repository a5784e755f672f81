/*
 * Lists of buffers: the argument checks every entry point (unscale.c)
 * starts with, and running a kernel over a range of the concatenated
 * elements.  A range is how work is split between threads
 * (ours or a host's pool): fixed costs are paid once per range, not once
 * per tensor, which is what makes thousands of tiny tensors cheap.
 */
#include "internal.h"

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
        const size_t bytes = b->length * ls_dtype_size(b->dtype);
        if (b->src != b->dst && !ls_disjoint(b->src, bytes, b->dst, bytes))
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
        size_t bytes = ls_dtype_size(b->dtype) * lo;
        const void *src = (const char *)b->src + bytes;
        /* a set without a kernel for a dtype leaves it to the scalar set */
        if (inv_by_dtype) {
            void *dst = (char *)b->dst + bytes;
            ls_unscale_fn unscale = k->unscale[b->dtype] ? k->unscale[b->dtype]
                                                         : ls_kernels_scalar.unscale[b->dtype];
            finite &= unscale(src, dst, hi - lo, inv_by_dtype[b->dtype], flags);
        } else if (finite) {
            ls_check_fn check = k->check[b->dtype] ? k->check[b->dtype]
                                                   : ls_kernels_scalar.check[b->dtype];
            finite = check(src, hi - lo);
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
