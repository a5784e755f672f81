/*
 * Coverage-guided fuzz target over the fused optimizer step.
 *
 * One input describes a list of variables (gradient dtype, weight-decay
 * form, length, raw bytes of the variable, gradient, slots and, for some,
 * a gradient term: ls_param.grad_term, an EMA: ls_param.average, a
 * sparse gradient: ls_param.indices, and a gradient accumulator:
 * ls_param.accumulator) and a whole configuration (optimizer, unscale
 * mode, scale, accumulation mode and steps, and every hyperparameter as raw
 * bits, so non-finite and out-of-range values come up).  Checked:
 *   - every kernel set this CPU runs gives the scalar set's bytes (NaN
 *     results need only be NaN: a compiler may swap the operands of a
 *     commutative scalar operation, which picks the other NaN payload);
 *   - ls_optim_step: a configuration ls_optim_validate refuses, or a
 *     non-finite gradient, leaves every byte as it was; otherwise it
 *     equals the scalar set;
 *   - ls_optim_validate takes a sparse gradient exactly when lossscale.h's
 *     rules for one hold (read here apart from the core's check: the
 *     legacy families' included) and the call, every gradient dense, would
 *     be taken; ls_optim_sparse_problem finds none exactly when the
 *     configuration's part of them holds;
 *   - a sparse gradient's update (every family that takes one) equals its
 *     form restated here from lossscale.h and family_<name>.h, a variable
 *     at a time: each slice value unscaled and clipped, a row's slices
 *     summed in their order onto +0; then Keras 3's SGD, Adam, Adamax and
 *     Lion as the scalar set's dense step on that densified gradient (and
 *     its summed term, or under the global clip the sums clipped); Adagrad
 *     as Keras scatters it; legacy SGD, Adagrad and RMSprop without
 *     momentum (in the kernel's order) and accumulate as the dense step on
 *     each named row's sums, their other rows as their forms say (as they
 *     are for SGD, Adagrad and accumulate); legacy Adam and RMSprop's other
 *     forms element by element; the EMA moved after;
 *   - ls_optim_validate takes accumulators exactly when lossscale.h's
 *     rules for them hold (a known accumulation mode, steps >= 1 under
 *     one, an accumulator only under one, on a dense gradient without a
 *     term), and a run that writes leaves every accumulator +0;
 *   - ls_optim_step_range over two parts equals one whole run, and so does
 *     ls_optim_update_with on a host parallel-for running them in reverse;
 *     a call either refuses, before the parallel-for runs, or updates;
 *   - no byte outside the buffers moves (guard bytes), gradients and
 *     indices are never written, and the caller's floating-point control
 *     state comes back.
 *
 * Input layout (a short input reads as if padded with zeros):
 *   0      bit 0 LS_FLUSH_DENORMALS, bits 1-3 the family's low three bits
 *          (its fourth is byte 65's bit 7; the four % (families + 1): the
 *          last value is an unknown one), bits 4-5 unscale mode (3: an
 *          invalid one), bit 6 the family's first number forced to 0 (SGD:
 *          no momentum), bit 7 the caller runs with FTZ/DAZ
 *   1..8   scale (double)
 *   9..16  learning rate, weight decay (float each)
 *   17..64 the family's numbers (LS_OPTIM_MAX_HYPER floats; those past its
 *          count are ignored), in family_<name>.h's order; 49..52, past
 *          every family's count (FITS below), are also the slice factor
 *          (raw bits 0 read as 1, most families' factor); 53: bits 0-1 the
 *          accumulation mode (ls_accumulation_mode; 3 is refused), bits 2-4
 *          which variables have an accumulator (bit 2 + i: variable i);
 *          54..56 the accumulation steps (u24); the last two (57..64) the
 *          EMA's momentum and rest.  (53..56 were read by no family before
 *          accumulators came: the corpus was rewritten with them zeroed, so
 *          that each input kept its meaning.)
 *   65     variables: 1 + (byte & 127) % 3; bit 7: the family's fourth bit
 *          (the corpus was rewritten when it was added, and again when the
 *          clip fields were: each input kept its meaning, the unknown family
 *          included)
 *   66     cut: where the range run splits, byte * total / 255
 *   67     clip mode (byte % 5: ls_clip_mode; 4 is refused)
 *   68..71 clip value (float)
 *   then per variable 8 bytes: gradient dtype (byte % 4: float16,
 *          bfloat16, float32, float64 — refused; bit 2: the gradient's
 *          term is given, refused but for a family that takes one
 *          under LS_UNSCALE_NONE; bit 3: the variable has an average,
 *          which inputs written before it was added may set too; bit 4:
 *          the gradient is sparse, which they may set too; bits 5-7: the
 *          row length less 1), decay (byte % 4: ls_decay; bits 2-6:
 *          the slices; bit 7: the length is not rounded down to a multiple
 *          of the row length, or with a row length of 1, which every
 *          length is a multiple of, the indices start 4 bytes off their
 *          alignment), length (u16 % 1500), clip scalar (float); a dense
 *          gradient's slices and row length are set too, to be ignored
 *   then the content, handed out to the buffers in order and repeated; an
 *   index is its 8 bytes as a u64 modulo the rows + 1 (the last value one
 *   row too far), or when its top byte is 0xFF or 0x7F the raw value
 *   (negative, or far past the rows).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lossscale_chunks.h"
#include "optim.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_MXCSR 1
#endif

enum {
    MAX_VARS = 3,
    NBUF = 9,
    TERM = 5,
    AVERAGE = 6,
    INDICES = 7,
    ACCUMULATOR = 8,
    GUARD = 0xA5,
    PAD = 64
};

/* The slice factor's bytes (49..52) lie past every family's numbers. */
#define FITS(family)                                                                       \
    _Static_assert(ls_##family##_hyper_count <= 8, #family " reads the slice factor's bytes");
LS_OPTIM_FAMILIES(FITS)
#undef FITS

typedef struct fuzz_input {
    const uint8_t *data;
    size_t size, pos;
} fuzz_input;

static uint8_t byte_at(const fuzz_input *in, size_t i) { return i < in->size ? in->data[i] : 0; }

static void read_bytes(const fuzz_input *in, size_t at, void *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        ((uint8_t *)out)[i] = byte_at(in, at + i);
}

/* One list of buffers with guard bytes around each. */
typedef struct arena {
    ls_param params[MAX_VARS];
    /* var, grad, 3 slots, term, average, indices, accumulator: PAD guard +
     * data + PAD guard */
    uint8_t *blocks[MAX_VARS][NBUF];
    size_t bytes[MAX_VARS][NBUF];
    int terms[MAX_VARS];
    int averages[MAX_VARS];
    int sparse[MAX_VARS];
    int accumulators[MAX_VARS];
    size_t skew[MAX_VARS]; /* the indices' offset in their buffer: 0, or 4 (misaligned) */
    size_t count;
} arena;


static char difference[160];

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_optim: %s %s\n", what, difference);
    abort();
}

