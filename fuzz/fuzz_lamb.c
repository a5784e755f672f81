/*
 * Coverage-guided fuzz target over Lamb's elementwise pass
 * (ls_lamb_moments_with, ls_lamb_problem).
 *
 * One input describes zero to three variables (lengths below a vector,
 * past one, and past the 65,536 values a thread takes at least), each
 * gradient dense or sparse (rows of any length that divides the
 * variable's, one that does not or 0; no slices, fewer than rows or more,
 * indices drawn, crowded onto three rows, ascending or descending, so
 * repeated; at most one fault of its own), each asking for its two sums
 * or not (of a length past Eigen's shards too; the variable read from
 * `var` when decayed, else from `weights`; at most one fault of their
 * own), the
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
 *     w - w * (wd * lr), w - w * wd); a sparse gradient made dense first:
 *     each slice value divided by the scale as a dense one's, then added
 *     in slice order onto +0 at its row's place, its square alike, the
 *     two taken as a dense gradient as it is and its term; u written into
 *     the slices' buffer past the slices when the input puts it there;
 *   - a variable's two sums, when it asks for them, equal bit for bit (a
 *     NaN need only be a NaN) ls_eigen_full_sum of the squares of the
 *     reference's final variable (`var` after its decay, or `weights`)
 *     and of its u, on the configuration's eigen_threads, in the flags'
 *     floating-point state; {0, 0} for a variable of length 0; the
 *     weights keep every bit;
 *   - the call is refused (LS_ERR_ARG) exactly when this file's
 *     restatement of the rules refuses it, a valid one (LS_ERR_SIMD)
 *     exactly when LOSSSCALE_SIMD names a level this CPU lacks, and then
 *     every buffer (a sparse gradient's indices, the weights and the two
 *     sums too) keeps every bit and the parallel-for never runs;
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
 *   then per variable 3 bytes: class (bits 0-1; bits 2-7 reading
 *          SPARSE_MARK make the gradient sparse, SUMS_MARK see below, any
 *          other value dense), L (u16): length L % 64, L % 1100, 65,536 +
 *          L % 70,000, or 0;
 *          with SUMS_MARK and a next byte whose bits 4-7 read SUMS_KEY,
 *          the variable asks for its sums, in 2 more bytes: that byte,
 *          bits 0-1 eigen_threads less 1 (the configuration takes the
 *          first such variable's; 0 with no variable asking), bit 2 the
 *          gradient is sparse, bit 3 length 250,000 + 4 * L + class bits
 *          0-1 (from 1 to 4 of Eigen's shards); then a byte: bits 0-2 the
 *          sums' fault (enum sums_fault), bits 3-4 its choice; without
 *          SUMS_KEY that byte is not read and the gradient is dense;
 *          a sparse gradient's 4 more: the row length's byte (bits 6-7 both
 *          set: bits 0-5 as they are, 0 and lengths that do not divide
 *          among them; else the (bits 0-6 % d)-th smallest of the length's
 *          d divisors, 1 + bits 0-2 for length 0), the slices (u16, % (2 *
 *          rows + 2)) and a byte: bits 0-2 its fault (enum sparse_fault),
 *          bit 3 grad NULL when there are no slices, bits 4-5 the indices'
 *          order (see draw_indices), bits 6-7 the fault's choice
 *   then the content, handed out in order and repeated from its start
 *   (zero bytes when there is none): per variable its gradient (a sparse
 *   one's slices), m and v (and its term, and the variable when decayed,
 *   and its weights when it has them), each value a 2-byte code (4 raw
 *   bytes with bit 7 of byte 0), then a sparse gradient's indices, a u32
 *   each.
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

/* The value of the class byte's bits 2-7 that makes a gradient sparse (any
 * other leaves it dense): one that no dense input of fuzz/corpus/lamb
 * holds, so that each of them reads as a dense one. */
enum { SPARSE_MARK = 30 };

