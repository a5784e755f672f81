/*
 * The contract between the fused optimizer step (optim.c) and its per-ISA
 * kernel files (optim_<set>.c, for the sets of kernel_sets.def), and the
 * one-element reference every one of them follows.
 *
 * A kernel updates elements [lo, hi) of one variable and its slots.  The
 * caller has set the floating-point control state (FTZ/DAZ per
 * LS_FLUSH_DENORMALS) and resolved the configuration into ls_optim_args.
 * Every operation is a plain IEEE float32 operation rounded on its own, in
 * Keras' order (the files are compiled with -ffp-contract=off, and the
 * vector code uses separate multiply and add instructions), so the scalar
 * reference below, numpy op by op, and Keras on TensorFlow all agree bit
 * for bit.
 */
#ifndef LOSSSCALE_OPTIM_H
#define LOSSSCALE_OPTIM_H

#include <math.h>

#include "kernels.h"

/* How a kernel turns a stored gradient into the float32 it applies. */
enum {
    LS_GRAD_AS_IS = 0,      /* widened only */
    LS_GRAD_DIVIDE = 1,     /* widened, then / factor */
    LS_GRAD_MULTIPLY = 2,   /* widened, then * factor (exact reciprocal) */
    LS_GRAD_MUL_ROUNDED = 3 /* widened, * factor, rounded to the gradient's
                               dtype, widened again (TensorFlow 2.4) */
};

/* How a kernel averages an accumulation's sum (ls_param.accumulator). */
enum {
    LS_AVERAGE_DIVIDE = 0,  /* / steps */
    LS_AVERAGE_MULTIPLY = 1 /* * steps (its reciprocal: exact, or TensorFlow's rounded one) */
};

/* The configuration as one kernel call sees it: the unscale, the common
 * scalars, and the family's numbers (family_<name>.h names their places). */
typedef struct ls_optim_args {
    int grad_mode;  /* LS_GRAD_* */
    float factor;   /* divisor or multiplier of the gradient */
    float lr;       /* learning rate */
    float wd;       /* weight decay */
    float wd_lr;    /* wd * lr, rounded to float32 */
    int decay;      /* ls_decay of this variable */
    int clip;       /* ls_clip_mode */
    float clip_value;  /* the config's */
    float clip_scalar; /* this variable's */
    int average;       /* LS_AVERAGE_*: an accumulation's average */
    float steps;       /* its divisor, or multiplier (exact or rounded reciprocal) */
    float h[LS_OPTIM_MAX_HYPER];
} ls_optim_args;

typedef void (*ls_optim_fn)(const ls_param *p, size_t lo, size_t hi, const ls_optim_args *a);

static inline int ls_optim_finite(float x) { return x - x == 0.0f; }

/* ------------------------------------------- the one-element reference */

static inline float ls_optim_load_grad(const void *grad, size_t i, ls_dtype dt)
{
    switch (dt) {
    case LS_FLOAT16:
        return ls_f16_to_f32(ls_load_u16((const uint16_t *)grad + i));
    case LS_BFLOAT16:
        return ls_bf16_to_f32(ls_load_u16((const uint16_t *)grad + i));
    default:
        return ls_load_f32((const float *)grad + i);
    }
}

static inline float ls_optim_unscale1(float g, ls_dtype dt, const ls_optim_args *a)
{
    switch (a->grad_mode) {
    case LS_GRAD_DIVIDE:
        return g / a->factor;
    case LS_GRAD_MULTIPLY:
        return g * a->factor;
    case LS_GRAD_MUL_ROUNDED:
        if (dt == LS_FLOAT16)
            return ls_f16_to_f32(ls_f32_to_f16(g * a->factor));
        if (dt == LS_BFLOAT16)
            return ls_bf16_to_f32(ls_f32_to_bf16(g * a->factor));
        return g * a->factor;
    default:
        return g;
    }
}

/* max(a, b) = (a > b) ? a : b, as x86's MAXPS computes it (the second
 * operand when either is NaN).  On x86 through the instruction itself, as
 * the vector sets and TensorFlow's Maximum use it: with DAZ on, a subnormal
 * operand reads as zero and a subnormal result is flushed, which a compare
 * and select would not do. */
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
static inline float ls_optim_max(float a, float b)
{
    return _mm_cvtss_f32(_mm_max_ss(_mm_set_ss(a), _mm_set_ss(b)));
}
#else
static inline float ls_optim_max(float a, float b) { return a > b ? a : b; }
#endif

/* min(a, b) = (a < b) ? a : b, as MINPS computes it (the second operand
 * when either is NaN), through the instruction on x86 as ls_optim_max. */
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
static inline float ls_optim_min(float a, float b)
{
    return _mm_cvtss_f32(_mm_min_ss(_mm_set_ss(a), _mm_set_ss(b)));
}
#else
static inline float ls_optim_min(float a, float b) { return a < b ? a : b; }
#endif