static void arena_fill(arena *a, const arena *layout, const fuzz_input *in, size_t content)
{
    *a = *layout;
    size_t pos = content;
    for (size_t i = 0; i < a->count; i++) {
        for (int b = 0; b < NBUF; b++) {
            size_t n = a->bytes[i][b];
            uint8_t *block = malloc(n + 2 * PAD);
            if (block == NULL)
                fail("out of memory");
            memset(block, GUARD, n + 2 * PAD);
            for (size_t k = 0; k < n; k++) {
                block[PAD + k] = in->size > content ? in->data[pos] : 0;
                if (in->size > content && ++pos >= in->size)
                    pos = content;
            }
            a->blocks[i][b] = block;
        }
        ls_param *p = &a->params[i];
        p->var = (float *)(void *)(a->blocks[i][0] + PAD);
        p->grad = a->blocks[i][1] + PAD;
        for (int s = 0; s < 3; s++)
            p->slot[s] = (float *)(void *)(a->blocks[i][2 + s] + PAD);
        p->grad_term = a->terms[i] ? (const float *)(void *)(a->blocks[i][TERM] + PAD) : NULL;
        p->average = a->averages[i] ? (float *)(void *)(a->blocks[i][AVERAGE] + PAD) : NULL;
        p->accumulator =
            a->accumulators[i] ? (float *)(void *)(a->blocks[i][ACCUMULATOR] + PAD) : NULL;
        p->indices = NULL;
        if (!a->sparse[i])
            continue;
        /* the raw words made indices, most of them rows */
        uint8_t *words = a->blocks[i][INDICES] + PAD + a->skew[i];
        const uint64_t rows = p->length / p->row_length;
        for (size_t k = 0; k < p->slices; k++) {
            uint64_t raw;
            memcpy(&raw, words + 8 * k, 8);
            if (raw >> 56 != 0xFF && raw >> 56 != 0x7F) {
                raw %= rows + 1;
                memcpy(words + 8 * k, &raw, 8);
            }
        }
        p->indices = (const int64_t *)(void *)words;
    }
}

static void arena_free(arena *a)
{
    for (size_t i = 0; i < a->count; i++)
        for (int b = 0; b < NBUF; b++)
            free(a->blocks[i][b]);
}

static void check_guards(const arena *a)
{
    for (size_t i = 0; i < a->count; i++)
        for (int b = 0; b < NBUF; b++)
            for (size_t k = 0; k < PAD; k++)
                if (a->blocks[i][b][k] != GUARD || a->blocks[i][b][PAD + a->bytes[i][b] + k] != GUARD)
                    fail("a byte outside a buffer was written");
}


/* Same bytes, except that a NaN float32 may be any NaN. */
static int same_results(const arena *x, const arena *y)
{
    for (size_t i = 0; i < x->count; i++)
        for (int b = 0; b < NBUF; b++) {
            const uint8_t *p = x->blocks[i][b], *q = y->blocks[i][b];
            if (memcmp(p, q, x->bytes[i][b] + 2 * PAD) == 0)
                continue;
            if (b == 1 || b == TERM || b == INDICES) /* only read */
                return 0;
            for (size_t k = 0; k < x->bytes[i][b]; k += 4) {
                float u = ls_load_f32(p + PAD + k), v = ls_load_f32(q + PAD + k);
                if (memcmp(&u, &v, 4) != 0 && !(isnan(u) && isnan(v))) {
                    snprintf(difference, sizeof difference,
                             "variable %zu, buffer %d, element %zu: %a vs %a", i, b, k / 4,
                             (double)u, (double)v);
                    return 0;
                }
            }
        }
    return 1;
}

static int identical(const arena *x, const arena *y)
{
    for (size_t i = 0; i < x->count; i++)
        for (int b = 0; b < NBUF; b++)
            if (memcmp(x->blocks[i][b], y->blocks[i][b], x->bytes[i][b] + 2 * PAD) != 0)
                return 0;
    return 1;
}

/* Every gradient element finite, read one at a time (a sparse gradient's
 * slices: what it stores). */
static int gradients_finite(const arena *a)
{
    for (size_t i = 0; i < a->count; i++) {
        const ls_param *p = &a->params[i];
        if (p->grad_dtype == LS_FLOAT64)
            continue;
        const size_t n = p->indices != NULL ? p->slices * p->row_length : p->length;
        for (size_t k = 0; k < n; k++)
            if (!isfinite(ls_optim_load_grad(p->grad, k, p->grad_dtype)))
                return 0;
    }
    return 1;
}

/* 1 when `family` takes a sparse gradient as tf_keras sums it, a row's
 * slices first (LS_OPTIM_SUMMED_FAMILIES): tf_keras' legacy families and
 * its current Adam, SGD and RMSprop (their names). */
static int legacy_family(int family)
{
    const char *name = ls_optim_family_name(family);
    return name != NULL &&
           (strncmp(name, "legacy_", 7) == 0 || strncmp(name, "tf_keras_", 9) == 0);
}

