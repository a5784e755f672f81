/*
 * Coverage-guided fuzz target over TensorFlow's sums of squares
 * (ls_squared_norms_with, ls_norm_bad_index).
 *
 * One input describes a list of gradients, dense or sparse (a table's row
 * count and row length, slices and their indices: mostly rows, some
 * repeated, one past the table, negative or far off, sorted or not), the
 * unscale mode, the scale (raw bits: non-finite, zero, negative,
 * subnormal and huge ones come up), Eigen's thread count, the flags (an
 * unknown bit among them), the library's threads, the caller's FTZ/DAZ
 * state, cut points for a host's parallel-for and at most one deliberate
 * fault.  Checked:
 *   - each sum equals, bit for bit (a NaN need only be a NaN: which NaN an
 *     addition keeps depends on its operands' order, which a compiler may
 *     swap), this file's own restatement of lossscale.h's order, written
 *     plainly: each value's square as the mode computes it, a sparse
 *     gradient's whole table made (each cell 0 plus its slices' squares in
 *     their order), Eigen's shards from its cost model, each range a
 *     recursive tree over leaves of at most 8,192 values, a leaf's four
 *     8-lane accumulators as arrays (restated_sums.h, which
 *     fuzz_adafactor.c shares), all in the floating-point state the flags
 *     name, set here;
 *   - the call is refused (LS_ERR_ARG) exactly when this file's
 *     restatement of the rules refuses it, and then `sums` keeps every bit
 *     and the parallel-for never runs;
 *   - the library's threads and a host's parallel-for that runs the job
 *     in uneven pieces (each leaf belongs to the piece it starts in), in
 *     order or last to first, give the same bits;
 *   - ls_norm_bad_index names the first slice outside the table, or -1;
 *   - no float past `sums` is written, and the caller's floating-point
 *     control state comes back.
 * The values and indices are allocated to their exact size, so that the
 * sanitizers see any read past them.
 *
 * Input layout (little-endian; a short input reads as if padded with
 * zeros):
 *   0      mode: bits 0-1 unscale (ls_unscale_mode; 3 is none), bit 2
 *          LS_FLUSH_DENORMALS, bit 3 LS_CHECK_INPUTS too (a flag other
 *          entry points take and this one refuses), bit 4 the caller runs
 *          with FTZ/DAZ, bit 5 values as raw float32 bits (else 2-byte
 *          codes, see value_of), bits 6-7 the library's threads less 1
 *   1      eigen_threads: below 240, 1 + byte % 8; 254 INT_MIN, 255
 *          INT_MAX; else byte - 248 (-8..5: zero and below are refused)
 *   2..9   scale (double)
 *   10     gradients: byte % 5
 *   11     bits 0-2 fault (enum fault), bits 3-5 cut points for the host's
 *          parallel-for, bit 6 its pieces run last to first, bit 7 the
 *          2-byte codes' special values include those whose squares are
 *          not finite (see value_of)
 *   12..39 the cut points (u32 each): position = value % (elements + 1)
 *   then per gradient 6 bytes: form (bit 0 sparse, bits 1-2 size class,
 *          bit 3 a sparse length one off slices * row length, bit 4 one
 *          more (else one less), bit 5 no values pointer when there are no
 *          values, bit 6 indices sorted, bit 7 indices crowded onto the
 *          first rows: many repeats), L (u16), W, S, X (a byte each):
 *            dense length by class: L % 320, L % 40000, 4 L + X % 4
 *              (up to 262,143: two shards from 258,462 on),
 *              200,000 + 16 L + X % 16 (up to 1,248,575: every shard count)
 *            sparse rows, row length by class: L % 64, W % 17; L % 4096,
 *              W % 33; L % 16384, W % 65; L, W % 33; slices S % 128
 *          every input's gradients together at most MAX_VALUES values
 *          (dense, or a sparse gradient's table): a later one is cut down
 *   then the content, handed out in order and repeated from its start
 *   (zero bytes when there is none): each sparse gradient's indices (8 bytes
 *   each: modulo rows + 1, the last value one past the table, or with
 *   form bit 7 modulo rows / 8 + 2; unless the top byte is 0x7F, 0x80 or
 *   0xFF: the raw value, far off or negative), then its values.
 */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lossscale_chunks.h"

