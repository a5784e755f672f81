/*
 * Keras' Lamb: the elementwise part of its update_step in one pass over
 * each variable's gradient and moments (see lossscale.h,
 * ls_lamb_moments_with).  Its norms and the variable's move are the
 * caller's: Keras takes them with TensorFlow's reductions, which the caller
 * runs as Keras runs them, on the u this pass writes.  The elements of
 * every variable are split over the threads as one concatenation; the
 * element loop is the active kernel set's (lamb_body.h).  A sparse
 * gradient's dense form and its squares' are gathered a block at a time
 * by the fused step's own gather (optim.c, ls_optim_gather_rows) and the
 * loop runs on them as on a densified gradient and its term.  A variable
 * that asks for its sums of squares (the norms Keras' Lamb takes next) is
 * passed leaf by leaf, the leaves of TensorFlow's Sum (norms.c), each
 * leaf's sums taken by the kernel set's leaf order right after its u is
 * made, while the leaf is in cache; a leaf two ranges share is summed
 * after the pass, and the leaves' sums are combined in TensorFlow's
 * order.
 */
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"
#include "lossscale.h"
#include "optim.h"

static int overlap(const float *a, const float *b, size_t n)
{
    return !ls_disjoint(a, n * sizeof(float), b, n * sizeof(float));
}

/* A sparse gradient's own checks (ls_lamb_param.indices), its slices
 * against m, v, u and the variable. */
static const char *sparse_problem(const ls_lamb_param *p)
{
    if (p->term != NULL)
        return "a sparse gradient takes no term";
    if (p->row_length == 0 || p->length % p->row_length != 0
        || p->slices > SIZE_MAX / sizeof(int64_t) / p->row_length
        || (uintptr_t)p->indices % sizeof(int64_t) != 0)
        return "a sparse gradient's rows are not whole rows of its variable";
    const size_t bytes = p->slices * p->row_length * sizeof(float);
    const float *const others[] = {p->m, p->v, p->u, p->var};
    for (int k = 0; k < 4; k++)
        if (others[k] != NULL && bytes > 0
            && !ls_disjoint(p->grad, bytes, others[k], p->length * sizeof(float)))
            return "a sparse gradient's slices overlap m, v, u or the variable";
    const int64_t rows = (int64_t)(p->length / p->row_length);
    for (size_t k = 0; k < p->slices; k++)
        if (p->indices[k] < 0 || p->indices[k] >= rows)
            return "a sparse gradient's index is outside its variable's rows";
    return NULL;
}

/* A variable's sums' checks (ls_lamb_param.sums): the variable to read,
 * apart from what the pass writes, and the two sums apart from every
 * buffer. */
static const char *sums_problem(const ls_lamb_param *p, const ls_lamb_config *c)
{
    const size_t n = p->length;
    if (c->eigen_threads < 1)
        return "sums need eigen_threads of at least 1";
    const float *w = p->var != NULL ? p->var : p->weights;
    if (w == NULL)
        return "sums need the variable (var or weights)";
    if (p->var == NULL && (overlap(w, p->m, n) || overlap(w, p->v, n) || overlap(w, p->u, n)))
        return "the weights overlap m, v or u";
    const size_t grad = p->indices != NULL ? p->slices * p->row_length : n;
    const float *const bufs[] = {p->m, p->v, p->u, w, p->term, p->grad};
    const size_t lengths[] = {n, n, n, n, n, grad};
    for (int k = 0; k < 6; k++)
        if (bufs[k] != NULL && lengths[k] > 0
            && !ls_disjoint(p->sums, 2 * sizeof(float), bufs[k], lengths[k] * sizeof(float)))
            return "the sums overlap another buffer";
    if (p->indices != NULL && p->slices > 0
        && !ls_disjoint(p->sums, 2 * sizeof(float), p->indices, p->slices * sizeof(int64_t)))
        return "the sums overlap another buffer";
    return NULL;
}

