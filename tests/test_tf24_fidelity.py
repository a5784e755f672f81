"""TensorFlow 2.4 code runs unchanged on Keras 3: compile follows the
experimental policy, and the details TensorFlow 2.4's own tests pin down.

Oracles: TensorFlow's in-tree Keras 2 (``tensorflow.python.keras``, still
shipped with TensorFlow: its ``LossScaleOptimizerV1`` is TensorFlow 2.4's
``experimental.LossScaleOptimizer`` and its ``OptimizerV2`` optimizers TensorFlow
2.4's), stock Keras 3's ``compile``, ``patch_keras()`` (which compile must
now match without being asked), numpy and TensorFlow's own ops.
"""

import os
import pydoc
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.trainers.trainer import Trainer
from tensorflow.python.keras.mixed_precision import loss_scale_optimizer as tf24_lso
from tensorflow.python.keras.mixed_precision import policy as tf24_policy
from tensorflow.python.keras.optimizer_v2 import adam as tf24_adam
from tensorflow.python.keras.optimizer_v2 import gradient_descent as tf24_sgd

import lossscale
from lossscale import experimental as mixed_precision
from lossscale import keras_patch
from lossscale.optimizer import LossScaleOptimizer
from helpers import ROOT, child_env

STOCK_COMPILE = Trainer.__dict__["compile"]


@pytest.fixture(autouse=True)
def _clean_state(stock_keras_compile):
    assert stock_keras_compile is STOCK_COMPILE
    yield


