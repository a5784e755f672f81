/*
 * Coverage-guided fuzz target over Keras' Adafactor step
 * (ls_adafactor_update_with, ls_adafactor_problem).
 *
 * One input describes one to three variables, each unfactored (a length)
 * or factored ([outer, rows, cols]: axes of 1 anywhere, rows below and
 * past the 16 that unroll a column's sum into four accumulators and not a
 * multiple of 4, columns that are no multiple of 8 so that a packet of 8
 * outputs straddles two slices, rows longer than an Eigen leaf of 8,192
 * values, variables that Eigen cuts into two shards), the unscale mode
 * (and an unknown one), the scale (raw bits, or a power of two: subnormal,
 * normal or past the largest float), rho, beta, rest, epsilon_1,
 * epsilon_2 and the clip threshold (mostly as Keras makes them, sometimes
 * zero, negative, NaN, infinite, subnormal or raw bits), TensorFlow's
 * Rsqrt or 1 / sqrt, Eigen's thread count, the flags (an unknown bit
 * among them), the library's threads, the caller's FTZ/DAZ state, cut
 * points for a host's parallel-for and at most one deliberate fault.
 * Checked:
 *   - every float of each variable, r, c and v equals, bit for bit (a NaN
 *     need only be a NaN), this file's own restatement of the step
 *     (lossscale.h's ls_adafactor_config), written plainly: g unscaled by
 *     a division, s = g * g + epsilon_1 made whole, TensorFlow's Mean
 *     orders over it (the full reduction of restated_sums.h; a row's own
 *     tree; the middle axis' packets of 8 outputs and their four
 *     accumulators, or a sum row by row), u, alpha and the clip from
 *     NaN-propagating maxima, all in the floating-point state the flags
 *     name, set here;
 *   - the call is refused (LS_ERR_ARG) exactly when this file's
 *     restatement of the rules refuses it, a valid one (LS_ERR_SIMD)
 *     exactly when LOSSSCALE_SIMD names a level this CPU lacks, and then
 *     every buffer keeps every bit and the parallel-for never runs;
 *   - the library's threads and a host's parallel-for that runs the job
 *     in uneven pieces (each variable belongs to the piece it starts in),
 *     in order or last to first, give the same bits;
 *   - the caller's floating-point control state comes back.
 * Every buffer is allocated to its exact size, so that the sanitizers see
 * any read or write past one.
 *
 * Input layout (little-endian; a short input reads as if padded with
 * zeros):
 *   0      mode: bits 0-1 unscale (0 none, 1 divide by the scale's raw
 *          bits, 2 divide by a power of two, 3 an unknown mode), bit 2
 *          LS_FLUSH_DENORMALS, bit 3 LS_CHECK_INPUTS too (a flag this
 *          entry point refuses), bit 4 the caller runs with FTZ/DAZ, bit 5
 *          TensorFlow's Rsqrt (refused off x86), bits 6-7 the library's
 *          threads less 1
 *   1      eigen_threads: below 240, 1 + byte % 8; 254 INT_MIN, 255
 *          INT_MAX; else byte - 248 (-8..5: zero and below are refused)
 *   2      bits 0-1 variables (0-3), bits 2-5 fault (enum fault), bit 6
 *          values as raw float32 bits (else 2-byte codes, see value_of),
 *          bit 7 the codes' special values include the non-finite ones
 *   3      bits 0-2 cut points for the host's parallel-for, bit 3 its
 *          pieces run last to first, bit 4 unfactored variables are given
 *          an r and a c of one float each (to be left alone)
 *   4..7   scale: its float32 bits; with unscale 2, 2^(byte 4 % 280 - 149)
 *          (2^-149 to 2^130: subnormal to inf); with unscale 3, byte 4
 *          even LS_UNSCALE_MULTIPLY, odd -1
 *   8..19  rho, beta, rest, epsilon_1, epsilon_2, clip_threshold: a u16
 *          code each (see hyper_of; a sane rest is 1 - beta)
 *   20..47 the cut points (u32 each): position = value % (elements + 1)
 *   then per variable 6 bytes: form (bit 0 factored, bits 1-3 shape
 *          class), O (a byte), R, C (u16 each):
 *            unfactored length by class: R % 64, R % 1100,
 *              8000 + R % 12000 (trees split), 258,000 + R % 4096 (two
 *              shards from 258,462 on), 0, else R % 300
 *            factored [outer, rows, cols] by class:
 *              0 [1 + O % 3, 1 + R % 20, 1 + C % 20]
 *              1 [1 + O % 4, 1 + R % 64, 1 + C % 100]
 *              2 [1 + O % 2, 1 + R % 4, 8193 + C % 12000]  rows past a leaf
 *              3 [1 + O % 3, 1 + R % 300, 1 + C % 13]
 *              4 [1, 380 + R % 300, 680 + C % 200]  often two shards
 *              5 [1 + O % 4, 1 + R % 2000, 1]
 *              6 [1 + O % 4, 1, 1 + C % 3000]
 *              7 [1, 1 + R % 3, 1 + C % 30000], or with R's top bit
 *                [1, 1, 258,000 + C % 8192]: one row, two shards
 *          every input's variables together at most MAX_VALUES values: a
 *          later one is cut down (its rows, then its slices, then its
 *          columns)
 *   then the content, handed out in order and repeated from its start
 *   (zero bytes when there is none): per variable its values, its
 *   gradient, then r and c (factored) and v, each value a 2-byte code (4
 *   raw bytes with bit 6 of byte 2); r, c and v take the code's magnitude
 *   unless the special values are wild.
 */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lossscale.h"
