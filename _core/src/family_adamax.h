/*
 * Keras' Adamax, one fused optimizer family: its numbers, its slots, the
 * one-element reference, and the vector loop over simd.h's vocabulary.
 *
 *   h[LS_ADAMAX_C1]       1 - beta_1, as Keras computes it (Python float, then float32)
 *   h[LS_ADAMAX_BETA_2]   beta_2
 *   h[LS_ADAMAX_EPSILON]  epsilon
 *   h[LS_ADAMAX_C1_T]     1 - beta_1^t, the step's scalar, computed by the
 *                         caller with the framework's ops
 *   slot[0..1]            m, u
 *
 *   m = m + (g - m) * c1;  u = maximum(beta_2 * u, |g|)
 *     (|g|, or p->grad_term: a sparse gradient's |slice| summed per row)
 *   w = w - (lr * m) / (c1_t * (u + epsilon))
 * maximum is TensorFlow's (NaN-propagating, ls_optim_maximum).
 */
#ifndef LOSSSCALE_FAMILY_ADAMAX_H
#define LOSSSCALE_FAMILY_ADAMAX_H

enum { LS_ADAMAX_C1, LS_ADAMAX_BETA_2, LS_ADAMAX_EPSILON, LS_ADAMAX_C1_T,
       ls_adamax_hyper_count };

LS_OPTIM_FIXED_SLOTS(adamax, 2)

static inline const char *ls_adamax_problem(const float *h)
{
    return ls_optim_numbers_problem(h, ls_adamax_hyper_count,
                                    "1 - beta_1, beta_2, epsilon and 1 - beta_1^t must be finite");
}

static inline void ls_adamax1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    float w = ls_optim_decay1(p->var[i], a);
    const float m = p->slot[0][i] + (g - p->slot[0][i]) * a->h[LS_ADAMAX_C1];
    const float mag = p->grad_term != NULL ? p->grad_term[i] : fabsf(g);
    const float u = ls_optim_maximum(a->h[LS_ADAMAX_BETA_2] * p->slot[1][i], mag);
    p->slot[0][i] = m;
    p->slot[1][i] = u;
    p->var[i] = w - (a->lr * m) / (a->h[LS_ADAMAX_C1_T] * (u + a->h[LS_ADAMAX_EPSILON]));
}

#endif /* LOSSSCALE_FAMILY_ADAMAX_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(adamax)
{
    const LS_V c1 = v_set1(a->h[LS_ADAMAX_C1]), beta_2 = v_set1(a->h[LS_ADAMAX_BETA_2]),
               eps = v_set1(a->h[LS_ADAMAX_EPSILON]), c1_t = v_set1(a->h[LS_ADAMAX_C1_T]);
    float *const ms = p->slot[0], *const us = p->slot[1];
    const float *const term = p->grad_term;
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        ls_prefetch(ms, i * sizeof(float));
        ls_prefetch(us, i * sizeof(float));
        if (term != NULL)
            ls_prefetch(term, i * sizeof(float));
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        LS_V m = v_load(ms + i);
        m = v_add(m, v_mul(v_sub(g, m), c1));
        const LS_V u = v_maximum(v_mul(beta_2, v_load(us + i)),
                                 term != NULL ? v_load(term + i) : v_abs(g));
        v_store(ms + i, m);
        v_store(us + i, u);
        w = v_sub(w, v_div(v_mul(c.lr, m), v_mul(c1_t, v_add(u, eps))));
        v_store(c.var + i, w);
    }
    ls_adamax_elements(p, i, hi, a);
}
#endif
