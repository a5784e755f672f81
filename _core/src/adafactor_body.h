/*
 * Adafactor's element loops (adafactor.c), written once and compiled by
 * each set's optim_<set>.c: on its vector vocabulary (simd.h) where the
 * file has one (LS_VW), one element at a time in the scalar set and for
 * every tail.  Each lane's operations are the element's, in its order.
 *
 * The loops over u take the span's fields into locals first (a store
 * through a float pointer could otherwise change them, as far as C knows,
 * and each would be loaded again on every vector) and are compiled once
 * for each way of taking g and v (LS_KFN(adafactor_u_spans)), so that no
 * choice is made per vector.
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

/* What a loop over a span's u does with each u: stores it (the pass that
 * takes its root-mean-square), or moves the variable by it, w = w -
 * alpha * (u / m) (`by` LS_ADAFACTOR_AS_IS: m is 1; DIVIDE by by_k;
 * MULTIPLY by by_k, 1 / m, exact). */
typedef struct LS_KFN(adafactor_move) {
    float *w; /* NULL: u stored to the span's u */
    float alpha;
    int by;
    float by_k;
} LS_KFN(adafactor_move);

/* A span's v (s->v, or s->f * s->c, written to s->v_out unless that is
 * NULL) and its u = g / sqrt(v), or g * TensorFlow's Rsqrt(v) by each
 * element's place in the tensor of s->length (ls_tf_rsqrt1: the vectors
 * stay within its packets); u stored or the variable moved (`move`).
 * `how`, `factored` (s->v is NULL) and `rsqrt` are the span's, constants
 * where the loop is inlined. */
LS_INLINE void LS_KFN(adafactor_u_loop)(const ls_adafactor_span *s, LS_KFN(adafactor_move) move,
                                       int how, int factored, int rsqrt)
{
    const float *const g = s->grad, *const v = s->v, *const c = s->c;
    float *const v_out = s->v_out, *const u = s->u, *const w = move.w;
    const float k = s->k, f = s->f, alpha = move.alpha, by_k = move.by_k;
    const int by = move.by;
    const size_t n = s->count, first = s->first, length = s->length;
    size_t i = 0;
#ifdef LS_VW
#if LS_V_RSQRT_X86
    const int rsqrt_vectors = 1;
#else
    const int rsqrt_vectors = 0;
#endif
    size_t vector_end = n;
    if (rsqrt) {
        const size_t packets = ls_tf_rsqrt_packets_end(length);
        vector_end = !rsqrt_vectors || first >= packets ? 0
                     : packets - first < n             ? packets - first
                                                       : n;
    }
    const LS_V kv = v_set1(k), fv = v_set1(f), av = v_set1(alpha), bv = v_set1(by_k);
    for (; i + LS_VW <= vector_end; i += LS_VW) {
        const LS_V x = LS_FN(adafactor_by)(v_load(g + i), how, kv);
        LS_V vv;
        if (!factored) {
            vv = v_load(v + i);
        } else {
            vv = v_mul(fv, v_load(c + i));
            if (v_out != NULL)
                v_store(v_out + i, vv);
        }
        const LS_V r = rsqrt ? v_mul(x, LS_FN(tf_rsqrt)(vv)) : v_div(x, v_sqrt(vv));
        if (w == NULL)
            v_store(u + i, r);
        else
            v_store(w + i, v_sub(v_load(w + i), v_mul(av, LS_FN(adafactor_by)(r, by, bv))));
    }
#endif
    for (; i < n; i++) {
        const float x = ls_adafactor_by1(g[i], how, k);
        float vv;
        if (!factored) {
            vv = v[i];
        } else {
            vv = f * c[i];
            if (v_out != NULL)
                v_out[i] = vv;
        }
        const float r = rsqrt ? x * ls_tf_rsqrt1(vv, first + i, length) : x / sqrtf(vv);
        if (w == NULL)
            u[i] = r;
        else
            w[i] = w[i] - alpha * ls_adafactor_by1(r, by, by_k);
    }
}