/* The class byte's bits 2-7 reading SUMS_MARK and the next byte's bits 4-7
 * reading SUMS_KEY make a variable ask for its sums (either alone leaves
 * the input as it was): no input of fuzz/corpus/lamb holds the pair, so
 * that each reads as it did. */
enum { SUMS_MARK = 29, SUMS_KEY = 10 };

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

/* A sparse gradient's own fault; "refused" is when its variable has
 * values. */
enum sparse_fault {
    SPARSE_NONE = 0,
    SPARSE_U_OVER,         /* u in the slices' buffer, at the choice's place (0, the last
                              slice value, just past the slices, half way): refused when
                              it overlaps a slice */
    SPARSE_INDEX_HIGH,     /* the last (choice bit 1: first) index rows (bit 0: INT64_MAX):
                              refused when there are slices */
    SPARSE_INDEX_NEGATIVE, /* likewise -1 (bit 0: INT64_MIN) */
    SPARSE_NO_INDICES,     /* indices NULL: refused when there are slices (else none) */
    SPARSE_MISALIGNED,     /* the indices 4 bytes off their alignment: refused, unread */
    SPARSE_ON_OTHER,       /* the slices at m, v, the variable (m when none) or m's last
                              element, by the choice: refused when there are slices */
    SPARSE_HUGE_SLICES     /* slices * row_length * 8 past SIZE_MAX: refused, unread */
};

/* A sums-asking variable's own fault; "refused" is when it has values.  A
 * variable not decayed is given weights of its own (its values, from the
 * content), a decayed one none. */
