/*
 * tf_keras' current Adam (tf_keras.optimizers.Adam, and AdamW: the same
 * update after the weight decay; amsgrad), one fused optimizer family for
 * its sparse gradients.  Its dense update is Keras 3's op for op, so the
 * dense reference and vector loop are family_adam.h's, with its numbers in
 * the same places (c1 and c2 as Python computes 1 - beta, then float32).
 *
 * A sparse gradient (ls_tf_keras_adam_sparse1) takes tf_keras' own ops: its
 * apply_gradients sums a row's duplicate slices (_deduplicate_sparse_grad:
 * UnsortedSegmentSum onto 0, in their order), then update_step decays m and
 * v everywhere by assign_add(-m * c1), scatter-adds the sums' terms to the
 * rows they name, and moves every weight as its dense update does:
 *
 *   m = m + -(m * c1);  v = v + -(v * c2)
 *   rows named: m = m + g * c1;  v = v + square(g) * c2
 *   amsgrad: v_hat = maximum(v_hat, v), v_hat in place of v below
 *   w = w - (m * alpha) / (sqrt(v) + epsilon)
 *
 * A row no slice names takes no added term (m + 0 would turn a -0 into +0).
 * TensorFlow's graph optimizer leaves square(g) * c2 as it is (a Square,
 * not a chain of Muls to regroup), so one form serves eagerly and in a graph.
 */
#ifndef LOSSSCALE_FAMILY_TF_KERAS_ADAM_H
#define LOSSSCALE_FAMILY_TF_KERAS_ADAM_H

LS_OPTIM_DENSE_AS(tf_keras_adam, adam)

/* ls_legacy_sgd_sparse1's contract, with family_adam.h's numbers. */
static inline void ls_tf_keras_adam_sparse1(const ls_param *p, size_t i, float g, int indexed,
                                            size_t c, size_t n, size_t at, size_t gathered,
                                            const ls_optim_args *a)
{
    (void)c, (void)n, (void)at, (void)gathered;
    const float c1 = a->h[LS_ADAM_C1], c2 = a->h[LS_ADAM_C2];
    float m = p->slot[0][i], v = p->slot[1][i];
    m = m + -(m * c1);
    v = v + -(v * c2);
    if (indexed) {
        m = m + g * c1;
        v = v + (g * g) * c2;
    }
    p->slot[0][i] = m;
    p->slot[1][i] = v;
    if (a->h[LS_ADAM_AMSGRAD] != 0.0f) {
        v = ls_optim_maximum(p->slot[2][i], v);
        p->slot[2][i] = v;
    }
    p->var[i] = ls_optim_decay1(p->var[i], a) -
                (m * a->h[LS_ADAM_ALPHA]) / (sqrtf(v) + a->h[LS_ADAM_EPSILON]);
}

#endif /* LOSSSCALE_FAMILY_TF_KERAS_ADAM_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(tf_keras_adam)
{
    LS_FN(adam_run)(p, lo, hi, a, dt, c);
}
#endif
