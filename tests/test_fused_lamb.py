"""Keras' Lamb on the fused step, against stock
``keras.optimizers.LossScaleOptimizer(Lamb(...))``.

Lamb's update takes two norms between its moments and the variable's move:
the variable's and its step's ``u``.  The fused step decays each variable
and makes m, v and u in one pass (the LossScaleLambMoments op, the
gradients unscaled on the fly; a sparse gradient taken as its slices,
densified with their squares a block at a time in the pass); then, in a graph where the probe finds stock's lines
rewritten as the native ops compute them, the norms by
the op's own sums of squares (each leaf taken in its pass) and the move by
the fused SGD op, else Keras' own
lines on that u.  The op's pass is checked against numpy's float32
arithmetic element by element (every way of taking the gradient: as it is,
divided by a scale, times a power of two's exact reciprocal, as slices;
each decay form; m, v and u over float32's range), the step against stock
over shapes of every rank, variables that split over the threads, sparse
gradients, eagerly and in a ``tf.function``, overflow steps among them; the
model-level lockstep (both mixed policies, clips, weight decay, schedules,
EMA, accumulation, MirroredStrategy) is in test_fused_step, test_fused_clip,
test_fused_ema_accum, test_fused_distributed and
test_fused_distributed_sparse.  The op refuses bad input before anything
moves.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from lossscale import ops as native_ops
from helpers import bits
from test_fused_adafactor import SPARSE_CLIPS, sparse_form, sparse_lockstep
from test_fused_adafactor import lockstep as adafactor_lockstep
from test_fused_step import Ours, Stock, assert_fused

SHAPES = [(), (1,), (40,), (7, 13), (3, 3, 16, 24), (2, 1, 5, 1)]
# Over the op's split between threads (65,536 values a thread at least),
# one of them the size of no vector.
LARGE = [(600, 500), (300007,)]


def library():
    return native_ops.native_library_for([])


def lockstep(shapes, graph, steps, kw, **options):
    """test_fused_adafactor's lockstep of ours and stock, around Lamb(**kw)."""
    return adafactor_lockstep(shapes, graph, steps, kw, make=keras.optimizers.Lamb, **options)


CONFIGS = {
    "default": {},
    "keywords": dict(learning_rate=0.05, beta_1=0.8, beta_2=0.95, epsilon=1e-3),
    "schedule_decay": dict(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(0.02, 5, 0.8),
        weight_decay=0.01),
}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_shape_bit_identical_to_stock(config, graph):
    ours = lockstep(SHAPES, graph, 10, CONFIGS[config])
    assert ours.step_path == "fused (Lamb)", ours.step_path
    assert int(ours.iterations.numpy()) == 9  # the overflow step skipped


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_large_variables_bit_identical_to_stock(graph):
    ours = lockstep(LARGE, graph, 3, {}, inf_at=())
    assert_fused(ours)


def test_zero_variable_and_zero_step_take_a_ratio_of_one_as_stock():
    """Keras' ratio is 1 where a norm is 0: a variable of zeros, and a
    gradient of zeros (m and v stay 0, so u is 0)."""
    for init in (np.zeros((4, 3), np.float32), np.ones((4, 3), np.float32)):
        twins = [keras.Variable(init) for _ in range(2)]
        opts = [cls(keras.optimizers.Lamb(0.01), initial_scale=4.0) for cls in (Stock, Ours)]
        for opt, v in zip(opts, twins):
            opt.apply([tf.zeros((4, 3)) if init.any() else tf.ones((4, 3))], [v])
        assert bits(twins[0].numpy()) == bits(twins[1].numpy())
        assert_fused(opts[1])


# ------------------------------------------- the norms and move in a graph

def op_types(function, *args):
    """The op types of ``function``'s graph for ``args``, with the functions
    it calls (a cond's branches)."""
    types = set()

    def walk(graph):
        types.update(op.type for op in graph.get_operations())
        for called in graph._functions.values():  # pylint: disable=protected-access
            walk(called.graph)

    walk(function.get_concrete_function(*args).graph)
    return types


