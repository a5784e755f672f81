/*
 * The fused optimizer step: argument checks, the configuration resolved
 * per gradient dtype, and the kernels run over ranges of the concatenated
 * elements (how the work is split between threads, ours or a host's).
 * Each entry point validates and resolves once, however many ranges run.
 * The check that every gradient is finite runs first and reads only;
 * nothing is written unless it passes.
 */
#include <math.h>
#include <stdlib.h>
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

/* 1 when `family` is the one named `name`. */
static int is_family(int family, const char *name)
{
    return known_family(family) && strcmp(families[family].name, name) == 0;
}

int ls_optim_takes_term(int family)
{
#define LS_TAKES_TERM(f)                                                                \
    if (is_family(family, #f))                                                          \
        return 1;
    LS_OPTIM_TERM_FAMILIES(LS_TAKES_TERM)
#undef LS_TAKES_TERM
    return 0;
}

/* 1 when `family` takes a sparse gradient row by row (LS_OPTIM_ROW_FAMILIES). */
static int row_family(int family)
{
#define LS_ROW_FAMILY(f)                                                                \
    if (is_family(family, #f))                                                          \
        return 1;
    LS_OPTIM_ROW_FAMILIES(LS_ROW_FAMILY)
#undef LS_ROW_FAMILY
    return 0;
}

/* 1 when `family` adds a sparse gradient's row sums (a row's slices added
 * in their order onto 0, as TensorFlow densifies them) to the rows its
 * slices name and leaves the others as they are (run_added_rows): Keras'
 * accumulating step. */
static int added_row_family(int family)
{
    return is_family(family, "accumulate");
}

/* A summed family's sparse reference (LS_OPTIM_SUMMED_FAMILIES), or NULL. */
typedef void (*sparse1_fn)(const ls_param *p, size_t i, float g, int indexed, size_t c,
                           size_t n, size_t at, size_t gathered, const ls_optim_args *a);

static sparse1_fn summed_family(int family)
{
#define LS_SUMMED_FAMILY(f)                                                             \
    if (is_family(family, #f))                                                          \
        return ls_##f##_sparse1;
    LS_OPTIM_SUMMED_FAMILIES(LS_SUMMED_FAMILY)
#undef LS_SUMMED_FAMILY
    return NULL;
}

int ls_optim_takes_sparse(int family)
{
#define LS_TAKES_SPARSE(f)                                                              \
    if (is_family(family, #f))                                                          \
        return 1;
    LS_OPTIM_SPARSE_FAMILIES(LS_TAKES_SPARSE)
#undef LS_TAKES_SPARSE
    return row_family(family) || added_row_family(family) || summed_family(family) != NULL;
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
    if (c->accumulation < LS_ACCUMULATION_NONE || c->accumulation > LS_ACCUMULATION_MULTIPLY)
        return "unknown accumulation mode";
    if (c->accumulation != LS_ACCUMULATION_NONE && c->accumulation_steps < 1)
        return "the accumulation steps must be >= 1";
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

const char *ls_optim_sparse_problem(const ls_optim_config *c)
{
    const char *problem = config_problem(c);
    if (problem != NULL)
        return problem;
    if (!ls_optim_takes_sparse(c->family))
        return "the family takes no sparse gradient (sgd, adam, adamax, lion, adagrad, "
               "rmsprop, accumulate and the legacy families do)";
    if (!ls_optim_finite(c->slice_factor))
        return "the slice factor must be finite";
    if (c->clip == LS_CLIP_GLOBAL && c->slice_factor != 1.0f)
        return "the global clip clips a sparse gradient's row sums: the slice factor must be 1";
    if (is_family(c->family, "adagrad") &&
        (c->clip == LS_CLIP_GLOBAL || c->slice_factor != 1.0f ||
         c->hyper[LS_ADAGRAD_RSQRT] != 0.0f))
        return "adagrad takes a sparse gradient as Keras scatters it: divided by a true "
               "square root (no Rsqrt form), clipped slice by slice (not the global clip), "
               "with a slice factor of 1";
    if (is_family(c->family, "rmsprop") &&
        (c->clip == LS_CLIP_GLOBAL || c->slice_factor != 1.0f ||
         c->hyper[LS_RMSPROP_RSQRT] != LS_RMSPROP_SQRT ||
         c->hyper[LS_RMSPROP_HAS_MOMENTUM] != 0.0f || c->hyper[LS_RMSPROP_CENTERED] != 0.0f))
        return "rmsprop takes a sparse gradient as Keras scatters it: without momentum, "
               "not centered, divided by a true square root (no Rsqrt form), clipped slice "
               "by slice (not the global clip), with a slice factor of 1";
    if (added_row_family(c->family) && (c->clip != LS_CLIP_NONE || c->slice_factor != 1.0f))
        return "accumulate adds a sparse gradient as Keras' accumulating step adds it: "
               "unclipped, with a slice factor of 1";
    if (summed_family(c->family) != NULL) {
        if (c->slice_factor != 1.0f || (c->clip != LS_CLIP_NONE && c->clip != LS_CLIP_VALUE))
            return "a legacy family takes a sparse gradient's slices as tf_keras sums them: "
                   "clipped by value or not at all, with a slice factor of 1";
        if (is_family(c->family, "legacy_rmsprop") &&
            c->hyper[LS_LEGACY_RMSPROP_HAS_MOMENTUM] != 0.0f)
            return ls_optim_rsqrt_problem(1.0f);
    }
    return NULL;
}

/* A sparse gradient's own checks (ls_param.indices): the configuration's
 * part, no term beside it, whole rows, aligned indices, each a row. */
static int check_sparse(const ls_param *p, const ls_optim_config *c)
{
    if (ls_optim_sparse_problem(c) != NULL || p->grad_term != NULL)
        return LS_ERR_ARG;
    if (added_row_family(c->family) && (p->decay != LS_DECAY_NONE || p->average != NULL))
        return LS_ERR_ARG;
    if (p->row_length == 0 || p->length % p->row_length != 0 ||
        p->slices > SIZE_MAX / 8 / p->row_length || (uintptr_t)p->indices % 8 != 0)
        return LS_ERR_ARG;
    const int64_t rows = (int64_t)(p->length / p->row_length);
    for (size_t k = 0; k < p->slices; k++)
        if (p->indices[k] < 0 || p->indices[k] >= rows)
            return LS_ERR_ARG;
    return LS_OK;
}

/* How many gradient elements a param's `grad` holds. */
static size_t grad_length(const ls_param *p)
{
    return p->indices != NULL ? p->slices * p->row_length : p->length;
}

/* `terms`: whether the configuration accepts ls_param.grad_term;
 * `accumulates`: ls_param.accumulator (on a dense gradient without a term). */
static int check_param(const ls_param *p, int nslots, int terms, int accumulates)
{
    if (p->grad_dtype != LS_FLOAT16 && p->grad_dtype != LS_BFLOAT16 &&
        p->grad_dtype != LS_FLOAT32)
        return LS_ERR_DTYPE;
    if (p->decay < LS_DECAY_NONE || p->decay > LS_DECAY_FACTOR)
        return LS_ERR_ARG;
    if (p->grad_term != NULL && !terms)
        return LS_ERR_ARG;
    if (p->accumulator != NULL && (!accumulates || p->grad_term != NULL || p->indices != NULL))
        return LS_ERR_ARG;
    if (p->length == 0)
        return LS_OK;
    const size_t gsize = ls_dtype_size(p->grad_dtype);
    if (p->length > SIZE_MAX / 4)
        return LS_ERR_ARG;
    /* The term, the average, the accumulator and a sparse gradient's
     * indices, when given, are checked after the slots. */
    const void *bufs[9] = {p->var, p->grad, p->slot[0], p->slot[1], p->slot[2]};
    size_t bytes[9] = {p->length * 4, grad_length(p) * gsize, p->length * 4, p->length * 4,
                       p->length * 4};
    size_t align[9] = {4, gsize, 4, 4, 4};
    int used = 2 + nslots;
    if (p->grad_term != NULL) {
        bufs[used] = p->grad_term, bytes[used] = p->length * 4, align[used++] = 4;
    }
    if (p->average != NULL) {
        bufs[used] = p->average, bytes[used] = p->length * 4, align[used++] = 4;
    }
    if (p->accumulator != NULL) {
        bufs[used] = p->accumulator, bytes[used] = p->length * 4, align[used++] = 4;
    }
    if (p->indices != NULL)
        bufs[used] = p->indices, bytes[used] = p->slices * 8, align[used++] = 8;
    for (int i = 0; i < used; i++) {
        if (bytes[i] == 0) /* a sparse gradient of no slices: no bytes to read */
            continue;
        if (bufs[i] == NULL || (uintptr_t)bufs[i] % align[i] != 0)
            return LS_ERR_ARG;
        for (int j = 0; j < i; j++)
            if (bytes[j] != 0 && !ls_disjoint(bufs[i], bytes[i], bufs[j], bytes[j]))
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
    const int accumulates = config->accumulation != LS_ACCUMULATION_NONE;
    for (size_t i = 0; i < count; i++) {
        if ((rc = check_param(&params[i], nslots, terms, accumulates)) != LS_OK)
            return rc;
        if (params[i].indices != NULL && (rc = check_sparse(&params[i], config)) != LS_OK)
            return rc;
    }
    return LS_OK;
}

/* A sparse gradient's slices grouped by row, each row's in their order:
 * the slices of row r are order[start[r] .. start[r + 1]).  For a summed
 * family, also the rows named ranked by their first slice (the order
 * TensorFlow's Unique gives them): rank[r] of a named row r, `named` of
 * them in all. */
typedef struct sparse_rows {
    size_t *start;
    size_t *order;
    size_t *rank;
    size_t named;
} sparse_rows;

/* A step ready to run over any range: validated, its kernels chosen and
 * its configuration resolved per gradient dtype, once; the rows of each
 * sparse gradient (NULL when there is none). */
typedef struct optim_job {
    const ls_optim_kernels *kernels;
    const ls_param *params;
    size_t count;
    int family;
    unsigned flags;
    float ema_momentum, ema_rest;
    float slice_factor;
    int slice_term;     /* LS_SLICE_*: how the family's term is made */
    float slice_term_k; /* LS_SLICE_SCALED's factor */
    sparse_rows *rows;
    sparse1_fn sparse1; /* a summed family's sparse reference */
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
    /* Dividing by a power of two is multiplying by its exact reciprocal;
     * TensorFlow's graph multiplies by 1 / steps rounded, computed as its
     * Reciprocal kernel computes it. */
    const float steps = (float)c->accumulation_steps;
    a.average = LS_AVERAGE_DIVIDE;
    a.steps = steps;
    if (c->accumulation == LS_ACCUMULATION_MULTIPLY ||
        (c->accumulation == LS_ACCUMULATION_DIVIDE && ls_exact_reciprocal(steps))) {
        a.average = LS_AVERAGE_MULTIPLY;
        a.steps = ls_f32_div(1.0f, steps);
    }
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

/* How a term family (LS_OPTIM_TERM_FAMILIES) makes its term of a slice
 * value (family_<name>.h says what its term replaces). */
static void slice_term_of(const ls_optim_config *c, int *kind, float *k)
{
    const char *name = ls_optim_family_name(c->family);
    *kind = LS_SLICE_NO_TERM;
    *k = 0.0f;
    if (strcmp(name, "adam") == 0)
        *kind = LS_SLICE_SQUARE;
    else if (strcmp(name, "adamax") == 0)
        *kind = LS_SLICE_ABS;
    else if (strcmp(name, "lion") == 0)
        *kind = LS_SLICE_SCALED, *k = c->hyper[LS_LION_C2];
}

/* Groups every sparse gradient's slices by row (a counting sort, stable):
 * LS_OK, or LS_ERR_MEMORY with nothing allocated. */
static int group_rows(optim_job *j)
{
    size_t words = 0;
    int any = 0;
    for (size_t i = 0; i < j->count; i++) {
        const ls_param *p = &j->params[i];
        if (p->indices != NULL && p->length > 0) {
            words += (p->length / p->row_length) * (j->sparse1 != NULL ? 2 : 1) + 1 + p->slices;
            any = 1;
        }
    }
    j->rows = NULL;
    if (!any)
        return LS_OK;
    char *memory = ls_rows_memory(j->count * sizeof(sparse_rows), words);
    if (memory == NULL)
        return LS_ERR_MEMORY;
    j->rows = (sparse_rows *)(void *)memory;
    size_t *next = (size_t *)(void *)(memory + j->count * sizeof(sparse_rows));
    for (size_t i = 0; i < j->count; i++) {
        const ls_param *p = &j->params[i];
        sparse_rows *r = &j->rows[i];
        r->start = r->order = r->rank = NULL;
        r->named = 0;
        if (p->indices == NULL || p->length == 0)
            continue;
        const size_t rows = p->length / p->row_length;
        next = ls_rows_place(p->indices, p->slices, rows, next, &r->start, &r->order);
        if (j->sparse1 == NULL)
            continue;
        r->rank = next;
        next += rows;
        for (size_t k = 0; k < p->slices; k++) {
            const size_t row = (size_t)p->indices[k];
            if (r->order[r->start[row]] == k)
                r->rank[row] = r->named++;
        }
    }
    return LS_OK;
}

static int job_init(optim_job *j, const ls_optim_kernels *k, const ls_param *params,
                    size_t count, const ls_optim_config *c, unsigned flags)
{
    j->kernels = k;
    j->params = params;
    j->count = count;
    j->family = c->family;
    j->flags = flags;
    j->ema_momentum = c->ema_momentum;
    j->ema_rest = c->ema_rest;
    j->slice_factor = c->slice_factor;
    slice_term_of(c, &j->slice_term, &j->slice_term_k);
    j->sparse1 = summed_family(c->family);
    resolve(c, flags, j->args);
    return group_rows(j);
}

static void job_free(optim_job *j) { free(j->rows); }

void *ls_rows_memory(size_t head, size_t words)
{
    if (head > SIZE_MAX / 2 || words > (SIZE_MAX - head) / sizeof(size_t))
        return NULL;
    return malloc(head + words * sizeof(size_t));
}

size_t *ls_rows_place(const int64_t *indices, size_t slices, size_t rows, size_t *next,
                      size_t **start, size_t **order)
{
    *start = next;
    *order = next + rows + 1;
    ls_sort_rows(indices, slices, rows, *start, *order);
    return next + rows + 1 + slices;
}

void ls_sort_rows(const int64_t *indices, size_t slices, size_t rows, size_t *start,
                  size_t *order)
{
    memset(start, 0, (rows + 1) * sizeof(size_t));
    for (size_t k = 0; k < slices; k++)
        start[(size_t)indices[k] + 1]++;
    for (size_t row = 0; row < rows; row++)
        start[row + 1] += start[row];
    /* Each slice at its row's next place (start[row] moves past it), then
     * every start back one row. */
    for (size_t k = 0; k < slices; k++)
        order[start[(size_t)indices[k]]++] = k;
    for (size_t row = rows; row > 0; row--)
        start[row] = start[row - 1];
    start[0] = 0;
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
 * average moved right after it, while the block's new values are in cache;
 * so is one with a sparse gradient, each block's sums gathered first. */
enum { BLOCK = 4096 };

void ls_optim_gather_rows(const ls_optim_kernels *k, const void *grad, ls_dtype dt,
                          size_t row_length, const size_t *start, const size_t *order,
                          size_t b, size_t e, const ls_optim_args *sa, float factor, int kind,
                          float term_k, float *g, float *t)
{
    const size_t n = row_length, size = ls_dtype_size(dt);
    if (t == NULL)
        kind = LS_SLICE_NO_TERM;
    for (size_t row = b / n; row * n < e; row++) {
        const size_t first = row * n < b ? b - row * n : 0;
        const size_t last = e - row * n < n ? e - row * n : n;
        float *gd = g + (row * n + first - b);
        float *td = t != NULL ? t + (row * n + first - b) : NULL;
        memset(gd, 0, (last - first) * sizeof(float));
        if (td != NULL)
            memset(td, 0, (last - first) * sizeof(float));
        for (size_t s = start[row]; s < start[row + 1]; s++) {
            const char *src = (const char *)grad + (order[s] * n + first) * size;
            k->slice_add(src, last - first, dt, sa, factor, kind, term_k, gd, td);
        }
    }
}

/* Elements [b, e) of a sparse gradient's dense form (ls_optim_gather_rows),
 * with the family's slice factor and term. */
static void gather_rows(const optim_job *j, const ls_param *p, const sparse_rows *r,
                        size_t b, size_t e, const ls_optim_args *sa, float *g, float *t)
{
    ls_optim_gather_rows(j->kernels, p->grad, p->grad_dtype, p->row_length, r->start, r->order,
                         b, e, sa, j->slice_factor, j->slice_term, j->slice_term_k, g, t);
}

/* Elements [lo, hi) of a variable whose gradient is sparse: a block at a
 * time, its dense gradient (and term) gathered in cache, then the family's
 * float32 kernel on the block as on a dense gradient already unscaled
 * (clipped under LS_CLIP_GLOBAL, which clips the sums), then its average. */
static void run_sparse(const optim_job *j, const ls_param *p, const sparse_rows *r, size_t lo,
                       size_t hi, const ls_optim_args *a)
{
    const int global = a->clip == LS_CLIP_GLOBAL;
    ls_optim_args sa = *a; /* each slice value's unscale and clip */
    if (global)
        sa.clip = LS_CLIP_NONE;
    ls_optim_args ka = j->args[LS_FLOAT32]; /* the kernel's, on the sums */
    ka.decay = a->decay;
    ka.wd_lr = a->wd_lr;
    ka.clip_scalar = a->clip_scalar;
    ka.grad_mode = LS_GRAD_AS_IS;
    ka.factor = 1.0f;
    if (!global)
        ka.clip = LS_CLIP_NONE;
    const ls_optim_fn fn = j->kernels->fn[j->family][LS_FLOAT32];
    float g[BLOCK], t[BLOCK];
    float *const term = !global && j->slice_term != LS_SLICE_NO_TERM ? t : NULL;
    for (size_t b = lo; b < hi; b += BLOCK) {
        const size_t e = hi - b < BLOCK ? hi : b + BLOCK;
        gather_rows(j, p, r, b, e, &sa, g, term);
        ls_param view = *p;
        view.var = p->var + b;
        view.grad = g;
        view.grad_dtype = LS_FLOAT32;
        for (int s = 0; s < 3; s++)
            view.slot[s] = p->slot[s] != NULL ? p->slot[s] + b : NULL;
        view.length = e - b;
        view.grad_term = term;
        view.average = NULL;
        view.indices = NULL;
        view.accumulator = NULL;
        fn(&view, 0, e - b, &ka);
        if (p->average != NULL)
            move_average(p, b, e, j->ema_momentum, j->ema_rest);
    }
}

/* A slice's values in float32, a piece of a row at a time: the kernel
 * set's slice_add onto -0 (x + -0 is x for every x, -0 included), factor 1
 * (exact), unscaled and clipped by `a`. */
enum { PIECE = 1024 };

static void slice_values(const optim_job *j, const ls_param *p, size_t slice, size_t c0,
                         size_t m, const ls_optim_args *a, float *u)
{
    const size_t size = ls_dtype_size(p->grad_dtype);
    const char *src = (const char *)p->grad + (slice * p->row_length + c0) * size;
    for (size_t c = 0; c < m; c++)
        u[c] = -0.0f;
    j->kernels->slice_add(src, m, p->grad_dtype, a, 1.0f, LS_SLICE_NO_TERM, 0.0f, u, NULL);
}

/* Adagrad's row (run_rows): the accumulator plus each slice's squares in
 * their order (ResourceScatterAdd), then the variable minus each slice's
 * (lr * g) / sqrt(accumulator + epsilon) in their order (ResourceScatterSub,
 * the accumulator's new value). */
static void adagrad_row(const optim_job *j, const ls_param *p, const sparse_rows *r,
                        size_t row, size_t c0, size_t m, const ls_optim_args *a)
{
    const size_t n = p->row_length, size = ls_dtype_size(p->grad_dtype);
    const float eps = a->h[LS_ADAGRAD_EPSILON], lr = a->lr;
    float *const vr = p->var + row * n + c0, *const ar = p->slot[0] + row * n + c0;
    float u[PIECE], unused[PIECE]; /* unused: the values, where only their squares count */
    memset(unused, 0, m * sizeof(float));
    for (size_t k = r->start[row]; k < r->start[row + 1]; k++) {
        const char *src = (const char *)p->grad + (r->order[k] * n + c0) * size;
        j->kernels->slice_add(src, m, p->grad_dtype, a, 1.0f, LS_SLICE_SQUARE, 0.0f, unused,
                              ar);
    }
    for (size_t k = r->start[row]; k < r->start[row + 1]; k++) {
        slice_values(j, p, r->order[k], c0, m, a, u);
        for (size_t c = 0; c < m; c++)
            vr[c] -= (lr * u[c]) / sqrtf(ar[c] + eps);
    }
}

/* RMSprop's row (no momentum, not centered; run_rows): the velocity
 * rho * v + t, t the row's slices' (1 - rho) * (g * g) added in their order
 * onto 0 (Keras adds the squares densified: UnsortedSegmentSum; t is 0 where
 * no slice names the row), then, where one does, the variable minus each
 * slice's (lr * g) / sqrt(v + epsilon) in their order (ResourceScatterSub
 * of the slices divided by the Gather of the denominator's Sqrt). */
static void rmsprop_row(const optim_job *j, const ls_param *p, const sparse_rows *r,
                        size_t row, size_t c0, size_t m, const ls_optim_args *a)
{
    const size_t n = p->row_length;
    const float rho = a->h[LS_RMSPROP_RHO], rest = a->h[LS_RMSPROP_C];
    const float eps = a->h[LS_RMSPROP_EPSILON], lr = a->lr;
    float *const vr = p->var + row * n + c0, *const v = p->slot[0] + row * n + c0;
    if (r->start[row] == r->start[row + 1]) {
        for (size_t c = 0; c < m; c++)
            v[c] = rho * v[c] + 0.0f;
        return;
    }
    float u[PIECE], t[PIECE];
    memset(t, 0, m * sizeof(float));
    for (size_t k = r->start[row]; k < r->start[row + 1]; k++) {
        slice_values(j, p, r->order[k], c0, m, a, u);
        for (size_t c = 0; c < m; c++)
            t[c] = t[c] + rest * (u[c] * u[c]);
    }
    for (size_t c = 0; c < m; c++)
        v[c] = rho * v[c] + t[c];
    for (size_t k = r->start[row]; k < r->start[row + 1]; k++) {
        slice_values(j, p, r->order[k], c0, m, a, u);
        for (size_t c = 0; c < m; c++)
            vr[c] -= (lr * u[c]) / sqrtf(v[c] + eps);
    }
}

/* Elements [lo, hi) of a variable of a row family (LS_OPTIM_ROW_FAMILIES)
 * whose gradient is sparse, as Keras' update scatters it: every element's
 * weight decay, then each row, a piece at a time, as the family's row
 * function says (Adagrad's leaves the rows no slice names as they are;
 * RMSprop's decays their velocity), then the average. */
static void run_rows(const optim_job *j, const ls_param *p, const sparse_rows *r, size_t lo,
                     size_t hi, const ls_optim_args *a)
{
    float *const var = p->var;
    const size_t n = p->row_length;
    const int rmsprop = is_family(j->family, "rmsprop");
    if (a->decay != LS_DECAY_NONE)
        for (size_t k = lo; k < hi; k++)
            var[k] = ls_optim_decay1(var[k], a);
    for (size_t row = lo / n; row * n < hi; row++) {
        if (!rmsprop && r->start[row] == r->start[row + 1])
            continue;
        const size_t first = row * n < lo ? lo - row * n : 0;
        const size_t last = hi - row * n < n ? hi - row * n : n;
        for (size_t c0 = first; c0 < last; c0 += PIECE) {
            const size_t m = last - c0 < PIECE ? last - c0 : PIECE;
            (rmsprop ? rmsprop_row : adagrad_row)(j, p, r, row, c0, m, a);
        }
    }
    if (p->average != NULL)
        move_average(p, lo, hi, j->ema_momentum, j->ema_rest);
}

/* Columns [c0, c0 + m) of row `row` of a sparse gradient's dense form,
 * into g: the row's slices, every value unscaled and clipped by `a`, added
 * in their order onto 0 (UnsortedSegmentSum). */
static void row_sum(const optim_job *j, const ls_param *p, const sparse_rows *r, size_t row,
                    size_t c0, size_t m, const ls_optim_args *a, float *g)
{
    const size_t n = p->row_length, size = ls_dtype_size(p->grad_dtype);
    memset(g, 0, m * sizeof(float));
    for (size_t k = r->start[row]; k < r->start[row + 1]; k++) {
        const char *src = (const char *)p->grad + (r->order[k] * n + c0) * size;
        j->kernels->slice_add(src, m, p->grad_dtype, a, 1.0f, LS_SLICE_NO_TERM, 0.0f, g, NULL);
    }
}

/* Elements [lo, hi) of a legacy variable (LS_OPTIM_SUMMED_FAMILIES) whose
 * gradient is sparse, as tf_keras hands it to TensorFlow: each row's
 * slices, every value unscaled and clipped by `a`, added in their order
 * onto 0 (UnsortedSegmentSum), a piece of a row at a time, then every
 * element through the family's sparse reference, told whether a slice
 * names its row, where in the row it is, and where in the named rows
 * gathered by rank. */
static void run_summed_rows(const optim_job *j, const ls_param *p, const sparse_rows *r,
                            size_t lo, size_t hi, const ls_optim_args *a)
{
    const size_t n = p->row_length;
    float g[PIECE];
    for (size_t row = lo / n; row * n < hi; row++) {
        const size_t first = row * n < lo ? lo - row * n : 0;
        const size_t last = hi - row * n < n ? hi - row * n : n;
        const int indexed = r->start[row] < r->start[row + 1];
        const size_t base = indexed ? r->rank[row] * n : 0;
        for (size_t c0 = first; c0 < last; c0 += PIECE) {
            const size_t m = last - c0 < PIECE ? last - c0 : PIECE;
            row_sum(j, p, r, row, c0, m, a, g);
            for (size_t c = 0; c < m; c++)
                j->sparse1(p, row * n + c0 + c, g[c], indexed, c0 + c, n, base + c0 + c,
                           r->named * n, a);
        }
    }
    if (p->average != NULL)
        move_average(p, lo, hi, j->ema_momentum, j->ema_rest);
}

/* Elements [lo, hi) of an accumulator (added_row_family) whose
 * gradient is sparse, as Keras' accumulating step adds it: for each row a
 * slice names, its slices, every value unscaled by `a`, added in their
 * order onto 0 (UnsortedSegmentSum's row), a piece of a row at a time,
 * then the row plus them, as the dense kernel adds; a row no slice names
 * is not read (lossscale.h: ls_param.indices says why that is Keras'). */
static void run_added_rows(const optim_job *j, const ls_param *p, const sparse_rows *r,
                           size_t lo, size_t hi, const ls_optim_args *a)
{
    const size_t n = p->row_length;
    float g[PIECE];
    for (size_t row = lo / n; row * n < hi; row++) {
        if (r->start[row] == r->start[row + 1])
            continue;
        const size_t first = row * n < lo ? lo - row * n : 0;
        const size_t last = hi - row * n < n ? hi - row * n : n;
        for (size_t c0 = first; c0 < last; c0 += PIECE) {
            const size_t m = last - c0 < PIECE ? last - c0 : PIECE;
            float *const w = p->var + row * n + c0;
            row_sum(j, p, r, row, c0, m, a, g);
            for (size_t c = 0; c < m; c++)
                w[c] = w[c] + g[c];
        }
    }
}

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
        ls_optim_decay_args(&a, p->decay);
        a.clip_scalar = p->clip_scalar;
        if (p->indices != NULL) {
            (j->sparse1 != NULL            ? run_summed_rows
             : row_family(j->family)       ? run_rows
             : added_row_family(j->family) ? run_added_rows
                                           : run_sparse)(j, p, &j->rows[i], lo, hi, &a);
            continue;
        }
        const ls_optim_fn fn = j->kernels->fn[j->family][p->grad_dtype];
        if (p->average == NULL) {
            fn(p, lo, hi, &a);
            continue;
        }
        for (size_t b = lo; b < hi; b += BLOCK) {
            const size_t e = hi - b < BLOCK ? hi : b + BLOCK;
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

int ls_optim_run(const ls_optim_kernels *k, const ls_param *params, size_t count,
                 const ls_optim_config *c, unsigned flags, size_t begin, size_t end)
{
    optim_job j;
    const int rc = job_init(&j, k, params, count, c, flags);
    if (rc != LS_OK)
        return rc;
    job_run(&j, begin, end);
    job_free(&j);
    return 1;
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
    return ls_optim_run(k, params, count, config, flags, begin, end);
}

int ls_optim_update_with(const ls_param *params, size_t count, const ls_optim_config *config,
                         unsigned flags, ls_parallel_fn parallel, void *host)
{
    int rc;
    const ls_optim_kernels *k = prepare(params, count, config, flags, &rc);
    if (k == NULL)
        return rc;
    optim_job job;
    if ((rc = job_init(&job, k, params, count, config, flags)) != LS_OK)
        return rc;
    rc = (parallel ? parallel : ls_own_threads)(host, job_range, &job,
                                                total_length(params, count));
    job_free(&job);
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
            grads[i] = (ls_buffer){p->grad, NULL, grad_length(p), p->grad_dtype};
        }
        rc = ls_all_finite(grads, n, flags);
        if (rc != 1)
            return rc; /* 0: not finite, nothing written; < 0: error */
    }
    optim_job job;
    if ((rc = job_init(&job, k, params, count, config, flags)) != LS_OK)
        return rc;
    rc = ls_run_parallel(job_range, &job, total_length(params, count));
    job_free(&job);
    return rc;
}

#define LS_FITS(family)                                                                    \
    _Static_assert(ls_##family##_hyper_count <= LS_OPTIM_MAX_HYPER,                        \
                   #family " takes more numbers than LS_OPTIM_MAX_HYPER");
LS_OPTIM_FAMILIES(LS_FITS)
