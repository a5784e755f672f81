/*
 * Coverage-guided fuzz target over the core's buffer entry points.
 *
 * One input describes a list of buffers (dtype, length, start offsets,
 * in place or not, raw bytes), an inverse scale, the flags, the caller's
 * floating-point state, a thread count, cut points for the range entry
 * points and at most one deliberate fault.  Every entry point runs on it:
 * ls_unscale and ls_all_finite (dispatched kernel set, library threads),
 * their _range variants over the cuts, their _with variants on a host
 * parallel-for that runs the cuts last to first, and every kernel set this
 * CPU runs called directly.  Each answer must equal the scalar set's, bit for bit
 * (NaN payloads included: the SIMD sets promise the scalar set's bits, and
 * tests/test_core_simd.py holds them to it); every byte outside the
 * destinations, and every destination of a rejected call, must be left as
 * it was; the caller's floating-point control state must come back
 * unchanged.  A failure aborts, which libFuzzer (or the replay driver)
 * reports with the input that caused it.
 *
 * Input layout (little-endian; a short input reads as if padded with
 * zeros), mirrored by tests/test_fuzz_regressions.py:
 *   0      mode: bit 0 LS_FLUSH_DENORMALS, bit 1 LS_CHECK_INPUTS,
 *                bit 2 caller runs with FTZ/DAZ set, bit 3 a big first
 *                buffer (see below: long enough for 2-4 thread-pool parts),
 *                bits 4-7 thread count (0: the default)
 *   1..8   inv_scale, an IEEE double
 *   9      buffers: 1 + (byte % 4)
 *   10     cuts: byte % 8 cut points for the range entry points
 *   11     fault: see enum fault
 *   then per buffer 5 bytes:
 *          dtype (bits 0-1), in place (bit 2), NULL pointers when empty
 *          (bit 3); src offset (% 64); dst offset (% 64); length L (u16 % 4096),
 *          for a big first buffer 65536 * (1 + L % 4) + L / 4
 *   then one byte per cut: position = byte * total / 255
 *   then the content, handed out to the buffers in order and repeated
 *   from its start when it runs out (zeros when there is none).
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lossscale_chunks.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_MXCSR 1
#endif

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HAVE_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define HAVE_ASAN 1
#endif
#ifdef HAVE_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* A big buffer is long enough for the thread pool: 2^16 elements per part. */
enum { MAX_BUFS = 4, MAX_CUTS = 7, MAX_LENGTH = 4095, BIG_UNIT = 65536, GUARD = 0xA5, TAIL = 64 };

enum fault {
    FAULT_NONE = 0,
    FAULT_FLAG,     /* an unknown flag bit: LS_ERR_ARG */
    FAULT_DTYPE,    /* buffer 0 has no dtype: LS_ERR_DTYPE */
    FAULT_NULL_SRC, /* buffer 0 has length but no source: LS_ERR_ARG */
    FAULT_OVERLAP,  /* buffer 0's destination overlaps its source in part: LS_ERR_ARG
                       (unscale only) */
    FAULT_NAN_SCALE, /* LS_ERR_ARG (unscale only) */
    FAULT_INF_SCALE, /* LS_ERR_ARG (unscale only) */
    FAULT_COUNT
};

static void fail(const char *what, size_t buf, size_t elem)
{
    fprintf(stderr, "fuzz_core: %s (buffer %zu, element %zu)\n", what, buf, elem);
    abort();
}

#define REQUIRE(cond, what)          \
    do {                             \
        if (!(cond))                 \
            fail((what), 0, 0);      \
    } while (0)

/* Reads the input front to back; past its end every byte is zero. */
typedef struct reader {
    const uint8_t *p;
    size_t n, at;
} reader;

static uint8_t byte_at(reader *r)
{
    return r->at < r->n ? r->p[r->at++] : (r->at++, 0);
}

