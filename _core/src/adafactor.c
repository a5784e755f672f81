/*
 * Keras' Adafactor, one step of each variable in three passes over its
 * gradient, every number as Keras' update_step makes it with TensorFlow's
 * CPU ops (see lossscale.h, ls_adafactor_update_with).
 *
 * Its means are TensorFlow's Mean kernel: a sum in Eigen's order divided
 * by the count, and Eigen's order depends on which axes are reduced once
 * TensorFlow has dropped the size-1 axes and merged neighbours:
 *
 *   all      Eigen's full reduction (norms.c: shards, trees, leaves);
 *   the last each row an inner-most reduction, its own tree over its
 *            values (split points counted from the tensor's start);
 *   a middle each output of [outer, rows, cols] -> [outer, cols] preserves
 *            the inner-most axis: the outputs are taken 8 at a time from
 *            the flat output index 0 (TensorFlow's AVX packets); 8 that lie
 *            in one outer slice are a packet, summed over the rows into 4
 *            accumulators, row r into r % 4, when there are 16 rows or
 *            more (((a0 + a1) + a2) + a3, then the rows past the last 4
 *            one by one), else into one, row by row; any other output is
 *            summed alone, row by row onto 0.
 *
 * Each addition is one float32 rounding whatever unit makes it, so the
 * sums are plain C in the orders above (a leaf of u's squares: the kernel
 * set's lanes, adafactor_body.h).
 *
 * Per variable (the variables split over the threads), after the RMS of
 * the variable: one pass makes s a row at a time, each row's mean and the
 * columns' sums as the rows go by (or a plain variable's v); one makes u
 * a leaf of the full reduction at a time, for its RMS; one makes u again
 * and moves the variable, storing a factored v.  The element loops are the
 * active kernel set's (adafactor_body.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lossscale.h"
#include "optim.h"

enum { PACKET = 8, UNROLLED_ROWS = 16 };

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#define LS_ADAFACTOR_SSE 1
#endif

/* TensorFlow's Maximum of float32 scalars: NaN from either side. */
static float tf_maximum(float a, float b)
{
    if (a != a)
        return a;
    if (b != b)
        return b;
    return a > b ? a : b;
}

/* Whether x is a power of two whose reciprocal is a normal float32 (then
 * *inverse = 1 / x, exact, and y / x == y * *inverse for every y). */
static int exact_reciprocal(float x, float *inverse)
{
    if (!(x > 0.0f) || x - x != 0.0f)
        return 0;
    int exponent;
    if (frexpf(x, &exponent) != 0.5f)
        return 0;
    /* x = 2^(exponent - 1); 1 / x = 2^(1 - exponent) must be >= 2^-126 */
    if (1 - exponent < -126 || 1 - exponent > 127)
        return 0;
    *inverse = ldexpf(1.0f, 1 - exponent);
    return 1;
}

/* ------------------------------------------------------------ the means */

/* TensorFlow's Mean over the last axis of x [kept, cols] into out[kept]
 * (axes of 1 dropped first, as TensorFlow's reduction helper drops them:
 * nothing left to reduce is a copy, one row left a full reduction). */
static void mean_last(const float *x, size_t kept, size_t cols, int threads, float *out)
{
    const float count = (float)cols;
    if (cols == 1) {
        memcpy(out, x, kept * sizeof(float));
        return;
    }
    if (kept == 1) {
        out[0] = ls_eigen_full_sum(x, cols, 0, threads) / count;
        return;
    }
    for (size_t k = 0; k < kept; k++)
        out[k] = ls_eigen_tree_sum(x + k * cols, k * cols, cols, 0) / count;
}

/* ----------------------------------------------------- one variable's u */

typedef struct adafactor_var {
    const ls_adafactor_param *p;
    const ls_adafactor_config *c;
    const ls_adafactor_loops *loops; /* the active kernel set's */
    /* how g is unscaled (ls_adafactor_how): as it is, divided by the
     * scale, or times its reciprocal `k` (a power of two whose reciprocal
     * is normal: g / scale and g * (1 / scale) are then the same real
     * number, rounded once) */
    int how;
    float k;
    /* factored: r[k] / mean(r) of each of the outer * rows rows */
    float *ratio;
} adafactor_var;

/* count floats from src to dst, bypassing the cache where dst is aligned
 * (a factored v is written and not read again in the step: a streaming
 * store spares the read a cached store makes of each line first). */
