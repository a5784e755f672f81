/*
 * Coverage-guided fuzz target over Lamb's elementwise pass
 * (ls_lamb_moments_with, ls_lamb_problem).
 *
 * One input describes zero to three variables (lengths below a vector,
 * past one, and past the 65,536 values a thread takes at least), the
 * unscale mode (and an unknown one), the scale (raw bits, or a power of
 * two: subnormal, normal or past the largest float), 1 - beta_1,
 * 1 - beta_2, epsilon and the two bias corrections (2-byte value codes or
 * raw bits), the flags (an unknown bit among them), the library's threads,
 * the caller's FTZ/DAZ state, cut points for a host's parallel-for and at
 * most one deliberate fault.  Checked:
 *   - every float of m, v and u equals, bit for bit (a NaN need only be a
 *     NaN), this file's own restatement of the pass (lossscale.h's
 *     ls_lamb_config), written plainly: g divided by the scale (never its
 *     reciprocal), then the moments and u, in the floating-point state the
 *     flags name, set here; u written over the gradient itself when the
 *     input asks for it; a variable given a term takes its g as it is and
 *     the term in place of x * x, and its term keeps every bit; a variable
 *     given a decay is decayed first by its form (w - (w * wd) * lr,
 *     w - w * (wd * lr), w - w * wd);
 *   - the call is refused (LS_ERR_ARG) exactly when this file's
 *     restatement of the rules refuses it, a valid one (LS_ERR_SIMD)
 *     exactly when LOSSSCALE_SIMD names a level this CPU lacks, and then
 *     every buffer keeps every bit and the parallel-for never runs;
 *   - the library's threads and a host's parallel-for that runs the job
 *     in uneven pieces, in order or last to first, give the same bits;
 *   - the caller's floating-point control state comes back.
 * Every buffer is allocated to its exact size, so that the sanitizers see
 * any read or write past one.
 *
 * Input layout (little-endian; a short input reads as if padded with
 * zeros):
 *   0      bits 0-1 unscale (0 none, 1 divide by the scale's raw bits, 2
 *          divide by a power of two, 3 an unknown mode), bit 2
 *          LS_FLUSH_DENORMALS, bit 3 an unknown flag too, bit 4 the caller
 *          runs with FTZ/DAZ, bits 5-6 the library's threads less 1, bit 7
 *          values as raw float32 bits (else 2-byte codes, see value_of)
 *   1      bits 0-1 variables (0-3), bits 2-4 fault (enum fault), bit 5
 *          the codes' special values include the non-finite ones, bit 6
 *          the variables are decayed (variable i by form 1 + i % 3), bit 7
 *          then variable 0's form is 4 (unknown: refused when it has values)
 *   2      bits 0-2 cut points for the host's parallel-for, bit 3 its
 *          pieces run last to first, bits 4-6 variables 0-2 take a term,
 *          bit 7 variable 0's term is its m (refused when it has values)
 *   3..6   scale: its float32 bits; with unscale 2, 2^(byte 3 % 280 - 149)
 *   7..26  1 - beta_1, 1 - beta_2, epsilon, bias_1, bias_2: a u32 each,
 *          raw bits with bit 7 of byte 0, else its low 16 bits a code;
 *          with bit 6 of byte 1, then the weight decay and the learning
 *          rate, alike
 *   then   the cut points (u32 each): position = value % (elements + 1)
 *   then per variable 3 bytes: class (bits 0-1), L (u16): length L % 64,
 *          L % 1100, 65,536 + L % 70,000, or 0
 *   then the content, handed out in order and repeated from its start
 *   (zero bytes when there is none): per variable its gradient, m and v
 *   (and its term, and the variable when decayed), each value a 2-byte
 *   code (4 raw bytes with bit 7 of byte 0).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lossscale.h"

enum { MAX_VARS = 3, MAX_CUTS = 7 };

enum fault {
    FAULT_NONE = 0,
    FAULT_NULL_CONFIG, /* no configuration: refused */
    FAULT_NULL_PARAMS, /* params NULL: refused unless there are none */
    FAULT_NULL_GRAD,   /* variable 0's gradient NULL: refused when it has values */
    FAULT_NULL_M,      /* its m NULL: likewise */
    FAULT_U_ON_M,      /* its u is its m: refused when it has values */
    FAULT_U_IS_GRAD,   /* its u is its gradient: valid, u written over g */
    FAULT_HUGE_LENGTH  /* a length past SIZE_MAX / 4: refused, unread */
};

static char detail[240];

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_lamb: %s %s\n", what, detail);
    abort();
}

/* the readers, value_of, same, control_state, piece_parallel */
#include "restated_sums.h"

