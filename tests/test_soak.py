"""Soak: thousands of training steps with non-finite gradients injected at random.

A seeded schedule injects inf, -inf and NaN into the input batch, into one
element of one gradient tensor, or into the loss, and multiplies the loss by
1e30 so that float16 overflows on the way back; runs of consecutive
overflows long enough to drive the scale to its minimum (and, under the
Keras 3 rule, which has no floor, far below 1) come in between.  Every step
runs inside a ``tf.function``.

Three paths, each in lockstep with an independent reference on an identical
copy of the model, compared bit for bit after every step:

* ``lossscale.LossScaleOptimizer`` (the Keras 3 rule) against the stock
  ``keras.optimizers.LossScaleOptimizer``: every model and optimizer variable;
* TensorFlow 2.4's custom loop on ``lossscale.experimental.LossScaleOptimizer``
  against ``tf.compat.v1.mixed_precision.DynamicLossScale`` driving a plain
  Keras optimizer on gradients unscaled with TensorFlow ops, skipped steps
  advancing ``iterations`` as TensorFlow 2.4 did;
* ``lossscale.LossScaleOptimizer(loss_scale=DynamicLossScale(...))`` with every
  extension on (floor, cap, back-off factor, hysteresis, skipped counter)
  against the float32 numpy model of the documented rule (``rule_model``)
  deciding, and TensorFlow ops applying, a plain optimizer's steps.

On every step the reference skipped, every model variable and every optimizer
variable other than the loss-scale state must be bit-for-bit what it was
before the step; the scale must stay within its bounds on every step.
"""

import math

import keras
import numpy as np
import tensorflow as tf

import rule_model
from helpers import (bits, keras3_train_step, mse_loss, scaled_gradients, tf24_reference_step,
                     tf24_train_step, tf_dynamic)
from lossscale import experimental
from lossscale.loss_scale import DynamicLossScale
from lossscale.optimizer import LossScaleOptimizer

STEPS = 3000
Stock = keras.optimizers.LossScaleOptimizer
NON_FINITE = (np.inf, -np.inf, np.nan)


class Layout:
    """All of ``variables`` as one byte string, read inside a ``tf.function``.

    Thousands of steps, each checked variable by variable: reading the
    variables one by one from Python would cost more than the steps.  A step
    function returns ``read()`` (its reads come after its updates: they
    touch the same resources), ``split`` cuts the result into the raw bytes
    of each variable.
    """

    def __init__(self, variables):
        self.variables = list(variables)
        self.dtypes = [np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype) for v in self.variables]
        sizes = [int(np.prod(v.shape)) * d.itemsize for v, d in zip(self.variables, self.dtypes)]
        self.bounds = np.cumsum([0] + sizes)

    def read(self):
        return tf.concat([tf.reshape(tf.bitcast(tf.convert_to_tensor(v), tf.uint8), [-1])
                          for v in self.variables], 0)

    def split(self, raw):
        raw = raw.numpy().tobytes()
        return [raw[a:b] for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    def read_eagerly(self):
        """What ``split(read())`` gives, read variable by variable outside any graph."""
        return [np.ascontiguousarray(np.asarray(v)).tobytes() for v in self.variables]

    def index(self, variable):
        (k,) = [k for k, v in enumerate(self.variables) if v is variable]
        return k

    def value(self, parts, variable):
        k = self.index(variable)
        return np.frombuffer(parts[k], self.dtypes[k]).reshape(self.variables[k].shape)

    def names(self, indices):
        return sorted(getattr(self.variables[k], "path", None) or self.variables[k].name
                      for k in indices)


def build_model(seed, low_precision_variables=False):
    """A small mixed_float16 model; with ``low_precision_variables`` two of
    its layers keep float16 and bfloat16 variables, so the gradient list
    mixes float32, float16 and bfloat16."""
    keras.utils.set_random_seed(seed)
    middle = [keras.layers.Dense(8, activation="tanh", dtype="mixed_float16")]
    if low_precision_variables:
        middle = [keras.layers.Dense(8, activation="tanh", dtype="float16"),
                  keras.layers.Dense(8, activation="tanh", dtype="bfloat16")]
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(12, activation="tanh", dtype="mixed_float16"),
        *middle,
        keras.layers.Dense(1, dtype="float32"),
    ])


def twin_models(**kwargs):
    a, b = build_model(0, **kwargs), build_model(1, **kwargs)
    b.set_weights(a.get_weights())
    return a, b


