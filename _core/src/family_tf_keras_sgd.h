/*
 * tf_keras' current SGD (tf_keras.optimizers.SGD), one fused optimizer
 * family for its sparse gradients with Nesterov.  Its dense update is
 * ApplyKerasMomentum's arithmetic (tf_keras keeps the momentum slot even
 * at momentum 0), so the numbers, the dense reference and the vector loop
 * are family_legacy_sgd.h's.
 *
 * A sparse gradient (ls_tf_keras_sgd_sparse1): its apply_gradients sums a
 * row's duplicate slices (_deduplicate_sparse_grad: UnsortedSegmentSum
 * onto 0, in their order), then update_step decays m everywhere, scatters
 * the sums times -lr onto m and, with Nesterov, onto the weight, and moves
 * every weight by m * momentum:
 *
 *   m = m * mu
 *   rows named: d = -g * lr;  m = m + d;  w = w + d
 *   Nesterov:   w = w + m * mu      (plain: w = w + m)
 *
 * Without Nesterov that is the dense update of the densified sums, bit
 * for bit (a row without slices subtracts 0 * lr, which changes no value),
 * and the plan densifies them; with Nesterov a named row's weight rounds
 * (w - g * lr) + m * mu where the dense update rounds w + (m * mu - g * lr),
 * and a row no slice names adds no term (m + 0 would turn a -0 into +0).
 */
#ifndef LOSSSCALE_FAMILY_TF_KERAS_SGD_H
#define LOSSSCALE_FAMILY_TF_KERAS_SGD_H

LS_OPTIM_DENSE_AS(tf_keras_sgd, legacy_sgd)

/* ls_legacy_sgd_sparse1's contract, with family_legacy_sgd.h's numbers. */
static inline void ls_tf_keras_sgd_sparse1(const ls_param *p, size_t i, float g, int indexed,
                                           size_t c, size_t n, size_t at, size_t gathered,
                                           const ls_optim_args *a)
{
    (void)c, (void)n, (void)at, (void)gathered;
    const float mu = a->h[LS_LEGACY_SGD_MOMENTUM];
    float w = ls_optim_decay1(p->var[i], a);
    if (a->h[LS_LEGACY_SGD_HAS_MOMENTUM] == 0.0f) {
        /* no slot: scatter_add of the sums times -lr */
        if (indexed)
            p->var[i] = w + -(g * a->lr);
        else
            p->var[i] = w;
        return;
    }
    float m = p->slot[0][i] * mu;
    if (indexed) {
        const float d = -(g * a->lr);
        m = m + d;
        if (a->h[LS_LEGACY_SGD_NESTEROV] != 0.0f)
            w = w + d;
    }
    p->slot[0][i] = m;
    p->var[i] = a->h[LS_LEGACY_SGD_NESTEROV] != 0.0f ? w + m * mu : w + m;
}

#endif /* LOSSSCALE_FAMILY_TF_KERAS_SGD_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(tf_keras_sgd)
{
    LS_FN(legacy_sgd_run)(p, lo, hi, a, dt, c);
}
#endif
