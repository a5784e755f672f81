/*
 * The core's own threads, driven from C so that the sanitizers see the
 * whole pool (AddressSanitizer and LeakSanitizer in `make sanitize`, and
 * ThreadSanitizer for its locking): large lists split over every thread
 * count, concurrent callers (the pool busy, callers running alone), the
 * thread count changed while calls run, an early non-finite value in one
 * part, a forked child that must start a pool of its own, the chunk
 * planner, and a host's own threads driving the _with entry points.  Every
 * answer is compared, byte for byte, with the scalar kernel set run on the
 * calling thread.  Exits non-zero on the first difference.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "lossscale_chunks.h"

static const size_t esize[LS_NUM_DTYPES] = {2, 2, 4, 8};

#define CHECK(cond, ...)                                             \
    do {                                                             \
        if (!(cond)) {                                               \
            fprintf(stderr, "test_threads: %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                            \
            fprintf(stderr, "\n");                                   \
            exit(1);                                                 \
        }                                                            \
    } while (0)

static uint64_t next_random(uint64_t *state)
{
    /* splitmix64: reproducible, no libc state shared between threads */
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Finite values of every magnitude, zeros and subnormals among them;
 * `bad` non-finite ones at random places. */
static void fill(ls_dtype t, void *p, size_t n, uint64_t seed, size_t bad)
{
    static const uint64_t inf_bits[LS_NUM_DTYPES] = {0x7c00u, 0x7f80u, 0x7f800000u,
                                                      0x7ff0000000000000ull};
    const size_t size = esize[t];
    /* A random pattern of the element's width (its low bytes: both
     * architectures built here are little-endian); one whose exponent is
     * all ones loses the exponent's top bit, and is finite. */
    const uint64_t width = size < 8 ? (1ull << (8 * size)) - 1 : ~0ull;
    const uint64_t top = 1ull << (8 * size - 2);
    uint64_t s = seed;
    uint8_t *b = (uint8_t *)p;
    for (size_t i = 0; i < n; i++) {
        uint64_t v = next_random(&s) & width;
        if ((v & inf_bits[t]) == inf_bits[t])
            v &= ~top;
        memcpy(b + size * i, &v, size);
    }
    for (size_t k = 0; k < bad && n > 0; k++) {
        size_t i = (size_t)(next_random(&s) % n);
        memcpy(b + esize[t] * i, &inf_bits[t], esize[t]);
    }
}

/* A list of `count` buffers of the given lengths and dtypes (cycling),
 * out of place, and the scalar set's answer for it. */
typedef struct list {
    size_t count;
    ls_buffer bufs[8];
    void *want[8];
    int want_finite, want_inputs_finite;
} list;

static void list_new(list *l, size_t count, const size_t *lengths, uint64_t seed, size_t bad,
                     double inv, unsigned flags)
{
    l->count = count;
    for (size_t i = 0; i < count; i++) {
        ls_dtype t = (ls_dtype)((seed + i) % LS_NUM_DTYPES);
        size_t bytes = lengths[i] * esize[t];
        void *src = malloc(bytes ? bytes : 1);
        fill(t, src, lengths[i], seed * 31 + i, i == 0 ? bad : 0);
        l->bufs[i] = (ls_buffer){src, malloc(bytes ? bytes : 1), lengths[i], t};
        l->want[i] = malloc(bytes ? bytes : 1);
    }
    ls_buffer ref[8];
    for (size_t i = 0; i < count; i++) {
        ref[i] = l->bufs[i];
        ref[i].dst = l->want[i];
    }
    double by_dtype[LS_NUM_DTYPES];
    for (int t = 0; t < LS_NUM_DTYPES; t++)
        by_dtype[t] = ls_round_to_dtype(inv, (ls_dtype)t);
    size_t total = ls_total_length(ref, count);
    l->want_finite = ls_run_range(&ls_kernels_scalar, ref, count, by_dtype, flags, 0, total);
    l->want_inputs_finite = ls_run_range(&ls_kernels_scalar, ref, count, NULL, flags, 0, total);
}

static void list_check(const list *l, int finite, const char *what)
{
    CHECK(finite == l->want_finite, "%s: finite flag %d, want %d", what, finite, l->want_finite);
    for (size_t i = 0; i < l->count; i++)
        CHECK(memcmp(l->bufs[i].dst, l->want[i], l->bufs[i].length * esize[l->bufs[i].dtype]) == 0,
              "%s: buffer %zu differs from the scalar set", what, i);
}

static void list_free(list *l)
{
    for (size_t i = 0; i < l->count; i++) {
        free((void *)l->bufs[i].src);
        free(l->bufs[i].dst);
        free(l->want[i]);
    }
}

/* Lengths around the points where the work is split: 2^16 elements per
 * thread at least, boundaries on multiples of 64 elements. */