/* One buffer of the case and the memory behind it: guard bytes before it
 * (the start offset) and after it, poisoned, so that ASan reports any
 * instrumented access outside the buffer, and checked after every call,
 * for the accesses it does not instrument (gcc leaves AVX-512 masked loads
 * and stores alone). */
typedef struct region {
    uint8_t *base;
    size_t lead, bytes;
} region;

typedef struct spec {
    ls_dtype dtype;
    int in_place, null_when_empty;
    size_t src_offset, dst_offset, length;
} spec;

typedef struct fuzz_case {
    unsigned flags;
    int caller_flush, big, threads;
    double inv_scale;
    size_t count, ncuts;
    enum fault fault;
    spec specs[MAX_BUFS];
    size_t cuts[MAX_CUTS + 2]; /* 0, the cuts sorted, total */
    size_t total;
    const uint8_t *content;
    size_t content_len;
} fuzz_case;

static void decode(const uint8_t *data, size_t size, fuzz_case *c)
{
    reader r = {data, size, 0};
    uint8_t mode = byte_at(&r);
    c->flags = mode & 3u;
    c->caller_flush = (mode >> 2) & 1;
    c->big = (mode >> 3) & 1;
    c->threads = mode >> 4;
    uint8_t raw[8];
    for (int i = 0; i < 8; i++)
        raw[i] = byte_at(&r);
    uint64_t bits = 0;
    for (int i = 7; i >= 0; i--)
        bits = bits << 8 | raw[i];
    memcpy(&c->inv_scale, &bits, sizeof bits);
    c->count = 1 + byte_at(&r) % MAX_BUFS;
    c->ncuts = byte_at(&r) % (MAX_CUTS + 1);
    c->fault = (enum fault)(byte_at(&r) % 16);
    if (c->fault >= FAULT_COUNT)
        c->fault = FAULT_NONE;
    c->total = 0;
    for (size_t i = 0; i < c->count; i++) {
        spec *s = &c->specs[i];
        uint8_t b0 = byte_at(&r);
        s->dtype = (ls_dtype)(b0 & 3u);
        s->in_place = (b0 >> 2) & 1;
        s->null_when_empty = (b0 >> 3) & 1;
        s->src_offset = byte_at(&r) % 64;
        s->dst_offset = byte_at(&r) % 64;
        size_t lo = byte_at(&r), hi = byte_at(&r);
        s->length = (lo | hi << 8) % (MAX_LENGTH + 1);
        if (c->big && i == 0)
            s->length = BIG_UNIT * (1 + s->length % 4) + s->length / 4;
        c->total += s->length;
    }
    c->cuts[0] = 0;
    for (size_t i = 0; i < c->ncuts; i++)
        c->cuts[i + 1] = (size_t)byte_at(&r) * c->total / 255;
    for (size_t i = 1; i <= c->ncuts; i++) /* insertion sort: at most 7 */
        for (size_t j = i; j > 1 && c->cuts[j - 1] > c->cuts[j]; j--) {
            size_t t = c->cuts[j];
            c->cuts[j] = c->cuts[j - 1];
            c->cuts[j - 1] = t;
        }
    c->cuts[c->ncuts + 1] = c->total;
    c->content = r.at < size ? data + r.at : NULL;
    c->content_len = r.at < size ? size - r.at : 0;
}

static region region_new(size_t lead, size_t bytes)
{
    region g = {NULL, lead, bytes};
    void *p = NULL;
    /* 64-byte aligned base: `lead` alone decides where the region starts
     * relative to vector and cache-line boundaries */
    if (posix_memalign(&p, 64, lead + bytes + TAIL) != 0)
        abort();
    g.base = (uint8_t *)p;
    memset(g.base, GUARD, lead);
    memset(g.base + lead + bytes, GUARD, TAIL);
    return g;
}

static uint8_t *region_data(const region *g) { return g->base + g->lead; }

