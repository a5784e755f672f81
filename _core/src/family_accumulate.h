/*
 * Keras' gradient accumulation (gradient_accumulation_steps), the steps
 * that only accumulate, as one fused family: the variable is the
 * accumulator, and the update adds the gradient to it as Keras'
 * assign_add does (after the common unscale, clip and weight decay, which
 * Keras' accumulating step never sets).  No numbers, no slots.
 *
 *   w = w + g
 */
#ifndef LOSSSCALE_FAMILY_ACCUMULATE_H
#define LOSSSCALE_FAMILY_ACCUMULATE_H

enum { ls_accumulate_hyper_count };

LS_OPTIM_FIXED_SLOTS(accumulate, 0)

static inline const char *ls_accumulate_problem(const float *h)
{
    (void)h;
    return NULL;
}

static inline void ls_accumulate1(const ls_param *p, size_t i, float g, const ls_optim_args *a)
{
    p->var[i] = ls_optim_decay1(p->var[i], a) + g;
}

#endif /* LOSSSCALE_FAMILY_ACCUMULATE_H */

#ifdef LS_OPTIM_VECTORS
LS_OPTIM_RUN(accumulate)
{
    LS_OPTIM_VECTOR_LOOP(i, LS_FN(vector_end)(p, lo, hi, a)) {
        LS_V g, w;
        LS_FN(grad_and_weight)(&c, i, dt, &g, &w);
        v_store(c.var + i, v_add(w, g));
    }
    ls_accumulate_elements(p, i, hi, a);
}
#endif