#include "optim.h"

enum {
    MAX_VARS = 3,
    MAX_CUTS = 7,
    /* Two shards at eigen_threads 2 (from 258,462 values) with room for a
     * second variable, small enough for a fast run. */
    MAX_VALUES = 600000
};

enum fault {
    FAULT_NONE = 0,
    FAULT_NULL_CONFIG, /* no configuration: refused */
    FAULT_NULL_PARAMS, /* params NULL: refused unless there are none */
    FAULT_NULL_VAR,    /* variable 0's buffer NULL: refused when it has values */
    FAULT_NULL_GRAD,   /* its gradient NULL: likewise */
    FAULT_NULL_V,      /* its v NULL: likewise */
    FAULT_NULL_R,      /* its r NULL: refused when it is factored */
    FAULT_NULL_C,      /* its c NULL: likewise */
    FAULT_BAD_SHAPE,   /* outer * rows * cols one column off its length (an
                          unfactored one given rows 2): refused */
    FAULT_ZERO_COLS,   /* a factored one's cols 0: refused */
    FAULT_OVERFLOW,    /* outer * rows past SIZE_MAX: refused */
    FAULT_HUGE_LENGTH, /* made unfactored and longer than memory: refused,
                          unread */
    FAULT_EMPTY,       /* made of no values, every buffer NULL and its
                          shape nonsense: skipped, not refused */
    FAULT_COUNT
};

static char detail[240];

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_adafactor: %s %s\n", what, detail);
    abort();
}

/* the readers, value_of, ref_sum, control_state, piece_parallel */
#include "restated_sums.h"

/* ------------------------------------------------------------ the case */

typedef struct var_spec {
    int factored;
    size_t length, outer, rows, cols;
    size_t nr, nc; /* r's and c's floats (1 each for an unfactored one
                      given them, else 0) */
} var_spec;

/* One copy of what a step writes, each buffer of its exact size. */
typedef struct state {
    float *var[MAX_VARS], *r[MAX_VARS], *c[MAX_VARS], *v[MAX_VARS];
} state;

typedef struct fuzz_case {
    int caller_flush, raw_values, wild, lib_threads, reverse, dummy_rc;
    unsigned flags;
    ls_adafactor_config config;
    size_t count, ncuts;
    enum fault fault;
    uint32_t cuts[MAX_CUTS];
    var_spec s[MAX_VARS];
    float *grad[MAX_VARS];
    state init; /* the values before the step */
} fuzz_case;

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

/* A hyperparameter from its code: 0xF... one of 16 special values, 0xE...
 * arbitrary bits, else a sane value 2^(lo + k) * (1 + m / 128), k below
 * span. */
