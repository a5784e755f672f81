"""The tf_keras checks, run by ``test_tf_keras.py`` in a child pytest with
``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is then ``tf_keras``, as it must be
decided before TensorFlow is imported).

Every optimizer check trains twice from the same weights and data, once
with ``tf_keras``' own ``LossScaleOptimizer`` (the oracle) and once with
ours, and compares the weights, the loss scale, its counter and
``iterations`` bit for bit after every step.  The data make the float16
gradients overflow at the larger scales, so the runs back off, skip and
grow again.  The process starts with two logical CPUs, for the
``MirroredStrategy`` checks.
"""

import os

from helpers import assert_same_bits, batch_recorder, two_cpu_replicas

STRATEGY = two_cpu_replicas()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import lossscale  # noqa: E402
from lossscale import _compat, _tf_keras  # noqa: E402
from lossscale import experimental as mixed_precision  # noqa: E402

STOCK = tf_keras.mixed_precision.LossScaleOptimizer
GROWTH = 2
STEPS = 12
BATCH = 8


@pytest.fixture(autouse=True)
def _reset():
    yield
    lossscale.unpatch_keras()
    tf_keras.mixed_precision.set_global_policy("float32")


def _data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    # Large targets: at 2**15 the float16 gradients overflow; at smaller
    # scales they do not, so the scale moves both ways.
    y = (rng.normal(size=(STEPS * BATCH, 1)) * 40).astype("float32")
    return x, y


def _model():
    tf_keras.utils.set_random_seed(3)
    model = tf_keras.Sequential([
        tf_keras.layers.Dense(16, activation="relu", dtype="mixed_float16"),
        tf_keras.layers.Dense(1, dtype="float32")])
    model.build((None, 4))
    return model


def _inner(kind):
    return {"adam": tf_keras.optimizers.Adam(1e-2),
            "sgd": tf_keras.optimizers.SGD(1e-3, momentum=0.9),
            "legacy_adam": tf_keras.optimizers.legacy.Adam(1e-2),
            "legacy_sgd": tf_keras.optimizers.legacy.SGD(1e-3, momentum=0.9)}[kind]


def _state(model, opt):
    return [np.asarray(v.numpy()) for v in
            model.weights + [opt.loss_scale, opt.dynamic_counter, opt.iterations]]


def _assert_same_states(got, want):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            assert_same_bits(a, b, f"step {step}, state {i}")


def _assert_native(opt):
    assert isinstance(opt, STOCK) and isinstance(opt, lossscale.LossScaleOptimizer)
    assert type(opt._loss_scale) is _tf_keras._NativeDynamicLossScaleState  # pylint: disable=protected-access


# ----------------------------------------------------------- detection

def test_tf_keras_is_the_keras_in_use():
    assert tf.keras.layers.Dense is tf_keras.layers.Dense
    assert lossscale.Policy is _tf_keras.Policy is mixed_precision.Policy
    assert lossscale.LossScaleOptimizer is _tf_keras.LossScaleOptimizer


# -------------------------------------------------------------- policy

def test_set_policy_sets_tf_keras_global_policy():
    mixed_precision.set_policy(mixed_precision.Policy("mixed_float16", loss_scale="dynamic"))
    assert tf.keras.mixed_precision.global_policy().name == "mixed_float16"
    assert mixed_precision.global_policy() is tf.keras.mixed_precision.global_policy()
    layer = tf.keras.layers.Dense(4)
    assert (layer.compute_dtype, layer.variable_dtype) == ("float16", "float32")
    mixed_precision.set_policy("float32")
    assert tf.keras.layers.Dense(4).compute_dtype == "float32"


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16", "float32", "float64"])
def test_layers_accept_the_policy(name):
    ours = tf.keras.layers.Dense(4, dtype=lossscale.Policy(name))
    stock = tf.keras.layers.Dense(4, dtype=tf_keras.mixed_precision.Policy(name))
    assert isinstance(ours.dtype_policy, tf_keras.mixed_precision.Policy)
    assert (ours.compute_dtype, ours.variable_dtype) == (stock.compute_dtype,
                                                          stock.variable_dtype)
    assert mixed_precision.get_layer_policy(ours).name == name


