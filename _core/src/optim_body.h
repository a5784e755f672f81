/*
 * The fused optimizer kernels, written once over simd.h's vector
 * vocabulary (float32 vectors: v_load, v_load_f16, v_mul, ...) and
 * compiled by each set's optim_<set>.c, which includes its vocabulary
 * header first.
 *
 * Each vector statement is the one-element reference of optim.h on LS_VW
 * lanes, operation for operation, so the two can be read side by side.
 * Tails, and float16/bfloat16 gradients under TensorFlow 2.4's rounded
 * multiply, run the reference itself.
 */
#include "simd.h"

/* Every stream is prefetched LS_PREFETCH_BYTES ahead: the hardware
 * prefetchers stop at each 4 KiB page, and TensorFlow's buffers are on
 * 4 KiB pages.  Measured on the fused SGD step over ResNet-50-shaped
 * TensorFlow variables (Xeon, 2 threads): 6-8% faster; 1-4 KiB alike.
 * A prefetch is only a hint: one past the end of a buffer reads nothing
 * and cannot fault, and the address is formed as an integer. */
enum { LS_PREFETCH_BYTES = 2048 };

LS_INLINE void ls_prefetch(const void *base, size_t offset)
{
    __builtin_prefetch((const void *)((uintptr_t)base + offset + LS_PREFETCH_BYTES), 0, 3);
}

LS_INLINE LS_V LS_FN(grad)(const void *grad, size_t i, ls_dtype dt, int mode, LS_V factor)
{
    LS_V g;
    if (dt == LS_FLOAT16)
        g = v_load_f16((const uint16_t *)grad + i);
    else if (dt == LS_BFLOAT16)
        g = v_load_bf16((const uint16_t *)grad + i);
    else
        g = v_load((const float *)grad + i);
    if (mode == LS_GRAD_DIVIDE)
        g = v_div(g, factor);
    else if (mode == LS_GRAD_MULTIPLY || mode == LS_GRAD_MUL_ROUNDED) /* float32 only */
        g = v_mul(g, factor);
    return g;
}

/* ls_optim_clip1 on LS_VW lanes. */
LS_INLINE LS_V LS_FN(clip)(LS_V g, int clip, LS_V value, LS_V neg_value, LS_V scalar)
{
    if (clip == LS_CLIP_VALUE)
        return v_max(neg_value, v_min(value, g));
    if (clip == LS_CLIP_NORM)
        return v_div(v_mul(g, value), scalar);
    if (clip == LS_CLIP_GLOBAL)
        return v_mul(g, scalar);
    return g;
}

LS_INLINE LS_V LS_FN(decay)(LS_V w, int decay, LS_V wd, LS_V lr, LS_V wd_lr)
{
    if (decay == LS_DECAY_OP_BY_OP)
        return v_sub(w, v_mul(v_mul(w, wd), lr));
    if (decay == LS_DECAY_REASSOCIATED)
        return v_sub(w, v_mul(w, wd_lr));
    return w;
}

/* ls_tf_rsqrt1 on LS_VW lanes that all lie in TensorFlow's packets
 * (LS_FN(rsqrt_vector_end) keeps the loops there). */
#if LS_V_RSQRT_X86
LS_INLINE LS_V LS_FN(tf_rsqrt)(LS_V y)
{
    const LS_V e = v_rsqrt_estimate(y);
    const LS_V r = v_add(v_mul(v_mul(e, v_set1(-0.5f)),
                               v_add(v_mul(v_mul(y, e), e), v_set1(-1.0f))), e);
    return v_nan_to(r, e);
}
#else
LS_INLINE LS_V LS_FN(tf_rsqrt)(LS_V y) { return v_div(v_set1(1.0f), v_sqrt(y)); }
#endif

/* The vector loop's reach: none when a rounded 16-bit multiply is asked. */
static inline size_t LS_FN(vector_end)(const ls_param *p, size_t lo, size_t hi,
                                       const ls_optim_args *a)
{
    if (a->grad_mode == LS_GRAD_MUL_ROUNDED && p->grad_dtype != LS_FLOAT32)
        return lo;
    return lo + (hi - lo) / LS_VW * LS_VW;
}