const char *ls_lamb_problem(const ls_lamb_param *params, size_t count, const ls_lamb_config *c)
{
    if (c == NULL || (count > 0 && params == NULL))
        return "no configuration or no variables";
    if (c->unscale != LS_UNSCALE_NONE && c->unscale != LS_UNSCALE_DIVIDE)
        return "the unscale must be none or divide";
    for (size_t i = 0; i < count; i++) {
        const ls_lamb_param *p = &params[i];
        if (p->length == 0)
            continue;
        if ((p->grad == NULL && (p->indices == NULL || p->slices > 0)) || p->m == NULL
            || p->v == NULL || p->u == NULL)
            return "a gradient, m, v or u buffer is NULL";
        if (p->length > SIZE_MAX / sizeof(float))
            return "a variable too large";
        const size_t n = p->length;
        /* A sparse gradient's slices are checked against the other buffers
         * by sparse_problem; a dense one's here, u allowed to be it. */
        const int sparse = p->indices != NULL || p->slices > 0;
        if (sparse) {
            const char *why = p->indices != NULL ? sparse_problem(p) : "slices without indices";
            if (why != NULL)
                return why;
        }
        if (overlap(p->m, p->v, n) || overlap(p->u, p->m, n) || overlap(p->u, p->v, n)
            || (!sparse && (overlap(p->m, p->grad, n) || overlap(p->v, p->grad, n)
                            || (p->u != p->grad && overlap(p->u, p->grad, n)))))
            return "m, v and u overlap each other or the gradient (u may be the gradient itself)";
        if (p->term != NULL
            && (overlap(p->term, p->m, n) || overlap(p->term, p->v, n) || overlap(p->term, p->u, n)))
            return "a term overlaps m, v or u";
        if (p->decay < LS_DECAY_NONE || p->decay > LS_DECAY_FACTOR)
            return "unknown decay";
        if ((p->decay != LS_DECAY_NONE) != (p->var != NULL))
            return "a decay needs its variable, and a variable its decay";
        if (p->var != NULL
            && (overlap(p->var, p->m, n) || overlap(p->var, p->v, n) || overlap(p->var, p->u, n)
                || (!sparse && overlap(p->var, p->grad, n))
                || (p->term != NULL && overlap(p->var, p->term, n))))
            return "the variable overlaps another buffer";
        if (p->sums != NULL) {
            const char *why = sums_problem(p, c);
            if (why != NULL)
                return why;
        }
    }
    return NULL;
}

/* A sparse gradient's slices grouped by row (ls_sort_rows): row r's are
 * order[start[r] .. start[r + 1]). */
typedef struct lamb_rows {
    size_t *start, *order;
} lamb_rows;

/* A variable's sums (ls_lamb_param.sums): the leaves of TensorFlow's Sum
 * over its values (ls_eigen_full_leaves), each leaf's sum of the
 * variable's squares and of u's, and whether the pass took them (a leaf
 * that two ranges share is taken after the pass). */
typedef struct lamb_leaves {
    size_t count;
    size_t *first, *length;
    float *w, *u;
    unsigned char *taken;
} lamb_leaves;

typedef struct lamb_job {
    const ls_lamb_param *params;
    size_t count;
    ls_lamb_span model; /* the config's numbers; buffers and n per range */
    unsigned flags;
    const ls_optim_kernels *kernels;
    lamb_rows *rows;       /* each param's; NULL when no gradient is sparse */
    ls_optim_args unscale; /* a slice value's unscale */
    lamb_leaves *leaves;   /* each param's; NULL when none asks for sums */
} lamb_job;

/* A block of a sparse gradient's dense form, in cache. */
enum { BLOCK = 4096 };

/* Elements [lo, hi) of a variable whose gradient is sparse: a block at a
 * time, its g and t gathered as Keras' densified slices and their
 * squares, then the loop on them as on a densified gradient's. */
static void lamb_sparse(const lamb_job *j, const ls_lamb_param *p, const lamb_rows *r,
                        ls_lamb_span s, size_t lo, size_t hi)
{
    float g[BLOCK], t[BLOCK];
    s.how = LS_ADAFACTOR_AS_IS;
    s.grad = g;
    s.term = t;
    for (size_t b = lo; b < hi; b += BLOCK) {
        const size_t e = hi - b < BLOCK ? hi : b + BLOCK;
        ls_optim_gather_rows(j->kernels, p->grad, LS_FLOAT32, p->row_length, r->start, r->order,
                             b, e, &j->unscale, 1.0f, LS_SLICE_SQUARE, 0.0f, g, t);
        s.var = p->var != NULL ? p->var + b : NULL;
        s.m = p->m + b;
        s.v = p->v + b;
        s.u = p->u + b;
        s.n = e - b;
        j->kernels->lamb(&s);
    }
}

/* Elements [lo, hi) of params[i]. */
static void lamb_span(const lamb_job *j, size_t i, size_t lo, size_t hi)
{
    const ls_lamb_param *p = &j->params[i];
    ls_lamb_span s = j->model;
    ls_optim_decay_args(&s.decay, p->decay);
    if (p->indices != NULL) {
        lamb_sparse(j, p, &j->rows[i], s, lo, hi);
        return;
    }
    s.grad = p->grad + lo;
    s.term = p->term != NULL ? p->term + lo : NULL;
    s.var = p->var != NULL ? p->var + lo : NULL;
    if (p->term != NULL) /* a densified sparse gradient: as it is */
        s.how = LS_ADAFACTOR_AS_IS;
    s.m = p->m + lo;
    s.v = p->v + lo;
    s.u = p->u + lo;
    s.n = hi - lo;
    j->kernels->lamb(&s);
}