/* The clip of an unscaled gradient (ls_clip_mode).  clip_by_value's
 * Minimum then Maximum, each with the gradient second, so that a NaN
 * gradient stays NaN as TensorFlow's NaN-propagating ops keep it (the
 * bounds are finite and the results are g or a bound: exact). */
static inline float ls_optim_clip1(float g, const ls_optim_args *a)
{
    switch (a->clip) {
    case LS_CLIP_VALUE:
        return ls_optim_max(-a->clip_value, ls_optim_min(a->clip_value, g));
    case LS_CLIP_NORM:
        return (g * a->clip_value) / a->clip_scalar;
    case LS_CLIP_GLOBAL:
        return g * a->clip_scalar;
    default:
        return g;
    }
}

/* Keras' average on an accumulation's update step, (g + acc) / steps: the
 * unscaled gradient first, as Keras writes it, the sum rounded, then the
 * division (or the product by the reciprocal the graph optimizer makes of
 * it). */
static inline float ls_optim_average1(float g, float acc, const ls_optim_args *a)
{
    const float sum = g + acc;
    return a->average == LS_AVERAGE_DIVIDE ? sum / a->steps : sum * a->steps;
}

/* Element i's gradient as the update applies it: loaded, unscaled,
 * averaged with its accumulator (which is then zeroed: Keras resets it
 * after the update, and nothing else reads it), clipped. */
static inline float ls_optim_grad1(const ls_param *p, size_t i, const ls_optim_args *a)
{
    float g =
        ls_optim_unscale1(ls_optim_load_grad(p->grad, i, p->grad_dtype), p->grad_dtype, a);
    if (p->accumulator != NULL) {
        g = ls_optim_average1(g, p->accumulator[i], a);
        p->accumulator[i] = 0.0f;
    }
    return ls_optim_clip1(g, a);
}

/* TensorFlow's Maximum and Sign on the CPU, as their vector bodies compute
 * them (Eigen's NaN-propagating pmax and its generic psign; TensorFlow's
 * last size % 8 elements go through Eigen's scalar forms, which differ
 * only for a tie of zeros in Maximum and the sign of a NaN in Sign). */
static inline float ls_optim_maximum(float a, float b) { return a != a ? a : ls_optim_max(a, b); }

static inline float ls_optim_sign(float a)
{
    const float m = fabsf(a);
    return 0.0f < m ? copysignf(1.0f, a) : m;
}

/* A sparse gradient's (ls_param.indices) term of one slice value u, by the
 * kind its family takes: none, u * u (Adam), |u| (Adamax), u * k (Lion's
 * u * (1 - beta_2)). */
enum { LS_SLICE_NO_TERM, LS_SLICE_SQUARE, LS_SLICE_ABS, LS_SLICE_SCALED };

static inline float ls_optim_slice_term1(float u, int kind, float k)
{
    return kind == LS_SLICE_SQUARE ? u * u : kind == LS_SLICE_ABS ? fabsf(u) : u * k;
}

/* Element c of a slice stored at `src` in dt: unscaled and clipped by `a`
 * (ls_optim_grad1's arithmetic), times `factor`, added to g[c], its term
 * to t[c] (unless LS_SLICE_NO_TERM). */
static inline void ls_optim_slice_add1(const void *src, size_t c, ls_dtype dt,
                                       const ls_optim_args *a, float factor, int kind, float k,
                                       float *g, float *t)
{
    const float u = ls_optim_clip1(ls_optim_unscale1(ls_optim_load_grad(src, c, dt), dt, a), a);
    g[c] += u * factor;
    if (kind != LS_SLICE_NO_TERM)
        t[c] += ls_optim_slice_term1(u, kind, k);
}

/* ls_optim_slice_add1 over c in [0, n): one slice onto a row's sums. */
typedef void (*ls_slice_fn)(const void *src, size_t n, ls_dtype dt, const ls_optim_args *a,
                            float factor, int kind, float k, float *g, float *t);

/* A variable's decay in a's terms: LS_DECAY_FACTOR is the reassociated
 * form with the weight decay as its whole factor (the kernels know the
 * first two forms only). */
static inline void ls_optim_decay_args(ls_optim_args *a, int decay)
{
    a->decay = decay;
    if (decay == LS_DECAY_FACTOR) {
        a->decay = LS_DECAY_REASSOCIATED;
        a->wd_lr = a->wd;
    }
}

static inline float ls_optim_decay1(float w, const ls_optim_args *a)
{
    if (a->decay == LS_DECAY_OP_BY_OP)
        return w - (w * a->wd) * a->lr;
    if (a->decay == LS_DECAY_REASSOCIATED)
        return w - w * a->wd_lr;
    return w;
}