static void store_streaming(float *dst, const float *src, size_t count)
{
    size_t k = 0;
#ifdef LS_ADAFACTOR_SSE
    for (; k < count && ((uintptr_t)(dst + k) & 15u) != 0; k++)
        dst[k] = src[k];
    for (; k + 4 <= count; k += 4)
        _mm_stream_ps(dst + k, _mm_loadu_ps(src + k));
#endif
    for (; k < count; k++)
        dst[k] = src[k];
}

/* The span of elements [e, e + count), which lie in one row of a
 * factored variable: a plain variable's v, or the factored one's made from
 * r and c, as Keras' outer product, into `vbuf` when it is not NULL; its u
 * into `out`. */
static ls_adafactor_span span_of(const adafactor_var *a, size_t e, size_t count, float *vbuf,
                                 float *out)
{
    const ls_adafactor_param *p = a->p;
    ls_adafactor_span s = {p->grad + e, a->how, a->k, p->v + e, 0.0f, NULL, NULL, out, e,
                           count, p->length, a->c->rsqrt};
    if (p->rows > 0) {
        const size_t row = e / p->cols, j = e % p->cols, slice = row / p->rows;
        s.v = NULL;
        s.f = a->ratio[row];
        s.c = p->c + slice * p->cols + j;
        s.v_out = vbuf;
    }
    return s;
}

/* The sum of the squares of u over elements [e, e + count) (an Eigen
 * leaf, any rows), u made a row's part at a time into ubuf. */
static float u_leaf_sumsq(const adafactor_var *a, size_t e, size_t count, float *ubuf)
{
    const size_t cols = a->p->cols;
    float *out = ubuf;
    for (size_t left = count; left > 0;) {
        size_t take = a->p->rows > 0 ? cols - e % cols : left;
        if (take > left)
            take = left;
        const ls_adafactor_span s = span_of(a, e, take, NULL, out);
        a->loops->u(&s);
        e += take;
        out += take;
        left -= take;
    }
    return a->loops->sumsq(ubuf, count);
}

/* --------------------------------------------------------- the passes */

/* dst[j] = dst[j] + src[j] for j < n, the two apart (vectors of any
 * width make the same sums). */
static void add_into(float *restrict dst, const float *restrict src, size_t n)
{
    for (size_t j = 0; j < n; j++)
        dst[j] = dst[j] + src[j];
}

/* The factored moments: s = g * g + epsilon_1 row by row (never whole),
 * each row's mean (its tree), each column's sum in the middle axis' order
 * (4 accumulators per column).  acc: 4 * cols floats, row: cols floats;
 * row_mean: outer * rows, col_mean: outer * cols. */
static void factored_means(const adafactor_var *a, float *acc, float *row, float *row_mean,
                           float *col_mean)
{
    const ls_adafactor_param *p = a->p;
    const size_t outer = p->outer, rows = p->rows, cols = p->cols;
    const float e1 = a->c->epsilon_1, count = (float)cols;
    const size_t unrolled = rows >= UNROLLED_ROWS ? rows / 4 * 4 : 0;
    for (size_t s = 0; s < outer; s++) {
        /* The columns of this slice whose outputs are packets: the 8-output
         * groups from flat output 0 that lie inside the slice. */
        const size_t o0 = s * cols, o1 = o0 + cols;
        size_t v0 = (o0 + PACKET - 1) / PACKET * PACKET, v1 = o1 / PACKET * PACKET;
        if (v1 < v0)
            v1 = v0;
        v0 -= o0, v1 -= o0; /* as columns of the slice (none: both cols) */
        if (v0 > cols)
            v0 = cols;
        if (v1 > cols)
            v1 = cols;
        memset(acc, 0, 4 * cols * sizeof(float));
        for (size_t r = 0; r < rows; r++) {
            const size_t e = (s * rows + r) * cols;
            a->loops->grad(p->grad + e, row, cols, a->how, a->k, 1, e1);
            row_mean[s * rows + r] =
                cols == 1        ? row[0]
                : outer * rows == 1 ? ls_eigen_full_sum(row, cols, 0, a->c->eigen_threads) / count
                                 : ls_eigen_tree_sum(row, e, cols, 0) / count;
            if (r < unrolled) {
                add_into(acc, row, v0);
                add_into(acc + (r % 4) * cols + v0, row + v0, v1 - v0);
                add_into(acc + v1, row + v1, cols - v1);
                continue;
            }
            if (r == unrolled && unrolled > 0)
                for (size_t j = v0; j < v1; j++)
                    acc[j] = ((acc[j] + acc[cols + j]) + acc[2 * cols + j]) + acc[3 * cols + j];
            add_into(acc, row, cols);
        }
        if (rows == unrolled) /* every row unrolled (a multiple of 4) */
            for (size_t j = v0; j < v1; j++)
                acc[j] = ((acc[j] + acc[cols + j]) + acc[2 * cols + j]) + acc[3 * cols + j];
        const float rows_f = (float)rows;
        for (size_t j = 0; j < cols; j++)
            col_mean[s * cols + j] = acc[j] / rows_f;
    }
    /* One column: the middle axis is the last one TensorFlow keeps, and
     * row_mean holds s itself ([outer, rows]). */
    if (cols == 1)
        mean_last(row_mean, outer, rows, a->c->eigen_threads, col_mean);
}