/* Leaf k's sums of squares, of the variable's values and of u's, by the
 * kernel set's leaf (adafactor_body.h: Eigen's leaf order on its vector
 * lanes). */
static void leaf_sums(const lamb_job *j, const ls_lamb_param *p, const lamb_leaves *l, size_t k)
{
    const float *w = p->var != NULL ? p->var : p->weights;
    const size_t a = l->first[k], n = l->length[k];
    l->w[k] = j->kernels->adafactor.sumsq(w + a, n);
    l->u[k] = j->kernels->adafactor.sumsq(p->u + a, n);
}

/* Elements [begin, end) of the concatenation of every variable's. */
static int lamb_range(const void *arg, size_t begin, size_t end)
{
    const lamb_job *j = arg;
    ls_fpenv env;
    ls_fpenv_enter(&env, (j->flags & LS_FLUSH_DENORMALS) != 0);
    size_t offset = 0; /* start of params[i] in the concatenation */
    for (size_t i = 0; i < j->count && offset < end; offset += j->params[i].length, i++) {
        const ls_lamb_param *p = &j->params[i];
        const size_t lo = begin > offset ? begin - offset : 0;
        const size_t hi = p->length < end - offset ? p->length : end - offset;
        if (lo >= hi)
            continue;
        if (p->sums == NULL) {
            lamb_span(j, i, lo, hi);
            continue;
        }
        /* Leaf by leaf, each leaf's sums taken while it is in cache where
         * the range holds all of it. */
        const lamb_leaves *l = &j->leaves[i];
        size_t k = 0, top = l->count; /* the first leaf that ends past lo */
        while (k < top) {
            const size_t mid = k + (top - k) / 2;
            if (l->first[mid] + l->length[mid] <= lo)
                k = mid + 1;
            else
                top = mid;
        }
        for (; k < l->count && l->first[k] < hi; k++) {
            const size_t a = l->first[k], b = a + l->length[k];
            lamb_span(j, i, a > lo ? a : lo, b < hi ? b : hi);
            if (a >= lo && b <= hi) {
                leaf_sums(j, p, l, k);
                l->taken[k] = 1;
            }
        }
    }
    ls_fpenv_leave(&env);
    return 1;
}

/* Every sparse gradient's slices grouped by row: LS_OK, or LS_ERR_MEMORY
 * with nothing allocated. */
static int group_rows(lamb_job *j)
{
    size_t words = 0;
    for (size_t i = 0; i < j->count; i++) {
        const ls_lamb_param *p = &j->params[i];
        if (p->indices != NULL && p->length > 0)
            words += p->length / p->row_length + 1 + p->slices;
    }
    if (words == 0)
        return LS_OK;
    char *memory = ls_rows_memory(j->count * sizeof(lamb_rows), words);
    if (memory == NULL)
        return LS_ERR_MEMORY;
    j->rows = (lamb_rows *)(void *)memory;
    size_t *next = (size_t *)(void *)(memory + j->count * sizeof(lamb_rows));
    for (size_t i = 0; i < j->count; i++) {
        const ls_lamb_param *p = &j->params[i];
        j->rows[i].start = j->rows[i].order = NULL;
        if (p->indices != NULL && p->length > 0)
            next = ls_rows_place(p->indices, p->slices, p->length / p->row_length, next,
                                 &j->rows[i].start, &j->rows[i].order);
    }
    return LS_OK;
}

/* Every sums-asking variable's leaves: LS_OK, or LS_ERR_MEMORY with
 * nothing allocated. */
static int place_leaves(lamb_job *j, int threads)
{
    size_t total = 0;
    int any = 0;
    for (size_t i = 0; i < j->count; i++)
        if (j->params[i].sums != NULL) {
            total += ls_eigen_full_leaves(j->params[i].length, threads, NULL, NULL);
            any = 1;
        }
    if (!any)
        return LS_OK;
    /* per leaf: first and length (size_t), two sums (float), a flag */
    const size_t each = 2 * sizeof(size_t) + 2 * sizeof(float) + 1;
    if (total > (SIZE_MAX - j->count * sizeof(lamb_leaves)) / each)
        return LS_ERR_MEMORY;
    char *memory = calloc(1, j->count * sizeof(lamb_leaves) + total * each);
    if (memory == NULL)
        return LS_ERR_MEMORY;
    j->leaves = (lamb_leaves *)(void *)memory;
    size_t *sizes = (size_t *)(void *)(memory + j->count * sizeof(lamb_leaves));
    float *sums = (float *)(void *)(sizes + 2 * total);
    unsigned char *taken = (unsigned char *)(sums + 2 * total);
    for (size_t i = 0; i < j->count; i++) {
        const ls_lamb_param *p = &j->params[i];
        lamb_leaves *l = &j->leaves[i];
        if (p->sums == NULL)
            continue;
        l->count = ls_eigen_full_leaves(p->length, threads, NULL, NULL);
        l->first = sizes;
        l->length = sizes + l->count;
        l->w = sums;
        l->u = sums + l->count;
        l->taken = taken;
        ls_eigen_full_leaves(p->length, threads, l->first, l->length);
        sizes += 2 * l->count;
        sums += 2 * l->count;
        taken += l->count;
    }
    return LS_OK;
}