static float hyper_of(uint16_t code, int lo, int span)
{
    static const uint32_t special[16] = {
        0x00000000, 0x80000000, 0x3F800000, 0xBF800000, /* 0, -0, 1, -1 */
        0x7FC00000, 0x7F800000, 0xFF800000, 0x00000001, /* NaN, inf, -inf, 2^-149 */
        0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x5F800000, /* max subnormal, 2^-126, FLT_MAX, 2^64 */
        0x1F800000, 0x3F000000, 0x00400000, 0x80100000, /* 2^-64, 0.5, 2^-127, -2^-129 */
    };
    if ((code >> 12) == 0xF)
        return from_bits(special[code & 15]);
    if ((code >> 12) == 0xE)
        return from_bits((uint32_t)code * 0x9E3779B1u);
    return ldexpf(1.0f + (float)(code & 127) / 128.0f, lo + (int)((code >> 7) % (unsigned)span));
}

static float *alloc_floats(size_t n)
{
    float *p = malloc(n > 0 ? n * sizeof(float) : 1);
    if (p == NULL)
        fail("out of memory");
    return p;
}

/* n values from the content: s.n values take whole turns of it, from
 * there on the values repeat, copied rather than decoded again.  A
 * moment (r, c, v) takes the code's magnitude unless `wild`. */
static void fill(stream *s, float *dst, size_t n, int raw, int wild, int moment)
{
    const size_t period = s->n > 0 ? s->n : 1, start = s->at;
    const int width = raw ? 4 : 2;
    const size_t decoded = min_size(n, period);
    for (size_t k = 0; k < decoded; k++) {
        float x = raw ? from_bits((uint32_t)stream_le(s, 4))
                      : value_of((uint16_t)stream_le(s, 2), wild);
        if (moment && !raw && !wild)
            x = fabsf(x);
        dst[k] = x;
    }
    for (size_t filled = decoded; filled < n;) {
        const size_t more = min_size(filled, n - filled); /* whole periods */
        memcpy(dst + filled, dst, more * sizeof(float));
        filled += more;
    }
    if (s->n > 0)
        s->at = (size_t)((start + (uint64_t)n * (uint64_t)width) % s->n);
}

/* A factored variable's shape by its class. */
static void factored_shape(var_spec *v, int cls, size_t O, size_t R, size_t C)
{
    switch (cls) {
    case 0: v->outer = 1 + O % 3, v->rows = 1 + R % 20, v->cols = 1 + C % 20; break;
    case 1: v->outer = 1 + O % 4, v->rows = 1 + R % 64, v->cols = 1 + C % 100; break;
    case 2: v->outer = 1 + O % 2, v->rows = 1 + R % 4, v->cols = 8193 + C % 12000; break;
    case 3: v->outer = 1 + O % 3, v->rows = 1 + R % 300, v->cols = 1 + C % 13; break;
    case 4: v->outer = 1, v->rows = 380 + R % 300, v->cols = 680 + C % 200; break;
    case 5: v->outer = 1 + O % 4, v->rows = 1 + R % 2000, v->cols = 1; break;
    case 6: v->outer = 1 + O % 4, v->rows = 1, v->cols = 1 + C % 3000; break;
    default:
        if (R & 0x8000u)
            v->outer = 1, v->rows = 1, v->cols = 258000 + C % 8192;
        else
            v->outer = 1, v->rows = 1 + R % 3, v->cols = 1 + C % 30000;
        break;
    }
}

