/*
 * tf_keras' current RMSprop (tf_keras.optimizers.RMSprop), one fused
 * optimizer family for its sparse gradients.  Its dense update is Keras 3's
 * RMSprop op for op (with TensorFlow's Rsqrt), so the numbers, the dense
 * reference and the vector loop are family_rmsprop.h's.
 *
 * A sparse gradient (ls_tf_keras_rmsprop_sparse1): its apply_gradients sums
 * a row's duplicate slices (_deduplicate_sparse_grad: Unique, the rows in
 * the order of their first slice, then UnsortedSegmentSum onto 0, in their
 * order), then update_step decays velocity (and average_gradient) on every
 * row, scatter-adds the sums' terms to the rows they name, makes the
 * denominator of every row, gathers the named rows' and moves the named
 * rows by the sums times lr and the Rsqrt of that gathered tensor:
 *
 *   v = rho * v;               rows named: v = v + (g * g) * c
 *   centered: a = rho * a;     rows named: a = a + g * c
 *             d = (v - a * a) + epsilon   (push down: (epsilon - a * a) + v)
 *   else:     d = v + epsilon
 *   rows named: step = (lr * g) * rsqrt(d)   (the other forms as
 *                                             family_rmsprop.h's)
 *   momentum: m = mu * m;  rows named: m = m + step;  w = w + -m
 *   else:     rows named: w = w + -step
 *
 * TensorFlow's Rsqrt rounds an element by where it falls in its tensor
 * (ls_tf_rsqrt1): here the gathered [K, n] one, K the rows named, a row's
 * elements at rank * n + column, its rank the number of named rows whose
 * first slice comes before its own (the order Unique gives them).  A row
 * no slice names takes no added term (v + 0 would turn a -0 into +0) and,
 * without momentum, keeps its weight.
 */
#ifndef LOSSSCALE_FAMILY_TF_KERAS_RMSPROP_H
#define LOSSSCALE_FAMILY_TF_KERAS_RMSPROP_H

LS_OPTIM_DENSE_AS(tf_keras_rmsprop, rmsprop)

/* w + -x as TensorFlow's Neg then add: a NaN x reaches the sum with its
 * sign flipped (a compiler's w - x would keep it). */
static inline float ls_tf_keras_rmsprop_add_negated(float w, float x)
{
    volatile float negated = -x;
    return w + negated;
}

/* ls_legacy_sgd_sparse1's contract, with family_rmsprop.h's numbers. */
static inline void ls_tf_keras_rmsprop_sparse1(const ls_param *p, size_t i, float g,
                                               int indexed, size_t c, size_t n, size_t at,
                                               size_t gathered, const ls_optim_args *a)
{
    (void)c, (void)n;
    const float *h = a->h;
    const int has_momentum = h[LS_RMSPROP_HAS_MOMENTUM] != 0.0f;
    const float rho = h[LS_RMSPROP_RHO], k = h[LS_RMSPROP_C], eps = h[LS_RMSPROP_EPSILON];
    float w = ls_optim_decay1(p->var[i], a);
    float v = rho * p->slot[0][i];
    if (indexed)
        v = v + (g * g) * k;
    p->slot[0][i] = v;
    float d;
    if (h[LS_RMSPROP_CENTERED] != 0.0f) {
        float *avg = p->slot[1 + has_momentum];
        float m = rho * avg[i];
        if (indexed)
            m = m + g * k;
        avg[i] = m;
        d = h[LS_RMSPROP_PUSH_DOWN] != 0.0f ? (eps - m * m) + v : (v - m * m) + eps;
    } else {
        d = v + eps;
    }
    float step = 0.0f;
    if (indexed) {
        const float form = h[LS_RMSPROP_RSQRT];
        if (form == LS_RMSPROP_SQRT) {
            step = (a->lr * g) / sqrtf(d);
        } else {
            const float r = ls_tf_rsqrt1(d, at, gathered);
            step = form == LS_RMSPROP_LR_RSQRT  ? g * (a->lr * r)
                   : form == LS_RMSPROP_G_RSQRT ? a->lr * (g * r)
                                                : (a->lr * g) * r;
        }
    }
    if (has_momentum) {
        float m = h[LS_RMSPROP_MOMENTUM] * p->slot[1][i];
        if (indexed)
            m = m + step;
        p->slot[1][i] = m;
        w = ls_tf_keras_rmsprop_add_negated(w, m);
    } else if (indexed) {
        w = ls_tf_keras_rmsprop_add_negated(w, step);
    }
    p->var[i] = w;
}

#endif /* LOSSSCALE_FAMILY_TF_KERAS_RMSPROP_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(tf_keras_rmsprop)
{
    LS_FN(rmsprop_run)(p, lo, hi, a, dt, c);
}
#endif
