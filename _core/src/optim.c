/*
 * The fused optimizer step: argument checks, the configuration resolved
 * per gradient dtype, and the kernels run over a range of the concatenated
 * elements (how the work is split between threads, ours or a host's).
 * The check that every gradient is finite runs first and reads only;
 * nothing is written unless it passes.
 */
#include <math.h>
#include <string.h>

#include "internal.h"
#include "optim.h"

static int finite_f(float x) { return x - x == 0.0f; }

static int slots_needed(const ls_optim_config *c)
{
    if (c->optimizer == LS_OPTIM_SGD)
        return c->momentum != 0.0f ? 1 : 0;
    return c->amsgrad ? 3 : 2;
}

static int check_config(const ls_optim_config *c)
{
    if (c == NULL)
        return LS_ERR_ARG;
    if (c->optimizer != LS_OPTIM_SGD && c->optimizer != LS_OPTIM_ADAM)
        return LS_ERR_ARG;
    if (c->unscale < LS_UNSCALE_NONE || c->unscale > LS_UNSCALE_MULTIPLY)
        return LS_ERR_ARG;
    /* Keras 3 divides by whatever its scale has become (its rule has no
     * floor: a scale flushed to 0 gives inf and NaN, in stock Keras too);
     * TensorFlow 2.4's scale is finite and >= 1 by its rule. */
    if (c->unscale == LS_UNSCALE_MULTIPLY && !(c->scale > 0.0 && c->scale - c->scale == 0.0))
        return LS_ERR_ARG;
    if (!finite_f(c->learning_rate) || c->learning_rate < 0.0f || !finite_f(c->weight_decay))
        return LS_ERR_ARG;
    if (c->optimizer == LS_OPTIM_SGD)
        return finite_f(c->momentum) ? LS_OK : LS_ERR_ARG;
    if (!finite_f(c->alpha) || !finite_f(c->one_minus_beta_1) ||
        !finite_f(c->one_minus_beta_2) || !finite_f(c->epsilon))
        return LS_ERR_ARG;
    return LS_OK;
}

static int disjoint(const void *a, size_t abytes, const void *b, size_t bbytes)
{
    const char *x = (const char *)a, *y = (const char *)b;
    return x + abytes <= y || y + bbytes <= x;
}

static int check_param(const ls_param *p, int nslots)
{
    if (p->grad_dtype != LS_FLOAT16 && p->grad_dtype != LS_BFLOAT16 &&
        p->grad_dtype != LS_FLOAT32)
        return LS_ERR_DTYPE;
    if (p->decay < LS_DECAY_NONE || p->decay > LS_DECAY_REASSOCIATED)
        return LS_ERR_ARG;
    if (p->length == 0)
        return LS_OK;
    const size_t gsize = ls_dtype_size(p->grad_dtype);
    const void *bufs[5] = {p->var, p->grad, p->slot[0], p->slot[1], p->slot[2]};
    const size_t bytes[5] = {p->length * 4, p->length * gsize, p->length * 4, p->length * 4,
                             p->length * 4};
    const size_t align[5] = {4, gsize, 4, 4, 4};
    const int used = 2 + nslots;
    if (p->length > SIZE_MAX / 4)
        return LS_ERR_ARG;
    for (int i = 0; i < used; i++) {
        if (bufs[i] == NULL || (uintptr_t)bufs[i] % align[i] != 0)
            return LS_ERR_ARG;
        for (int j = 0; j < i; j++)
            if (!disjoint(bufs[i], bytes[i], bufs[j], bytes[j]))
                return LS_ERR_ARG;
    }
    return LS_OK;
}

int ls_optim_validate(const ls_param *params, size_t count, const ls_optim_config *config)
{
    int rc = check_config(config);
    if (rc != LS_OK)
        return rc;
    if (count > 0 && params == NULL)
        return LS_ERR_ARG;
    const int nslots = slots_needed(config);
    for (size_t i = 0; i < count; i++)
        if ((rc = check_param(&params[i], nslots)) != LS_OK)
            return rc;
    return LS_OK;
}

/* Whether g / scale == g * (1 / scale) for every float32 g: a positive
 * power of two whose reciprocal is a normal float32. */
static int exact_reciprocal(float scale)
{
    uint32_t bits;
    memcpy(&bits, &scale, sizeof bits);
    const unsigned exponent = bits >> 23; /* a set sign bit makes it > 255 */
    return (bits & 0x7fffffu) == 0 && exponent >= 1 && exponent <= 253;
}

/* The arguments of every kernel call, by gradient dtype.  Runs inside the
 * caller's floating-point state: TensorFlow computes 1 / scale with
 * subnormals flushed. */