/* lossscale.h's rules for a configuration that takes sparse gradients
 * (ls_param.indices), apart from the core's ls_optim_sparse_problem: the
 * family takes one, a finite slice factor, 1 under LS_CLIP_GLOBAL;
 * Adagrad's is 1, never under LS_CLIP_GLOBAL nor in its Rsqrt form;
 * RMSprop's too, and without momentum, not centered; a
 * legacy family's is 1, clipped by value or not at all, and legacy
 * RMSprop's with momentum (TensorFlow's Rsqrt of a row) on x86 only;
 * accumulate's is 1, unclipped. */
static int sparse_config_ok(const ls_optim_config *c)
{
    if (!ls_optim_takes_sparse(c->family) || !isfinite(c->slice_factor) ||
        (c->clip == LS_CLIP_GLOBAL && c->slice_factor != 1.0f))
        return 0;
    if (c->family == ls_optim_family("accumulate"))
        return c->slice_factor == 1.0f && c->clip == LS_CLIP_NONE;
    if (legacy_family(c->family)) {
        if (c->slice_factor != 1.0f || (c->clip != LS_CLIP_NONE && c->clip != LS_CLIP_VALUE))
            return 0;
#ifndef HAVE_MXCSR
        if (c->family == ls_optim_family("legacy_rmsprop") &&
            c->hyper[LS_LEGACY_RMSPROP_HAS_MOMENTUM] != 0.0f)
            return 0;
#endif
        return 1;
    }
    if (c->family == ls_optim_family("rmsprop"))
        return c->clip != LS_CLIP_GLOBAL && c->slice_factor == 1.0f &&
               c->hyper[LS_RMSPROP_RSQRT] == 0.0f && c->hyper[LS_RMSPROP_HAS_MOMENTUM] == 0.0f &&
               c->hyper[LS_RMSPROP_CENTERED] == 0.0f;
    return c->family != ls_optim_family("adagrad") ||
           (c->clip != LS_CLIP_GLOBAL && c->slice_factor == 1.0f &&
            c->hyper[LS_ADAGRAD_RSQRT] == 0.0f);
}

/* The rules for every sparse gradient of a call, apart from the core's
 * check_sparse: the configuration's, no term, whole rows, 8-byte aligned
 * indices, every index a row; accumulate's with no weight decay and no
 * average. */
static int sparse_rules_hold(const arena *a, const ls_optim_config *c)
{
    for (size_t i = 0; i < a->count; i++) {
        const ls_param *p = &a->params[i];
        if (p->indices == NULL)
            continue;
        if (!sparse_config_ok(c) || p->grad_term != NULL || p->row_length == 0 ||
            p->length % p->row_length != 0 || (uintptr_t)p->indices % 8 != 0)
            return 0;
        if (c->family == ls_optim_family("accumulate") &&
            (p->decay != LS_DECAY_NONE || p->average != NULL))
            return 0;
        for (size_t k = 0; k < p->slices; k++) {
            int64_t index;
            memcpy(&index, (const uint8_t *)p->indices + 8 * k, 8);
            if (index < 0 || (uint64_t)index >= p->length / p->row_length)
                return 0;
        }
    }
    return 1;
}

/* lossscale.h's rules for accumulators (ls_param.accumulator), apart
 * from the core's checks: a known accumulation mode, steps >= 1 under one;
 * an accumulator only under one, on a dense gradient without a term. */
static int accumulation_rules_hold(const arena *a, const ls_optim_config *c)
{
    if (c->accumulation < LS_ACCUMULATION_NONE || c->accumulation > LS_ACCUMULATION_MULTIPLY ||
        (c->accumulation != LS_ACCUMULATION_NONE && c->accumulation_steps < 1))
        return 0;
    for (size_t i = 0; i < a->count; i++) {
        const ls_param *p = &a->params[i];
        if (p->accumulator != NULL && (c->accumulation == LS_ACCUMULATION_NONE ||
                                       p->indices != NULL || p->grad_term != NULL))
            return 0;
    }
    return 1;
}

/* Every accumulator all +0 (what a run that writes leaves). */
static int accumulators_zero(const arena *a)
{
    for (size_t i = 0; i < a->count; i++)
        for (size_t k = 0; a->accumulators[i] && k < a->bytes[i][ACCUMULATOR]; k++)
            if (a->blocks[i][ACCUMULATOR][PAD + k] != 0)
                return 0;
    return 1;
}

/* Whether the call validates with every gradient taken as dense (`length`
 * elements from `grad`: only checked, never read, so it may claim more
 * bytes than a sparse one's buffer holds, and then overlap another and be
 * refused; only its taking is a claim). */
static int valid_as_dense(const arena *a, const ls_optim_config *c)
{
    ls_param dense[MAX_VARS];
    memcpy(dense, a->params, sizeof dense);
    for (size_t i = 0; i < a->count; i++)
        dense[i].indices = NULL;
    return ls_optim_validate(dense, a->count, c) == LS_OK;
}

/* ---- the sparse forms restated (lossscale.h's ls_param.indices) ---- */

/* Slice value k of a sparse gradient as its form takes it, restated from
 * lossscale.h: unscaled as a dense element is (Keras 3 divides by the
 * scale; TensorFlow 2.4 multiplies by its reciprocal rounded to the
 * gradient's dtype, the product rounded to it again), then clipped, but
 * under LS_CLIP_GLOBAL, which clips the row sums.  In the step's
 * floating-point state. */
