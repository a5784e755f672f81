"""Our loss scales where TensorFlow's TF1 API takes one.

In TensorFlow 2.4, ``tf.mixed_precision.experimental.DynamicLossScale`` was
``tf.compat.v1.mixed_precision.DynamicLossScale``, so code of that time passes
it to ``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer`` and
``enable_mixed_precision_graph_rewrite``.  Ours goes there too: each loop
here runs twice in TF1 graph mode (``tf.compat.v1`` Graph and Session), once
with TensorFlow's loss scale (the oracle) and once with ours, from the same
weights and batches, and compares every variable the optimizer touches, the
loss scale and its counter after every step, bit for bit.  The batches
overflow the float16 part of the model at the larger scales, and some carry
an injected inf, so the scale grows, backs off and steps are skipped.
"""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.util import deprecation

import lossscale
from lossscale import ops
from helpers import ROOT, assert_same_bits, child_env, tf_dynamic, tf_fixed

STEPS = 24
POISONED = (3, 4, 15)  # steps whose loss is multiplied by inf


def _batches():
    rng = np.random.default_rng(11)
    # |x| up to ~100: at a scale of 2**10 and more, the float16 gradient of
    # the first layer overflows.
    return [(rng.normal(size=(4, 3)).astype(np.float32) * 40,
             rng.normal(size=(4, 1)).astype(np.float32),
             np.float32(np.inf if i in POISONED else 1.0)) for i in range(STEPS)]


def _inner(kind, **kwargs):
    with deprecation.silence():
        if kind == "sgd":
            return tf.compat.v1.train.GradientDescentOptimizer(0.01, **kwargs)
        if kind == "momentum":
            return tf.compat.v1.train.MomentumOptimizer(0.01, 0.9, **kwargs)
        return tf.compat.v1.train.AdamOptimizer(0.01, **kwargs)


def _loss(x, y, poison):
    """A float16 first layer and a float32 second one; the float16 part is
    what overflows."""
    rng = np.random.default_rng(5)
    w1 = tf.compat.v1.get_variable("w1", initializer=rng.normal(size=(3, 8)).astype(np.float32))
    w2 = tf.compat.v1.get_variable("w2", initializer=rng.normal(size=(8, 1)).astype(np.float32))
    hidden = tf.tanh(tf.matmul(tf.cast(x, tf.float16), tf.cast(w1, tf.float16)))
    pred = tf.matmul(tf.cast(hidden, tf.float32), w2)
    return tf.reduce_mean(tf.square(pred - y)) * poison


def _graph_run(make_loss_scale, kind, batches=None, wrap=None):
    """Builds the TF1 loop in its own graph, runs ``STEPS`` steps; returns the
    state after every step and the graph's op types."""
    batches = batches or _batches()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 3))
        y = tf.compat.v1.placeholder(tf.float32, (4, 1))
        poison = tf.compat.v1.placeholder(tf.float32, ())
        loss = _loss(x, y, poison)
        loss_scale = make_loss_scale()
        wrap = wrap or tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer
        with deprecation.silence():
            opt = wrap(_inner(kind), loss_scale)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train = opt.minimize(loss, global_step=global_step)
        tracked = sorted(tf.compat.v1.global_variables(), key=lambda v: v.name)
        names = [v.name for v in tracked]
        scale = opt._loss_scale()  # pylint: disable=protected-access
        states = []
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for bx, by, bp in batches:
                session.run(train, {x: bx, y: by, poison: bp})
                states.append(session.run(tracked + [scale]))
        op_types = {op.type for op in graph.get_operations()}
    return names, states, op_types, opt


def _assert_same_runs(ours, reference):
    names, got, _, _ = ours
    ref_names, want, _, _ = reference
    assert names == ref_names
    for step, (g, w) in enumerate(zip(got, want)):
        for name, a, b in zip(names + ["loss scale"], g, w):
            assert_same_bits(np.asarray(a), np.asarray(b), f"step {step}, {name}")