static void decode(const uint8_t *data, size_t size, fuzz_case *c)
{
    memset(c, 0, sizeof *c);
    reader r = {data, size, 0};
    const uint8_t mode = next_byte(&r);
    const int unscale = mode & 3;
    c->flags = ((mode >> 2) & 1 ? LS_FLUSH_DENORMALS : 0u)
               | ((mode >> 3) & 1 ? LS_CHECK_INPUTS : 0u);
    c->caller_flush = (mode >> 4) & 1;
    c->config.rsqrt = (mode >> 5) & 1;
    c->lib_threads = 1 + (mode >> 6);
    const uint8_t threads = next_byte(&r);
    c->config.eigen_threads = threads < 240   ? 1 + threads % 8
                              : threads == 254 ? INT_MIN
                              : threads == 255 ? INT_MAX
                                               : (int)threads - 248;
    const uint8_t list = next_byte(&r);
    c->count = list & 3;
    c->fault = (enum fault)((list >> 2) & 15);
    if (c->fault >= FAULT_COUNT)
        c->fault = FAULT_NONE;
    c->raw_values = (list >> 6) & 1;
    c->wild = list >> 7;
    const uint8_t split = next_byte(&r);
    c->ncuts = split & 7;
    c->reverse = (split >> 3) & 1;
    c->dummy_rc = (split >> 4) & 1;
    const uint32_t scale_bits = (uint32_t)next_le(&r, 4);
    switch (unscale) {
    case 0:
        c->config.unscale = LS_UNSCALE_NONE, c->config.scale = from_bits(scale_bits);
        break;
    case 1:
        c->config.unscale = LS_UNSCALE_DIVIDE, c->config.scale = from_bits(scale_bits);
        break;
    case 2:
        c->config.unscale = LS_UNSCALE_DIVIDE;
        c->config.scale = ldexpf(1.0f, (int)((scale_bits & 0xFFu) % 280) - 149);
        break;
    default:
        c->config.unscale = (scale_bits & 1) ? -1 : LS_UNSCALE_MULTIPLY;
        c->config.scale = 1.0f;
        break;
    }
    uint16_t code[6];
    for (int i = 0; i < 6; i++)
        code[i] = (uint16_t)next_le(&r, 2);
    c->config.rho = hyper_of(code[0], -14, 14);
    c->config.beta = (code[1] & 0x3FFFu) == 0 ? 0.0f : hyper_of(code[1], -8, 8);
    c->config.rest = code[2] >> 13 == 7 ? hyper_of(code[2], 0, 1) : 1.0f - c->config.beta;
    c->config.epsilon_1 = hyper_of(code[3], -110, 20);
    c->config.epsilon_2 = hyper_of(code[4], -14, 10);
    c->config.clip_threshold = hyper_of(code[5], -3, 7);
    for (int i = 0; i < MAX_CUTS; i++)
        c->cuts[i] = (uint32_t)next_le(&r, 4);

    size_t budget = MAX_VALUES;
    for (size_t i = 0; i < c->count; i++) {
        var_spec *v = &c->s[i];
        const uint8_t form = next_byte(&r), O = next_byte(&r);
        const size_t R = (size_t)next_le(&r, 2), C = (size_t)next_le(&r, 2);
        const int cls = (form >> 1) & 7;
        v->factored = form & 1;
        if (v->factored) {
            factored_shape(v, cls, O, R, C);
            if (v->outer * v->rows * v->cols > budget) {
                v->outer = 1;
                v->rows = budget / v->cols;
                if (v->rows == 0)
                    v->rows = 1, v->cols = budget;
            }
            v->length = v->outer * v->rows * v->cols;
            if (v->length == 0) {
                v->factored = 0;
                v->outer = v->rows = v->cols = 0;
            }
        } else {
            v->length = cls == 0   ? R % 64
                        : cls == 1 ? R % 1100
                        : cls == 2 ? 8000 + R % 12000
                        : cls == 3 ? 258000 + R % 4096
                        : cls == 4 ? 0
                                   : R % 300;
            v->length = min_size(v->length, budget);
        }
        budget -= v->length;
        if (v->factored)
            v->nr = v->outer * v->rows, v->nc = v->outer * v->cols;
        else if (c->dummy_rc)
            v->nr = v->nc = 1;
    }

    stream s = {r.at < size ? data + r.at : NULL, r.at < size ? size - r.at : 0, 0};
    for (size_t i = 0; i < c->count; i++) {
        const var_spec *v = &c->s[i];
        c->init.var[i] = alloc_floats(v->length);
        c->grad[i] = alloc_floats(v->length);
        c->init.r[i] = v->nr > 0 ? alloc_floats(v->nr) : NULL;
        c->init.c[i] = v->nc > 0 ? alloc_floats(v->nc) : NULL;
        c->init.v[i] = alloc_floats(v->length);
        fill(&s, c->init.var[i], v->length, c->raw_values, c->wild, 0);
        fill(&s, c->grad[i], v->length, c->raw_values, c->wild, 0);
        if (v->nr > 0)
            fill(&s, c->init.r[i], v->nr, c->raw_values, c->wild, 1);
        if (v->nc > 0)
            fill(&s, c->init.c[i], v->nc, c->raw_values, c->wild, 1);
        fill(&s, c->init.v[i], v->length, c->raw_values, c->wild, 1);
    }
}