static float slice_value(const ls_param *p, size_t k, const ls_optim_config *c)
{
    ls_optim_args a;
    memset(&a, 0, sizeof a);
    a.grad_mode = LS_GRAD_AS_IS;
    a.factor = 1.0f;
    if (c->unscale == LS_UNSCALE_DIVIDE) {
        a.grad_mode = LS_GRAD_DIVIDE;
        a.factor = (float)c->scale;
    } else if (c->unscale == LS_UNSCALE_MULTIPLY) {
        a.grad_mode = p->grad_dtype == LS_FLOAT32 ? LS_GRAD_MULTIPLY : LS_GRAD_MUL_ROUNDED;
        a.factor = (float)ls_round_to_dtype(1.0f / (float)c->scale, p->grad_dtype);
    }
    a.clip = c->clip == LS_CLIP_GLOBAL ? LS_CLIP_NONE : c->clip;
    a.clip_value = c->clip_value;
    a.clip_scalar = p->clip_scalar;
    const float g = ls_optim_load_grad(p->grad, k, p->grad_dtype);
    return ls_optim_clip1(ls_optim_unscale1(g, p->grad_dtype, &a), &a);
}

/* A sparse gradient densified as lossscale.h says: every slice value times
 * `factor`, a row's slices added in their order onto +0 (rows no slice
 * names stay 0), into g; the term the family takes of each value summed
 * the same way into t (when not NULL): Adam's u * u, Adamax's |u|, Lion's
 * u * (1 - beta_2).  `named[r]`: whether a slice names row r. */
static void densify(const ls_param *p, const ls_optim_config *c, float factor, float *g,
                    float *t, unsigned char *named)
{
    const size_t n = p->row_length;
    const char *name = ls_optim_family_name(c->family);
    memset(g, 0, p->length * sizeof(float));
    if (t != NULL)
        memset(t, 0, p->length * sizeof(float));
    memset(named, 0, p->length / n);
    for (size_t s = 0; s < p->slices; s++) {
        const size_t row = (size_t)p->indices[s];
        named[row] = 1;
        for (size_t col = 0; col < n; col++) {
            const float u = slice_value(p, s * n + col, c);
            g[row * n + col] += u * factor;
            if (t == NULL)
                continue;
            if (strcmp(name, "adam") == 0)
                t[row * n + col] += u * u;
            else if (strcmp(name, "adamax") == 0)
                t[row * n + col] += fabsf(u);
            else
                t[row * n + col] += u * c->hyper[LS_LION_C2];
        }
    }
}

/* Keras' weight decay of one weight (lossscale.h's three forms). */
/* `x` as it is, hidden from the optimizer.  The restatements run under the
 * step's flush-to-zero mode, and a compiler that assumes the default
 * environment may rewrite `named ? w + d : w` as `w + (named ? d : -0.0f)`,
 * which flushes a subnormal `w` the step leaves as it is. */
static float kept(float x)
{
    volatile float v = x;
    return v;
}

static float decayed(float w, int decay, const ls_optim_config *c)
{
    if (decay == LS_DECAY_OP_BY_OP)
        return w - (w * c->weight_decay) * c->learning_rate;
    if (decay == LS_DECAY_REASSOCIATED) {
        const float wd_lr = c->weight_decay * c->learning_rate;
        return w - w * wd_lr;
    }
    if (decay == LS_DECAY_FACTOR)
        return w - w * c->weight_decay;
    return w;
}

/* The configuration a densified gradient runs under: already unscaled
 * and clipped (but for the global clip, which clips the sums), no
 * accumulation. */
static ls_optim_config dense_config(const ls_optim_config *c)
{
    ls_optim_config d = *c;
    d.unscale = LS_UNSCALE_NONE;
    d.scale = 1.0;
    d.clip = c->clip == LS_CLIP_GLOBAL ? LS_CLIP_GLOBAL : LS_CLIP_NONE;
    d.accumulation = LS_ACCUMULATION_NONE;
    return d;
}

/* Elements [lo, hi) of `p` as a dense float32 gradient `g` updates them,
 * through the scalar set (the reference every other set is held to). */
static void dense_run(const ls_param *p, size_t lo, size_t hi, const float *g,
                      const float *t, const ls_optim_config *dc, unsigned flags)
{
    ls_param d = *p;
    d.var = p->var + lo;
    for (int s = 0; s < 3; s++)
        d.slot[s] = p->slot[s] != NULL ? p->slot[s] + lo : NULL;
    d.average = p->average != NULL ? p->average + lo : NULL;
    d.grad = g + lo;
    d.grad_dtype = LS_FLOAT32;
    d.grad_term = t != NULL ? t + lo : NULL;
    d.indices = NULL;
    d.slices = 0;
    d.accumulator = NULL;
    d.length = hi - lo;
    if (ls_optim_run(&ls_optim_scalar, &d, 1, dc, flags, 0, d.length) != 1)
        fail("the scalar set refused a densified gradient");
}

/* The legacy sparse forms (family_legacy_*.h, family_tf_keras_*.h) of the
 * rows no densified equivalent covers, restated element by element from
 * their comments: SGD's and Adagrad's rows no slice names stay as they are;
 * tf_keras' current SGD (every m times mu, the named rows' sums times -lr
 * added, every weight moved), Adam (every row's moments decayed, the named
 * ones' sums added, every weight moved) and RMSprop (the slots decayed on
 * every row, the named rows' steps of TensorFlow's Rsqrt of their
 * denominators gathered, the element at `at` of `gathered`), legacy
 * RMSprop with momentum (ResourceSparseApply(Centered)RMSProp on the named
 * rows, TensorFlow's Rsqrt of a row) and without (every rms and mg times
 * rho, the named rows' rest). */