# ------------------------------------------------------------- the schedule

class Step:
    """What one step feeds: a batch, a loss factor and a gradient to spoil."""

    __slots__ = ("x", "y", "factor", "grad_index", "grad_position", "grad_value", "kind")

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.factor = np.float32(1.0)
        self.grad_index = np.int32(-1)  # no gradient spoiled
        self.grad_position = np.int32(0)
        self.grad_value = np.float32(0.0)
        self.kind = "finite"

    def args(self):
        return (self.x, self.y, self.factor, self.grad_index, self.grad_position, self.grad_value)


def schedule(steps, model, seed, run_lengths=(20, 60)):
    """A seeded list of ``Step``s for ``model``: mostly finite, one step in
    thirty-odd a single overflow of any kind, and now and then a run of
    ``run_lengths`` consecutive certain overflows (at least 250 steps apart,
    none in the last 300 steps, so the scale recovers in between)."""
    rng = np.random.default_rng(seed)
    grad_sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    w = rng.standard_normal((6, 1)).astype(np.float32)
    out = []
    run_left, quiet = 0, 100
    while len(out) < steps:
        x = rng.standard_normal((16, 6)).astype(np.float32)
        step = Step(x, np.tanh(x @ w))
        quiet -= 1
        if quiet <= 0 and len(out) < steps - 300 and rng.random() < 0.01:
            run_left = int(rng.integers(run_lengths[0], run_lengths[1] + 1))
            quiet = run_left + 250
        if run_left:
            run_left -= 1
            kind = ("input", "gradient", "loss")[rng.integers(3)]
        else:
            r = rng.random()
            kind = ("finite" if r >= 0.03 else "huge" if r >= 0.02 else
                    ("input", "gradient", "loss")[int(r / 0.02 * 3)])
        value = np.float32(NON_FINITE[rng.integers(3)])
        step.kind = kind
        if kind == "input":
            x[rng.integers(x.shape[0]), rng.integers(x.shape[1])] = value
        elif kind == "gradient":
            step.grad_index = np.int32(rng.integers(len(grad_sizes)))
            step.grad_position = np.int32(rng.integers(grad_sizes[step.grad_index]))
            step.grad_value = value
        elif kind == "loss":
            step.factor = value
        elif kind == "huge":
            # A finite float32 loss whose gradient overflows float16.
            step.factor = np.float32(1e30)
        out.append(step)
    return out


def certain_overflow(step):
    return step.kind in ("input", "gradient", "loss")


def spoil(grads, index, position, value):
    """``grads`` with element ``position`` of ``grads[index]`` set to ``value``
    (none when index is -1); every other bit kept."""
    out = []
    for j, g in enumerate(grads):
        flat = tf.reshape(g, [-1])
        hit = tf.logical_and(tf.equal(index, j),
                             tf.equal(tf.range(tf.size(flat)), position))
        out.append(tf.reshape(tf.where(hit, tf.cast(value, g.dtype), flat), tf.shape(g)))
    return out


def longest_run(flags):
    best = run = 0
    for f in flags:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


# ------------------------------------------------- 1. the Keras 3 rule

def keras_step_fn(model, optimizer, layout):
    """A Keras 3 custom step; returns the state after it (``layout.read``)."""

    train = keras3_train_step(model, optimizer)

    @tf.function
    def step(x, y, factor, index, position, value):
        train(x, y, factor, edit=lambda grads: spoil(grads, index, position, value))
        return layout.read()

    return lambda step_: layout.split(step(*step_.args()))