typedef struct state {
    float *grad[MAX_VARS], *m[MAX_VARS], *v[MAX_VARS], *u[MAX_VARS];
    float *term[MAX_VARS]; /* NULL where the variable takes none */
    float *var[MAX_VARS];  /* NULL where the variable is not decayed */
} state;

typedef struct fuzz_case {
    int caller_flush, raw, wild, lib_threads, reverse, termed[MAX_VARS], term_on_m;
    int decayed, bad_decay;
    unsigned flags;
    ls_lamb_config config;
    size_t count, ncuts;
    enum fault fault;
    uint32_t cuts[MAX_CUTS];
    size_t length[MAX_VARS];
    state init;
} fuzz_case;

static float number_of(reader *r, int raw, int wild)
{
    const uint32_t bits = (uint32_t)next_le(r, 4);
    return raw ? from_bits(bits) : value_of((uint16_t)bits, wild);
}

static float *floats(size_t n)
{
    float *p = malloc(n > 0 ? n * sizeof(float) : 1);
    if (p == NULL)
        fail("out of memory");
    return p;
}

static void decode(const uint8_t *data, size_t size, fuzz_case *c)
{
    reader r = {data, size, 0};
    memset(c, 0, sizeof *c);
    const uint8_t mode = next_byte(&r);
    const int unscale = mode & 3;
    c->flags = ((mode >> 2) & 1 ? LS_FLUSH_DENORMALS : 0u) | ((mode >> 3) & 1 ? 0x100u : 0u);
    c->caller_flush = (mode >> 4) & 1;
    c->lib_threads = 1 + ((mode >> 5) & 3);
    c->raw = mode >> 7;
    const uint8_t list = next_byte(&r);
    c->count = list & 3;
    c->fault = (enum fault)((list >> 2) & 7);
    c->wild = (list >> 5) & 1;
    c->decayed = (list >> 6) & 1;
    c->bad_decay = list >> 7;
    const uint8_t split = next_byte(&r);
    c->ncuts = split & 7;
    c->reverse = (split >> 3) & 1;
    for (size_t i = 0; i < MAX_VARS; i++)
        c->termed[i] = (split >> (4 + i)) & 1;
    c->term_on_m = split >> 7;
    const uint32_t scale_bits = (uint32_t)next_le(&r, 4);
    c->config.unscale = unscale == 0 ? LS_UNSCALE_NONE : unscale == 3 ? 7 : LS_UNSCALE_DIVIDE;
    c->config.scale = unscale == 2 ? ldexpf(1.0f, (int)(scale_bits & 0xffu) % 280 - 149)
                                   : from_bits(scale_bits);
    c->config.one_minus_beta_1 = number_of(&r, c->raw, c->wild);
    c->config.one_minus_beta_2 = number_of(&r, c->raw, c->wild);
    c->config.epsilon = number_of(&r, c->raw, c->wild);
    c->config.bias_1 = number_of(&r, c->raw, c->wild);
    c->config.bias_2 = number_of(&r, c->raw, c->wild);
    if (c->decayed) {
        c->config.weight_decay = number_of(&r, c->raw, c->wild);
        c->config.learning_rate = number_of(&r, c->raw, c->wild);
    }
    for (size_t i = 0; i < MAX_CUTS; i++)
        c->cuts[i] = (uint32_t)next_le(&r, 4);
    for (size_t i = 0; i < c->count; i++) {
        const uint8_t cls = next_byte(&r) & 3;
        const size_t l = (size_t)next_le(&r, 2);
        c->length[i] = cls == 0 ? l % 64 : cls == 1 ? l % 1100 : cls == 2 ? 65536 + l % 70000 : 0;
    }
    stream content = {data + (r.at < size ? r.at : size), r.at < size ? size - r.at : 0, 0};
    for (size_t i = 0; i < c->count; i++) {
        float **bufs[5] = {&c->init.grad[i], &c->init.m[i], &c->init.v[i],
                           c->termed[i] ? &c->init.term[i] : &c->init.var[i], &c->init.var[i]};
        for (int b = 0; b < 3 + c->termed[i] + c->decayed; b++) {
            *bufs[b] = floats(c->length[i]);
            for (size_t k = 0; k < c->length[i]; k++)
                (*bufs[b])[k] = c->raw ? from_bits((uint32_t)stream_le(&content, 4))
                                       : value_of((uint16_t)stream_le(&content, 2), c->wild);
        }
        c->init.u[i] = floats(c->length[i]);
        memset(c->init.u[i], 0xA5, c->length[i] * sizeof(float));
    }
}

