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

/* The update of one element, given the momentum mu and whether to keep
 * one: Keras' SGD decides by mu != 0, legacy SGD (family_legacy_sgd.h) by
 * tf_keras' own flag; the arithmetic is the same. */
static inline void ls_sgd_step1(const ls_param *p, size_t i, float g, const ls_optim_args *a,
                                float mu, int use_momentum, int nesterov)
{
    float w = ls_optim_decay1(p->var[i], a);
    if (use_momentum) {
        const float m = p->slot[0][i] * mu - g * a->lr;
        p->slot[0][i] = m;
        w = nesterov ? w + (m * mu - g * a->lr) : w + m;
    } else {
        w = w - g * a->lr;
    }
    p->var[i] = w;
}

static inline void ls_sgd1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float mu = a->h[LS_SGD_MOMENTUM];
    ls_sgd_step1(p, i, g, a, mu, mu != 0.0f, a->h[LS_SGD_NESTEROV] != 0.0f);
}

#endif /* LOSSSCALE_FAMILY_SGD_H */

#ifdef LS_OPTIM_VECTORS
/* ls_sgd_step1 over [lo, end) a vector at a time (legacy SGD's loop too);
 * returns where the tail starts. */
LS_INLINE size_t LS_FN(sgd_vectors)(size_t lo, size_t end, ls_dtype dt, const LS_FN(common) c,
                                    float mu_, int use_momentum, int nesterov, float *mom)
{
    const LS_V lr = c.lr, mu = v_set1(mu_);
    LS_OPTIM_VECTOR_LOOP(i, end) {
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        if (use_momentum) {
            ls_prefetch(mom, i * sizeof(float));
            const LS_V m = v_sub(v_mul(v_load(mom + i), mu), v_mul(g, lr));
            v_store(mom + i, m);
            w = nesterov ? v_add(w, v_sub(v_mul(m, mu), v_mul(g, lr))) : v_add(w, m);
        } else {
            w = v_sub(w, v_mul(g, lr));
        }
        v_store(c.var + i, w);
    }
    return i;
}

LS_OPTIM_RUN(sgd)
{
    const float mu = a->h[LS_SGD_MOMENTUM];
    const size_t i = LS_FN(sgd_vectors)(lo, LS_FN(vector_end)(p, lo, hi, a), dt, c, mu,
                                        mu != 0.0f, a->h[LS_SGD_NESTEROV] != 0.0f, p->slot[0]);
    ls_sgd_elements(p, i, hi, a);
}
#endif
