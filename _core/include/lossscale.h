/*
 * lossscale — the native core of dynamic loss scaling.
 *
 * Fused "are all gradients finite?" and "multiply every gradient by
 * inv_scale, round to its dtype, and say whether every result is finite",
 * over contiguous float16 / bfloat16 / float32 / float64 buffers, one pass
 * over memory, SIMD chosen at run time.  Also the loss-scale state machine
 * (TensorFlow 2.4 rule with extensions, and the Keras 3 rule) as plain C.
 *
 * No Python and no TensorFlow here: the numpy bindings and the TensorFlow
 * op both call this header.  All entry points are thread-safe.
 */
#ifndef LOSSSCALE_H
#define LOSSSCALE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ types */

typedef enum ls_dtype {
    LS_FLOAT16 = 0,
    LS_BFLOAT16 = 1,
    LS_FLOAT32 = 2,
    LS_FLOAT64 = 3,
    LS_NUM_DTYPES = 4
} ls_dtype;

/* Bytes per element of `dtype`; 0 for a value that is no ls_dtype. */
static inline size_t ls_dtype_size(ls_dtype dtype)
{
    switch (dtype) {
    case LS_FLOAT16:
    case LS_BFLOAT16:
        return 2;
    case LS_FLOAT32:
        return 4;
    case LS_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

typedef enum ls_status {
    LS_OK = 0,
    LS_ERR_ARG = -1,   /* bad argument (NULL pointer, bad length, bad flag) */
    LS_ERR_DTYPE = -2, /* unknown dtype */
    LS_ERR_SIMD = -3,  /* LOSSSCALE_SIMD names a level this CPU lacks or an unknown one */
    LS_ERR_MEMORY = -4 /* out of memory (a sparse gradient's rows), nothing written */
} ls_status;

/*
 * One contiguous buffer of `length` elements of `dtype`.
 * Unscale reads `src` and writes `dst`; dst == src is allowed (in place),
 * partial overlap is not.  Check-only entry points ignore `dst`.
 */
typedef struct ls_buffer {
    const void *src;
    void *dst;
    size_t length;
    ls_dtype dtype;
} ls_buffer;

/* Flags for the entry points below. */
enum {
    /* Compute as TensorFlow's CPU kernels do: subnormal inputs and results
     * of float32/float64/bfloat16 arithmetic are flushed to zero (FTZ+DAZ).
     * Without it, IEEE arithmetic with subnormals kept (numpy's results). */
    LS_FLUSH_DENORMALS = 1u << 0,
    /* The finite flag describes the inputs rather than the results
     * (x finite but x * inv_scale overflowing then still counts as finite).
     * Keras 3 checks the scaled gradients, before unscaling. */
    LS_CHECK_INPUTS = 1u << 1
};

/* -------------------------------------------------------------- dispatch */

/*
 * Kernel sets ("levels") are the entries of one table in dispatch.c,
 * best first, as _core/src/kernel_sets.def lists them; the last one,
 * "scalar", is the reference and runs everywhere.  A level is an index
 * into the table (ls_simd_count(), ls_simd_name() list it).  Every set gives the same bits as "scalar": every core
 * file is compiled with -ffp-contract=off (_core/kernel_sets.py) and the
 * kernels multiply with plain multiply instructions, so no a*b+c is ever
 * fused into one rounding; each operation must round as numpy's and
 * TensorFlow's do.
 */

/* Number of kernel sets the library knows (built here or not). */
int ls_simd_count(void);
/* Name of the set at `level`; "unknown" when out of range. */
const char *ls_simd_name(int level);
/* 1 when this library has the set at `level` and this CPU can run it. */
int ls_simd_supported(int level);

/*
 * The kernel set in use.  Chosen at first use: the first set in the table
 * this CPU runs, or the one the environment variable LOSSSCALE_SIMD names,
 * which must be one the CPU runs (a later entry: it may only lower).
 * Returns LS_ERR_SIMD (negative) when LOSSSCALE_SIMD cannot be honoured;
 * ls_simd_error() then says why.
 */
int ls_simd_level(void);
/* Best kernel set this CPU supports, ignoring LOSSSCALE_SIMD. */
int ls_simd_best(void);
/* Human-readable reason of the last dispatch failure ("" when none). */
const char *ls_simd_error(void);

/* --------------------------------------------------------------- threads */

/* Threads used by ls_unscale / ls_all_finite for large inputs.
 * n <= 0 restores the default (the machine's online cores). */
void ls_set_num_threads(int n);
int ls_get_num_threads(void);

/* ------------------------------------------------------------ rounding */

/* inv_scale rounded (nearest-even) to `dtype`, returned as a double.
 * This is what every unscale entry point multiplies by. */
double ls_round_to_dtype(double value, ls_dtype dtype);

/* 1 / scale in float32, one rounding; with LS_FLUSH_DENORMALS as
 * TensorFlow's CPU kernels compute it (subnormal input and result
 * flushed), else IEEE. */
float ls_reciprocal_f32(float scale, unsigned flags);

/* 1 when x / scale == x * (1 / scale) for every float32 and float64 x,
 * subnormals kept or flushed alike: scale is a positive power of two whose
 * reciprocal is a normal float32.  Only then may a division by the loss
 * scale run as a multiplication. */
int ls_exact_reciprocal(float scale);

/* -------------------------------------------------------- whole lists */

/*
 * Unscale every buffer: dst[i] = round_to_dtype(src[i] * round_to_dtype(inv_scale)).
 * float16/bfloat16 are widened to float32, multiplied, rounded back
 * to nearest-even.  Returns 1 when every result (or input, with
 * LS_CHECK_INPUTS) is finite, 0 when not, a negative ls_status on error —
 * in which case nothing was written.  Zero-length buffers and count == 0
 * are allowed (finite).  Large lists are split over the library's threads;
 * a call made while another call holds the threads runs on the caller's
 * thread alone (no oversubscription).
 */
int ls_unscale(const ls_buffer *bufs, size_t count, double inv_scale, unsigned flags);

/* 1 when every element of every buffer is finite, 0 when not, < 0 on error. */
int ls_all_finite(const ls_buffer *bufs, size_t count, unsigned flags);

/* --------------------------------------------------- ranges (for hosts
 * with their own thread pool, e.g. TensorFlow's intra-op pool) ---------- */

/* Sum of lengths (elements) of the list. */
size_t ls_total_length(const ls_buffer *bufs, size_t count);

/*
 * The same as ls_unscale / ls_all_finite restricted to elements
 * [begin, end) of the concatenation of the buffers, on the calling thread.
 * Disjoint ranges may run concurrently.  Arguments are validated as in
 * the whole-list calls; with LS_FLUSH_DENORMALS the caller's floating-point
 * control state is set for the call and restored after.
 */
int ls_unscale_range(const ls_buffer *bufs, size_t count, double inv_scale,
                     unsigned flags, size_t begin, size_t end);
int ls_all_finite_range(const ls_buffer *bufs, size_t count, unsigned flags,
                        size_t begin, size_t end);

/* Validate a list without touching it: LS_OK or the error. */
int ls_validate(const ls_buffer *bufs, size_t count);

/* ----------------------------------------- a host's threads (parallel-for)
 *
 * The whole-list entry points split their work through a parallel-for:
 * the library's own threads, or a host's pool (TensorFlow's intra-op
 * threads) passed in as `parallel` and `host`.  Either way the arguments
 * are validated once, by the entry point, before any range runs.
 */

/* Work on elements [begin, end) of a job: 1 or 0 (a finite flag), or a
 * negative ls_status. */
typedef int (*ls_range_fn)(const void *ctx, size_t begin, size_t end);

/* Calls range(ctx, begin, end) over disjoint ranges that cover
 * [0, total), on one thread or several at once, and returns their results
 * combined: the AND of the finite flags, or a negative status (the ranges
 * left may then be skipped).  lossscale_chunks.h plans the ranges as the
 * library's threads cut them. */
typedef int (*ls_parallel_fn)(void *host, ls_range_fn range, const void *ctx, size_t total);

/* ls_unscale and ls_all_finite on `parallel` (NULL: the library's threads). */
int ls_unscale_with(const ls_buffer *bufs, size_t count, double inv_scale, unsigned flags,
                    ls_parallel_fn parallel, void *host);
int ls_all_finite_with(const ls_buffer *bufs, size_t count, unsigned flags,
                       ls_parallel_fn parallel, void *host);

/* ---------------------------------------------------- loss-scale rules */

typedef enum ls_rule {
    /* TensorFlow 2.4 DynamicLossScale, bit-exact in float32:
     *   finite:     if good_steps + 1 >= increment_period:
     *                   new = scale * multiplier (capped at max_loss_scale);
     *                   scale = new if finite; good_steps = 0
     *               else good_steps += 1
     *   non-finite: good_steps = 0; after `hysteresis` consecutive
     *               non-finite steps: scale = max(scale / multiplier,
     *               min_loss_scale) (or scale * backoff_factor when set). */
    LS_RULE_TF24 = 0,
    /* Keras 3 LossScaleOptimizer:
     *   finite:     if counter == growth_steps - 1: scale *= 2, counter = 0
     *               else counter += 1
     *   non-finite: counter = 0; scale /= 2  (no floor) */
    LS_RULE_KERAS3 = 1
} ls_rule;

typedef struct ls_scale_config {
    int rule;                  /* ls_rule */
    int64_t increment_period;  /* growth period, >= 1 */
    float multiplier;          /* > 1; Keras 3 rule: 2 */
    float backoff_factor;      /* 0: divide by multiplier (seed arithmetic);
                                  else multiply by it, 0 < f < 1 */
    float min_loss_scale;      /* floor after back-off; seed: 1 */
    float max_loss_scale;      /* cap on growth; +inf: none */
    int64_t hysteresis;        /* consecutive non-finite steps before back-off; seed: 1 */
} ls_scale_config;

typedef struct ls_scale_state {
    float scale;
    int64_t good_steps;          /* steps since last growth or overflow */
    int64_t overflow_run;        /* consecutive non-finite steps not yet backed off */
    int64_t skipped_steps;       /* total non-finite (skipped) steps */
} ls_scale_state;

/* The defaults of TensorFlow 2.4's DynamicLossScale and of Keras 3's
 * LossScaleOptimizer: the loss scale a dynamic rule starts from, and the
 * finite steps before it grows. */
#define LS_DEFAULT_LOSS_SCALE 32768.0f /* 2^15 */
#define LS_DEFAULT_INCREMENT_PERIOD 2000

/* The seed's defaults for `rule` (multiplier 2, period
 * LS_DEFAULT_INCREMENT_PERIOD, floor 1, no cap, hysteresis 1). */
void ls_scale_config_default(ls_scale_config *config, int rule);

/* LS_OK or LS_ERR_ARG with a short reason in *why (may be NULL). */
int ls_scale_config_check(const ls_scale_config *config, const char **why);

/* Advance the state by one step.  Returns 1 when the gradients should be
 * applied (grads_finite), 0 when the step is skipped, < 0 on a bad config. */
int ls_scale_update(const ls_scale_config *config, ls_scale_state *state,
                    int grads_finite);

/* ------------------------------------------- fused optimizer steps
 *
 * Check, unscale and a Keras optimizer's update of float32 variables in
 * one pass over memory.  Every element is computed with exactly the
 * roundings of Keras 3's op-by-op float32 arithmetic, in its order (each
 * `+ - * / sqrt` rounded on its own, never fused), so the variables and
 * slots come out bit-identical to the stock optimizer's:
 *
 *   g  = unscale(grad)                     (see ls_unscale_mode)
 *   g  = (g + acc) / steps, acc = 0        (with an accumulator: see
 *                                           ls_accumulation_mode)
 *   g  = clip(g)                           (see ls_clip_mode)
 *   w  = var;  decay 1: w = w - (w * weight_decay) * learning_rate
 *              decay 2: w = w - w * (weight_decay * learning_rate)
 *              decay 3: w = w - w * weight_decay
 *   then the family's update of w and its slots.
 *
 * A family is one Keras optimizer's update_step (ls_optim_family names
 * them: "sgd", "adam", ...).  Its numbers (momentum, 1 - beta_1, ...) and
 * the scalars Keras derives from its step counter (Adam's alpha = lr *
 * sqrt(1 - beta_2^t) / (1 - beta_1^t), computed by the caller with the
 * framework's own scalar ops and passed in as they came out) are the
 * config's `hyper`, in the family's order; _core/src/family_<name>.h
 * documents each family's numbers, slots and update. */

/* The most numbers a family takes. */
#define LS_OPTIM_MAX_HYPER 12

/* A family's id by name, or -1; its name by id, or NULL; how many there
 * are; how many numbers a family takes (-1: no such family). */
int ls_optim_family(const char *name);
const char *ls_optim_family_name(int family);
int ls_optim_family_count(void);
int ls_optim_hyper_count(int family);
/* 1 when `family` takes a gradient term (ls_param.grad_term), else 0. */
int ls_optim_takes_term(int family);
/* 1 when `family` takes a sparse gradient (ls_param.indices), else 0. */
int ls_optim_takes_sparse(int family);

/* Keras applies weight decay as `var - var * wd * lr`.  Run op by op (eager)
 * that is (var * wd) * lr; in a tf.function, TensorFlow's graph optimizer
 * (Grappler's arithmetic optimizer, which reorders chains of multiplies to
 * minimise broadcasts) turns it into var * (wd * lr) for any variable of
 * more than one element.  With a learning-rate schedule it goes further and
 * merges the schedule's own products into the chain (var * (pow * (initial
 * * wd)), say): the caller then computes that factor as the graph does and
 * passes it as the weight decay, LS_DECAY_FACTOR.  The caller says which one
 * the stock step computes. */
typedef enum ls_decay {
    LS_DECAY_NONE = 0,
    LS_DECAY_OP_BY_OP = 1,     /* var - (var * wd) * lr */
    LS_DECAY_REASSOCIATED = 2, /* var - var * (wd * lr) */
    LS_DECAY_FACTOR = 3        /* var - var * wd: wd is the whole factor */
} ls_decay;

typedef enum ls_unscale_mode {
    /* The gradients are already unscaled. */
    LS_UNSCALE_NONE = 0,
    /* Keras 3: g = float32(grad) / float32(scale), in float32. */
    LS_UNSCALE_DIVIDE = 1,
    /* TensorFlow 2.4: g = grad * (1 / scale) in the gradient's own dtype
     * (the reciprocal computed in float32 and rounded to that dtype, the
     * product of a float16/bfloat16 gradient rounded back to it), then
     * widened to float32. */
    LS_UNSCALE_MULTIPLY = 2
} ls_unscale_mode;

/* Keras' gradient clipping (clipvalue, clipnorm, global_clipnorm), applied
 * to each unscaled float32 gradient before the update, with the roundings
 * of TensorFlow's ops: */
typedef enum ls_clip_mode {
    LS_CLIP_NONE = 0,
    /* g = max(min(g, clip_value), -clip_value)  (tf.clip_by_value; exact) */
    LS_CLIP_VALUE = 1,
    /* g = (g * clip_value) / clip_scalar  (tf.clip_by_norm: clip_value is
     * clipnorm, the variable's clip_scalar max(l2norm, clipnorm)) */
    LS_CLIP_NORM = 2,
    /* g = g * clip_scalar  (Keras' clip_by_global_norm: every variable's
     * clip_scalar is the step's one factor) */
    LS_CLIP_GLOBAL = 3
} ls_clip_mode;

/* One variable with its gradient and slots.  `var` and the slots are
 * float32 buffers of `length` elements, updated in place; `grad` is
 * float16, bfloat16 or float32 and only read.  The family says which slots
 * a configuration uses, in order (ls_optim_slot_count); unused slots are
 * NULL.  `grad_term`, when not NULL, is a float32 buffer of `length`, only
 * read: what the family takes in place of one function of the gradient
 * (family_<name>.h says which: Adam's g * g, Adamax's |g|, Lion's
 * g * (1 - beta_2)), for a sparse gradient whose slices Keras maps, then
 * sums per row; only the families that ls_optim_takes_term names accept
 * one, and then the gradient is taken as it is (LS_UNSCALE_NONE).
 * `average`, when not NULL, is the variable's exponential moving average
 * (Keras' use_ema), a float32 buffer of `length` moved right after the
 * variable's update: average = ema_momentum * average + ema_rest * var,
 * with the configuration's two numbers (Keras' momentum and 1 - momentum).
 * `accumulator`, when not NULL, is the variable's gradient accumulator
 * (Keras' gradient_accumulation_steps), a float32 buffer of `length`, on
 * the update step that ends an accumulation: the gradient the update takes
 * is the unscaled gradient plus the accumulator, averaged as the
 * configuration's `accumulation` says, then clipped; and the accumulator
 * is set to +0 (Keras zeroes it after the update).  Not with a sparse
 * gradient nor a gradient term.
 * No two buffers may overlap. */
typedef struct ls_param {
    float *var;
    const void *grad;
    float *slot[3];
    size_t length;
    ls_dtype grad_dtype;
    int decay; /* ls_decay: whether and how weight decay applies */
    float clip_scalar; /* LS_CLIP_NORM, LS_CLIP_GLOBAL: this variable's clip
                          number (any value: IEEE arithmetic, as Keras') */
    const float *grad_term;
    float *average;
    /* A sparse gradient (TensorFlow's IndexedSlices), when `indices` is not
     * NULL: `grad` holds `slices` slices of `row_length` elements each,
     * slice k the gradient of row indices[k] of the variable (`length` is
     * rows * row_length, every index in [0, rows), repeats allowed), and
     * the update runs as on the dense gradient Keras' ops make of it: each
     * slice element unscaled (and, but under LS_CLIP_GLOBAL, clipped) as a
     * dense one is, times the configuration's slice_factor, then a row's
     * slices summed in their order onto 0 (TensorFlow's UnsortedSegmentSum:
     * rows no slice names are 0); the term the family takes (see
     * grad_term, which must then be NULL) is summed the same way from the
     * same values.  Under LS_CLIP_GLOBAL the sums are clipped instead, as
     * Keras clips a densified gradient, and the family computes its own
     * term.  Only the families whose update of an element reads that
     * element alone take one (ls_optim_takes_sparse); the sums are made a
     * block at a time, in cache, never as a whole dense gradient.
     * Adagrad takes one as Keras' update scatters it instead: every
     * element's weight decay, then, for each row a slice names, the
     * accumulator plus each slice's squares in their order, then the
     * variable minus each slice's (lr * g) / sqrt(accumulator + epsilon)
     * in their order (a true division: its Rsqrt form is refused, as are
     * LS_CLIP_GLOBAL and a slice_factor other than 1); other rows stay as
     * they are.  RMSprop without momentum, not centered, takes one as
     * Keras' update takes it: every element's weight decay, then every
     * element's velocity rho * v + t, t the sum of its row's slices'
     * (1 - rho) * (g * g) in their order onto 0 (0 for a row no slice
     * names: Keras adds the densified squares), then, for each row a slice
     * names, the variable minus each slice's (lr * g) / sqrt(v + epsilon)
     * in their order (a true division; its Rsqrt form, momentum, centered,
     * LS_CLIP_GLOBAL and a slice_factor other than 1 are refused).  The
     * legacy families (tf_keras.optimizers.legacy) take one
     * as tf_keras hands it to TensorFlow: a row's slices (each unscaled,
     * and clipped by value or not at all) summed in their order onto 0,
     * then the family's sparse form of every element (family_legacy_*.h:
     * TensorFlow's ResourceSparseApply* on the rows named, or tf_keras'
     * own ops, which decay every row's slots), with a slice_factor of 1.
     * The accumulate family (Keras' accumulating step) takes one as Keras
     * adds it, densified, to the accumulator: each named row's slices
     * (each unscaled) summed in their order onto 0, then added to the
     * row; other rows are not read (Keras adds them +0, which leaves
     * every value but -0 and, with LS_FLUSH_DENORMALS, a subnormal; an
     * accumulator that starts at +0 holds neither: no sum onto +0 is -0,
     * and a flushed sum is never subnormal).  Unclipped, with a
     * slice_factor of 1, no weight decay and no average. */
    const int64_t *indices;
    size_t slices;
    size_t row_length;
    float *accumulator;
} ls_param;

/* Keras' average of an accumulation's update step, (g + acc) / steps, each
 * element's unscaled gradient g plus its accumulator (ls_param.accumulator),
 * rounded, then: */
typedef enum ls_accumulation_mode {
    LS_ACCUMULATION_NONE = 0,   /* no accumulator may be given */
    /* divided by float32(steps), as Keras' division runs eagerly */
    LS_ACCUMULATION_DIVIDE = 1,
    /* times float32(1 / steps), the reciprocal rounded once: the division
     * as TensorFlow's graph optimizer rewrites it in a tf.function (its
     * constant folding turns x / c into x * (1 / c)); the same bits as
     * LS_ACCUMULATION_DIVIDE where steps is a power of two */
    LS_ACCUMULATION_MULTIPLY = 2
} ls_accumulation_mode;

typedef struct ls_optim_config {
    int family;             /* ls_optim_family(name) */
    int unscale;            /* ls_unscale_mode */
    double scale;           /* the loss scale: MULTIPLY: finite, > 0; DIVIDE: any
                               (IEEE division, as Keras divides) */
    float learning_rate;    /* finite, >= 0 */
    float weight_decay;     /* for params with decay = 1 or 2; finite */
    int num_hyper;          /* ls_optim_hyper_count(family) */
    float hyper[LS_OPTIM_MAX_HYPER]; /* the family's numbers, in its order */
    int clip;               /* ls_clip_mode */
    float clip_value;       /* LS_CLIP_VALUE, LS_CLIP_NORM: finite, > 0 */
    float ema_momentum;     /* for params with an average: any value (IEEE */
    float ema_rest;         /* arithmetic, as Keras'), rest = 1 - momentum  */
    float slice_factor;     /* for sparse params: each slice value's factor
                               before the row sums (SGD's learning rate, Lion's
                               1 - beta_1; 1 for the others: x * 1 is x); finite */
    int accumulation;       /* ls_accumulation_mode */
    int accumulation_steps; /* >= 1 unless LS_ACCUMULATION_NONE; its float32 value
                               (rounded to nearest above 2^24) divides */
} ls_optim_config;

/* The slots per variable a configuration updates (a family's count may
 * depend on its numbers: SGD keeps no momentum at momentum 0); -1 for an
 * unknown family. */
int ls_optim_slot_count(const ls_optim_config *config);

/* Validate a step without touching anything: LS_OK or the error. */
int ls_optim_validate(const ls_param *params, size_t count, const ls_optim_config *config);

/* The configuration's part of ls_optim_validate: LS_OK, or LS_ERR_ARG with
 * a short reason in *why (may be NULL). */
int ls_optim_config_check(const ls_optim_config *config, const char **why);

/* Why ls_optim_validate refuses every sparse gradient (ls_param.indices)
 * under this configuration (the family takes none, the slice factor, ...),
 * or NULL. */
const char *ls_optim_sparse_problem(const ls_optim_config *config);

/*
 * One optimizer step over the list: first a read-only check that every
 * gradient is finite; when one is not, nothing is written and 0 is
 * returned; else every variable and slot is updated and 1 is returned.
 * < 0: an ls_status, nothing written.  Large lists use the library's
 * threads.  LS_FLUSH_DENORMALS computes as TensorFlow's CPU kernels do.
 */
int ls_optim_step(const ls_param *params, size_t count, const ls_optim_config *config,
                  unsigned flags);

/* The update alone (no check): every variable and slot updated, split
 * over `parallel` (NULL: the library's threads), for hosts that decided
 * the step applies beforehand.  The arguments are validated once, before
 * anything is written.  1 or < 0. */
int ls_optim_update_with(const ls_param *params, size_t count, const ls_optim_config *config,
                         unsigned flags, ls_parallel_fn parallel, void *host);

/* The update alone over elements [begin, end) of the concatenation of the
 * variables, on the calling thread (each call validates the whole step).
 * Disjoint ranges may run concurrently.  1 or < 0. */
int ls_optim_step_range(const ls_param *params, size_t count, const ls_optim_config *config,
                        unsigned flags, size_t begin, size_t end);

/* ------------------------------------------ TensorFlow's sums of squares
 *
 * What Keras' clipnorm and global_clipnorm take of a gradient,
 * reduce_sum(square(u)) with TensorFlow's ops on CPU, u the gradient
 * unscaled: the squares summed in the order of TensorFlow's Sum kernel,
 * Eigen's full reduction on a device of `eigen_threads` threads.  That
 * order is fixed by the element count alone: the values are cut into
 * `threads` equal shards (TensorFlow's cost model picks how many: one
 * below about 258,000 values at two), the rest a last one; each is
 * summed as a tree, halves split on 8-value packets down to leaves of at
 * most 8,192 values; a leaf adds its packets into four accumulators of 8
 * lanes (then one), its last values one by one, and its lanes pairwise;
 * the shards are added to the rest in order.  8 lanes are the AVX packets
 * of TensorFlow's x86 builds (other builds: check against tf.reduce_sum
 * before relying on it).  Each value is computed as TensorFlow's ops do:
 * u = the float32 value, divided by `scale` (LS_UNSCALE_DIVIDE), times
 * ls_reciprocal_f32(scale) (LS_UNSCALE_MULTIPLY) or as it is, then u * u;
 * LS_FLUSH_DENORMALS flushes subnormals as TensorFlow's CPU kernels do.
 */

/* One gradient.  Dense (indices NULL): `length` float32 values.  Sparse:
 * `slices` slices of `row_length` values in `values` (length = slices *
 * row_length), slice k of row indices[k] of a rows x row_length variable;
 * its sum is that of the dense squares Keras' ops.sum(ops.square(slices))
 * makes: each value squared, a row's squares added in their order onto 0
 * (UnsortedSegmentSum), rows no slice names 0, then the rows x row_length
 * values summed as above.  The dense form is never made: a leaf no slice
 * touches adds 0, the others are made one at a time in cache.  (A sum of
 * the slices' own values, as tf.clip_by_norm takes it, is the dense case
 * over `values`.) */
typedef struct ls_norm_param {
    const float *values;
    size_t length;
    const int64_t *indices;
    size_t slices;
    size_t row_length;
    size_t rows;
} ls_norm_param;

/* sums[i]: params[i]'s sum of squares.  LS_OK, or an ls_status with
 * nothing written (LS_ERR_ARG: a NULL buffer, a length that does not
 * match, an index outside [0, rows), eigen_threads < 1, an unknown
 * unscale, a MULTIPLY scale that is not finite and > 0).  The leaves are
 * summed over `parallel` (NULL: the library's threads), then combined in
 * order on the calling thread. */
int ls_squared_norms_with(const ls_norm_param *params, size_t count, int unscale, double scale,
                          int eigen_threads, unsigned flags, float *sums,
                          ls_parallel_fn parallel, void *host);

/* Which index of params[i] is outside [0, rows), for messages: the first
 * bad slice k, or -1 when all are in range. */
long long ls_norm_bad_index(const ls_norm_param *param);

/* ------------------------------------------------------ Keras' Adafactor
 *
 * One step of keras.optimizers.Adafactor's update_step per variable, every
 * number as its TensorFlow ops make it on CPU (float32 variables and
 * gradients):
 *
 *   g     = grad / scale (LS_UNSCALE_DIVIDE) or grad (LS_UNSCALE_NONE)
 *   alpha = max(epsilon_2, rms(var)) * rho          (var before the step)
 *   s     = g * g + epsilon_1
 *   factored (rank >= 2; var [outer, rows, cols], the last two axes):
 *     r = beta * r + rest * mean(s, -1)             r [outer, rows]
 *     c = beta * c + rest * mean(s, -2)             c [outer, cols]
 *     v = (r / mean(r, -1))[..., None] * c[..., None, :]
 *   else: v = beta * v + rest * s
 *   u     = g / sqrt(v), or g * rsqrt(v) with TensorFlow's Rsqrt (`rsqrt`:
 *           what a tf.function computes, Grappler's rewrite)
 *   var   = var - alpha * (u / max(1, rms(u) / clip_threshold))
 *
 * rms(x) = sqrt(mean(square(x))); every mean TensorFlow's Mean kernel, a
 * sum in Eigen's order on a device of `eigen_threads` threads divided by
 * the count (adafactor.c says which order each takes).  rho = min(lr,
 * 1 / sqrt(step)), beta = 1 - step ** beta_2_decay and rest = 1 - beta are
 * the caller's, made as Keras makes them.  LS_FLUSH_DENORMALS computes as
 * TensorFlow's CPU kernels do.
 */
typedef struct ls_adafactor_param {
    float *var;
    const float *grad;
    float *r, *c, *v; /* r and c: a factored variable's (else unused) */
    size_t length;    /* var, grad and v's */
    size_t outer, rows, cols; /* factored: outer * rows * cols = length; rows 0: not */
} ls_adafactor_param;

typedef struct ls_adafactor_config {
    int unscale; /* LS_UNSCALE_NONE or LS_UNSCALE_DIVIDE */
    float scale;
    float rho, beta, rest;
    float epsilon_1, epsilon_2, clip_threshold;
    int rsqrt;
    int eigen_threads;
} ls_adafactor_config;

/* Why the step cannot run as given (a NULL buffer, shapes that do not
 * match, an unknown unscale, eigen_threads < 1), or NULL. */
const char *ls_adafactor_problem(const ls_adafactor_param *params, size_t count,
                                 const ls_adafactor_config *config);

/* Every variable's step (no finite check: the caller decided the step
 * applies), its variables split over `parallel` (NULL: the library's
 * threads), its element loops the kernel set's LOSSSCALE_SIMD names (the
 * same bits at every level).  1; LS_ERR_ARG (ls_adafactor_problem) or
 * LS_ERR_SIMD (a level this CPU lacks) with nothing written; LS_ERR_MEMORY
 * (a variable's scratch), the variables before it may have been stepped. */
int ls_adafactor_update_with(const ls_adafactor_param *params, size_t count,
                             const ls_adafactor_config *config, unsigned flags,
                             ls_parallel_fn parallel, void *host);

/* ------------------------------------------------------------------ Lamb
 *
 * The elementwise part of Keras' Lamb update_step (lamb.c): per element,
 * every number float32 and rounded as TensorFlow's CPU ops round it,
 *
 *   x = g unscaled: as it is, or g / scale (LS_UNSCALE_DIVIDE)
 *   m = m + (x - m) * one_minus_beta_1
 *   v = v + (t - v) * one_minus_beta_2,  t = x * x, or the given term
 *   u = (m / bias_1) / (sqrt(v / bias_2) + epsilon)
 *
 * with m and v written in place and u to its own buffer, which may be the
 * gradient's own (then each element's g is read before its u is written).
 * A variable given a term (a sparse gradient's, as Keras densifies it: g
 * the slices summed per row, the term their squares summed alike) takes g
 * as it is, whatever the unscale.  A variable given with a decay (Keras'
 * weight decay, which its step applies before any update and so before
 * the norms) is decayed in the same pass, w = w - (w * weight_decay) *
 * learning_rate and its other ls_decay forms, and written in place.  A
 * sparse gradient (TensorFlow's IndexedSlices, `indices` not NULL) is
 * taken as Keras' Lamb densifies it, never made whole: `grad` holds
 * `slices` slices of `row_length` float32 values, slice k the gradient of
 * row indices[k] (`length` is rows * row_length, every index in [0,
 * rows), repeats allowed); each slice value is unscaled as a dense
 * gradient is, then g is a row's slices added in their order onto 0
 * (TensorFlow's UnsortedSegmentSum: 0 for a row no slice names) and t
 * their squares added alike (Keras squares the slices, then its
 * subtraction densifies them), a block at a time in cache.  bias_1 and
 * bias_2 are Keras' 1 - beta ** step, made as Keras makes them; the norms
 * of the variable and of u, their ratio and the variable's move by u are
 * the caller's (TensorFlow's reductions, as Keras takes them).
 * LS_FLUSH_DENORMALS computes as TensorFlow's CPU kernels do.
 */
typedef struct ls_lamb_param {
    const float *grad;
    float *m, *v;
    float *u; /* the step's u: grad itself, or a buffer apart from m and v */
    size_t length;
    const float *term; /* NULL, or v's term t for each element (read only) */
    float *var;        /* NULL, or the variable, decayed in place as `decay` says */
    int decay;         /* ls_decay; LS_DECAY_NONE without a variable */
    /* NULL, or a sparse gradient's row of each slice (int64, aligned; then
     * no term, and u a buffer of its own) */
    const int64_t *indices;
    size_t slices, row_length;
    /* NULL, or where the pass writes two sums of squares in the order of
     * TensorFlow's Sum over the whole tensor on the configuration's
     * eigen_threads (ls_eigen_full_sum): [0] the variable's (`var` after
     * its decay, or `weights`), [1] u's, each leaf of a sum taken from
     * cache as the pass makes it */
    float *sums;
    const float *weights; /* the variable, read only, where `var` is NULL */
} ls_lamb_param;

typedef struct ls_lamb_config {
    int unscale; /* LS_UNSCALE_NONE or LS_UNSCALE_DIVIDE */
    float scale;
    float one_minus_beta_1, one_minus_beta_2, epsilon;
    float bias_1, bias_2;
    float weight_decay, learning_rate; /* the decay's numbers: any values (IEEE
                                          arithmetic, as Keras') */
    int eigen_threads; /* >= 1 where a param asks for sums: TensorFlow's threads */
} ls_lamb_config;

/* Why the pass cannot run as given (no configuration, a NULL buffer, m, v
 * and u overlapping each other or the gradient but for u being it, a term
 * overlapping m, v or u, a variable overlapping any buffer, an unknown
 * decay or one without a variable, an unknown unscale; a sparse gradient
 * with a term, not whole rows, an index outside [0, rows) or a buffer
 * overlapping another; sums without eigen_threads or a variable to read,
 * weights overlapping m, v or u, sums overlapping any buffer of their
 * variable's), or NULL. */
const char *ls_lamb_problem(const ls_lamb_param *params, size_t count,
                            const ls_lamb_config *config);

/* The pass over every element of every variable (no finite check: the
 * caller decided the step applies), the elements split over `parallel`
 * (NULL: the library's threads), its loop the kernel set's LOSSSCALE_SIMD
 * names (the same bits at every level).  1; LS_ERR_ARG (ls_lamb_problem,
 * or an unknown flag), LS_ERR_SIMD (a level this CPU lacks) or
 * LS_ERR_MEMORY (a sparse gradient's rows) with nothing written. */
int ls_lamb_moments_with(const ls_lamb_param *params, size_t count,
                         const ls_lamb_config *config, unsigned flags,
                         ls_parallel_fn parallel, void *host);

#ifdef __cplusplus
}
#endif

#endif /* LOSSSCALE_H */