enum {
    MAX_GRADS = 4,
    MAX_CUTS = 7,
    /* Enough for every shard count Eigen picks at 8 threads (from about
     * 997,000 values on), small enough for a fast run. */
    MAX_VALUES = 1500000
};

enum fault {
    FAULT_NONE = 0,
    FAULT_NULL_PARAMS, /* params NULL: refused unless there are none */
    FAULT_NULL_SUMS,   /* sums NULL: likewise */
    FAULT_NULL_VALUES, /* gradient 0 without values: refused when it has any */
    FAULT_HUGE_LENGTH, /* gradient 0 longer than memory (sparse: more slices
                          than size_t counts values of): refused, unread */
    FAULT_HUGE_ROWS,   /* gradient 0's table larger than memory: refused */
    FAULT_COUNT
};

static char detail[200];

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_norms: %s %s\n", what, detail);
    abort();
}

/* the readers, value_of, ref_sum, control_state, piece_parallel */
#include "restated_sums.h"

/* ------------------------------------------------------------ the case */

typedef struct grad_spec {
    int sparse, off_by_one, null_when_empty;
    size_t length, rows, row_length, slices;
} grad_spec;

typedef struct fuzz_case {
    int unscale, caller_flush, raw_values, wild, lib_threads, eigen_threads, reverse;
    unsigned flags;
    double scale;
    size_t count, ncuts;
    enum fault fault;
    uint32_t cuts[MAX_CUTS];
    grad_spec g[MAX_GRADS];
    /* what each gradient was given, and the pointers the call sees */
    float *values[MAX_GRADS];
    int64_t *indices[MAX_GRADS];
    ls_norm_param params[MAX_GRADS];
} fuzz_case;

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

