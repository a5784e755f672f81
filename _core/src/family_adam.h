/*
 * Keras' Adam (and AdamW: the same update after the weight decay; amsgrad),
 * one fused optimizer family: its numbers, its slots, the one-element
 * reference, and the vector loop over simd.h's vocabulary.
 *
 *   h[LS_ADAM_C1]       1 - beta_1, as Keras computes it (Python float, then float32)
 *   h[LS_ADAM_C2]       1 - beta_2
 *   h[LS_ADAM_EPSILON]  epsilon
 *   h[LS_ADAM_AMSGRAD]  1: amsgrad (a third slot)
 *   h[LS_ADAM_ALPHA]    lr * sqrt(1 - beta_2^t) / (1 - beta_1^t), the step's
 *                       scalar, computed by the caller with the framework's ops
 *   slot[0..2]          m, v, v_hat (amsgrad)
 *
 *   m = m + (g - m) * c1;  v = v + (gg - v) * c2
 *     (gg: g * g, or p->grad_term: a sparse gradient's squares summed per row)
 *   amsgrad: v_hat = max(v_hat, v), v_hat in place of v below
 *   w = w - (m * alpha) / (sqrt(v) + epsilon)
 */
#ifndef LOSSSCALE_FAMILY_ADAM_H
#define LOSSSCALE_FAMILY_ADAM_H

enum { LS_ADAM_C1, LS_ADAM_C2, LS_ADAM_EPSILON, LS_ADAM_AMSGRAD, LS_ADAM_ALPHA,
       ls_adam_hyper_count };

static inline int ls_adam_slots(const float *h) { return h[LS_ADAM_AMSGRAD] != 0.0f ? 3 : 2; }

static inline const char *ls_adam_problem(const float *h)
{
    if (!ls_optim_finite(h[LS_ADAM_ALPHA]) || !ls_optim_finite(h[LS_ADAM_C1]) ||
        !ls_optim_finite(h[LS_ADAM_C2]) || !ls_optim_finite(h[LS_ADAM_EPSILON]))
        return "alpha, 1 - beta_1, 1 - beta_2 and epsilon must be finite";
    return NULL;
}

static inline void ls_adam1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float w = ls_optim_decay1(p->var[i], a);
    const float gg = p->grad_term != NULL ? p->grad_term[i] : g * g;
    float m, v;
    ls_optim_moments1(p, i, g, gg, a->h[LS_ADAM_C1], a->h[LS_ADAM_C2], &m, &v);
    if (a->h[LS_ADAM_AMSGRAD] != 0.0f) {
        v = ls_optim_max(p->slot[2][i], v);
        p->slot[2][i] = v;
    }
    p->var[i] = w - (m * a->h[LS_ADAM_ALPHA]) / (sqrtf(v) + a->h[LS_ADAM_EPSILON]);
}

#endif /* LOSSSCALE_FAMILY_ADAM_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(adam)
{
    const LS_V c1 = v_set1(a->h[LS_ADAM_C1]), c2 = v_set1(a->h[LS_ADAM_C2]),
               alpha = v_set1(a->h[LS_ADAM_ALPHA]), eps = v_set1(a->h[LS_ADAM_EPSILON]);
    float *const ms = p->slot[0], *const vs = p->slot[1],
                 *const vhs = p->slot[2];
    const float *const sq = p->grad_term;
    const int amsgrad = a->h[LS_ADAM_AMSGRAD] != 0.0f;
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        ls_prefetch_slots(i, ms, 1, vs, amsgrad, vhs);
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        LS_V m, v;
        if (sq != NULL)
            ls_prefetch(sq, i * sizeof(float));
        LS_FN(moments)(ms, vs, i, g, sq != NULL ? v_load(sq + i) : v_mul(g, g), c1, c2, &m, &v);
        if (amsgrad) {
            v = v_max(v_load(vhs + i), v);
            v_store(vhs + i, v);
        }
        w = v_sub(w, v_div(v_mul(m, alpha), v_add(v_sqrt(v), eps)));
        v_store(c.var + i, w);
    }
    ls_adam_elements(p, i, hi, a);
}
#endif
