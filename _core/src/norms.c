/*
 * Sums of squares in the order of TensorFlow's Sum kernel on CPU (see
 * lossscale.h, ls_squared_norms_with): Eigen's FullReducer on the thread
 * pool device (TensorReduction.h) with its vectorized tree reducer.
 *
 *   shards   TensorCostModel::numThreads(n, cost, threads) of them, cost
 *            per value 4 bytes loaded at 11/64 cycles each plus one add
 *            over an 8-lane packet; blocksize n / shards, as many blocks
 *            as fit, the rest one more range; result: the rest's sum (or
 *            0), plus each block's in order.
 *   tree     a range of more than 8 * 1024 values is split where the
 *            packet boundary at or after its middle falls (counted from 0,
 *            not from the range): 0 + left, then + right.
 *   leaf     four 8-lane accumulators over runs of 32 values, folded as
 *            ((a0 + a1) + a2) + a3, then single packets into a0, the
 *            values past the last packet added one by one onto 0, and
 *            that plus a0's lanes as SSE reduces them:
 *            ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
 *
 * Only the additions' grouping matters (every addition is one IEEE
 * float32 rounding, whatever vector unit makes it), so the lanes are GCC
 * vector types (two 4-lane halves each) in a file with no ISA flags: SSE2
 * on x86-64, which streams faster than the memory delivers.  Leaves are independent: the job sums
 * every leaf of every gradient over the threads, then replays each tree
 * on the calling thread over the leaves' sums.
 */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "lossscale.h"

enum { LANES = 8, LEAF = LANES * 1024 };

/* An 8-lane value is two 4-lane halves: GCC and clang keep a 16-byte
 * vector in one register (SSE, NEON), where a 32-byte one without AVX is
 * lowered through the stack. */
typedef float lanes4 __attribute__((vector_size(4 * sizeof(float))));
typedef struct lanes8 {
    lanes4 lo, hi;
} lanes8;

static inline __attribute__((always_inline)) lanes8 add8(lanes8 a, lanes8 b)
{
    return (lanes8){a.lo + b.lo, a.hi + b.hi};
}

/* How each value becomes its square: the values as given are squared
 * after no unscale, a division or a multiplication (by k); PLAIN values
 * are squares already (a sparse leaf's densified squares). */
enum { SQUARE_NONE, SQUARE_DIVIDE, SQUARE_MULTIPLY, PLAIN };

static inline __attribute__((always_inline)) lanes4 term4(const float *p, int mode, lanes4 k)
{
    lanes4 x;
    memcpy(&x, p, sizeof x);
    if (mode == PLAIN)
        return x;
    if (mode == SQUARE_DIVIDE)
        x = x / k;
    else if (mode == SQUARE_MULTIPLY)
        x = x * k;
    return x * x;
}

static inline __attribute__((always_inline)) lanes8 term8(const float *p, int mode, lanes4 k)
{
    return (lanes8){term4(p, mode, k), term4(p + 4, mode, k)};
}

static inline __attribute__((always_inline)) float term1(float x, int mode, float k)
{
    if (mode == PLAIN)
        return x;
    if (mode == SQUARE_DIVIDE)
        x = x / k;
    else if (mode == SQUARE_MULTIPLY)
        x = x * k;
    return x * x;
}

/* One leaf of n <= LEAF values (Eigen's InnerMostDimReducer<..., true,
 * false>::reduce). */
static inline __attribute__((always_inline)) float leaf_sum(const float *p, size_t n, int mode,
                                                            float k)
{
    const lanes4 kv = {k, k, k, k};
    lanes8 a0 = {{0}, {0}};
    size_t start = 0;
    if (n >= 4 * LANES) {
        const size_t runs = n / (4 * LANES) * (4 * LANES);
        lanes8 a1 = a0, a2 = a0, a3 = a0;
        for (size_t j = 0; j < runs; j += 4 * LANES) {
            a0 = add8(a0, term8(p + j, mode, kv));
            a1 = add8(a1, term8(p + j + LANES, mode, kv));
            a2 = add8(a2, term8(p + j + 2 * LANES, mode, kv));
            a3 = add8(a3, term8(p + j + 3 * LANES, mode, kv));
        }
        a0 = add8(a0, a1);
        a0 = add8(a0, a2);
        a0 = add8(a0, a3);
        start = runs;
    }
    if (n >= LANES && start <= n - LANES) {
        const size_t packets = n / LANES * LANES;
        for (size_t j = start; j < packets; j += LANES)
            a0 = add8(a0, term8(p + j, mode, kv));
        start = packets;
    }
    float rest = 0.0f;
    for (size_t j = start; j < n; j++)
        rest += term1(p[j], mode, k);
    const lanes4 b = a0.lo + a0.hi; /* lane l + lane l + 4 */
    return rest + ((b[0] + b[2]) + (b[1] + b[3]));
}

