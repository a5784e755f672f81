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
 * loop runs on them as on a densified gradient and its term.
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
    }
    return NULL;
}

/* A sparse gradient's slices grouped by row (ls_sort_rows): row r's are
 * order[start[r] .. start[r + 1]). */
typedef struct lamb_rows {
    size_t *start, *order;
} lamb_rows;

typedef struct lamb_job {
    const ls_lamb_param *params;
    size_t count;
    ls_lamb_span model; /* the config's numbers; buffers and n per range */
    unsigned flags;
    const ls_optim_kernels *kernels;
    lamb_rows *rows;       /* each param's; NULL when no gradient is sparse */
    ls_optim_args unscale; /* a slice value's unscale */
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
        ls_lamb_span s = j->model;
        ls_optim_decay_args(&s.decay, p->decay);
        if (p->indices != NULL) {
            lamb_sparse(j, p, &j->rows[i], s, lo, hi);
            continue;
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
    if (total == 0)
        return 1;
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
    lamb_job j = {params, count, model, flags, ls_optim_kernels_at(level), NULL, unscale};
    if (group_rows(&j) != LS_OK)
        return LS_ERR_MEMORY;
    const int rc = (parallel ? parallel : ls_own_threads)(host, lamb_range, &j, total);
    free(j.rows);
    return rc < 0 ? rc : 1;
}