static void resolve(const ls_optim_config *c, ls_optim_args args[LS_NUM_DTYPES])
{
    ls_optim_args a;
    memset(&a, 0, sizeof a);
    a.lr = c->learning_rate;
    a.wd = c->weight_decay;
    a.wd_lr = c->weight_decay * c->learning_rate;
    a.momentum = c->momentum;
    a.use_momentum = c->momentum != 0.0f;
    a.nesterov = c->nesterov != 0;
    a.alpha = c->alpha;
    a.c1 = c->one_minus_beta_1;
    a.c2 = c->one_minus_beta_2;
    a.epsilon = c->epsilon;
    a.amsgrad = c->amsgrad != 0;
    for (int t = 0; t < LS_NUM_DTYPES; t++) {
        args[t] = a;
        const float scale = (float)c->scale;
        switch (c->unscale) {
        case LS_UNSCALE_DIVIDE:
            if (exact_reciprocal(scale)) {
                args[t].grad_mode = LS_GRAD_MULTIPLY;
                args[t].factor = 1.0f / scale;
            } else {
                args[t].grad_mode = LS_GRAD_DIVIDE;
                args[t].factor = scale;
            }
            break;
        case LS_UNSCALE_MULTIPLY: {
            volatile float one = 1.0f;
            const float inv = one / scale;
            args[t].grad_mode = t == LS_FLOAT32 ? LS_GRAD_MULTIPLY : LS_GRAD_MUL_ROUNDED;
            args[t].factor = (float)ls_round_to_dtype(inv, (ls_dtype)t);
            break;
        }
        default:
            args[t].grad_mode = LS_GRAD_AS_IS;
            args[t].factor = 1.0f;
        }
    }
}

void ls_optim_run(const ls_optim_kernels *k, const ls_param *params, size_t count,
                  const ls_optim_config *c, unsigned flags, size_t begin, size_t end)
{
    ls_fpenv env;
    ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
    ls_optim_args args[LS_NUM_DTYPES];
    resolve(c, args);
    size_t offset = 0; /* start of params[i] in the concatenation */
    for (size_t i = 0; i < count && offset < end; offset += params[i].length, i++) {
        const ls_param *p = &params[i];
        size_t lo = begin > offset ? begin - offset : 0;
        size_t hi = p->length < end - offset ? p->length : end - offset;
        if (lo >= hi)
            continue;
        ls_optim_args *a = &args[p->grad_dtype];
        a->decay = p->decay;
        if (c->optimizer == LS_OPTIM_SGD)
            k->sgd[p->grad_dtype](p, lo, hi, a);
        else
            k->adam[p->grad_dtype](p, lo, hi, a);
    }
    ls_fpenv_leave(&env);
}

static size_t total_length(const ls_param *params, size_t count)
{
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        total += params[i].length;
    return total;
}

int ls_optim_step_range(const ls_param *params, size_t count, const ls_optim_config *config,
                        unsigned flags, size_t begin, size_t end)
{
    if (flags & ~(unsigned)LS_FLUSH_DENORMALS)
        return LS_ERR_ARG;
    int rc = ls_optim_validate(params, count, config);
    if (rc != LS_OK)
        return rc;
    const int level = ls_simd_level();
    if (level < 0)
        return LS_ERR_SIMD;
    if (begin > end || end > total_length(params, count))
        return LS_ERR_ARG;
    ls_optim_run(ls_optim_kernels_at(level), params, count, config, flags, begin, end);
    return 1;
}

/* The update over one part of the list, for the library's threads. */
typedef struct optim_job {
    const ls_optim_kernels *kernels;
    const ls_param *params;
    size_t count;
    const ls_optim_config *config;
    unsigned flags;
} optim_job;

static int optim_range(const void *ctx, size_t begin, size_t end)
{
    const optim_job *j = (const optim_job *)ctx;
    ls_optim_run(j->kernels, j->params, j->count, j->config, j->flags, begin, end);
    return 1;
}

int ls_optim_step(const ls_param *params, size_t count, const ls_optim_config *config,
                  unsigned flags)
{
    if (flags & ~(unsigned)LS_FLUSH_DENORMALS)
        return LS_ERR_ARG;
    int rc = ls_optim_validate(params, count, config);
    if (rc != LS_OK)
        return rc;
    const int level = ls_simd_level();
    if (level < 0)
        return LS_ERR_SIMD;
    /* The read-only check, over the gradients as they are stored. */
    enum { CHUNK = 256 };
    ls_buffer grads[CHUNK];
    for (size_t first = 0; first < count; first += CHUNK) {
        size_t n = count - first < CHUNK ? count - first : CHUNK;
        for (size_t i = 0; i < n; i++) {
            const ls_param *p = &params[first + i];
            grads[i] = (ls_buffer){p->grad, NULL, p->length, p->grad_dtype};
        }
        rc = ls_all_finite(grads, n, flags);
        if (rc != 1)
            return rc; /* 0: not finite, nothing written; < 0: error */
    }
    const optim_job job = {ls_optim_kernels_at(level), params, count, config, flags};
    return ls_run_parallel(optim_range, &job, total_length(params, count));
}
