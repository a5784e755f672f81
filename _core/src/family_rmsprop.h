/*
 * Keras' RMSprop (momentum, centered), one fused optimizer family: its
 * numbers, its slots, the one-element reference, and the vector loop over
 * simd.h's vocabulary.
 *
 *   h[LS_RMSPROP_RHO]           rho (a Python float, then float32)
 *   h[LS_RMSPROP_C]             1 - rho, as Keras computes it (Python float,
 *                               then float32)
 *   h[LS_RMSPROP_EPSILON]       epsilon
 *   h[LS_RMSPROP_MOMENTUM]      mu
 *   h[LS_RMSPROP_HAS_MOMENTUM]  1: Keras' momentum > 0, a momentum slot
 *   h[LS_RMSPROP_CENTERED]      1: centered, an average_gradient slot
 *   h[LS_RMSPROP_RSQRT]         1: x / sqrt(y) as x * rsqrt(y), TensorFlow's
 *                               Rsqrt (ls_tf_rsqrt1): in a tf.function,
 *                               Grappler's arithmetic optimizer rewrites it
 *   h[LS_RMSPROP_PUSH_DOWN]     1: (v - a * a) + epsilon as
 *                               (epsilon - a * a) + v: in a tf.function,
 *                               Grappler's constant folding pushes the
 *                               constant down the sum
 *   slot[0..2]                  velocity, momentum (if any),
 *                               average_gradient (centered)
 *
 *   v = rho * v + c * (g * g)
 *   centered: a = rho * a + c * g;  d = (v - a * a) + epsilon
 *                                       (push down: (epsilon - a * a) + v)
 *   else:     d = v + epsilon
 *   step = (lr * g) / sqrt(d)           (rsqrt: (lr * g) * rsqrt(d))
 *   momentum: m = mu * m + step;  w = w - m
 *   else:     w = w - step
 */
#ifndef LOSSSCALE_FAMILY_RMSPROP_H
#define LOSSSCALE_FAMILY_RMSPROP_H

enum { LS_RMSPROP_RHO, LS_RMSPROP_C, LS_RMSPROP_EPSILON, LS_RMSPROP_MOMENTUM,
       LS_RMSPROP_HAS_MOMENTUM, LS_RMSPROP_CENTERED, LS_RMSPROP_RSQRT, LS_RMSPROP_PUSH_DOWN,
       ls_rmsprop_hyper_count };

static inline int ls_rmsprop_slots(const float *h)
{
    return 1 + (h[LS_RMSPROP_HAS_MOMENTUM] != 0.0f) + (h[LS_RMSPROP_CENTERED] != 0.0f);
}

static inline const char *ls_rmsprop_problem(const float *h)
{
    if (!ls_optim_finite(h[LS_RMSPROP_RHO]) || !ls_optim_finite(h[LS_RMSPROP_C]) ||
        !ls_optim_finite(h[LS_RMSPROP_EPSILON]) || !ls_optim_finite(h[LS_RMSPROP_MOMENTUM]))
        return "rho, 1 - rho, epsilon and the momentum must be finite";
    return ls_optim_rsqrt_problem(h[LS_RMSPROP_RSQRT]);
}

static inline void ls_rmsprop1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float *h = a->h;
    const int has_momentum = h[LS_RMSPROP_HAS_MOMENTUM] != 0.0f;
    float w = ls_optim_decay1(p->var[i], a);
    const float v = h[LS_RMSPROP_RHO] * p->slot[0][i] + h[LS_RMSPROP_C] * (g * g);
    p->slot[0][i] = v;
    float d;
    if (h[LS_RMSPROP_CENTERED] != 0.0f) {
        float *avg = p->slot[1 + has_momentum];
        const float m = h[LS_RMSPROP_RHO] * avg[i] + h[LS_RMSPROP_C] * g;
        avg[i] = m;
        d = h[LS_RMSPROP_PUSH_DOWN] != 0.0f ? (h[LS_RMSPROP_EPSILON] - m * m) + v
                                            : (v - m * m) + h[LS_RMSPROP_EPSILON];
    } else {
        d = v + h[LS_RMSPROP_EPSILON];
    }
    const float step = h[LS_RMSPROP_RSQRT] != 0.0f ? (a->lr * g) * ls_tf_rsqrt1(d, i, p->length)
                                                   : (a->lr * g) / sqrtf(d);
    if (has_momentum) {
        const float m = h[LS_RMSPROP_MOMENTUM] * p->slot[1][i] + step;
        p->slot[1][i] = m;
        w = w - m;
    } else {
        w = w - step;
    }
    p->var[i] = w;
}

#endif /* LOSSSCALE_FAMILY_RMSPROP_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(rmsprop)
{
    const LS_V rho = v_set1(a->h[LS_RMSPROP_RHO]), c1 = v_set1(a->h[LS_RMSPROP_C]),
               eps = v_set1(a->h[LS_RMSPROP_EPSILON]), mu = v_set1(a->h[LS_RMSPROP_MOMENTUM]);
    const int has_momentum = a->h[LS_RMSPROP_HAS_MOMENTUM] != 0.0f,
              centered = a->h[LS_RMSPROP_CENTERED] != 0.0f,
              rsqrt = a->h[LS_RMSPROP_RSQRT] != 0.0f,
              push_down = a->h[LS_RMSPROP_PUSH_DOWN] != 0.0f;
    float *const vs = p->slot[0], *const ms = p->slot[1],
                 *const avgs = p->slot[1 + has_momentum];
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(rsqrt_vector_end)(p, lo, hi, a, rsqrt)) {
        ls_prefetch_slots(i, vs, has_momentum, ms, centered, avgs);
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        const LS_V v = v_add(v_mul(rho, v_load(vs + i)), v_mul(c1, v_mul(g, g)));
        v_store(vs + i, v);
        LS_V d;
        if (centered) {
            const LS_V m = v_add(v_mul(rho, v_load(avgs + i)), v_mul(c1, g));
            v_store(avgs + i, m);
            d = push_down ? v_add(v_sub(eps, v_mul(m, m)), v)
                          : v_add(v_sub(v, v_mul(m, m)), eps);
        } else {
            d = v_add(v, eps);
        }
        const LS_V step = rsqrt ? v_mul(v_mul(c.lr, g), LS_FN(tf_rsqrt)(d))
                                : v_div(v_mul(c.lr, g), v_sqrt(d));
        if (has_momentum) {
            const LS_V m = v_add(v_mul(mu, v_load(ms + i)), step);
            v_store(ms + i, m);
            w = v_sub(w, m);
        } else {
            w = v_sub(w, step);
        }
        v_store(c.var + i, w);
    }
    ls_rmsprop_elements(p, i, hi, a);
}
#endif
