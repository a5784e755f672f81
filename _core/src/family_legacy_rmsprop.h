/*
 * tf_keras' legacy RMSprop (tf_keras.optimizers.legacy.RMSprop), one fused
 * optimizer family.  With momentum it is TensorFlow's
 * ResourceApplyRMSProp or ResourceApplyCenteredRMSProp (training_ops.cc's
 * Eigen functors: epsilon inside the square root); without, tf_keras'
 * own float32 ops (epsilon outside).  Every number but the two flags is a
 * scalar input, read from the hyperparameter variables at every step.
 *
 *   h[LS_LEGACY_RMSPROP_HAS_MOMENTUM]  1: tf_keras' `_momentum` (a slot)
 *   h[LS_LEGACY_RMSPROP_CENTERED]      1: centered (an mg slot)
 *   h[LS_LEGACY_RMSPROP_SCALAR_FIRST]  a sparse gradient's form (below)
 *   h[LS_LEGACY_RMSPROP_RHO]           rho
 *   h[LS_LEGACY_RMSPROP_C]             1 - rho (float32)
 *   h[LS_LEGACY_RMSPROP_MOMENTUM]      mu
 *   h[LS_LEGACY_RMSPROP_EPSILON]       epsilon
 *   slot[0..2]                         rms, momentum (if any), mg (centered)
 *
 *   momentum:  rms = rms + (g * g - rms) * c
 *              centered: mg = mg + (g - mg) * c;  d = (rms - mg * mg) + epsilon
 *              else:     d = rms + epsilon
 *              mom = mom * mu + (g * lr) / sqrt(d);  w = w - mom
 *   else:      rms = rho * rms + c * (g * g)
 *              centered: mg = rho * mg + c * g;  d = rms - mg * mg
 *              else:     d = rms
 *              w = w - (lr * g) / (sqrt(d) + epsilon)
 *
 * A sparse gradient (ls_legacy_rmsprop_sparse1), its slices summed per
 * row.  With momentum, TensorFlow's ResourceSparseApply(Centered)RMSProp
 * on the rows they name, an arithmetic of its own (Eigen's rsqrt of each
 * row, a packet at a time, ls_tf_rsqrt1 over the row's n elements):
 *
 *              rms = rms * rho + (g * g) * c
 *              centered: mg = mg * rho + g * c;  d = (rms + epsilon) - mg * mg
 *              else:     d = rms + epsilon
 *              mom = mom * mu + (rsqrt(d) * lr) * g;  w = w - mom
 *
 * the other rows as they are.  Without, tf_keras' ops: rms (and mg) times
 * rho everywhere, then the rows named take the rest of the dense step (the
 * products commute: the same arithmetic) but for rms's (g * g) * c, which
 * in a graph the graph optimizer regroups (c * g) * g
 * (h[LS_LEGACY_RMSPROP_SCALAR_FIRST] 1, family_legacy_adam.h's
 * ls_legacy_scaled_square); the others keep their weights.
 */
#ifndef LOSSSCALE_FAMILY_LEGACY_RMSPROP_H
#define LOSSSCALE_FAMILY_LEGACY_RMSPROP_H

enum { LS_LEGACY_RMSPROP_HAS_MOMENTUM, LS_LEGACY_RMSPROP_CENTERED,
       LS_LEGACY_RMSPROP_SCALAR_FIRST, LS_LEGACY_RMSPROP_RHO,
       LS_LEGACY_RMSPROP_C, LS_LEGACY_RMSPROP_MOMENTUM, LS_LEGACY_RMSPROP_EPSILON,
       ls_legacy_rmsprop_hyper_count };

static inline int ls_legacy_rmsprop_slots(const float *h)
{
    return 1 + (h[LS_LEGACY_RMSPROP_HAS_MOMENTUM] != 0.0f) +
           (h[LS_LEGACY_RMSPROP_CENTERED] != 0.0f);
}

static inline const char *ls_legacy_rmsprop_problem(const float *h)
{
    return ls_optim_numbers_problem(h + LS_LEGACY_RMSPROP_RHO, 4,
                                    "rho, 1 - rho, the momentum and epsilon must be finite");
}

static inline void ls_legacy_rmsprop1(const ls_param *p, size_t i, float g,
                                      const ls_optim_args *a)
{
    const float *h = a->h;
    const int has_momentum = h[LS_LEGACY_RMSPROP_HAS_MOMENTUM] != 0.0f,
              centered = h[LS_LEGACY_RMSPROP_CENTERED] != 0.0f;
    const float rho = h[LS_LEGACY_RMSPROP_RHO], c = h[LS_LEGACY_RMSPROP_C],
                eps = h[LS_LEGACY_RMSPROP_EPSILON];
    float *mgs = p->slot[1 + has_momentum];
    float w = ls_optim_decay1(p->var[i], a);
    if (has_momentum) {
        const float rms = p->slot[0][i] + (g * g - p->slot[0][i]) * c;
        p->slot[0][i] = rms;
        float d;
        if (centered) {
            const float mg = mgs[i] + (g - mgs[i]) * c;
            mgs[i] = mg;
            d = (rms - mg * mg) + eps;
        } else {
            d = rms + eps;
        }
        const float mom = p->slot[1][i] * h[LS_LEGACY_RMSPROP_MOMENTUM] + (g * a->lr) / sqrtf(d);
        p->slot[1][i] = mom;
        w = w - mom;
    } else {
        const float rms = rho * p->slot[0][i] + c * (g * g);
        p->slot[0][i] = rms;
        float d = rms;
        if (centered) {
            const float mg = rho * mgs[i] + c * g;
            mgs[i] = mg;
            d = rms - mg * mg;
        }
        w = w - (a->lr * g) / (sqrtf(d) + eps);
    }
    p->var[i] = w;
}

