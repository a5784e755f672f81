/*
 * Keras' Lamb: the elementwise part of its update_step in one pass over
 * each variable's gradient and moments (see lossscale.h,
 * ls_lamb_moments_with).  Its norms and the variable's move are the
 * caller's: Keras takes them with TensorFlow's reductions, which the caller
 * runs as Keras runs them, on the u this pass writes.  The elements of
 * every variable are split over the threads as one concatenation; the
 * element loop is the active kernel set's (lamb_body.h).
 */
#include <stdint.h>

#include "internal.h"
#include "lossscale.h"
#include "optim.h"

static int overlap(const float *a, const float *b, size_t n)
{
    return !ls_disjoint(a, n * sizeof(float), b, n * sizeof(float));
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
        if (p->grad == NULL || p->m == NULL || p->v == NULL || p->u == NULL)
            return "a gradient, m, v or u buffer is NULL";
        if (p->length > SIZE_MAX / sizeof(float))
            return "a variable too large";
        const size_t n = p->length;
        if (overlap(p->m, p->v, n) || overlap(p->m, p->grad, n) || overlap(p->v, p->grad, n)
            || overlap(p->u, p->m, n) || overlap(p->u, p->v, n)
            || (p->u != p->grad && overlap(p->u, p->grad, n)))
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
                || overlap(p->var, p->grad, n)
                || (p->term != NULL && overlap(p->var, p->term, n))))
            return "the variable overlaps another buffer";
    }
    return NULL;
}

typedef struct lamb_job {
    const ls_lamb_param *params;
    size_t count;
    ls_lamb_span model; /* the config's numbers; buffers and n per range */
    unsigned flags;
    ls_lamb_fn loop;
} lamb_job;

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
        s.grad = p->grad + lo;
        s.term = p->term != NULL ? p->term + lo : NULL;
        s.var = p->var != NULL ? p->var + lo : NULL;
        ls_optim_decay_args(&s.decay, p->decay);
        if (p->term != NULL) /* a densified sparse gradient: as it is */
            s.how = LS_ADAFACTOR_AS_IS;
        s.m = p->m + lo;
        s.v = p->v + lo;
        s.u = p->u + lo;
        s.n = hi - lo;
        j->loop(&s);
    }
    ls_fpenv_leave(&env);
    return 1;
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
    lamb_job j = {params, count, model, flags, ls_optim_kernels_at(level)->lamb};
    const int rc = (parallel ? parallel : ls_own_threads)(host, lamb_range, &j, total);
    return rc < 0 ? rc : 1;
}
