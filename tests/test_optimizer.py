"""lossscale.LossScaleOptimizer against the stock keras.optimizers.LossScaleOptimizer.

The oracle is stock Keras itself: two copies of the same mixed_float16 model,
one trained with the stock optimizer and one with ours, from identical
weights on identical batches, with overflow forced on chosen steps.  After
every step every model variable and every optimizer variable (the scale, the
counter, ``iterations``, the inner optimizer's slots) must be bit-identical.
The ``loss_scale=`` mode is checked against TensorFlow's own
``tf.compat.v1.mixed_precision.DynamicLossScale`` driving a plain optimizer
on gradients unscaled with TensorFlow ops, and against a float32 numpy model
of the extensions' rule.
"""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from lossscale import ops
from lossscale.loss_scale import DynamicLossScale, FixedLossScale
from lossscale.optimizer import LossScaleOptimizer
from helpers import batch_recorder, bits, keras3_train_step, mixed_mlp, tf24_reference_step, tf_dynamic

Stock = keras.optimizers.LossScaleOptimizer
INF = float("inf")
NAN = float("nan")


# ---------------------------------------------------------------- helpers

def snapshot(model, optimizer):
    return [bits(v) for v in list(model.variables) + list(optimizer.variables)]


def assert_same_state(model_a, opt_a, model_b, opt_b, where=""):
    a, b = snapshot(model_a, opt_a), snapshot(model_b, opt_b)
    assert len(a) == len(b), where
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == y, f"{where}: variable {i} differs"


def cnn(seed, dtype="mixed_float16"):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(4, 3, activation="relu", dtype=dtype),
        keras.layers.Conv2D(4, 3, dtype=dtype),
        keras.layers.Flatten(dtype=dtype),
        keras.layers.Dense(16, activation="tanh", dtype=dtype),
        keras.layers.Dense(1, dtype="float32" if dtype == "mixed_float16" else dtype),
    ])


def twin_models(build, seed=0):
    a = build(seed)
    b = build(seed + 1)
    b.set_weights(a.get_weights())
    return a, b


def batches(steps, seed=0, batch=8, shape=(8, 8, 3)):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((batch,) + shape).astype(np.float32)
        y = rng.standard_normal((batch, 1)).astype(np.float32)
        yield x, y


def train_step_fn(model, optimizer):
    """A custom step: scale_loss, GradientTape, apply on the scaled gradients."""
    return tf.function(keras3_train_step(model, optimizer))


def overflow_factor(i):
    """What the loss is multiplied by on step i: mostly 1, sometimes inf, NaN or huge."""
    if i % 23 == 5:
        return INF
    if i % 31 == 7:
        return NAN
    if i % 17 == 11:
        return 1e30  # finite loss, gradients overflow float16 on the way back
    return 1.0


def run_twins(build, make_inner, steps, *, stock_kwargs, ours_kwargs=None, factor=overflow_factor,
              data_seed=0, check_every_step=True):
    model_a, model_b = twin_models(build)
    stock = Stock(make_inner(), **stock_kwargs)
    ours = LossScaleOptimizer(make_inner(), **(ours_kwargs or stock_kwargs))
    step_a, step_b = train_step_fn(model_a, stock), train_step_fn(model_b, ours)
    scales = []
    for i, (x, y) in enumerate(batches(steps, data_seed)):
        f = np.float32(factor(i))
        step_a(x, y, f)
        step_b(x, y, f)
        scales.append(float(stock.dynamic_scale.numpy()))
        if check_every_step or i == steps - 1:
            assert_same_state(model_a, stock, model_b, ours, f"step {i}")
    return model_a, stock, model_b, ours, scales


def count_moves(scales):
    ups = sum(b > a for a, b in zip(scales, scales[1:]))
    downs = sum(b < a for a, b in zip(scales, scales[1:]))
    return ups, downs


# ------------------------------------------------- drop-in, step by step

