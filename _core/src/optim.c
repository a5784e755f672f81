/*
 * The fused optimizer step: argument checks, the configuration resolved
 * per gradient dtype, and the kernels run over ranges of the concatenated
 * elements (how the work is split between threads, ours or a host's).
 * Each entry point validates and resolves once, however many ranges run.
 * The check that every gradient is finite runs first and reads only;
 * nothing is written unless it passes.
 */
#include <math.h>
#include <string.h>

#include "internal.h"
#include "optim.h"

/* Each family's entry, from optim_families.h. */
typedef struct family_info {
    const char *name;
    int hyper_count;
    int (*slots)(const float *hyper);
    const char *(*problem)(const float *hyper);
} family_info;

#define LS_FAMILY_INFO(family) \
    {#family, ls_##family##_hyper_count, ls_##family##_slots, ls_##family##_problem},
static const family_info families[] = {LS_OPTIM_FAMILIES(LS_FAMILY_INFO)};
#undef LS_FAMILY_INFO

int ls_optim_family_count(void) { return LS_OPTIM_NUM_FAMILIES; }

int ls_optim_family(const char *name)
{
    for (int f = 0; name != NULL && f < LS_OPTIM_NUM_FAMILIES; f++)
        if (strcmp(name, families[f].name) == 0)
            return f;
    return -1;
}

static int known_family(int family) { return family >= 0 && family < LS_OPTIM_NUM_FAMILIES; }

int ls_optim_takes_term(int family)
{
#define LS_TAKES_TERM(f)                                                                \
    if (known_family(family) && strcmp(families[family].name, #f) == 0)                    \
        return 1;
    LS_OPTIM_TERM_FAMILIES(LS_TAKES_TERM)
#undef LS_TAKES_TERM
    return 0;
}

const char *ls_optim_family_name(int family)
{
    return known_family(family) ? families[family].name : NULL;
}

int ls_optim_hyper_count(int family)
{
    return known_family(family) ? families[family].hyper_count : -1;
}

int ls_optim_slot_count(const ls_optim_config *c)
{
    if (c == NULL || !known_family(c->family))
        return -1;
    return families[c->family].slots(c->hyper);
}

/* What is wrong with a configuration, or NULL. */
static const char *config_problem(const ls_optim_config *c)
{
    if (c == NULL)
        return "config is NULL";
    if (!known_family(c->family))
        return "unknown optimizer family";
    if (c->num_hyper != families[c->family].hyper_count)
        return "the number of hyperparameters is not the family's";
    if (c->unscale < LS_UNSCALE_NONE || c->unscale > LS_UNSCALE_MULTIPLY)
        return "unknown unscale mode";
    /* Keras 3 divides by whatever its scale has become (its rule has no
     * floor: a scale flushed to 0 gives inf and NaN, in stock Keras too);
     * TensorFlow 2.4's scale is finite and >= 1 by its rule. */
    if (c->unscale == LS_UNSCALE_MULTIPLY && !(c->scale > 0.0 && c->scale - c->scale == 0.0))
        return "the loss scale must be finite and > 0 to multiply by its reciprocal";
    if (!ls_optim_finite(c->learning_rate) || c->learning_rate < 0.0f)
        return "the learning rate must be finite and >= 0";
    if (!ls_optim_finite(c->weight_decay))
        return "the weight decay must be finite";
    if (c->clip < LS_CLIP_NONE || c->clip > LS_CLIP_GLOBAL)
        return "unknown clip mode";
    if ((c->clip == LS_CLIP_VALUE || c->clip == LS_CLIP_NORM) &&
        !(ls_optim_finite(c->clip_value) && c->clip_value > 0.0f))
        return "the clip value must be finite and > 0";
    return families[c->family].problem(c->hyper);
}

int ls_optim_config_check(const ls_optim_config *config, const char **why)
{
    const char *reason = config_problem(config);
    if (why)
        *why = reason ? reason : "";
    return reason ? LS_ERR_ARG : LS_OK;
}

static int disjoint(const void *a, size_t abytes, const void *b, size_t bbytes)
{
    const char *x = (const char *)a, *y = (const char *)b;
    return x + abytes <= y || y + bbytes <= x;
}

/* `terms`: whether the configuration accepts ls_param.grad_term. */
static int check_param(const ls_param *p, int nslots, int terms)
{
    if (p->grad_dtype != LS_FLOAT16 && p->grad_dtype != LS_BFLOAT16 &&
        p->grad_dtype != LS_FLOAT32)
        return LS_ERR_DTYPE;
    if (p->decay < LS_DECAY_NONE || p->decay > LS_DECAY_REASSOCIATED)
        return LS_ERR_ARG;
    if (p->grad_term != NULL && !terms)
        return LS_ERR_ARG;
    if (p->length == 0)
        return LS_OK;
    const size_t gsize = ls_dtype_size(p->grad_dtype);
    /* The term and the average, when given, are checked after the slots. */
    const void *bufs[7] = {p->var, p->grad, p->slot[0], p->slot[1], p->slot[2], NULL, NULL};
    size_t bytes[7] = {p->length * 4, p->length * gsize, p->length * 4, p->length * 4,
                       p->length * 4, p->length * 4, p->length * 4};
    const size_t align[7] = {4, gsize, 4, 4, 4, 4, 4};
    int used = 2 + nslots;
    if (p->grad_term != NULL)
        bufs[used++] = p->grad_term;
    if (p->average != NULL)
        bufs[used++] = p->average;
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
    int rc = ls_optim_config_check(config, NULL);
    if (rc != LS_OK)
        return rc;
    if (count > 0 && params == NULL)
        return LS_ERR_ARG;
    const int nslots = ls_optim_slot_count(config);
    /* A term comes from a gradient already unscaled. */
    const int terms =
        ls_optim_takes_term(config->family) && config->unscale == LS_UNSCALE_NONE;
    for (size_t i = 0; i < count; i++)
        if ((rc = check_param(&params[i], nslots, terms)) != LS_OK)
            return rc;
    return LS_OK;
}

/* A step ready to run over any range: validated, its kernels chosen and
 * its configuration resolved per gradient dtype, once. */
typedef struct optim_job {
    const ls_optim_kernels *kernels;
    const ls_param *params;
    size_t count;
    int family;
    unsigned flags;
    float ema_momentum, ema_rest;
    ls_optim_args args[LS_NUM_DTYPES];
} optim_job;

/* The arguments of every kernel call, by gradient dtype.  Computed in the
 * step's floating-point state: TensorFlow computes 1 / scale and wd * lr
 * with subnormals flushed. */
static void resolve(const ls_optim_config *c, unsigned flags, ls_optim_args args[LS_NUM_DTYPES])
{
    ls_fpenv env;
    ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
    ls_optim_args a;
    memset(&a, 0, sizeof a);
    a.lr = c->learning_rate;
    a.wd = c->weight_decay;
    a.wd_lr = ls_f32_mul(c->weight_decay, c->learning_rate);
    memcpy(a.h, c->hyper, sizeof a.h);
    a.clip = c->clip;
    a.clip_value = c->clip_value;
    const float scale = (float)c->scale;
    for (int t = 0; t < LS_NUM_DTYPES; t++) {
        args[t] = a;
        switch (c->unscale) {
        case LS_UNSCALE_DIVIDE:
            if (ls_exact_reciprocal(scale)) {
                args[t].grad_mode = LS_GRAD_MULTIPLY;
                args[t].factor = ls_f32_div(1.0f, scale);
            } else {
                args[t].grad_mode = LS_GRAD_DIVIDE;
                args[t].factor = scale;
            }
            break;
        case LS_UNSCALE_MULTIPLY:
            args[t].grad_mode = t == LS_FLOAT32 ? LS_GRAD_MULTIPLY : LS_GRAD_MUL_ROUNDED;
            args[t].factor = (float)ls_round_to_dtype(ls_f32_div(1.0f, scale), (ls_dtype)t);
            break;
        default:
            args[t].grad_mode = LS_GRAD_AS_IS;
            args[t].factor = 1.0f;
        }
    }
    ls_fpenv_leave(&env);
}

static void job_init(optim_job *j, const ls_optim_kernels *k, const ls_param *params,
                     size_t count, const ls_optim_config *c, unsigned flags)
{
    j->kernels = k;
    j->params = params;
    j->count = count;
    j->family = c->family;
    j->flags = flags;
    j->ema_momentum = c->ema_momentum;
    j->ema_rest = c->ema_rest;
    resolve(c, flags, j->args);
}

/* Elements [lo, hi) of a variable's EMA moved toward the variable as Keras
 * moves it: momentum * average + rest * var, each product rounded, then
 * the sum (-ffp-contract=off: no fused multiply-add).  The same code for
 * every kernel set. */
static void move_average(const ls_param *p, size_t lo, size_t hi, float momentum, float rest)
{
    float *average = p->average;
    const float *var = p->var;
    for (size_t k = lo; k < hi; k++)
        average[k] = momentum * average[k] + rest * var[k];
}

/* A variable with an average is updated in blocks this long, each block's
 * average moved right after it, while the block's new values are in cache. */
enum { EMA_BLOCK = 4096 };

/* The kernels over elements [begin, end) of the concatenation. */
static void job_run(const optim_job *j, size_t begin, size_t end)
{
    ls_fpenv env;
    ls_fpenv_enter(&env, (j->flags & LS_FLUSH_DENORMALS) != 0);
    size_t offset = 0; /* start of params[i] in the concatenation */
    for (size_t i = 0; i < j->count && offset < end; offset += j->params[i].length, i++) {
        const ls_param *p = &j->params[i];
        size_t lo = begin > offset ? begin - offset : 0;
        size_t hi = p->length < end - offset ? p->length : end - offset;
        if (lo >= hi)
            continue;
        ls_optim_args a = j->args[p->grad_dtype];
        a.decay = p->decay;
        a.clip_scalar = p->clip_scalar;
        const ls_optim_fn fn = j->kernels->fn[j->family][p->grad_dtype];
        if (p->average == NULL) {
            fn(p, lo, hi, &a);
            continue;
        }
        for (size_t b = lo; b < hi; b += EMA_BLOCK) {
            const size_t e = hi - b < EMA_BLOCK ? hi : b + EMA_BLOCK;
            fn(p, b, e, &a);
            move_average(p, b, e, j->ema_momentum, j->ema_rest);
        }
    }
    ls_fpenv_leave(&env);
}

static int job_range(const void *ctx, size_t begin, size_t end)
{
    job_run((const optim_job *)ctx, begin, end);
    return 1;
}

void ls_optim_run(const ls_optim_kernels *k, const ls_param *params, size_t count,
                  const ls_optim_config *c, unsigned flags, size_t begin, size_t end)
{
    optim_job j;
    job_init(&j, k, params, count, c, flags);
    job_run(&j, begin, end);
}

static size_t total_length(const ls_param *params, size_t count)
{
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        total += params[i].length;
    return total;
}

/* The checks every entry point makes first, once per call; the kernels to
 * run, or NULL with the error in *rc. */
static const ls_optim_kernels *prepare(const ls_param *params, size_t count,
                                       const ls_optim_config *config, unsigned flags, int *rc)
{
    *rc = flags & ~(unsigned)LS_FLUSH_DENORMALS ? LS_ERR_ARG
                                                 : ls_optim_validate(params, count, config);
    if (*rc != LS_OK)
        return NULL;
    const int level = ls_simd_level();
    if (level < 0) {
        *rc = LS_ERR_SIMD;
        return NULL;
    }
    return ls_optim_kernels_at(level);
}

int ls_optim_step_range(const ls_param *params, size_t count, const ls_optim_config *config,
                        unsigned flags, size_t begin, size_t end)
{
    int rc;
    const ls_optim_kernels *k = prepare(params, count, config, flags, &rc);
    if (k == NULL)
        return rc;
    if (begin > end || end > total_length(params, count))
        return LS_ERR_ARG;
    ls_optim_run(k, params, count, config, flags, begin, end);
    return 1;
}

int ls_optim_update_with(const ls_param *params, size_t count, const ls_optim_config *config,
                         unsigned flags, ls_parallel_fn parallel, void *host)
{
    int rc;
    const ls_optim_kernels *k = prepare(params, count, config, flags, &rc);
    if (k == NULL)
        return rc;
    optim_job job;
    job_init(&job, k, params, count, config, flags);
    rc = (parallel ? parallel : ls_own_threads)(host, job_range, &job,
                                                total_length(params, count));
    return rc < 0 ? rc : 1;
}

int ls_optim_step(const ls_param *params, size_t count, const ls_optim_config *config,
                  unsigned flags)
{
    int rc;
    const ls_optim_kernels *k = prepare(params, count, config, flags, &rc);
    if (k == NULL)
        return rc;
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
    optim_job job;
    job_init(&job, k, params, count, config, flags);
    return ls_run_parallel(job_range, &job, total_length(params, count));
}

#define LS_FITS(family)                                                                    \
    _Static_assert(ls_##family##_hyper_count <= LS_OPTIM_MAX_HYPER,                        \
                   #family " takes more numbers than LS_OPTIM_MAX_HYPER");
LS_OPTIM_FAMILIES(LS_FITS)