static void legacy_element(const ls_param *p, size_t i, float g, int named, size_t col,
                           size_t at, size_t gathered, const ls_optim_config *c)
{
    const float *h = c->hyper, lr = c->learning_rate;
    const char *name = ls_optim_family_name(c->family);
    if (strcmp(name, "legacy_sgd") == 0 || strcmp(name, "legacy_adagrad") == 0 ||
        strcmp(name, "accumulate") == 0)
        return; /* a row no slice names stays as it is (the named: densified) */
    if (strcmp(name, "tf_keras_sgd") == 0) {
        /* tf_keras' current SGD: m times mu on every row; the named rows'
         * sums times -lr scatter-added to m and, with Nesterov, to w; then
         * w + m * mu (Nesterov) or w + m.  No slot: the scatter alone. */
        const int nesterov = h[LS_LEGACY_SGD_NESTEROV] != 0.0f;
        const float mu = h[LS_LEGACY_SGD_MOMENTUM], d = -(g * lr);
        float w = decayed(p->var[i], p->decay, c);
        if (h[LS_LEGACY_SGD_HAS_MOMENTUM] == 0.0f) {
            p->var[i] = named ? w + d : kept(w);
            return;
        }
        float m = p->slot[0][i] * mu;
        if (named) {
            m = m + d;
            w = nesterov ? w + d : kept(w);
        }
        p->slot[0][i] = m;
        p->var[i] = nesterov ? w + m * mu : w + m;
        return;
    }
    if (strcmp(name, "tf_keras_rmsprop") == 0) {
        /* tf_keras' current RMSprop: velocity (and average_gradient) times
         * rho on every row, the named rows' sums' terms scatter-added; every
         * row's denominator; the named rows' lr * g * rsqrt(d) (in the
         * step's grouping) of their denominators gathered in the order of
         * their first slice; momentum times mu on every row, the steps
         * added, every weight minus it, or the named weights minus their
         * steps. */
        const int momentum = h[LS_RMSPROP_HAS_MOMENTUM] != 0.0f;
        const float rho = h[LS_RMSPROP_RHO], k = h[LS_RMSPROP_C], eps = h[LS_RMSPROP_EPSILON],
                    form = h[LS_RMSPROP_RSQRT];
        float v = p->slot[0][i] * rho;
        if (named)
            v = v + k * (g * g);
        p->slot[0][i] = v;
        float d = v + eps;
        if (h[LS_RMSPROP_CENTERED] != 0.0f) {
            float *avg = p->slot[1 + momentum];
            float a = avg[i] * rho;
            if (named)
                a = a + k * g;
            avg[i] = a;
            d = h[LS_RMSPROP_PUSH_DOWN] != 0.0f ? (eps - a * a) + v : (v - a * a) + eps;
        }
        float w = decayed(p->var[i], p->decay, c), step = 0.0f;
        if (named) {
            const float r = ls_tf_rsqrt1(d, at, gathered);
            step = form == LS_RMSPROP_SQRT       ? (lr * g) / sqrtf(d)
                   : form == LS_RMSPROP_LR_RSQRT ? g * (lr * r)
                   : form == LS_RMSPROP_G_RSQRT  ? lr * (g * r)
                                                 : (lr * g) * r;
        }
        if (momentum) {
            float m = p->slot[1][i] * h[LS_RMSPROP_MOMENTUM];
            if (named)
                m = m + step;
            p->slot[1][i] = m;
            w = w - m;
        } else {
            w = named ? w - step : kept(w);
        }
        p->var[i] = w;
        return;
    }
    if (strcmp(name, "tf_keras_adam") == 0) {
        /* tf_keras' current Adam: every row's moments decayed by
         * assign_add(-m * c1), the named rows' sums' terms added. */
        const float c1 = h[LS_ADAM_C1], c2 = h[LS_ADAM_C2];
        float m = p->slot[0][i], v = p->slot[1][i];
        m = m + -(m * c1);
        v = v + -(v * c2);
        if (named) {
            m = m + g * c1;
            v = v + (g * g) * c2;
        }
        p->slot[0][i] = m;
        p->slot[1][i] = v;
        if (h[LS_ADAM_AMSGRAD] != 0.0f) { /* TensorFlow's NaN-propagating Maximum */
            const float vhat = p->slot[2][i];
            v = vhat != vhat ? vhat : ls_optim_max(vhat, v);
            p->slot[2][i] = v;
        }
        const float w = decayed(p->var[i], p->decay, c);
        p->var[i] = w - (m * h[LS_ADAM_ALPHA]) / (sqrtf(v) + h[LS_ADAM_EPSILON]);
        return;
    }
    if (strcmp(name, "legacy_adam") == 0) {
        const float b1 = h[LS_LEGACY_ADAM_BETA_1], b2 = h[LS_LEGACY_ADAM_BETA_2];
        float m = p->slot[0][i] * b1, v = p->slot[1][i] * b2;
        if (named) {
            const float k2 = 1.0f - b2;
            m = m + g * (1.0f - b1);
            v = v + (h[LS_LEGACY_ADAM_SCALAR_FIRST] != 0.0f ? (k2 * g) * g : (g * g) * k2);
        }
        p->slot[0][i] = m;
        p->slot[1][i] = v;
        if (h[LS_LEGACY_ADAM_AMSGRAD] != 0.0f) { /* TensorFlow's NaN-propagating Maximum */
            const float vhat = p->slot[2][i];
            v = vhat != vhat ? vhat : ls_optim_max(vhat, v);
            p->slot[2][i] = v;
        }
        const float w = decayed(p->var[i], p->decay, c);
        p->var[i] = w - (h[LS_LEGACY_ADAM_ALPHA] * m) / (sqrtf(v) + h[LS_LEGACY_ADAM_EPSILON]);
        return;
    }
    /* legacy_rmsprop */
    const int momentum = h[LS_LEGACY_RMSPROP_HAS_MOMENTUM] != 0.0f,
              centered = h[LS_LEGACY_RMSPROP_CENTERED] != 0.0f;
    const float rho = h[LS_LEGACY_RMSPROP_RHO], k = h[LS_LEGACY_RMSPROP_C],
                eps = h[LS_LEGACY_RMSPROP_EPSILON];
    float *mg = centered ? p->slot[1 + momentum] : NULL;
    if (!momentum) {
        if (!named) {
            p->slot[0][i] = p->slot[0][i] * rho;
            if (centered)
                mg[i] = mg[i] * rho;
            return;
        }
        const float sq = h[LS_LEGACY_RMSPROP_SCALAR_FIRST] != 0.0f ? (k * g) * g : (g * g) * k;
        const float rms = p->slot[0][i] * rho + sq;
        p->slot[0][i] = rms;
        float d = rms;
        if (centered) {
            mg[i] = mg[i] * rho + g * k;
            d = rms - mg[i] * mg[i];
        }
        p->var[i] = decayed(p->var[i], p->decay, c) - (lr * g) / (sqrtf(d) + eps);
        return;
    }
    if (!named)
        return;
    const float rms = p->slot[0][i] * rho + (g * g) * k;
    p->slot[0][i] = rms;
    float d = rms + eps;
    if (centered) {
        mg[i] = mg[i] * rho + g * k;
        d = d - mg[i] * mg[i];
    }
    const float mom =
        p->slot[1][i] * h[LS_LEGACY_RMSPROP_MOMENTUM] + (ls_tf_rsqrt1(d, col, p->row_length) * lr) * g;
    p->slot[1][i] = mom;
    p->var[i] = decayed(p->var[i], p->decay, c) - mom;
}

