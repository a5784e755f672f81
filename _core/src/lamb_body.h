/*
 * Lamb's elementwise pass (lamb.c), written once and compiled by each
 * set's optim_<set>.c: on its vector vocabulary (simd.h) where the file has
 * one (LS_VW), one element at a time in the scalar set and for every tail.
 * Each lane's operations are the element's, in its order (lossscale.h,
 * ls_lamb_config), and the loop is compiled once for each way of taking
 * the gradient (`how`), with a term or not and with a decay or not
 * (constants where it is inlined).
 */

LS_INLINE void LS_KFN(lamb_loop)(const ls_lamb_span *s, int how, int termed, int decayed)
{
    const float *const g = s->grad, *const t = s->term;
    float *const m = s->m, *const v = s->v, *const u = s->u, *const w = s->var;
    const float k = s->k, c1 = s->c1, c2 = s->c2, eps = s->epsilon, b1 = s->bias_1,
                b2 = s->bias_2;
    const size_t n = s->n;
    const ls_optim_args *const da = &s->decay;
    size_t i = 0;
#ifdef LS_VW
    const LS_V kv = v_set1(k), c1v = v_set1(c1), c2v = v_set1(c2), ev = v_set1(eps),
               b1v = v_set1(b1), b2v = v_set1(b2), wdv = v_set1(da->wd), lrv = v_set1(da->lr),
               wd_lrv = v_set1(da->wd_lr);
    for (; i + LS_VW <= n; i += LS_VW) {
        if (decayed)
            v_store(w + i, LS_FN(decay)(v_load(w + i), da->decay, wdv, lrv, wd_lrv));
        const LS_V x = LS_FN(adafactor_by)(v_load(g + i), how, kv);
        const LS_V m0 = v_load(m + i), v0 = v_load(v + i);
        const LS_V m1 = v_add(m0, v_mul(v_sub(x, m0), c1v));
        const LS_V sq = termed ? v_load(t + i) : v_mul(x, x);
        const LS_V v1 = v_add(v0, v_mul(v_sub(sq, v0), c2v));
        v_store(m + i, m1);
        v_store(v + i, v1);
        v_store(u + i, v_div(v_div(m1, b1v), v_add(v_sqrt(v_div(v1, b2v)), ev)));
    }
#endif
    for (; i < n; i++) {
        if (decayed)
            w[i] = ls_optim_decay1(w[i], da);
        const float x = ls_adafactor_by1(g[i], how, k);
        const float m1 = m[i] + (x - m[i]) * c1;
        const float v1 = v[i] + ((termed ? t[i] : x * x) - v[i]) * c2;
        m[i] = m1;
        v[i] = v1;
        u[i] = (m1 / b1) / (sqrtf(v1 / b2) + eps);
    }
}

/* LS_KFN(lamb_loop) for the span's way of taking the gradient (a span
 * with a term takes it as it is). */
LS_INLINE void LS_KFN(lamb_taken)(const ls_lamb_span *s, int decayed)
{
    if (s->term != NULL)
        LS_KFN(lamb_loop)(s, LS_ADAFACTOR_AS_IS, 1, decayed);
    else if (s->how == LS_ADAFACTOR_DIVIDE)
        LS_KFN(lamb_loop)(s, LS_ADAFACTOR_DIVIDE, 0, decayed);
    else if (s->how == LS_ADAFACTOR_MULTIPLY)
        LS_KFN(lamb_loop)(s, LS_ADAFACTOR_MULTIPLY, 0, decayed);
    else
        LS_KFN(lamb_loop)(s, LS_ADAFACTOR_AS_IS, 0, decayed);
}

/* The span's pass, its variable decayed first where it has one. */
static void LS_KFN(lamb)(const ls_lamb_span *s)
{
    if (s->var != NULL && s->decay.decay != LS_DECAY_NONE)
        LS_KFN(lamb_taken)(s, 1);
    else
        LS_KFN(lamb_taken)(s, 0);
}