static void region_guard(region *g)
{
    POISON(g->base, g->lead);
    POISON(g->base + g->lead + g->bytes, TAIL);
}

static void region_unguard(region *g)
{
    UNPOISON(g->base, g->lead);
    UNPOISON(g->base + g->lead + g->bytes, TAIL);
}

static void region_check_guard(region *g, size_t buf)
{
    region_unguard(g);
    for (size_t i = 0; i < g->lead; i++)
        if (g->base[i] != GUARD)
            fail("write before a buffer", buf, i);
    for (size_t i = 0; i < TAIL; i++)
        if (g->base[g->lead + g->bytes + i] != GUARD)
            fail("write past a buffer", buf, i);
    region_guard(g);
}

static void region_free(region *g)
{
    region_unguard(g);
    free(g->base);
}

/* The memory of one run: source and destination regions per buffer,
 * filled from the case's content. */
typedef struct arena {
    region src[MAX_BUFS], dst[MAX_BUFS];
    ls_buffer bufs[MAX_BUFS];
} arena;

static void fill(const fuzz_case *c, size_t buf, uint8_t *out, size_t bytes)
{
    /* every buffer starts where the previous one ended in the content */
    size_t start = 0;
    for (size_t i = 0; i < buf; i++)
        start += c->specs[i].length * ls_dtype_size(c->specs[i].dtype);
    if (c->content_len == 0) {
        memset(out, 0, bytes);
        return;
    }
    size_t at = start % c->content_len;
    for (size_t done = 0; done < bytes;) {
        size_t run = c->content_len - at < bytes - done ? c->content_len - at : bytes - done;
        memcpy(out + done, c->content + at, run);
        done += run;
        at = 0;
    }
}

static void arena_new(const fuzz_case *c, arena *a, int inject)
{
    for (size_t i = 0; i < c->count; i++) {
        const spec *s = &c->specs[i];
        size_t bytes = s->length * ls_dtype_size(s->dtype);
        a->src[i] = region_new(s->src_offset, bytes);
        fill(c, i, region_data(&a->src[i]), bytes);
        if (s->in_place)
            a->dst[i] = a->src[i];
        else
            a->dst[i] = region_new(s->dst_offset, bytes);
        if (!s->in_place)
            memset(region_data(&a->dst[i]), GUARD, bytes);
        ls_buffer *b = &a->bufs[i];
        b->src = region_data(&a->src[i]);
        b->dst = region_data(&a->dst[i]);
        b->length = s->length;
        b->dtype = s->dtype;
        if (s->length == 0 && s->null_when_empty)
            b->src = b->dst = NULL;
    }
    if (inject) {
        ls_buffer *b = &a->bufs[0];
        switch (c->fault) {
        case FAULT_DTYPE:
            b->dtype = (ls_dtype)(LS_NUM_DTYPES + (c->specs[0].src_offset & 7));
            break;
        case FAULT_NULL_SRC:
            b->src = NULL;
            break;
        case FAULT_OVERLAP:
            /* one element on: the last destination element is in the
             * source's tail guard, so a write that got through is seen */
            if (b->length > 1)
                b->dst = (uint8_t *)b->src + ls_dtype_size(b->dtype);
            break;
        default:
            break;
        }
    }
    for (size_t i = 0; i < c->count; i++) {
        region_guard(&a->src[i]);
        if (!c->specs[i].in_place)
            region_guard(&a->dst[i]);
    }
}

static void arena_free(const fuzz_case *c, arena *a)
{
    for (size_t i = 0; i < c->count; i++) {
        region_free(&a->src[i]);
        if (!c->specs[i].in_place)
            region_free(&a->dst[i]);
    }
}

static int finite_double(double x) { return x == x && x - x == 0.0; }

/* Whether the call is one the entry point must refuse: the fault, or an
 * inverse scale from the input that is not finite.  Several reasons may
 * hold at once; the entry point may report any of them. */