static int cmp_index(const void *a, const void *b)
{
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void decode(const uint8_t *data, size_t size, fuzz_case *c)
{
    memset(c, 0, sizeof *c);
    reader r = {data, size, 0};
    const uint8_t mode = next_byte(&r);
    c->unscale = mode & 3;
    c->flags = ((mode >> 2) & 1 ? LS_FLUSH_DENORMALS : 0u) | ((mode >> 3) & 1 ? LS_CHECK_INPUTS : 0u);
    c->caller_flush = (mode >> 4) & 1;
    c->raw_values = (mode >> 5) & 1;
    c->lib_threads = 1 + (mode >> 6);
    const uint8_t threads = next_byte(&r);
    c->eigen_threads = threads < 240   ? 1 + threads % 8
                       : threads == 254 ? INT_MIN
                       : threads == 255 ? INT_MAX
                                        : (int)threads - 248;
    const uint64_t scale_bits = next_le(&r, 8);
    memcpy(&c->scale, &scale_bits, sizeof c->scale);
    c->count = next_byte(&r) % (MAX_GRADS + 1);
    const uint8_t split = next_byte(&r);
    c->fault = (enum fault)(split & 7);
    if (c->fault >= FAULT_COUNT)
        c->fault = FAULT_NONE;
    c->ncuts = (split >> 3) & 7;
    c->reverse = (split >> 6) & 1;
    c->wild = split >> 7;
    for (int i = 0; i < MAX_CUTS; i++)
        c->cuts[i] = (uint32_t)next_le(&r, 4);

    size_t budget = MAX_VALUES;
    uint8_t order[MAX_GRADS] = {0};
    for (size_t i = 0; i < c->count; i++) {
        grad_spec *g = &c->g[i];
        const uint8_t form = next_byte(&r);
        const size_t L = (size_t)next_le(&r, 2);
        const uint8_t W = next_byte(&r), S = next_byte(&r), X = next_byte(&r);
        const int size_class = (form >> 1) & 3;
        g->sparse = form & 1;
        g->off_by_one = (form >> 3) & 1 ? ((form >> 4) & 1 ? 1 : -1) : 0;
        g->null_when_empty = (form >> 5) & 1;
        order[i] = form >> 6; /* bit 0 sorted, bit 1 crowded */
        if (!g->sparse) {
            const size_t n = size_class == 0   ? L % 320
                             : size_class == 1 ? L % 40000
                             : size_class == 2 ? 4 * L + X % 4
                                               : 200000 + 16 * L + X % 16;
            g->length = min_size(n, budget);
            budget -= g->length;
            continue;
        }
        static const size_t rows_mod[4] = {64, 4096, 16384, 65536};
        static const size_t width_mod[4] = {17, 33, 65, 33};
        g->rows = L % rows_mod[size_class];
        g->row_length = W % width_mod[size_class];
        if (g->row_length > 0) {
            g->rows = min_size(g->rows, budget / g->row_length);
            budget -= g->rows * g->row_length;
        }
        g->slices = S % 128;
        g->length = g->slices * g->row_length;
        if (g->off_by_one > 0 || (g->off_by_one < 0 && g->length == 0))
            g->length++;
        else if (g->off_by_one < 0)
            g->length--;
    }

    stream s = {r.at < size ? data + r.at : NULL, r.at < size ? size - r.at : 0, 0};
    for (size_t i = 0; i < c->count; i++) {
        grad_spec *g = &c->g[i];
        ls_norm_param *p = &c->params[i];
        if (g->sparse) {
            /* never empty: indices NULL would make the gradient dense */
            c->indices[i] = malloc((g->slices > 0 ? g->slices : 1) * sizeof(int64_t));
            if (c->indices[i] == NULL)
                fail("out of memory");
            const uint64_t crowd = g->rows / 8 + 2;
            for (size_t k = 0; k < g->slices; k++) {
                uint64_t raw = stream_le(&s, 8);
                if (raw >> 56 != 0xFF && raw >> 56 != 0x7F && raw >> 56 != 0x80)
                    raw %= (order[i] & 2) ? crowd : (uint64_t)g->rows + 1;
                memcpy(&c->indices[i][k], &raw, 8);
            }
            if (order[i] & 1)
                qsort(c->indices[i], g->slices, sizeof(int64_t), cmp_index);
        }
        c->values[i] = malloc(g->length > 0 ? g->length * sizeof(float) : 1);
        if (c->values[i] == NULL)
            fail("out of memory");
        /* s.n values take whole turns of the content: from there on the
         * values repeat, copied rather than decoded again */
        const size_t period = s.n > 0 ? s.n : 1, start = s.at;
        const int width = c->raw_values ? 4 : 2;
        const size_t decoded = min_size(g->length, period);
        for (size_t k = 0; k < decoded; k++)
            c->values[i][k] = c->raw_values ? from_bits((uint32_t)stream_le(&s, 4))
                                            : value_of((uint16_t)stream_le(&s, 2), c->wild);
        for (size_t filled = decoded; filled < g->length;) {
            const size_t more = min_size(filled, g->length - filled); /* whole periods */
            memcpy(c->values[i] + filled, c->values[i], more * sizeof(float));
            filled += more;
        }
        if (s.n > 0)
            s.at = (size_t)((start + (uint64_t)g->length * (uint64_t)width) % s.n);
        p->values = g->length == 0 && g->null_when_empty ? NULL : c->values[i];
        p->length = g->length;
        p->indices = c->indices[i];
        p->slices = g->slices;
        p->row_length = g->row_length;
        p->rows = g->rows;
    }
    if (c->count > 0) {
        ls_norm_param *p = &c->params[0];
        switch (c->fault) {
        case FAULT_NULL_VALUES:
            p->values = NULL;
            break;
        case FAULT_HUGE_LENGTH:
            if (p->indices == NULL)
                p->length = SIZE_MAX / sizeof(float) + 1;
            else if (p->row_length > 0)
                p->slices = SIZE_MAX / p->row_length + 1;
            else
                p->length = 1;
            break;
        case FAULT_HUGE_ROWS:
            if (p->indices != NULL && p->row_length > 0)
                p->rows = SIZE_MAX / sizeof(float) / p->row_length + 1;
            break;
        default:
            break;
        }
    }
}

static void case_free(fuzz_case *c)
{
    for (size_t i = 0; i < c->count; i++) {
        free(c->values[i]);
        free(c->indices[i]);
    }
}

/* ------------------------------------------- the reference: plain C */

/* lossscale.h's rules for a call, apart from the core's checks: the
 * arguments, then each gradient (its buffers given, its sizes within
 * size_t, a sparse one's values slices * row length, its table's bytes
 * countable, every index a row), then the elements of all of them
 * countable.  Only the indices a gradient was given are read: a count
 * past them (FAULT_HUGE_LENGTH) is refused on its size first. */
static int ref_valid(const fuzz_case *c, const ls_norm_param *params, const float *sums)
{
    if (c->count > 0 && (params == NULL || sums == NULL))
        return 0;
    if (c->eigen_threads < 1 || (c->flags & ~(unsigned)LS_FLUSH_DENORMALS) != 0)
        return 0;
    if (c->unscale != LS_UNSCALE_NONE && c->unscale != LS_UNSCALE_DIVIDE &&
        c->unscale != LS_UNSCALE_MULTIPLY)
        return 0;
    /* the scale itself finite and > 0, as the optimizer's check has it */
    if (c->unscale == LS_UNSCALE_MULTIPLY && !(c->scale > 0 && isfinite(c->scale)))
        return 0;
    const size_t max_floats = SIZE_MAX / sizeof(float);
    size_t total = 0;
    for (size_t i = 0; i < c->count; i++) {
        const ls_norm_param *p = &params[i];
        if (p->length > 0 && p->values == NULL)
            return 0;
        size_t n = p->length;
        if (p->indices != NULL) {
            const size_t w = p->row_length;
            if (w > 0 && (p->slices > SIZE_MAX / w || p->rows > max_floats / w))
                return 0;
            if (p->slices * w != p->length)
                return 0;
            if (p->slices > c->g[i].slices)
                fail("a case with more slices than indices got this far");
            for (size_t k = 0; k < p->slices; k++)
                if (p->indices[k] < 0 || (uint64_t)p->indices[k] >= (uint64_t)p->rows)
                    return 0;
            n = p->rows * w;
        } else if (n > max_floats) {
            return 0;
        }
        if (n > SIZE_MAX - total)
            return 0;
        total += n;
    }
    return 1;
}

/* The first slice naming no row of the table, or -1. */
static long long ref_bad_index(const ls_norm_param *p)
{
    if (p->indices == NULL)
        return -1;
    for (size_t k = 0; k < p->slices; k++)
        if (p->indices[k] < 0 || (uint64_t)p->indices[k] >= (uint64_t)p->rows)
            return (long long)k;
    return -1;
}

static float ref_square(float x, int unscale, float k)
{
    float u = x;
    if (unscale == LS_UNSCALE_DIVIDE)
        u = x / k;
    else if (unscale == LS_UNSCALE_MULTIPLY)
        u = x * k;
    return u * u;
}

/* Every gradient's sum, in whatever floating-point state the caller set;
 * not inlined, so that no operation moves across that setting. */
static __attribute__((noinline)) void ref_sums(const fuzz_case *c, float *out)
{
    const float scale32 = (float)c->scale;
    const float k = c->unscale == LS_UNSCALE_MULTIPLY ? 1.0f / scale32 : scale32;
    for (size_t i = 0; i < c->count; i++) {
        const ls_norm_param *p = &c->params[i];
        const size_t n = p->indices != NULL ? p->rows * p->row_length : p->length;
        float *table = calloc(n > 0 ? n : 1, sizeof(float)); /* every cell +0 */
        if (table == NULL)
            fail("out of memory");
        if (p->indices == NULL) {
            for (size_t e = 0; e < n; e++)
                table[e] = ref_square(p->values[e], c->unscale, k);
        } else {
            const size_t w = p->row_length;
            for (size_t s = 0; s < p->slices; s++)
                for (size_t e = 0; e < w; e++) {
                    float *cell = &table[(size_t)p->indices[s] * w + e];
                    *cell = *cell + ref_square(p->values[s * w + e], c->unscale, k);
                }
        }
        out[i] = ref_sum(table, n, c->eigen_threads);
        free(table);
    }
}

/* ------------------------------------- floating-point state, by hand */

/* The reference in the state the flags name: FTZ and DAZ both, or
 * neither (IEEE), whatever the caller runs with. */
static void ref_sums_in_state(const fuzz_case *c, float *out)
{
    const int flush = (c->flags & LS_FLUSH_DENORMALS) != 0;
#ifdef HAVE_MXCSR
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(flush ? saved | FLUSH_BITS : saved & ~FLUSH_BITS);
    ref_sums(c, out);
    _mm_setcsr(saved);
#else
    ls_fpenv env;
    ls_fpenv_enter(&env, flush);
    ref_sums(c, out);
    ls_fpenv_leave(&env);
#endif
}

/* ------------------------------------------------------------ the run */

/* A signalling NaN: arithmetic returns quiet ones, so no sum is this. */
static const uint32_t SENTINEL = 0x7FA5A5A5u;

static float *sums_new(size_t count)
{
    /* a guard float on either side */
    float *s = malloc((count + 2) * sizeof(float));
    if (s == NULL)
        fail("out of memory");
    for (size_t i = 0; i < count + 2; i++)
        s[i] = from_bits(SENTINEL);
    return s;
}

static void check_guards(const float *s, size_t count, int untouched)
{
    for (size_t i = 0; i < count + 2; i++)
        if ((i == 0 || i == count + 1 || untouched) && bits_of(s[i]) != SENTINEL) {
            snprintf(detail, sizeof detail, "(float %zu of %zu + 2)", i, count);
            fail(untouched ? "a refused call wrote a sum" : "a float outside `sums` was written");
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

    float *own = sums_new(c.count), *hosted = sums_new(c.count);
    const ls_norm_param *params = c.fault == FAULT_NULL_PARAMS ? NULL : c.params;
    float *own_out = c.fault == FAULT_NULL_SUMS ? NULL : own + 1;
    float *hosted_out = c.fault == FAULT_NULL_SUMS ? NULL : hosted + 1;
    const int valid = ref_valid(&c, params, own_out);

    /* the library's threads */
    const int rc = ls_squared_norms_with(params, c.count, c.unscale, c.scale, c.eigen_threads,
                                         c.flags, own_out, NULL, NULL);
    if (control_state() != caller)
        fail("the caller's floating-point control state was not restored");
    snprintf(detail, sizeof detail, "(status %d)", rc);
    if (valid ? rc != LS_OK : rc != LS_ERR_ARG)
        fail(valid ? "a valid call was refused" : "an invalid call was not refused");
    check_guards(own, c.count, !valid);

    /* a host's parallel-for, in pieces */
    piece_host host = {c.cuts, c.ncuts, c.reverse, 0};
    const int hrc = ls_squared_norms_with(params, c.count, c.unscale, c.scale, c.eigen_threads,
                                          c.flags, hosted_out, piece_parallel, &host);
    if (control_state() != caller)
        fail("the caller's floating-point control state was not restored");
    snprintf(detail, sizeof detail, "(status %d, %d calls)", hrc, host.calls);
    if (hrc != rc)
        fail("the host's parallel-for changed the status");
    if (valid ? host.calls != (c.count > 0) : host.calls != 0)
        fail(valid ? "the parallel-for did not run once" : "the parallel-for ran on a refused call");
    check_guards(hosted, c.count, !valid);

    for (size_t i = 0; i < c.count; i++) {
        if (i == 0 && c.fault == FAULT_HUGE_LENGTH) /* more slices than it has */
            continue;
        const long long bad = ls_norm_bad_index(&c.params[i]), want = ref_bad_index(&c.params[i]);
        snprintf(detail, sizeof detail, "(gradient %zu: %lld, not %lld)", i, bad, want);
        if (bad != want)
            fail("ls_norm_bad_index");
    }
    if (ls_norm_bad_index(NULL) != -1)
        fail("ls_norm_bad_index(NULL)");

    if (valid && c.count > 0) {
        float ref[MAX_GRADS];
        ref_sums_in_state(&c, ref);
        for (size_t i = 0; i < c.count; i++) {
            const ls_norm_param *p = &c.params[i];
            snprintf(detail, sizeof detail,
                     "(gradient %zu, %s, %zu values: %a, host %a, reference %a)", i,
                     p->indices != NULL ? "sparse" : "dense",
                     p->indices != NULL ? p->rows * p->row_length : p->length,
                     (double)own_out[i], (double)hosted_out[i], (double)ref[i]);
            if (bits_of(own_out[i]) == SENTINEL || bits_of(hosted_out[i]) == SENTINEL)
                fail("a sum was not written");
            if (bits_of(own_out[i]) != bits_of(hosted_out[i]))
                fail("the host's pieces and the library's threads differ");
            if (!same(own_out[i], ref[i]))
                fail("the sum differs from the reference");
        }
    }

    free(own);
    free(hosted);
    case_free(&c);
#ifdef HAVE_MXCSR
    _mm_setcsr(saved_csr);
#endif
    return 0;
}