def _uses_native_update(run):
    return "LossScaleUpdate" in run[2] and "LossScaleAllFinite" in run[2]


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("initial, period", [(2.0**12, 2), (2.0**8, 3), (2.0**15, 2000)])
def test_mixed_precision_loss_scale_optimizer_dynamic(kind, initial, period):
    ours = _graph_run(lambda: lossscale.DynamicLossScale(initial, period), kind)
    reference = _graph_run(lambda: tf_dynamic(initial, period), kind)
    _assert_same_runs(ours, reference)
    scales = [float(s[-1]) for s in reference[1]]
    assert len(set(scales)) > 1 or period == 2000, "the scale never moved"
    if ops.native_available():
        assert _uses_native_update(ours) and not _uses_native_update(reference)
    # The skipped steps moved nothing, as TensorFlow skips them.
    global_steps = [int(s[reference[0].index("global_step:0")]) for s in reference[1]]
    assert global_steps[-1] < STEPS


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_mixed_precision_loss_scale_optimizer_fixed(kind):
    # No step is skipped with a fixed scale: no inf injected, moderate scale.
    batches = [(x, y, np.float32(1.0)) for x, y, _ in _batches()]
    ours = _graph_run(lambda: lossscale.FixedLossScale(64), kind, batches)
    reference = _graph_run(lambda: tf_fixed(64), kind, batches)
    _assert_same_runs(ours, reference)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_mixed_precision_loss_scale_optimizer_from_identifiers(kind):
    # What TensorFlow builds itself from "dynamic" (its own class) against
    # ours handed over as an object.
    ours = _graph_run(lossscale.DynamicLossScale, kind)
    reference = _graph_run(lambda: "dynamic", kind)
    _assert_same_runs(ours, reference)


def test_extensions_are_followed_under_the_v1_optimizer():
    # TensorFlow's optimizer calls our update, so our extensions hold there
    # too: with hysteresis=2 the first of two non-finite steps in a row is
    # skipped without backing off.
    ls = {}

    def make():
        ls["obj"] = lossscale.DynamicLossScale(2.0**8, 3, hysteresis=2, count_skipped_steps=True)
        return ls["obj"]

    names, states, _, _ = _graph_run(make, "sgd")
    scales = [float(s[-1]) for s in states]
    # Steps 3 and 4 are poisoned in a row: one back-off, on the second.
    assert scales[2] == scales[3] and scales[4] == scales[3] / 2
    skipped = names.index("skipped_steps:0")
    assert int(states[-1][skipped]) >= len(POISONED)


def test_variables_and_tracking_are_ours():
    _, _, _, opt = _graph_run(lossscale.DynamicLossScale, "adam")
    scale = opt._loss_scale  # pylint: disable=protected-access
    assert isinstance(scale, lossscale.DynamicLossScale)
    names = sorted(v.name for v in opt.variables())
    assert "current_loss_scale:0" in names and "good_steps:0" in names


def test_our_loss_scales_are_tensorflows():
    dynamic = lossscale.DynamicLossScale(4.0, 3, 2.0)
    fixed = lossscale.FixedLossScale(8)
    assert isinstance(dynamic, tf.compat.v1.mixed_precision.DynamicLossScale)
    assert isinstance(fixed, tf.compat.v1.mixed_precision.FixedLossScale)
    assert isinstance(dynamic, tf.compat.v1.mixed_precision.LossScale)
    assert not isinstance(fixed, tf.compat.v1.mixed_precision.DynamicLossScale)
    # TensorFlow's get hands them back as they are; ours converts TensorFlow's.
    from tensorflow.python.training.experimental import loss_scale as tf_module  # pylint: disable=import-outside-toplevel
    assert tf_module.get(dynamic) is dynamic and tf_module.get(fixed) is fixed
    reference = tf_dynamic(4.0, 3)
    assert type(lossscale.get(reference)) is lossscale.DynamicLossScale


