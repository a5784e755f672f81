/*
 * How a job over elements [0, total) is cut between threads: the one
 * planner behind the library's own threads (threads.c) and a host's pool
 * (the TensorFlow ops' parallel-for), header-only so that a host sees it
 * through the public include directory alone.
 *
 * A job goes to at most one thread per LS_MIN_PER_THREAD elements and is
 * cut into up to LS_CHUNKS_PER_THREAD chunks per thread (never below
 * LS_MIN_PER_THREAD elements each), which the threads take in turn from a
 * shared counter: a thread that gets no core for a while (another
 * library's spinning threads, the machine's other work) costs its share of
 * the job, not a fixed part of it.  Measured on ResNet-50-sized lists, 2
 * threads: splitting into many small blocks made two threads slower than
 * one (chunks of 64K elements and more stream at the memory's rate), and
 * one fixed half per thread waited for the later thread, which on a shared
 * machine started 1-5 ms late in about one step in six.
 */
#ifndef LOSSSCALE_CHUNKS_H
#define LOSSSCALE_CHUNKS_H

#include <stddef.h>

#include "lossscale.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Below this many elements per thread, waking a thread costs more than the
 * share of the pass it would take; no chunk is smaller either. */
#define LS_MIN_PER_THREAD ((size_t)1 << 16)
/* Chunks per thread: enough that a thread the machine takes away for a
 * while costs only its share, few enough that every chunk is a long
 * stream. */
#define LS_CHUNKS_PER_THREAD ((size_t)32)
/* Chunks begin on multiples of this many elements (a cache line of every
 * dtype), so no two threads write into one line. */
#define LS_GRAIN ((size_t)64)

typedef struct ls_chunk_plan {
    size_t total;  /* elements of the job */
    int threads;   /* threads on it, the caller's included; 1: the caller alone */
    size_t chunks; /* how many pieces they take in turn */
} ls_chunk_plan;

/* The plan for `total` elements and at most `threads` threads. */
static inline ls_chunk_plan ls_plan_chunks(size_t total, int threads)
{
    const size_t by_size = total / LS_MIN_PER_THREAD;
    ls_chunk_plan p;
    p.total = total;
    p.threads = threads < 1 ? 1 : (by_size < (size_t)threads ? (int)by_size : threads);
    if (p.threads < 2) {
        p.threads = 1;
        p.chunks = 1;
        return p;
    }
    /* At least one chunk per thread: threads <= by_size. */
    p.chunks = (size_t)p.threads * LS_CHUNKS_PER_THREAD;
    if (p.chunks > by_size)
        p.chunks = by_size;
    return p;
}

/* Elements [*begin, *end) of chunk `c` (< p->chunks). */
static inline void ls_chunk_bounds(const ls_chunk_plan *p, size_t c, size_t *begin, size_t *end)
{
    const size_t grains = (p->total + LS_GRAIN - 1) / LS_GRAIN;
    const size_t b = grains * c / p->chunks * LS_GRAIN;
    const size_t e = grains * (c + 1) / p->chunks * LS_GRAIN;
    *begin = b < p->total ? b : p->total;
    *end = e < p->total ? e : p->total;
}

/* Results of ranges combined: finite flags by AND; the first negative
 * status wins. */
static inline int ls_combine_status(int a, int b)
{
    if (a < 0)
        return a;
    if (b < 0)
        return b;
    return a & b;
}

/* What every thread on a job runs: takes chunks from the shared counter
 * `*next` (0 at the start) until none is left, runs `range` on each and
 * returns their combined result.  A negative status ends the job: no
 * thread takes another chunk. */
static inline int ls_take_chunks(const ls_chunk_plan *p, size_t *next, ls_range_fn range,
                                 const void *ctx)
{
    int result = 1;
    for (;;) {
        const size_t c = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (c >= p->chunks)
            return result;
        size_t begin, end;
        ls_chunk_bounds(p, c, &begin, &end);
        const int rc = range(ctx, begin, end);
        result = ls_combine_status(result, rc);
        if (rc < 0)
            __atomic_store_n(next, p->chunks, __ATOMIC_RELAXED);
    }
}

#ifdef __cplusplus
}
#endif

#endif /* LOSSSCALE_CHUNKS_H */
