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
 *   h[LS_LEGACY_ADAM_SCALAR_FIRST]  a sparse gradient's form (below)
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
 *
 * A sparse gradient (ls_legacy_adam_sparse1) takes tf_keras' own ops, not
 * a kernel: m and v decayed everywhere, the slices summed per row added to
 * the rows they name (ResourceScatterAdd), then every weight moved.  Its
 * numbers are others, in the same places: beta_1 and beta_2 themselves
 * (1 - beta is the same float32 subtraction here), and tf_keras'
 * lr * (sqrt(1 - beta_2^t) / (1 - beta_1^t)) as alpha:
 *
 *   m = m * beta_1;  v = v * beta_2
 *   rows named: m = m + g * (1 - beta_1);  v = v + (g * g) * (1 - beta_2)
 *   amsgrad: vhat = maximum(vhat, v), vhat in place of v below
 *   w = w - (alpha * m) / (sqrt(v) + epsilon)
 *
 * In a graph, TensorFlow's graph optimizer regroups the chain (g * g) *
 * (1 - beta_2) scalar first, ((1 - beta_2) * g) * g (its arithmetic
 * optimizer's MinimizeBroadcasts): h[LS_LEGACY_ADAM_SCALAR_FIRST] 1.
 */
#ifndef LOSSSCALE_FAMILY_LEGACY_ADAM_H
#define LOSSSCALE_FAMILY_LEGACY_ADAM_H

enum { LS_LEGACY_ADAM_AMSGRAD, LS_LEGACY_ADAM_SCALAR_FIRST, LS_LEGACY_ADAM_C1, LS_LEGACY_ADAM_C2, LS_LEGACY_ADAM_EPSILON,
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

enum { LS_LEGACY_ADAM_BETA_1 = LS_LEGACY_ADAM_C1, LS_LEGACY_ADAM_BETA_2 = LS_LEGACY_ADAM_C2 };

/* tf_keras' (g * g) * k of a sparse gradient's rows, or, where the graph
 * optimizer regroups it (`scalar_first` 1), (k * g) * g. */
static inline float ls_legacy_scaled_square(float g, float k, float scalar_first)
{
    return scalar_first != 0.0f ? (k * g) * g : (g * g) * k;
}

/* ls_legacy_sgd_sparse1's contract, with the sparse numbers. */
static inline void ls_legacy_adam_sparse1(const ls_param *p, size_t i, float g, int indexed,
                                          size_t c, size_t n, size_t at, size_t gathered,
                                          const ls_optim_args *a)
{
    (void)c, (void)n, (void)at, (void)gathered;
    const float b1 = a->h[LS_LEGACY_ADAM_BETA_1], b2 = a->h[LS_LEGACY_ADAM_BETA_2];
    float m = p->slot[0][i] * b1, v = p->slot[1][i] * b2;
    if (indexed) {
        m = m + g * (1.0f - b1);
        v = v + ls_legacy_scaled_square(g, 1.0f - b2, a->h[LS_LEGACY_ADAM_SCALAR_FIRST]);
    }
    p->slot[0][i] = m;
    p->slot[1][i] = v;
    if (a->h[LS_LEGACY_ADAM_AMSGRAD] != 0.0f) {
        v = ls_optim_maximum(p->slot[2][i], v);
        p->slot[2][i] = v;
    }
    p->var[i] = ls_optim_decay1(p->var[i], a) -
                (a->h[LS_LEGACY_ADAM_ALPHA] * m) / (sqrtf(v) + a->h[LS_LEGACY_ADAM_EPSILON]);
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