def _model(dtype=None, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", dtype=dtype)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, dtype=dtype)(hidden))


def _data():
    rng = np.random.default_rng(3)
    return (rng.normal(size=(16, 4)).astype("float32"),
            rng.normal(size=(16, 1)).astype("float32"))


def _fit(model):
    x, y = _data()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    return [w.numpy() for w in model.weights]


# ----------------------------------------------------------------------
# Item 2: compile honours the experimental policy without a switch


def _patched_twin(policy):
    """The same model compiled under ``patch_keras()``: what compile must do."""
    lossscale.patch_keras()
    try:
        keras.mixed_precision.set_global_policy(policy)
        model = _model()
        model.compile(keras.optimizers.Adam(0.01, name="adam"), "mse")
        return model
    finally:
        lossscale.unpatch_keras()


@pytest.mark.parametrize("loss_scale, expected", [
    (128, lossscale.FixedLossScale), ("dynamic", lossscale.DynamicLossScale)])
def test_set_policy_makes_compile_wrap_as_patch_keras_does(loss_scale, expected):
    policy = mixed_precision.Policy("mixed_float16", loss_scale=loss_scale)
    twin = _patched_twin(policy)
    lossscale.unpatch_keras()
    mixed_precision.set_policy(policy)
    assert not keras_patch.is_keras_patched()
    model = _model()
    model.compile(keras.optimizers.Adam(0.01, name="adam"), "mse")
    assert type(model.optimizer) is type(twin.optimizer) is LossScaleOptimizer
    assert type(model.optimizer.loss_scale_object) is expected
    assert model.optimizer.get_config() == twin.optimizer.get_config()
    # A fresh copy, as patch_keras() makes, not the policy's own object.
    assert model.optimizer.loss_scale_object is not policy.loss_scale
    for ours, want in zip(_fit(model), _fit(twin)):
        np.testing.assert_array_equal(ours, want)


def test_set_policy_by_name_follows_tf24_default_dynamic_loss_scale():
    # TensorFlow 2.4: Policy("mixed_float16") has loss_scale "dynamic", and
    # compile wraps with it (the reference page of Policy).
    mixed_precision.set_policy("mixed_float16")
    model = _model()
    model.compile("sgd", "mse")
    assert type(model.optimizer) is LossScaleOptimizer
    scale = model.optimizer.loss_scale_object
    reference = tf.compat.v1.mixed_precision.DynamicLossScale()
    assert type(scale) is lossscale.DynamicLossScale
    assert (scale.initial_loss_scale, scale.increment_period, scale.multiplier) == (
        reference.initial_loss_scale, reference.increment_period, reference.multiplier)


def test_explicit_loss_scale_policy_set_through_keras_is_followed():
    # Not through set_policy: Keras's own setter, with our policy.
    keras.mixed_precision.set_global_policy(
        mixed_precision.Policy("mixed_float16", loss_scale=64))
    model = _model()
    model.compile("sgd", "mse")
    assert type(model.optimizer) is LossScaleOptimizer
    assert model.optimizer.loss_scale_object.get_config() == \
        tf.compat.v1.mixed_precision.FixedLossScale(64).get_config()


def test_set_policy_without_loss_scale_does_not_wrap():
    # TensorFlow 2.4 compile wrapped only when the policy had a loss scale.
    mixed_precision.set_policy(mixed_precision.Policy("mixed_float16", loss_scale=None))
    model = _model()
    model.compile("sgd", "mse")
    assert type(model.optimizer) is keras.optimizers.SGD


def test_other_policies_stay_with_stock_keras_while_the_hook_is_in():
    mixed_precision.Policy("mixed_float16", loss_scale=8)  # installs the hook
    assert Trainer.__dict__["compile"] is not STOCK_COMPILE
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _model()
    model.compile("sgd", "mse")
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    assert model.optimizer.get_config()["initial_scale"] == stock.get_config()["initial_scale"]
    # and Policy(..., loss_scale=None), never given to set_policy: stock too.
    keras.mixed_precision.set_global_policy(
        mixed_precision.Policy("mixed_float16", loss_scale=None))
    model = _model()
    model.compile("sgd", "mse")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer


def test_unpatch_keras_undoes_the_policy_hook():
    mixed_precision.set_policy(mixed_precision.Policy("mixed_float16", loss_scale=128))
    lossscale.unpatch_keras()
    assert Trainer.__dict__["compile"] is STOCK_COMPILE
    model = _model()
    model.compile("sgd", "mse")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    # patch_keras() after the hook: the full switch, undone by one unpatch.
    mixed_precision.set_policy(mixed_precision.Policy("mixed_float16", loss_scale=128))
    lossscale.patch_keras()
    assert keras_patch.is_keras_patched()
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _model()
    model.compile("sgd", "mse")
    assert type(model.optimizer) is LossScaleOptimizer
    lossscale.unpatch_keras()
    assert Trainer.__dict__["compile"] is STOCK_COMPILE and not keras_patch.is_keras_patched()


def _run_child(code, marker):
    """Runs ``code`` in a fresh interpreter; fails unless it prints ``marker``."""
    result = subprocess.run([sys.executable, "-c", code + f"\nprint({marker!r})\n"],
                            env=child_env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert marker in result.stdout, result.stderr[-3000:]


def _readme_migration_example():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    # The Keras 3 one; the tf_keras example sets TF_USE_LEGACY_KERAS first.
    found = [b for b in blocks if "from lossscale import experimental as mixed_precision" in b
             and "TF_USE_LEGACY_KERAS" not in b]
    assert len(found) == 1, "README: one example of the one-line migration"
    return found[0]


def test_readme_one_line_migration_runs_in_a_fresh_interpreter():
    code = _readme_migration_example()
    # The one changed line, and nothing that switches anything on.
    assert "patch_keras" not in code
    check = code + (
        "\nimport lossscale\n"
        "assert type(model.optimizer) is lossscale.LossScaleOptimizer, type(model.optimizer)\n"
        "assert model.optimizer.loss_scale_object.get_config() == "
        "{'loss_scale_value': 128.0}\n")
    _run_child(check, "MIGRATION-OK")
    # The same code with TensorFlow 2.4's import compiled with a loss-scale
    # optimizer of the policy's scale: tf.keras's in-tree Keras 2 is the oracle.
    policy = tf24_policy.PolicyV1("mixed_float16", loss_scale=128)
    assert policy.loss_scale.get_config() == {"loss_scale_value": 128.0}


# ----------------------------------------------------------------------
# Item 3: set_policy


def test_set_policy_none_resets_to_the_default():
    mixed_precision.set_policy("mixed_float16")
    mixed_precision.set_policy(None)
    tf24_policy.set_global_policy("mixed_float16")
    tf24_policy.set_global_policy(None)
    assert mixed_precision.global_policy().name == tf24_policy.global_policy().name == "float32"
    assert keras.layers.Dense(2).compute_dtype == "float32"


@pytest.mark.parametrize("name", ["int32", "bool"])
def test_set_policy_rejects_non_floating_policies_as_tf24(name):
    with pytest.raises(ValueError) as reference:
        tf24_policy.set_global_policy(name)
    before = keras.mixed_precision.global_policy()
    with pytest.raises(ValueError) as ours:
        mixed_precision.set_policy(name)
    assert keras.mixed_precision.global_policy() is before
    common = "can only be used to set the global policy to floating-point policies"
    assert common in str(reference.value) and common in str(ours.value)
    assert str(ours.value).endswith(f"but got policy: {name}")
    assert str(reference.value).endswith(f"but got policy: {name}")


# ----------------------------------------------------------------------
# Item 3: hyperparameters of the wrapped optimizer


def _pair(kind, **kwargs):
    """TensorFlow 2.4's experimental LossScaleOptimizer and ours, same inner."""
    tf24_inner = {"sgd": tf24_sgd.SGD, "adam": tf24_adam.Adam}[kind](**kwargs)
    ours_inner = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[kind](**kwargs)
    return (tf24_lso.LossScaleOptimizerV1(tf24_inner, loss_scale=128),
            mixed_precision.LossScaleOptimizer(ours_inner, loss_scale=128))


def _value(x):
    return float(x.numpy()) if hasattr(x, "numpy") else x


@pytest.mark.parametrize("kind, kwargs, names", [
    ("sgd", dict(learning_rate=0.25, momentum=0.5, clipnorm=2.0),
     ["learning_rate", "lr", "momentum", "clipnorm"]),
    ("adam", dict(learning_rate=0.125, beta_1=0.75, beta_2=0.875, clipvalue=1.5),
     ["learning_rate", "lr", "beta_1", "beta_2", "clipvalue"]),
])
def test_hyperparameters_read_and_write_through(kind, kwargs, names):
    ref, ours = _pair(kind, **kwargs)
    for name in names:
        assert _value(getattr(ours, name)) == pytest.approx(_value(getattr(ref, name))), name
        assert name in dir(ours) and name in dir(ref), name
    for i, name in enumerate(names):
        value = 0.0625 * (i + 1)
        setattr(ref, name, value)
        setattr(ours, name, value)
        target = "learning_rate" if name == "lr" else name
        assert _value(getattr(ours.inner_optimizer, target)) == pytest.approx(
            _value(getattr(ref._optimizer, target)))  # pylint: disable=protected-access
        assert _value(getattr(ours, name)) == pytest.approx(value)


def test_clipnorm_set_on_the_wrapper_changes_training_as_tf24():
    ref, ours = _pair("sgd", learning_rate=1.0, clipnorm=2.0)
    ref.clipnorm = ours.clipnorm = 0.5
    v_ref, v_ours = tf.Variable([0.0, 0.0]), tf.Variable([0.0, 0.0])
    grad = tf.constant([3.0, 4.0])
    ref.apply_gradients([(grad, v_ref)])
    ours.apply_gradients([(grad, v_ours)])
    np.testing.assert_allclose(v_ours.numpy(), v_ref.numpy(), rtol=1e-6)
    np.testing.assert_allclose(v_ours.numpy(), [-0.3, -0.4], rtol=1e-6)


def test_other_inner_attributes_are_not_exposed():
    ref, ours = _pair("sgd", learning_rate=0.1, momentum=0.9)
    for opt in (ref, ours):
        with pytest.raises(AttributeError):
            opt.nesterov  # pylint: disable=pointless-statement
    ref.nesterov = True
    ours.nesterov = True
    assert ref._optimizer.nesterov is False  # pylint: disable=protected-access
    assert ours.inner_optimizer.nesterov is False
    assert "nesterov" not in dir(mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()))


# ----------------------------------------------------------------------
# Item 3: iterations, weights, variables


def _step_both(ref, ours, grads=((0.5, -1.0), (0.25, 2.0))):
    v_ref, v_ours = tf.Variable([1.0, 2.0]), tf.Variable([1.0, 2.0])
    for g in grads:
        ref.apply_gradients([(tf.constant(g), v_ref)])
        ours.apply_gradients([(tf.constant(g), v_ours)])
    return v_ref, v_ours


def test_iterations_can_be_assigned():
    ref, ours = _pair("sgd", learning_rate=0.1)
    ref.iterations = tf.Variable(5, dtype=tf.int64)
    ours.iterations = tf.Variable(5, dtype=tf.int64)
    assert int(ours.iterations.numpy()) == int(ref.iterations.numpy()) == 5
    _step_both(ref, ours)
    assert int(ours.iterations.numpy()) == int(ref.iterations.numpy()) == 7
    ours.iterations = 3
    assert int(ours.inner_optimizer.iterations.numpy()) == 3
    with pytest.raises(TypeError, match="iterations must be an integer"):
        ours.iterations = 1.5


@pytest.mark.parametrize("kind, kwargs", [("sgd", dict(learning_rate=0.1, momentum=0.9)),
                                          ("adam", dict(learning_rate=0.01))])
def test_weights_get_set_and_variables_as_tf24(kind, kwargs):
    ref, ours = _pair(kind, **kwargs)
    v_ref, v_ours = _step_both(ref, ours)
    np.testing.assert_allclose(v_ours.numpy(), v_ref.numpy(), rtol=1e-4)
    assert len(ours.weights) == len(ref.weights)
    got, want = ours.get_weights(), ref.get_weights()
    assert [w.shape for w in got] == [w.shape for w in want]
    for a, b in zip(got, want):
        # Keras 3's Adam folds epsilon in differently: the same up to rounding.
        np.testing.assert_allclose(a, b, rtol=1e-4)
    assert len(ours.variables()) == len(ref.variables())
    assert len(ours.variables) == len(super(mixed_precision.LossScaleOptimizer, ours).variables)
    # TensorFlow 2.4's weights restore into ours, and ours into TensorFlow's.
    new = [w * 2 + 1 for w in want]
    ours.set_weights(new)
    for a, b in zip(ours.get_weights(), new):
        np.testing.assert_array_equal(a, b.astype(a.dtype))
    ref.set_weights(ours.get_weights())
    for a, b in zip(ref.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_set_weights_rejects_what_tf24_rejects():
    ref, ours = _pair("sgd", learning_rate=0.1, momentum=0.9)
    _step_both(ref, ours)
    for opt in (ref, ours):
        with pytest.raises(ValueError, match="weight list of length 1, but the optimizer was "
                                             "expecting 2 weights"):
            opt.set_weights(opt.get_weights()[:1])
        bad = opt.get_weights()
        bad[1] = np.zeros(3, np.float32)
        with pytest.raises(ValueError, match=r"Optimizer weight shape \(2,\) not compatible"):
            opt.set_weights(bad)


# ----------------------------------------------------------------------
# Item 3: TensorFlow 2.3/2.4 configs


def _train(opt, steps=6):
    var = tf.Variable([1.0, -2.0])
    for i in range(steps):
        opt.apply_gradients([(tf.constant([0.5, 0.25 * i]), var)])
    return var.numpy()


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_from_config_reads_tf24_experimental_configs(decay):
    inner = tf24_sgd.SGD(0.5, momentum=0.9, decay=decay)
    config = {  # what TensorFlow 2.4's experimental LossScaleOptimizer wrote
        "optimizer": {"class_name": "SGD", "config": inner.get_config()},
        "loss_scale": {"class_name": "FixedLossScale", "config": {"loss_scale_value": 64.0}},
    }
    ours = mixed_precision.LossScaleOptimizer.from_config(config)
    assert type(ours.inner_optimizer) is keras.optimizers.SGD
    assert ours.loss_scale_object.get_config() == {"loss_scale_value": 64.0}
    ref = tf24_lso.LossScaleOptimizerV1(tf24_sgd.SGD(0.5, momentum=0.9, decay=decay), 64)
    np.testing.assert_allclose(_train(ours), _train(ref), rtol=1e-6)


def test_from_config_reads_tf24_non_experimental_configs():
    ref = tf24_lso.LossScaleOptimizerV1(tf24_adam.Adam(0.01), loss_scale="dynamic")
    config = ref.get_config()  # {'inner_optimizer': {'class_name': 'Adam', ...}, 'dynamic'...}
    assert "module" not in config["inner_optimizer"]
    ours = mixed_precision.LossScaleOptimizer.from_config(config)
    assert type(ours.inner_optimizer) is keras.optimizers.Adam
    assert type(ours.loss_scale_object) is lossscale.DynamicLossScale
    np.testing.assert_allclose(_train(ours), _train(ref), rtol=1e-5)


def test_from_config_names_an_unknown_tf2_optimizer():
    config = {"optimizer": {"class_name": "NoSuchOpt", "config": {"learning_rate": 0.1}},
              "loss_scale": "dynamic"}
    with pytest.raises(ValueError, match="NoSuchOpt"):
        mixed_precision.LossScaleOptimizer.from_config(config)


# ----------------------------------------------------------------------
# Item 4: small things


def test_ops_and_core_are_attributes_after_import():
    code = ("import sys, lossscale\n"
            "assert lossscale.core.all_finite([])\n"
            "assert 'tensorflow' not in sys.modules, 'core pulled in TensorFlow'\n"
            "assert callable(lossscale.ops.unscale_and_check)\n")
    _run_child(code, "ATTR-OK")


def test_help_lists_the_public_classes():
    text = pydoc.render_doc(lossscale, renderer=pydoc.plaintext)
    for name in ("LossScale", "FixedLossScale", "DynamicLossScale", "Policy",
                 "LossScaleOptimizer", "LossScaleMonitor"):
        assert f"class {name}(" in text, name


def test_empty_checks_agree_with_numpy_and_the_tensorflow_op():
    want = bool(np.all([])) and bool(tf.reduce_all(tf.zeros([0], tf.bool)))
    assert lossscale.core.all_finite([]) is want
    assert lossscale.core.all_finite([np.zeros((2, 0), np.float16)]) is want
    assert bool(lossscale.ops.all_finite([tf.zeros([0])])) is want
    assert bool(lossscale.ops.all_finite([])) is want


@pytest.mark.parametrize("make", [
    lambda: mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=-5),
    lambda: LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=-5),
    lambda: mixed_precision.Policy("mixed_float16", loss_scale=-5),
    lambda: lossscale.get(-5),
])
def test_negative_loss_scale_names_the_argument(make):
    with pytest.raises(ValueError) as info:
        make()
    assert "loss_scale=-5" in str(info.value)
    # TensorFlow's own message is kept after it.
    with pytest.raises(ValueError) as reference:
        tf.compat.v1.mixed_precision.FixedLossScale(-5)
    assert str(reference.value) in str(info.value)


