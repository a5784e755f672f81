/*
 * Keras' Nadam, one fused optimizer family: its numbers, its slots, the
 * one-element reference, and the vector loop over simd.h's vocabulary.
 * The caller keeps Keras' u_product and computes the step's scalars from
 * it as Keras' update_step does.
 *
 *   h[LS_NADAM_C1]        1 - beta_1, in float32 (Keras: 1 - cast(beta_1))
 *   h[LS_NADAM_C2]        1 - beta_2, in float32
 *   h[LS_NADAM_EPSILON]   epsilon
 *   h[LS_NADAM_U_T_1]     u_t_1 = beta_1 * (1 - 0.5 * 0.96^(t + 1))
 *   h[LS_NADAM_D_T_1]     1 - u_product_t * u_t_1
 *   h[LS_NADAM_C_T]       1 - u_t, u_t = beta_1 * (1 - 0.5 * 0.96^t)
 *   h[LS_NADAM_D_T]       1 - u_product_t
 *   h[LS_NADAM_C2_T]      1 - beta_2^t
 *   slot[0..1]            m, v
 *
 *   m = m + (g - m) * c1;  v = v + (g * g - v) * c2
 *   m_hat = (u_t_1 * m) / d_t_1 + (c_t * g) / d_t;  v_hat = v / c2_t
 *   w = w - (m_hat * lr) / (sqrt(v_hat) + epsilon)
 */
#ifndef LOSSSCALE_FAMILY_NADAM_H
#define LOSSSCALE_FAMILY_NADAM_H

enum { LS_NADAM_C1, LS_NADAM_C2, LS_NADAM_EPSILON, LS_NADAM_U_T_1, LS_NADAM_D_T_1,
       LS_NADAM_C_T, LS_NADAM_D_T, LS_NADAM_C2_T, ls_nadam_hyper_count };

LS_OPTIM_FIXED_SLOTS(nadam, 2)

static inline const char *ls_nadam_problem(const float *h)
{
    return ls_optim_numbers_problem(h, ls_nadam_hyper_count,
                                    "Nadam's numbers (1 - beta_1, 1 - beta_2, epsilon and "
                                    "the step's scalars) must be finite");
}

static inline void ls_nadam1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    const float *h = a->h;
    float w = ls_optim_decay1(p->var[i], a);
    float m, v;
    ls_optim_moments1(p, i, g, g * g, h[LS_NADAM_C1], h[LS_NADAM_C2], &m, &v);
    const float m_hat = (h[LS_NADAM_U_T_1] * m) / h[LS_NADAM_D_T_1] +
                        (h[LS_NADAM_C_T] * g) / h[LS_NADAM_D_T];
    const float v_hat = v / h[LS_NADAM_C2_T];
    p->var[i] = w - (m_hat * a->lr) / (sqrtf(v_hat) + h[LS_NADAM_EPSILON]);
}

#endif /* LOSSSCALE_FAMILY_NADAM_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(nadam)
{
    const float *h = a->h;
    const LS_V c1 = v_set1(h[LS_NADAM_C1]), c2 = v_set1(h[LS_NADAM_C2]),
               eps = v_set1(h[LS_NADAM_EPSILON]), u_t_1 = v_set1(h[LS_NADAM_U_T_1]),
               d_t_1 = v_set1(h[LS_NADAM_D_T_1]), c_t = v_set1(h[LS_NADAM_C_T]),
               d_t = v_set1(h[LS_NADAM_D_T]), c2_t = v_set1(h[LS_NADAM_C2_T]);
    float *const ms = p->slot[0], *const vs = p->slot[1];
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        ls_prefetch(ms, i * sizeof(float));
        ls_prefetch(vs, i * sizeof(float));
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        LS_V m, v;
        LS_FN(moments)(ms, vs, i, g, v_mul(g, g), c1, c2, &m, &v);
        const LS_V m_hat = v_add(v_div(v_mul(u_t_1, m), d_t_1), v_div(v_mul(c_t, g), d_t));
        const LS_V v_hat = v_div(v, c2_t);
        w = v_sub(w, v_div(v_mul(m_hat, c.lr), v_add(v_sqrt(v_hat), eps)));
        v_store(c.var + i, w);
    }
    ls_nadam_elements(p, i, hi, a);
}
#endif