/* One variable's step. */
static int step_one(const ls_adafactor_param *p, const ls_adafactor_config *c,
                    const ls_adafactor_loops *loops)
{
    const size_t n = p->length;
    const int threads = c->eigen_threads;
    const float beta = c->beta, rest = c->rest;
    adafactor_var a = {p, c, loops,
                       c->unscale == LS_UNSCALE_DIVIDE ? LS_ADAFACTOR_DIVIDE : LS_ADAFACTOR_AS_IS,
                       c->scale, NULL};
    if (a.how == LS_ADAFACTOR_DIVIDE && exact_reciprocal(c->scale, &a.k))
        a.how = LS_ADAFACTOR_MULTIPLY;
    const size_t leaves = ls_eigen_full_leaves(n, threads, NULL, NULL);
    const size_t outer = p->outer, rows = p->rows, cols = p->rows > 0 ? p->cols : 0;
    /* leaf firsts and lengths (size_t), leaf sums, a leaf's u and v, and a
     * factored variable's rows, accumulators and means */
    const size_t leaf = 8 * 1024;
    size_t floats = leaves + 2 * leaf;
    if (rows > 0)
        floats += 5 * cols + outer * (2 * rows + cols + 1);
    size_t *firsts = malloc(2 * leaves * sizeof(size_t) + floats * sizeof(float));
    if (firsts == NULL)
        return LS_ERR_MEMORY;
    size_t *lengths = firsts + leaves;
    float *sums = (float *)(void *)(lengths + leaves), *ubuf = sums + leaves,
          *vbuf = ubuf + leaf;
    ls_eigen_full_leaves(n, threads, firsts, lengths);

    /* alpha_t from the variable before it moves. */
    const float alpha = tf_maximum(c->epsilon_2, sqrtf(ls_eigen_full_sum(p->var, n, 1, threads)
                                                      / (float)n)) * c->rho;
    if (rows > 0) {
        float *acc = vbuf + leaf, *row = acc + 4 * cols, *row_mean = row + cols,
              *col_mean = row_mean + outer * rows, *r_mean = col_mean + outer * cols;
        a.ratio = r_mean + outer; /* outer * rows */
        factored_means(&a, acc, row, row_mean, col_mean);
        for (size_t k = 0; k < outer * rows; k++)
            p->r[k] = beta * p->r[k] + rest * row_mean[k];
        for (size_t k = 0; k < outer * cols; k++)
            p->c[k] = beta * p->c[k] + rest * col_mean[k];
        /* r / mean(r, -1): each slice's mean over its rows */
        mean_last(p->r, outer, rows, threads, r_mean);
        for (size_t s = 0; s < outer; s++)
            for (size_t k = 0; k < rows; k++)
                a.ratio[s * rows + k] = p->r[s * rows + k] / r_mean[s];
    } else {
        const float e1 = c->epsilon_1;
        for (size_t e = 0; e < n; e += leaf) {
            const size_t take = n - e < leaf ? n - e : leaf;
            loops->grad(p->grad + e, ubuf, take, a.how, a.k, 1, e1);
            for (size_t k = 0; k < take; k++)
                p->v[e + k] = beta * p->v[e + k] + rest * ubuf[k];
        }
    }
    /* rms(u): u made a leaf at a time, never whole. */
    for (size_t l = 0; l < leaves; l++)
        sums[l] = u_leaf_sumsq(&a, firsts[l], lengths[l], ubuf);
    const float rms_u = sqrtf(ls_eigen_full_combine(n, threads, sums) / (float)n);
    const float m = tf_maximum(1.0f, rms_u / c->clip_threshold);
    /* v stored, u made again, the variable moved: row by row.  u / m is
     * u where m is 1 (u, a product or quotient, is never subnormal under
     * the flush), u times 1 / m where that is exact. */
    float by_k = m;
    const int by = m == 1.0f                    ? LS_ADAFACTOR_AS_IS
                   : exact_reciprocal(m, &by_k) ? LS_ADAFACTOR_MULTIPLY
                                                : LS_ADAFACTOR_DIVIDE;
    const size_t span = rows > 0 ? cols : n;
    for (size_t e = 0; e < n; e += span)
        for (size_t k = 0; k < span; k += leaf) {
            const size_t take = span - k < leaf ? span - k : leaf;
            const ls_adafactor_span s = span_of(&a, e + k, take, vbuf, NULL);
            loops->update(&s, p->var + e + k, alpha, by, by_k);
            if (rows > 0)
                store_streaming(p->v + e + k, vbuf, take);
        }
#ifdef LS_ADAFACTOR_SSE
    _mm_sfence(); /* the streaming stores, ordered before the op returns */
#endif
    free(firsts);
    return 1;
}

