"""``lossscale.patch_keras`` / ``unpatch_keras``: which optimizer
``Model.compile`` ends up with, and that ``fit`` then follows the loss scale.

Oracles: stock Keras's own compile (what it wraps, with which arguments, and
the numbers its ``LossScaleOptimizer`` produces), TensorFlow's
``tf.compat.v1.mixed_precision.DynamicLossScale`` fed the same finite /
non-finite steps, and plain float32 training for a power-of-two fixed scale
(exact in float32, so the same bits).
"""

import inspect
import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.trainers.trainer import Trainer

import lossscale
from lossscale import keras_patch
from lossscale import loss_scale as loss_scale_module
from lossscale.optimizer import LossScaleOptimizer
from lossscale.policy import Policy

STOCK_COMPILE = Trainer.__dict__["compile"]
OVERFLOW_STEPS = (2, 5, 6, 13)  # batch-size-1 steps whose loss is inf
N = 16


@pytest.fixture(autouse=True)
def _clean_state(stock_keras_compile):
    assert stock_keras_compile is STOCK_COMPILE
    yield


def _model(policy, seed=0):
    """A two-layer model whose own policy (the global one) is ``policy``."""
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def _data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    y[list(OVERFLOW_STEPS)] = np.inf
    return x, y


class _ScaleTrace(keras.callbacks.Callback):
    def __init__(self, read):
        super().__init__()
        self.read = read
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(self.read(self.model.optimizer))


def _tf_trajectory(initial, period, steps=N, multiplier=2.0):
    """TensorFlow's DynamicLossScale after each step of ``_data()``."""
    oracle = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=initial, increment_period=period, multiplier=multiplier)
    out = []
    for step in range(steps):
        grad = np.inf if step in OVERFLOW_STEPS else 0.0
        oracle.update([tf.constant([grad])])
        out.append(float(oracle()))
    return out, int(oracle._num_good_steps)  # pylint: disable=protected-access


# ----------------------------------------------------------------------
# The switch itself


def test_patch_and_unpatch_are_idempotent_and_exact():
    signature = inspect.signature(keras.Model.compile)
    assert not keras_patch.is_keras_patched()
    lossscale.unpatch_keras()  # not patched: nothing to do
    assert Trainer.__dict__["compile"] is STOCK_COMPILE
    lossscale.patch_keras()
    patched = Trainer.__dict__["compile"]
    assert patched is not STOCK_COMPILE and keras_patch.is_keras_patched()
    lossscale.patch_keras()
    assert Trainer.__dict__["compile"] is patched
    assert inspect.signature(keras.Model.compile) == signature
    lossscale.unpatch_keras()
    lossscale.unpatch_keras()
    assert Trainer.__dict__["compile"] is STOCK_COMPILE
    assert keras.Model.compile is STOCK_COMPILE
    assert not keras_patch.is_keras_patched()


def test_unpatch_leaves_a_later_patch_alone():
    lossscale.patch_keras()
    ours = Trainer.__dict__["compile"]

    def someone_elses(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    Trainer.compile = someone_elses
    try:
        with pytest.warns(UserWarning, match="replaced"):
            lossscale.unpatch_keras()
        assert Trainer.__dict__["compile"] is someone_elses
    finally:
        Trainer.compile = ours
    lossscale.unpatch_keras()


def test_the_policy_hook_is_installed_once_by_the_first_policy_with_a_loss_scale():
    from lossscale import experimental  # pylint: disable=import-outside-toplevel

    Policy("float32")
    Policy("mixed_float16", loss_scale=None)
    assert Trainer.__dict__["compile"] is STOCK_COMPILE
    Policy("mixed_float16")
    hooked = Trainer.__dict__["compile"]
    assert hooked is not STOCK_COMPILE and not keras_patch.is_keras_patched()
    Policy("float32", loss_scale=8)
    experimental.set_policy(Policy("mixed_float16", loss_scale=None))
    assert Trainer.__dict__["compile"] is hooked
    lossscale.patch_keras()
    assert Trainer.__dict__["compile"] is hooked and keras_patch.is_keras_patched()
    lossscale.unpatch_keras()
    assert Trainer.__dict__["compile"] is STOCK_COMPILE


# ----------------------------------------------------------------------
# What compile wraps


def _compiled(policy, optimizer=None, **kwargs):
    model = _model(policy)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01, name="sgd"), loss="mse", **kwargs)
    return model


# The reference page: "Масштаб потерь используется только
# tf.keras.Model.compile, который автоматически оборачивает оптимизатор с
# LossScaleOptimizer, если оптимизатор не является LossScaleOptimizer. Для
# неэкспериментального класса Policy Model.compile вместо этого оборачивает
# оптимизатор с LossScaleOptimizer, если Policy.name равен "mixed_float16"."
# That is what compile does once patched; unpatched, it is stock Keras.


