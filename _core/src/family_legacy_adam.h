/*
 * tf_keras' legacy Adam (tf_keras.optimizers.legacy.Adam), one fused
 * optimizer family: TensorFlow's ResourceApplyAdam, or with amsgrad its
 * ResourceApplyAdamWithAmsgrad (training_ops.cc's Eigen functors).  Every
 * number but the amsgrad flag is a scalar input, computed by the caller
 * with TensorFlow's float32 ops from the hyperparameter variables, as the
 * kernel computes them: 1 - beta_1 and 1 - beta_2 in float32 (not in
 * Python floats, as the current optimizers do), and
 * alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t).
 *
 *   h[LS_LEGACY_ADAM_AMSGRAD]  1: amsgrad (a third slot, vhat)
 *   h[LS_LEGACY_ADAM_C1]       1 - beta_1 (float32)
 *   h[LS_LEGACY_ADAM_C2]       1 - beta_2 (float32)
 *   h[LS_LEGACY_ADAM_EPSILON]  epsilon
 *   h[LS_LEGACY_ADAM_ALPHA]    alpha
 *   slot[0..2]                 m, v, vhat (amsgrad)
 *
 *   m = m + (g - m) * c1;  v = v + (g * g - v) * c2
 *   amsgrad: vhat = vhat.cwiseMax(v), vhat in place of v below
 *   w = w - (m * alpha) / (sqrt(v) + epsilon)
 *
 * Eigen's cwiseMax(vhat, v) is std::max's (vhat unless v > vhat: vhat on
 * a tie of zeros or a NaN), which is MAXPS with v first, ls_optim_max(v,
 * vhat); Keras 3's maximum(v_hat, v) is the other order.
 */
#ifndef LOSSSCALE_FAMILY_LEGACY_ADAM_H
#define LOSSSCALE_FAMILY_LEGACY_ADAM_H

enum { LS_LEGACY_ADAM_AMSGRAD, LS_LEGACY_ADAM_C1, LS_LEGACY_ADAM_C2, LS_LEGACY_ADAM_EPSILON,
       LS_LEGACY_ADAM_ALPHA, ls_legacy_adam_hyper_count };

static inline int ls_legacy_adam_slots(const float *h)
{
    return h[LS_LEGACY_ADAM_AMSGRAD] != 0.0f ? 3 : 2;
}

static inline const char *ls_legacy_adam_problem(const float *h)
{
    return ls_optim_numbers_problem(h + LS_LEGACY_ADAM_C1, 4,
                                    "1 - beta_1, 1 - beta_2, epsilon and alpha must be finite");
}

static inline void ls_legacy_adam1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float w = ls_optim_decay1(p->var[i], a);
    float m, v;
    ls_optim_moments1(p, i, g, g * g, a->h[LS_LEGACY_ADAM_C1], a->h[LS_LEGACY_ADAM_C2], &m, &v);
    if (a->h[LS_LEGACY_ADAM_AMSGRAD] != 0.0f) {
        v = ls_optim_max(v, p->slot[2][i]);
        p->slot[2][i] = v;
    }
    p->var[i] = w - (m * a->h[LS_LEGACY_ADAM_ALPHA]) / (sqrtf(v) + a->h[LS_LEGACY_ADAM_EPSILON]);
}

#endif /* LOSSSCALE_FAMILY_LEGACY_ADAM_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(legacy_adam)
{
    const LS_V c1 = v_set1(a->h[LS_LEGACY_ADAM_C1]), c2 = v_set1(a->h[LS_LEGACY_ADAM_C2]),
               alpha = v_set1(a->h[LS_LEGACY_ADAM_ALPHA]),
               eps = v_set1(a->h[LS_LEGACY_ADAM_EPSILON]);
    float *const ms = p->slot[0], *const vs = p->slot[1], *const vhs = p->slot[2];
    const int amsgrad = a->h[LS_LEGACY_ADAM_AMSGRAD] != 0.0f;
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        ls_prefetch_slots(i, ms, 1, vs, amsgrad, vhs);
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        LS_V m, v;
        LS_FN(moments)(ms, vs, i, g, v_mul(g, g), c1, c2, &m, &v);
        if (amsgrad) {
            v = v_max(v, v_load(vhs + i));
            v_store(vhs + i, v);
        }
        w = v_sub(w, v_div(v_mul(m, alpha), v_add(v_sqrt(v), eps)));
        v_store(c.var + i, w);
    }
    ls_legacy_adam_elements(p, i, hi, a);
}
#endif
