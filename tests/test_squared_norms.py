"""The native sums of squares (``core.squared_norms``, the
``LossScaleSquaredNorms`` op) that Keras' clipnorm and global_clipnorm take,
bit for bit.

Oracles: TensorFlow's own ``reduce_sum(square(u))`` (``u = g / scale`` and
the other unscales, a sparse gradient densified by TensorFlow's IndexedSlices
conversion first), run in the same process on the same device; and, for
thread counts other than this device's, a numpy restatement of the order of
Eigen's full reduction written here from its description (every addition a
float32 ``cumsum`` step or a scalar float32 addition, so numpy's pairwise
summation never enters).
"""

import numpy as np
import pytest
import tensorflow as tf

from helpers import assert_same_bits
from lossscale import _fused, _loader, core, ops

F32 = np.float32
LANES = 8
LEAF = LANES * 1024
# Sizes around every edge of the order: the 8-value packet, the 32-value
# run of four accumulators, a leaf, a tree split, and TensorFlow's second
# shard at two threads (from 258,462 values).
SIZES = ([0, 1, 7, 8, 9, 31, 32, 33, 39, 40, 63, 64, 65, 100, 1000, 8191, 8192, 8193,
          8200, 16383, 16385, 24577, 65537, 258461, 258462, 258463, 300001, 1 << 20])


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    monkeypatch.delenv(_loader.FORCE_FALLBACK_ENV, raising=False)
    status = ops.native_available()
    assert status, f"native op library not usable: {status.reason}"


def library():
    return _loader.load()[0]


# ------------------------------------------------------- numpy restatement

def _leaf(x):
    n = x.size
    a0 = np.zeros(LANES, F32)
    start = 0
    if n >= 4 * LANES:
        runs = n // (4 * LANES) * (4 * LANES)
        lanes = np.cumsum(x[:runs].reshape(-1, 4 * LANES), axis=0, dtype=F32)[-1]
        a = lanes.reshape(4, LANES)
        a0 = ((a[0] + a[1]) + a[2]) + a[3]
        start = runs
    if n >= LANES and start <= n - LANES:
        packets = n // LANES * LANES
        if packets > start:
            rows = np.vstack([a0[None], x[start:packets].reshape(-1, LANES)])
            a0 = np.cumsum(rows, axis=0, dtype=F32)[-1]
        start = packets
    rest = F32(0)
    for v in x[start:]:
        rest = F32(rest + v)
    b = a0[:4] + a0[4:]
    return F32(rest + F32(F32(b[0] + b[2]) + F32(b[1] + b[3])))