def test_unpatched_keras_is_stock():
    model = _compiled("mixed_float16")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    # Stock Keras ignores our policy's loss scale and goes by the name.
    assert type(_compiled(Policy("mixed_float16", loss_scale=None)).optimizer) \
        is keras.optimizers.LossScaleOptimizer


def test_mixed_float16_is_wrapped_as_keras_does():
    stock = _compiled("mixed_float16")
    lossscale.patch_keras()
    ours = _compiled("mixed_float16")
    assert type(ours.optimizer) is LossScaleOptimizer
    assert ours.optimizer.loss_scale_object is None  # the Keras rule
    assert ours.optimizer.get_config() == stock.optimizer.get_config()
    assert (ours.optimizer.name, ours.optimizer.initial_scale,
            ours.optimizer.dynamic_growth_steps) == ("loss_scale_optimizer", 2.0**15, 2000)
    assert type(ours.optimizer.inner_optimizer) is keras.optimizers.SGD
    # What compile records for saving is the unwrapped optimizer, as stock.
    assert ours.get_compile_config() == stock.get_compile_config()


def test_string_optimizer_is_wrapped():
    lossscale.patch_keras()
    model = _compiled("mixed_float16", optimizer="adam")
    assert type(model.optimizer) is LossScaleOptimizer
    assert type(model.optimizer.inner_optimizer) is keras.optimizers.Adam


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "float64"])
def test_other_policies_are_not_wrapped(policy):
    lossscale.patch_keras()
    model = _compiled(policy)
    assert type(model.optimizer) is keras.optimizers.SGD
    assert type(_compiled(Policy(policy)).optimizer) is keras.optimizers.SGD


@pytest.mark.parametrize("loss_scale,expected_type,config", [
    ("auto", loss_scale_module.DynamicLossScale,
     tf.compat.v1.mixed_precision.DynamicLossScale().get_config()),
    ("dynamic", loss_scale_module.DynamicLossScale,
     tf.compat.v1.mixed_precision.DynamicLossScale().get_config()),
    (loss_scale_module.DynamicLossScale(initial_loss_scale=64, increment_period=3,
                                        multiplier=4.0, hysteresis=2),
     loss_scale_module.DynamicLossScale,
     {"initial_loss_scale": 64.0, "increment_period": 3, "multiplier": 4.0, "hysteresis": 2}),
    (256, loss_scale_module.FixedLossScale, {"loss_scale_value": 256.0}),
])
def test_policy_loss_scale_is_followed(loss_scale, expected_type, config):
    policy = Policy("mixed_float16", loss_scale=loss_scale)
    lossscale.patch_keras()
    model = _compiled(policy)
    optimizer = model.optimizer
    assert type(optimizer) is LossScaleOptimizer and optimizer.name == "loss_scale_optimizer"
    assert type(optimizer.loss_scale_object) is expected_type
    assert optimizer.loss_scale_object.get_config() == config
    # A copy: each compiled model has its own loss-scale state.
    assert optimizer.loss_scale_object is not policy.loss_scale
    other = _compiled(policy)
    assert other.optimizer.loss_scale_object is not optimizer.loss_scale_object


def test_policy_without_loss_scale_is_not_wrapped_even_for_mixed_float16():
    lossscale.patch_keras()
    assert type(_compiled(Policy("mixed_float16", loss_scale=None)).optimizer) \
        is keras.optimizers.SGD


def test_fixed_loss_scale_on_float32_policy_is_wrapped(caplog):
    with caplog.at_level(logging.WARNING):
        policy = Policy("float32", loss_scale=8)
    lossscale.patch_keras()
    model = _compiled(policy)
    assert type(model.optimizer.loss_scale_object) is loss_scale_module.FixedLossScale


@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
    lambda: LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0),
    lambda: LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=4),
])
@pytest.mark.parametrize("policy", ["mixed_float16", "policy"])
def test_loss_scale_optimizers_are_left_alone(make, policy):
    if policy == "policy":
        policy = Policy("mixed_float16", loss_scale=2)
    lossscale.patch_keras()
    optimizer = make()
    assert _compiled(policy, optimizer=optimizer).optimizer is optimizer


def test_auto_scale_loss_false_is_respected():
    lossscale.patch_keras()
    for policy in ("mixed_float16", Policy("mixed_float16", loss_scale=4)):
        model = _compiled(policy, auto_scale_loss=False)
        assert type(model.optimizer) is keras.optimizers.SGD


def test_positional_arguments():
    lossscale.patch_keras()
    model = _model("mixed_float16")
    model.compile(keras.optimizers.SGD(0.01), "mse", None, ["mae"])
    assert type(model.optimizer) is LossScaleOptimizer
    assert model.get_compile_config()["metrics"] == ["mae"]