enum { REFUSE_ARG = 1, REFUSE_DTYPE = 2 };

static int refusals(const fuzz_case *c, int unscale)
{
    int why = unscale && !finite_double(c->inv_scale) ? REFUSE_ARG : 0;
    switch (c->fault) {
    case FAULT_FLAG:
        return why | REFUSE_ARG;
    case FAULT_DTYPE:
        return why | REFUSE_DTYPE;
    case FAULT_NULL_SRC:
        return why | (c->specs[0].length > 0 ? REFUSE_ARG : 0);
    case FAULT_OVERLAP:
        return why | (unscale && c->specs[0].length > 1 ? REFUSE_ARG : 0);
    case FAULT_NAN_SCALE:
    case FAULT_INF_SCALE:
        return why | (unscale ? REFUSE_ARG : 0);
    default:
        return why;
    }
}

static int refused_as_expected(int why, int rc)
{
    return (rc == LS_ERR_ARG && (why & REFUSE_ARG)) || (rc == LS_ERR_DTYPE && (why & REFUSE_DTYPE));
}

static unsigned call_flags(const fuzz_case *c)
{
    return c->fault == FAULT_FLAG ? c->flags | (1u << (2 + (c->specs[0].dst_offset & 7)))
                                  : c->flags;
}

static double call_scale(const fuzz_case *c)
{
    if (c->fault == FAULT_NAN_SCALE)
        return __builtin_nan("");
    if (c->fault == FAULT_INF_SCALE)
        return c->inv_scale < 0 ? -__builtin_inf() : __builtin_inf();
    return c->inv_scale;
}

/* ------------------------------------------------ the caller's fp state */

static unsigned caller_state_enter(const fuzz_case *c)
{
#ifdef HAVE_MXCSR
    unsigned saved = _mm_getcsr();
    _mm_setcsr(c->caller_flush ? saved | 0x8040u : saved & ~0x8040u);
    return saved;
#else
    (void)c;
    return 0;
#endif
}

static void caller_state_check(unsigned saved, const fuzz_case *c)
{
#ifdef HAVE_MXCSR
    unsigned want = c->caller_flush ? saved | 0x8040u : saved & ~0x8040u;
    /* exception flags are sticky status, not control state */
    if ((_mm_getcsr() & ~0x3fu) != (want & ~0x3fu))
        fail("caller's MXCSR control bits changed", 0, 0);
    _mm_setcsr(saved);
#else
    (void)saved;
    (void)c;
#endif
}

/* ------------------------------------------------------------ compare */

/* The reference: the scalar set over the whole list, out of place. */
typedef struct reference {
    uint8_t *out[MAX_BUFS];
    int unscale_finite, inputs_finite;
} reference;

static void reference_run(const fuzz_case *c, reference *ref)
{
    arena a;
    arena_new(c, &a, 0);
    ls_buffer bufs[MAX_BUFS];
    for (size_t i = 0; i < c->count; i++) {
        size_t bytes = c->specs[i].length * ls_dtype_size(c->specs[i].dtype);
        ref->out[i] = (uint8_t *)malloc(bytes ? bytes : 1);
        bufs[i] = a.bufs[i];
        bufs[i].dst = ref->out[i];
    }
    double inv[LS_NUM_DTYPES];
    for (int t = 0; t < LS_NUM_DTYPES; t++)
        inv[t] = ls_round_to_dtype(c->inv_scale, (ls_dtype)t);
    ref->unscale_finite = ls_run_range(&ls_kernels_scalar, bufs, c->count, inv, c->flags, 0,
                                       c->total);
    ref->inputs_finite = ls_run_range(&ls_kernels_scalar, bufs, c->count, NULL, c->flags, 0,
                                      c->total);
    /* the two finite tests of the reference agree with each other */
    if (c->flags & LS_CHECK_INPUTS)
        REQUIRE(ref->unscale_finite == ref->inputs_finite,
                "scalar set: unscale's input flag differs from its check");
    arena_free(c, &a);
}