static float leaf_of(const float *p, size_t n, int mode, float k)
{
    switch (mode) {
    case SQUARE_DIVIDE: return leaf_sum(p, n, SQUARE_DIVIDE, k);
    case SQUARE_MULTIPLY: return leaf_sum(p, n, SQUARE_MULTIPLY, k);
    case PLAIN: return leaf_sum(p, n, PLAIN, k);
    default: return leaf_sum(p, n, SQUARE_NONE, k);
    }
}

/* ------------------------------------------------------------ the order */

/* Eigen's shards of n values: *blocks blocks of *size (0 blocks: one tree
 * over all n). */
static void shards_of(size_t n, int threads, size_t *blocks, size_t *size)
{
    const double cost = 4.0 * (1.0 / 64 * 11) + 1.0 / LANES;
    double t = ((double)n * cost - 100000.0) / 100000.0 + 0.9;
    if (t > (double)INT_MAX)
        t = (double)INT_MAX;
    int shards = (int)t;
    if (shards < 1)
        shards = 1;
    if (shards > threads)
        shards = threads;
    *blocks = *size = 0;
    if (shards == 1 || n == 0)
        return;
    *size = n / (size_t)shards;
    *blocks = *size > 0 ? n / *size : 0;
}

/* How many of the n values from `first` a range over a leaf's size puts
 * in its left half: up to the packet boundary at or after its middle,
 * counted from 0 (the right half starts at first + that). */
static size_t tree_left(size_t first, size_t n)
{
    const size_t half = (n + 1) / 2;
    const size_t split = LANES * ((first + half + LANES - 1) / LANES);
    return split - first < n ? split - first : n;
}

/* The tree over [first, first + n): each leaf's range appended through
 * `out` (when not NULL) at *count, which counts them either way. */
static void tree_leaves(size_t first, size_t n, size_t *out_first, size_t *out_n,
                        size_t *count)
{
    if (n > LEAF) {
        const size_t left = tree_left(first, n), split = first + left;
        tree_leaves(first, left, out_first, out_n, count);
        if (left < n)
            tree_leaves(split, n - left, out_first, out_n, count);
        return;
    }
    if (out_first != NULL) {
        out_first[*count] = first;
        out_n[*count] = n;
    }
    (*count)++;
}

/* The same tree's sum from its leaves' sums, taken from *next on. */
static float tree_combine(size_t first, size_t n, const float *leaf, size_t *next)
{
    if (n > LEAF) {
        const size_t left = tree_left(first, n), split = first + left;
        float sum = 0.0f + tree_combine(first, left, leaf, next);
        if (left < n)
            sum = sum + tree_combine(split, n - left, leaf, next);
        return sum;
    }
    return leaf[(*next)++];
}

/* Every tree of n values (the shards', then the rest's), as tree_leaves. */
static void all_leaves(size_t n, int threads, size_t *out_first, size_t *out_n, size_t *count)
{
    size_t blocks, size;
    shards_of(n, threads, &blocks, &size);
    if (blocks == 0) {
        if (n > 0)
            tree_leaves(0, n, out_first, out_n, count);
        return;
    }
    for (size_t b = 0; b < blocks; b++)
        tree_leaves(b * size, size, out_first, out_n, count);
    if (blocks * size < n)
        tree_leaves(blocks * size, n - blocks * size, out_first, out_n, count);
}

static float all_combine(size_t n, int threads, const float *leaf)
{
    size_t blocks, size, next = 0;
    shards_of(n, threads, &blocks, &size);
    if (blocks == 0)
        return n > 0 ? tree_combine(0, n, leaf, &next) : 0.0f;
    /* The rest's leaves follow every block's: its sum first, then each
     * block's added in order, each tree replayed where its leaves are. */
    size_t rest_leaves = 0;
    for (size_t b = 0; b < blocks; b++)
        tree_leaves(b * size, size, NULL, NULL, &rest_leaves);
    float total = 0.0f;
    if (blocks * size < n)
        total = tree_combine(blocks * size, n - blocks * size, leaf, &rest_leaves);
    for (size_t b = 0; b < blocks; b++)
        total = total + tree_combine(b * size, size, leaf, &next);
    return total;
}

/* ------------------------------------- the order over one float32 buffer */

float ls_eigen_tree_sum(const float *range, size_t first, size_t n, int square)
{
    if (n > LEAF) {
        const size_t left = tree_left(first, n), split = first + left;
        float sum = 0.0f + ls_eigen_tree_sum(range, first, left, square);
        if (left < n)
            sum = sum + ls_eigen_tree_sum(range + left, split, n - left, square);
        return sum;
    }
    return leaf_of(range, n, square ? SQUARE_NONE : PLAIN, 0.0f);
}

