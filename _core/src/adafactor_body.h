/*
 * Adafactor's element loops (adafactor.c), written once and compiled by
 * each set's optim_<set>.c: on its vector vocabulary (simd.h) where the
 * file has one (LS_VW), one element at a time in the scalar set and for
 * every tail.  Each lane's operations are the element's, in its order.
 */

#ifdef LS_VW
/* ls_adafactor_by1 on LS_VW lanes. */
LS_INLINE LS_V LS_FN(adafactor_by)(LS_V x, int how, LS_V k)
{
    return how == LS_ADAFACTOR_DIVIDE     ? v_div(x, k)
           : how == LS_ADAFACTOR_MULTIPLY ? v_mul(x, k)
                                          : x;
}
#endif

/* out = g unscaled (ls_adafactor_how: as it is, / k, * k), then with
 * `square` out * out + e1. */
static void LS_KFN(adafactor_grad)(const float *g, float *out, size_t n, int how, float k,
                                   int square, float e1)
{
    size_t i = 0;
#ifdef LS_VW
    const LS_V kv = v_set1(k), ev = v_set1(e1);
    for (; i + LS_VW <= n; i += LS_VW) {
        const LS_V x = LS_FN(adafactor_by)(v_load(g + i), how, kv);
        v_store(out + i, square ? v_add(v_mul(x, x), ev) : x);
    }
#endif
    for (; i < n; i++) {
        const float x = ls_adafactor_by1(g[i], how, k);
        out[i] = square ? x * x + e1 : x;
    }
}

/* A span's v (s->v, or s->f * s->c written to s->v_out) and its
 * u = g / sqrt(v), or g * TensorFlow's Rsqrt(v) by each element's place in
 * the tensor of s->length (ls_tf_rsqrt1: the vectors stay within its
 * packets). */
static void LS_KFN(adafactor_u)(const ls_adafactor_span *s)
{
    const size_t n = s->count;
    size_t i = 0;
#ifdef LS_VW
#if LS_V_RSQRT_X86
    const int rsqrt_vectors = 1;
#else
    const int rsqrt_vectors = 0;
#endif
    size_t vector_end = n;
    if (s->rsqrt) {
        const size_t packets = ls_tf_rsqrt_packets_end(s->length);
        vector_end = !rsqrt_vectors || s->first >= packets ? 0
                     : packets - s->first < n             ? packets - s->first
                                                          : n;
    }
    const LS_V kv = v_set1(s->k), fv = v_set1(s->f);
    for (; i + LS_VW <= vector_end; i += LS_VW) {
        const LS_V g = LS_FN(adafactor_by)(v_load(s->grad + i), s->how, kv);
        LS_V v;
        if (s->v != NULL) {
            v = v_load(s->v + i);
        } else {
            v = v_mul(fv, v_load(s->c + i));
            v_store(s->v_out + i, v);
        }
        v_store(s->u + i, s->rsqrt ? v_mul(g, LS_FN(tf_rsqrt)(v)) : v_div(g, v_sqrt(v)));
    }
#endif
    for (; i < n; i++) {
        const float g = ls_adafactor_by1(s->grad[i], s->how, s->k);
        float v;
        if (s->v != NULL) {
            v = s->v[i];
        } else {
            v = s->f * s->c[i];
            s->v_out[i] = v;
        }
        s->u[i] = s->rsqrt ? g * ls_tf_rsqrt1(v, s->first + i, s->length) : g / sqrtf(v);
    }
}

/* w = w - alpha * (u / m): `how` LS_ADAFACTOR_AS_IS (m is 1), DIVIDE by k,
 * MULTIPLY by k (1 / m, exact). */
static void LS_KFN(adafactor_update)(float *w, const float *u, size_t n, float alpha, int how,
                                     float k)
{
    size_t i = 0;
#ifdef LS_VW
    const LS_V av = v_set1(alpha), kv = v_set1(k);
    for (; i + LS_VW <= n; i += LS_VW) {
        const LS_V x = LS_FN(adafactor_by)(v_load(u + i), how, kv);
        v_store(w + i, v_sub(v_load(w + i), v_mul(av, x)));
    }
#endif
    for (; i < n; i++)
        w[i] = w[i] - alpha * ls_adafactor_by1(u[i], how, k);
}

#define LS_ADAFACTOR_LOOPS {LS_KFN(adafactor_grad), LS_KFN(adafactor_u), LS_KFN(adafactor_update)}