def test_models_compiled_before_keep_their_optimizer():
    model = _compiled("mixed_float16")
    before = model.optimizer
    lossscale.patch_keras()
    assert model.optimizer is before


def test_compile_from_config_goes_through_the_patch():
    source = _compiled("mixed_float16")
    config = source.get_compile_config()
    lossscale.patch_keras()
    model = _model("mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.compile_from_config(config)
    assert type(model.optimizer) is LossScaleOptimizer


def test_unpatch_restores_stock_wrapping():
    lossscale.patch_keras()
    assert type(_compiled("mixed_float16").optimizer) is LossScaleOptimizer
    lossscale.unpatch_keras()
    assert type(_compiled("mixed_float16").optimizer) is keras.optimizers.LossScaleOptimizer
    assert type(_compiled(Policy("mixed_float16", loss_scale=None)).optimizer) \
        is keras.optimizers.LossScaleOptimizer


# ----------------------------------------------------------------------
# Training with the wrapped optimizer


def test_fit_matches_stock_keras_for_mixed_float16():
    x, y = _data()
    stock = _compiled("mixed_float16")
    stock_trace = _ScaleTrace(lambda o: float(o.dynamic_scale))
    stock.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[stock_trace])

    lossscale.patch_keras()
    ours = _compiled("mixed_float16")
    ours_trace = _ScaleTrace(lambda o: float(o.dynamic_scale))
    ours.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[ours_trace])

    assert type(ours.optimizer) is LossScaleOptimizer
    assert ours_trace.values == stock_trace.values
    trace = [2.0**15] + stock_trace.values
    skipped = sum(after < before for before, after in zip(trace, trace[1:]))
    assert skipped >= len(OVERFLOW_STEPS)  # the injected ones, and float16's own
    for name in ("dynamic_scale", "step_counter", "iterations"):
        assert (getattr(ours.optimizer, name).numpy()
                == getattr(stock.optimizer, name).numpy()), name
    assert int(ours.optimizer.iterations) == N - skipped
    for a, b in zip(ours.weights, stock.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _patched_with_dynamic_scale(initial, period):
    """The data, a policy with its own DynamicLossScale, and a model compiled
    under it with Keras patched."""
    x, y = _data()
    policy = Policy("mixed_float16", loss_scale=loss_scale_module.DynamicLossScale(
        initial_loss_scale=initial, increment_period=period))
    lossscale.patch_keras()
    return x, y, policy, _compiled(policy)


def test_fit_follows_the_policy_dynamic_loss_scale():
    x, y, policy, model = _patched_with_dynamic_scale(4, 2)
    trace = _ScaleTrace(lambda o: float(o.loss_scale))
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[trace])
    want, good_steps = _tf_trajectory(initial=4, period=2)
    assert trace.values == want
    assert len(set(want)) > 2  # it did grow and back off
    state = model.optimizer.loss_scale_object
    assert float(state()) == want[-1]
    assert int(state._num_good_steps) == good_steps  # pylint: disable=protected-access
    assert int(model.optimizer.iterations) == N - len(OVERFLOW_STEPS)
    # The policy's own loss scale is a recipe: untouched by training.
    assert float(policy.loss_scale()) == 4.0


def test_train_on_batch_uses_the_loss_scale():
    x, y, _, model = _patched_with_dynamic_scale(4, 1)
    model.train_on_batch(x[:2], y[:2])  # finite: period 1 grows at once
    assert float(model.optimizer.loss_scale) == 8.0
    model.train_on_batch(x[2:3], y[2:3])  # inf: back off, skip
    assert float(model.optimizer.loss_scale) == 4.0
    assert int(model.optimizer.iterations) == 1
    # Evaluating and predicting never touch it, overflow or not.
    model.evaluate(x, y, batch_size=4, verbose=0)
    model.predict(x, verbose=0)
    model.test_on_batch(x[2:3], y[2:3])
    assert float(model.optimizer.loss_scale) == 4.0
    assert int(model.optimizer.loss_scale_object._num_good_steps) == 0  # pylint: disable=protected-access


def test_fit_with_fixed_power_of_two_scale_is_plain_float32_training(caplog):
    x, y = _data()
    x, y = x[:8], np.nan_to_num(y[:8], posinf=3.0)
    plain = _compiled("float32")
    plain.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    with caplog.at_level(logging.WARNING):
        policy = Policy("float32", loss_scale=128)
    lossscale.patch_keras()
    ours = _compiled(policy)
    ours.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    assert float(ours.optimizer.scale_loss(1.0)) == 128.0
    assert int(ours.optimizer.iterations) == int(plain.optimizer.iterations) == 4
    for a, b in zip(ours.weights, plain.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