/* Keras 3's Adagrad on a sparse gradient, restated from lossscale.h: every
 * weight decayed; per named element, the accumulator plus each slice's
 * square in their order, then the weight minus each slice's
 * (lr * u) / sqrt(accumulator + epsilon) in their order. */
static void adagrad_rows(const ls_param *p, const ls_optim_config *c)
{
    const size_t n = p->row_length;
    const float lr = c->learning_rate, eps = c->hyper[LS_ADAGRAD_EPSILON];
    for (size_t k = 0; k < p->length; k++)
        p->var[k] = decayed(p->var[k], p->decay, c);
    for (size_t s = 0; s < p->slices; s++)
        for (size_t col = 0; col < n; col++) {
            const float u = slice_value(p, s * n + col, c);
            p->slot[0][(size_t)p->indices[s] * n + col] += u * u;
        }
    for (size_t s = 0; s < p->slices; s++)
        for (size_t col = 0; col < n; col++) {
            const size_t i = (size_t)p->indices[s] * n + col;
            const float u = slice_value(p, s * n + col, c);
            p->var[i] -= (lr * u) / sqrtf(p->slot[0][i] + eps);
        }
}

/* Keras 3's RMSprop (no momentum, not centered) on a sparse gradient,
 * restated from lossscale.h: every weight decayed; every velocity
 * rho * v + t, t the densified (1 - rho) * (u * u) of the slices (each
 * row's added in their order onto 0); then the weight minus each slice's
 * (lr * u) / sqrt(v + epsilon) in their order. */
static void rmsprop_rows(const ls_param *p, const ls_optim_config *c)
{
    const size_t n = p->row_length;
    const float lr = c->learning_rate, rho = c->hyper[LS_RMSPROP_RHO],
                rest = c->hyper[LS_RMSPROP_C], eps = c->hyper[LS_RMSPROP_EPSILON];
    float *t = calloc(p->length, sizeof(float));
    if (t == NULL)
        fail("out of memory");
    for (size_t k = 0; k < p->length; k++)
        p->var[k] = decayed(p->var[k], p->decay, c);
    for (size_t s = 0; s < p->slices; s++)
        for (size_t col = 0; col < n; col++) {
            const float u = slice_value(p, s * n + col, c);
            t[(size_t)p->indices[s] * n + col] += rest * (u * u);
        }
    for (size_t k = 0; k < p->length; k++)
        p->slot[0][k] = rho * p->slot[0][k] + t[k];
    for (size_t s = 0; s < p->slices; s++)
        for (size_t col = 0; col < n; col++) {
            const size_t i = (size_t)p->indices[s] * n + col;
            const float u = slice_value(p, s * n + col, c);
            p->var[i] -= (lr * u) / sqrtf(p->slot[0][i] + eps);
        }
    free(t);
}

/* Every sparse gradient's update (`want`, filled as `before`) restated
 * from its form, each variable alone, then held to the scalar set's
 * (`ref`): Keras 3's densified families as the same gradient densified
 * (with its term), Adagrad and RMSprop as their scatters, the legacy families' and
 * accumulate's named rows as their sums densified (SGD, Adagrad, RMSprop
 * without momentum in the kernel's order, accumulate) or their restated
 * sparse form, the others as that form says; the EMA moved after. */
