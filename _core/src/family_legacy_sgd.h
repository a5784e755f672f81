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
 *
 * Keras' SGD's arithmetic, op for op: the reference and the vector loop are
 * family_sgd.h's, given tf_keras' momentum flag in place of mu != 0.
 *
 * A sparse gradient (with momentum; ls_legacy_sgd_sparse1): its slices
 * summed per row, ResourceSparseApplyKerasMomentum's update of the rows
 * they name, the same arithmetic; the other rows stay as they are.
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
    ls_sgd_step1(p, i, g, a, a->h[LS_LEGACY_SGD_MOMENTUM],
                 a->h[LS_LEGACY_SGD_HAS_MOMENTUM] != 0.0f, a->h[LS_LEGACY_SGD_NESTEROV] != 0.0f);
}

/* Element i, column c of a row of n, of a variable whose gradient is
 * sparse: g is its row's summed slices when `indexed`, and `at` the
 * element's place in the named rows gathered (rank * n + c, the rows
 * ranked by their first slice) of `gathered` elements in all. */
static inline void ls_legacy_sgd_sparse1(const ls_param *p, size_t i, float g, int indexed,
                                         size_t c, size_t n, size_t at, size_t gathered,
                                         const ls_optim_args *a)
{
    (void)c, (void)n, (void)at, (void)gathered;
    if (indexed)
        ls_legacy_sgd1(p, i, g, a);
}

#endif /* LOSSSCALE_FAMILY_LEGACY_SGD_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(legacy_sgd)
{
    const size_t i = LS_FN(sgd_vectors)(lo, LS_FN(vector_end)(p, lo, hi, a), dt, c,
                                        a->h[LS_LEGACY_SGD_MOMENTUM],
                                        a->h[LS_LEGACY_SGD_HAS_MOMENTUM] != 0.0f,
                                        a->h[LS_LEGACY_SGD_NESTEROV] != 0.0f, p->slot[0]);
    ls_legacy_sgd_elements(p, i, hi, a);
}
#endif