static void reference_free(const fuzz_case *c, reference *ref)
{
    for (size_t i = 0; i < c->count; i++)
        free(ref->out[i]);
}

/* Every destination equals the reference; every out-of-place source is
 * untouched; no guard byte moved. */
static void check_outputs(const fuzz_case *c, arena *a, const reference *ref, const char *who)
{
    static char what[160];
    for (size_t i = 0; i < c->count; i++) {
        const spec *s = &c->specs[i];
        size_t bytes = s->length * ls_dtype_size(s->dtype);
        const uint8_t *got = region_data(&a->dst[i]);
        if (memcmp(got, ref->out[i], bytes) != 0)
            for (size_t k = 0; k < bytes; k++)
                if (got[k] != ref->out[i][k]) {
                    snprintf(what, sizeof what, "%s: result differs from the scalar set", who);
                    fail(what, i, k / ls_dtype_size(s->dtype));
                }
        if (!s->in_place) {
            region_check_guard(&a->dst[i], i);
            uint8_t *expect = (uint8_t *)malloc(bytes ? bytes : 1);
            fill(c, i, expect, bytes);
            if (memcmp(expect, region_data(&a->src[i]), bytes) != 0) {
                snprintf(what, sizeof what, "%s: source of an out-of-place call changed", who);
                fail(what, i, 0);
            }
            free(expect);
        }
        region_check_guard(&a->src[i], i);
    }
}

/* A rejected call wrote nothing anywhere. */
static void check_untouched(const fuzz_case *c, arena *a, const char *who)
{
    static char what[160];
    for (size_t i = 0; i < c->count; i++) {
        const spec *s = &c->specs[i];
        size_t bytes = s->length * ls_dtype_size(s->dtype);
        uint8_t *expect = (uint8_t *)malloc(bytes ? bytes : 1);
        fill(c, i, expect, bytes);
        if (memcmp(expect, region_data(&a->src[i]), bytes) != 0) {
            snprintf(what, sizeof what, "%s: a rejected call wrote a buffer", who);
            fail(what, i, 0);
        }
        if (!s->in_place) {
            memset(expect, GUARD, bytes);
            if (memcmp(expect, region_data(&a->dst[i]), bytes) != 0)
                for (size_t k = 0; k < bytes; k++)
                    if (region_data(&a->dst[i])[k] != GUARD) {
                        snprintf(what, sizeof what, "%s: a rejected call wrote a destination",
                                 who);
                        fail(what, i, k);
                    }
            region_check_guard(&a->dst[i], i);
        }
        region_check_guard(&a->src[i], i);
        free(expect);
    }
}

/* ---------------------------------------------------------- the runs */

/* Each kernel set on its own, straight through the list. */
static void run_kernel_sets(const fuzz_case *c, const reference *ref)
{
    static char who[64];
    double inv[LS_NUM_DTYPES];
    for (int t = 0; t < LS_NUM_DTYPES; t++)
        inv[t] = ls_round_to_dtype(c->inv_scale, (ls_dtype)t);
    /* every set dispatch's table has and this CPU runs */
    for (int k = 0; k < ls_simd_count(); k++) {
        const ls_kernel_set *set = ls_kernels_at(k);
        if (set == NULL)
            continue;
        snprintf(who, sizeof who, "kernel set %s", ls_simd_name(k));
        arena a;
        arena_new(c, &a, 0);
        int checked = ls_run_range(set, a.bufs, c->count, NULL, c->flags, 0, c->total);
        if (checked != ref->inputs_finite)
            fail("kernel set's check differs from the scalar set", k, 0);
        int finite = ls_run_range(set, a.bufs, c->count, inv, c->flags, 0, c->total);
        if (finite != ref->unscale_finite)
            fail("kernel set's unscale flag differs from the scalar set", k, 0);
        check_outputs(c, &a, ref, who);
        arena_free(c, &a);
    }
}