/* The reach of a loop that takes TensorFlow's Rsqrt (`rsqrt` set): its
 * vectors stay within the tensor's packets, the rest goes one at a time;
 * none off x86. */
static inline size_t LS_FN(rsqrt_vector_end)(const ls_param *p, size_t lo, size_t hi,
                                             const ls_optim_args *a, int rsqrt)
{
    if (!rsqrt)
        return LS_FN(vector_end)(p, lo, hi, a);
    if (!LS_V_RSQRT_X86)
        return lo;
    size_t limit = ls_tf_rsqrt_packets_end(p->length);
    if (limit > hi)
        limit = hi;
    return LS_FN(vector_end)(p, lo, limit > lo ? limit : lo, a);
}

/* What both loops read once: the stores below could alias it as far as C
 * knows, and reloading it would keep the compiler from unswitching the
 * loops. */
typedef struct LS_FN(common) {
    const void *grad;
    float *var;
    float *acc;
    size_t gsize;
    int mode, decay, clip, average;
    LS_V factor, lr, wd, wd_lr, clip_value, neg_clip_value, clip_scalar, steps;
} LS_FN(common);

LS_INLINE LS_FN(common) LS_FN(common_of)(const ls_param *p, const ls_optim_args *a,
                                         ls_dtype dt)
{
    const LS_FN(common) c = {p->grad,           p->var,
                             p->accumulator,    ls_dtype_size(dt),
                             a->grad_mode,      a->decay,
                             a->clip,           a->average,
                             v_set1(a->factor), v_set1(a->lr),
                             v_set1(a->wd),     v_set1(a->wd_lr),
                             v_set1(a->clip_value), v_set1(-a->clip_value),
                             v_set1(a->clip_scalar), v_set1(a->steps)};
    return c;
}

/* ls_optim_average1 on LS_VW lanes: the accumulator at i added, the sum
 * averaged, the accumulator zeroed. */
LS_INLINE LS_V LS_FN(average)(LS_V g, float *acc, size_t i, int average, LS_V steps)
{
    ls_prefetch(acc, i * sizeof(float));
    const LS_V sum = v_add(g, v_load(acc + i));
    v_store(acc + i, v_set1(0.0f));
    return average == LS_AVERAGE_DIVIDE ? v_div(sum, steps) : v_mul(sum, steps);
}

/* The gradient at i (unscaled, averaged with an accumulator, clipped) and
 * the weight after decay, their streams prefetched. */
LS_INLINE void LS_FN(grad_and_weight)(const LS_FN(common) *c, size_t i, ls_dtype dt, LS_V *g,
                                      LS_V *w)
{
    ls_prefetch(c->grad, i * c->gsize);
    ls_prefetch(c->var, i * sizeof(float));
    LS_V u = LS_FN(grad)(c->grad, i, dt, c->mode, c->factor);
    if (c->acc != NULL)
        u = LS_FN(average)(u, c->acc, i, c->average, c->steps);
    *g = LS_FN(clip)(u, c->clip, c->clip_value, c->neg_clip_value, c->clip_scalar);
    *w = LS_FN(decay)(v_load(c->var + i), c->decay, c->wd, c->lr, c->wd_lr);
}

/* A family's slot streams at i prefetched, in the order of its slots: the
 * first, then the second and the third where the family keeps them. */
LS_INLINE void ls_prefetch_slots(size_t i, const float *first, int second_kept,
                                 const float *second, int third_kept, const float *third)
{
    ls_prefetch(first, i * sizeof(float));
    if (second_kept)
        ls_prefetch(second, i * sizeof(float));
    if (third_kept)
        ls_prefetch(third, i * sizeof(float));
}

/* The families' vector loops (the second include of their headers, now
 * that the vocabulary is defined), then a kernel per family and gradient
 * dtype, and the set's table. */
/* Adam's moments at i (Nadam's too): m = m + (g - m) * c1 and
 * v = v + (gg - v) * c2 (gg: g * g, or a sparse gradient's squares),
 * stored, and handed back. */