static float *copy_floats(const float *src, size_t n)
{
    if (src == NULL)
        return NULL;
    float *p = alloc_floats(n);
    memcpy(p, src, n * sizeof(float));
    return p;
}

static void state_copy(const fuzz_case *c, state *to)
{
    memset(to, 0, sizeof *to);
    for (size_t i = 0; i < c->count; i++) {
        const var_spec *v = &c->s[i];
        to->var[i] = copy_floats(c->init.var[i], v->length);
        to->r[i] = copy_floats(c->init.r[i], v->nr);
        to->c[i] = copy_floats(c->init.c[i], v->nc);
        to->v[i] = copy_floats(c->init.v[i], v->length);
    }
}

static void state_free(const fuzz_case *c, state *st)
{
    for (size_t i = 0; i < c->count; i++) {
        free(st->var[i]);
        free(st->r[i]);
        free(st->c[i]);
        free(st->v[i]);
    }
}

/* The parameters a call sees of a copy, the fault made on variable 0. */
static void params_of(const fuzz_case *c, const state *st, ls_adafactor_param *p)
{
    for (size_t i = 0; i < c->count; i++) {
        const var_spec *v = &c->s[i];
        p[i] = (ls_adafactor_param){st->var[i], c->grad[i], st->r[i], st->c[i], st->v[i],
                                     v->length, v->outer, v->rows, v->cols};
    }
    if (c->count == 0)
        return;
    ls_adafactor_param *q = &p[0];
    switch (c->fault) {
    case FAULT_NULL_VAR: q->var = NULL; break;
    case FAULT_NULL_GRAD: q->grad = NULL; break;
    case FAULT_NULL_V: q->v = NULL; break;
    case FAULT_NULL_R: q->r = NULL; break;
    case FAULT_NULL_C: q->c = NULL; break;
    case FAULT_BAD_SHAPE:
        if (q->rows > 0)
            q->cols++;
        else
            q->outer = 1, q->rows = 2, q->cols = q->length;
        break;
    case FAULT_ZERO_COLS:
        if (q->rows > 0)
            q->cols = 0;
        break;
    case FAULT_OVERFLOW:
        if (q->rows > 0)
            q->outer = SIZE_MAX / q->rows + 1;
        break;
    case FAULT_HUGE_LENGTH:
        q->rows = 0;
        q->length = SIZE_MAX / (4 * sizeof(float)) + 1;
        break;
    case FAULT_EMPTY:
        *q = (ls_adafactor_param){NULL, NULL, NULL, NULL, NULL, 0, 0, 7, 0};
        break;
    default:
        break;
    }
}

static void case_free(fuzz_case *c)
{
    state_free(c, &c->init);
    for (size_t i = 0; i < c->count; i++)
        free(c->grad[i]);
}

/* ------------------------------------------- the reference: plain C */

/* lossscale.h's rules for a call: the flags, a configuration and the
 * variables given (the flags: ls_adafactor_update_with's alone, not
 * ls_adafactor_problem's), Eigen's threads, the unscale, Rsqrt off x86; then each
 * variable with values: its buffers, a factored one's r and c and a shape
 * whose product (within size_t) is its length, and a length that memory
 * could hold four times over. */
