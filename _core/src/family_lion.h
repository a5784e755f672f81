/*
 * Keras' Lion, one fused optimizer family: its numbers, its slots, the
 * one-element reference, and the vector loop over simd.h's vocabulary.
 *
 *   h[LS_LION_BETA_1]  beta_1
 *   h[LS_LION_C1]      1 - beta_1, in float32 (Keras: 1.0 - cast(beta_1))
 *   h[LS_LION_BETA_2]  beta_2
 *   h[LS_LION_C2]      1 - beta_2, in float32
 *   slot[0]            m
 *
 *   w = w - lr * sign(m * beta_1 + g * c1);  m = m * beta_2 + g * c2
 *     (g * c2, or p->grad_term: a sparse gradient's slice * c2 summed per
 *     row; the caller then gives slice * c1 summed per row as g, and 1 as
 *     c1: x * 1 is x)
 * sign is TensorFlow's (ls_optim_sign).
 */
#ifndef LOSSSCALE_FAMILY_LION_H
#define LOSSSCALE_FAMILY_LION_H

enum { LS_LION_BETA_1, LS_LION_C1, LS_LION_BETA_2, LS_LION_C2, ls_lion_hyper_count };

LS_OPTIM_FIXED_SLOTS(lion, 1)

static inline const char *ls_lion_problem(const float *h)
{
    return ls_optim_numbers_problem(h, ls_lion_hyper_count,
                                    "beta_1, beta_2 and 1 - each must be finite");
}

static inline void ls_lion1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float *h = a->h;
    const float w = ls_optim_decay1(p->var[i], a);
    const float m = p->slot[0][i];
    p->var[i] = w - a->lr * ls_optim_sign(m * h[LS_LION_BETA_1] + g * h[LS_LION_C1]);
    p->slot[0][i] = m * h[LS_LION_BETA_2] +
                    (p->grad_term != NULL ? p->grad_term[i] : g * h[LS_LION_C2]);
}

#endif /* LOSSSCALE_FAMILY_LION_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(lion)
{
    const float *h = a->h;
    const LS_V beta_1 = v_set1(h[LS_LION_BETA_1]), c1 = v_set1(h[LS_LION_C1]),
               beta_2 = v_set1(h[LS_LION_BETA_2]), c2 = v_set1(h[LS_LION_C2]);
    float *const ms = p->slot[0];
    const float *const term = p->grad_term;
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        ls_prefetch(ms, i * sizeof(float));
        if (term != NULL)
            ls_prefetch(term, i * sizeof(float));
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        const LS_V m = v_load(ms + i);
        w = v_sub(w, v_mul(c.lr, v_sign(v_add(v_mul(m, beta_1), v_mul(g, c1)))));
        v_store(c.var + i, w);
        v_store(ms + i, v_add(v_mul(m, beta_2), term != NULL ? v_load(term + i) : v_mul(g, c2)));
    }
    ls_lion_elements(p, i, hi, a);
}
#endif