float ls_eigen_full_sum(const float *values, size_t n, int square, int eigen_threads)
{
    size_t blocks, size;
    shards_of(n, eigen_threads, &blocks, &size);
    if (blocks == 0)
        return n > 0 ? ls_eigen_tree_sum(values, 0, n, square) : 0.0f;
    float total = 0.0f;
    if (blocks * size < n)
        total = ls_eigen_tree_sum(values + blocks * size, blocks * size, n - blocks * size,
                                  square);
    for (size_t b = 0; b < blocks; b++)
        total = total + ls_eigen_tree_sum(values + b * size, b * size, size, square);
    return total;
}

size_t ls_eigen_full_leaves(size_t n, int eigen_threads, size_t *first, size_t *length)
{
    size_t count = 0;
    all_leaves(n, eigen_threads, first, length, &count);
    return count;
}

float ls_eigen_full_combine(size_t n, int eigen_threads, const float *leaf_sums)
{
    return all_combine(n, eigen_threads, leaf_sums);
}

/* ------------------------------------------------------------- the job */

typedef struct norm_job {
    const ls_norm_param *params;
    size_t count;
    int mode;
    float k;
    unsigned flags;
    /* Every leaf, gradient by gradient: its gradient, its range in that
     * gradient's (dense) values, and where it starts in the job's
     * elements (the concatenation of every gradient's dense values). */
    size_t leaves;
    size_t *param, *first, *n, *offset;
    float *sum;
    /* Per sparse gradient: its rows' slices (ls_sort_rows), else NULL. */
    size_t **start, **order;
} norm_job;

/* A sparse gradient's leaf: its densified squares into `dense`, then
 * summed; 0 when no slice touches it. */
static float sparse_leaf(const norm_job *j, size_t i, size_t first, size_t n, float *dense)
{
    const ls_norm_param *p = &j->params[i];
    const size_t w = p->row_length, r0 = first / w, r1 = (first + n - 1) / w;
    const size_t *start = j->start[i], *order = j->order[i];
    if (start[r1 + 1] == start[r0])
        return 0.0f;
    memset(dense, 0, n * sizeof(float));
    for (size_t r = r0; r <= r1; r++) {
        const size_t lo = r * w > first ? r * w : first;
        const size_t hi = (r + 1) * w < first + n ? (r + 1) * w : first + n;
        float *out = dense + (lo - first);
        for (size_t s = start[r]; s < start[r + 1]; s++) {
            const float *v = p->values + order[s] * w + (lo - r * w);
            for (size_t c = 0; c < hi - lo; c++)
                out[c] += term1(v[c], j->mode, j->k);
        }
    }
    return leaf_of(dense, n, PLAIN, 0.0f);
}

/* The leaves that start in elements [begin, end) of the job. */
static int norm_range(const void *arg, size_t begin, size_t end)
{
    const norm_job *j = arg;
    /* The first leaf starting at or after `begin`. */
    size_t lo = 0, hi = j->leaves;
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        if (j->offset[mid] < begin)
            lo = mid + 1;
        else
            hi = mid;
    }
    float *dense = NULL;
    ls_fpenv env;
    ls_fpenv_enter(&env, (j->flags & LS_FLUSH_DENORMALS) != 0);
    for (size_t l = lo; l < j->leaves && j->offset[l] < end; l++) {
        const ls_norm_param *p = &j->params[j->param[l]];
        if (p->indices == NULL) {
            j->sum[l] = leaf_of(p->values + j->first[l], j->n[l], j->mode, j->k);
            continue;
        }
        if (dense == NULL && (dense = malloc(LEAF * sizeof(float))) == NULL) {
            ls_fpenv_leave(&env);
            return LS_ERR_MEMORY;
        }
        j->sum[l] = sparse_leaf(j, j->param[l], j->first[l], j->n[l], dense);
    }
    ls_fpenv_leave(&env);
    free(dense);
    return 1;
}

/* The values a gradient's sum runs over: its own, or its dense form's. */
static size_t dense_length(const ls_norm_param *p)
{
    return p->indices != NULL ? p->rows * p->row_length : p->length;
}

long long ls_norm_bad_index(const ls_norm_param *p)
{
    if (p == NULL || p->indices == NULL)
        return -1;
    for (size_t k = 0; k < p->slices; k++)
        if (p->indices[k] < 0 || (uint64_t)p->indices[k] >= (uint64_t)p->rows)
            return (long long)k;
    return -1;
}

static int check_param(const ls_norm_param *p)
{
    if (p->length > 0 && p->values == NULL)
        return LS_ERR_ARG;
    if (p->indices == NULL)
        return p->length <= SIZE_MAX / sizeof(float) ? LS_OK : LS_ERR_ARG;
    const size_t w = p->row_length;
    if (w == 0) /* rows of no values: a sum of nothing */
        return p->length == 0 && ls_norm_bad_index(p) < 0 ? LS_OK : LS_ERR_ARG;
    if (p->slices > SIZE_MAX / w || p->slices * w != p->length
        || p->rows > SIZE_MAX / sizeof(float) / w || ls_norm_bad_index(p) >= 0)
        return LS_ERR_ARG;
    return LS_OK;
}