static int ref_valid(const fuzz_case *c, const ls_adafactor_param *p,
                     const ls_adafactor_config *config, int flags_too)
{
    if (flags_too && (c->flags & ~(unsigned)LS_FLUSH_DENORMALS) != 0)
        return 0;
    if (config == NULL || (c->count > 0 && p == NULL))
        return 0;
    if (config->eigen_threads < 1)
        return 0;
    if (config->unscale != LS_UNSCALE_NONE && config->unscale != LS_UNSCALE_DIVIDE)
        return 0;
#if !(defined(__x86_64__) || defined(__i386__))
    if (config->rsqrt)
        return 0;
#endif
    for (size_t i = 0; i < c->count; i++) {
        if (p[i].length == 0)
            continue;
        if (p[i].var == NULL || p[i].grad == NULL || p[i].v == NULL)
            return 0;
        if (p[i].rows > 0) {
            size_t slices, product;
            if (p[i].r == NULL || p[i].c == NULL)
                return 0;
            if (__builtin_mul_overflow(p[i].outer, p[i].rows, &slices)
                || __builtin_mul_overflow(slices, p[i].cols, &product) || product != p[i].length)
                return 0;
        }
        if (p[i].length > SIZE_MAX / 16)
            return 0;
    }
    return 1;
}

/* TensorFlow's Maximum: a NaN on either side is the answer. */
static float tf_max(float a, float b)
{
    if (isnan(a))
        return a;
    if (isnan(b))
        return b;
    return a > b ? a : b;
}

/* A value that passes through untouched (a copy is a copy: no add of -0
 * that the flush would turn a subnormal into 0 with). */
static float untouched(float x)
{
    volatile float t = x;
    return t;
}

/* TensorFlow's Mean over the last axis of x [kept, cols] into out: a copy
 * when cols is 1 (nothing left to reduce), the full reduction when one row
 * is kept, else each row its own tree (split points counted from the
 * tensor's start); each sum divided by cols. */
static void ref_mean_last(const float *x, size_t kept, size_t cols, int threads, float *out)
{
    if (cols == 1) {
        for (size_t k = 0; k < kept; k++)
            out[k] = untouched(x[k]);
        return;
    }
    const float count = (float)cols;
    if (kept == 1) {
        out[0] = ref_sum(x, cols, threads) / count;
        return;
    }
    for (size_t k = 0; k < kept; k++)
        out[k] = ref_tree(x, k * cols, cols) / count;
}

/* TensorFlow's Mean over the middle axis of x [outer, rows, cols] into
 * out [outer * cols]: a copy when rows is 1; the mean over the last axis
 * of [outer, rows] when cols is 1; else the outputs taken 8 at a time from
 * flat output 0: 8 in one slice are a packet, whose sums over 16 rows or
 * more go row r into accumulator r % 4 up to the last multiple of 4,
 * ((a0 + a1) + a2) + a3, then the other rows one by one; every other sum
 * (and a packet's over fewer rows) row by row onto 0. */
static void ref_mean_middle(const float *x, size_t outer, size_t rows, size_t cols, int threads,
                            float *out)
{
    const size_t outputs = outer * cols;
    if (cols == 1) {
        ref_mean_last(x, outer, rows, threads, out);
        return;
    }
    if (rows == 1) {
        for (size_t o = 0; o < outputs; o++)
            out[o] = untouched(x[o]);
        return;
    }
    unsigned char *packet = calloc(outputs, 1);
    if (packet == NULL)
        fail("out of memory");
    for (size_t g = 0; g + 8 <= outputs; g += 8)
        if (g / cols == (g + 7) / cols)
            memset(packet + g, 1, 8);
    const float count = (float)rows;
    for (size_t o = 0; o < outputs; o++) {
        const float *col = x + (o / cols) * rows * cols + o % cols;
        float sum = 0.0f;
        size_t r = 0;
        if (packet[o] && rows >= 16) {
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (; r < rows / 4 * 4; r++)
                a[r % 4] = a[r % 4] + col[r * cols];
            sum = ((a[0] + a[1]) + a[2]) + a[3];
        }
        for (; r < rows; r++)
            sum = sum + col[r * cols];
        out[o] = sum / count;
    }
    free(packet);
}

/* sqrt(mean(square(x))): the squares made whole, then TensorFlow's Mean. */
static float ref_rms(const float *x, size_t n, int threads, float *scratch)
{
    for (size_t e = 0; e < n; e++)
        scratch[e] = x[e] * x[e];
    return sqrtf(ref_sum(scratch, n, threads) / (float)n);
}

