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

LS_INLINE LS_V LS_FN(decay)(LS_V w, int decay, LS_V wd, LS_V lr, LS_V wd_lr)
{
    if (decay == LS_DECAY_OP_BY_OP)
        return v_sub(w, v_mul(v_mul(w, wd), lr));
    if (decay == LS_DECAY_REASSOCIATED)
        return v_sub(w, v_mul(w, wd_lr));
    return w;
}

/* The vector loop's reach: none when a rounded 16-bit multiply is asked. */
static inline size_t LS_FN(vector_end)(const ls_param *p, size_t lo, size_t hi,
                                       const ls_optim_args *a)
{
    if (a->grad_mode == LS_GRAD_MUL_ROUNDED && p->grad_dtype != LS_FLOAT32)
        return lo;
    return lo + (hi - lo) / LS_VW * LS_VW;
}

/* What both loops read once: the stores below could alias it as far as C
 * knows, and reloading it would keep the compiler from unswitching the
 * loops. */
typedef struct LS_FN(common) {
    const void *grad;
    float *var;
    size_t gsize;
    int mode, decay;
    LS_V factor, lr, wd, wd_lr;
} LS_FN(common);

LS_INLINE LS_FN(common) LS_FN(common_of)(const ls_param *p, const ls_optim_args *a,
                                         ls_dtype dt)
{
    const LS_FN(common) c = {p->grad, p->var, ls_dtype_size(dt), a->grad_mode, a->decay,
                             v_set1(a->factor), v_set1(a->lr), v_set1(a->wd), v_set1(a->wd_lr)};
    return c;
}

/* The gradient at i and the weight after decay, their streams prefetched. */
LS_INLINE void LS_FN(grad_and_weight)(const LS_FN(common) *c, size_t i, ls_dtype dt, LS_V *g,
                                      LS_V *w)
{
    ls_prefetch(c->grad, i * c->gsize);
    ls_prefetch(c->var, i * sizeof(float));
    *g = LS_FN(grad)(c->grad, i, dt, c->mode, c->factor);
    *w = LS_FN(decay)(v_load(c->var + i), c->decay, c->wd, c->lr, c->wd_lr);
}

LS_INLINE void LS_FN(sgd_run)(const ls_param *p, size_t lo, size_t hi, const ls_optim_args *a,
                              ls_dtype dt)
{
    const LS_FN(common) c = LS_FN(common_of)(p, a, dt);
    const LS_V lr = c.lr, mu = v_set1(a->momentum);
    float *const var = c.var, *const mom = p->slot[0];
    const int use_momentum = a->use_momentum, nesterov = a->nesterov;
    const size_t end = LS_FN(vector_end)(p, lo, hi, a);
    size_t i = lo;
    for (; i < end; i += LS_VW) {
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        if (use_momentum) {
            ls_prefetch(mom, i * sizeof(float));
            LS_V m = v_sub(v_mul(v_load(mom + i), mu), v_mul(g, lr));
            v_store(mom + i, m);
            w = nesterov ? v_add(w, v_sub(v_mul(m, mu), v_mul(g, lr))) : v_add(w, m);
        } else {
            w = v_sub(w, v_mul(g, lr));
        }
        v_store(var + i, w);
    }
    ls_sgd_elements(p, i, hi, a);
}

LS_INLINE void LS_FN(adam_run)(const ls_param *p, size_t lo, size_t hi, const ls_optim_args *a,
                               ls_dtype dt)
{
    const LS_FN(common) c = LS_FN(common_of)(p, a, dt);
    const LS_V c1 = v_set1(a->c1), c2 = v_set1(a->c2), alpha = v_set1(a->alpha),
               eps = v_set1(a->epsilon);
    float *const var = c.var, *const ms = p->slot[0], *const vs = p->slot[1],
                 *const vhs = p->slot[2];
    const int amsgrad = a->amsgrad;
    const size_t end = LS_FN(vector_end)(p, lo, hi, a);
    size_t i = lo;
    for (; i < end; i += LS_VW) {
        ls_prefetch(ms, i * sizeof(float));
        ls_prefetch(vs, i * sizeof(float));
        if (amsgrad)
            ls_prefetch(vhs, i * sizeof(float));
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        LS_V m = v_load(ms + i), v = v_load(vs + i);
        m = v_add(m, v_mul(v_sub(g, m), c1));
        v = v_add(v, v_mul(v_sub(v_mul(g, g), v), c2));
        v_store(ms + i, m);
        v_store(vs + i, v);
        if (amsgrad) {
            v = v_max(v_load(vhs + i), v);
            v_store(vhs + i, v);
        }
        w = v_sub(w, v_div(v_mul(m, alpha), v_add(v_sqrt(v), eps)));
        v_store(var + i, w);
    }
    ls_adam_elements(p, i, hi, a);
}

#define LS_OPTIM_DEFINE(opt, dtname, dt)                                                 \
    static void LS_KFN(opt##_##dtname)(const ls_param *p, size_t lo, size_t hi,          \
                                       const ls_optim_args *a)                           \
    {                                                                                    \
        LS_FN(opt##_run)(p, lo, hi, a, dt);                                              \
    }

LS_OPTIM_DEFINE(sgd, f16, LS_FLOAT16)
LS_OPTIM_DEFINE(sgd, bf16, LS_BFLOAT16)
LS_OPTIM_DEFINE(sgd, f32, LS_FLOAT32)
LS_OPTIM_DEFINE(adam, f16, LS_FLOAT16)
LS_OPTIM_DEFINE(adam, bf16, LS_BFLOAT16)
LS_OPTIM_DEFINE(adam, f32, LS_FLOAT32)

const ls_optim_kernels LS_CAT(ls_optim_, LS_SET) = {
    LS_SET_NAME,
    {LS_KFN(sgd_f16), LS_KFN(sgd_bf16), LS_KFN(sgd_f32), NULL},
    {LS_KFN(adam_f16), LS_KFN(adam_bf16), LS_KFN(adam_f32), NULL},
};
