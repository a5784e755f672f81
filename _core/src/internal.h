/*
 * Declarations shared by the core's own translation units (not installed).
 */
#ifndef LOSSSCALE_INTERNAL_H
#define LOSSSCALE_INTERNAL_H

#include <pthread.h>

#include "kernels.h"

typedef pthread_once_t ls_once_t;
#define LS_ONCE_INIT PTHREAD_ONCE_INIT
#define ls_once(flag, fn) pthread_once((flag), (fn))

/* The kernel set chosen by dispatch, or NULL when LOSSSCALE_SIMD cannot be
 * honoured. */
const ls_kernel_set *ls_active_kernels(void);
/* The set at `level` of dispatch's table, or NULL when this library or
 * this CPU lacks it (for drivers that run every set, like the fuzzer). */
const ls_kernel_set *ls_kernels_at(int level);

/* Floating-point control state: FTZ/DAZ on (flush) or off (IEEE). */
typedef struct ls_fpenv {
    unsigned long saved;
} ls_fpenv;
void ls_fpenv_enter(ls_fpenv *env, int flush);
void ls_fpenv_leave(const ls_fpenv *env);

/* lists.c: argument checks shared by every entry point, then one range. */
int ls_prepare(const ls_buffer *bufs, size_t count, const double *inv_scale, unsigned flags,
               double inv_by_dtype[LS_NUM_DTYPES], const ls_kernel_set **kernels);
int ls_run_range(const ls_kernel_set *k, const ls_buffer *bufs, size_t count,
                 const double *inv_by_dtype, unsigned flags, size_t begin, size_t end);

/* threads.c: `range(ctx, begin, end)` over [0, total) split across the
 * library's threads (or on the caller's alone when they are busy or the
 * work is small); returns the AND of the parts' results, which must be 0
 * or 1.  Parts begin on multiples of 64 elements. */
typedef int (*ls_range_fn)(const void *ctx, size_t begin, size_t end);
int ls_run_parallel(ls_range_fn range, const void *ctx, size_t total);

/* A whole list of ls_run_range over the library's threads; assumes
 * validated arguments. */
int ls_run_split(const ls_kernel_set *k, const ls_buffer *bufs, size_t count,
                 const double *inv, unsigned flags);

#endif /* LOSSSCALE_INTERNAL_H */