/* One variable's step, as lossscale.h's ls_adafactor_config writes it. */
static void ref_step(const ls_adafactor_config *k, const var_spec *vs, const float *grad,
                     float *var, float *r, float *c, float *v)
{
    const size_t n = vs->length;
    const int T = k->eigen_threads;
    float *g = alloc_floats(n), *s = alloc_floats(n), *u = alloc_floats(n), *sq = alloc_floats(n);
    for (size_t e = 0; e < n; e++)
        g[e] = k->unscale == LS_UNSCALE_DIVIDE ? grad[e] / k->scale : untouched(grad[e]);
    const float alpha = tf_max(k->epsilon_2, ref_rms(var, n, T, sq)) * k->rho;
    for (size_t e = 0; e < n; e++)
        s[e] = g[e] * g[e] + k->epsilon_1;
    if (vs->factored) {
        const size_t outer = vs->outer, rows = vs->rows, cols = vs->cols;
        float *row_mean = alloc_floats(outer * rows), *col_mean = alloc_floats(outer * cols);
        float *r_mean = alloc_floats(outer);
        ref_mean_last(s, outer * rows, cols, T, row_mean);
        ref_mean_middle(s, outer, rows, cols, T, col_mean);
        for (size_t q = 0; q < outer * rows; q++)
            r[q] = k->beta * r[q] + k->rest * row_mean[q];
        for (size_t q = 0; q < outer * cols; q++)
            c[q] = k->beta * c[q] + k->rest * col_mean[q];
        ref_mean_last(r, outer, rows, T, r_mean);
        for (size_t e = 0; e < n; e++) {
            const size_t row = e / cols, slice = row / rows;
            v[e] = (r[row] / r_mean[slice]) * c[slice * cols + e % cols];
        }
        free(row_mean);
        free(col_mean);
        free(r_mean);
    } else {
        for (size_t e = 0; e < n; e++)
            v[e] = k->beta * v[e] + k->rest * s[e];
    }
    for (size_t e = 0; e < n; e++)
        u[e] = k->rsqrt ? g[e] * ls_tf_rsqrt1(v[e], e, n) : g[e] / sqrtf(v[e]);
    const float m = tf_max(1.0f, ref_rms(u, n, T, sq) / k->clip_threshold);
    for (size_t e = 0; e < n; e++)
        var[e] = var[e] - alpha * (u[e] / m);
    free(g);
    free(s);
    free(u);
    free(sq);
}

/* Every variable's step, in whatever floating-point state the caller set;
 * not inlined, so that no operation moves across that setting. */
static __attribute__((noinline)) void ref_steps(const fuzz_case *c, const ls_adafactor_param *p,
                                                state *st)
{
    for (size_t i = 0; i < c->count; i++)
        if (p[i].length > 0)
            ref_step(&c->config, &c->s[i], c->grad[i], st->var[i], st->r[i], st->c[i],
                     st->v[i]);
}

/* The reference in the state the flags name: FTZ and DAZ both, or
 * neither (IEEE), whatever the caller runs with. */
static void ref_steps_in_state(const fuzz_case *c, const ls_adafactor_param *p, state *st)
{
    const int flush = (c->flags & LS_FLUSH_DENORMALS) != 0;
#ifdef HAVE_MXCSR
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(flush ? saved | FLUSH_BITS : saved & ~FLUSH_BITS);
    ref_steps(c, p, st);
    _mm_setcsr(saved);
#else
    ls_fpenv env;
    ls_fpenv_enter(&env, flush);
    ref_steps(c, p, st);
    ls_fpenv_leave(&env);
#endif
}

/* ------------------------------------------------------------ the run */

/* Every float of one buffer against another: same bits (any NaN for a
 * NaN unless `exact`). */
static void compare(const char *what, size_t var, const float *got, const float *want, size_t n,
                    int exact, const char *why)
{
    for (size_t e = 0; e < n; e++)
        if (exact ? bits_of(got[e]) != bits_of(want[e]) : !same(got[e], want[e])) {
            snprintf(detail, sizeof detail, "(variable %zu's %s, float %zu of %zu: %a, want %a)",
                     var, what, e, n, (double)got[e], (double)want[e]);
            fail(why);
        }
}