enum sums_fault {
    SUMS_NONE = 0,
    SUMS_ON_M,          /* the sums at m (choice bit 1: v), on its first float (bit 0: its
                           last, the second sum past it): refused */
    SUMS_ON_U,          /* likewise at u (bit 1: the term, u where none): refused */
    SUMS_ON_GRAD,       /* likewise at the gradient's values (bit 1: the variable, var or
                           the weights): refused; apart where the gradient has no values */
    SUMS_WEIGHTS_ON,    /* the weights at u, m, v or (a dense one's) the gradient (u for a
                           sparse one) by the choice: refused unless decayed (then unread)
                           or on a gradient that u is not */
    SUMS_NO_WEIGHTS,    /* weights NULL: refused unless decayed */
    SUMS_NO_THREADS,    /* the configuration's eigen_threads 0: refused */
    SUMS_WEIGHTS_BESIDE /* weights of their own beside a decayed variable: unread */
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
    int64_t *indices[MAX_VARS]; /* a sparse gradient's, slices + 1; NULL where dense */
    float *weights[MAX_VARS];   /* NULL where the variable has none */
    float *sums[MAX_VARS];      /* 2 floats; NULL where the variable asks for none */
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
    size_t glen[MAX_VARS]; /* floats in the gradient's buffer */
    int sparse[MAX_VARS], order[MAX_VARS], choice[MAX_VARS], null_grad[MAX_VARS];
    size_t row_length[MAX_VARS], slices[MAX_VARS];
    enum sparse_fault sfault[MAX_VARS];
    size_t u_shift[MAX_VARS]; /* u at the gradient's buffer + u_shift; SIZE_MAX: apart */
    int sums[MAX_VARS], sums_choice[MAX_VARS];
    int weighted[MAX_VARS]; /* given weights of its own */
    enum sums_fault sums_fault[MAX_VARS];
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

/* n values from the content. */
static void draw(stream *content, const fuzz_case *c, float *to, size_t n)
{
    for (size_t k = 0; k < n; k++)
        to[k] = c->raw ? from_bits((uint32_t)stream_le(content, 4))
                       : value_of((uint16_t)stream_le(content, 2), c->wild);
}

/* The (pick % d)-th smallest of n's d divisors (n > 0). */
static size_t divisor(size_t n, unsigned pick)
{
    size_t low[512], high[512], nlow = 0, nhigh = 0;
    for (size_t d = 1; d * d <= n; d++)
        if (n % d == 0) {
            low[nlow++] = d;
            if (d != n / d)
                high[nhigh++] = n / d;
        }
    const size_t k = pick % (nlow + nhigh);
    return k < nlow ? low[k] : high[nhigh - 1 - (k - nlow)];
}

/* A sparse gradient's 4 header bytes (see the layout above); its buffer
 * holds the slices, and u's length after them when u is put there. */
static void decode_sparse(reader *r, fuzz_case *c, size_t i)
{
    const size_t n = c->length[i];
    const uint8_t shape = next_byte(r);
    const size_t code = (size_t)next_le(r, 2);
    const uint8_t how = next_byte(r);
    c->sparse[i] = 1;
    c->row_length[i] = shape >> 6 == 3 ? shape & 63u
                       : n == 0        ? 1 + (shape & 7u)
                                       : divisor(n, shape & 127u);
    const size_t rows = c->row_length[i] > 0 ? n / c->row_length[i] : 0;
    c->slices[i] = code % (2 * rows + 2);
    c->sfault[i] = (enum sparse_fault)(how & 7);
    c->order[i] = (how >> 4) & 3;
    c->choice[i] = how >> 6;
    const size_t values = c->slices[i] * c->row_length[i];
    const int u_is_grad = i == 0 && c->fault == FAULT_U_IS_GRAD;
    if (u_is_grad || c->sfault[i] == SPARSE_U_OVER) {
        const size_t at[4] = {0, values > 0 ? values - 1 : 0, values, values / 2};
        c->u_shift[i] = u_is_grad ? 0 : at[c->choice[i]];
        c->glen[i] = values + n;
    } else {
        c->glen[i] = values;
    }
    c->null_grad[i] = (how >> 3) & 1 && c->slices[i] == 0 && c->u_shift[i] == SIZE_MAX;
}

/* A sparse gradient's indices, one u32 of the content d each, by its
 * order: d % rows, d % min(rows, 3) (crowded), k * rows / slices
 * (ascending) or rows - 1 less that (descending); d itself when there are
 * no whole rows.  Then its index fault.  One more index, 0, ends the
 * buffer, so that the indices 4 bytes off their alignment stay in it. */
static void draw_indices(stream *content, fuzz_case *c, size_t i)
{
    const size_t s = c->slices[i];
    const size_t rows = c->row_length[i] > 0 ? c->length[i] / c->row_length[i] : 0;
    int64_t *idx = malloc((s + 1) * sizeof(int64_t));
    if (idx == NULL)
        fail("out of memory");
    for (size_t k = 0; k < s; k++) {
        const size_t d = (size_t)stream_le(content, 4);
        size_t row = d;
        if (rows > 0)
            switch (c->order[i]) {
            case 0: row = d % rows; break;
            case 1: row = d % (rows < 3 ? rows : 3); break;
            case 2: row = k * rows / s; break;
            default: row = rows - 1 - k * rows / s; break;
            }
        idx[k] = (int64_t)row;
    }
    idx[s] = 0;
    const int extreme = c->choice[i] & 1;
    const size_t at = c->choice[i] >> 1 ? 0 : s - 1;
    if (s > 0 && c->sfault[i] == SPARSE_INDEX_HIGH)
        idx[at] = extreme ? INT64_MAX : (int64_t)rows;
    if (s > 0 && c->sfault[i] == SPARSE_INDEX_NEGATIVE)
        idx[at] = extreme ? INT64_MIN : -1;
    c->init.indices[i] = idx;
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
    int asked = 0; /* whether a variable before asked for its sums */
    for (size_t i = 0; i < c->count; i++) {
        const uint8_t cls = next_byte(&r);
        const size_t l = (size_t)next_le(&r, 2);
        const int form = cls & 3;
        int sparse = cls >> 2 == SPARSE_MARK, past_shards = 0;
        if (cls >> 2 == SUMS_MARK && r.at < r.n && r.p[r.at] >> 4 == SUMS_KEY) {
            const uint8_t ask = next_byte(&r), fault = next_byte(&r);
            c->sums[i] = 1;
            if (!asked)
                c->config.eigen_threads = 1 + (ask & 3);
            asked = 1;
            sparse = (ask >> 2) & 1;
            past_shards = (ask >> 3) & 1;
            c->sums_fault[i] = (enum sums_fault)(fault & 7);
            c->sums_choice[i] = (fault >> 3) & 3;
            c->weighted[i] = !c->decayed || c->sums_fault[i] == SUMS_WEIGHTS_BESIDE;
        }
        c->length[i] = past_shards ? 250000 + 4 * l + (size_t)form
                       : form == 0 ? l % 64
                       : form == 1 ? l % 1100
                       : form == 2 ? 65536 + l % 70000
                                   : 0;
        c->glen[i] = c->length[i];
        c->u_shift[i] = SIZE_MAX;
        if (sparse)
            decode_sparse(&r, c, i);
    }
    for (size_t i = 0; i < c->count; i++)
        if (c->sums[i] && c->sums_fault[i] == SUMS_NO_THREADS)
            c->config.eigen_threads = 0;
    stream content = {data + (r.at < size ? r.at : size), r.at < size ? size - r.at : 0, 0};
    for (size_t i = 0; i < c->count; i++) {
        const size_t values = c->sparse[i] ? c->slices[i] * c->row_length[i] : c->length[i];
        c->init.grad[i] = floats(c->glen[i]);
        draw(&content, c, c->init.grad[i], values);
        memset(c->init.grad[i] + values, 0xA5, (c->glen[i] - values) * sizeof(float));
        float **bufs[4] = {&c->init.m[i], &c->init.v[i],
                           c->termed[i] ? &c->init.term[i] : &c->init.var[i], &c->init.var[i]};
        for (int b = 0; b < 2 + c->termed[i] + c->decayed; b++) {
            *bufs[b] = floats(c->length[i]);
            draw(&content, c, *bufs[b], c->length[i]);
        }
        if (c->weighted[i]) {
            c->init.weights[i] = floats(c->length[i]);
            draw(&content, c, c->init.weights[i], c->length[i]);
        }
        if (c->sums[i]) {
            c->init.sums[i] = floats(2);
            memset(c->init.sums[i], 0xA5, 2 * sizeof(float));
        }
        c->init.u[i] = floats(c->length[i]);
        memset(c->init.u[i], 0xA5, c->length[i] * sizeof(float));
        if (c->sparse[i])
            draw_indices(&content, c, i);
    }
}

/* A fresh copy of the case's buffers, each of its exact size. */
static void copy_state(const fuzz_case *c, state *to)
{
    for (size_t i = 0; i < c->count; i++) {
        const size_t bytes = c->length[i] * sizeof(float);
        to->grad[i] = floats(c->glen[i]);
        to->m[i] = floats(c->length[i]);
        to->v[i] = floats(c->length[i]);
        to->u[i] = floats(c->length[i]);
        memcpy(to->grad[i], c->init.grad[i], c->glen[i] * sizeof(float));
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
        to->weights[i] = NULL;
        if (c->weighted[i]) {
            to->weights[i] = floats(c->length[i]);
            memcpy(to->weights[i], c->init.weights[i], bytes);
        }
        to->sums[i] = NULL;
        if (c->sums[i]) {
            to->sums[i] = floats(2);
            memcpy(to->sums[i], c->init.sums[i], 2 * sizeof(float));
        }
        to->indices[i] = NULL;
        if (c->sparse[i]) {
            const size_t words = (c->slices[i] + 1) * sizeof(int64_t);
            to->indices[i] = malloc(words);
            if (to->indices[i] == NULL)
                fail("out of memory");
            memcpy(to->indices[i], c->init.indices[i], words);
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
        free(s->indices[i]);
        free(s->weights[i]);
        free(s->sums[i]);
    }
}

/* A sparse gradient's parameters over `s`, with its own fault. */
static void sparse_params(const fuzz_case *c, const state *s, size_t i, ls_lamb_param *q)
{
    const size_t n = c->length[i], rl = c->row_length[i];
    q->indices = s->indices[i];
    q->slices = c->slices[i];
    q->row_length = rl;
    if (c->null_grad[i])
        q->grad = NULL;
    if (c->u_shift[i] != SIZE_MAX)
        q->u = s->grad[i] + c->u_shift[i];
    switch (c->sfault[i]) {
    case SPARSE_NO_INDICES:
        if (c->slices[i] > 0)
            q->indices = NULL;
        break;
    case SPARSE_MISALIGNED:
        q->indices = (const int64_t *)(const void *)((const char *)s->indices[i] + 4);
        break;
    case SPARSE_ON_OTHER: {
        float *const on[4] = {q->m, q->v, q->var != NULL ? q->var : q->m,
                              q->m + (n > 0 ? n - 1 : 0)};
        q->grad = on[c->choice[i]];
        break;
    }
    case SPARSE_HUGE_SLICES:
        q->slices = rl > 0 ? SIZE_MAX / sizeof(int64_t) / rl + 1 : SIZE_MAX;
        break;
    default: break;
    }
}

/* A sums-asking variable's sums and weights over `s` (after every other
 * fault, so that they fall on the buffers the call is given), with its
 * own fault. */
static void sums_params(const fuzz_case *c, const state *s, size_t i, ls_lamb_param *q)
{
    const size_t n = c->length[i];
    const size_t values = c->sparse[i] ? c->slices[i] * c->row_length[i] : n;
    const int last = c->sums_choice[i] & 1, other = c->sums_choice[i] >> 1;
    float *on = NULL; /* the buffer the sums fall on, of `span` floats */
    size_t span = n;
    q->sums = s->sums[i];
    q->weights = s->weights[i];
    switch (c->sums_fault[i]) {
    case SUMS_ON_M: on = other ? s->v[i] : s->m[i]; break;
    case SUMS_ON_U: on = other && q->term != NULL ? (float *)q->term : q->u; break;
    case SUMS_ON_GRAD:
        if (other)
            on = s->var[i] != NULL ? s->var[i] : s->weights[i];
        else if (values > 0) {
            on = s->grad[i];
            span = values;
        }
        break;
    case SUMS_WEIGHTS_ON: {
        const float *const at[4] = {q->u, s->m[i], s->v[i], c->sparse[i] ? q->u : s->grad[i]};
        q->weights = at[c->sums_choice[i]];
        break;
    }
    case SUMS_NO_WEIGHTS: q->weights = NULL; break;
    default: break;
    }
    if (on != NULL && n > 0)
        q->sums = on + (last ? span - 1 : 0);
}

/* The parameters over `s`, with the case's fault. */
static void params_of(const fuzz_case *c, const state *s, ls_lamb_param *p)
{
    for (size_t i = 0; i < c->count; i++) {
        p[i] = (ls_lamb_param){s->grad[i], s->m[i], s->v[i], s->u[i], c->length[i], s->term[i],
                               s->var[i], s->var[i] != NULL ? 1 + (int)(i % 3) : LS_DECAY_NONE,
                               NULL, 0, 0, NULL, NULL};
        if (c->sparse[i])
            sparse_params(c, s, i, &p[i]);
    }
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
    for (size_t i = 0; i < c->count; i++)
        if (c->sums[i])
            sums_params(c, s, i, &p[i]);
}

/* ls_lamb_problem's rules for a sparse gradient's variable, restated
 * (variable 0 with the case's fault too): whether they refuse it. */
static int ref_sparse_problem(const fuzz_case *c, size_t i)
{
    const size_t n = c->length[i], rl = c->row_length[i], s = c->slices[i];
    const enum fault f = i == 0 ? c->fault : FAULT_NONE;
    const enum sparse_fault sf = c->sfault[i];
    if (n == 0)
        return 0;
    if (f == FAULT_NULL_M || f == FAULT_U_ON_M || (i == 0 && c->decayed && c->bad_decay))
        return 1;
    if (c->termed[i] || rl == 0 || n % rl != 0 || sf == SPARSE_MISALIGNED
        || sf == SPARSE_HUGE_SLICES)
        return 1;
    if (s == 0) /* no slices to overlap; but u on the gradient is then on m, v or the variable */
        return f == FAULT_U_IS_GRAD && sf == SPARSE_ON_OTHER;
    return f == FAULT_NULL_GRAD || f == FAULT_U_IS_GRAD || sf == SPARSE_NO_INDICES
           || sf == SPARSE_INDEX_HIGH || sf == SPARSE_INDEX_NEGATIVE || sf == SPARSE_ON_OTHER
           || (sf == SPARSE_U_OVER && c->u_shift[i] < s * rl);
}

/* ls_lamb_problem's rules for a variable's sums, restated (with its
 * own fault): whether they refuse it. */
static int ref_sums_problem(const fuzz_case *c, size_t i)
{
    const size_t values = c->sparse[i] ? c->slices[i] * c->row_length[i] : c->length[i];
    const int u_is_grad = i == 0 && c->fault == FAULT_U_IS_GRAD && !c->sparse[i];
    if (!c->sums[i] || c->length[i] == 0)
        return 0;
    if (c->config.eigen_threads < 1)
        return 1;
    switch (c->sums_fault[i]) {
    case SUMS_ON_M:
    case SUMS_ON_U: return 1;
    case SUMS_ON_GRAD: return c->sums_choice[i] >> 1 || values > 0;
    case SUMS_WEIGHTS_ON:
        return !c->decayed && (c->sums_choice[i] < 3 || c->sparse[i] || u_is_grad);
    case SUMS_NO_WEIGHTS: return !c->decayed;
    default: return 0;
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
    for (size_t i = 0; i < c->count; i++)
        if ((c->sparse[i] && ref_sparse_problem(c, i)) || ref_sums_problem(c, i))
            return 1;
    return !c->sparse[0] && p[0].length > 0
           && (c->fault == FAULT_NULL_GRAD || c->fault == FAULT_NULL_M || c->fault == FAULT_U_ON_M
               || (c->termed[0] && c->term_on_m) || (c->decayed && c->bad_decay));
}

/* A sparse gradient made dense as lossscale.h says, in the floating-point
 * state ref_pass sets: each slice value unscaled as a dense gradient's
 * (divided by the scale), added in slice order onto +0 at its row's
 * place in g, its square (rounded) likewise in t. */
static void densify(const fuzz_case *c, const state *s, size_t i, float *g, float *t)
{
    const size_t rl = c->row_length[i];
    for (size_t e = 0; e < c->length[i]; e++) {
        g[e] = 0.0f;
        t[e] = 0.0f;
    }
    for (size_t k = 0; k < c->slices[i]; k++) {
        const size_t row = (size_t)s->indices[i][k];
        for (size_t col = 0; col < rl; col++) {
            const float value = s->grad[i][k * rl + col];
            const float x = c->config.unscale == LS_UNSCALE_DIVIDE ? value / c->config.scale
                                                                   : value;
            const size_t e = row * rl + col;
            g[e] = g[e] + x;
            t[e] = t[e] + x * x;
        }
    }
}

/* The pass, restated one element at a time in the flags' state, then
 * each variable's sums (at p's sums, which are s's in a valid call) by
 * ls_eigen_full_sum over p's variable and u, which are s's buffers. */
static void ref_pass(const fuzz_case *c, state *s, const ls_lamb_param *p)
{
#ifdef HAVE_MXCSR
    const unsigned saved = _mm_getcsr();
    _mm_setcsr((saved & ~FLUSH_BITS) | ((c->flags & LS_FLUSH_DENORMALS) ? FLUSH_BITS : 0u));
#endif
    const ls_lamb_config *k = &c->config;
    const float wd = k->weight_decay, lr = k->learning_rate;
    const float wd_lr = wd * lr;
    for (size_t i = 0; i < c->count; i++) {
        float *u = c->u_shift[i] != SIZE_MAX                  ? s->grad[i] + c->u_shift[i]
                   : i == 0 && c->fault == FAULT_U_IS_GRAD ? s->grad[0]
                                                           : s->u[i];
        const float *grad = s->grad[i], *t = s->term[i];
        float *w = s->var[i];
        float *dense_g = NULL, *dense_t = NULL;
        if (c->sparse[i] && c->length[i] > 0) {
            dense_g = floats(c->length[i]);
            dense_t = floats(c->length[i]);
            densify(c, s, i, dense_g, dense_t);
            grad = dense_g;
            t = dense_t;
        }
        for (size_t e = 0; e < c->length[i]; e++) {
            if (w != NULL) {
                const int form = 1 + (int)(i % 3);
                w[e] = form == 1 ? w[e] - (w[e] * wd) * lr
                       : form == 2 ? w[e] - w[e] * wd_lr
                                   : w[e] - w[e] * wd;
            }
            const float g = grad[e];
            const float x = t == NULL && k->unscale == LS_UNSCALE_DIVIDE ? g / k->scale : g;
            const float m = s->m[i][e] + (x - s->m[i][e]) * k->one_minus_beta_1;
            const float v = s->v[i][e] + ((t != NULL ? t[e] : x * x) - s->v[i][e])
                                             * k->one_minus_beta_2;
            s->m[i][e] = m;
            s->v[i][e] = v;
            u[e] = (m / k->bias_1) / (sqrtf(v / k->bias_2) + k->epsilon);
        }
        free(dense_g);
        free(dense_t);
    }
    for (size_t i = 0; i < c->count; i++) {
        const size_t n = c->length[i];
        const float *w = p[i].var != NULL ? p[i].var : p[i].weights;
        if (p[i].sums == NULL)
            continue;
        p[i].sums[0] = n > 0 ? ls_eigen_full_sum(w, n, 1, k->eigen_threads) : 0.0f;
        p[i].sums[1] = n > 0 ? ls_eigen_full_sum(p[i].u, n, 1, k->eigen_threads) : 0.0f;
    }
#ifdef HAVE_MXCSR
    _mm_setcsr(saved);
#endif
}

/* Every buffer of a and b: 0 the gradient's, m, v, u, the term, the
 * variable, the weights, 7 the sums. */
static void compare(const fuzz_case *c, const state *a, const state *b, const char *what)
{
    for (size_t i = 0; i < c->count; i++) {
        const float *pa[8] = {a->grad[i], a->m[i],   a->v[i],       a->u[i],
                              a->term[i], a->var[i], a->weights[i], a->sums[i]};
        const float *pb[8] = {b->grad[i], b->m[i],   b->v[i],       b->u[i],
                              b->term[i], b->var[i], b->weights[i], b->sums[i]};
        const size_t n = c->length[i];
        const size_t length[8] = {c->glen[i], n, n, n, n, n, n, 2};
        for (int t = 0; t < 8; t++)
            for (size_t e = 0; pa[t] != NULL && e < length[t]; e++)
                if (!same(pa[t][e], pb[t][e])) {
                    snprintf(detail, sizeof detail, "(variable %zu, buffer %d, element %zu: "
                             "%08x against %08x)", i, t, e, bits_of(pa[t][e]), bits_of(pb[t][e]));
                    fail(what);
                }
        if (a->indices[i] != NULL
            && memcmp(a->indices[i], b->indices[i], (c->slices[i] + 1) * sizeof(int64_t)) != 0) {
            snprintf(detail, sizeof detail, "(variable %zu, its indices)", i);
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
        ref_pass(&c, &ref, ref_p);
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