def test_keras_rule_soak_matches_stock_and_skips_change_nothing():
    model_ref, model = twin_models(low_precision_variables=True)
    stock = Stock(keras.optimizers.SGD(0.01, momentum=0.5), initial_scale=2.0**15,
                  dynamic_growth_steps=4)
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.01, momentum=0.5), initial_scale=2.0**15,
                              dynamic_growth_steps=4)
    stock.build(model_ref.trainable_variables)
    ours.build(model.trainable_variables)
    layout = Layout(list(model.variables) + list(ours.variables))
    stock_layout = Layout(list(model_ref.variables) + list(stock.variables))
    ref_step = keras_step_fn(model_ref, stock, stock_layout)
    our_step = keras_step_fn(model, ours, layout)
    loss_scale_state = {layout.index(ours.dynamic_scale), layout.index(ours.step_counter)}

    # Runs of at most 45 overflows, apart: the Keras 3 rule has no floor, and a
    # scale halved below float32's smallest normal flushes to zero, from where
    # stock (and so ours) unscales the next finite step's gradients to 0/0.
    steps = schedule(STEPS, model, seed=20, run_lengths=(20, 45))
    skipped, scales = [], []
    before = layout.split(layout.read())
    iterations = 0
    for i, step in enumerate(steps):
        reference = ref_step(step)
        after = our_step(step)
        assert after == reference, f"step {i} ({step.kind}): differs from stock Keras"
        stock_iterations = int(stock_layout.value(reference, stock.iterations))
        skip = stock_iterations == iterations
        iterations = stock_iterations
        moved = {k for k, (a, b) in enumerate(zip(before, after)) if a != b}
        if skip:
            assert moved <= loss_scale_state, \
                f"step {i} ({step.kind}) was skipped but changed {layout.names(moved)}"
        else:
            assert len(moved) > 3, f"step {i} was applied but changed nothing"
        if certain_overflow(step):
            assert skip, f"step {i}: a non-finite {step.kind} was applied"
        before = after
        scale = float(layout.value(after, ours.dynamic_scale))
        # Keras 3 has no floor (nor has ours, as stock): a positive, finite
        # power of two is the bound.
        assert 0.0 < scale < math.inf and math.frexp(scale)[0] == 0.5, f"step {i}: {scale}"
        skipped.append(skip)
        scales.append(scale)

    # float16 and bfloat16 gradients also overflow on their own when the
    # scale has grown too far.
    assert sum(skipped) < STEPS // 3 and longest_run(skipped) >= 30
    # The runs drove the scale far below 1, and it grew back.
    assert min(scales) <= 2.0**-10 and scales[-1] >= 2.0**8
    assert sum(b > a for a, b in zip(scales, scales[1:])) >= 100
    assert int(ours.iterations.numpy()) == STEPS - sum(skipped)
    # The in-graph reads saw the state after the step.
    assert after == layout.read_eagerly()


# ------------------------------------- 2. TensorFlow 2.4's custom loop

def test_tensorflow_2_4_loop_soak_matches_tensorflow():
    model_ref, model = twin_models()
    opt = experimental.LossScaleOptimizer(keras.optimizers.Adam(1e-3),
                                          experimental.DynamicLossScale(2.0**15, 8))
    opt.build(model.trainable_variables)
    reference_scale = tf_dynamic(initial_loss_scale=2.0**15, increment_period=8)
    reference = keras.optimizers.Adam(1e-3)
    reference.build(model_ref.trainable_variables)
    ls = opt.loss_scale_object
    # pylint: disable=protected-access
    # The model, the wrapper's own (unused) iteration and learning rate, the
    # loss-scale state, the inner optimizer.
    layout = Layout(list(model.variables) + list(opt.variables))
    compared = [layout.index(v) for v in list(model.variables) + list(
        opt.inner_optimizer.variables) + [ls._current_loss_scale, ls._num_good_steps]]
    ref_layout = Layout(list(model_ref.variables) + list(reference.variables)
                        + [reference_scale._current_loss_scale, reference_scale._num_good_steps])
    iterations = layout.index(opt.inner_optimizer.iterations)
    loss_scale_state = {iterations, layout.index(ls._current_loss_scale),
                        layout.index(ls._num_good_steps)}

    train = tf24_train_step(model, opt)

    @tf.function
    def our_step(x, y, factor, index, position, value):
        train(x, y, factor, edit=lambda grads: spoil(grads, index, position, value))
        return layout.read()

    reference_step = tf24_reference_step(model_ref, reference, reference_scale,
                                         count_skipped=True)

    @tf.function
    def ref_step(x, y, factor, index, position, value):
        should_apply = reference_step(x, y, factor,
                                      edit=lambda grads: spoil(grads, index, position, value))
        return should_apply, ref_layout.read()

    steps = schedule(STEPS, model, seed=24)
    skipped, scales = [], []
    before = layout.split(layout.read())
    for i, step in enumerate(steps):
        should_apply, expected = ref_step(*step.args())
        skip = not bool(should_apply)
        after = layout.split(our_step(*step.args()))
        assert [after[k] for k in compared] == ref_layout.split(expected), \
            f"step {i} ({step.kind}): differs from TensorFlow"
        moved = {k for k, (a, b) in enumerate(zip(before, after)) if a != b}
        if skip:
            assert iterations in moved and moved <= loss_scale_state, \
                f"step {i} ({step.kind}) was skipped but changed {layout.names(moved)}"
        if certain_overflow(step):
            assert skip, f"step {i}: a non-finite {step.kind} was applied"
        before = after
        scale = float(layout.value(after, ls._current_loss_scale))
        assert 1.0 <= scale < math.inf, f"step {i}: {scale}"
        skipped.append(skip)
        scales.append(scale)

    assert sum(skipped) < STEPS // 4 and longest_run(skipped) >= 40
    # The floor was reached and held through the rest of a run; the scale
    # grew back.
    assert longest_run(s == 1.0 for s in scales) >= 10 and scales[-1] >= 2.0**8
    assert int(opt.iterations.numpy()) == STEPS
    assert after == layout.read_eagerly()