def test_policy_loss_scale_and_config_round_trip():
    policy = lossscale.Policy("mixed_float16", loss_scale=128)
    assert float(policy.loss_scale()) == 128.0
    assert lossscale.Policy("mixed_float16").loss_scale is not None
    assert lossscale.Policy("float32").loss_scale is None
    again = lossscale.Policy.from_config(policy.get_config())
    assert again == policy and float(again.loss_scale()) == 128.0
    # tf_keras reads a model holding it back, as its own Policy.
    model = tf.keras.Sequential([tf.keras.layers.Dense(2, dtype=policy)])
    model.build((None, 3))
    loaded = tf.keras.Sequential.from_config(model.get_config())
    assert type(loaded.layers[0].dtype_policy) is tf_keras.mixed_precision.Policy
    assert loaded.layers[0].dtype_policy.name == "mixed_float16"


def test_set_policy_with_a_keras3_policy_warns():
    import keras  # pylint: disable=import-outside-toplevel

    try:
        with pytest.warns(UserWarning, match="tf_keras"):
            mixed_precision.set_policy(keras.DTypePolicy("float32"))
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ----------------------------------------------------------- optimizer

@pytest.mark.parametrize("kind", ["adam", "legacy_adam"])
@pytest.mark.parametrize("loss_scale, dynamic, initial, growth", [
    ("dynamic", True, 2**15, 2000), (128, False, 128, None),
    (lossscale.DynamicLossScale(4, 3), True, 4, 3), (lossscale.FixedLossScale(8), False, 8, None)])
def test_experimental_optimizer_takes_tf_keras_optimizers(kind, loss_scale, dynamic, initial,
                                                          growth):
    opt = mixed_precision.LossScaleOptimizer(_inner(kind), loss_scale)
    assert isinstance(opt, STOCK)
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (dynamic, initial, growth)
    assert float(opt.loss_scale) == initial


def test_tf_keras_rule_only():
    with pytest.raises(ValueError, match="tf_keras.*multiplier"):
        mixed_precision.LossScaleOptimizer(_inner("adam"), lossscale.DynamicLossScale(
            4, 3, multiplier=3))
    with pytest.raises(ValueError, match="tf_keras.*hysteresis"):
        mixed_precision.LossScaleOptimizer(_inner("adam"), lossscale.DynamicLossScale(
            hysteresis=2))
    import keras  # pylint: disable=import-outside-toplevel

    with pytest.raises(TypeError, match="tf_keras.*Keras 3 optimizer"):
        lossscale.LossScaleOptimizer(keras.optimizers.Adam())


def _custom_loop(opt, model, x, y, use_function):
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))

    if use_function:
        step = tf.function(step)
    states = []
    for i in range(STEPS):
        step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
        states.append(_state(model, opt))
    return states


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("kind", ["adam", "sgd", "legacy_adam", "legacy_sgd"])
def test_custom_loop_bit_identical(kind, use_function):
    x, y = _data()
    runs = []
    for cls in (STOCK, lossscale.LossScaleOptimizer):
        opt = cls(_inner(kind), dynamic_growth_steps=GROWTH)
        runs.append(_custom_loop(opt, _model(), x, y, use_function))
    _assert_native(opt)
    scales = [float(s[-3]) for s in runs[0]]
    assert min(scales) < 2**15 and len(set(scales)) > 2, "the run neither backed off nor grew"
    _assert_same_states(runs[1], runs[0])


def test_native_ops_do_the_work(monkeypatch):
    from lossscale import ops  # pylint: disable=import-outside-toplevel

    assert ops.native_available(), "the native op library did not load"
    calls = {"unscale_and_check": 0, "all_finite": 0, "update_loss_scale": 0}
    for name in calls:
        def spy(*args, _name=name, _original=getattr(ops, name), **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(ops, name, spy)
    x, y = _data()
    for kind in ("adam", "legacy_adam"):
        opt = lossscale.LossScaleOptimizer(_inner(kind), dynamic_growth_steps=GROWTH)
        _custom_loop(opt, _model(), x, y, use_function=False)
    assert calls == dict.fromkeys(calls, 2 * STEPS)


def _fit(opt, x, y, strategy=None, epochs=1, jit_compile=None):
    scope = strategy.scope() if strategy is not None else tf.name_scope("fit")
    with scope:
        model = _model()
        model.compile(opt() if callable(opt) else opt, "mse", jit_compile=jit_compile)
    recorder = batch_recorder(tf_keras.callbacks, _state)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[recorder])
    return model, recorder.states