typedef struct adafactor_job {
    const ls_adafactor_param *params;
    size_t count;
    const ls_adafactor_config *config;
    unsigned flags;
    const ls_adafactor_loops *loops;
    size_t *offset; /* where each variable starts in the concatenation */
} adafactor_job;

/* The variables that start in elements [begin, end) of the job. */
static int adafactor_range(const void *arg, size_t begin, size_t end)
{
    const adafactor_job *j = arg;
    ls_fpenv env;
    ls_fpenv_enter(&env, (j->flags & LS_FLUSH_DENORMALS) != 0);
    int rc = 1;
    for (size_t i = 0; i < j->count && rc > 0; i++)
        if (j->offset[i] >= begin && j->offset[i] < end && j->params[i].length > 0)
            rc = step_one(&j->params[i], j->config, j->loops);
    ls_fpenv_leave(&env);
    return rc;
}

const char *ls_adafactor_problem(const ls_adafactor_param *params, size_t count,
                                 const ls_adafactor_config *c)
{
    if (c == NULL || (count > 0 && params == NULL))
        return "no configuration or no variables";
    if (c->eigen_threads < 1)
        return "eigen_threads must be at least 1";
    if (c->unscale != LS_UNSCALE_NONE && c->unscale != LS_UNSCALE_DIVIDE)
        return "the unscale must be none or divide";
    if (c->rsqrt && ls_optim_rsqrt_problem(1.0f) != NULL)
        return ls_optim_rsqrt_problem(1.0f);
    for (size_t i = 0; i < count; i++) {
        const ls_adafactor_param *p = &params[i];
        if (p->length == 0)
            continue;
        if (p->var == NULL || p->grad == NULL || p->v == NULL)
            return "a variable, gradient or velocity buffer is NULL";
        if (p->rows > 0) {
            if (p->r == NULL || p->c == NULL)
                return "a factored variable's r or c buffer is NULL";
            if (p->cols == 0 || p->outer == 0 || p->outer > SIZE_MAX / p->rows
                || p->outer * p->rows > SIZE_MAX / p->cols
                || p->outer * p->rows * p->cols != p->length)
                return "outer * rows * cols is not the variable's length";
        }
        if (p->length > SIZE_MAX / (4 * sizeof(float)))
            return "a variable too large";
    }
    return NULL;
}

int ls_adafactor_update_with(const ls_adafactor_param *params, size_t count,
                             const ls_adafactor_config *config, unsigned flags,
                             ls_parallel_fn parallel, void *host)
{
    if ((flags & ~(unsigned)LS_FLUSH_DENORMALS) != 0
        || ls_adafactor_problem(params, count, config) != NULL)
        return LS_ERR_ARG;
    const int level = ls_simd_level();
    if (level < 0)
        return LS_ERR_SIMD;
    if (count == 0)
        return 1;
    adafactor_job j = {params, count, config, flags, &ls_optim_kernels_at(level)->adafactor,
                       malloc(count * sizeof(size_t))};
    if (j.offset == NULL)
        return LS_ERR_MEMORY;
    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        j.offset[i] = total;
        total += params[i].length > 0 ? params[i].length : 1;
    }
    const int rc = (parallel ? parallel : ls_own_threads)(host, adafactor_range, &j, total);
    free(j.offset);
    return rc < 0 ? rc : 1;
}
