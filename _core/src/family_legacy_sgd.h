/*
 * tf_keras' legacy SGD (tf_keras.optimizers.legacy.SGD), one fused
 * optimizer family: TensorFlow's ResourceApplyGradientDescent, or with
 * momentum its ResourceApplyKerasMomentum (training_ops.cc's Eigen
 * functors, each product and sum rounded on its own).  The momentum is a
 * scalar input: tf_keras reads it from its hyperparameter variable at
 * every step.
 *
 *   h[LS_LEGACY_SGD_HAS_MOMENTUM]  1: tf_keras' `_momentum` (a slot)
 *   h[LS_LEGACY_SGD_NESTEROV]      1: Nesterov
 *   h[LS_LEGACY_SGD_MOMENTUM]      mu, the step's scalar
 *   slot[0]                        momentum (has_momentum)
 *
 *   no momentum:  w = w - g * lr
 *   momentum:     m = m * mu - g * lr;  w = w + m
 *   Nesterov:     m = m * mu - g * lr;  w = w + (m * mu - g * lr)
 */
#ifndef LOSSSCALE_FAMILY_LEGACY_SGD_H
#define LOSSSCALE_FAMILY_LEGACY_SGD_H

enum { LS_LEGACY_SGD_HAS_MOMENTUM, LS_LEGACY_SGD_NESTEROV, LS_LEGACY_SGD_MOMENTUM,
       ls_legacy_sgd_hyper_count };

static inline int ls_legacy_sgd_slots(const float *h)
{
    return h[LS_LEGACY_SGD_HAS_MOMENTUM] != 0.0f ? 1 : 0;
}

static inline const char *ls_legacy_sgd_problem(const float *h)
{
    return ls_optim_finite(h[LS_LEGACY_SGD_MOMENTUM]) ? NULL : "the momentum must be finite";
}

static inline void ls_legacy_sgd1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float mu = a->h[LS_LEGACY_SGD_MOMENTUM];
    float w = ls_optim_decay1(p->var[i], a);
    if (a->h[LS_LEGACY_SGD_HAS_MOMENTUM] != 0.0f) {
        const float m = p->slot[0][i] * mu - g * a->lr;
        p->slot[0][i] = m;
        w = a->h[LS_LEGACY_SGD_NESTEROV] != 0.0f ? w + (m * mu - g * a->lr) : w + m;
    } else {
        w = w - g * a->lr;
    }
    p->var[i] = w;
}

#endif /* LOSSSCALE_FAMILY_LEGACY_SGD_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(legacy_sgd)
{
    const LS_V lr = c.lr, mu = v_set1(a->h[LS_LEGACY_SGD_MOMENTUM]);
    float *const mom = p->slot[0];
    const int has_momentum = a->h[LS_LEGACY_SGD_HAS_MOMENTUM] != 0.0f,
              nesterov = a->h[LS_LEGACY_SGD_NESTEROV] != 0.0f;
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        if (has_momentum) {
            ls_prefetch(mom, i * sizeof(float));
            const LS_V m = v_sub(v_mul(v_load(mom + i), mu), v_mul(g, lr));
            v_store(mom + i, m);
            w = nesterov ? v_add(w, v_sub(v_mul(m, mu), v_mul(g, lr))) : v_add(w, m);
        } else {
            w = v_sub(w, v_mul(g, lr));
        }
        v_store(c.var + i, w);
    }
    ls_legacy_sgd_elements(p, i, hi, a);
}
#endif
