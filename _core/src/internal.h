/*
 * Declarations shared by the core's own translation units (not installed).
 */
#ifndef LOSSSCALE_INTERNAL_H
#define LOSSSCALE_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

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

/* Whether buffers [a, a + abytes) and [b, b + bbytes) share no byte. */
static inline int ls_disjoint(const void *a, size_t abytes, const void *b, size_t bbytes)
{
    const char *x = (const char *)a, *y = (const char *)b;
    return x + abytes <= y || y + bbytes <= x;
}

/* One float32 operation, rounded to float32 on its own: the store through
 * a volatile keeps the compiler from holding a wider intermediate (x87) or
 * fusing it with a neighbour.  Rounds in the caller's floating-point state. */
static inline float ls_f32_mul(float a, float b)
{
    volatile float r = a * b;
    return r;
}

static inline float ls_f32_div(float a, float b)
{
    volatile float r = a / b;
    return r;
}

/* lists.c: argument checks shared by every entry point, then one range. */
int ls_prepare(const ls_buffer *bufs, size_t count, const double *inv_scale, unsigned flags,
               double inv_by_dtype[LS_NUM_DTYPES], const ls_kernel_set **kernels);
int ls_run_range(const ls_kernel_set *k, const ls_buffer *bufs, size_t count,
                 const double *inv_by_dtype, unsigned flags, size_t begin, size_t end);

/* threads.c: `range(ctx, begin, end)` over [0, total) split across the
 * library's threads as lossscale_chunks.h plans it (or on the caller's
 * alone when they are busy or the work is small); returns the parts'
 * results combined (ls_combine_status).  ls_own_threads is the same as an
 * ls_parallel_fn: what a NULL `parallel` means. */
int ls_run_parallel(ls_range_fn range, const void *ctx, size_t total);
int ls_own_threads(void *host, ls_range_fn range, const void *ctx, size_t total);

/* A whole list of ls_run_range over `parallel` (NULL: the library's
 * threads); assumes validated arguments. */
int ls_run_split(const ls_kernel_set *k, const ls_buffer *bufs, size_t count,
                 const double *inv, unsigned flags, ls_parallel_fn parallel, void *host);

/* optim.c: a sparse gradient's slices grouped by row, a stable counting
 * sort: row r's slices are order[start[r] .. start[r + 1]), in their order
 * (`start` has rows + 1 entries, `order` slices; every index in
 * [0, rows)). */
void ls_sort_rows(const int64_t *indices, size_t slices, size_t rows, size_t *start,
                  size_t *order);

/* optim.c: one allocation for the row groupings of a step, `head` bytes
 * then `words` size_t's (NULL when that is too large or not there), and
 * one grouping placed at `next` (start, then order: rows + 1 + slices
 * words) and sorted by ls_sort_rows; the words after it. */
void *ls_rows_memory(size_t head, size_t words);
size_t *ls_rows_place(const int64_t *indices, size_t slices, size_t rows, size_t *next,
                      size_t **start, size_t **order);

/* norms.c: TensorFlow's Sum of float32 values on CPU, in its order (see
 * norms.c), of the values or (square) of their squares, in the caller's
 * floating-point state:
 *   ls_eigen_tree_sum   the tree over `n` values at `range`, element
 *                       `first` of their tensor (split points count from
 *                       the tensor's start): an inner-most reduction's row;
 *   ls_eigen_full_sum   Eigen's full reduction of values[0 .. n) on a
 *                       device of `eigen_threads` threads;
 *   ls_eigen_full_leaves, ls_eigen_full_combine  the same reduction in
 *                       parts: its leaves (their first element and length,
 *                       written where not NULL; the count returned), and
 *                       the total from the leaves' sums in that order (a
 *                       leaf's sum: norms.c's leaf_sum, or a kernel set's
 *                       adafactor sumsq for squares). */
float ls_eigen_tree_sum(const float *range, size_t first, size_t n, int square);
float ls_eigen_full_sum(const float *values, size_t n, int square, int eigen_threads);
size_t ls_eigen_full_leaves(size_t n, int eigen_threads, size_t *first, size_t *length);
float ls_eigen_full_combine(size_t n, int eigen_threads, const float *leaf_sums);

#endif /* LOSSSCALE_INTERNAL_H */
