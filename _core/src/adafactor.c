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
 * sums are plain C in the orders above.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lossscale.h"
#include "optim.h"

enum { PACKET = 8, UNROLLED_ROWS = 16 };

/* TensorFlow's Maximum of float32 scalars: NaN from either side. */
static float tf_maximum(float a, float b)
{
    if (a != a)
        return a;
    if (b != b)
        return b;
    return a > b ? a : b;
}

/* Sum over the middle axis of x [outer, rows, cols] into out [outer * cols],
 * in the order above. */
static void middle_sums(const float *x, size_t outer, size_t rows, size_t cols, float *out)
{
    const size_t n = outer * cols;
    for (size_t o = 0; o < n; o += PACKET) {
        const size_t a = o / cols, c0 = o % cols;
        const float *base = x + a * rows * cols;
        if (o + PACKET <= n && c0 + PACKET <= cols) {
            float s[PACKET];
            if (rows >= UNROLLED_ROWS) {
                float acc[4][PACKET] = {{0}};
                const size_t unrolled = rows / 4 * 4;
                for (size_t r = 0; r < unrolled; r++)
                    for (size_t k = 0; k < PACKET; k++)
                        acc[r % 4][k] = acc[r % 4][k] + base[r * cols + c0 + k];
                for (size_t k = 0; k < PACKET; k++)
                    s[k] = ((acc[0][k] + acc[1][k]) + acc[2][k]) + acc[3][k];
                for (size_t r = unrolled; r < rows; r++)
                    for (size_t k = 0; k < PACKET; k++)
                        s[k] = s[k] + base[r * cols + c0 + k];
            } else {
                memset(s, 0, sizeof s);
                for (size_t r = 0; r < rows; r++)
                    for (size_t k = 0; k < PACKET; k++)
                        s[k] = s[k] + base[r * cols + c0 + k];
            }
            memcpy(out + o, s, sizeof s);
            continue;
        }
        for (size_t q = o; q < n && q < o + PACKET; q++) {
            const float *col = x + (q / cols) * rows * cols + q % cols;
            float s = 0.0f;
            for (size_t r = 0; r < rows; r++)
                s = s + col[r * cols];
            out[q] = s;
        }
    }
}

/* TensorFlow's Mean of x [outer, rows, cols] over its last axis into out
 * [outer * rows] (axes of 1 dropped first, as TensorFlow's reduction
 * helper drops them; nothing left to reduce: a copy). */
static void mean_last(const float *x, size_t outer, size_t rows, size_t cols, int threads,
                      float *out)
{
    const size_t kept = outer * rows;
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
        out[k] = ls_eigen_tree_sum(x, k * cols, cols, 0) / count;
}

/* TensorFlow's Mean of x [outer, rows, cols] over its middle axis into out
 * [outer * cols]. */
static void mean_middle(const float *x, size_t outer, size_t rows, size_t cols, int threads,
                        float *out)
{
    if (rows == 1) {
        memcpy(out, x, outer * cols * sizeof(float));
        return;
    }
    if (cols == 1) { /* [outer, rows]: the middle axis is the last one left */
        mean_last(x, 1, outer, rows, threads, out);
        return;
    }
    const float count = (float)rows;
    middle_sums(x, outer, rows, cols, out);
    for (size_t k = 0; k < outer * cols; k++)
        out[k] = out[k] / count;
}

/* sqrt(mean(square(x))) over all of x, as Keras' _rms. */
static float rms(const float *x, size_t n, int threads)
{
    return sqrtf(ls_eigen_full_sum(x, n, 1, threads) / (float)n);
}

typedef struct adafactor_job {
    const ls_adafactor_param *params;
    size_t count;
    const ls_adafactor_config *config;
    unsigned flags;
    size_t *offset; /* where each variable starts in the concatenation */
} adafactor_job;

/* The scratch floats a variable's step takes: its squares (then its u),
 * and a factored one's means of them and of r. */
static size_t scratch_of(const ls_adafactor_param *p)
{
    return p->length + (p->rows > 0 ? p->outer * (p->rows + p->cols + 1) : 0);
}

/* One variable's step. */
static void step_one(const ls_adafactor_param *p, const ls_adafactor_config *c, float *scratch)
{
    const size_t n = p->length;
    const int threads = c->eigen_threads, divide = c->unscale == LS_UNSCALE_DIVIDE;
    const float scale = c->scale, beta = c->beta, rest = c->rest;
    /* alpha_t from the variable before it moves. */
    const float alpha = tf_maximum(c->epsilon_2, rms(p->var, n, threads)) * c->rho;
    float *reg = scratch;
    for (size_t i = 0; i < n; i++) {
        const float g = divide ? p->grad[i] / scale : p->grad[i];
        reg[i] = g * g + c->epsilon_1;
    }
    if (p->rows > 0) {
        const size_t outer = p->outer, rows = p->rows, cols = p->cols;
        float *row_mean = scratch + n, *col_mean = row_mean + outer * rows,
              *r_mean = col_mean + outer * cols;
        mean_last(reg, outer, rows, cols, threads, row_mean);
        mean_middle(reg, outer, rows, cols, threads, col_mean);
        for (size_t k = 0; k < outer * rows; k++)
            p->r[k] = beta * p->r[k] + rest * row_mean[k];
        for (size_t k = 0; k < outer * cols; k++)
            p->c[k] = beta * p->c[k] + rest * col_mean[k];
        /* v = (r / mean(r, -1))[..., None] * c[..., None, :] */
        mean_last(p->r, 1, outer, rows, threads, r_mean);
        for (size_t a = 0; a < outer; a++)
            for (size_t k = 0; k < rows; k++) {
                const float f = p->r[a * rows + k] / r_mean[a];
                float *v = p->v + (a * rows + k) * cols;
                const float *cc = p->c + a * cols;
                for (size_t j = 0; j < cols; j++)
                    v[j] = f * cc[j];
            }
    } else {
        for (size_t i = 0; i < n; i++)
            p->v[i] = beta * p->v[i] + rest * reg[i];
    }
    float *u = reg; /* the squares are spent */
    for (size_t i = 0; i < n; i++) {
        const float g = divide ? p->grad[i] / scale : p->grad[i];
        u[i] = c->rsqrt ? g * ls_tf_rsqrt1(p->v[i], i, n) : g / sqrtf(p->v[i]);
    }
    const float m = tf_maximum(1.0f, rms(u, n, threads) / c->clip_threshold);
    for (size_t i = 0; i < n; i++)
        p->var[i] = p->var[i] - alpha * (u[i] / m);
}

/* The variables that start in elements [begin, end) of the job. */
static int adafactor_range(const void *arg, size_t begin, size_t end)
{
    const adafactor_job *j = arg;
    size_t most = 0;
    for (size_t i = 0; i < j->count; i++)
        if (j->offset[i] >= begin && j->offset[i] < end && scratch_of(&j->params[i]) > most)
            most = scratch_of(&j->params[i]);
    if (most == 0)
        return 1;
    float *scratch = malloc(most * sizeof(float));
    if (scratch == NULL)
        return LS_ERR_MEMORY;
    ls_fpenv env;
    ls_fpenv_enter(&env, (j->flags & LS_FLUSH_DENORMALS) != 0);
    for (size_t i = 0; i < j->count; i++)
        if (j->offset[i] >= begin && j->offset[i] < end && j->params[i].length > 0)
            step_one(&j->params[i], j->config, scratch);
    ls_fpenv_leave(&env);
    free(scratch);
    return 1;
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
    if (count == 0)
        return 1;
    adafactor_job j = {params, count, config, flags, malloc(count * sizeof(size_t))};
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