static void test_split_over_every_thread_count(void)
{
    static const size_t single[][1] = {{131072}, {131073}, {196608 + 63}, {262144 + 1}, {600001}};
    static const size_t mixed[] = {70000, 3, 0, 65536 * 3 + 5, 17, 1};
    for (int threads = 1; threads <= 9; threads += 2) {
        ls_set_num_threads(threads);
        for (size_t k = 0; k < sizeof single / sizeof single[0]; k++) {
            for (unsigned flags = 0; flags < 4; flags++) {
                list l;
                list_new(&l, 1, single[k], k + flags, k % 2, 1.0 / 3.0 + k, flags);
                list_check(&l, ls_unscale(l.bufs, 1, 1.0 / 3.0 + k, flags), "single buffer");
                CHECK(ls_all_finite(l.bufs, 1, flags) == l.want_inputs_finite, "all_finite");
                list_free(&l);
            }
        }
        list l;
        list_new(&l, 6, mixed, (uint64_t)threads, 1, 0.125, 0);
        list_check(&l, ls_unscale(l.bufs, 6, 0.125, 0), "mixed list");
        CHECK(ls_all_finite(l.bufs, 6, 0) == l.want_inputs_finite, "mixed all_finite");
        list_free(&l);
    }
    ls_set_num_threads(0);
}

/* The planner the library's threads and a host's pool share: every element
 * in exactly one chunk, in order; chunks begin on LS_GRAIN boundaries; no
 * more threads than LS_MIN_PER_THREAD shares, nor than asked for; at least
 * one chunk per thread, none smaller than a share. */
static void test_plan_covers_every_element(void)
{
    static const size_t totals[] = {0, 1, 63, 65535, 65536, 131071, 131072, 131073,
                                    200000, 1u << 20, (1u << 20) + 17, 25557032};
    for (size_t k = 0; k < sizeof totals / sizeof totals[0]; k++) {
        const size_t total = totals[k];
        for (int threads = -1; threads <= 300; threads += threads < 10 ? 1 : 37) {
            const ls_chunk_plan p = ls_plan_chunks(total, threads);
            const size_t shares = total / LS_MIN_PER_THREAD;
            CHECK(p.total == total && p.threads >= 1, "plan of %zu", total);
            CHECK(p.threads <= (threads < 1 ? 1 : threads), "%d threads asked, %d planned",
                  threads, p.threads);
            if (p.threads == 1) {
                CHECK(p.chunks == 1, "one thread, %zu chunks", p.chunks);
            } else {
                CHECK((size_t)p.threads <= shares && p.chunks >= (size_t)p.threads &&
                          p.chunks <= shares &&
                          p.chunks <= (size_t)p.threads * LS_CHUNKS_PER_THREAD,
                      "%zu elements: %d threads, %zu chunks", total, p.threads, p.chunks);
            }
            size_t end = 0;
            for (size_t c = 0; c < p.chunks; c++) {
                size_t b, e;
                ls_chunk_bounds(&p, c, &b, &e);
                CHECK(b == end && e >= b && (b % LS_GRAIN == 0 || b == total),
                      "%zu elements, chunk %zu: [%zu, %zu) after %zu", total, c, b, e, end);
                CHECK(p.threads == 1 || e - b >= LS_MIN_PER_THREAD - LS_GRAIN ||
                          e == total,
                      "%zu elements, chunk %zu: %zu only", total, c, e - b);
                end = e;
            }
            CHECK(end == total, "%zu elements, the chunks end at %zu", total, end);
        }
    }
}

/* A host's pool as the core sees it: a parallel-for over threads of its
 * own, cut by the same planner (what the TensorFlow ops do with the
 * intra-op pool).  Counts its calls. */
typedef struct host_part {
    const ls_chunk_plan *plan;
    size_t *next;
    ls_range_fn range;
    const void *ctx;
    int result;
} host_part;

static void *host_worker(void *arg)
{
    host_part *h = (host_part *)arg;
    h->result = ls_take_chunks(h->plan, h->next, h->range, h->ctx);
    return NULL;
}

static int host_parallel(void *host, ls_range_fn range, const void *ctx, size_t total)
{
    enum { HOST_THREADS = 3 };
    __atomic_fetch_add((int *)host, 1, __ATOMIC_RELAXED);
    const ls_chunk_plan plan = ls_plan_chunks(total, HOST_THREADS);
    size_t next = 0;
    host_part parts[HOST_THREADS];
    pthread_t t[HOST_THREADS];
    for (int i = 1; i < plan.threads; i++) {
        parts[i] = (host_part){&plan, &next, range, ctx, 1};
        CHECK(pthread_create(&t[i], NULL, host_worker, &parts[i]) == 0, "pthread_create");
    }
    int rc = ls_take_chunks(&plan, &next, range, ctx);
    for (int i = 1; i < plan.threads; i++) {
        pthread_join(t[i], NULL);
        rc = ls_combine_status(rc, parts[i].result);
    }
    return rc;
}