@pytest.mark.parametrize("make_inner", [
    lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    lambda: keras.optimizers.Adam(1e-3),
], ids=["sgd-momentum", "adam"])
def test_custom_loop_bit_identical_to_stock_every_step(make_inner):
    _, stock, _, ours, scales = run_twins(
        cnn, make_inner, 320, stock_kwargs=dict(initial_scale=2.0**12, dynamic_growth_steps=4))
    ups, downs = count_moves(scales)
    # Growth and back-off both happened many times (natural float16
    # overflows at high scales as well as the forced ones).
    assert ups >= 20 and downs >= 20, (ups, downs)
    assert 0 < int(ours.iterations.numpy()) < 320
    assert int(ours.iterations.numpy()) == int(stock.iterations.numpy())


def test_variables_line_up_with_stock():
    model = cnn(0)
    stock = Stock(keras.optimizers.Adam(), initial_scale=128.0, dynamic_growth_steps=10)
    ours = LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=128.0,
                              dynamic_growth_steps=10)
    stock.build(model.trainable_variables)
    ours.build(model.trainable_variables)

    def describe(opt):
        return [(v.name, v.dtype, tuple(v.shape)) for v in opt.variables]

    assert describe(ours) == describe(stock)
    assert [v.name for v in ours.variables][2:4] == ["step_counter", "dynamic_scale"]
    assert ours.dynamic_scale.dtype == "float32" and ours.step_counter.dtype == "int64"
    assert isinstance(ours, Stock)


def test_train_on_batch_bit_identical_to_stock():
    """Keras's own train step (compile + train_on_batch), inf in some batches."""
    model_a, model_b = twin_models(cnn)
    stock = Stock(keras.optimizers.SGD(0.02), initial_scale=2.0**10, dynamic_growth_steps=3)
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.02), initial_scale=2.0**10,
                              dynamic_growth_steps=3)
    model_a.compile(optimizer=stock, loss="mse")
    model_b.compile(optimizer=ours, loss="mse")
    assert model_b.optimizer is ours  # not wrapped a second time
    for i, (x, y) in enumerate(batches(60, seed=3)):
        if i % 9 == 4:
            x[0, 0, 0, 0] = np.inf
        model_a.train_on_batch(x, y)
        model_b.train_on_batch(x, y)
        assert_same_state(model_a, stock, model_b, ours, f"batch {i}")
    assert int(ours.iterations.numpy()) < 60


def test_fit_jit_compile_bit_identical_to_stock():
    """fit with jit_compile=True: XLA compiles the step, the ops take their TF path."""
    x, y = zip(*batches(40, seed=5))
    x, y = np.concatenate(x), np.concatenate(y)
    x[8 * 7 + 1, 2, 2, 0] = np.inf      # batch 7
    x[8 * 21, 0, 1, 2] = np.nan         # batch 21
    y[8 * 30] = 1e30                    # batch 30: the loss overflows float16 on the way back
    histories = []
    for cls in (Stock, LossScaleOptimizer):
        model = cnn(0)
        opt = cls(keras.optimizers.SGD(0.01, momentum=0.5), initial_scale=2.0**13,
                  dynamic_growth_steps=2)
        model.compile(optimizer=opt, loss="mse", jit_compile=True)
        snaps = batch_recorder(keras.callbacks, snapshot)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[snaps])
        histories.append(snaps.states)
    stock_states, our_states = histories
    assert len(stock_states) == len(our_states) == 80
    for i, (a, b) in enumerate(zip(stock_states, our_states)):
        assert a == b, f"batch {i}"