/* ls_legacy_sgd_sparse1's contract. */
static inline void ls_legacy_rmsprop_sparse1(const ls_param *p, size_t i, float g, int indexed,
                                             size_t c, size_t n, size_t at, size_t gathered,
                                             const ls_optim_args *a)
{
    (void)at, (void)gathered;
    const float *h = a->h;
    const int has_momentum = h[LS_LEGACY_RMSPROP_HAS_MOMENTUM] != 0.0f,
              centered = h[LS_LEGACY_RMSPROP_CENTERED] != 0.0f;
    const float rho = h[LS_LEGACY_RMSPROP_RHO], k = h[LS_LEGACY_RMSPROP_C],
                eps = h[LS_LEGACY_RMSPROP_EPSILON];
    float *mgs = p->slot[1 + has_momentum];
    if (!has_momentum) {
        if (indexed) {
            const float rms = p->slot[0][i] * rho +
                              ls_legacy_scaled_square(g, k, h[LS_LEGACY_RMSPROP_SCALAR_FIRST]);
            p->slot[0][i] = rms;
            float d = rms;
            if (centered) {
                const float mg = mgs[i] * rho + g * k;
                mgs[i] = mg;
                d = rms - mg * mg;
            }
            p->var[i] = ls_optim_decay1(p->var[i], a) - (a->lr * g) / (sqrtf(d) + eps);
        } else {
            p->slot[0][i] = p->slot[0][i] * rho;
            if (centered)
                mgs[i] = mgs[i] * rho;
        }
        return;
    }
    if (!indexed)
        return;
    const float rms = p->slot[0][i] * rho + (g * g) * k;
    p->slot[0][i] = rms;
    float d = rms + eps;
    if (centered) {
        const float mg = mgs[i] * rho + g * k;
        mgs[i] = mg;
        d = d - mg * mg;
    }
    const float mom =
        p->slot[1][i] * h[LS_LEGACY_RMSPROP_MOMENTUM] + (ls_tf_rsqrt1(d, c, n) * a->lr) * g;
    p->slot[1][i] = mom;
    p->var[i] = ls_optim_decay1(p->var[i], a) - mom;
}

#endif /* LOSSSCALE_FAMILY_LEGACY_RMSPROP_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(legacy_rmsprop)
{
    const int has_momentum = a->h[LS_LEGACY_RMSPROP_HAS_MOMENTUM] != 0.0f,
              centered = a->h[LS_LEGACY_RMSPROP_CENTERED] != 0.0f;
    const LS_V rho = v_set1(a->h[LS_LEGACY_RMSPROP_RHO]), c1 = v_set1(a->h[LS_LEGACY_RMSPROP_C]),
               mu = v_set1(a->h[LS_LEGACY_RMSPROP_MOMENTUM]),
               eps = v_set1(a->h[LS_LEGACY_RMSPROP_EPSILON]);
    float *const rmss = p->slot[0], *const moms = p->slot[1],
                 *const mgs = p->slot[1 + has_momentum];
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        ls_prefetch_slots(i, rmss, has_momentum, moms, centered, mgs);
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        if (has_momentum) {
            const LS_V r = v_load(rmss + i);
            const LS_V rms = v_add(r, v_mul(v_sub(v_mul(g, g), r), c1));
            v_store(rmss + i, rms);
            LS_V d;
            if (centered) {
                const LS_V m0 = v_load(mgs + i);
                const LS_V mg = v_add(m0, v_mul(v_sub(g, m0), c1));
                v_store(mgs + i, mg);
                d = v_add(v_sub(rms, v_mul(mg, mg)), eps);
            } else {
                d = v_add(rms, eps);
            }
            const LS_V mom = v_add(v_mul(v_load(moms + i), mu), v_div(v_mul(g, c.lr), v_sqrt(d)));
            v_store(moms + i, mom);
            w = v_sub(w, mom);
        } else {
            const LS_V rms = v_add(v_mul(rho, v_load(rmss + i)), v_mul(c1, v_mul(g, g)));
            v_store(rmss + i, rms);
            LS_V d = rms;
            if (centered) {
                const LS_V mg = v_add(v_mul(rho, v_load(mgs + i)), v_mul(c1, g));
                v_store(mgs + i, mg);
                d = v_sub(rms, v_mul(mg, mg));
            }
            w = v_sub(w, v_div(v_mul(c.lr, g), v_add(v_sqrt(d), eps)));
        }
        v_store(c.var + i, w);
    }
    ls_legacy_rmsprop_elements(p, i, hi, a);
}
#endif