static void job_free(norm_job *j)
{
    free(j->param);
    if (j->start != NULL)
        for (size_t i = 0; i < j->count; i++)
            free(j->start[i]);
    free(j->start);
}

int ls_squared_norms_with(const ls_norm_param *params, size_t count, int unscale, double scale,
                          int eigen_threads, unsigned flags, float *sums,
                          ls_parallel_fn parallel, void *host)
{
    if ((count > 0 && (params == NULL || sums == NULL)) || eigen_threads < 1
        || (flags & ~(unsigned)LS_FLUSH_DENORMALS) != 0)
        return LS_ERR_ARG;
    norm_job j;
    memset(&j, 0, sizeof j);
    j.params = params;
    j.count = count;
    j.flags = flags;
    /* The scale in float32, and its reciprocal, in the call's own
     * floating-point state (the caller's may flush a subnormal scale). */
    ls_fpenv env;
    switch (unscale) {
    case LS_UNSCALE_NONE: j.mode = SQUARE_NONE; break;
    case LS_UNSCALE_DIVIDE:
        j.mode = SQUARE_DIVIDE;
        ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
        j.k = (float)scale;
        ls_fpenv_leave(&env);
        break;
    case LS_UNSCALE_MULTIPLY: {
        /* As ls_optim_config_check: finite and > 0 (TensorFlow 2.4's rule
         * keeps its scale >= 1). */
        if (!(scale > 0.0 && scale - scale == 0.0))
            return LS_ERR_ARG;
        j.mode = SQUARE_MULTIPLY;
        ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
        const float s = (float)scale;
        ls_fpenv_leave(&env);
        j.k = ls_reciprocal_f32(s, flags);
        break;
    }
    default: return LS_ERR_ARG;
    }
    size_t leaves = 0, total = 0;
    for (size_t i = 0; i < count; i++) {
        if (check_param(&params[i]) != LS_OK)
            return LS_ERR_ARG;
        const size_t n = dense_length(&params[i]);
        if (n > SIZE_MAX - total)
            return LS_ERR_ARG;
        total += n;
        all_leaves(n, eigen_threads, NULL, NULL, &leaves);
    }
    if (count == 0)
        return LS_OK;
    /* param, first, n, offset (size_t each) and sum (float) per leaf. */
    if (leaves > SIZE_MAX / (4 * sizeof(size_t) + sizeof(float)))
        return LS_ERR_MEMORY;
    j.param = malloc(leaves * (4 * sizeof(size_t) + sizeof(float)) + 1);
    j.start = calloc(count, 2 * sizeof(size_t *));
    if (j.param == NULL || j.start == NULL) {
        job_free(&j);
        return LS_ERR_MEMORY;
    }
    j.order = j.start + count;
    j.first = j.param + leaves;
    j.n = j.first + leaves;
    j.offset = j.n + leaves;
    j.sum = (float *)(void *)(j.offset + leaves);
    j.leaves = leaves;
    size_t at = 0, base = 0;
    for (size_t i = 0; i < count; i++) {
        const ls_norm_param *p = &params[i];
        const size_t from = at;
        all_leaves(dense_length(p), eigen_threads, j.first, j.n, &at);
        for (size_t l = from; l < at; l++) {
            j.param[l] = i;
            j.offset[l] = base + j.first[l];
        }
        base += dense_length(p);
        if (p->indices != NULL && dense_length(p) > 0) {
            j.start[i] = malloc((p->rows + 1 + p->slices) * sizeof(size_t));
            if (j.start[i] == NULL) {
                job_free(&j);
                return LS_ERR_MEMORY;
            }
            j.order[i] = j.start[i] + p->rows + 1;
            ls_sort_rows(p->indices, p->slices, p->rows, j.start[i], j.order[i]);
        }
    }
    int rc = (parallel ? parallel : ls_own_threads)(host, norm_range, &j, total);
    if (rc >= 0) {
        ls_fpenv env;
        ls_fpenv_enter(&env, (flags & LS_FLUSH_DENORMALS) != 0);
        size_t from = 0;
        for (size_t i = 0; i < count; i++) {
            const size_t n = dense_length(&params[i]);
            size_t mine = 0;
            all_leaves(n, eigen_threads, NULL, NULL, &mine);
            sums[i] = all_combine(n, eigen_threads, j.sum + from);
            from += mine;
        }
        ls_fpenv_leave(&env);
        rc = LS_OK;
    }
    job_free(&j);
    return rc;
}