LS_INLINE void LS_FN(moments)(float *ms, float *vs, size_t i, LS_V g, LS_V gg, LS_V c1,
                              LS_V c2, LS_V *m_out, LS_V *v_out)
{
    LS_V m = v_load(ms + i), v = v_load(vs + i);
    m = v_add(m, v_mul(v_sub(g, m), c1));
    v = v_add(v, v_mul(v_sub(gg, v), c2));
    v_store(ms + i, m);
    v_store(vs + i, v);
    *m_out = m;
    *v_out = v;
}

/* What a family's vector loop is: the second pass over its header
 * (LS_OPTIM_VECTORS), in which it defines LS_OPTIM_RUN(name), a loop over
 * [lo, hi) given `c`, what every loop reads once (common_of). */
#define LS_OPTIM_VECTORS
/* `i` over [lo, end) a vector at a time, declared before the loop: the tail
 * from `i` to hi runs the family's reference. */
#define LS_OPTIM_VECTOR_LOOP(i, end)                                                       \
    size_t i = lo;                                                                         \
    for (const size_t i##_end = (end); i < i##_end; i += LS_VW)
#define LS_OPTIM_RUN(family)                                                               \
    LS_INLINE void LS_FN(family##_run)(const ls_param *p, size_t lo, size_t hi,            \
                                       const ls_optim_args *a, ls_dtype dt,                \
                                       const LS_FN(common) c)
#include "optim_families.h"

#define LS_OPTIM_DEFINE_DTYPE(family, dtname, dt)                                          \
    static void LS_KFN(family##_##dtname)(const ls_param *p, size_t lo, size_t hi,         \
                                          const ls_optim_args *a)                          \
    {                                                                                      \
        LS_FN(family##_run)(p, lo, hi, a, dt, LS_FN(common_of)(p, a, dt));                 \
    }
#define LS_OPTIM_DEFINE(family)                                                            \
    LS_OPTIM_DEFINE_DTYPE(family, f16, LS_FLOAT16)                                         \
    LS_OPTIM_DEFINE_DTYPE(family, bf16, LS_BFLOAT16)                                       \
    LS_OPTIM_DEFINE_DTYPE(family, f32, LS_FLOAT32)
LS_OPTIM_FAMILIES(LS_OPTIM_DEFINE)

/* ls_optim_slice_add1 on LS_VW lanes; the tail, and float16/bfloat16
 * slices under TensorFlow 2.4's rounded multiply, by the reference. */
static void LS_KFN(slice_add)(const void *src, size_t n, ls_dtype dt, const ls_optim_args *a,
                              float factor, int kind, float k, float *g, float *t)
{
    size_t c = 0;
    if (a->grad_mode != LS_GRAD_MUL_ROUNDED || dt == LS_FLOAT32) {
        const LS_V f = v_set1(a->factor), times = v_set1(factor), kv = v_set1(k),
                   value = v_set1(a->clip_value), neg_value = v_set1(-a->clip_value),
                   scalar = v_set1(a->clip_scalar);
        for (; c + LS_VW <= n; c += LS_VW) {
            const LS_V u = LS_FN(clip)(LS_FN(grad)(src, c, dt, a->grad_mode, f), a->clip, value,
                                       neg_value, scalar);
            v_store(g + c, v_add(v_load(g + c), v_mul(u, times)));
            if (kind == LS_SLICE_NO_TERM)
                continue;
            const LS_V term = kind == LS_SLICE_SQUARE ? v_mul(u, u)
                              : kind == LS_SLICE_ABS  ? v_abs(u)
                                                      : v_mul(u, kv);
            v_store(t + c, v_add(v_load(t + c), term));
        }
    }
    for (; c < n; c++)
        ls_optim_slice_add1(src, c, dt, a, factor, kind, k, g, t);
}

#include "adafactor_body.h"
#include "lamb_body.h"

#define LS_OPTIM_ROW(family) {LS_KFN(family##_f16), LS_KFN(family##_bf16), LS_KFN(family##_f32), NULL},
const ls_optim_kernels LS_CAT(ls_optim_, LS_SET) = {
    LS_SET_NAME,
    {LS_OPTIM_FAMILIES(LS_OPTIM_ROW)},
    LS_KFN(slice_add),
    LS_ADAFACTOR_LOOPS,
    LS_KFN(lamb),
};
