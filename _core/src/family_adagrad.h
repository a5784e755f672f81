/*
 * Keras' Adagrad, one fused optimizer family: its numbers, its slot, the
 * one-element reference, and the vector loop over simd.h's vocabulary.
 * (initial_accumulator_value is only the slot's starting value, which
 * Keras sets when it builds.)
 *
 *   h[LS_ADAGRAD_EPSILON]  epsilon
 *   h[LS_ADAGRAD_RSQRT]    1: x / sqrt(y) as x * rsqrt(y), TensorFlow's
 *                          Rsqrt (ls_tf_rsqrt1): in a tf.function,
 *                          Grappler's arithmetic optimizer rewrites it
 *   slot[0]                accumulator
 *
 *   acc = acc + g * g
 *   w = w - (lr * g) / sqrt(acc + epsilon)   (rsqrt: (lr * g) * rsqrt(...))
 */
#ifndef LOSSSCALE_FAMILY_ADAGRAD_H
#define LOSSSCALE_FAMILY_ADAGRAD_H

enum { LS_ADAGRAD_EPSILON, LS_ADAGRAD_RSQRT, ls_adagrad_hyper_count };

LS_OPTIM_FIXED_SLOTS(adagrad, 1)

static inline const char *ls_adagrad_problem(const float *h)
{
    if (!ls_optim_finite(h[LS_ADAGRAD_EPSILON]))
        return "epsilon must be finite";
    return ls_optim_rsqrt_problem(h[LS_ADAGRAD_RSQRT]);
}

static inline void ls_adagrad1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float w = ls_optim_decay1(p->var[i], a);
    const float acc = p->slot[0][i] + g * g;
    p->slot[0][i] = acc;
    const float d = acc + a->h[LS_ADAGRAD_EPSILON];
    p->var[i] = a->h[LS_ADAGRAD_RSQRT] != 0.0f ? w - (a->lr * g) * ls_tf_rsqrt1(d, i, p->length)
                                               : w - (a->lr * g) / sqrtf(d);
}

#endif /* LOSSSCALE_FAMILY_ADAGRAD_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(adagrad)
{
    const LS_V eps = v_set1(a->h[LS_ADAGRAD_EPSILON]);
    const int rsqrt = a->h[LS_ADAGRAD_RSQRT] != 0.0f;
    float *const accs = p->slot[0];
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(rsqrt_vector_end)(p, lo, hi, a, rsqrt)) {
        ls_prefetch(accs, i * sizeof(float));
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        const LS_V acc = v_add(v_load(accs + i), v_mul(g, g));
        v_store(accs + i, acc);
        const LS_V d = v_add(acc, eps);
        w = rsqrt ? v_sub(w, v_mul(v_mul(c.lr, g), LS_FN(tf_rsqrt)(d)))
                  : v_sub(w, v_div(v_mul(c.lr, g), v_sqrt(d)));
        v_store(c.var + i, w);
    }
    ls_adagrad_elements(p, i, hi, a);
}
#endif