static void test_host_parallel_for(void)
{
    static const size_t lengths[] = {300000, 5, 0, 70001, 131072};
    for (unsigned flags = 0; flags < 4; flags++) {
        int calls = 0;
        list l;
        list_new(&l, 5, lengths, 7 + flags, flags % 2, 0.375, flags);
        list_check(&l, ls_unscale_with(l.bufs, 5, 0.375, flags, host_parallel, &calls),
                   "host parallel-for");
        CHECK(ls_all_finite_with(l.bufs, 5, flags, host_parallel, &calls) ==
                  l.want_inputs_finite,
              "host all_finite");
        CHECK(calls == 2, "the host's parallel-for ran %d times for 2 calls", calls);
        /* refused before any range runs */
        CHECK(ls_unscale_with(l.bufs, 5, 0.375, 1u << 7, host_parallel, &calls) == LS_ERR_ARG &&
                  calls == 2,
              "a bad flag reached the host");
        list_check(&l, l.want_finite, "after a refused call");
        list_free(&l);
    }
}

/* One non-finite value, in every part of a split check. */
static void test_check_finds_one_bad_value_anywhere(void)
{
    ls_set_num_threads(4);
    size_t n = 1u << 19;
    float *x = (float *)calloc(n, sizeof *x);
    ls_buffer b = {x, x, n, LS_FLOAT32};
    CHECK(ls_all_finite(&b, 1, 0) == 1, "zeros are finite");
    for (size_t pos = 0; pos < n; pos += n / 8 - 1) {
        uint32_t nan = 0x7fc00001u;
        memcpy(&x[pos], &nan, sizeof nan);
        CHECK(ls_all_finite(&b, 1, 0) == 0, "NaN at %zu missed", pos);
        x[pos] = 0.0f;
    }
    free(x);
    ls_set_num_threads(0);
}

typedef struct caller {
    int index;
    int failures;
} caller;

static void *concurrent_caller(void *arg)
{
    caller *c = (caller *)arg;
    for (int round = 0; round < 6; round++) {
        size_t lengths[2] = {150000 + (size_t)c->index * 1000, 70000};
        list l;
        list_new(&l, 2, lengths, (uint64_t)(c->index * 100 + round), round % 3 == 0, 0.5,
                 (unsigned)round % 4);
        int finite = ls_unscale(l.bufs, 2, 0.5, (unsigned)round % 4);
        list_check(&l, finite, "concurrent caller");
        list_free(&l);
    }
    return NULL;
}

static void *thread_count_changer(void *arg)
{
    volatile int *stop = (volatile int *)arg;
    for (int n = 0; !__atomic_load_n(stop, __ATOMIC_ACQUIRE); n = (n + 1) % 6)
        ls_set_num_threads(n);
    return NULL;
}

static void test_concurrent_callers(void)
{
    enum { CALLERS = 4 };
    pthread_t t[CALLERS], changer;
    caller c[CALLERS];
    int stop = 0;
    CHECK(pthread_create(&changer, NULL, thread_count_changer, &stop) == 0, "pthread_create");
    for (int i = 0; i < CALLERS; i++) {
        c[i] = (caller){i, 0};
        CHECK(pthread_create(&t[i], NULL, concurrent_caller, &c[i]) == 0, "pthread_create");
    }
    for (int i = 0; i < CALLERS; i++)
        pthread_join(t[i], NULL);
    __atomic_store_n(&stop, 1, __ATOMIC_RELEASE);
    pthread_join(changer, NULL);
    ls_set_num_threads(0);
}

/* The child of a fork has none of its parent's workers. */
static void test_fork_child_runs_its_own_pool(void)
{
    ls_set_num_threads(3);
    size_t lengths[1] = {400000};
    list l;
    list_new(&l, 1, lengths, 5, 0, 2.0, 0);
    list_check(&l, ls_unscale(l.bufs, 1, 2.0, 0), "parent before fork");
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        list m;
        list_new(&m, 1, lengths, 6, 1, 0.25, 0);
        list_check(&m, ls_unscale(m.bufs, 1, 0.25, 0), "forked child");
        list_free(&m);
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "forked child failed (status %d)",
          status);
    list_check(&l, ls_unscale(l.bufs, 1, 2.0, 0), "parent after fork");
    list_free(&l);
    ls_set_num_threads(0);
}

int main(void)
{
    if (ls_simd_level() < 0) {
        /* a level this CPU lacks: refused by every entry point */
        ls_buffer b = {"", NULL, 0, LS_FLOAT32};
        CHECK(ls_unscale(&b, 1, 1.0, 0) == LS_ERR_SIMD, "LS_ERR_SIMD expected");
        CHECK(ls_all_finite(&b, 1, 0) == LS_ERR_SIMD, "LS_ERR_SIMD expected");
        printf("test_threads: %s\n", ls_simd_error());
        return 0;
    }
    test_plan_covers_every_element();
    test_split_over_every_thread_count();
    test_host_parallel_for();
    test_check_finds_one_bad_value_anywhere();
    test_concurrent_callers();
    test_fork_child_runs_its_own_pool();
    printf("test_threads: ok (%s)\n", ls_simd_name(ls_simd_level()));
    return 0;
}