/* A fresh copy of the case's buffers, each of its exact size. */
static void copy_state(const fuzz_case *c, state *to)
{
    for (size_t i = 0; i < c->count; i++) {
        const size_t bytes = c->length[i] * sizeof(float);
        to->grad[i] = floats(c->length[i]);
        to->m[i] = floats(c->length[i]);
        to->v[i] = floats(c->length[i]);
        to->u[i] = floats(c->length[i]);
        memcpy(to->grad[i], c->init.grad[i], bytes);
        memcpy(to->m[i], c->init.m[i], bytes);
        memcpy(to->v[i], c->init.v[i], bytes);
        memcpy(to->u[i], c->init.u[i], bytes);
        to->term[i] = NULL;
        if (c->termed[i]) {
            to->term[i] = floats(c->length[i]);
            memcpy(to->term[i], c->init.term[i], bytes);
        }
        to->var[i] = NULL;
        if (c->decayed) {
            to->var[i] = floats(c->length[i]);
            memcpy(to->var[i], c->init.var[i], bytes);
        }
    }
}

static void free_state(const fuzz_case *c, state *s)
{
    for (size_t i = 0; i < c->count; i++) {
        free(s->grad[i]);
        free(s->m[i]);
        free(s->v[i]);
        free(s->u[i]);
        free(s->term[i]);
        free(s->var[i]);
    }
}

/* The parameters over `s`, with the case's fault. */
static void params_of(const fuzz_case *c, const state *s, ls_lamb_param *p)
{
    for (size_t i = 0; i < c->count; i++)
        p[i] = (ls_lamb_param){s->grad[i], s->m[i], s->v[i], s->u[i], c->length[i], s->term[i],
                               s->var[i], s->var[i] != NULL ? 1 + (int)(i % 3) : LS_DECAY_NONE};
    if (c->count == 0)
        return;
    if (c->decayed && c->bad_decay)
        p[0].decay = 4;
    if (c->termed[0] && c->term_on_m)
        p[0].term = p[0].m;
    switch (c->fault) {
    case FAULT_NULL_GRAD: p[0].grad = NULL; break;
    case FAULT_NULL_M: p[0].m = NULL; break;
    case FAULT_U_ON_M: p[0].u = p[0].m; break;
    case FAULT_U_IS_GRAD: p[0].u = (float *)p[0].grad; break;
    case FAULT_HUGE_LENGTH: p[0].length = SIZE_MAX / 2; break;
    default: break;
    }
}

/* ls_lamb_problem's rules, restated: whether it refuses the call. */
static int ref_problem(const fuzz_case *c, const ls_lamb_param *p)
{
    if (c->fault == FAULT_NULL_CONFIG || (c->fault == FAULT_NULL_PARAMS && c->count > 0))
        return 1;
    if (c->config.unscale != LS_UNSCALE_NONE && c->config.unscale != LS_UNSCALE_DIVIDE)
        return 1;
    if (c->count == 0)
        return 0;
    if (c->fault == FAULT_HUGE_LENGTH)
        return 1;
    return p[0].length > 0 && (c->fault == FAULT_NULL_GRAD || c->fault == FAULT_NULL_M
                               || c->fault == FAULT_U_ON_M || (c->termed[0] && c->term_on_m)
                               || (c->decayed && c->bad_decay));
}

/* The pass, restated one element at a time in the flags' state. */
static void ref_pass(const fuzz_case *c, state *s, int in_place0)
{
#ifdef HAVE_MXCSR
    const unsigned saved = _mm_getcsr();
    _mm_setcsr((saved & ~FLUSH_BITS) | ((c->flags & LS_FLUSH_DENORMALS) ? FLUSH_BITS : 0u));
#endif
    const ls_lamb_config *k = &c->config;
    const float wd = k->weight_decay, lr = k->learning_rate;
    const float wd_lr = wd * lr;
    for (size_t i = 0; i < c->count; i++) {
        float *u = i == 0 && in_place0 ? s->grad[0] : s->u[i];
        const float *t = s->term[i];
        float *w = s->var[i];
        for (size_t e = 0; e < c->length[i]; e++) {
            if (w != NULL) {
                const int form = 1 + (int)(i % 3);
                w[e] = form == 1 ? w[e] - (w[e] * wd) * lr
                       : form == 2 ? w[e] - w[e] * wd_lr
                                   : w[e] - w[e] * wd;
            }
            const float g = s->grad[i][e];
            const float x = t == NULL && k->unscale == LS_UNSCALE_DIVIDE ? g / k->scale : g;
            const float m = s->m[i][e] + (x - s->m[i][e]) * k->one_minus_beta_1;
            const float v = s->v[i][e] + ((t != NULL ? t[e] : x * x) - s->v[i][e])
                                             * k->one_minus_beta_2;
            s->m[i][e] = m;
            s->v[i][e] = v;
            u[e] = (m / k->bias_1) / (sqrtf(v / k->bias_2) + k->epsilon);
        }
    }
#ifdef HAVE_MXCSR
    _mm_setcsr(saved);
#endif
}

