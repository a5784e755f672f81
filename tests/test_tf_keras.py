"""Legacy Keras (``tf_keras``) as a first-class Keras.

``tf.keras`` resolves to ``tf_keras`` only when ``TF_USE_LEGACY_KERAS`` is
set before TensorFlow is imported, so the checks live in case files, each run
in one child pytest with that variable set: ``tf_keras_cases.py`` (ours
against ``tf_keras``' own ``LossScaleOptimizer`` and policies, the fused step
included, bit for bit), ``tf_keras_lso_cases.py`` (``tf_keras``' own
loss-scale optimizer tests, ported as checks of ours),
``tf_keras_loop_cases.py`` (TensorFlow 2.4's custom loop in a
``tf.function``) and ``tf_keras_mirrored_cases.py`` (the fused step under
``MirroredStrategy``, every copy of every variable).  Each test here
reports one check function of one file (all its parameters).  The tests
below the children's run here, under Keras 3: ``tf_keras`` objects passed in
choose ``tf_keras`` by themselves.
"""

import os

import numpy as np
import pytest

from helpers import TESTS, assert_child_case_passed, case_names, child_pytest

tf_keras = pytest.importorskip("tf_keras")

CASE_FILES = ("tf_keras_cases.py", "tf_keras_lso_cases.py", "tf_keras_loop_cases.py",
              "tf_keras_clip_cases.py", "tf_keras_mirrored_cases.py",
              "tf_keras_sparse_ema_cases.py", "tf_keras_legacy_sparse_cases.py")


def _under_tf_keras(cases):
    """A class for one case file: its child pytest runs once, when a test
    first asks for it, and each check of the file is one test here.  A class
    is one unit of ``make test``'s scheduling (``--dist loadscope``), so the
    children run side by side on as many workers as there are."""

    class CaseFile:
        @pytest.fixture(scope="class")
        def results(self, tmp_path_factory):
            report = tmp_path_factory.mktemp(cases.split(".")[0]) / "report.xml"
            return child_pytest(os.path.join(TESTS, cases), str(report), TF_USE_LEGACY_KERAS="1")

        @pytest.mark.parametrize("name", case_names(os.path.join(TESTS, cases)))
        def test_under_tf_keras(self, results, name):
            assert_child_case_passed(results, name)

    name = "Test" + "".join(part.title() for part in cases[:-len(".py")].split("_"))
    CaseFile.__name__ = CaseFile.__qualname__ = name
    return name, CaseFile


globals().update(_under_tf_keras(cases) for cases in CASE_FILES)


# Under Keras 3 (no TF_USE_LEGACY_KERAS): the objects decide.

def test_experimental_optimizer_takes_a_tf_keras_optimizer_under_keras3():
    from lossscale import experimental as mixed_precision  # pylint: disable=import-outside-toplevel

    opt = mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(), loss_scale=64)
    assert isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer)
    assert (opt.dynamic, float(opt.loss_scale)) == (False, 64.0)
    legacy = mixed_precision.LossScaleOptimizer(tf_keras.optimizers.legacy.SGD(), "dynamic")
    assert (legacy.dynamic, legacy.initial_scale, legacy.dynamic_growth_steps) == (
        True, 2**15, 2000)


def test_set_policy_with_a_tf_keras_policy_under_keras3():
    import keras  # pylint: disable=import-outside-toplevel
    from lossscale import experimental as mixed_precision  # pylint: disable=import-outside-toplevel

    try:
        mixed_precision.set_policy(tf_keras.mixed_precision.Policy("mixed_float16"))
        assert tf_keras.mixed_precision.global_policy().name == "mixed_float16"
        assert tf_keras.layers.Dense(2).compute_dtype == "float16"
        assert keras.mixed_precision.global_policy().name == "float32"
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
        from lossscale import keras_patch  # pylint: disable=import-outside-toplevel

        keras_patch.unpatch_keras()


