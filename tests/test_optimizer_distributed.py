"""lossscale.LossScaleOptimizer under tf.distribute.MirroredStrategy (two CPU replicas).

TensorFlow fixes its logical devices when it initialises, so the strategy runs
in a subprocess that splits the CPU in two before anything else; it reports
what it saw as JSON and the assertions are made here.  Oracles: the stock
Keras optimizer under the same strategy (same data on both replicas, so every
overflow is seen by both and the stock one, which trusts the first replica's
flag, is exact too), and, for overflow on one replica only, the requirement
itself: every replica skips, every copy of every variable stays as it was.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r'''
import json, sys
import numpy as np
import tensorflow as tf
from helpers import batch_recorder, two_cpu_replicas

strategy = two_cpu_replicas()

import keras
from tensorflow.python.util import deprecation
from lossscale.optimizer import LossScaleOptimizer
from lossscale import experimental

Stock = keras.optimizers.LossScaleOptimizer
report = {"replicas": strategy.num_replicas_in_sync}


def as_bits(x):
    a = np.ascontiguousarray(np.asarray(x))
    return a.dtype.str + str(a.shape) + a.reshape(-1).view(np.uint8).tobytes().hex()


def copies(variable):
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return [as_bits(c.numpy()) for c in getattr(variable, "values", [variable])]


def state(model, opt):
    """Every copy of every variable, model and optimizer."""
    return [copies(v) for v in list(model.variables) + list(opt.variables)]


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, 3, activation="relu", dtype="mixed_float16"),
        keras.layers.Flatten(dtype="mixed_float16"),
        keras.layers.Dense(8, activation="tanh", dtype="mixed_float16"),
        keras.layers.Dense(1, dtype="float32"),
    ])


def make(cls, **kw):
    with strategy.scope():
        model = build(0)
        opt = cls(keras.optimizers.SGD(0.01, momentum=0.5), **kw)
        opt.build(model.trainable_variables)
    return model, opt


def step_fn(model, opt):
    @tf.function
    def step(x, y, factor):
        def replica(x, y, factor):
            with tf.GradientTape() as tape:
                pred = tf.cast(model(x, training=True), tf.float32)
                loss = opt.scale_loss(tf.reduce_mean(tf.square(pred - y)) * factor)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        strategy.run(replica, args=(x, y, factor))
    return step


def per_replica(fn):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: fn(ctx.replica_id_in_sync_group))


rng = np.random.default_rng(0)
data = [(rng.standard_normal((4, 6, 6, 2)).astype(np.float32),
         rng.standard_normal((4, 1)).astype(np.float32)) for _ in range(40)]


def factor(i):
    return np.inf if i % 9 == 4 else (np.nan if i % 13 == 6 else 1.0)


# 1. Same data on both replicas: bit-identical to stock after every step.
kw = dict(initial_scale=2.0**12, dynamic_growth_steps=3)
pairs = [make(Stock, **kw), make(LossScaleOptimizer, **kw)]
steps = [step_fn(m, o) for m, o in pairs]
mismatch, scales = [], []
for i, (x, y) in enumerate(data):
    f = np.float32(factor(i))
    for step in steps:
        step(per_replica(lambda r: tf.constant(x)), per_replica(lambda r: tf.constant(y)),
             per_replica(lambda r: tf.constant(f)))
    if state(*pairs[0]) != state(*pairs[1]):
        mismatch.append(i)
    scales.append(float(pairs[1][1].dynamic_scale.numpy()))
report["custom_loop_mismatch"] = mismatch
report["custom_loop_scales"] = scales
report["copies_agree"] = all(len(set(c)) == 1 for c in state(*pairs[1]))
report["iterations"] = int(pairs[1][1].iterations.numpy())

# 2. Overflow on one replica only: every replica skips.
model, opt = pairs[1]
before = state(model, opt)
scale = float(opt.dynamic_scale.numpy())
x, y = data[0]
for bad in (1, 0):
    steps[1](per_replica(lambda r: tf.constant(x)), per_replica(lambda r: tf.constant(y)),
             per_replica(lambda r: tf.constant(np.float32(np.inf if r == bad else 1.0))))
after = state(model, opt)
n_model = len(model.variables)
report["one_replica_model_unchanged"] = after[:n_model] == before[:n_model]
report["one_replica_iterations_unchanged"] = int(opt.iterations.numpy()) == report["iterations"]
report["one_replica_scale"] = [float(c) for c in
                               [v.numpy() for v in opt.dynamic_scale.value.values]]
report["scale_before"] = scale
report["one_replica_copies_agree"] = all(len(set(c)) == 1 for c in after)

# 3. fit: each global batch of 8 is two identical halves, one per replica.
xs = np.concatenate([np.concatenate([x, x]) for x, _ in data[:20]])
ys = np.concatenate([np.concatenate([y, y]) for _, y in data[:20]])
xs[8 * 5 + 1, 0, 0, 0] = xs[8 * 5 + 5, 0, 0, 0] = np.inf
xs[8 * 13 + 2, 1, 1, 1] = xs[8 * 13 + 6, 1, 1, 1] = np.nan


fit_states = []
for cls in (Stock, LossScaleOptimizer):
    with strategy.scope():
        model = build(0)
        opt = cls(keras.optimizers.SGD(0.01), initial_scale=2.0**10, dynamic_growth_steps=2)
        model.compile(optimizer=opt, loss="mse")
    snaps = batch_recorder(keras.callbacks, state)
    model.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[snaps])
    fit_states.append(snaps.states)
report["fit_batches"] = [len(s) for s in fit_states]
report["fit_mismatch"] = [i for i, (a, b) in enumerate(zip(*fit_states)) if a != b]
report["fit_skipped"] = 20 - int(opt.iterations.numpy())

# 4. TensorFlow 2.4's custom loop on the experimental optimizer, under the strategy.
with strategy.scope():
    model = build(0)
    opt = experimental.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), experimental.DynamicLossScale(2.0**8, 2))
    opt.build(model.trainable_variables)
with deprecation.silence():
    reference = tf.compat.v1.mixed_precision.DynamicLossScale(2.0**8, 2)


@tf.function
def old_step(x, y, factor):
    def replica(x, y, factor):
        with tf.GradientTape() as tape:
            pred = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_mean(tf.square(pred - y)) * factor
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
    strategy.run(replica, args=(x, y, factor))


trajectory, expected, unchanged_on_skip = [], [], []
for i, (x, y) in enumerate(data[:16]):
    bad = {3: 1, 7: 0, 8: -1}.get(i)  # replica with the overflow, -1: both
    before = state(model, opt)[:len(model.variables)]
    old_step(per_replica(lambda r: tf.constant(x)), per_replica(lambda r: tf.constant(y)),
             per_replica(lambda r: tf.constant(
                 np.float32(np.inf if bad is not None and bad in (r, -1) else 1.0))))
    if bad is not None:
        unchanged_on_skip.append(state(model, opt)[:len(model.variables)] == before)
    reference.update([tf.constant(np.inf if bad is not None else 1.0)])
    trajectory.append([float(c.numpy()) for c in opt.loss_scale_object._current_loss_scale.values])
    expected.append(float(reference().numpy()))
report["old_loop_trajectory"] = trajectory
report["old_loop_expected"] = expected
report["old_loop_unchanged_on_skip"] = unchanged_on_skip
report["old_loop_iterations"] = int(opt.iterations.numpy())
json.dump(report, sys.stdout)
'''


# MultiWorkerMirroredStrategy must be made before TensorFlow runs anything:
# one worker on its own, fit against stock with an overflow in one batch.
MULTI_WORKER = r'''
import json, sys
import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
import keras
from lossscale.optimizer import LossScaleOptimizer
from lossscale import experimental

x = np.random.default_rng(0).standard_normal((64, 6)).astype("float32")
x[17, 0] = np.inf
y = np.ones((64, 1), "float32")
states = []
for cls in (keras.optimizers.LossScaleOptimizer, LossScaleOptimizer):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(8, activation="tanh", dtype="mixed_float16"),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=cls(keras.optimizers.SGD(0.1), initial_scale=16.0,
                                    dynamic_growth_steps=2), loss="mse")
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    states.append([np.asarray(v).tobytes().hex() for v in model.variables + model.optimizer.variables])
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), "dynamic")
    model.compile(optimizer=opt, loss="mse")
model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
json.dump({"replicas": strategy.num_replicas_in_sync, "equal": states[0] == states[1],
           "iterations": int(model.optimizer.iterations.numpy())}, sys.stdout)
'''


def run_worker(code):
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(drop=("TF_CONFIG",)),
                          capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report():
    return run_worker(WORKER)


def test_two_replicas(report):
    assert report["replicas"] == 2


def test_custom_loop_bit_identical_to_stock_on_every_copy(report):
    assert report["custom_loop_mismatch"] == []
    assert report["copies_agree"]
    scales = report["custom_loop_scales"]
    ups = sum(b > a for a, b in zip(scales, scales[1:]))
    downs = sum(b < a for a, b in zip(scales, scales[1:]))
    assert ups >= 3 and downs >= 3
    assert 0 < report["iterations"] < 40


def test_overflow_on_one_replica_skips_on_all(report):
    assert report["one_replica_model_unchanged"]
    assert report["one_replica_iterations_unchanged"]
    assert report["one_replica_scale"] == [report["scale_before"] / 4] * 2
    assert report["one_replica_copies_agree"]


def test_fit_bit_identical_to_stock(report):
    assert report["fit_batches"] == [20, 20]
    assert report["fit_mismatch"] == []
    assert report["fit_skipped"] >= 2


def test_old_loop_replicas_skip_together_and_follow_tensorflow(report):
    assert all(report["old_loop_unchanged_on_skip"]) and len(report["old_loop_unchanged_on_skip"]) == 3
    for copies, expected in zip(report["old_loop_trajectory"], report["old_loop_expected"]):
        assert copies == [expected, expected]
    # TensorFlow 2.4 counted skipped steps in `iterations`.
    assert report["old_loop_iterations"] == 16


def test_multi_worker_mirrored_strategy_one_worker():
    result = run_worker(MULTI_WORKER)
    assert result["replicas"] == 1
    assert result["equal"]
    assert result["iterations"] == 8  # TensorFlow 2.4's count: skipped steps too