def test_checkpoints_move_between_the_two(tmp_path):
    # Object-based checkpoints of the v1 optimizer, ours written, TensorFlow's
    # read, and back; eagerly, where the v1 optimizer also runs.
    def train(loss_scale, steps):
        var = tf.Variable([1.0, -2.0])
        with deprecation.silence():
            opt = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
                _inner("adam"), loss_scale)
        for i in range(steps):
            poison = np.inf if i == 1 else 1.0
            opt.minimize(lambda: tf.reduce_sum(var * var) * poison, var_list=[var])
        return var, opt

    for write, read in [(lambda: lossscale.DynamicLossScale(64.0, 2), lambda: tf_dynamic(1.0, 2)),
                        (lambda: tf_dynamic(64.0, 2), lambda: lossscale.DynamicLossScale(1.0, 2))]:
        var, opt = train(write(), 6)
        path = tf.train.Checkpoint(var=var, opt=opt).save(str(tmp_path / "ckpt"))
        var2, opt2 = train(read(), 1)
        tf.train.Checkpoint(var=var2, opt=opt2).restore(path).assert_existing_objects_matched()
        assert_same_bits(var2.numpy(), var.numpy(), "variable")
        # pylint: disable=protected-access
        assert_same_bits(opt2._loss_scale().numpy(), opt._loss_scale().numpy(), "scale")
        ours, theirs = opt._loss_scale, opt2._loss_scale
        assert int(tf.convert_to_tensor(ours._num_good_steps)) == int(
            tf.convert_to_tensor(theirs._num_good_steps))


def test_saver_checkpoints_move_between_the_two(tmp_path):
    # TF1's name-based Saver: our variables have TensorFlow's names.
    def build(make_loss_scale):
        x = tf.compat.v1.placeholder(tf.float32, (4, 3))
        y = tf.compat.v1.placeholder(tf.float32, (4, 1))
        poison = tf.compat.v1.placeholder(tf.float32, ())
        with deprecation.silence():
            opt = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
                _inner("adam"), make_loss_scale())
        train = opt.minimize(_loss(x, y, poison))
        feeds = (x, y, poison)
        # pylint: disable=protected-access
        state = [opt._loss_scale(), opt._loss_scale._num_good_steps] + sorted(
            tf.compat.v1.trainable_variables(), key=lambda v: v.name)
        return train, feeds, state

    batches = _batches()[:6]
    for write, read in [(lossscale.DynamicLossScale, tf_dynamic),
                        (tf_dynamic, lossscale.DynamicLossScale)]:
        with tf.Graph().as_default():
            train, feeds, state = build(lambda write=write: write(2.0**10, 2))
            saver = tf.compat.v1.train.Saver()
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                for batch in batches:
                    session.run(train, dict(zip(feeds, batch)))
                saved = session.run(state)
                path = saver.save(session, str(tmp_path / "model"))
        with tf.Graph().as_default():
            _, _, state = build(lambda read=read: read(1.0, 2))
            with tf.compat.v1.Session() as session:
                tf.compat.v1.train.Saver().restore(session, path)
                for got, want in zip(session.run(state), saved):
                    assert_same_bits(np.asarray(got), np.asarray(want), "restored")
        assert float(saved[0]) != 2.0**10, "the scale never moved"


