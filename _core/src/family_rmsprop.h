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
 *   h[LS_RMSPROP_RSQRT]         the step's form (ls_rmsprop_form): 0
 *                               divides by sqrt(d); the others multiply
 *                               by TensorFlow's Rsqrt (ls_tf_rsqrt1), lr
 *                               and g in the order the stock step leaves
 *                               them: 1 as written (Keras' x / sqrt(y),
 *                               which a tf.function's arithmetic
 *                               optimizer writes x * rsqrt(y); tf_keras'
 *                               lr * g * rsqrt(d) eagerly, or a rank-0
 *                               variable's); 2 and 3 tf_keras' in a
 *                               tf.function, whose arithmetic optimizer
 *                               regroups the chain by size (lr, the
 *                               scalar, first: 2) or, for a one-element
 *                               variable, by the names of its tensors
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
 *   step = (lr * g) / sqrt(d)           (1: (lr * g) * rsqrt(d),
 *                                        2: g * (lr * rsqrt(d)),
 *                                        3: lr * (g * rsqrt(d)))
 *   momentum: m = mu * m + step;  w = w - m
 *   else:     w = w - step
 */
#ifndef LOSSSCALE_FAMILY_RMSPROP_H
#define LOSSSCALE_FAMILY_RMSPROP_H

enum { LS_RMSPROP_RHO, LS_RMSPROP_C, LS_RMSPROP_EPSILON, LS_RMSPROP_MOMENTUM,
       LS_RMSPROP_HAS_MOMENTUM, LS_RMSPROP_CENTERED, LS_RMSPROP_RSQRT, LS_RMSPROP_PUSH_DOWN,
       ls_rmsprop_hyper_count };

/* h[LS_RMSPROP_RSQRT]: the step's form. */
enum ls_rmsprop_form { LS_RMSPROP_SQRT, LS_RMSPROP_LR_G, LS_RMSPROP_LR_RSQRT, LS_RMSPROP_G_RSQRT };

static inline int ls_rmsprop_slots(const float *h)
{
    return 1 + (h[LS_RMSPROP_HAS_MOMENTUM] != 0.0f) + (h[LS_RMSPROP_CENTERED] != 0.0f);
}

static inline const char *ls_rmsprop_problem(const float *h)
{
    if (!ls_optim_finite(h[LS_RMSPROP_RHO]) || !ls_optim_finite(h[LS_RMSPROP_C]) ||
        !ls_optim_finite(h[LS_RMSPROP_EPSILON]) || !ls_optim_finite(h[LS_RMSPROP_MOMENTUM]))
        return "rho, 1 - rho, epsilon and the momentum must be finite";
    const float form = h[LS_RMSPROP_RSQRT];
    if (form != LS_RMSPROP_SQRT && form != LS_RMSPROP_LR_G && form != LS_RMSPROP_LR_RSQRT &&
        form != LS_RMSPROP_G_RSQRT)
        return "RMSprop's step form must be 0, 1, 2 or 3";
    return ls_optim_rsqrt_problem(form);
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
    const float form = h[LS_RMSPROP_RSQRT];
    float step;
    if (form == LS_RMSPROP_SQRT) {
        step = (a->lr * g) / sqrtf(d);
    } else {
        const float r = ls_tf_rsqrt1(d, i, p->length);
        step = form == LS_RMSPROP_LR_RSQRT  ? g * (a->lr * r)
               : form == LS_RMSPROP_G_RSQRT ? a->lr * (g * r)
                                            : (a->lr * g) * r;
    }
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
              rsqrt = a->h[LS_RMSPROP_RSQRT] != LS_RMSPROP_SQRT,
              lr_rsqrt = a->h[LS_RMSPROP_RSQRT] == LS_RMSPROP_LR_RSQRT,
              g_rsqrt = a->h[LS_RMSPROP_RSQRT] == LS_RMSPROP_G_RSQRT,
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
        LS_V step;
        if (rsqrt) {
            const LS_V r = LS_FN(tf_rsqrt)(d);
            step = lr_rsqrt  ? v_mul(g, v_mul(c.lr, r))
                   : g_rsqrt ? v_mul(c.lr, v_mul(g, r))
                             : v_mul(v_mul(c.lr, g), r);
        } else {
            step = v_div(v_mul(c.lr, g), v_sqrt(d));
        }
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