# ------------------------------ 3. DynamicLossScale with its extensions

EXTENSIONS = dict(min_loss_scale=4.0, max_loss_scale=2.0**13, backoff_factor=0.25, hysteresis=2)


def test_extensions_soak_follow_the_documented_rule():
    model_ref, model = twin_models()
    ls = DynamicLossScale(2.0**12, 6, 2.0, count_skipped_steps=True, **EXTENSIONS)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.02, momentum=0.9), loss_scale=ls)
    opt.build(model.trainable_variables)
    reference = keras.optimizers.SGD(0.02, momentum=0.9)
    reference.build(model_ref.trainable_variables)
    # The model, the wrapper's own (unused) iteration and learning rate, the
    # loss-scale state, the inner optimizer.
    layout = Layout(list(model.variables) + list(opt.variables))
    ref_layout = Layout(list(model_ref.variables) + list(reference.variables))
    # pylint: disable=protected-access
    counters = (ls._num_good_steps, ls._overflow_run, ls.skipped_steps)
    loss_scale_state = {layout.index(v) for v in (ls._current_loss_scale,) + counters}
    trained = [layout.index(v) for v in list(model.variables)
               + list(opt.inner_optimizer.variables)]
    our_step = keras_step_fn(model, opt, layout)

    @tf.function
    def ref_step(x, y, factor, index, position, value, scale):
        """Scale, unscale (times 1/scale, dtype kept), check, apply when finite."""
        _, grads = scaled_gradients(model_ref, mse_loss, lambda loss: loss * scale, x, y, factor,
                                    edit=lambda grads: spoil(grads, index, position, value))
        inv = 1.0 / scale
        grads = [g * tf.cast(inv, g.dtype) for g in grads]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

        def apply():
            reference.apply(grads, model_ref.trainable_variables)

        tf.cond(finite, apply, lambda: None)
        return finite, ref_layout.read()

    rule = dict(period=6, multiplier=2.0, **EXTENSIONS)
    state = (np.float32(2.0**12), 0, 0, 0)
    steps = schedule(STEPS, model, seed=28)
    skipped, scales = [], []
    before = layout.split(layout.read())
    for i, step in enumerate(steps):
        finite, expected = ref_step(*step.args(), state[0])
        finite = bool(finite)
        state = rule_model.tf24_step(state, finite, **rule)
        after = our_step(step)
        assert [after[k] for k in trained] == ref_layout.split(expected), \
            f"step {i} ({step.kind}): differs from the reference"
        assert bits(layout.value(after, ls._current_loss_scale)) == bits(np.float32(state[0])), \
            f"step {i}: scale"
        assert [int(layout.value(after, v)) for v in counters] == list(state[1:]), \
            f"step {i}: counters"
        moved = {k for k, (a, b) in enumerate(zip(before, after)) if a != b}
        if not finite:
            assert moved <= loss_scale_state, \
                f"step {i} ({step.kind}) was skipped but changed {layout.names(moved)}"
        if certain_overflow(step):
            assert not finite, f"step {i}: a non-finite {step.kind} was applied"
        before = after
        scale = float(state[0])
        assert EXTENSIONS["min_loss_scale"] <= scale <= EXTENSIONS["max_loss_scale"], \
            f"step {i}: {scale}"
        skipped.append(not finite)
        scales.append(scale)

    assert sum(skipped) < STEPS // 4 and longest_run(skipped) >= 40
    assert longest_run(s == EXTENSIONS["min_loss_scale"] for s in scales) >= 10
    assert longest_run(s == EXTENSIONS["max_loss_scale"] for s in scales) >= 10
    assert int(opt.iterations.numpy()) == STEPS - sum(skipped)
    assert after == layout.read_eagerly()