def test_skipped_step_changes_nothing():
    """On a non-finite step no model variable and no inner slot moves by a bit."""
    model = cnn(0)
    opt = LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**8,
                             dynamic_growth_steps=1000)
    step = train_step_fn(model, opt)
    data = list(batches(6, seed=7))
    for x, y in data[:5]:
        step(x, y, np.float32(1.0))
    model_before = [bits(v) for v in model.variables]
    inner_before = [bits(v) for v in opt.inner_optimizer.variables]
    iterations = int(opt.iterations.numpy())
    scale = float(opt.dynamic_scale.numpy())
    assert any(np.any(np.asarray(v) != 0) for v in opt.inner_optimizer.variables[2:])
    for factor in (INF, NAN, 1e30):
        step(*data[5], np.float32(factor))
        assert [bits(v) for v in model.variables] == model_before
        assert [bits(v) for v in opt.inner_optimizer.variables] == inner_before
        assert int(opt.iterations.numpy()) == iterations
        assert int(opt.step_counter.numpy()) == 0
        scale /= 2
        assert float(opt.dynamic_scale.numpy()) == scale


# ------------------------------------------------------ exactness edges

def test_non_power_of_two_scale_divides_as_stock():
    """initial_scale=1000: g / s and g * (1/s) differ, ours must give the division."""
    g = tf.constant(np.random.default_rng(0).standard_normal(10000).astype(np.float32))
    s = tf.constant(1000.0)
    assert not np.array_equal((g / s).numpy(), (g * (1.0 / s)).numpy())  # the test can see it
    _, stock, _, ours, scales = run_twins(
        cnn, lambda: keras.optimizers.SGD(0.01), 60,
        stock_kwargs=dict(initial_scale=1000.0, dynamic_growth_steps=2))
    assert all(not float(s).is_integer() or math.log2(s) % 1 for s in scales)


def test_scale_beyond_normal_reciprocal_divides_as_stock():
    """At 2**127, 1/scale flushes to zero in TensorFlow; the stock division does not."""
    assert float((1.0 / tf.constant(2.0**127)).numpy()) == 0.0
    tiny = lambda i: 1e-30  # keeps the scaled gradients finite at huge scales
    _, stock, _, ours, scales = run_twins(
        lambda seed: cnn(seed, dtype="float32"), lambda: keras.optimizers.SGD(1e27), 6,
        factor=tiny,
        stock_kwargs=dict(initial_scale=2.0**124, dynamic_growth_steps=1))
    assert max(scales) >= 2.0**127


def test_scale_flushed_to_zero_as_stock():
    """Backing off below 2**-126 flushes the scale to zero in TensorFlow; ours too."""
    assert float((tf.constant(2.0**-126) * 0.5).numpy()) == 0.0
    _, stock, _, ours, scales = run_twins(
        cnn, lambda: keras.optimizers.SGD(0.01), 6, factor=lambda i: INF if i < 4 else 1.0,
        stock_kwargs=dict(initial_scale=2.0**-124, dynamic_growth_steps=5))
    assert scales[2] == 0.0


def test_finite_check_on_scaled_gradients_as_stock():
    """Stock checks the scaled gradients: at a scale below 1 the unscaled ones can
    overflow while the scaled ones are finite, and the step is then applied."""
    model_a, model_b = twin_models(lambda seed: cnn(seed, dtype="float32"))
    stock = Stock(keras.optimizers.SGD(1.0), initial_scale=2.0**-120)
    ours = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0**-120)
    x, y = next(batches(1, seed=6))
    x, factor = x * 100, np.float32(1e38)  # loss * factor finite, some gradients not
    for model, opt in ((model_a, stock), (model_b, ours)):
        train_step_fn(model, opt)(x, y, factor)
    assert_same_state(model_a, stock, model_b, ours)
    assert int(ours.iterations.numpy()) == 1
    assert not all(np.all(np.isfinite(v.numpy())) for v in model_b.trainable_variables)


def test_float16_variables_promoted_as_stock():
    """float16 gradients: stock divides in float32 (result_type); so do we."""
    build = lambda seed: cnn(seed, dtype="float16")
    model_a, stock, model_b, ours, _ = run_twins(
        build, lambda: keras.optimizers.SGD(0.01), 40,
        stock_kwargs=dict(initial_scale=2.0**4, dynamic_growth_steps=3))
    assert model_b.trainable_variables[0].dtype == "float16"