def test_unknown_identifier_lists_the_accepted_values():
    with pytest.raises(ValueError) as info:
        lossscale.get("Dynamic")
    message = str(info.value)
    assert "'Dynamic'" in message and "did you mean 'dynamic'" in message
    for accepted in ("'dynamic'", "int or float", "LossScale", "None", "serialize"):
        assert accepted in message, accepted
    assert lossscale.get("dynamic").get_config() == \
        tf.compat.v1.mixed_precision.DynamicLossScale().get_config()


def test_hook_module_is_documented_and_is_keras_patched_means_patch_keras():
    mixed_precision.set_policy("mixed_float16")
    assert not keras_patch.is_keras_patched()
    assert Trainer.__dict__["compile"] is not STOCK_COMPILE


# ----------------------------------------------------------------------
# Item 3: checkpoints of the bare optimizer and of the wrapper


def _trained_sgd(opt, var, steps=2):
    for _ in range(steps):
        opt.apply_gradients([(tf.constant([1.0, 3.0]), var)])


def _tf24_layout(tmp_path):
    """Names TensorFlow 2.4's experimental optimizer writes (in-tree Keras 2):
    the wrapped optimizer's, plus ``loss_scale/...``."""
    var = tf.Variable([1.0, 2.0])
    opt = tf24_lso.LossScaleOptimizerV1(tf24_sgd.SGD(0.1, momentum=0.9), "dynamic")
    _trained_sgd(opt, var)
    path = tf.train.Checkpoint(optimizer=opt, v=var).save(str(tmp_path / "tf24"))
    return {n for n, _ in tf.train.list_variables(path) if n.startswith("optimizer/loss_scale")}