/* How a public entry point is called. */
enum call { CALL_WHOLE, CALL_RANGES, CALL_HOST };

/* A host's parallel-for as the fuzzer plays it: the job cut at the case's
 * cuts, the pieces run last to first; counts the calls, which must come
 * only after the arguments were found good. */
typedef struct cut_host {
    const fuzz_case *c;
    int calls;
} cut_host;

static int cut_parallel(void *host, ls_range_fn range, const void *ctx, size_t total)
{
    cut_host *h = (cut_host *)host;
    h->calls++;
    if (total != h->c->total)
        fail("a parallel-for was handed the wrong total", 0, total);
    int rc = 1;
    for (size_t i = h->c->ncuts + 1; i-- > 0;)
        rc = ls_combine_status(rc, range(ctx, h->c->cuts[i], h->c->cuts[i + 1]));
    return rc;
}

/* The range entry point over c's cuts, one call a part, combined as a
 * caller would: the first error, else whether every part was finite. */
typedef int (*range_call)(const fuzz_case *c, const arena *a, size_t begin, size_t end);

static int over_cuts(const fuzz_case *c, const arena *a, range_call call)
{
    int rc = 1;
    for (size_t i = 0; i <= c->ncuts; i++) {
        int r = call(c, a, c->cuts[i], c->cuts[i + 1]);
        if (r < 0)
            return r;
        rc &= r;
    }
    return rc;
}

static int unscale_part(const fuzz_case *c, const arena *a, size_t begin, size_t end)
{
    return ls_unscale_range(a->bufs, c->count, call_scale(c), call_flags(c), begin, end);
}

static int check_part(const fuzz_case *c, const arena *a, size_t begin, size_t end)
{
    return ls_all_finite_range(a->bufs, c->count, call_flags(c), begin, end);
}

/* A host's parallel-for runs once for a call the library takes, never for
 * one it refuses. */
static void host_ran_once(const char *who, const cut_host *host, int rc)
{
    if (host->calls != (rc >= 0)) {
        char what[96];
        snprintf(what, sizeof what, "%s: the parallel-for ran for a refused call, or not once",
                 who);
        fail(what, 0, (size_t)host->calls);
    }
}

static void run_public_unscale(const fuzz_case *c, const reference *ref, enum call how)
{
    static const char *const names[] = {"ls_unscale", "ls_unscale_range", "ls_unscale_with"};
    const char *who = names[how];
    const int why = refusals(c, 1);
    arena a;
    arena_new(c, &a, 1);
    unsigned saved = caller_state_enter(c);
    cut_host host = {c, 0};
    int rc;
    if (how == CALL_WHOLE) {
        rc = ls_unscale(a.bufs, c->count, call_scale(c), call_flags(c));
    } else if (how == CALL_HOST) {
        rc = ls_unscale_with(a.bufs, c->count, call_scale(c), call_flags(c), cut_parallel,
                             &host);
        host_ran_once(who, &host, rc);
    } else {
        rc = over_cuts(c, &a, unscale_part);
    }
    caller_state_check(saved, c);
    char what[96];
    if (why) {
        snprintf(what, sizeof what, "%s: wrong error code", who);
        if (!refused_as_expected(why, rc))
            fail(what, 0, (size_t)(rc < 0 ? -rc : rc));
        check_untouched(c, &a, who);
    } else {
        snprintf(what, sizeof what, "%s: finite flag differs from the scalar set", who);
        if (rc != ref->unscale_finite)
            fail(what, 0, (size_t)rc);
        check_outputs(c, &a, ref, who);
    }
    arena_free(c, &a);
}

