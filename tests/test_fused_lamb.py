"""Keras' Lamb on the fused step, against stock
``keras.optimizers.LossScaleOptimizer(Lamb(...))``.

Lamb's update takes two norms between its moments and the variable's move:
the variable's and its step's ``u``.  The fused step makes m, v and u in one
pass (the LossScaleLambMoments op, the gradients unscaled on the fly), then
takes the norms, their ratio and the move with Keras' own ops on that u, so
that each reduction is TensorFlow's, as a graph rewrites it or not.  The
op's pass is checked against numpy's float32 arithmetic element by element
(every way of taking the gradient: as it is, divided by a scale, times a
power of two's exact reciprocal; m, v and u over float32's range), the step
against stock over shapes of every rank, variables that split over the
threads, eagerly and in a ``tf.function``, overflow steps among them; the
model-level lockstep (both mixed policies, clips, weight decay, schedules,
EMA, accumulation, MirroredStrategy) is in test_fused_step, test_fused_clip,
test_fused_ema_accum and test_fused_distributed.  The op refuses bad input
before anything moves.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from lossscale import ops as native_ops
from helpers import bits
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


# ------------------------------------------------------- the op's pass

def op_case(shape=(3, 4), seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal(shape).astype(np.float32)
    v = rng.uniform(0.0, 4.0, shape).astype(np.float32)
    g = (rng.standard_normal(shape) * scale).astype(np.float32)
    made = {"m": tf.Variable(m, name="m"), "v": tf.Variable(v, name="v")}
    args = dict(m=[made["m"].handle], v=[made["v"].handle], grads=[tf.constant(g)],
                scale=tf.constant(scale), bias_1=tf.constant(np.float32(0.271)),
                bias_2=tf.constant(np.float32(0.00299)), one_minus_beta_1=0.1,
                one_minus_beta_2=0.001, epsilon=1e-6, unscale="divide")
    return made, args, (m, v, g)


def numpy_pass(m, v, g, args):
    """The op's arithmetic in numpy's float32 operations, one rounding each."""
    f = np.float32
    how = args["unscale"]
    x = g / f(args["scale"].numpy()) if how == "divide" else g
    m1 = m + (x - m) * f(args["one_minus_beta_1"])
    v1 = v + (x * x - v) * f(args["one_minus_beta_2"])
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
    out = library().loss_scale_lamb_moments(**args)
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
                bias_2=tf.constant(np.float32(0.001)), one_minus_beta_1=0.1,
                one_minus_beta_2=0.001, epsilon=1e-6, unscale="divide")
    with np.errstate(all="ignore"):
        want = numpy_pass(m, v, g, args)
    out = library().loss_scale_lamb_moments(**args)
    for got, expected in zip((made["m"].numpy(), made["v"].numpy(), out[0].numpy()), want):
        nan = np.isnan(expected)
        assert np.array_equal(np.isnan(got), nan)
        assert bits(got[~nan]) == bits(expected[~nan])


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
], ids=["v_shape", "dtype", "twice", "grad_shape", "bias_shape"])
def test_op_refuses_bad_input_and_changes_nothing(bad, message):
    made, args, _ = op_case()
    before = snapshot(made)
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        library().loss_scale_lamb_moments(**bad(made, args))
    assert snapshot(made) == before
