/*
 * Keras' SGD (momentum, Nesterov), one fused optimizer family: its
 * numbers, its slots, the one-element reference, and the vector loop over
 * simd.h's vocabulary (compiled by each kernel set, see optim_body.h).
 *
 *   h[LS_SGD_MOMENTUM]  mu; 0: no momentum slot (Keras keeps none)
 *   h[LS_SGD_NESTEROV]  1: Nesterov
 *   slot[0]             momentum (mu != 0)
 *
 *   no momentum:  w = w - g * lr
 *   momentum:     m = m * mu - g * lr;  w = w + m
 *   Nesterov:     m = m * mu - g * lr;  w = w + (m * mu - g * lr)
 */
#ifndef LOSSSCALE_FAMILY_SGD_H
#define LOSSSCALE_FAMILY_SGD_H

enum { LS_SGD_MOMENTUM, LS_SGD_NESTEROV, ls_sgd_hyper_count };

static inline int ls_sgd_slots(const float *h) { return h[LS_SGD_MOMENTUM] != 0.0f ? 1 : 0; }

static inline const char *ls_sgd_problem(const float *h)
{
    return ls_optim_finite(h[LS_SGD_MOMENTUM]) ? NULL : "the momentum must be finite";
}

static inline void ls_sgd1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float mu = a->h[LS_SGD_MOMENTUM];
    float w = ls_optim_decay1(p->var[i], a);
    if (mu != 0.0f) {
        float m = p->slot[0][i] * mu - g * a->lr;
        p->slot[0][i] = m;
        w = a->h[LS_SGD_NESTEROV] != 0.0f ? w + (m * mu - g * a->lr) : w + m;
    } else {
        w = w - g * a->lr;
    }
    p->var[i] = w;
}

#endif /* LOSSSCALE_FAMILY_SGD_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(sgd)
{
    const LS_V lr = c.lr, mu = v_set1(a->h[LS_SGD_MOMENTUM]);
    float *const mom = p->slot[0];
    const int use_momentum = a->h[LS_SGD_MOMENTUM] != 0.0f,
              nesterov = a->h[LS_SGD_NESTEROV] != 0.0f;
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
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
        v_store(c.var + i, w);
    }
    ls_sgd_elements(p, i, hi, a);
}
#endif