static void check_sparse_forms(arena *want, const arena *ref, const ls_optim_config *c,
                               unsigned flags)
{
    const char *name = ls_optim_family_name(c->family);
    const int global = c->clip == LS_CLIP_GLOBAL;
    const int term = !global && (strcmp(name, "adam") == 0 || strcmp(name, "adamax") == 0 ||
                                 strcmp(name, "lion") == 0);
    const ls_optim_config dc = dense_config(c);
    for (size_t v = 0; v < want->count; v++) {
        ls_param *p = &want->params[v];
        if (p->indices == NULL || p->length == 0)
            continue;
        float *g = malloc(p->length * sizeof(float)), *t = malloc(p->length * sizeof(float));
        unsigned char *named = malloc(p->length / p->row_length);
        if (g == NULL || t == NULL || named == NULL)
            fail("out of memory");
        ls_fpenv env;
        ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
        const size_t n = p->row_length;
        const int added = strcmp(name, "accumulate") == 0;
        const int rows_form = strcmp(name, "adagrad") == 0 || strcmp(name, "rmsprop") == 0;
        if (!legacy_family(c->family) && !rows_form && !added) {
            densify(p, c, c->slice_factor, g, term ? t : NULL, named);
            ls_fpenv_leave(&env);
            dense_run(p, 0, p->length, g, term ? t : NULL, &dc, flags);
        } else {
            const int plain =
                added || strcmp(name, "legacy_sgd") == 0 || strcmp(name, "legacy_adagrad") == 0 ||
                (strcmp(name, "legacy_rmsprop") == 0 &&
                 c->hyper[LS_LEGACY_RMSPROP_HAS_MOMENTUM] == 0.0f &&
                 c->hyper[LS_LEGACY_RMSPROP_SCALAR_FIRST] == 0.0f);
            if (strcmp(name, "adagrad") == 0) {
                adagrad_rows(p, c);
            } else if (strcmp(name, "rmsprop") == 0) {
                rmsprop_rows(p, c);
            } else {
                densify(p, c, 1.0f, g, NULL, named);
                /* each named row's place among them by its first slice */
                const size_t rows = p->length / n;
                size_t *rank = malloc(rows * sizeof(size_t)), ranked = 0;
                if (rank == NULL)
                    fail("out of memory");
                for (size_t row = 0; row < rows; row++)
                    rank[row] = SIZE_MAX;
                for (size_t s = 0; s < p->slices; s++)
                    if (rank[(size_t)p->indices[s]] == SIZE_MAX)
                        rank[(size_t)p->indices[s]] = ranked++;
                /* the rows a dense run covers run below, in its own state */
                for (size_t row = 0; row < rows; row++)
                    for (size_t col = 0; !(plain && named[row]) && col < n; col++)
                        legacy_element(p, row * n + col, g[row * n + col], named[row], col,
                                       named[row] ? rank[row] * n + col : 0, ranked * n, c);
                free(rank);
            }
            if (p->average != NULL)
                for (size_t k = 0; k < p->length; k++)
                    if (!(plain && named[k / n]))
                        p->average[k] = c->ema_momentum * p->average[k] + c->ema_rest * p->var[k];
            ls_fpenv_leave(&env);
            for (size_t row = 0; plain && row < p->length / n; row++)
                if (named[row])
                    dense_run(p, row * n, row * n + n, g, NULL, &dc, flags);
        }
        free(g);
        free(t);
        free(named);
        for (int b = 0; b < AVERAGE + 1; b++) {
            if (b == 1 || b == TERM)
                continue;
            const uint8_t *x = want->blocks[v][b] + PAD, *y = ref->blocks[v][b] + PAD;
            for (size_t k = 0; k + 4 <= want->bytes[v][b]; k += 4) {
                const float u = ls_load_f32(x + k), w = ls_load_f32(y + k);
                if (memcmp(&u, &w, 4) != 0 && !(isnan(u) && isnan(w))) {
                    snprintf(difference, sizeof difference,
                             "variable %zu, buffer %d, element %zu: %a restated, %a run", v, b,
                             k / 4, (double)u, (double)w);
                    fail("a sparse gradient's update differs from its form restated");
                }
            }
        }
    }
}

static unsigned read_csr(void)
{
#ifdef HAVE_MXCSR
    return _mm_getcsr();
#else
    return 0;
#endif
}

/* A host's parallel-for as the fuzzer plays it: the job cut at `cut`, the
 * later part run first; counts its calls. */
typedef struct cut_host {
    size_t cut;
    int calls;
} cut_host;