static void compare_states(const fuzz_case *c, const state *got, const state *want, int exact,
                           const char *why)
{
    for (size_t i = 0; i < c->count; i++) {
        const var_spec *v = &c->s[i];
        compare("r", i, got->r[i], want->r[i], v->nr, exact, why);
        compare("c", i, got->c[i], want->c[i], v->nc, exact, why);
        compare("v", i, got->v[i], want->v[i], v->length, exact, why);
        compare("var", i, got->var[i], want->var[i], v->length, exact, why);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_case c;
    decode(data, size, &c);
    detail[0] = '\0';
    ls_set_num_threads(c.lib_threads);

#ifdef HAVE_MXCSR
    const unsigned saved_csr = _mm_getcsr();
    _mm_setcsr(c.caller_flush ? saved_csr | FLUSH_BITS : saved_csr & ~FLUSH_BITS);
#endif
    const unsigned caller = control_state();

    state own, hosted, ref;
    state_copy(&c, &own);
    state_copy(&c, &hosted);
    state_copy(&c, &ref);
    ls_adafactor_param own_p[MAX_VARS], hosted_p[MAX_VARS], ref_p[MAX_VARS];
    params_of(&c, &own, own_p);
    params_of(&c, &hosted, hosted_p);
    params_of(&c, &ref, ref_p);
    const ls_adafactor_config *config = c.fault == FAULT_NULL_CONFIG ? NULL : &c.config;
    const int null_params = c.fault == FAULT_NULL_PARAMS;
    const int valid = ref_valid(&c, null_params ? NULL : own_p, config, 1);

    const char *why = ls_adafactor_problem(null_params ? NULL : own_p, c.count, config);
    const int problem_expected = !ref_valid(&c, null_params ? NULL : own_p, config, 0);
    snprintf(detail, sizeof detail, "(%s)", why != NULL ? why : "no problem");
    if ((why != NULL) != problem_expected)
        fail(problem_expected ? "ls_adafactor_problem missed a problem"
                              : "ls_adafactor_problem found a problem in a valid step");

    /* the library's threads */
    const int rc = ls_adafactor_update_with(null_params ? NULL : own_p, c.count, config, c.flags,
                                            NULL, NULL);
    if (control_state() != caller)
        fail("the caller's floating-point control state was not restored");
    snprintf(detail, sizeof detail, "(status %d)", rc);
    /* a valid call at a level this CPU lacks (LOSSSCALE_SIMD) is refused too */
    const int runs = valid && ls_simd_level() >= 0;
    if (rc != (!valid ? LS_ERR_ARG : runs ? 1 : LS_ERR_SIMD))
        fail(runs ? "a valid call was refused" : "an invalid call was not refused as it should be");

    /* a host's parallel-for, in pieces */
    piece_host host = {c.cuts, c.ncuts, c.reverse, 0};
    const int hrc = ls_adafactor_update_with(null_params ? NULL : hosted_p, c.count, config,
                                             c.flags, piece_parallel, &host);
    if (control_state() != caller)
        fail("the caller's floating-point control state was not restored");
    snprintf(detail, sizeof detail, "(status %d, %d calls)", hrc, host.calls);
    if (hrc != rc)
        fail("the host's parallel-for changed the status");
    if (runs ? host.calls != (c.count > 0) : host.calls != 0)
        fail(runs ? "the parallel-for did not run once" : "the parallel-for ran on a refused call");

    if (!runs) {
        compare_states(&c, &own, &c.init, 1, "a refused call wrote");
        compare_states(&c, &hosted, &c.init, 1, "a refused call wrote");
    } else {
        compare_states(&c, &hosted, &own, 1, "the host's pieces and the library's threads differ");
        ref_steps_in_state(&c, ref_p, &ref);
        compare_states(&c, &own, &ref, 0, "the step differs from the reference");
    }

    state_free(&c, &own);
    state_free(&c, &hosted);
    state_free(&c, &ref);
    case_free(&c);
#ifdef HAVE_MXCSR
    _mm_setcsr(saved_csr);
#endif
    return 0;
}
