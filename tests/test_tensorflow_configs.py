"""Loss-scale optimizer configs that TensorFlow 2.3 and 2.4 wrote, read by ours
under Keras 3 as TensorFlow 2.4 read them.

TensorFlow 2.3's ``tf.keras.mixed_precision.experimental.LossScaleOptimizer``
wrote ``{'optimizer', 'loss_scale'}``; TensorFlow 2.4's two classes read that
form, and refused a ``DynamicLossScale`` whose multiplier is not 2, since
they only follow the rule with multiplier 2.  The oracle is TensorFlow's
in-tree Keras 2 (``tensorflow.python.keras``, TensorFlow 2.4's code, still
shipped): the same configs, the same refusals, the same messages.  The same
under ``tf_keras`` is in ``tf_keras_lso_cases.py``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.keras.mixed_precision import loss_scale_optimizer as tf24_lso
from tensorflow.python.keras.optimizer_v2 import gradient_descent as tf24_sgd

import lossscale
from lossscale import experimental
from lossscale.optimizer import LossScaleOptimizer
from helpers import assert_same_bits

# TensorFlow 2.4's two classes: the non-experimental one and the experimental one.
TF24_CLASSES = {"non-experimental": tf24_lso.LossScaleOptimizer,
                "experimental": tf24_lso.LossScaleOptimizerV1}
OURS = {"non-experimental": LossScaleOptimizer, "experimental": experimental.LossScaleOptimizer}


def _keras2_sgd():
    return {"class_name": "SGD", "config": {"learning_rate": 2.0, "momentum": 0.5, "decay": 0.0,
                                            "nesterov": False, "name": "SGD"}}


def _tf23_config(loss_scale):
    return {"optimizer": _keras2_sgd(), "loss_scale": loss_scale}


def _dynamic(multiplier, initial=2.0, period=3):
    return {"class_name": "DynamicLossScale",
            "config": {"initial_loss_scale": initial, "increment_period": period,
                       "multiplier": multiplier}}


def _error(from_config, config):
    with pytest.raises(Exception) as info:  # The oracle's class is compared.
        from_config(dict(config))
    return type(info.value), str(info.value)


@pytest.mark.parametrize("kind", sorted(OURS))
@pytest.mark.parametrize("multiplier", [4.0, 3.0, 1.5, 1.0])
def test_a_multiplier_other_than_2_is_refused_as_tensorflow_2_4(kind, multiplier):
    config = _tf23_config(_dynamic(multiplier))
    want = _error(TF24_CLASSES[kind].from_config, config)
    assert want[0] is ValueError and "whose multiplier is not 2" in want[1]
    assert _error(OURS[kind].from_config, config) == want


@pytest.mark.parametrize("kind", sorted(OURS))
@pytest.mark.parametrize("loss_scale", [
    _dynamic(2.0), _dynamic(2, 2.0**10, 7),
    {"class_name": "FixedLossScale", "config": {"loss_scale_value": 12.0}}])
def test_tensorflow_2_3_configs_read_as_tensorflow_2_4(kind, loss_scale):
    config = _tf23_config(loss_scale)
    ours = OURS[kind].from_config(dict(config))
    reference = TF24_CLASSES[kind].from_config(dict(config))
    assert type(ours) is OURS[kind]
    assert type(ours.inner_optimizer) is keras.optimizers.SGD
    assert float(ours.inner_optimizer.learning_rate.numpy()) == 2.0
    assert (ours.dynamic if kind == "experimental" else
            isinstance(ours.loss_scale_object, lossscale.DynamicLossScale)) == reference.dynamic
    assert ours.initial_scale == reference.initial_scale
    assert ours.dynamic_growth_steps == reference.dynamic_growth_steps
    assert_same_bits(ours.loss_scale.numpy(), reference.loss_scale.numpy(), "scale")
    # The scale moves as TensorFlow 2.4's does, step for step (overflow included).
    ours_var, ref_var = tf.Variable([5.0, -1.0]), tf.Variable([5.0, -1.0])
    for i in range(9):
        poison = np.inf if i in (2, 5) else 1.0
        loss = lambda v: tf.reduce_sum(v * v) * poison  # noqa: E731
        with tf.GradientTape() as tape:
            scaled = ours.get_scaled_loss(loss(ours_var)) if kind == "experimental" else \
                ours.scale_loss(loss(ours_var))
        grads = tape.gradient(scaled, [ours_var])
        if kind == "experimental":
            ours.apply_gradients(zip(ours.get_unscaled_gradients(grads), [ours_var]))
        else:
            ours.apply(grads, [ours_var])
        with tf.GradientTape() as tape:
            scaled = reference.get_scaled_loss(loss(ref_var))
        grads = reference.get_unscaled_gradients(tape.gradient(scaled, [ref_var]))
        reference.apply_gradients(zip(grads, [ref_var]))
        assert_same_bits(ours.loss_scale.numpy(), reference.loss_scale.numpy(), f"step {i}")


@pytest.mark.parametrize("kind", sorted(OURS))
@pytest.mark.parametrize("dynamic", [True, False])
def test_tensorflow_2_4_configs(kind, dynamic):
    arguments = dict(dynamic=True, initial_scale=64.0, dynamic_growth_steps=5) if dynamic else \
        dict(dynamic=False, initial_scale=12.0)
    config = tf24_lso.LossScaleOptimizer(tf24_sgd.SGD(2.0, momentum=0.5), **arguments).get_config()
    ours = OURS[kind].from_config(dict(config))
    reference = TF24_CLASSES[kind].from_config(dict(config))
    assert type(ours) is OURS[kind]
    assert type(ours.loss_scale_object) is (lossscale.DynamicLossScale if dynamic
                                            else lossscale.FixedLossScale)
    assert (ours.initial_scale, ours.dynamic_growth_steps) == (
        reference.initial_scale, reference.dynamic_growth_steps)
    assert float(ours.inner_optimizer.momentum) == 0.5


def test_our_own_configs_keep_their_multiplier():
    # Our constructors follow any multiplier, so their configs read back with it.
    scale = lossscale.DynamicLossScale(8.0, 3, multiplier=3.0)
    for cls in (LossScaleOptimizer, experimental.LossScaleOptimizer):
        inner = keras.optimizers.SGD(0.1)
        opt = (cls(inner, loss_scale=scale) if cls is LossScaleOptimizer else cls(inner, scale))
        again = cls.from_config(opt.get_config())
        assert again.loss_scale_object.get_config() == scale.get_config()
        again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
        assert type(again) is cls and again.loss_scale_object.multiplier == 3.0


def test_keras3_configs_still_read():
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=64.0,
                                                dynamic_growth_steps=9)
    ours = LossScaleOptimizer.from_config(stock.get_config())
    assert type(ours) is LossScaleOptimizer and ours.loss_scale_object is None
    assert ours.get_config() == stock.get_config()


def test_a_neither_fixed_nor_dynamic_loss_scale_in_a_tensorflow_2_3_config():
    # An unknown class is refused, by its name.
    config = _tf23_config({"class_name": "NoSuchLossScale", "config": {}})
    for cls in OURS.values():
        with pytest.raises(ValueError, match="NoSuchLossScale"):
            cls.from_config(dict(config))