@pytest.mark.parametrize("kind, jit_compile", [("adam", None), ("legacy_sgd", None),
                                               ("adam", True)])
def test_fit_bit_identical(kind, jit_compile):
    # jit_compile: XLA has no kernel for the native ops, which then run as
    # TensorFlow ops, still bit for bit.
    x, y = _data()
    _, want = _fit(lambda: STOCK(_inner(kind), dynamic_growth_steps=GROWTH), x, y, epochs=2,
                   jit_compile=jit_compile)
    model, got = _fit(lambda: lossscale.LossScaleOptimizer(_inner(kind),
                                                           dynamic_growth_steps=GROWTH),
                      x, y, epochs=2, jit_compile=jit_compile)
    _assert_native(model.optimizer)
    _assert_same_states(got, want)


@pytest.mark.parametrize("kind", ["adam", "legacy_adam"])
def test_mirrored_strategy_bit_identical(kind):
    x, y = _data()
    _, want = _fit(lambda: STOCK(_inner(kind), dynamic_growth_steps=GROWTH), x, y, STRATEGY)
    model, got = _fit(lambda: lossscale.LossScaleOptimizer(_inner(kind),
                                                           dynamic_growth_steps=GROWTH),
                      x, y, STRATEGY)
    _assert_native(model.optimizer)
    assert len(got) == STEPS
    _assert_same_states(got, want)


@pytest.mark.parametrize("kind, fmt", [("adam", "tf"), ("adam", "keras"), ("adam", "h5"),
                                       ("legacy_adam", "tf"), ("legacy_adam", "h5")])
def test_save_load_then_train_bit_identical(kind, fmt, tmp_path):
    x, y = _data()
    runs = []
    for name, cls in (("stock", STOCK), ("ours", lossscale.LossScaleOptimizer)):
        model, _ = _fit(lambda: cls(_inner(kind), dynamic_growth_steps=GROWTH), x, y)
        path = str(tmp_path / name) + {"tf": "", "keras": ".keras", "h5": ".h5"}[fmt]
        model.save(path, save_format=fmt)
        loaded = tf_keras.models.load_model(path)
        assert type(loaded.optimizer) is type(model.optimizer)  # pylint: disable=unidiomatic-typecheck
        recorder = batch_recorder(tf_keras.callbacks, _state)
        loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                   callbacks=[recorder])
        runs.append(recorder.states)
    _assert_native(loaded.optimizer)
    _assert_same_states(runs[1], runs[0])


def test_checkpoint_layout_is_tf_keras():
    # The same names and values: a checkpoint of either restores into the other.
    stock, ours = STOCK(_inner("adam")), lossscale.LossScaleOptimizer(_inner("adam"))
    keys = []
    for opt in (stock, ours):
        var = tf.Variable([1.0, 2.0])
        opt.apply_gradients([(tf.constant([0.5, 0.5]), var)])
        path = tf.train.Checkpoint(optimizer=opt, var=var).save(os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"lossscale-tfk-{os.getpid()}-{len(keys)}"))
        keys.append(sorted(name for name, _ in tf.train.list_variables(path)))
    assert keys[0] == keys[1]


# ----------------------------------------------------------- compile

def _compiled(policy, optimizer="adam"):
    tf_keras.mixed_precision.set_global_policy(policy)
    try:
        model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    model.compile(optimizer, "mse")
    return model.optimizer


def test_compile_honours_the_policys_loss_scale():
    mixed_precision.set_policy(mixed_precision.Policy("mixed_float16", loss_scale=128))
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.compile("adam", "mse")
    opt = model.optimizer
    assert isinstance(opt, lossscale.LossScaleOptimizer)
    assert (opt.dynamic, float(opt.loss_scale)) == (False, 128.0)
    opt = _compiled(lossscale.Policy("mixed_float16", loss_scale=lossscale.DynamicLossScale(
        16, 5)))
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 16, 5)
    assert type(_compiled(lossscale.Policy("mixed_float16", loss_scale=None))) is \
        tf_keras.optimizers.Adam
    # A plain mixed_float16 policy: tf_keras' own wrapping, until patch_keras().
    assert type(_compiled("mixed_float16")) is _compat.tf_keras_loss_scale_optimizer_module(
    ).LossScaleOptimizerV3