static void run_public_check(const fuzz_case *c, const reference *ref, enum call how)
{
    static const char *const names[] = {"ls_all_finite", "ls_all_finite_range",
                                        "ls_all_finite_with"};
    const char *who = names[how];
    const int why = refusals(c, 0);
    arena a;
    arena_new(c, &a, 1);
    unsigned saved = caller_state_enter(c);
    const unsigned flags = call_flags(c);
    cut_host host = {c, 0};
    int rc;
    if (how == CALL_WHOLE) {
        rc = ls_all_finite(a.bufs, c->count, flags);
    } else if (how == CALL_HOST) {
        rc = ls_all_finite_with(a.bufs, c->count, flags, cut_parallel, &host);
        host_ran_once(who, &host, rc);
    } else {
        rc = over_cuts(c, &a, check_part);
    }
    caller_state_check(saved, c);
    char what[96];
    snprintf(what, sizeof what, "%s: wrong answer", who);
    if (why ? !refused_as_expected(why, rc) : rc != ref->inputs_finite)
        fail(what, 0, (size_t)(rc < 0 ? -rc : rc));
    check_untouched(c, &a, who);
    arena_free(c, &a);
}

/* Arguments the range entry points must refuse whatever the list. */
static void run_bad_ranges(const fuzz_case *c)
{
    arena a;
    arena_new(c, &a, 0);
    REQUIRE(ls_total_length(a.bufs, c->count) == c->total, "ls_total_length");
    REQUIRE(ls_validate(a.bufs, c->count) == LS_OK, "ls_validate refused a good list");
    REQUIRE(ls_unscale_range(a.bufs, c->count, c->inv_scale, c->flags, 0, c->total + 1) ==
                LS_ERR_ARG,
            "ls_unscale_range accepted an end past the list");
    REQUIRE(ls_all_finite_range(a.bufs, c->count, c->flags, 0, c->total + 1) == LS_ERR_ARG,
            "ls_all_finite_range accepted an end past the list");
    if (c->total > 0) {
        REQUIRE(ls_unscale_range(a.bufs, c->count, c->inv_scale, c->flags, c->total, 0) ==
                    LS_ERR_ARG,
                "ls_unscale_range accepted begin > end");
        REQUIRE(ls_all_finite_range(a.bufs, c->count, c->flags, c->total, 0) == LS_ERR_ARG,
                "ls_all_finite_range accepted begin > end");
    }
    check_untouched(c, &a, "range bounds");
    arena_free(c, &a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_case c;
    decode(data, size, &c);
    if (ls_simd_level() < 0) {
        /* LOSSSCALE_SIMD names a set this CPU lacks: every entry point says so */
        arena a;
        arena_new(&c, &a, 0);
        REQUIRE(ls_unscale(a.bufs, c.count, 1.0, 0) == LS_ERR_SIMD, "LS_ERR_SIMD expected");
        REQUIRE(ls_all_finite(a.bufs, c.count, 0) == LS_ERR_SIMD, "LS_ERR_SIMD expected");
        arena_free(&c, &a);
        return 0;
    }
    ls_set_num_threads(c.threads);
    reference ref;
    reference_run(&c, &ref);
    /* A big list is there for the thread pool, which only the whole-list
     * calls use; the other runs would see nothing a short list does not
     * show them, at many times the cost per input. */
    if (!c.big) {
        /* a kernel never sees a non-finite scale: the entry points refuse it */
        if (c.fault == FAULT_NONE && finite_double(c.inv_scale)) {
            run_kernel_sets(&c, &ref);
            run_bad_ranges(&c);
        }
        run_public_unscale(&c, &ref, CALL_RANGES);
        run_public_check(&c, &ref, CALL_RANGES);
        run_public_unscale(&c, &ref, CALL_HOST);
        run_public_check(&c, &ref, CALL_HOST);
    }
    run_public_unscale(&c, &ref, CALL_WHOLE);
    run_public_check(&c, &ref, CALL_WHOLE);
    reference_free(&c, &ref);
    return 0;
}
