/*
 * The library's own threads, for callers without a pool (the numpy
 * bindings).  One pool per process, started on first need.  A call that
 * finds the pool busy — another Python thread is in the middle of a large
 * unscale — runs on its own thread instead of queueing or adding threads,
 * so concurrent callers never oversubscribe the cores.
 */
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

/* Below this many elements per thread, waking threads costs more than the
 * memory pass it would share. */
#define LS_MIN_PER_THREAD (1u << 16)
/* Range boundaries fall on multiples of this many elements (cache lines
 * of every dtype), so no two threads write into one line. */
#define LS_GRAIN 64u
/* A job is cut into this many chunks per thread (none under
 * LS_MIN_PER_THREAD elements), which the threads take in turn: a thread
 * that gets no core for a while (another library's spinning threads, the
 * machine's other work) costs its share of the job, not a fixed half. */
#define LS_CHUNKS_PER_THREAD 32u
#define LS_MAX_THREADS 256

typedef struct job {
    ls_range_fn range;
    const void *ctx;
    size_t total;
    int parts;     /* threads on the job, the caller included */
    size_t chunks;
    size_t next;   /* the next chunk to take (atomic) */
} job;

static struct {
    pthread_mutex_t busy; /* held by the call that owns the pool */
    pthread_mutex_t lock; /* guards the fields below */
    pthread_cond_t work, done;
    int started;          /* workers created */
    unsigned generation;  /* bumped for every job */
    int pending;          /* workers still on the current job */
    int result;           /* AND of the finite flags */
    job current;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 1, {0}};

static int requested_threads; /* 0: default */

static int online_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > LS_MAX_THREADS ? LS_MAX_THREADS : (int)n);
}

void ls_set_num_threads(int n)
{
    __atomic_store_n(&requested_threads, n <= 0 ? 0 : (n > LS_MAX_THREADS ? LS_MAX_THREADS : n),
                     __ATOMIC_RELAXED);
}

int ls_get_num_threads(void)
{
    int n = __atomic_load_n(&requested_threads, __ATOMIC_RELAXED);
    return n > 0 ? n : online_cores();
}

/* Finite flags combine by AND; the first negative status wins. */
static int combine(int a, int b)
{
    if (a < 0)
        return a;
    if (b < 0)
        return b;
    return a & b;
}

/* Takes chunks of `j` until none is left; the combined result. */
static int run_chunks(job *j)
{
    size_t grains = (j->total + LS_GRAIN - 1) / LS_GRAIN;
    int result = 1;
    for (;;) {
        size_t c = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (c >= j->chunks)
            return result;
        size_t b = grains * c / j->chunks * LS_GRAIN;
        size_t e = grains * (c + 1) / j->chunks * LS_GRAIN;
        result = combine(result, j->range(j->ctx, b < j->total ? b : j->total,
                                          e < j->total ? e : j->total));
    }
}

static void *worker(void *arg)
{
    int index = (int)(size_t)arg; /* joins jobs of more than `index` threads */
    unsigned seen = 0;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen)
            pthread_cond_wait(&pool.work, &pool.lock);
        seen = pool.generation;
        if (index >= pool.current.parts)
            continue;
        /* pool.current stays put until the last worker is done with it. */
        pthread_mutex_unlock(&pool.lock);
        int finite = run_chunks(&pool.current);
        pthread_mutex_lock(&pool.lock);
        pool.result = combine(pool.result, finite);
        if (--pool.pending == 0)
            pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* Ensures at least `want` - 1 workers; returns how many parts can run. */
static int grow_pool(int want)
{
    while (pool.started < want - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(size_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pool.started++;
    }
    return pool.started + 1 < want ? pool.started + 1 : want;
}

/* A forked child has none of the parent's workers: start from scratch. */
static void reset_after_fork(void)
{
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.pending = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

int ls_run_parallel(ls_range_fn range, const void *ctx, size_t total)
{
    int threads = ls_get_num_threads();
    size_t by_size = total / LS_MIN_PER_THREAD;
    int parts = by_size < (size_t)threads ? (int)by_size : threads;
    pthread_once(&atfork_once, register_atfork);
    if (parts < 2 || pthread_mutex_trylock(&pool.busy) != 0)
        return range(ctx, 0, total);

    pthread_mutex_lock(&pool.lock);
    parts = grow_pool(parts);
    /* At least one chunk per thread: parts <= by_size. */
    size_t chunks = (size_t)parts * LS_CHUNKS_PER_THREAD;
    if (chunks > by_size)
        chunks = by_size;
    pool.current = (job){range, ctx, total, parts, chunks, 0};
    pool.pending = parts - 1;
    pool.result = 1;
    pool.generation++;
    pthread_cond_broadcast(&pool.work);
    pthread_mutex_unlock(&pool.lock);

    int result = parts > 1 ? run_chunks(&pool.current) : range(ctx, 0, total);

    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0)
        pthread_cond_wait(&pool.done, &pool.lock);
    result = combine(result, pool.result);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.busy);
    return result;
}

/* The unscale/check kernels over one part of a list. */
typedef struct list_job {
    const ls_kernel_set *kernels;
    const ls_buffer *bufs;
    size_t count;
    const double *inv;
    unsigned flags;
} list_job;

static int list_range(const void *ctx, size_t begin, size_t end)
{
    const list_job *j = (const list_job *)ctx;
    return ls_run_range(j->kernels, j->bufs, j->count, j->inv, j->flags, begin, end);
}

int ls_run_split(const ls_kernel_set *k, const ls_buffer *bufs, size_t count,
                 const double *inv, unsigned flags)
{
    const list_job j = {k, bufs, count, inv, flags};
    return ls_run_parallel(list_range, &j, ls_total_length(bufs, count));
}