/* LS_KFN(adafactor_u_loop), compiled for each (how, factored, rsqrt). */
static void LS_KFN(adafactor_u_spans)(const ls_adafactor_span *s, LS_KFN(adafactor_move) move)
{
    const int factored = s->v == NULL;
#define LS_ADAFACTOR_U_CASE(h, fac, rs)                                                    \
    if (s->how == (h) && factored == (fac) && (s->rsqrt != 0) == (rs)) {                   \
        LS_KFN(adafactor_u_loop)(s, move, h, fac, rs);                                      \
        return;                                                                            \
    }
#define LS_ADAFACTOR_U_HOW(h)                                                              \
    LS_ADAFACTOR_U_CASE(h, 0, 0)                                                           \
    LS_ADAFACTOR_U_CASE(h, 0, 1) LS_ADAFACTOR_U_CASE(h, 1, 0) LS_ADAFACTOR_U_CASE(h, 1, 1)
    LS_ADAFACTOR_U_HOW(LS_ADAFACTOR_AS_IS)
    LS_ADAFACTOR_U_HOW(LS_ADAFACTOR_DIVIDE)
    LS_ADAFACTOR_U_HOW(LS_ADAFACTOR_MULTIPLY)
#undef LS_ADAFACTOR_U_HOW
#undef LS_ADAFACTOR_U_CASE
}

/* The span's u, into s->u. */
static void LS_KFN(adafactor_u)(const ls_adafactor_span *s)
{
    const LS_KFN(adafactor_move) store = {NULL, 0.0f, LS_ADAFACTOR_AS_IS, 1.0f};
    LS_KFN(adafactor_u_spans)(s, store);
}

/* The span's u made and the variable's elements there moved by it:
 * w = w - alpha * (u / m) (LS_KFN(adafactor_move)); s->u is not used. */
static void LS_KFN(adafactor_update)(const ls_adafactor_span *s, float *w, float alpha, int by,
                                     float by_k)
{
    const LS_KFN(adafactor_move) move = {w, alpha, by, by_k};
    LS_KFN(adafactor_u_spans)(s, move);
}

#ifdef LS_VW
/* Eight float32 lanes, Eigen's packet, as a GCC vector: one AVX register
 * where the set has AVX, two where it has 128-bit vectors; the same lanes
 * and sums whatever the set's own width. */
typedef float LS_KFN(lanes8) __attribute__((vector_size(8 * sizeof(float))));

LS_INLINE LS_KFN(lanes8) LS_KFN(square8)(const float *x)
{
    LS_KFN(lanes8) y;
    memcpy(&y, x, sizeof y);
    return y * y;
}
#endif

/* The sum of the squares of x[0, n), n <= 8,192, in the order of Eigen's
 * leaf of a full reduction (norms.c, leaf_sum): four 8-lane accumulators
 * over runs of 32 values, folded ((a0 + a1) + a2) + a3, then single
 * packets into a0, the values past the last packet added one by one onto
 * 0, and that plus a0's lanes as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
 * (l3 + l7)).  The scalar set spells the lanes out. */
static float LS_KFN(adafactor_sumsq)(const float *x, size_t n)
{
    float a0[8] = {0}, rest = 0.0f;
    size_t j = 0;
    if (n >= 32) {
        const size_t runs = n / 32 * 32;
#ifdef LS_VW
        LS_KFN(lanes8) s0 = {0}, s1 = s0, s2 = s0, s3 = s0;
        for (; j < runs; j += 32) {
            s0 = s0 + LS_KFN(square8)(x + j);
            s1 = s1 + LS_KFN(square8)(x + j + 8);
            s2 = s2 + LS_KFN(square8)(x + j + 16);
            s3 = s3 + LS_KFN(square8)(x + j + 24);
        }
        const LS_KFN(lanes8) folded = ((s0 + s1) + s2) + s3;
        memcpy(a0, &folded, sizeof a0);
#else
        float a[4][8] = {{0}};
        for (; j < runs; j += 32)
            for (int q = 0; q < 4; q++)
                for (int l = 0; l < 8; l++)
                    a[q][l] = a[q][l] + x[j + 8 * q + l] * x[j + 8 * q + l];
        for (int l = 0; l < 8; l++)
            a0[l] = ((a[0][l] + a[1][l]) + a[2][l]) + a[3][l];
#endif
    }
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++)
            a0[l] = a0[l] + x[j + l] * x[j + l];
    for (; j < n; j++)
        rest += x[j] * x[j];
    const float b0 = a0[0] + a0[4], b1 = a0[1] + a0[5], b2 = a0[2] + a0[6],
                b3 = a0[3] + a0[7];
    return rest + ((b0 + b2) + (b1 + b3));
}

#define LS_ADAFACTOR_LOOPS                                                                 \
    {LS_KFN(adafactor_grad), LS_KFN(adafactor_u), LS_KFN(adafactor_update),                \
     LS_KFN(adafactor_sumsq)}
