/*
 * tf_keras' legacy Adagrad (tf_keras.optimizers.legacy.Adagrad), one fused
 * optimizer family: TensorFlow's ResourceApplyAdagradV2 with update_slots
 * (training_ops.cc's Eigen functor: epsilon outside the square root, where
 * the current Adagrad has it inside).
 *
 *   h[LS_LEGACY_ADAGRAD_EPSILON]  epsilon, a scalar input
 *   slot[0]                       accumulator
 *
 *   acc = acc + g * g
 *   w = w - (g * lr) / (sqrt(acc) + epsilon)
 *
 * A sparse gradient (ls_legacy_adagrad_sparse1): its slices summed per
 * row, ResourceSparseApplyAdagradV2's update of the rows they name, the
 * same arithmetic (lr * g first, a product that commutes); the other rows
 * stay as they are.
 */
#ifndef LOSSSCALE_FAMILY_LEGACY_ADAGRAD_H
#define LOSSSCALE_FAMILY_LEGACY_ADAGRAD_H

enum { LS_LEGACY_ADAGRAD_EPSILON, ls_legacy_adagrad_hyper_count };

LS_OPTIM_FIXED_SLOTS(legacy_adagrad, 1)

static inline const char *ls_legacy_adagrad_problem(const float *h)
{
    return ls_optim_numbers_problem(h, 1, "epsilon must be finite");
}

static inline void ls_legacy_adagrad1(const ls_param *p, size_t i, float g,
                                      const ls_optim_args *a)
{
    const float w = ls_optim_decay1(p->var[i], a);
    const float acc = p->slot[0][i] + g * g;
    p->slot[0][i] = acc;
    p->var[i] = w - (g * a->lr) / (sqrtf(acc) + a->h[LS_LEGACY_ADAGRAD_EPSILON]);
}

/* ls_legacy_sgd_sparse1's contract. */
static inline void ls_legacy_adagrad_sparse1(const ls_param *p, size_t i, float g, int indexed,
                                             size_t c, size_t n, size_t at, size_t gathered,
                                             const ls_optim_args *a)
{
    (void)c, (void)n, (void)at, (void)gathered;
    if (indexed)
        ls_legacy_adagrad1(p, i, g, a);
}

#endif /* LOSSSCALE_FAMILY_LEGACY_ADAGRAD_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(legacy_adagrad)
{
    const LS_V eps = v_set1(a->h[LS_LEGACY_ADAGRAD_EPSILON]);
    float *const accs = p->slot[0];
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        ls_prefetch(accs, i * sizeof(float));
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        const LS_V acc = v_add(v_load(accs + i), v_mul(g, g));
        v_store(accs + i, acc);
        w = v_sub(w, v_div(v_mul(g, c.lr), v_add(v_sqrt(acc), eps)));
        v_store(c.var + i, w);
    }
    ls_legacy_adagrad_elements(p, i, hi, a);
}
#endif