static void compare(const fuzz_case *c, const state *a, const state *b, const char *what)
{
    for (size_t i = 0; i < c->count; i++)
        for (size_t e = 0; e < c->length[i]; e++) {
            const float *pa[6] = {a->grad[i], a->m[i], a->v[i], a->u[i], a->term[i], a->var[i]};
            const float *pb[6] = {b->grad[i], b->m[i], b->v[i], b->u[i], b->term[i], b->var[i]};
            for (int t = 0; t < 6; t++)
                if (pa[t] != NULL && !same(pa[t][e], pb[t][e])) {
                    snprintf(detail, sizeof detail, "(variable %zu, buffer %d, element %zu: "
                             "%08x against %08x)", i, t, e, bits_of(pa[t][e]), bits_of(pb[t][e]));
                    fail(what);
                }
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_case c;
    decode(data, size, &c);
#ifdef HAVE_MXCSR
    const unsigned saved_csr = _mm_getcsr();
    _mm_setcsr((saved_csr & ~FLUSH_BITS) | (c.caller_flush ? FLUSH_BITS : 0u));
#endif
    const unsigned caller = control_state();
    ls_set_num_threads(c.lib_threads);
    state own, hosted, ref;
    copy_state(&c, &own);
    copy_state(&c, &hosted);
    copy_state(&c, &ref);
    ls_lamb_param own_p[MAX_VARS], hosted_p[MAX_VARS], ref_p[MAX_VARS];
    params_of(&c, &own, own_p);
    params_of(&c, &hosted, hosted_p);
    params_of(&c, &ref, ref_p);
    const ls_lamb_config *config = c.fault == FAULT_NULL_CONFIG ? NULL : &c.config;
    const int null_params = c.fault == FAULT_NULL_PARAMS;
    const int problem_expected = ref_problem(&c, own_p);
    const int valid = !problem_expected && (c.flags & ~(unsigned)LS_FLUSH_DENORMALS) == 0;

    const char *why = ls_lamb_problem(null_params ? NULL : own_p, c.count, config);
    snprintf(detail, sizeof detail, "(%s)", why ? why : "no problem");
    if ((why != NULL) != problem_expected)
        fail(problem_expected ? "ls_lamb_problem missed a problem"
                              : "ls_lamb_problem refused a valid call");

    const int rc = ls_lamb_moments_with(null_params ? NULL : own_p, c.count, config, c.flags,
                                        NULL, NULL);
    if (control_state() != caller)
        fail("the caller's floating-point control state was not restored");
    snprintf(detail, sizeof detail, "(status %d)", rc);
    const int runs = valid && ls_simd_level() >= 0;
    if (rc != (!valid ? LS_ERR_ARG : runs ? 1 : LS_ERR_SIMD))
        fail(runs ? "a valid call was refused" : "an invalid call was not refused as it should be");

    piece_host host = {c.cuts, c.ncuts, c.reverse, 0};
    const int hrc = ls_lamb_moments_with(null_params ? NULL : hosted_p, c.count, config, c.flags,
                                         piece_parallel, &host);
    if (control_state() != caller)
        fail("the caller's floating-point control state was not restored");
    snprintf(detail, sizeof detail, "(status %d, %d calls)", hrc, host.calls);
    if (hrc != rc)
        fail("the host's parallel-for changed the status");
    size_t total = 0;
    for (size_t i = 0; i < c.count; i++)
        total += c.length[i];
    const int ran = runs && total > 0;
    if (ran ? host.calls != 1 : host.calls != 0)
        fail(ran ? "the parallel-for did not run once" : "the parallel-for ran when it should not");

    if (!runs) {
        compare(&c, &own, &c.init, "a refused call wrote");
        compare(&c, &hosted, &c.init, "a refused call wrote");
    } else {
        compare(&c, &hosted, &own, "the host's pieces and the library's threads differ");
        ref_pass(&c, &ref, c.fault == FAULT_U_IS_GRAD);
        compare(&c, &own, &ref, "the pass differs from the reference");
    }
    free_state(&c, &own);
    free_state(&c, &hosted);
    free_state(&c, &ref);
    free_state(&c, &c.init);
#ifdef HAVE_MXCSR
    _mm_setcsr(saved_csr);
#endif
    return 0;
}