@pytest.mark.parametrize("build_first", [True, False])
def test_bare_optimizer_checkpoint_restores_into_the_wrapper(tmp_path, build_first):
    var = tf.Variable([1.0, 2.0])
    bare = keras.optimizers.SGD(0.1, momentum=0.9)
    _trained_sgd(bare, var)
    path = tf.train.Checkpoint(optimizer=bare, v=var).save(str(tmp_path / "bare"))
    target = tf.Variable([0.0, 0.0])
    ours = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), 64)
    if build_first:
        ours.build([target])
    tf.train.Checkpoint(optimizer=ours, v=target).restore(path)
    if not build_first:
        ours.build([target])
    assert int(ours.iterations.numpy()) == int(bare.iterations.numpy()) == 2
    np.testing.assert_array_equal(ours.inner_optimizer.momentums[0].numpy(),
                                  bare.momentums[0].numpy())
    np.testing.assert_array_equal(target.numpy(), var.numpy())
    assert float(ours.loss_scale) == 64.0


def test_wrapper_checkpoint_restores_into_the_bare_optimizer_and_back(tmp_path):
    var = tf.Variable([1.0, 2.0])
    ours = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), "dynamic")
    _trained_sgd(ours, var, steps=3)
    ours.loss_scale_object.good_steps.assign(7)
    path = tf.train.Checkpoint(optimizer=ours, v=var).save(str(tmp_path / "ours"))
    names = {n for n, _ in tf.train.list_variables(path)}
    assert {n for n in names if n.startswith("optimizer/loss_scale")} == _tf24_layout(tmp_path)
    bare_var = tf.Variable([0.0, 0.0])
    bare = keras.optimizers.SGD(0.1, momentum=0.9)
    bare.build([bare_var])
    tf.train.Checkpoint(optimizer=bare, v=bare_var).restore(path)
    assert int(bare.iterations.numpy()) == int(ours.iterations.numpy()) == 3
    np.testing.assert_array_equal(bare.momentums[0].numpy(),
                                  ours.inner_optimizer.momentums[0].numpy())
    again_var = tf.Variable([0.0, 0.0])
    again = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                               "dynamic")
    tf.train.Checkpoint(optimizer=again, v=again_var).restore(path)
    again.build([again_var])
    assert int(again.iterations.numpy()) == 3
    assert int(again.loss_scale_object.good_steps.numpy()) == 7
    np.testing.assert_array_equal(again.inner_optimizer.momentums[0].numpy(),
                                  ours.inner_optimizer.momentums[0].numpy())
