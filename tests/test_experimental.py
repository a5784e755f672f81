"""lossscale.experimental: TensorFlow 2.4's namespace and its LossScaleOptimizer contract.

Oracles: TensorFlow's own ``tf.compat.v1.mixed_precision.DynamicLossScale``
fed the same unscaled gradients (the loss-scale trajectory must match step
for step), a plain Keras optimizer applying gradients unscaled with
TensorFlow ops (the model must match bit for bit), and the examples of
TensorFlow 2.4's ``LossScaleOptimizer`` documentation.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from lossscale import experimental
from lossscale import loss_scale as ls_module
from helpers import bits, mixed_mlp, tf24_reference_step, tf24_train_step, tf_dynamic

INF = float("inf")


def regression_model(seed):
    return mixed_mlp(seed, hidden=16)


def regression_data(steps, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((6, 1)).astype(np.float32) * 0.5
    for _ in range(steps):
        x = rng.standard_normal((16, 6)).astype(np.float32)
        yield x, np.tanh(x @ w)


def overflow(i):
    return INF if i % 11 == 6 else (1e30 if i % 17 == 9 else 1.0)


# ----------------------------------------------------- the old custom loop

def test_old_custom_loop_trains_skips_and_follows_tensorflow():
    model = regression_model(0)
    reference_model = regression_model(1)
    reference_model.set_weights(model.get_weights())
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                          experimental.DynamicLossScale(2.0**10, 5))
    reference_scale = tf_dynamic(initial_loss_scale=2.0**10, increment_period=5)
    reference_inner = keras.optimizers.SGD(0.1)
    reference_inner.build(reference_model.trainable_variables)

    train_step = tf.function(tf24_train_step(model, opt))
    reference_step = tf.function(tf24_reference_step(reference_model, reference_inner,
                                                     reference_scale))

    losses, skipped, moves = [], 0, set()
    for i, (x, y) in enumerate(regression_data(200)):
        f = np.float32(overflow(i))
        before = [bits(v) for v in model.variables]
        scale_before = float(opt.loss_scale.numpy())
        loss = train_step(x, y, f)
        reference_step(x, y, f)
        if f != 1.0:
            skipped += 1
            assert [bits(v) for v in model.variables] == before, f"step {i} not skipped"
        else:
            losses.append(float(loss))
        assert bits(opt.loss_scale) == bits(reference_scale()), f"step {i}"
        assert int(opt.dynamic_counter.numpy()) == int(reference_scale._num_good_steps.numpy())
        for a, b in zip(model.variables, reference_model.variables):
            assert bits(a) == bits(b), f"step {i}"
        moves.add(np.sign(float(opt.loss_scale.numpy()) - scale_before))
    assert moves == {-1.0, 0.0, 1.0}
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])  # it trains
    # TensorFlow 2.4 counts skipped steps in `iterations` too.
    assert int(opt.iterations.numpy()) == 200 and skipped > 10


def test_documentation_examples_of_tensorflow_2_4():
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.25), "dynamic")
    var = keras.Variable(1.0)
    loss_fn = lambda: var**2
    opt.minimize(loss_fn, var_list=[var])
    assert float(var.numpy()) == 0.5

    with tf.GradientTape() as tape:
        loss = loss_fn()
        scaled_loss = opt.get_scaled_loss(loss)
    scaled_grad = tape.gradient(scaled_loss, var)
    (grad,) = opt.get_unscaled_gradients([scaled_grad])
    opt.apply_gradients([(grad, var)])
    assert float(var.numpy()) == 0.25

    with tf.GradientTape() as tape:
        loss = loss_fn()
    opt.minimize(loss, [var], tape=tape)
    assert float(var.numpy()) == 0.125
    with pytest.raises(ValueError, match="tape"):
        opt.minimize(var * 2.0, [var])


def test_minimize_equals_the_explicit_loop():
    model_a, model_b = regression_model(0), regression_model(1)
    model_b.set_weights(model_a.get_weights())
    opt_a = experimental.LossScaleOptimizer(keras.optimizers.Adam(1e-2), 256)
    opt_b = experimental.LossScaleOptimizer(keras.optimizers.Adam(1e-2), 256)
    for x, y in regression_data(10, seed=3):
        loss_fn = lambda: tf.reduce_mean(tf.square(tf.cast(model_a(x), tf.float32) - y))
        opt_a.minimize(loss_fn, lambda: model_a.trainable_variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model_b(x), tf.float32) - y))
            scaled = opt_b.get_scaled_loss(loss)
        grads = opt_b.get_unscaled_gradients(tape.gradient(scaled, model_b.trainable_variables))
        opt_b.apply_gradients(zip(grads, model_b.trainable_variables))
    for a, b in zip(model_a.variables + opt_a.variables, model_b.variables + opt_b.variables):
        assert bits(a) == bits(b)


# ------------------------------------------------------------ the pieces

def test_get_unscaled_gradients_is_tensorflow_arithmetic():
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(), 1000)
    rng = np.random.default_rng(0)
    dense32 = tf.constant(rng.standard_normal((50, 7)).astype(np.float32) * 1000)
    dense16 = tf.constant(rng.standard_normal(300).astype(np.float16) * 100)
    sparse = tf.IndexedSlices(tf.constant(rng.standard_normal((3, 4)).astype(np.float32)),
                              tf.constant([0, 5, 5]), tf.constant([8, 4]))
    out = opt.get_unscaled_gradients([dense32, None, dense16, sparse])
    inv = 1.0 / tf.constant(1000.0)
    assert out[1] is None
    assert bits(out[0]) == bits(dense32 * tf.cast(inv, tf.float32))
    assert out[2].dtype == tf.float16
    assert bits(out[2]) == bits(dense16 * tf.cast(inv, tf.float16))
    assert isinstance(out[3], tf.IndexedSlices)
    assert bits(out[3].values) == bits(sparse.values * inv)
    assert bits(out[3].indices) == bits(sparse.indices)


def test_get_scaled_loss_keeps_the_loss_dtype():
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(), experimental.FixedLossScale(8))
    loss16 = tf.constant(1.5, tf.float16)
    assert opt.get_scaled_loss(loss16).dtype == tf.float16
    assert float(opt.get_scaled_loss(loss16)) == 12.0
    scaled_fn = opt.get_scaled_loss(lambda: tf.constant(2.0))
    assert callable(scaled_fn) and float(scaled_fn()) == 16.0


def test_properties_as_tensorflow_2_4():
    dynamic = experimental.LossScaleOptimizer(keras.optimizers.SGD(), "dynamic")
    assert dynamic.dynamic and dynamic.initial_scale == 2.0**15
    assert dynamic.dynamic_growth_steps == 2000
    assert isinstance(dynamic.loss_scale, tf.Tensor) and dynamic.loss_scale.dtype == tf.float32
    assert float(dynamic.loss_scale) == 2.0**15
    assert int(dynamic.dynamic_counter.numpy()) == 0
    assert isinstance(dynamic.inner_optimizer, keras.optimizers.SGD)
    assert isinstance(dynamic, lossscale.LossScaleOptimizer)
    assert isinstance(dynamic, keras.optimizers.LossScaleOptimizer)

    fixed = experimental.LossScaleOptimizer(keras.optimizers.SGD(), 123)
    assert not fixed.dynamic and fixed.dynamic_counter is None
    assert fixed.initial_scale == 123.0 and fixed.dynamic_growth_steps is None
    assert float(fixed.loss_scale) == 123.0
    with pytest.raises(ValueError):
        experimental.LossScaleOptimizer(keras.optimizers.SGD(), None)
    with pytest.raises(ValueError):
        experimental.LossScaleOptimizer(keras.optimizers.SGD(), "static")


def test_fixed_loss_scale_applies_every_step():
    model = regression_model(0)
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), 64)
    x, y = next(regression_data(1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y)) * INF
        scaled = opt.get_scaled_loss(loss)
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
    opt.apply_gradients(zip(grads, model.trainable_variables))
    assert not np.all(np.isfinite(model.trainable_variables[0].numpy()))
    assert int(opt.iterations.numpy()) == 1


def test_hysteresis_extension_skips_without_backing_off():
    ls = experimental.DynamicLossScale(2.0**8, 100, hysteresis=2)
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), ls)
    model = regression_model(0)
    x, y = next(regression_data(1))
    for i, factor in enumerate([INF, INF, INF]):
        before = [bits(v) for v in model.variables]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y)) * factor
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        assert [bits(v) for v in model.variables] == before
        assert float(opt.loss_scale) == [2.0**8, 2.0**7, 2.0**7][i]


def test_sparse_gradients_reach_the_inner_optimizer_sparse():
    seen = []

    class Recording(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            seen.append(isinstance(gradient, tf.IndexedSlices))
            return super().update_step(gradient, variable, learning_rate)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,), dtype="int32"),
                              keras.layers.Embedding(20, 4, dtype="mixed_float16"),
                              keras.layers.Flatten(dtype="mixed_float16"),
                              keras.layers.Dense(1, dtype="float32")])
    opt = experimental.LossScaleOptimizer(Recording(0.1), "dynamic")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.cast(model(np.array([[1, 2, 2]], np.int32)), tf.float32))
        scaled = opt.get_scaled_loss(loss)
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
    assert isinstance(grads[0], tf.IndexedSlices)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    assert seen == [True, False, False]


def test_fit_goes_through_scale_loss_and_apply():
    """Keras 3's fit hands scaled gradients to apply(); TensorFlow 2.4's rule still holds."""
    model = regression_model(0)
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.05),
                                          experimental.DynamicLossScale(2.0**6, 3))
    model.compile(optimizer=opt, loss="mse")
    x, y = zip(*regression_data(12, seed=5))
    x, y = np.concatenate(x), np.concatenate(y)
    x[16 * 4 + 3, 0] = np.inf
    reference = tf_dynamic(initial_loss_scale=2.0**6, increment_period=3)
    for i in range(12):
        reference.update([tf.constant(INF if i == 4 else 1.0)])
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert bits(opt.loss_scale) == bits(reference())
    assert int(opt.dynamic_counter.numpy()) == int(reference._num_good_steps.numpy())
    assert int(opt.iterations.numpy()) == 12


# ------------------------------------------------------------- config

def test_config_round_trips_and_reads_tensorflow_formats():
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.5, name="sgd"),
                                          experimental.DynamicLossScale(64, 7), name="old")
    config = opt.get_config()
    assert config["loss_scale"] == {
        "class_name": "DynamicLossScale",
        "config": {"initial_loss_scale": 64.0, "increment_period": 7, "multiplier": 2.0}}
    again = experimental.LossScaleOptimizer.from_config(config)
    assert type(again) is experimental.LossScaleOptimizer
    assert again.get_config() == config
    generic = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(generic) is experimental.LossScaleOptimizer
    assert generic.get_config() == config

    sgd = keras.saving.serialize_keras_object(keras.optimizers.SGD(0.5, name="sgd"))
    tf24 = experimental.LossScaleOptimizer.from_config(
        {"inner_optimizer": sgd, "dynamic": True, "initial_scale": 64.0,
         "dynamic_growth_steps": 7})
    assert tf24.loss_scale_object.get_config() == again.loss_scale_object.get_config()
    tf24_fixed = experimental.LossScaleOptimizer.from_config(
        {"inner_optimizer": sgd, "dynamic": False, "initial_scale": 12.0,
         "dynamic_growth_steps": None})
    assert isinstance(tf24_fixed.loss_scale_object, ls_module.FixedLossScale)
    tf23 = experimental.LossScaleOptimizer.from_config(
        {"optimizer": sgd, "loss_scale": {"class_name": "FixedLossScale",
                                          "config": {"loss_scale_value": 12.0}}})
    assert float(tf23.loss_scale) == 12.0


# ---------------------------------------------------------- the namespace

def test_namespace_of_tensorflow_2_4():
    assert experimental.LossScale is ls_module.LossScale
    assert experimental.FixedLossScale is ls_module.FixedLossScale
    assert experimental.DynamicLossScale is ls_module.DynamicLossScale
    from lossscale.policy import Policy
    assert experimental.Policy is Policy
    assert lossscale.experimental is experimental
    for name in experimental.__all__:
        assert getattr(experimental, name) is not None


def test_set_policy_and_global_policy():
    previous = keras.mixed_precision.global_policy()
    try:
        experimental.set_policy("mixed_float16")
        policy = experimental.global_policy()
        assert isinstance(policy, experimental.Policy)
        assert policy.compute_dtype == "float16" and policy.variable_dtype == "float32"
        layer = keras.layers.Dense(2)
        assert experimental.get_layer_policy(layer).name == "mixed_float16"
    finally:
        keras.mixed_precision.set_global_policy(previous)
    with pytest.raises(ValueError):
        experimental.get_layer_policy("not a layer")


def test_hyperparameters_delegated_as_tensorflow_2_4():
    opt = experimental.LossScaleOptimizer(keras.optimizers.Adam(beta_1=0.8, epsilon=1e-5))
    assert opt.beta_1 == 0.8
    opt.beta_1 = 0.7
    assert opt.inner_optimizer.beta_1 == 0.7 and opt.beta_1 == 0.7
    opt.lr = 0.5
    assert float(opt.inner_optimizer.learning_rate.numpy()) == 0.5
    assert float(opt.lr.numpy()) == 0.5
    with pytest.raises(AttributeError):
        opt.no_such_hyperparameter