static int cut_parallel(void *host, ls_range_fn range, const void *ctx, size_t total)
{
    cut_host *h = (cut_host *)host;
    h->calls++;
    const size_t cut = h->cut < total ? h->cut : total;
    const int later = range(ctx, cut, total);
    return ls_combine_status(range(ctx, 0, cut), later);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_input in = {data, size, 0};
    const uint8_t mode = byte_at(&in, 0);
    ls_optim_config c;
    memset(&c, 0, sizeof c);
    c.family = (((mode >> 1) & 7) | (byte_at(&in, 65) >> 7) << 3) % (ls_optim_family_count() + 1);
    c.num_hyper = c.family < ls_optim_family_count() ? ls_optim_hyper_count(c.family) : 0;
    c.unscale = (mode >> 4) & 3;
    read_bytes(&in, 1, &c.scale, 8);
    read_bytes(&in, 9, &c.learning_rate, 4);
    read_bytes(&in, 13, &c.weight_decay, 4);
    for (int f = 0; f < c.num_hyper; f++)
        read_bytes(&in, 17 + 4 * f, &c.hyper[f], 4);
    if (mode & 64)
        c.hyper[0] = 0.0f;
    c.clip = byte_at(&in, 67) % 5;
    read_bytes(&in, 68, &c.clip_value, 4);
    read_bytes(&in, 57, &c.ema_momentum, 4);
    read_bytes(&in, 61, &c.ema_rest, 4);
    uint32_t factor_bits;
    read_bytes(&in, 49, &factor_bits, 4);
    memcpy(&c.slice_factor, &factor_bits, 4);
    if (factor_bits == 0) /* most families' factor, and a short input's */
        c.slice_factor = 1.0f;
    const uint8_t accumulation = byte_at(&in, 53);
    c.accumulation = accumulation & 3;
    c.accumulation_steps =
        byte_at(&in, 54) | byte_at(&in, 55) << 8 | (int)byte_at(&in, 56) << 16;
    const unsigned flags = mode & 1 ? LS_FLUSH_DENORMALS : 0;

    arena layout;
    memset(&layout, 0, sizeof layout);
    layout.count = 1 + (byte_at(&in, 65) & 127) % MAX_VARS;
    size_t at = 72, total = 0;
    for (size_t i = 0; i < layout.count; i++, at += 8) {
        ls_param *p = &layout.params[i];
        const uint8_t form = byte_at(&in, at), decay = byte_at(&in, at + 1);
        p->grad_dtype = (ls_dtype)(form % 4);
        layout.terms[i] = (form >> 2) & 1;
        layout.averages[i] = (form >> 3) & 1;
        layout.sparse[i] = (form >> 4) & 1;
        layout.accumulators[i] = (accumulation >> (2 + i)) & 1;
        p->row_length = 1 + (form >> 5);
        p->slices = (decay >> 2) & 31;
        p->decay = decay % 4;
        p->length = (byte_at(&in, at + 2) | (size_t)byte_at(&in, at + 3) << 8) % 1500;
        read_bytes(&in, at + 4, &p->clip_scalar, 4);
        if (layout.sparse[i] && !(decay & 128))
            p->length -= p->length % p->row_length;
        else if (layout.sparse[i] && p->row_length == 1)
            layout.skew[i] = 4;
        total += p->length;
        const size_t grads = layout.sparse[i] ? p->slices * p->row_length : p->length;
        layout.bytes[i][0] = p->length * 4;
        layout.bytes[i][1] = grads * ls_dtype_size(p->grad_dtype);
        for (int s = 0; s < 3; s++)
            layout.bytes[i][2 + s] = p->length * 4;
        layout.bytes[i][TERM] = layout.terms[i] ? p->length * 4 : 0;
        layout.bytes[i][AVERAGE] = layout.averages[i] ? p->length * 4 : 0;
        layout.bytes[i][INDICES] = layout.sparse[i] ? p->slices * 8 + layout.skew[i] : 0;
        layout.bytes[i][ACCUMULATOR] = layout.accumulators[i] ? p->length * 4 : 0;
    }
    const size_t cut = byte_at(&in, 66) * total / 255;

#ifdef HAVE_MXCSR
    const unsigned caller_csr = (mode & 128) ? (read_csr() | 0x8040u) : (read_csr() & ~0x8040u);
    _mm_setcsr(caller_csr);
#else
    const unsigned caller_csr = read_csr();
#endif
    const unsigned saved_csr = read_csr();
    arena before, ref, got;
    arena_fill(&before, &layout, &in, at);
    arena_fill(&ref, &layout, &in, at);
    const int valid = ls_optim_validate(before.params, before.count, &c) == LS_OK;
    if (valid && !sparse_rules_hold(&before, &c))
        fail("ls_optim_validate took a sparse gradient its rules refuse");
    if (valid && !accumulation_rules_hold(&before, &c))
        fail("ls_optim_validate took accumulators their rules refuse");
    if (!valid && sparse_rules_hold(&before, &c) && accumulation_rules_hold(&before, &c) &&
        valid_as_dense(&before, &c))
        fail("ls_optim_validate refused a sparse gradient or an accumulator its rules take");
    if ((ls_optim_sparse_problem(&c) == NULL) !=
        (ls_optim_config_check(&c, NULL) == LS_OK && sparse_config_ok(&c)))
        fail("ls_optim_sparse_problem disagrees with the rules");
    if (valid) {
        if (ls_optim_run(&ls_optim_scalar, ref.params, ref.count, &c, flags, 0, total) != 1)
            fail("the scalar set refused a valid call");
        check_guards(&ref);
        if (!accumulators_zero(&ref))
            fail("an accumulator is not +0 after the update");
        /* each sparse gradient against its form restated */
        arena_fill(&got, &layout, &in, at);
        check_sparse_forms(&got, &ref, &c, flags);
        arena_free(&got);
        /* every kernel set this CPU runs */
        for (int level = 0; level < ls_simd_count(); level++) {
            const ls_optim_kernels *k = ls_optim_kernels_at(level);
            if (k == NULL || k == &ls_optim_scalar)
                continue;
            arena_fill(&got, &layout, &in, at);
            if (ls_optim_run(k, got.params, got.count, &c, flags, 0, total) != 1)
                fail("a kernel set refused a valid call");
            check_guards(&got);
            if (!same_results(&got, &ref))
                fail("a kernel set differs from the scalar set");
            arena_free(&got);
        }
        /* two ranges make the whole; under a kernel level this CPU lacks
         * (LOSSSCALE_SIMD) each range is refused and changes nothing */
        arena_fill(&got, &layout, &in, at);
        const int r1 = ls_optim_step_range(got.params, got.count, &c, flags, 0, cut);
        const int r2 = ls_optim_step_range(got.params, got.count, &c, flags, cut, total);
        check_guards(&got);
        if (ls_simd_level() >= 0) {
            if (r1 != 1 || r2 != 1)
                fail("ls_optim_step_range refused a valid call");
            if (!same_results(&got, &ref))
                fail("two ranges differ from one whole run");
        } else if (r1 >= 0 || r2 >= 0 || !identical(&got, &before)) {
            fail("ls_optim_step_range ran under a kernel level this CPU lacks");
        }
        arena_free(&got);
    }

    /* the update alone on a host's parallel-for (the cut, later part
     * first): validated before any range runs, then the scalar set's bytes */
    arena_fill(&got, &layout, &in, at);
    cut_host host = {cut, 0};
    const int urc = ls_optim_update_with(got.params, got.count, &c, flags, cut_parallel, &host);
    check_guards(&got);
    if (valid && ls_simd_level() >= 0) {
        if (urc != 1 || host.calls != 1)
            fail("ls_optim_update_with refused a valid call");
        if (!same_results(&got, &ref))
            fail("ls_optim_update_with differs from the scalar set");
    } else if (urc >= 0 || host.calls != 0 || !identical(&got, &before)) {
        fail("ls_optim_update_with ran an invalid call");
    }
    arena_free(&got);

    /* the whole step: check first, then all or nothing */
    arena_fill(&got, &layout, &in, at);
    const int rc = ls_optim_step(got.params, got.count, &c, flags);
    check_guards(&got);
    /* control bits only: the status flags (bits 0-5) are sticky by design */
    if ((read_csr() & ~0x3fu) != (caller_csr & ~0x3fu))
        fail("the caller's floating-point control state was not restored");
    if (rc <= 0) {
        if (rc < 0 && valid && ls_simd_level() >= 0)
            fail("ls_optim_step refused a valid call");
        if (rc == 0 && gradients_finite(&before))
            fail("ls_optim_step skipped a step whose gradients are finite");
        if (!identical(&got, &before))
            fail("a refused or skipped step wrote something");
    } else {
        if (!gradients_finite(&before))
            fail("ls_optim_step applied non-finite gradients");
        if (!valid)
            fail("ls_optim_step took an invalid call");
        if (!same_results(&got, &ref))
            fail("ls_optim_step differs from the scalar set");
    }
    arena_free(&got);
    arena_free(&ref);
    arena_free(&before);
#ifdef HAVE_MXCSR
    _mm_setcsr(saved_csr);
#endif
    return 0;
}
