"""``lossscale.Policy``: every statement of TensorFlow 2.4's page on the
experimental ``Policy``, checked against independent oracles -- Keras's own
``DTypePolicy`` for names and dtypes, TensorFlow's
``tf.compat.v1.mixed_precision`` loss scales for the default loss scale,
Keras's serializers for what a saved model holds, and numbers computed by
plain Keras layers for what a layer does with the policy.
"""

import inspect
import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from lossscale import loss_scale as loss_scale_module
from lossscale.policy import Policy

NAMES = ["float32", "float64", "mixed_float16", "mixed_bfloat16"]
LOGGER = "lossscale.policy"


@pytest.fixture(autouse=True)
def _restore_global_policy():
    before = keras.mixed_precision.global_policy()
    yield
    keras.mixed_precision.set_global_policy(before)


def _warnings_logged(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# "Устаревший тип данных политики для слоя Keras. Наследуется от: Policy"
def test_is_a_keras_dtype_policy():
    assert issubclass(Policy, keras.DTypePolicy)
    assert issubclass(Policy, keras.mixed_precision.Policy)
    assert lossscale.Policy is Policy


# "Разница между этим классом и неэкспериментальным классом заключается в
# том, что этот класс имеет поле loss_scale, а неэкспериментальный класс — нет."
def test_loss_scale_field_is_the_difference():
    ours, plain = Policy("mixed_float16"), keras.DTypePolicy("mixed_float16")
    assert hasattr(ours, "loss_scale") and not hasattr(plain, "loss_scale")
    for attribute in ("name", "compute_dtype", "variable_dtype", "quantization_mode"):
        assert getattr(ours, attribute) == getattr(plain, attribute)


# The sentences on what ``Model.compile`` does with the loss scale (and with
# a plain policy named "mixed_float16") are tested in test_keras_patch.py;
# the one on restoring saved models without the experimental policy in
# test_saving.py.


# "tf.keras.mixed_precision.experimental.Policy(name, loss_scale='auto')"
def test_signature():
    params = inspect.signature(Policy).parameters
    assert list(params) == ["name", "loss_scale"]
    assert params["name"].default is inspect.Parameter.empty
    assert params["loss_scale"].default == "auto"


# `name`: "Любое имя типа данных ... И тип данных переменной, и тип данных
# вычислений будут равны этому типу. 'mixed_float16' или 'mixed_bfloat16':
# тип данных вычислений — float16 или bfloat16, а тип данных переменной —
# float32."  Attributes `name`, `compute_dtype`, `variable_dtype`.
@pytest.mark.parametrize("name", NAMES + ["float16", "bfloat16"])
def test_name_and_dtypes_match_keras(name):
    policy = Policy(name)
    oracle = keras.DTypePolicy(name)
    assert policy.name == oracle.name == name
    assert policy.compute_dtype == oracle.compute_dtype
    assert policy.variable_dtype == oracle.variable_dtype


def test_mixed_dtypes_spelled_out():
    assert (Policy("mixed_float16").compute_dtype, Policy("mixed_float16").variable_dtype) == (
        "float16", "float32")
    assert (Policy("mixed_bfloat16").compute_dtype, Policy("mixed_bfloat16").variable_dtype) == (
        "bfloat16", "float32")
    assert (Policy("float64").compute_dtype, Policy("float64").variable_dtype) == (
        "float64", "float64")


def test_bad_name_is_an_error_naming_it():
    with pytest.raises(ValueError, match="mixed_float17"):
        Policy("mixed_float17")
    with pytest.raises(TypeError):
        Policy(16)


# "При использовании 'mixed_float16' используется динамический масштаб
# потерь."  "В случае "auto": 1) если name равно "mixed_float16", то
# используйте loss_scale="dynamic". 2) в противном случае не используйте
# масштаб потерь."
def test_auto_is_dynamic_for_mixed_float16():
    oracle = tf.compat.v1.mixed_precision.DynamicLossScale()
    for policy in (Policy("mixed_float16"), Policy("mixed_float16", loss_scale="auto")):
        assert type(policy.loss_scale) is loss_scale_module.DynamicLossScale
        assert policy.loss_scale.get_config() == oracle.get_config()
        assert float(policy.loss_scale()) == float(oracle()) == 2.0**15


@pytest.mark.parametrize("name", ["float32", "float64", "mixed_bfloat16", "float16", "bfloat16"])
def test_auto_is_none_otherwise(name, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert Policy(name).loss_scale is None
        assert Policy(name, loss_scale="auto").loss_scale is None
    assert not _warnings_logged(caplog)


# "`loss_scale`: tf.compat.v1.mixed_precision.LossScale, целое число (которое
# использует FixedLossScale), строка "dynamic" (которая использует
# DynamicLossScale) или None (не использует масштаб потерь)."
def test_loss_scale_object_is_kept():
    for ls in (loss_scale_module.FixedLossScale(256),
               loss_scale_module.DynamicLossScale(initial_loss_scale=64, increment_period=7)):
        assert Policy("mixed_float16", loss_scale=ls).loss_scale is ls


def test_loss_scale_int_is_fixed():
    policy = Policy("mixed_float16", loss_scale=1024)
    oracle = tf.compat.v1.mixed_precision.FixedLossScale(1024)
    assert type(policy.loss_scale) is loss_scale_module.FixedLossScale
    assert policy.loss_scale.get_config() == oracle.get_config()
    assert float(policy.loss_scale()) == float(oracle()) == 1024.0
    # The state machine never moves a fixed scale.
    _, apply = policy.loss_scale.update([tf.constant([np.inf])])
    assert bool(apply) and float(policy.loss_scale()) == 1024.0


def test_loss_scale_dynamic_string():
    policy = Policy("mixed_float16", loss_scale="dynamic")
    assert type(policy.loss_scale) is loss_scale_module.DynamicLossScale
    assert (policy.loss_scale.get_config()
            == tf.compat.v1.mixed_precision.DynamicLossScale().get_config())


def test_loss_scale_none():
    assert Policy("mixed_float16", loss_scale=None).loss_scale is None
    assert Policy("float32", loss_scale=None).loss_scale is None


def test_tensorflow_loss_scale_accepted():
    tf_scale = tf.compat.v1.mixed_precision.FixedLossScale(32)
    policy = Policy("mixed_float16", loss_scale=tf_scale)
    assert isinstance(policy.loss_scale, loss_scale_module.LossScale)
    assert float(policy.loss_scale()) == float(tf_scale()) == 32.0


@pytest.mark.parametrize("bad", ["static", 0.5, 0, -4, [2.0]])
def test_bad_loss_scale_is_an_error(bad):
    with pytest.raises(ValueError):
        Policy("mixed_float16", loss_scale=bad)


# SPEC §4: "a loss scale on a non-float16 policy logs a warning".
@pytest.mark.parametrize("name", ["float32", "float64", "mixed_bfloat16"])
@pytest.mark.parametrize("loss_scale", ["dynamic", 128, "fixed-object"])
def test_loss_scale_on_non_float16_policy_warns(name, loss_scale, caplog):
    if loss_scale == "fixed-object":
        loss_scale = loss_scale_module.FixedLossScale(8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        policy = Policy(name, loss_scale=loss_scale)
    logged = _warnings_logged(caplog)
    assert len(logged) == 1
    assert name in logged[0].getMessage() and "float16" in logged[0].getMessage()
    assert policy.loss_scale is not None  # a warning, not a refusal


@pytest.mark.parametrize("loss_scale", ["auto", "dynamic", 128, None])
def test_no_warning_for_float16_or_no_loss_scale(loss_scale, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Policy("mixed_float16", loss_scale=loss_scale)
        Policy("float16", loss_scale=loss_scale)
        Policy("float32", loss_scale=None)
    assert not _warnings_logged(caplog)


# Attribute `loss_scale`: "Возвращает масштаб потерь этой политики."
def test_loss_scale_is_read_only():
    policy = Policy("mixed_float16")
    with pytest.raises(AttributeError):
        policy.loss_scale = None


def test_repr_like_tensorflow():
    assert repr(Policy("float32")) == '<Policy "float32", loss_scale=None>'
    assert (repr(Policy("mixed_float16", loss_scale=128))
            == '<Policy "mixed_float16", loss_scale=FixedLossScale(128.0)>')
    assert repr(Policy("mixed_float16")).startswith(
        '<Policy "mixed_float16", loss_scale=DynamicLossScale(')


def test_equality():
    assert Policy("mixed_float16", loss_scale=4) == Policy("mixed_float16", loss_scale=4)
    assert Policy("mixed_float16", loss_scale=4) != Policy("mixed_float16", loss_scale=8)
    assert Policy("mixed_float16") != Policy("mixed_float16", loss_scale=None)
    assert Policy("mixed_float16") != keras.DTypePolicy("mixed_float16")
    assert keras.DTypePolicy("mixed_float16") != Policy("mixed_float16")


# Methods `get_config` / `from_config(config, custom_objects=None)`.  The
# config has `loss_scale` only when it was passed explicitly.
@pytest.mark.parametrize("name", NAMES)
def test_config_without_explicit_loss_scale(name):
    policy = Policy(name)
    assert policy.get_config() == {"name": name}
    restored = Policy.from_config(policy.get_config())
    assert restored == policy and restored.get_config() == {"name": name}


def test_config_with_explicit_loss_scale():
    dynamic = loss_scale_module.DynamicLossScale(initial_loss_scale=16, increment_period=3,
                                                 multiplier=4.0)
    cases = [
        ("mixed_float16", dynamic, loss_scale_module.serialize(dynamic)),
        ("mixed_float16", 512, {"class_name": "FixedLossScale",
                                "config": {"loss_scale_value": 512.0}}),
        ("mixed_float16", "dynamic", {"class_name": "DynamicLossScale",
                                      "config": tf.compat.v1.mixed_precision.DynamicLossScale()
                                      .get_config()}),
        ("mixed_float16", None, None),
        ("float32", None, None),
    ]
    for name, loss_scale, serialized in cases:
        policy = Policy(name, loss_scale=loss_scale)
        config = policy.get_config()
        assert config == {"name": name, "loss_scale": serialized}
        restored = Policy.from_config(config)
        assert restored == policy
        assert restored.get_config() == config
        if loss_scale is not None:
            assert restored.loss_scale is not policy.loss_scale


def test_from_config_accepts_custom_objects():
    class TenLossScale(loss_scale_module.FixedLossScale):
        def __init__(self):
            super().__init__(10)

        def get_config(self):
            return {}

    policy = Policy("mixed_float16", loss_scale=TenLossScale())
    config = policy.get_config()
    assert config["loss_scale"] == {"class_name": "TenLossScale", "config": {}}
    with pytest.raises(ValueError, match="TenLossScale"):
        Policy.from_config(config)
    restored = Policy.from_config(config, custom_objects={"TenLossScale": TenLossScale})
    assert type(restored.loss_scale) is TenLossScale and float(restored.loss_scale()) == 10.0


def test_from_config_takes_a_loss_scale_identifier():
    assert type(Policy.from_config({"name": "mixed_float16", "loss_scale": 4}).loss_scale) \
        is loss_scale_module.FixedLossScale


# "При десериализации объектов с экспериментальной политикой с помощью
# функций, таких как tf.keras.utils.deserialize_keras_object, политика будет
# десериализована как неэкспериментальная tf.keras.mixed_precision.Policy, а
# масштаб потерь будет безмолвно опущен."
def _policies_with_loss_scales():
    return [Policy("mixed_float16"), Policy("mixed_float16", loss_scale=64),
            Policy("mixed_float16", loss_scale=None), Policy("float32", loss_scale="dynamic"),
            Policy("mixed_bfloat16"), Policy("float64", loss_scale=None)]


def _assert_silently(fn, caplog):
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING):
            result = fn()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    return result


def test_generic_deserialization_gives_plain_policy(caplog):
    for policy in _policies_with_loss_scales():
        oracle = keras.saving.serialize_keras_object(keras.DTypePolicy(policy.name))
        serialized = keras.saving.serialize_keras_object(policy)
        # What Keras writes is exactly what it writes for the plain policy.
        assert serialized == oracle
        for deserialize in (keras.saving.deserialize_keras_object,
                            keras.utils.deserialize_keras_object,
                            keras.dtype_policies.deserialize,
                            keras.dtype_policies.get):
            restored = _assert_silently(lambda: deserialize(serialized), caplog)
            assert type(restored) is keras.DTypePolicy
            assert restored == keras.DTypePolicy(policy.name)
            assert not hasattr(restored, "loss_scale")
        restored = keras.dtype_policies.deserialize(keras.dtype_policies.serialize(policy))
        assert type(restored) is keras.DTypePolicy and restored.name == policy.name


def test_layer_config_round_trip_gives_plain_policy(caplog):
    for policy in _policies_with_loss_scales():
        layer = keras.layers.Dense(3, dtype=policy)
        oracle = keras.layers.Dense(3, dtype=policy.name).get_config()["dtype"]
        assert layer.get_config()["dtype"] == oracle
        clone = _assert_silently(lambda: keras.layers.Dense.from_config(layer.get_config()),
                                 caplog)
        assert type(clone.dtype_policy) is keras.DTypePolicy
        assert clone.dtype_policy.name == policy.name


def test_model_json_round_trip_gives_plain_policies():
    keras.mixed_precision.set_global_policy(Policy("mixed_float16", loss_scale=8))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(2, dtype=Policy("float32", loss_scale=None))])
    keras.mixed_precision.set_global_policy("float32")
    clone = keras.models.model_from_json(model.to_json())
    assert [type(layer.dtype_policy) for layer in clone.layers] == [keras.DTypePolicy] * 2
    assert [layer.dtype_policy.name for layer in clone.layers] == ["mixed_float16", "float32"]


# "It is a keras.DTypePolicy: layers accept it" (SPEC §4), and the
# `compute_dtype` / `variable_dtype` attribute texts: layers compute and
# output in the compute dtype, create variables in the variable dtype and
# cast them; regularizers run in the variable dtype.
def test_layer_computes_as_with_the_plain_policy():
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    ours = keras.layers.Dense(3, dtype=Policy("mixed_float16", loss_scale=4096),
                              kernel_regularizer=keras.regularizers.L2(0.1))
    plain = keras.layers.Dense(3, dtype="mixed_float16",
                               kernel_regularizer=keras.regularizers.L2(0.1))
    ours.build((None, 4))
    plain.build((None, 4))
    plain.set_weights(ours.get_weights())
    assert ours.kernel.dtype == "float32" and ours.compute_dtype == "float16"
    y_ours, y_plain = ours(x), plain(x)
    assert y_ours.dtype == y_plain.dtype == tf.float16
    np.testing.assert_array_equal(y_ours.numpy(), y_plain.numpy())
    assert ours.losses[0].dtype == plain.losses[0].dtype == tf.float32
    assert float(ours.losses[0]) == float(plain.losses[0])


# `compute_dtype`: "слой tf.keras.layers.Dense ... с типом данных вычислений
# float16 передаст входы float16 в tf.linalg.matmul" -- the kernel cast too.
def test_dense_matmul_gets_compute_dtype_inputs():
    def matmul_input_dtypes(policy):
        layer = keras.layers.Dense(3, dtype=policy)
        layer.build((None, 4))
        graph = tf.function(layer).get_concrete_function(
            tf.TensorSpec((None, 4), tf.float32)).graph
        return [[t.dtype for t in op.inputs] for op in graph.get_operations()
                if op.type in ("MatMul", "BatchMatMulV2")]

    ours = matmul_input_dtypes(Policy("mixed_float16", loss_scale=64))
    assert ours == matmul_input_dtypes("mixed_float16")
    assert ours == [[tf.float16, tf.float16]]


def test_global_policy_accepts_it():
    policy = Policy("mixed_float16", loss_scale=128)
    keras.mixed_precision.set_global_policy(policy)
    assert keras.mixed_precision.global_policy() is policy
    layer = keras.layers.Dense(2)
    assert layer.dtype_policy is policy
    assert layer(np.ones((1, 3), "float32")).dtype == tf.float16
    assert layer.kernel.dtype == "float32"


# "Только tf.keras.Model, а не слои, используют масштаб потерь, и он
# используется только во время Model.fit, Model.train_on_batch и других
# аналогичных методах."  Layers: same numbers, same variables and gradients
# as under the plain policy; the loss scale's own variables are nowhere in
# the layer or the model.  (The Model side is in test_keras_patch.py.)
def test_layers_never_use_the_loss_scale():
    x = np.random.default_rng(1).normal(size=(6, 4)).astype("float32")

    def build(policy):
        keras.utils.set_random_seed(3)
        keras.mixed_precision.set_global_policy(policy)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
                                 keras.layers.Dense(1)])

    policy = Policy("mixed_float16", loss_scale=loss_scale_module.DynamicLossScale(
        initial_loss_scale=8, increment_period=1))
    ours, plain = build(policy), build("mixed_float16")
    for a, b in zip(ours.weights, plain.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert ([(w.name, w.shape, w.dtype) for w in ours.weights]
            == [(w.name, w.shape, w.dtype) for w in plain.weights])

    def grads(model):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(x), tf.float32) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    for a, b in zip(grads(ours), grads(plain)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Running the layers did not touch the loss scale.
    assert float(policy.loss_scale()) == 8.0
    assert int(policy.loss_scale._num_good_steps) == 0  # pylint: disable=protected-access
