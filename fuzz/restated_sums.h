/*
 * What the fuzz targets over TensorFlow's reductions share
 * (fuzz/fuzz_norms.c, fuzz/fuzz_adafactor.c; fuzz/fuzz_lamb.c takes all
 * but the reduction): the input's readers, the
 * 2-byte value codes, a plain restatement of Eigen's full reduction of
 * float32 values on CPU (lossscale.h's order, written independently of
 * norms.c), the floating-point control state set by hand, and a host's
 * parallel-for that runs a job in uneven pieces.
 *
 * The including file defines `static void fail(const char *what)` (it
 * aborts) before including this one.
 */
#ifndef LOSSSCALE_FUZZ_RESTATED_SUMS_H
#define LOSSSCALE_FUZZ_RESTATED_SUMS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lossscale.h"
#include "lossscale_chunks.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_MXCSR 1
#define FLUSH_BITS 0x8040u /* MXCSR: FTZ (bit 15) | DAZ (bit 6) */
#endif

/* Reads the input front to back; past its end every byte is zero. */
typedef struct reader {
    const uint8_t *p;
    size_t n, at;
} reader;

static uint8_t next_byte(reader *r) { return r->at < r->n ? r->p[r->at++] : (r->at++, 0); }

static uint64_t next_le(reader *r, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)next_byte(r) << (8 * i);
    return v;
}

/* The content: handed out in order, from its start again when it runs
 * out; zeros when there is none. */
typedef struct stream {
    const uint8_t *p;
    size_t n, at;
} stream;

static uint8_t stream_byte(stream *s)
{
    if (s->n == 0)
        return 0;
    const uint8_t b = s->p[s->at];
    if (++s->at == s->n)
        s->at = 0;
    return b;
}

static uint64_t stream_le(stream *s, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)stream_byte(s) << (8 * i);
    return v;
}