def _tree(x, first, n):
    if n > LEAF:
        half = (n + 1) // 2
        split = LANES * ((first + half + LANES - 1) // LANES)
        left = min(split - first, n)
        total = F32(F32(0) + _tree(x, first, left))
        if left < n:
            total = F32(total + _tree(x, split, n - left))
        return total
    return _leaf(x[first:first + n])


def eigen_sum(x, threads):
    """reduce_sum of the float32 vector ``x`` in the order of Eigen's full
    reduction on a device of ``threads`` threads."""
    x = np.ascontiguousarray(x, F32).reshape(-1)
    n = x.size
    if n == 0:
        return F32(0)
    cost = 4 * (11 / 64) + 1 / LANES
    shards = max(1, min(threads, int(min((n * cost - 100000) / 100000 + 0.9, 2**31 - 1))))
    if shards == 1:
        return _tree(x, 0, n)
    size = n // shards
    blocks = n // size
    sums = [_tree(x, b * size, size) for b in range(blocks)]
    total = _tree(x, blocks * size, n - blocks * size) if blocks * size < n else F32(0)
    for s in sums:
        total = F32(total + s)
    return total


def densified_squares(values, indices, rows):
    """A sparse gradient's squares densified as UnsortedSegmentSum adds them:
    each row's slices in their order onto 0."""
    squares = values.astype(F32) * values.astype(F32)
    out = np.zeros((rows,) + values.shape[1:], F32)
    for k, r in enumerate(indices):
        out[r] = out[r] + squares[k]
    return out


# ------------------------------------------------------------ the binding

def _values(n, seed, spread=300.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * spread).astype(F32)


@pytest.mark.parametrize("n", SIZES)
def test_binding_matches_tensorflow(n):
    """Below two shards TensorFlow's order does not depend on the thread
    count; above, the device's threads decide, and the op is checked."""
    g = _values(n, n)
    scale = F32(256.0)
    want = tf.reduce_sum(tf.square(tf.math.divide(tf.constant(g), tf.constant(scale))))
    got = core.squared_norms([g], scale=scale, eigen_threads=1, flush_denormals=True)
    if n < 258462:
        assert_same_bits(got[0], want.numpy(), f"{n} values")
    u = g / scale
    assert_same_bits(got[0], eigen_sum(u * u, 1), f"{n} values, restatement")


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("n", [258462, 300001, 1 << 20, 2_359_296 + 5])
def test_binding_follows_every_thread_count(n, threads):
    g = _values(n, threads)
    got = core.squared_norms([g], eigen_threads=threads)
    assert_same_bits(got[0], eigen_sum(g * g, threads), f"{n} values, {threads} threads")


def test_binding_unscales_as_tensorflow():
    g = _values(70001, 3)
    tg = tf.constant(g)
    for scale in (3.0, 2.0 ** 15, 0.75, 1e-3):
        s = tf.constant(scale, tf.float32)
        divided = tf.reduce_sum(tf.square(tf.math.divide(tg, s)))
        multiplied = tf.reduce_sum(tf.square(tg * (1.0 / s)))
        assert_same_bits(core.squared_norms([g], scale=scale, unscale="divide",
                                            flush_denormals=True)[0], divided.numpy())
        assert_same_bits(core.squared_norms([g], scale=scale, unscale="multiply",
                                            flush_denormals=True)[0], multiplied.numpy())
    assert_same_bits(core.squared_norms([g])[0], tf.reduce_sum(tf.square(tg)).numpy())


def test_binding_flushes_as_tensorflow():
    """Subnormal gradients (read as 0 by TensorFlow's kernels), values whose
    unscaled square is subnormal (flushed), next to normal ones."""
    rng = np.random.default_rng(5)
    g = np.concatenate([
        rng.standard_normal(3000) * 1e-40,          # subnormal float32
        rng.standard_normal(3000) * 1e-18,          # squares near float32's bottom
        rng.standard_normal(3000) * 2.0 ** -60,
        rng.standard_normal(3000)]).astype(F32)
    rng.shuffle(g)
    for scale in (1.0, 0.5, 2.0 ** 10):
        s = tf.constant(scale, tf.float32)
        want = tf.reduce_sum(tf.square(tf.math.divide(tf.constant(g), s))).numpy()
        got = core.squared_norms([g], scale=scale, flush_denormals=True)[0]
        assert_same_bits(got, want, f"scale {scale}")
    ieee = core.squared_norms([g], scale=1.0, flush_denormals=False)[0]
    assert_same_bits(ieee, eigen_sum(g.astype(F32) * g.astype(F32), 1))


def test_binding_non_finite():
    g = _values(20000, 9)
    for bad in (np.inf, -np.inf, np.nan):
        h = g.copy()
        h[12345] = bad
        want = tf.reduce_sum(tf.square(tf.constant(h))).numpy()
        got = core.squared_norms([h])[0]
        assert_same_bits(got, want, str(bad))
    huge = np.full(100, 3e38, F32)
    assert np.isinf(core.squared_norms([huge])[0])


@pytest.mark.parametrize("rows,width,slices,threads", [
    (10, 3, 7, 2), (1000, 37, 5000, 2), (5, 8192, 9, 2), (70000, 4, 100, 2),
    (30522, 32, 4000, 2), (4001, 64, 3000, 3), (300, 1, 50, 1)])
def test_binding_sparse_is_the_densified_sum(rows, width, slices, threads):
    rng = np.random.default_rng(rows + width)
    index = rng.integers(0, rows, slices).astype(np.int64)
    index[: slices // 3] = index[0]          # repeats, not sorted
    values = (rng.standard_normal((slices, width)) * 50).astype(F32)
    scale = F32(3.0)
    unscaled = values / scale
    dense = densified_squares(unscaled, index, rows)
    got = core.squared_norms([values], indices=[index], rows=[rows], scale=scale,
                             eigen_threads=threads)[0]
    assert_same_bits(got, eigen_sum(dense, threads), f"{rows} x {width}")
    if rows * width < 258462:
        sl = tf.IndexedSlices(tf.square(tf.constant(unscaled)), tf.constant(index),
                              tf.constant([rows, width], tf.int64))
        want = tf.reduce_sum(tf.convert_to_tensor(sl)).numpy()
        assert_same_bits(got, want, f"{rows} x {width} against TensorFlow")


def test_binding_lists_and_empty():
    a, b = _values(100, 1), _values(9000, 2)
    index = np.array([2, 0, 2], np.int64)
    c = _values(12, 3).reshape(3, 4)
    got = core.squared_norms([a, c, b], indices=[None, index, None], rows=[None, 5, None])
    assert_same_bits(got, np.array([eigen_sum(a * a, 2),
                                    eigen_sum(densified_squares(c, index, 5), 2),
                                    eigen_sum(b * b, 2)], F32))
    assert core.squared_norms([]).shape == (0,)
    assert_same_bits(core.squared_norms([np.zeros(0, F32)]), np.zeros(1, F32))
    empty = core.squared_norms([np.zeros((0, 4), F32)], indices=[np.zeros(0, np.int64)],
                               rows=[6])
    assert_same_bits(empty, np.zeros(1, F32))


@pytest.mark.parametrize("kwargs,message", [
    (dict(indices=[np.array([0, 5], np.int64)], rows=[5]), r"indices\[0\]\[1\] = 5"),
    (dict(indices=[np.array([-1, 0], np.int64)], rows=[5]), r"indices\[0\]\[0\] = -1"),
    (dict(indices=[np.array([0], np.int64)], rows=[5]), "one slice per index"),
    (dict(indices=[np.array([0, 1], np.int32)], rows=[5]), "int64"),
    (dict(indices=[np.array([0, 1], np.int64)], rows=[None]), "row count"),
    (dict(eigen_threads=0), "eigen_threads"),
    (dict(scale=1.0, unscale="sideways"), "unscale"),
    (dict(scale=-1.0), "scale"),
])
def test_binding_refuses_bad_input(kwargs, message):
    values = _values(8, 0).reshape(2, 4)
    with pytest.raises((ValueError, TypeError), match=message):
        core.squared_norms([values], **kwargs)


def test_binding_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float32"):
        core.squared_norms([np.ones(4, np.float16)])


# ------------------------------------------------------------------ the op

def _stock_dense(g, scale, unscale):
    if unscale == "divide":
        u = tf.math.divide(g, scale)
    elif unscale == "multiply":
        u = g * (1.0 / scale)
    else:
        u = g
    return tf.reduce_sum(tf.square(u))


@pytest.mark.parametrize("unscale", ["divide", "multiply", "none"])
@pytest.mark.parametrize("eager", [True, False])
def test_op_matches_tensorflow(unscale, eager):
    """Every size above, together in one op, against TensorFlow's ops on the
    same device (its own thread count), in a graph and eagerly."""
    grads = [tf.constant(_values(n, n + 1)) for n in SIZES]
    scale = tf.constant(2.0 ** 7 * 3, tf.float32)

    def both(gs):
        got = library().loss_scale_squared_norms(gs, [], scale, unscale=unscale)
        return got, [_stock_dense(g, scale, unscale) for g in gs]

    got, want = both(grads) if eager else tf.function(both)(grads)
    for n, a, b in zip(SIZES, got, want):
        assert_same_bits(a.numpy(), b.numpy(), f"{n} values")


def test_op_sparse_matches_tensorflow():
    rng = np.random.default_rng(11)
    cases = [(30522, 768, 4096), (1000, 300, 2000), (7, 5, 3), (50, 16, 0)]
    values, indices, dense = [], [], []
    scale = tf.constant(1024.0)
    for rows, width, k in cases:
        index = rng.integers(0, rows, k).astype(np.int64)
        v = tf.constant((rng.standard_normal((k, width)) * 100).astype(F32))
        values.append(v)
        indices.append(tf.constant(index))
        sl = tf.IndexedSlices(tf.square(tf.math.divide(v, scale)), tf.constant(index),
                              tf.constant([rows, width], tf.int64))
        dense.append(tf.reduce_sum(tf.convert_to_tensor(sl)))
    got = library().loss_scale_squared_norms(
        values, indices, scale, sparse=list(range(len(cases))),
        rows=[c[0] for c in cases], unscale="divide")
    for case, a, b in zip(cases, got, dense):
        assert_same_bits(a.numpy(), b.numpy(), str(case))


def test_op_names_the_variable_of_a_bad_index():
    v = tf.ones((2, 4))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"the gradient of dense/kernel: index 9 \(slice 1\) is outside"):
        library().loss_scale_squared_norms(
            [tf.ones(3), v], [tf.constant([0, 9], tf.int64)], tf.constant(1.0), sparse=[1],
            rows=[5], names=["dense/bias", "dense/kernel"])


def test_fused_plan_takes_the_native_sums():
    """The fused step's norms come from the op, and agree with TensorFlow's
    on this build (the per-process check of the order)."""
    assert _fused._native_norms_agree(library())
    grads = [tf.constant(_values(1000, 1)), tf.IndexedSlices(
        tf.constant(_values(24, 2).reshape(3, 8)), tf.constant([4, 1, 4]),
        tf.constant([6, 8]))]
    scale = tf.constant(8.0)

    @tf.function
    def sums(gs):
        return _fused._squared_norms(gs, scale, "divide", None, "global")

    graph = sums.get_concrete_function(grads).graph
    assert [op.type for op in graph.get_operations()].count("LossScaleSquaredNorms") == 1
    got = sums(grads)
    want = [_stock_dense(grads[0], scale, "divide"),
            tf.reduce_sum(tf.convert_to_tensor(tf.IndexedSlices(
                tf.square(grads[1].values / scale), grads[1].indices,
                grads[1].dense_shape)))]
    for a, b in zip(got, want):
        assert_same_bits(a.numpy(), b.numpy())