def test_tf_keras_unscale_is_tf_keras_multiply():
    # The unscaling alone, on values that round differently when divided.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from lossscale import _tf_keras  # pylint: disable=import-outside-toplevel
    from helpers import assert_same_bits  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=257).astype(dtype) * 1000)
             for dtype in ("float16", "float32", "float64")]
    for initial in (3.0, 2**15, 1e-3):
        ours = _tf_keras.LossScaleOptimizer(tf_keras.optimizers.SGD(), dynamic=False,
                                            initial_scale=initial)
        stock = tf_keras.mixed_precision.LossScaleOptimizer(
            tf_keras.optimizers.SGD(), dynamic=False, initial_scale=initial)
        unscaled = ours.get_unscaled_gradients(grads + [None])
        assert unscaled[-1] is None
        for got, want in zip(unscaled, stock.get_unscaled_gradients(grads)):
            assert_same_bits(got.numpy(), want.numpy(), f"scale {initial}")


def test_a_tf_keras_policy_under_keras3_patches_only_tf_keras(stock_keras_compile):
    from lossscale import _compat, _tf_keras  # pylint: disable=import-outside-toplevel

    trainer = _compat.trainer_class()
    model_class, name = _compat.tf_keras_optimizer_wrapping_method()
    tf_keras_stock = model_class.__dict__[name]
    try:
        _tf_keras.Policy("mixed_float16")
        assert model_class.__dict__[name] is tf_keras_stock
        _tf_keras.Policy("mixed_float16", loss_scale=128)
        assert trainer.__dict__["compile"] is stock_keras_compile
        assert model_class.__dict__[name] is not tf_keras_stock
    finally:
        import lossscale  # pylint: disable=import-outside-toplevel

        lossscale.unpatch_keras()
    assert model_class.__dict__[name] is tf_keras_stock


# The private tf_keras names of lossscale._compat's last section, checked
# against the installed tf_keras (each failure names the one that moved).

def test_compat_tf_keras_optimizer_wrapping_method():
    from lossscale import _compat  # pylint: disable=import-outside-toplevel

    owner, name = _compat.tf_keras_optimizer_wrapping_method()
    assert issubclass(tf_keras.Model, owner) and callable(owner.__dict__.get(name)), (
        "tf_keras_optimizer_wrapping_method: tf_keras' Model no longer defines _get_optimizer")


def test_compat_tf_keras_dynamic_state_and_unscaled_flag():
    from lossscale import _compat  # pylint: disable=import-outside-toplevel

    state_class = _compat.tf_keras_dynamic_loss_scale_state_class()
    stock = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD())
    assert type(stock._loss_scale) is state_class, (  # pylint: disable=protected-access
        "tf_keras_dynamic_loss_scale_state_class: tf_keras' dynamic LossScaleOptimizer no "
        "longer keeps a _DynamicLossScaleState in _loss_scale")

    class Marked(state_class):
        pass

    variables = list(stock.variables)
    _compat.tf_keras_update_dynamic_state_with(stock, Marked)
    assert type(stock._loss_scale) is Marked  # pylint: disable=protected-access
    assert list(stock.variables) == variables and float(stock.loss_scale) == 2**15
    fixed = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(),
                                                         dynamic=False, initial_scale=4)
    _compat.tf_keras_update_dynamic_state_with(fixed, Marked)
    assert not fixed.dynamic

    assert stock._gradients_have_been_unscaled is False, (  # pylint: disable=protected-access
        "tf_keras_note_gradients_unscaled: tf_keras' LossScaleOptimizer no longer keeps "
        "_gradients_have_been_unscaled")
    _compat.tf_keras_note_gradients_unscaled(stock)
    assert stock._gradients_have_been_unscaled is True  # pylint: disable=protected-access


def test_compat_tf_keras_batch_hooks():
    import lossscale  # pylint: disable=import-outside-toplevel

    # pylint: disable=protected-access
    callbacks = tf_keras.callbacks.CallbackList([lossscale.LossScaleMonitor()])
    assert (callbacks._should_call_train_batch_hooks, callbacks._should_call_test_batch_hooks,
            callbacks._should_call_predict_batch_hooks) == (True, False, False), (
        "TfKerasBatchHooks: tf_keras' CallbackList no longer asks "
        "_implements_*_batch_hooks")