def test_overwrite_with_gradient_variables_as_stock():
    """Variables that take their gradient as value: checked, never unscaled."""
    states = []
    for cls in (Stock, LossScaleOptimizer):
        w = keras.Variable(np.ones((3, 2), np.float32), name="w")
        m = keras.Variable(np.zeros((4,), np.float32), name="m")
        m.overwrite_with_gradient = True
        opt = cls(keras.optimizers.SGD(0.1), initial_scale=8.0, dynamic_growth_steps=2)
        rng = np.random.default_rng(0)
        for i in range(8):
            gw = rng.standard_normal((3, 2)).astype(np.float32) * 8
            gm = rng.standard_normal(4).astype(np.float32)
            if i == 5:
                gm[1] = np.inf  # only the overwritten variable's gradient overflows
            opt.apply([tf.constant(gw), tf.constant(gm)], [w, m])
            states.append([bits(v) for v in [w, m] + opt.variables])
    assert states[:8] == states[8:]
    assert int(opt.iterations.numpy()) == 7


def test_growth_steps_zero_falls_back_to_stock_rule():
    run_twins(cnn, lambda: keras.optimizers.SGD(0.01), 12,
              stock_kwargs=dict(initial_scale=64.0, dynamic_growth_steps=0))


# ------------------------------------------------------------- sparse