def test_graph_step_takes_its_norms_and_move_by_native_ops():
    """In a tf.function, the variables of more than one element have their
    norms summed in the Lamb op's pass and move by LossScaleApplyOptimizer
    where the probe finds stock's lines rewritten as those compute them
    (Pow(x, 2) as Square, ``(ratio * lr) * u``); the probe says so in a
    graph and not eagerly, where Pow stays TensorFlow's Pow."""
    from lossscale import _fused

    variables = [keras.Variable(np.ones(s, np.float32) * 0.5) for s in [(30, 40), (40,), (1,)]]
    ours = Ours(keras.optimizers.Lamb(0.01), initial_scale=4.0)
    apply = tf.function(lambda grads: ours.apply(grads, variables))
    grads = [tf.ones(v.shape) for v in variables]
    apply(grads)
    assert_fused(ours)
    types = op_types(apply, grads)
    assert {"LossScaleLambMoments", "LossScaleApplyOptimizer"} <= types
    assert "LossScaleSquaredNorms" not in types
    assert _fused._pow_lanes().size > 0  # TensorFlow's Pow differs from x * x here
    rate, iterations = tf.Variable(0.01), tf.Variable(3, dtype=tf.int64)
    assert bool(tf.function(lambda: _fused._lamb_probe(rate, iterations))())
    assert not bool(_fused._lamb_probe(rate, iterations))


def test_probe_tells_pow_left_as_written():
    """With the graph optimizer's arithmetic pass off, power(x, 2) stays
    TensorFlow's Pow and the probe says so; the step then takes Keras' own
    ops, bit-identical to stock's."""
    from lossscale import _fused

    rate, iterations = tf.Variable(0.01), tf.Variable(3, dtype=tf.int64)
    previous = tf.config.optimizer.get_experimental_options().get("arithmetic_optimization")
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    try:
        assert not bool(tf.function(lambda: _fused._lamb_probe(rate, iterations))())
        assert_fused(lockstep(SHAPES, True, 8, CONFIGS["schedule_decay"]))
    finally:
        tf.config.optimizer.set_experimental_options(
            {"arithmetic_optimization": True if previous is None else previous})


def test_probe_false_moves_by_keras_ops_as_stock(monkeypatch):
    """Should the probe find either rewrite missing, every variable moves by
    Keras' own lines, bit-identical to stock."""
    from lossscale import _fused

    monkeypatch.setattr(_fused, "_lamb_probe", lambda lr, iterations: tf.constant(False))
    assert_fused(lockstep(SHAPES + LARGE[:1], True, 8, CONFIGS["schedule_decay"]))


@pytest.mark.parametrize("config", ["keywords", "schedule_decay"])
def test_one_variable_moves_as_stock(config):
    """A step of one variable: stock's learning rate feeds that one chain,
    which the graph optimizer may then merge with a schedule's products; it
    moves by Keras' own lines."""
    assert_fused(lockstep([(7, 13)], True, 10, CONFIGS[config]))


# ------------------------------------------------------ sparse gradients