/* Adam's moments at i (Nadam's and legacy Adam's too), optim_body.h's
 * moments on one element: m = m + (g - m) * c1 and v = v + (gg - v) * c2,
 * stored, and handed back. */
static inline void ls_optim_moments1(const ls_param *p, size_t i, float g, float gg, float c1,
                                     float c2, float *m_out, float *v_out)
{
    const float m = p->slot[0][i] + (g - p->slot[0][i]) * c1;
    const float v = p->slot[1][i] + (gg - p->slot[1][i]) * c2;
    p->slot[0][i] = m;
    p->slot[1][i] = v;
    *m_out = m;
    *v_out = v;
}

/* TensorFlow's CPU Rsqrt (what a tf.function computes for `x / sqrt(y)`:
 * Grappler's arithmetic optimizer turns it into `x * rsqrt(y)`) of element
 * i of a tensor of n, as the x86 wheels' Eigen computes it: packets of
 * LS_TF_RSQRT_PACKET (AVX, no FMA) take RSQRTPS's estimate and one Newton
 * step, `e + (e * -0.5) * ((y * e) * e - 1)`, each product and sum rounded
 * on its own (the estimate where the step gives NaN); the last n % 8
 * elements, `1 / sqrt(y)`.  Off x86 no family accepts the form
 * (ls_optim_rsqrt_problem), and the reference is never asked for it. */
enum { LS_TF_RSQRT_PACKET = 8 };

static inline size_t ls_tf_rsqrt_packets_end(size_t n) { return n - n % LS_TF_RSQRT_PACKET; }

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
static inline const char *ls_optim_rsqrt_problem(float form)
{
    (void)form;
    return NULL;
}

static inline float ls_tf_rsqrt1(float y, size_t i, size_t n)
{
    if (i >= ls_tf_rsqrt_packets_end(n))
        return 1.0f / sqrtf(y);
    const float e = _mm_cvtss_f32(_mm_rsqrt_ss(_mm_set_ss(y)));
    const float r = (e * -0.5f) * ((y * e) * e + -1.0f) + e;
    return r != r ? e : r;
}
#else
static inline const char *ls_optim_rsqrt_problem(float form)
{
    return form == 0.0f ? NULL : "TensorFlow's Rsqrt is reproduced on x86 only";
}

static inline float ls_tf_rsqrt1(float y, size_t i, size_t n)
{
    (void)i, (void)n;
    return 1.0f / sqrtf(y);
}
#endif

/* The slot count of a family that keeps the same slots whatever its numbers. */
#define LS_OPTIM_FIXED_SLOTS(family, n)                                                    \
    static inline int ls_##family##_slots(const float *h)                                  \
    {                                                                                      \
        (void)h;                                                                           \
        return n;                                                                          \
    }

/* A family whose dense update is `base`'s (tf_keras' current optimizers,
 * whose sparse forms alone are their own): `base`'s numbers, slots, check
 * and one-element reference under the family's name. */
#define LS_OPTIM_DENSE_AS(family, base)                                                    \
    enum { ls_##family##_hyper_count = ls_##base##_hyper_count };                          \
    static inline int ls_##family##_slots(const float *h) { return ls_##base##_slots(h); } \
    static inline const char *ls_##family##_problem(const float *h)                        \
    {                                                                                      \
        return ls_##base##_problem(h);                                                     \
    }                                                                                      \
    static inline void ls_##family##1(const ls_param *p, size_t i, float g,                \
                                      const ls_optim_args *a)                              \
    {                                                                                      \
        ls_##base##1(p, i, g, a);                                                          \
    }

/* A family's check of its numbers: `why` when any of the first `n` is not
 * finite, else NULL. */
static inline const char *ls_optim_numbers_problem(const float *h, int n, const char *why)
{
    for (int k = 0; k < n; k++)
        if (!ls_optim_finite(h[k]))
            return why;
    return NULL;
}

#include "optim_families.h"

/* Elements [lo, hi) one at a time, for each family: the scalar set, and
 * the vector sets' tails and rare modes. */
#define LS_OPTIM_ELEMENTS(family)                                                          \
    static inline void ls_##family##_elements(const ls_param *p, size_t lo, size_t hi,     \
                                              const ls_optim_args *a)                      \
    {                                                                                      \
        for (size_t i = lo; i < hi; i++)                                                   \
            ls_##family##1(p, i, ls_optim_grad1(p, i, a), a);                              \
    }
LS_OPTIM_FAMILIES(LS_OPTIM_ELEMENTS)
#undef LS_OPTIM_ELEMENTS

#define LS_OPTIM_ONE(family) +1
enum { LS_OPTIM_NUM_FAMILIES = 0 LS_OPTIM_FAMILIES(LS_OPTIM_ONE) };
#undef LS_OPTIM_ONE