class RecordingSGD(keras.optimizers.SGD):
    """SGD that records the type of every gradient it is handed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def update_step(self, gradient, variable, learning_rate):
        self.seen.append(type(gradient).__name__)
        return super().update_step(gradient, variable, learning_rate)


def embedding_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(40, 8, dtype="mixed_float16"),
        keras.layers.Flatten(dtype="mixed_float16"),
        keras.layers.Dense(1, dtype="float32"),
    ])


def test_embedding_gradients_stay_sparse_and_match_stock():
    model_a, model_b = twin_models(embedding_model)
    stock = Stock(RecordingSGD(0.1, momentum=0.5), initial_scale=2.0**8, dynamic_growth_steps=3)
    ours = LossScaleOptimizer(RecordingSGD(0.1, momentum=0.5), initial_scale=2.0**8,
                              dynamic_growth_steps=3)
    step_a, step_b = train_step_fn(model_a, stock), train_step_fn(model_b, ours)
    rng = np.random.default_rng(11)
    for i in range(60):
        x = rng.integers(0, 40, (6, 5)).astype(np.int32)  # repeated ids: duplicate indices
        y = rng.standard_normal((6, 1)).astype(np.float32)
        f = np.float32(overflow_factor(i))
        step_a(x, y, f)
        step_b(x, y, f)
        assert_same_state(model_a, stock, model_b, ours, f"step {i}")
    assert ours.inner_optimizer.seen[0] == "IndexedSlices"
    assert "IndexedSlices" not in ours.inner_optimizer.seen[1:3]
    assert stock.inner_optimizer.seen[:3] == ours.inner_optimizer.seen[:3]

    # Eagerly, too: what reaches the inner optimizer is still IndexedSlices.
    ours.inner_optimizer.seen.clear()
    with tf.GradientTape() as tape:
        loss = ours.scale_loss(tf.reduce_mean(model_b(x)))
    grads = tape.gradient(loss, model_b.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)
    ours.apply(grads, model_b.trainable_variables)
    assert ours.inner_optimizer.seen[0] == "IndexedSlices"


@pytest.mark.parametrize("fused", [True, False])
def test_the_step_is_few_native_ops(fused):
    """The hot path.  Fused (stock SGD): the finite check, one update op for
    the scale and ONE op that unscales and updates every variable.  Not
    fused: one unscale-and-check op and one update op, then the inner step."""
    if not ops.native_available():
        pytest.skip(f"native ops unavailable: {ops.native_available().reason}")
    model = cnn(0)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), fused=fused)
    opt.build(model.trainable_variables)

    @tf.function
    def apply(grads):
        opt.apply(grads, model.trainable_variables)

    grads = [tf.ones_like(v) for v in model.trainable_variables]
    graph_def = apply.get_concrete_function(grads).graph.as_graph_def()
    names = [n.op for n in graph_def.node]
    for fn in graph_def.library.function:  # the cond branches
        names.extend(n.op for n in fn.node_def)
    assert names.count("LossScaleUpdate") == 1
    assert "IsFinite" not in names
    if fused:
        assert opt.step_path == "fused (SGD)"
        assert names.count("LossScaleApplyOptimizer") == 1
        assert names.count("LossScaleUnscaleAndCheck") == 0
        assert 1 <= names.count("LossScaleAllFinite") <= len(grads)
        # iterations, and no per-variable update
        assert names.count("AssignAddVariableOp") + names.count("AssignVariableOp") == 1
    else:
        assert opt.step_path == "stock: fused=False"
        assert names.count("LossScaleUnscaleAndCheck") == 1


# -------------------------------------------------------- config, saving

def test_config_matches_stock_and_round_trips():
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.5, name="sgd"), initial_scale=64.0,
                              dynamic_growth_steps=7, name="lso")
    stock = Stock(keras.optimizers.SGD(0.5, name="sgd"), initial_scale=64.0,
                  dynamic_growth_steps=7, name="lso")
    assert ours.get_config() == stock.get_config()
    again = LossScaleOptimizer.from_config(ours.get_config())
    assert type(again) is LossScaleOptimizer
    assert again.get_config() == ours.get_config()
    generic = keras.optimizers.deserialize(keras.optimizers.serialize(ours))
    assert type(generic) is LossScaleOptimizer and generic.get_config() == ours.get_config()
    with pytest.raises(ValueError, match="dynamic=False"):
        LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False)
    with pytest.raises(ValueError, match="clipnorm"):
        LossScaleOptimizer(keras.optimizers.SGD(), clipnorm=1.0)


def test_checkpoint_from_stock_restores_into_ours(tmp_path):
    model_a, model_b = twin_models(cnn)
    stock = Stock(keras.optimizers.Adam(), initial_scale=2.0**10, dynamic_growth_steps=3)
    step = train_step_fn(model_a, stock)
    for i, (x, y) in enumerate(batches(12, seed=1)):
        step(x, y, np.float32(overflow_factor(i + 5)))
    path = tf.train.Checkpoint(optimizer=stock, model=model_a).save(str(tmp_path / "ckpt"))
    ours = LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=2.0**10,
                              dynamic_growth_steps=3)
    ours.build(model_b.trainable_variables)
    tf.train.Checkpoint(optimizer=ours, model=model_b).restore(path).assert_consumed()
    assert_same_state(model_a, stock, model_b, ours)


def test_keras_file_round_trip(tmp_path):
    model = cnn(0)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), initial_scale=2.0**9,
                             dynamic_growth_steps=2)
    model.compile(optimizer=opt, loss="mse")
    x, y = zip(*batches(5, seed=2))
    model.fit(np.concatenate(x), np.concatenate(y), batch_size=8, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is LossScaleOptimizer
    assert_same_state(model, opt, loaded, loaded.optimizer)


# ------------------------------------------------- loss_scale= objects

def dense_model(seed):
    return mixed_mlp(seed, hidden=8)


def test_dynamic_loss_scale_object_follows_tensorflow_reference():
    model_ref, model_ours = twin_models(dense_model)
    reference = tf_dynamic(initial_loss_scale=2.0**10, increment_period=3, multiplier=2.0)
    inner_ref = keras.optimizers.SGD(0.05)
    inner_ref.build(model_ref.trainable_variables)
    ref_step = tf.function(tf24_reference_step(model_ref, inner_ref, reference))
    ls = DynamicLossScale(2.0**10, 3, 2.0)
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.05), loss_scale=ls)
    our_step = train_step_fn(model_ours, ours)
    rng = np.random.default_rng(4)
    skipped = 0
    for i in range(150):
        x = rng.standard_normal((8, 6)).astype(np.float32)
        y = rng.standard_normal((8, 1)).astype(np.float32)
        f = np.float32(overflow_factor(i))
        ref_step(x, y, f)
        our_step(x, y, f)
        skipped += not math.isfinite(f)
        assert bits(reference()) == bits(ls())
        assert int(reference._num_good_steps.numpy()) == int(ls._num_good_steps.numpy())
        for a, b in zip(model_ref.variables, model_ours.variables):
            assert bits(a) == bits(b), f"step {i}"
    # Keras 3 semantics for iterations: a skipped step does not count.
    assert int(ours.iterations.numpy()) == int(inner_ref.iterations.numpy()) <= 150 - skipped
    # The object's variables are the optimizer's loss-scale state.
    state = [id(v) for v in ours.variables]
    assert id(ls._current_loss_scale) in state and id(ls._num_good_steps) in state
    assert bits(ours.loss_scale) == bits(ls())


def test_tensorflow_dynamic_loss_scale_object_accepted():
    reference = tf_dynamic(initial_loss_scale=64.0, increment_period=2)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=reference)
    model = dense_model(0)
    step = train_step_fn(model, opt)
    for i in range(5):
        step(np.ones((2, 6), np.float32), np.ones((2, 1), np.float32),
             np.float32(INF if i == 3 else 1.0))
    # Shared state: TensorFlow's object saw every step.
    assert float(reference().numpy()) == 64.0
    assert int(reference._num_good_steps.numpy()) == 1


def extension_rule(scale, good, run, finite, *, period, multiplier, min_scale, max_scale,
                   backoff, hysteresis):
    """The documented float32 rule of DynamicLossScale's extensions."""
    f32 = np.float32
    if finite:
        run = 0
        if good + 1 >= period:
            grown = f32(scale * f32(multiplier))
            grown = min(grown, f32(max_scale))
            if np.isfinite(grown):
                scale = grown
            good = 0
        else:
            good += 1
        return scale, good, run
    good = 0
    run += 1
    if run >= hysteresis:
        run = 0
        lowered = f32(scale * f32(backoff)) if backoff else f32(scale / f32(multiplier))
        scale = max(lowered, f32(min_scale))
    return scale, good, run