@pytest.mark.parametrize("kw", SPARSE_CLIPS, ids=["plain", "clipnorm", "global_clipnorm",
                                                  "clipvalue_decay_ema"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_sparse_gradient_bit_identical_to_stock(graph, dtype, kw):
    """An embedding table's slices (a row named twice, rows never named)
    beside dense variables: Keras densifies the slices, and apart from them
    their squares (a row's duplicates' squares summed); the op takes the
    slices and makes both (under ``global_clipnorm`` Keras densifies the
    gradient first, and the op squares it).  A step with an overflow is
    skipped by both."""
    sparse_lockstep(keras.optimizers.Lamb, graph, 2.0**10, kw, dtype=dtype, steps=10)


def test_sparse_gradient_with_an_inexact_scale_bit_identical_to_stock():
    sparse_lockstep(keras.optimizers.Lamb, True, 1000.0, {}, dtype=np.float32)


def test_sparse_gradient_takes_the_op():
    """(Under several replicas too: test_fused_distributed_sparse.)"""
    from lossscale import _fused

    assert sparse_form(keras.optimizers.Lamb)[0] is _fused.DENSIFIED_WITH_SQUARES


def test_sparse_gradient_is_never_made_whole_in_a_graph():
    """The op takes a sparse gradient's slices and indices, and the step's
    graph densifies nothing (no UnsortedSegmentSum: stock's graph has two,
    one for the slices and one for their squares)."""
    table = keras.Variable(np.ones((10, 4), np.float32), name="table")
    dense = keras.Variable(np.ones((3, 4), np.float32), name="kernel")
    grads = [tf.IndexedSlices(tf.ones((3, 4)), tf.constant([1, 7, 1]), tf.constant([10, 4])),
             tf.ones((3, 4))]

    def graph_of(cls):
        opt = cls(keras.optimizers.Lamb(0.01), initial_scale=4.0)
        apply = tf.function(lambda: opt.apply(grads, [table, dense]))
        graph = apply.get_concrete_function().graph
        return op_types(apply), graph, opt

    types, graph, ours = graph_of(Ours)
    assert_fused(ours)
    moments = [op for g in [graph] + [f.graph for f in graph._functions.values()]
               for op in g.get_operations() if op.type == "LossScaleLambMoments"]
    assert [op.get_attr("sparse") for op in moments] == [[0]]
    assert "UnsortedSegmentSum" not in types
    assert "UnsortedSegmentSum" in graph_of(Stock)[0]


# ------------------------------------------------------- the op's pass

def op_case(shape=(3, 4), seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal(shape).astype(np.float32)
    v = rng.uniform(0.0, 4.0, shape).astype(np.float32)
    g = (rng.standard_normal(shape) * scale).astype(np.float32)
    made = {"m": tf.Variable(m, name="m"), "v": tf.Variable(v, name="v")}
    args = dict(m=[made["m"].handle], v=[made["v"].handle], grads=[tf.constant(g)],
                scale=tf.constant(scale), bias_1=tf.constant(np.float32(0.271)),
                bias_2=tf.constant(np.float32(0.00299)), variables=[],
                learning_rate=tf.constant(0.01), weight_decay=tf.constant(0.0), indices=[],
                weights=[],
                one_minus_beta_1=0.1, one_minus_beta_2=0.001, epsilon=1e-6, unscale="divide")
    return made, args, (m, v, g)


def numpy_pass(m, v, g, args, term=None):
    """The op's arithmetic in numpy's float32 operations, one rounding each
    (with a ``term``, g as it is and the term in place of its square)."""
    f = np.float32
    how = args["unscale"]
    x = g / f(args["scale"].numpy()) if how == "divide" and term is None else g
    m1 = m + (x - m) * f(args["one_minus_beta_1"])
    v1 = v + ((x * x if term is None else term) - v) * f(args["one_minus_beta_2"])
    u = (m1 / args["bias_1"].numpy()) / (np.sqrt(v1 / args["bias_2"].numpy())
                                          + f(args["epsilon"]))
    return m1, v1, u


@pytest.mark.parametrize("shape", [(3, 4), (1,), (37,), (70001,)])
@pytest.mark.parametrize("unscale,scale", [("divide", 2.0**-9), ("divide", 3.0),
                                           ("none", 1.0), ("divide", 2.0**20)])
def test_op_pass_against_numpy(shape, unscale, scale):
    made, args, (m, v, g) = op_case(shape, scale=scale)
    args = {**args, "unscale": unscale, "scale": tf.constant(np.float32(scale))}
    with np.errstate(all="ignore"):
        m1, v1, u = numpy_pass(m, v, g, args)
    out, _ = library().loss_scale_lamb_moments(**args)
    assert bits(made["m"].numpy()) == bits(m1)
    assert bits(made["v"].numpy()) == bits(v1)
    assert bits(out[0].numpy()) == bits(u)


def test_op_pass_of_special_values_against_numpy():
    """Infinities, NaNs, zeros of both signs and values near float32's
    largest in g, m and v, each lane of a vector and the tail.  (No value
    whose results fall below float32's normal range: the op flushes those,
    as TensorFlow's CPU kernels do, and numpy does not.)"""
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1.0, -2.5,
                         1e20, 7.0], np.float32)
    rng = np.random.default_rng(3)
    n = 61
    g, m, v = (rng.choice(specials, n) for _ in range(3))
    v = np.abs(v)
    made = {"m": tf.Variable(m), "v": tf.Variable(v)}
    args = dict(m=[made["m"].handle], v=[made["v"].handle], grads=[tf.constant(g)],
                scale=tf.constant(np.float32(0.5)), bias_1=tf.constant(np.float32(0.1)),
                bias_2=tf.constant(np.float32(0.001)), variables=[],
                learning_rate=tf.constant(0.01), weight_decay=tf.constant(0.0), indices=[],
                weights=[],
                one_minus_beta_1=0.1, one_minus_beta_2=0.001, epsilon=1e-6, unscale="divide")
    with np.errstate(all="ignore"):
        want = numpy_pass(m, v, g, args)
    out, _ = library().loss_scale_lamb_moments(**args)
    for got, expected in zip((made["m"].numpy(), made["v"].numpy(), out[0].numpy()), want):
        nan = np.isnan(expected)
        assert np.array_equal(np.isnan(got), nan)
        assert bits(got[~nan]) == bits(expected[~nan])


def densified(values, index, rows, scale, unscale):
    """TensorFlow's conversion of slices unscaled as the op unscales them
    (numpy's float32 division), and of their squares: each row's slices
    added in their order onto 0, one rounding each."""
    f = np.float32
    x = values / f(scale) if unscale == "divide" else values
    g = np.zeros((rows,) + values.shape[1:], np.float32)
    t = np.zeros_like(g)
    for k, row in enumerate(index):
        g[row] = g[row] + x[k]
        t[row] = t[row] + x[k] * x[k]
    return g, t


@pytest.mark.parametrize("rows,cols,slices", [(5, 3, 0), (6, 1, 9), (40, 37, 120),
                                              (3, 5000, 7), (700, 100, 1500)])
@pytest.mark.parametrize("unscale,scale", [("divide", 512.0), ("divide", 1000.0),
                                           ("none", 1.0)])
def test_op_pass_with_a_sparse_gradient_against_numpy(rows, cols, slices, unscale, scale):
    """Three variables, the middle one's gradient slices (rows named twice
    and more, rows never named; no slice at all): the op makes their dense
    form and their squares' a block at a time as Keras' Lamb densifies
    them, then the pass; the others as dense ones.  Each against numpy's
    float32 arithmetic, the sparse one's m, v and u over every row."""
    rng = np.random.default_rng(rows * cols + slices)
    f = np.float32
    cases = [op_case((211,), seed=0, scale=scale), op_case((rows, cols), seed=1, scale=scale),
             op_case((64,), seed=2, scale=scale)]
    index = rng.integers(0, rows, slices)
    values = (rng.standard_normal((slices, cols)) * scale).astype(np.float32)
    values[:, 0] = -0.0  # onto +0: +0, as TensorFlow's sum makes it
    args = {**cases[0][1], "m": [c[1]["m"][0] for c in cases],
            "v": [c[1]["v"][0] for c in cases],
            "grads": [tf.constant(cases[0][2][2]), tf.constant(values), tf.constant(cases[2][2][2])],
            "scale": tf.constant(f(scale)), "unscale": unscale,
            "indices": [tf.constant(index, tf.int64)], "sparse": [1]}
    out, _ = library().loss_scale_lamb_moments(**args)
    g, t = densified(values, index, rows, scale, unscale)
    for k, ((made, _, (m, v, dense)), u) in enumerate(zip(cases, out)):
        if k == 1:
            m1, v1, u1 = numpy_pass(m, v, g, args, term=t)
        else:
            m1, v1, u1 = numpy_pass(m, v, dense, args)
        assert u.shape == m.shape
        assert bits(made["m"].numpy()) == bits(m1), k
        assert bits(made["v"].numpy()) == bits(v1), k
        assert bits(u.numpy()) == bits(u1), k


def test_op_pass_with_a_sparse_gradient_and_a_decay_against_numpy():
    """A decayed table with a sparse gradient: every row decays, named or
    not, before its moments, as Keras decays the variable first."""
    rng = np.random.default_rng(4)
    made, args, (m, v, _) = op_case((50, 8), scale=512.0)
    start = rng.standard_normal((50, 8)).astype(np.float32)
    weight = tf.Variable(start)
    index = np.array([3, 3, 49, 0, 3], np.int64)
    values = (rng.standard_normal((5, 8)) * 512).astype(np.float32)
    wd, lr = np.float32(0.037), np.float32(0.29)
    args = {**args, "grads": [tf.constant(values)], "scale": tf.constant(512.0),
            "indices": [tf.constant(index)], "sparse": [0], "variables": [weight.handle],
            "learning_rate": tf.constant(lr), "weight_decay": tf.constant(wd),
            "decayed": [0], "decay": [1]}
    out, _ = library().loss_scale_lamb_moments(**args)
    g, t = densified(values, index, 50, 512.0, "divide")
    m1, v1, u1 = numpy_pass(m, v, g, args, term=t)
    assert bits(weight.numpy()) == bits(start - (start * wd) * lr)
    assert bits(made["m"].numpy()) == bits(m1)
    assert bits(made["v"].numpy()) == bits(v1)
    assert bits(out[0].numpy()) == bits(u1)


def test_op_decays_each_variable_as_its_form_says_against_numpy():
    """Four variables: three decayed in the pass, one by each form (Keras'
    ``w - (w * wd) * lr`` op by op, ``w - w * (wd * lr)`` as the graph
    optimizer reorders it, ``w - w * factor``), one left alone; each
    against numpy's float32 arithmetic, the moments and u as without a
    decay."""
    rng = np.random.default_rng(9)
    cases = [op_case((1000 + 7 * k,), seed=k, scale=512.0) for k in range(4)]
    start = [rng.standard_normal(1000 + 7 * k).astype(np.float32) for k in range(4)]
    weights = [tf.Variable(w) for w in start]
    wd, lr = np.float32(0.037), np.float32(0.29)
    args = {**cases[0][1], "m": [c[1]["m"][0] for c in cases],
            "v": [c[1]["v"][0] for c in cases], "grads": [tf.constant(c[2][2]) for c in cases],
            "scale": tf.constant(512.0), "variables": [w.handle for w in weights[:3]],
            "learning_rate": tf.constant(lr), "weight_decay": tf.constant(wd),
            "decayed": [0, 1, 2], "decay": [1, 2, 3]}
    out, _ = library().loss_scale_lamb_moments(**args)
    want = [start[0] - (start[0] * wd) * lr, start[1] - start[1] * (wd * lr),
            start[2] - start[2] * wd, start[3]]
    for w, expected in zip(weights, want):
        assert bits(w.numpy()) == bits(expected)
    for (made, _, (m, v, g)), u in zip(cases, out):
        m1, v1, u1 = numpy_pass(m, v, g, args)
        assert bits(made["m"].numpy()) == bits(m1)
        assert bits(u.numpy()) == bits(u1)


@pytest.mark.parametrize("length", [13, 8195, 70001, 300007])
def test_op_sums_of_squares_are_tensorflows(length):
    """Four variables asking for sums: one decayed (its sum is of the
    decayed values), one read as given, a sparse table's (its u from the
    densified slices) and a decayed table of rows; each sum bit for bit
    TensorFlow's Sum of Square over the whole tensor (a short tail, one
    leaf, a tree, two shards), leaves split over the threads or not."""
    rng = np.random.default_rng(length)
    rows = max(length // 64, 1)
    cases = [op_case((length,), seed=0, scale=512.0), op_case((length,), seed=1, scale=512.0),
             op_case((rows, 64), seed=2, scale=512.0), op_case((rows, 64), seed=3, scale=512.0)]
    start = [rng.standard_normal(c[2][0].shape).astype(np.float32) for c in cases]
    weights = [tf.Variable(w) for w in start]
    index = rng.integers(0, rows, 2 * rows)
    values = (rng.standard_normal((2 * rows, 64)) * 512).astype(np.float32)
    args = {**cases[0][1], "m": [c[1]["m"][0] for c in cases],
            "v": [c[1]["v"][0] for c in cases],
            "grads": [tf.constant(cases[0][2][2]), tf.constant(cases[1][2][2]),
                      tf.constant(values), tf.constant(cases[3][2][2])],
            "scale": tf.constant(512.0), "learning_rate": tf.constant(np.float32(0.29)),
            "weight_decay": tf.constant(np.float32(0.037)),
            "variables": [weights[0].handle, weights[3].handle], "decayed": [0, 3],
            "decay": [1, 2], "indices": [tf.constant(index, tf.int64)], "sparse": [2],
            "weights": [weights[1].handle, weights[2].handle], "normed": [0, 1, 2, 3]}
    us, sums = library().loss_scale_lamb_moments(**args)
    assert sums.shape == (4, 2)
    for k, (w, u) in enumerate(zip(weights, us)):
        want_w = tf.reduce_sum(tf.square(tf.reshape(w, [-1])))
        want_u = tf.reduce_sum(tf.square(tf.reshape(u, [-1])))
        assert bits(sums[k, 0].numpy()) == bits(want_w.numpy()), k
        assert bits(sums[k, 1].numpy()) == bits(want_u.numpy()), k
    assert bits(weights[1].numpy()) == bits(start[1])  # read only
    assert bits(weights[0].numpy()) == bits(start[0] - (start[0] * np.float32(0.037))
                                            * np.float32(0.29))


def snapshot(made):
    return {name: v.numpy().tobytes() for name, v in made.items()}


@pytest.mark.parametrize("bad,message", [
    (lambda made, a: {**a, "v": [tf.Variable(np.ones(4, np.float32)).handle]},
     "has shape [4], expected [3,4]"),
    (lambda made, a: {**a, "m": [tf.Variable(np.ones((3, 4), np.float64)).handle]},
     "must be float32"),
    (lambda made, a: {**a, "v": [made["m"].handle]}, "passed twice"),
    (lambda made, a: {**a, "grads": [tf.ones((4, 3))]}, "has shape [3,4], expected [4,3]"),
    (lambda made, a: {**a, "bias_1": tf.constant([0.5, 0.5])}, "must be a scalar"),
    (lambda made, a: {**a, "grads": [tf.ones((2, 4))], "sparse": [0],
                      "indices": [tf.constant([0, 3], tf.int64)]}, "has index 3, outside [0, 3)"),
    (lambda made, a: {**a, "grads": [tf.ones((2, 4))], "sparse": [0],
                      "indices": [tf.constant([0, -1], tf.int64)]}, "has index -1, outside [0, 3)"),
    (lambda made, a: {**a, "grads": [tf.ones((2, 5))], "sparse": [0],
                      "indices": [tf.constant([0, 1], tf.int64)]},
     "has slices of shape [2,5] for rows of the variable of shape [3,4]"),
    (lambda made, a: {**a, "grads": [tf.ones((2, 4))], "sparse": [0],
                      "indices": [tf.constant([0, 1, 2], tf.int64)]}, "has 3 indices for 2 slices"),
    (lambda made, a: {**a, "grads": [tf.ones((2, 4))], "sparse": [1],
                      "indices": [tf.constant([0, 1], tf.int64)]},
     "sparse must be ascending positions of variables, below 1"),
    (lambda made, a: {**a, "grads": [tf.ones((2, 4))], "sparse": [],
                      "indices": [tf.constant([0, 1], tf.int64)]}, "1 indices for 0 sparse"),
    (lambda made, a: {**a, "variables": [made["m"].handle], "decayed": [0], "decay": [1]},
     "passed twice"),
    (lambda made, a: {**a, "variables": [tf.Variable(np.ones(12, np.float32)).handle],
                      "decayed": [0], "decay": [1]}, "has shape [12], expected [3,4]"),
    (lambda made, a: {**a, "variables": [tf.Variable(np.ones((3, 4), np.float32)).handle],
                      "decayed": [0], "decay": [4]}, "a decay must be 1, 2 or 3, got 4"),
    (lambda made, a: {**a, "variables": [tf.Variable(np.ones((3, 4), np.float32)).handle],
                      "decayed": [0], "decay": []}, "1 variables and 0 decays"),
    (lambda made, a: {**a, "weight_decay": tf.constant([0.5, 0.5])}, "must be a scalar"),
    (lambda made, a: {**a, "normed": [1]}, "normed must be ascending positions of variables"),
    (lambda made, a: {**a, "normed": [0]}, "0 weights for 1 normed variables not decayed"),
    (lambda made, a: {**a, "normed": [0], "weights": [tf.Variable(np.ones(12, np.float32)).handle]},
     "has shape [12], expected [3,4]"),
    (lambda made, a: {**a, "normed": [0], "weights": [made["m"].handle]}, "passed twice"),
], ids=["v_shape", "dtype", "twice", "grad_shape", "bias_shape", "index_above", "index_below",
        "slice_shape", "indices_count", "sparse_range", "sparse_count", "variable_twice", "variable_shape", "decay_form", "decay_count",
        "weight_decay_shape", "normed_range", "weights_count", "weights_shape",
        "weights_twice"])
def test_op_refuses_bad_input_and_changes_nothing(bad, message):
    made, args, _ = op_case()
    before = snapshot(made)
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        library().loss_scale_lamb_moments(**bad(made, args))
    assert snapshot(made) == before


def test_op_keeps_a_sparse_gradients_u_buffer_only_once_released():
    """A sparse gradient's u (no gradient buffer can hold it) goes into a
    buffer the kernel keeps: handed out again once the last step's u is
    released, never while something still holds it (then a fresh one, and
    the u held keeps its values)."""
    from lossscale import ops

    rows, cols = 600, 512  # past the 1 MiB from which the kernel keeps u
    made, args, _ = op_case((rows, cols), scale=512.0)
    rng = np.random.default_rng(5)

    def step():
        values = (rng.standard_normal((40, cols)) * 512).astype(np.float32)
        index = rng.integers(0, rows, 40)
        out, _ = library().loss_scale_lamb_moments(
            **{**args, "grads": [tf.constant(values)], "indices": [tf.constant(index, tf.int64)],
               "sparse": [0]})
        u, address = ops._debug_buffer_address(out[0])
        return u, int(address)

    held, first = step()
    kept = held.numpy().tobytes()
    second_u, second = step()
    assert second != first  # the first u is still held
    assert held.numpy().tobytes() == kept
    del held, second_u
    assert step()[1] == second  # released: the kept buffer again