def _keras3_compile():
    return _compat.trainer_class().__dict__["compile"]


def test_tf_keras_policies_leave_keras3_compile_alone():
    # TensorFlow 2.4's ways of asking compile to follow a loss scale, under
    # tf_keras, patch tf_keras' compile and never Keras 3's.
    import keras  # pylint: disable=import-outside-toplevel

    stock = _keras3_compile()
    model_class, name = _compat.tf_keras_optimizer_wrapping_method()
    tf_keras_stock = model_class.__dict__[name]
    for policy in (lossscale.Policy("mixed_float16"), lossscale.Policy("float32", loss_scale=None),
                   mixed_precision.Policy("mixed_float16", loss_scale=128),
                   lossscale.Policy("mixed_float16", loss_scale="dynamic")):
        assert isinstance(policy, tf_keras.mixed_precision.Policy)
        assert _keras3_compile() is stock
    mixed_precision.set_policy("mixed_float16")
    assert _keras3_compile() is stock
    hooked = model_class.__dict__[name]
    assert hooked is not tf_keras_stock
    # Asking again installs nothing more.
    mixed_precision.Policy("mixed_float16", loss_scale=64)
    mixed_precision.set_policy(mixed_precision.Policy("mixed_float16", loss_scale=8))
    assert model_class.__dict__[name] is hooked
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.compile("adam", "mse")
    assert isinstance(model.optimizer, lossscale.LossScaleOptimizer)
    assert float(model.optimizer.loss_scale) == 8.0
    # A Keras 3 model beside it compiles as stock Keras 3.
    keras3 = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    keras3.compile(keras.optimizers.SGD(), "mse")
    assert type(keras3.optimizer) is keras.optimizers.SGD
    assert _keras3_compile() is stock
    lossscale.unpatch_keras()
    assert model_class.__dict__[name] is tf_keras_stock


def test_patch_keras_hooks_tf_keras_compile():
    model_class = _compat.tf_keras_model_class()
    original = model_class.__dict__["_get_optimizer"]
    lossscale.patch_keras()
    opt = _compiled("mixed_float16")
    _assert_native(opt)
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 2**15, 2000)
    legacy = _compiled("mixed_float16", tf_keras.optimizers.legacy.SGD())
    assert isinstance(legacy, _tf_keras.LegacyLossScaleOptimizer)
    assert type(_compiled("float32")) is tf_keras.optimizers.Adam
    lossscale.unpatch_keras()
    assert model_class.__dict__["_get_optimizer"] is original
    assert not isinstance(_compiled("mixed_float16"), lossscale.LossScaleOptimizer)


# ----------------------------------------------------------- callback

@pytest.mark.parametrize("ours", [False, True], ids=["stock", "ours"])
def test_loss_scale_monitor_in_tf_keras_fit(ours):
    x, y = _data()
    seen = []

    class Oracle(tf_keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.before = [v.numpy() for v in self.model.trainable_weights]

        def on_train_batch_end(self, batch, logs=None):
            after = [v.numpy() for v in self.model.trainable_weights]
            skipped = all(np.array_equal(a, b) for a, b in zip(self.before, after))
            seen.append((float(self.model.optimizer.loss_scale), skipped))

    model = _model()
    model.compile((lossscale.LossScaleOptimizer if ours else STOCK)(
        _inner("sgd"), dynamic_growth_steps=GROWTH), "mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[lossscale.LossScaleMonitor(), Oracle()])
    assert history.history["loss_scale"] == [seen[STEPS - 1][0], seen[-1][0]]
    want = [sum(s for _, s in seen[:STEPS]), sum(s for _, s in seen)]
    assert want[1] > 0
    assert history.history["skipped_steps"] == want


# ------------------------------------------------------------- README

def test_readme_keras_versions_example():
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "README.md"), encoding="utf-8") as f:
        section = f.read().split("### Keras versions", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
    model = namespace["model"]
    assert isinstance(model.optimizer, _tf_keras.LegacyLossScaleOptimizer)
    assert model.layers[0].compute_dtype == "float16"