def test_dynamic_loss_scale_extensions_followed():
    kw = dict(period=3, multiplier=2.0, min_scale=4.0, max_scale=2.0**9, backoff=0.25,
              hysteresis=2)
    ls = DynamicLossScale(2.0**7, 3, 2.0, min_loss_scale=4.0, max_loss_scale=2.0**9,
                          backoff_factor=0.25, hysteresis=2, count_skipped_steps=True)
    model_ref, model_ours = twin_models(dense_model)
    inner_ref = keras.optimizers.SGD(0.05)
    inner_ref.build(model_ref.trainable_variables)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.05), loss_scale=ls)
    step = train_step_fn(model_ours, opt)

    @tf.function
    def ref_grads(x, y, scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model_ref(x), tf.float32) - y)) * scale
        grads = tape.gradient(loss, model_ref.trainable_variables)
        return [g * tf.cast(1.0 / scale, g.dtype) for g in grads]

    scale, good, run, skipped = np.float32(2.0**7), 0, 0, 0
    trajectory = []
    pattern = [1] * 9 + [0] * 9 + [1, 0, 1, 0, 0, 1, 1, 1, 1]  # up to the cap, down to the floor
    for i in range(72):
        finite = pattern[i % len(pattern)]
        x = np.full((4, 6), 0.1 * (i % 5 + 1), np.float32)
        y = np.zeros((4, 1), np.float32)
        f = np.float32(1.0 if finite else INF)
        grads = ref_grads(x, y, tf.constant(scale) * f)
        if finite:
            inner_ref.apply(grads, model_ref.trainable_variables)
        else:
            skipped += 1
        scale, good, run = extension_rule(scale, good, run, finite, **kw)
        trajectory.append(float(scale))
        step(x, y, f)
        assert bits(ls()) == bits(scale), f"step {i}"
        assert int(ls._num_good_steps.numpy()) == good
        assert int(ls._overflow_run.numpy()) == run
        assert int(opt.skipped_steps.numpy()) == skipped
        for a, b in zip(model_ref.variables, model_ours.variables):
            assert bits(a) == bits(b), f"step {i}"
    # The run reached both the floor and the cap.
    assert min(trajectory) == 4.0 and max(trajectory) == 2.0**9