/* A kernel set's fused optimizer kernels: by family id (the order of
 * LS_OPTIM_FAMILIES), then by gradient dtype (float64: NULL); and its
 * ls_slice_fn. */
/* Adafactor's element loops (adafactor.c, adafactor_body.h): how a value
 * is taken (as it is, divided or multiplied by a number), and one span of a
 * step's u. */
enum { LS_ADAFACTOR_AS_IS, LS_ADAFACTOR_DIVIDE, LS_ADAFACTOR_MULTIPLY };

typedef struct ls_adafactor_span {
    const float *grad; /* the span's gradient */
    int how;           /* its unscale, by k */
    float k;
    const float *v;    /* its v, or NULL: f * c, written to v_out (unless NULL) */
    float f;
    const float *c;
    float *v_out;
    float *u;          /* the span's u */
    size_t first;      /* the span's first element in the variable */
    size_t count;
    size_t length;     /* the variable's */
    int rsqrt;         /* g * TensorFlow's Rsqrt(v), else g / sqrt(v) */
} ls_adafactor_span;

/* x as it is, x / k or x * k (an ls_adafactor_how). */
static inline float ls_adafactor_by1(float x, int how, float k)
{
    return how == LS_ADAFACTOR_DIVIDE ? x / k : how == LS_ADAFACTOR_MULTIPLY ? x * k : x;
}

typedef struct ls_adafactor_loops {
    void (*grad)(const float *g, float *out, size_t n, int how, float k, int square, float e1);
    /* the span's u into span->u */
    void (*u)(const ls_adafactor_span *span);
    /* the span's u made, w (the span's elements of the variable) moved by
     * it: w = w - alpha * (u / m), u / m as ls_adafactor_by1(u, how, k) */
    void (*update)(const ls_adafactor_span *span, float *w, float alpha, int how, float k);
    /* the sum of squares of n <= 8,192 values in the order of Eigen's leaf */
    float (*sumsq)(const float *x, size_t n);
} ls_adafactor_loops;

/* Lamb's elementwise pass (lamb.c, lamb_body.h) over elements [0, n) of
 * one variable: lossscale.h's ls_lamb_config arithmetic, `how` and `k` the
 * unscale (ls_adafactor_by1's). */
typedef struct ls_lamb_span {
    const float *grad;
    const float *term;    /* NULL: v's term is x * x */
    float *var;           /* NULL, or decayed in place as `decay` says */
    ls_optim_args decay;  /* its decay's form and numbers (ls_optim_decay1) */
    float *m, *v, *u;
    size_t n;
    int how;
    float k;
    float c1, c2, epsilon, bias_1, bias_2;
} ls_lamb_span;

typedef void (*ls_lamb_fn)(const ls_lamb_span *span);

typedef struct ls_optim_kernels {
    const char *name;
    ls_optim_fn fn[LS_OPTIM_NUM_FAMILIES][LS_NUM_DTYPES];
    ls_slice_fn slice_add; /* a sparse gradient's slices onto its row sums */
    ls_adafactor_loops adafactor;
    ls_lamb_fn lamb;
} ls_optim_kernels;

/* ls_optim_<set> of every set built here (kernel_sets.def's optim column;
 * a table two sets share is declared twice, which C allows). */
#define LS_KERNEL_SET(name, arch, needs, unscale, optim, flags) \
    LS_BUILT_##arch(extern const ls_optim_kernels ls_optim_##optim;, )
#include "kernel_sets.def"
#undef LS_KERNEL_SET

/* The optimizer kernels of a level (dispatch.c's table), NULL when this CPU
 * cannot run it; and a run of `k` over [begin, end) of validated arguments,
 * on the calling thread (the entry points and the fuzz target use it): 1,
 * or LS_ERR_MEMORY with nothing written. */
const ls_optim_kernels *ls_optim_kernels_at(int level);
int ls_optim_run(const ls_optim_kernels *k, const ls_param *params, size_t count,
                 const ls_optim_config *config, unsigned flags, size_t begin, size_t end);

/* Elements [b, e) of a sparse gradient's dense form, into g[0 .. e - b),
 * and its term (the slice term `kind`, LS_SLICE_*) into t unless t is
 * NULL: the gradient holds slices of row_length values in dt, the slices
 * of row r being order[start[r] .. start[r + 1]) (ls_sort_rows); each
 * value unscaled and clipped by `sa`, times `factor`, and a row's slices
 * added in their order onto 0, as UnsortedSegmentSum adds them (a row no
 * slice names is 0).  By k's slice_add, on the calling thread. */
void ls_optim_gather_rows(const ls_optim_kernels *k, const void *grad, ls_dtype dt,
                          size_t row_length, const size_t *start, const size_t *order,
                          size_t b, size_t e, const ls_optim_args *sa, float factor, int kind,
                          float term_k, float *g, float *t);

#endif /* LOSSSCALE_OPTIM_H */
