/*
 * The library's own threads, for callers without a pool (the numpy
 * bindings).  One pool per process, started on first need.  A call that
 * finds the pool busy — another Python thread is in the middle of a large
 * unscale — runs on its own thread instead of queueing or adding threads,
 * so concurrent callers never oversubscribe the cores.  A job is cut as
 * lossscale_chunks.h plans it, the planner a host's pool uses too.
 *
 * The workers are kept off the CPU the caller runs on (place_workers).
 * After an idle spell the scheduler was seen to wake a worker on the
 * caller's own CPU, where it waited behind the caller, or took the CPU
 * from it, until a balancing pass moved one of them (1.5-2 ms later on a
 * virtual machine whose idle CPUs halt): the job ran on one core.  On two
 * cores, a ResNet-50-sized float16 unscale called after 20 ms of sleep
 * took 5.6-6.0 ms, called back to back 2.2-3.2 ms; with the workers kept
 * off the caller's CPU, 3.2 ms after the same sleep.
 */
#define _GNU_SOURCE /* sched_getcpu, pthread_setaffinity_np, pthread_setname_np */
#ifdef __linux__
#include <sched.h>
#define LS_LINUX_THREADS 1
#endif
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"
#include "lossscale_chunks.h"

#define LS_MAX_THREADS 256

typedef struct job {
    ls_range_fn range;
    const void *ctx;
    ls_chunk_plan plan; /* lossscale_chunks.h: how many threads, which chunks */
    size_t next;        /* the next chunk to take (atomic) */
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
    pthread_t threads[LS_MAX_THREADS]; /* the workers, pool.started of them */
    int away_from;        /* the CPU they are kept off; -1: none */
#ifdef LS_LINUX_THREADS
    cpu_set_t placed;     /* the caller's CPUs when they were placed */
#endif
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER,
          .lock = PTHREAD_MUTEX_INITIALIZER,
          .work = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER,
          .result = 1,
          .away_from = -1};

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

static int run_chunks(job *j) { return ls_take_chunks(&j->plan, &j->next, j->range, j->ctx); }

static void *worker(void *arg)
{
    int index = (int)(size_t)arg; /* joins jobs of more than `index` threads */
    unsigned seen = 0;
#ifdef LS_LINUX_THREADS
    pthread_setname_np(pthread_self(), "lossscale"); /* in top, perf and /proc */
#endif
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen)
            pthread_cond_wait(&pool.work, &pool.lock);
        seen = pool.generation;
        if (index >= pool.current.plan.threads)
            continue;
        /* pool.current stays put until the last worker is done with it. */
        pthread_mutex_unlock(&pool.lock);
        int finite = run_chunks(&pool.current);
        pthread_mutex_lock(&pool.lock);
        pool.result = ls_combine_status(pool.result, finite);
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
        pool.threads[pool.started++] = t;
        pool.away_from = -1; /* a new worker is not placed yet */
    }
    return pool.started + 1 < want ? pool.started + 1 : want;
}

/* Keeps every worker on the CPUs the calling thread may use, less the one
 * it runs on now (see the top of this file); with pool.lock held.  Asked
 * every job, it calls the kernel only when the caller has moved to another
 * CPU or its CPUs have changed.  Where the caller may use one CPU alone,
 * or where the kernel will not say, the workers are left where they are. */
static void place_workers(void)
{
#ifdef LS_LINUX_THREADS
    const int cpu = sched_getcpu();
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (cpu < 0 || pthread_getaffinity_np(pthread_self(), sizeof allowed, &allowed) != 0)
        return;
    if (cpu == pool.away_from && CPU_EQUAL(&allowed, &pool.placed))
        return;
    pool.placed = allowed;
    pool.away_from = cpu;
    if (!CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2)
        return;
    CPU_CLR(cpu, &allowed);
    /* A worker the kernel refuses to move still runs, wherever it is. */
    for (int i = 0; i < pool.started; i++)
        (void)pthread_setaffinity_np(pool.threads[i], sizeof allowed, &allowed);
#endif
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
    pool.away_from = -1;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

int ls_run_parallel(ls_range_fn range, const void *ctx, size_t total)
{
    ls_chunk_plan plan = ls_plan_chunks(total, ls_get_num_threads());
    pthread_once(&atfork_once, register_atfork);
    if (plan.threads < 2 || pthread_mutex_trylock(&pool.busy) != 0)
        return range(ctx, 0, total);

    pthread_mutex_lock(&pool.lock);
    /* As many threads as could be started: fewer threads, fewer chunks. */
    plan = ls_plan_chunks(total, grow_pool(plan.threads));
    place_workers();
    pool.current = (job){range, ctx, plan, 0};
    pool.pending = plan.threads - 1;
    pool.result = 1;
    pool.generation++;
    pthread_cond_broadcast(&pool.work);
    pthread_mutex_unlock(&pool.lock);

    int result = run_chunks(&pool.current);

    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0)
        pthread_cond_wait(&pool.done, &pool.lock);
    result = ls_combine_status(result, pool.result);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.busy);
    return result;
}

int ls_own_threads(void *host, ls_range_fn range, const void *ctx, size_t total)
{
    (void)host;
    return ls_run_parallel(range, ctx, total);
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
                 const double *inv, unsigned flags, ls_parallel_fn parallel, void *host)
{
    const list_job j = {k, bufs, count, inv, flags};
    return (parallel ? parallel : ls_own_threads)(host, list_range, &j,
                                                  ls_total_length(bufs, count));
}