def test_fixed_loss_scale_always_applies():
    """A FixedLossScale never skips (TensorFlow 2.4's rule) and unscales by 1/scale.

    Eagerly: in a graph, Grappler may re-associate the multiplications by a
    constant 1/1000 with the optimizer's, which no other graph has to copy.
    """
    model_ref, model_ours = twin_models(dense_model)
    inner_ref = keras.optimizers.SGD(0.05)
    inner_ref.build(model_ref.trainable_variables)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.05), loss_scale=FixedLossScale(1000))
    assert opt.initial_scale == 1000.0 and opt.dynamic_growth_steps is None
    step = train_step_fn(model_ours, opt).python_function

    def ref_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model_ref(x), tf.float32) - y)) * 1000.0
        grads = tape.gradient(loss, model_ref.trainable_variables)
        inv = 1.0 / tf.constant(1000.0)
        inner_ref.apply([g * tf.cast(inv, g.dtype) for g in grads], model_ref.trainable_variables)

    for i, (x, y) in enumerate(batches(20, seed=9, batch=4, shape=(6,))):
        ref_step(x, y)
        step(x, y, np.float32(1.0))
        for a, b in zip(model_ref.variables, model_ours.variables):
            assert bits(a) == bits(b), f"step {i}"
    step(x, y, np.float32(INF))
    assert int(opt.iterations.numpy()) == 21
    assert not np.all(np.isfinite(model_ours.trainable_variables[0].numpy()))


def test_loss_scale_object_config_and_saving(tmp_path):
    ls = DynamicLossScale(256.0, 5, 2.0, hysteresis=3)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=ls, name="with_object")
    config = opt.get_config()
    assert config["loss_scale"] == lossscale.serialize(ls)
    assert "initial_scale" not in config
    again = LossScaleOptimizer.from_config(config)
    assert again.loss_scale_object.get_config() == ls.get_config()
    assert again.loss_scale_object is not ls

    model = dense_model(0)
    model.compile(optimizer=opt, loss="mse")
    x = np.ones((8, 6), np.float32)
    model.fit(x, np.ones((8, 1), np.float32), batch_size=4, epochs=3, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is LossScaleOptimizer
    assert int(loaded.optimizer.loss_scale_object._num_good_steps.numpy()) == 1
    assert_same_state(model, opt, loaded, loaded.optimizer)

    # tf.train.Checkpoint: the LossScale's state travels with the optimizer.
    path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh = LossScaleOptimizer(keras.optimizers.SGD(0.1),
                               loss_scale=DynamicLossScale(256.0, 5, 2.0, hysteresis=3))
    fresh.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=fresh).restore(path).assert_existing_objects_matched()
    assert [bits(v) for v in fresh.variables] == [bits(v) for v in opt.variables]

    with pytest.raises(ValueError, match="not both"):
        LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0, loss_scale="dynamic")
    assert isinstance(LossScaleOptimizer(keras.optimizers.SGD(), loss_scale="dynamic")
                      .loss_scale_object, DynamicLossScale)
    assert lossscale.LossScaleOptimizer is LossScaleOptimizer


def test_a_tf_keras_optimizer_is_refused_with_the_way_out():
    tf_keras = pytest.importorskip("tf_keras")
    with pytest.raises(TypeError, match="tf_keras .* TF_USE_LEGACY_KERAS=1"):
        LossScaleOptimizer(tf_keras.optimizers.SGD())