static float from_bits(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint32_t bits_of(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* Same bits, or NaN both (which NaN an operation keeps depends on its
 * operands' order, which a compiler may swap). */
static int same(float x, float y) { return bits_of(x) == bits_of(y) || (isnan(x) && isnan(y)); }

/* A 2-byte code as a value: mostly magnitudes between 2^-8 and 2^8 with
 * 11 random mantissa bits, whose squares and sums round at every step but
 * stay finite (random float32 bits would make most sums inf or NaN, which
 * no order changes); one code in 128 a special value: zeros, subnormals
 * and values whose squares are subnormal or underflow, and with `wild`
 * those that make a sum inf or NaN too. */
static float value_of(uint16_t code, int wild)
{
    static const uint32_t special[16] = {
        0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, /* 0, -0, 2^-149, largest subnormal */
        0x00800000, 0x1F800000, 0x1A000000, 0x9FC00000, /* 2^-126, 2^-64, 2^-75, -1.5 * 2^-64 */
        0x7FC00000, 0xFFC12345, 0x7F800001, 0x7F800000, /* NaN, a NaN with payload, sNaN, inf */
        0xFF800000, 0x7F7FFFFF, 0x5F800000, 0xE2800000, /* -inf, FLT_MAX, 2^64, -2^70 */
    };
    if ((code & 0xFE00u) == 0xFE00u)
        return from_bits(special[code & (wild ? 15u : 7u)]);
    const uint32_t sign = (uint32_t)(code >> 15) << 31;
    const uint32_t exponent = (uint32_t)(127 - 8 + ((code >> 11) & 15u)) << 23;
    const uint32_t mantissa = (uint32_t)(code & 2047u) << 12;
    return from_bits(sign | exponent | mantissa);
}

/* ------------------------------- Eigen's full reduction, restated plainly */

/* One leaf of n <= 8192 values: runs of 32 into four 8-lane
 * accumulators, folded into the first lane by lane, then runs of 8 into
 * it; the last values one by one onto 0; that plus the lanes, pairwise. */
static float ref_leaf(const float *v, size_t n)
{
    float acc[4][8];
    for (size_t q = 0; q < 4; q++)
        for (size_t l = 0; l < 8; l++)
            acc[q][l] = 0.0f;
    size_t j = 0;
    if (n >= 32) {
        for (; j + 32 <= n; j += 32)
            for (size_t q = 0; q < 4; q++)
                for (size_t l = 0; l < 8; l++)
                    acc[q][l] = acc[q][l] + v[j + 8 * q + l];
        for (size_t q = 1; q < 4; q++)
            for (size_t l = 0; l < 8; l++)
                acc[0][l] = acc[0][l] + acc[q][l];
    }
    for (; j + 8 <= n; j += 8)
        for (size_t l = 0; l < 8; l++)
            acc[0][l] = acc[0][l] + v[j + l];
    float rest = 0.0f;
    for (; j < n; j++)
        rest = rest + v[j];
    const float *a = acc[0];
    const float lanes = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    return rest + lanes;
}

/* Values [first, first + n) of v: more than 8192 split at the 8-value
 * boundary at or after first + ceil(n / 2) (first counts from the
 * tensor's start), 0 plus the left part, plus the right. */
static float ref_tree(const float *v, size_t first, size_t n)
{
    if (n <= 8192)
        return ref_leaf(v + first, n);
    const size_t half = n / 2 + n % 2;
    const size_t split = 8 * ((first + half) / 8 + ((first + half) % 8 != 0));
    size_t left = split - first;
    if (left > n)
        left = n;
    float sum = 0.0f + ref_tree(v, first, left);
    sum = sum + ref_tree(v, split, n - left);
    return sum;
}

/* Eigen's TensorCostModel::numThreads for n values: 4 bytes loaded at
 * 11/64 cycles each plus one add per 8-value packet; 100,000 cycles to
 * start, 100,000 per thread. */
static int ref_threads(size_t n, int eigen_threads)
{
    const double cost = 4 * (11.0 / 64) + 1.0 / 8;
    const double t = ((double)n * cost - 100000) / 100000 + 0.9;
    if (t >= (double)eigen_threads)
        return eigen_threads;
    return t < 1 ? 1 : (int)t;
}

/* FullReducer on the thread-pool device: one thread, one tree; else
 * blocks of n / threads, the rest's tree (or 0) plus each block's in
 * order.  (Unused where a target takes no reduction: fuzz_lamb.c.) */
static __attribute__((unused)) float ref_sum(const float *v, size_t n, int eigen_threads)
{
    const int threads = ref_threads(n, eigen_threads);
    if (n == 0)
        return 0.0f;
    if (threads == 1)
        return ref_tree(v, 0, n);
    const size_t blocksize = n / (size_t)threads;
    const size_t blocks = blocksize > 0 ? n / blocksize : 0;
    float shard[64];
    if (blocks > 64)
        fail("more blocks than threads");
    for (size_t b = 0; b < blocks; b++)
        shard[b] = ref_tree(v, b * blocksize, blocksize);
    float total = blocks * blocksize < n ? ref_tree(v, blocks * blocksize, n - blocks * blocksize)
                                         : 0.0f;
    for (size_t b = 0; b < blocks; b++)
        total = total + shard[b];
    return total;
}

/* ------------------------------------- floating-point state, by hand */

static unsigned control_state(void)
{
#ifdef HAVE_MXCSR
    return _mm_getcsr() & ~0x3fu; /* less the sticky exception flags */
#else
    return 0;
#endif
}

/* ------------------------------------------------ a host's parallel-for */

/* The job cut at `cuts` (each modulo the job's elements + 1), the pieces
 * run in order or last to first on the calling thread: a unit of work
 * (a leaf, a variable) begins anywhere in a piece, and a cut may fall on
 * its first element, one before or after it, or twice at one place (an
 * empty piece). */
typedef struct piece_host {
    const uint32_t *cuts;
    size_t ncuts;
    int reverse;
    int calls;
} piece_host;

enum { MAX_PIECE_CUTS = 7 };

static int piece_parallel(void *host, ls_range_fn range, const void *ctx, size_t total)
{
    piece_host *h = (piece_host *)host;
    h->calls++;
    size_t edge[MAX_PIECE_CUTS + 2];
    size_t n = 0;
    edge[n++] = 0;
    for (size_t i = 0; i < h->ncuts && i < MAX_PIECE_CUTS; i++)
        edge[n++] = (size_t)(h->cuts[i] % ((uint64_t)total + 1));
    edge[n++] = total;
    for (size_t i = 2; i < n - 1; i++) /* insertion sort of the cuts */
        for (size_t j = i; j > 1 && edge[j - 1] > edge[j]; j--) {
            const size_t t = edge[j];
            edge[j] = edge[j - 1];
            edge[j - 1] = t;
        }
    int rc = 1;
    for (size_t k = 0; k + 1 < n; k++) {
        const size_t piece = h->reverse ? n - 2 - k : k;
        rc = ls_combine_status(rc, range(ctx, edge[piece], edge[piece + 1]));
    }
    return rc;
}

#endif /* LOSSSCALE_FUZZ_RESTATED_SUMS_H */