/* After the pass: the leaves no range held whole, then each variable's
 * two sums from its leaves', in TensorFlow's order. */
static void finish_sums(const lamb_job *j, int threads)
{
    ls_fpenv env;
    ls_fpenv_enter(&env, (j->flags & LS_FLUSH_DENORMALS) != 0);
    for (size_t i = 0; i < j->count; i++) {
        const ls_lamb_param *p = &j->params[i];
        if (p->sums == NULL)
            continue;
        const lamb_leaves *l = &j->leaves[i];
        for (size_t k = 0; k < l->count; k++)
            if (!l->taken[k])
                leaf_sums(j, p, l, k);
        p->sums[0] = ls_eigen_full_combine(p->length, threads, l->w);
        p->sums[1] = ls_eigen_full_combine(p->length, threads, l->u);
    }
    ls_fpenv_leave(&env);
}

int ls_lamb_moments_with(const ls_lamb_param *params, size_t count,
                         const ls_lamb_config *config, unsigned flags,
                         ls_parallel_fn parallel, void *host)
{
    if ((flags & ~(unsigned)LS_FLUSH_DENORMALS) != 0
        || ls_lamb_problem(params, count, config) != NULL)
        return LS_ERR_ARG;
    const int level = ls_simd_level();
    if (level < 0)
        return LS_ERR_SIMD;
    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        if (params[i].length > SIZE_MAX - total)
            return LS_ERR_ARG;
        total += params[i].length;
    }
    if (total == 0) {
        for (size_t i = 0; i < count; i++)
            if (params[i].sums != NULL)
                params[i].sums[0] = params[i].sums[1] = 0.0f;
        return 1;
    }
    /* Dividing by a power of two whose reciprocal is normal is multiplying
     * by that reciprocal: the same real number, rounded once. */
    int how = LS_ADAFACTOR_AS_IS;
    float k = 1.0f;
    if (config->unscale == LS_UNSCALE_DIVIDE) {
        how = ls_exact_reciprocal(config->scale) ? LS_ADAFACTOR_MULTIPLY : LS_ADAFACTOR_DIVIDE;
        k = how == LS_ADAFACTOR_MULTIPLY ? ls_reciprocal_f32(config->scale, 0) : config->scale;
    }
    /* wd * lr as TensorFlow's Mul makes it, in the step's floating-point
     * state (subnormals flushed with LS_FLUSH_DENORMALS). */
    ls_fpenv env;
    ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
    const float wd_lr = ls_f32_mul(config->weight_decay, config->learning_rate);
    ls_fpenv_leave(&env);
    const ls_lamb_span model = {.decay = {.lr = config->learning_rate,
                                          .wd = config->weight_decay,
                                          .wd_lr = wd_lr},
                                .how = how,
                                .k = k,
                                .c1 = config->one_minus_beta_1,
                                .c2 = config->one_minus_beta_2,
                                .epsilon = config->epsilon,
                                .bias_1 = config->bias_1,
                                .bias_2 = config->bias_2};
    ls_optim_args unscale = {.grad_mode = how == LS_ADAFACTOR_DIVIDE     ? LS_GRAD_DIVIDE
                                          : how == LS_ADAFACTOR_MULTIPLY ? LS_GRAD_MULTIPLY
                                                                         : LS_GRAD_AS_IS,
                             .factor = k,
                             .clip = LS_CLIP_NONE};
    lamb_job j = {params, count, model, flags, ls_optim_kernels_at(level), NULL, unscale, NULL};
    const int threads = config->eigen_threads;
    if (group_rows(&j) != LS_OK || place_leaves(&j, threads) != LS_OK) {
        free(j.rows);
        return LS_ERR_MEMORY;
    }
    const int rc = (parallel ? parallel : ls_own_threads)(host, lamb_range, &j, total);
    if (rc >= 0 && j.leaves != NULL)
        finish_sums(&j, threads);
    free(j.rows);
    free(j.leaves);
    return rc < 0 ? rc : 1;
}