_REWRITE_CHILD = r'''
import numpy as np
import tensorflow as tf
from tensorflow.python.util import deprecation
import tf_keras
import lossscale
import test_tf1_loss_scale as cases

rewrite = tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite
undo = tf.compat.v1.mixed_precision.disable_mixed_precision_graph_rewrite

def wrap(opt, loss_scale):
    with deprecation.silence():
        wrapped = rewrite(opt, loss_scale=loss_scale)
    assert tf.config.optimizer.get_experimental_options()["auto_mixed_precision"] is True
    undo()
    return wrapped

# A tf.compat.v1 optimizer: TensorFlow wraps it in its v1 loss-scale optimizer,
# which then runs our loss scale, bit for bit as its own.
for kind in ("sgd", "adam"):
    ours = cases._graph_run(lambda: lossscale.DynamicLossScale(2.0**12, 2), kind, wrap=wrap)
    reference = cases._graph_run(lambda: cases.tf_dynamic(2.0**12, 2), kind, wrap=wrap)
    assert type(ours[3]) is tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer
    assert isinstance(ours[3]._loss_scale, lossscale.DynamicLossScale)
    cases._assert_same_runs(ours, reference)

# A tf_keras (legacy, the only kind it registers) optimizer: tf_keras' own
# wrapping reads our object's settings.
dynamic = wrap(tf_keras.optimizers.legacy.SGD(), lossscale.DynamicLossScale(64.0, 7))
assert type(dynamic).__module__.startswith("tf_keras")
assert (dynamic.dynamic, dynamic.initial_scale, dynamic.dynamic_growth_steps) == (True, 64.0, 7)
fixed = wrap(tf_keras.optimizers.legacy.SGD(), lossscale.FixedLossScale(12))
assert (fixed.dynamic, fixed.initial_scale) == (False, 12.0)
try:
    wrap(tf_keras.optimizers.legacy.SGD(), lossscale.DynamicLossScale(64.0, 7, multiplier=3))
except ValueError as exc:
    assert "DynamicLossScale.multiplier must be 2" in str(exc), exc
else:
    raise AssertionError("tf_keras took a multiplier of 3")
print("REWRITE-OK")
'''


def test_enable_mixed_precision_graph_rewrite_takes_ours():
    # A child: the rewrite sets process-wide state (the grappler option, and
    # TensorFlow's note that the rewrite was enabled).
    pytest.importorskip("tf_keras")
    result = subprocess.run([sys.executable, "-c", _REWRITE_CHILD], env=child_env(),
                            cwd=f"{ROOT}/tests", capture_output=True, text=True, timeout=600)
    assert "REWRITE-OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]


_MIRRORED_CHILD = r'''
from helpers import assert_same_bits, tf_dynamic, two_cpu_replicas

strategy = two_cpu_replicas()
import numpy as np
import tensorflow as tf
from tensorflow.python.util import deprecation
import lossscale

def run(make_loss_scale):
    with strategy.scope():
        var = tf.Variable([1.0, -2.0])
        with deprecation.silence():
            opt = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
                tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), make_loss_scale())

    @tf.function
    def step(poison):
        def replica():
            # Only the second replica's gradients overflow.
            second = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 1)
            factor = tf.where(second, poison, 1.0)
            opt.minimize(lambda: tf.reduce_sum(var * var) * factor, var_list=[var])
        strategy.run(replica)

    states = []
    for i in range(10):
        step(tf.constant(np.inf if i in (2, 5, 6) else 1.0, tf.float32))
        states.append([var.numpy(), opt._loss_scale().numpy()])
    return states

ours = run(lambda: lossscale.DynamicLossScale(16.0, 2))
reference = run(lambda: tf_dynamic(16.0, 2))
for i, (got, want) in enumerate(zip(ours, reference)):
    for a, b in zip(got, want):
        assert_same_bits(np.asarray(a), np.asarray(b), f"step {i}")
assert_same_bits(ours[2][0], ours[1][0], "the overflow on one replica skipped the step")
print("MIRRORED-OK")
'''


def test_mirrored_strategy_combines_the_replicas():
    # TensorFlow's v1 optimizer calls our update in the cross-replica context
    # of its merge call: the replicas' flags are combined, one overflowing
    # replica skips the step on both, as with TensorFlow's loss scale.
    result = subprocess.run([sys.executable, "-c", _MIRRORED_CHILD], env=child_env(),
                            cwd=f"{ROOT}/tests", capture_output=True, text=True, timeout=600)
    assert "MIRRORED-OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
