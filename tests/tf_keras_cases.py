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

from helpers import (assert_same_bits, batch_recorder, overflowing_batches,
                     tied_size_decay_case, two_cpu_replicas)

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


def _model(width=16, seed=3):
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential([
        tf_keras.layers.Dense(width, activation="relu", dtype="mixed_float16"),
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


def _apply_step(opt, model):
    """A custom loop's step: the scaled loss, the unscaled gradients, apply_gradients."""
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return step


def _minimize_step(opt, model):
    """TensorFlow 2.4's minimize(loss, var_list, tape=tape): the unscale fused
    into the step."""
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        opt.minimize(loss, model.trainable_variables, tape=tape)
    return step


def _custom_loop(opt, model, x, y, use_function, steps=STEPS, state=_state,
                 make_step=_apply_step):
    """``state(model, opt)`` after each of ``steps`` batches of ``make_step``'s step."""
    step = make_step(opt, model)
    if use_function:
        step = tf.function(step)
    states = []
    for i in range(steps):
        step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
        states.append(state(model, opt))
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
        # The stock path's ops (the fused step checks with all_finite_grouped).
        opt = lossscale.LossScaleOptimizer(_inner(kind), dynamic_growth_steps=GROWTH,
                                           fused=False)
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
    assert model.optimizer.step_path == {"adam": "fused (Adam)",
                                         "legacy_adam": "fused (Adam)"}[kind]
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


# ------------------------------------------------------- the fused step
# Every optimizer the fused step serves, against tf_keras' own
# LossScaleOptimizer around the same optimizer: every weight, slot and
# hyperparameter variable, the loss scale, its counter and iterations after
# every step, with overflow injected.


def _schedule():
    return tf_keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=3, decay_rate=0.9)


FUSED = {
    "legacy_sgd_momentum": (lambda: tf_keras.optimizers.legacy.SGD(1e-2, momentum=0.9), "SGD"),
    "legacy_sgd_nesterov_schedule": (lambda: tf_keras.optimizers.legacy.SGD(
        _schedule(), momentum=0.9, nesterov=True), "SGD"),
    "legacy_sgd_decay": (lambda: tf_keras.optimizers.legacy.SGD(1e-2, decay=0.01), "SGD"),
    "legacy_adam": (lambda: tf_keras.optimizers.legacy.Adam(1e-2), "Adam"),
    "legacy_adam_amsgrad_schedule": (lambda: tf_keras.optimizers.legacy.Adam(
        _schedule(), amsgrad=True), "Adam"),
    "legacy_rmsprop_momentum": (lambda: tf_keras.optimizers.legacy.RMSprop(1e-3, momentum=0.5),
                                "RMSprop"),
    "legacy_rmsprop_centered": (lambda: tf_keras.optimizers.legacy.RMSprop(1e-3, centered=True),
                                "RMSprop"),
    "legacy_rmsprop_centered_momentum": (lambda: tf_keras.optimizers.legacy.RMSprop(
        1e-3, momentum=0.5, centered=True), "RMSprop"),
    "legacy_adagrad": (lambda: tf_keras.optimizers.legacy.Adagrad(1e-2), "Adagrad"),
    "sgd": (lambda: tf_keras.optimizers.SGD(1e-2), "SGD"),
    "sgd_nesterov_decay": (lambda: tf_keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True,
                                                           weight_decay=0.01), "SGD"),
    "adam_schedule": (lambda: tf_keras.optimizers.Adam(_schedule()), "Adam"),
    "adamw_amsgrad": (lambda: tf_keras.optimizers.AdamW(1e-3, weight_decay=0.004, amsgrad=True),
                      "AdamW"),
    "adamw_schedule": (lambda: tf_keras.optimizers.AdamW(_schedule(), weight_decay=0.004),
                       "AdamW"),
    "rmsprop_centered_momentum": (lambda: tf_keras.optimizers.RMSprop(
        1e-3, momentum=0.5, centered=True), "RMSprop"),
    "rmsprop": (lambda: tf_keras.optimizers.RMSprop(1e-3), "RMSprop"),
    "rmsprop_momentum_decay": (lambda: tf_keras.optimizers.RMSprop(
        1e-3, momentum=0.9, weight_decay=0.004), "RMSprop"),
}
# Long runs, in a tf.function.
LONG = ("legacy_adam", "legacy_rmsprop_centered_momentum", "adamw_amsgrad")
FUSED_STEPS = 40
LONG_STEPS = 240


def _fused_data(steps):
    # Every ninth batch overflows float16 at any scale the run reaches.
    return overflowing_batches(steps, BATCH, seed=11, first=4, every=9, factor=3e3)


class _ScalarWeight(tf_keras.layers.Layer):
    """``x * s``, ``s`` a rank-0 weight."""

    def build(self, input_shape):
        self.s = self.add_weight(name="s", shape=(),
                                 initializer=tf_keras.initializers.Constant(0.75))

    def call(self, inputs):
        return inputs * self.s


def _fused_model(kind=None):
    # Odd sizes (vector tails) and one-element variables; for tf_keras'
    # RMSprop, whose step TensorFlow's graph optimizer regroups for
    # variables of rank 1 or more alone, a rank-0 weight too.
    model = _model(width=37, seed=5)
    if kind is not None and kind.startswith("rmsprop"):
        model = tf_keras.Sequential(model.layers + [_ScalarWeight(dtype="float32")])
        model.build((None, 4))
    return model


def _inner_variables(opt):
    variables = opt.inner_optimizer.variables
    return list(variables() if callable(variables) else variables)


def _fused_state(model, opt):
    return [np.asarray(v.numpy()) for v in
            model.weights + _inner_variables(opt)
            + [opt.loss_scale, opt.dynamic_counter, opt.iterations]]


def fit_lockstep(make_model, make_optimizer, x, y, strategy=None):
    """One epoch of ``fit`` of a fresh ``make_model()`` compiled with stock's
    loss-scale optimizer, then with ours (``make_optimizer(cls)``, in
    ``strategy``'s scope where given): ours, the states after every batch
    (``_fused_state``) and after training, stock's first."""
    states, finals = [], []
    for cls in (STOCK, lossscale.LossScaleOptimizer):
        scope = strategy.scope() if strategy is not None else tf.name_scope("fit")
        with scope:
            model = make_model()
            model.compile(make_optimizer(cls), "mse")
        recorder = batch_recorder(tf_keras.callbacks, _fused_state)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[recorder])
        states.append(recorder.states)
        finals.append(_fused_state(model, model.optimizer))
    return model.optimizer, states, finals


def _expected_path(kind):
    return f"fused ({FUSED[kind][1]})"


def _assert_moved(states):
    scales = [float(s[-3]) for s in states]
    assert any(b < a for a, b in zip(scales, scales[1:])), "the run never backed off"
    assert any(b > a for a, b in zip(scales, scales[1:])), "the run never grew"
    iterations = [int(s[-1]) for s in states]
    assert iterations == list(range(1, len(states) + 1))


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("kind", sorted(FUSED))
def test_fused_custom_loop_bit_identical(kind, use_function):
    steps = LONG_STEPS if use_function and kind in LONG else FUSED_STEPS
    x, y = _fused_data(steps)
    runs = []
    for make in (lambda inner: STOCK(inner, initial_scale=2.0**10, dynamic_growth_steps=GROWTH),
                 lambda inner: lossscale.LossScaleOptimizer(inner, initial_scale=2.0**10,
                                                            dynamic_growth_steps=GROWTH)):
        opt = make(FUSED[kind][0]())
        runs.append(_custom_loop(opt, _fused_model(kind), x, y, use_function, steps,
                                 _fused_state))
    assert opt.step_path.startswith(_expected_path(kind)), opt.step_path
    _assert_moved(runs[0])
    _assert_same_states(runs[1], runs[0])


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("kind", ["legacy_sgd_momentum", "legacy_adam_amsgrad_schedule",
                                  "legacy_rmsprop_centered", "adamw_amsgrad", "rmsprop"])
def test_fused_minimize_bit_identical(kind, use_function):
    x, y = _fused_data(FUSED_STEPS)
    runs = []
    for cls in (STOCK, lossscale.LossScaleOptimizer):
        opt = cls(FUSED[kind][0](), initial_scale=2.0**10, dynamic_growth_steps=GROWTH)
        runs.append(_custom_loop(opt, _fused_model(kind), x, y, use_function, FUSED_STEPS,
                                 _fused_state, _minimize_step))
    assert opt.step_path.startswith(_expected_path(kind)), opt.step_path
    _assert_moved(runs[0])
    _assert_same_states(runs[1], runs[0])


def _scoped(scope):
    """``_apply_step``'s step, made under the name scope ``scope``."""
    def make_step(opt, model):
        step = _apply_step(opt, model)

        def scoped(xb, yb):
            with tf.name_scope(scope):
                step(xb, yb)
        return scoped
    return make_step


def test_fused_rmsprop_one_element_order_follows_the_graph():
    # TensorFlow's graph optimizer orders a one-element variable's
    # lr * g * rsqrt(d) by the names of its tensors, which the step's name
    # scope decides ("Apply" sorts before the "Func/" of an inlined cond's
    # input, "train" after): the stock runs differ, and each fused one
    # follows its own.
    x, y = _fused_data(FUSED_STEPS)
    want = {}
    for scope in ("Apply", "train"):
        runs = []
        for make in (STOCK, lossscale.LossScaleOptimizer):
            opt = make(FUSED["rmsprop"][0](), initial_scale=2.0**10, dynamic_growth_steps=GROWTH)
            runs.append(_custom_loop(opt, _fused_model("rmsprop"), x, y, True, FUSED_STEPS,
                                     _fused_state, _scoped(scope)))
        assert opt.step_path == _expected_path("rmsprop")
        _assert_same_states(runs[1], runs[0])
        want[scope] = runs[0]
    bias = 3  # the output layer's, of one element
    assert any(a[bias].tobytes() != b[bias].tobytes()
               for a, b in zip(want["Apply"], want["train"])), "the scopes ran one order"


@pytest.mark.parametrize("make_inner", [
    lambda: tf_keras.optimizers.AdamW(0.37, weight_decay=0.83),
    lambda: tf_keras.optimizers.SGD(0.37, momentum=0.5, weight_decay=0.83),
    lambda: tf_keras.optimizers.RMSprop(0.37, weight_decay=0.83),
], ids=["adamw", "sgd_momentum", "rmsprop"])
def test_fused_weight_decay_of_one_element_variables_in_a_graph(make_inner):
    # The graph optimizer regroups tf_keras' `var * wd * lr` by the factors'
    # sizes and, where they tie (one element), by their tensors' names, which
    # keep tf_keras' order as written: 30 variables of each of the shapes
    # (), (1,), (1, 1) and (3,), each name its own, against stock, with a
    # weight decay large enough that the grouping decides many last bits.
    shapes, start, steps = tied_size_decay_case()
    finals = []
    for make in (STOCK, lossscale.LossScaleOptimizer):
        variables = [tf.Variable(a) for a in start]
        opt = make(make_inner(), dynamic=False, initial_scale=1.0)
        apply = tf.function(lambda grads, opt=opt, variables=variables:
                            opt.apply_gradients(zip(grads, variables)))
        for grads in steps:
            apply(grads)
        finals.append([v.numpy() for v in variables])
    assert opt.step_path.startswith("fused"), opt.step_path
    bad = [f"variable {i} of shape {s}" for i, (s, a, b) in enumerate(zip(shapes, *finals))
           if a.tobytes() != b.tobytes()]
    assert not bad, bad


@pytest.mark.parametrize("kind", ["legacy_adam_amsgrad_schedule", "legacy_rmsprop_centered",
                                  "sgd_nesterov_decay", "adamw_schedule"])
def test_fused_experimental_optimizer_bit_identical(kind):
    # TensorFlow 2.4's LossScaleOptimizer(opt, "dynamic") around a tf_keras
    # optimizer is tf_keras' drop-in, on the fused step.
    x, y = _fused_data(FUSED_STEPS)
    want = _custom_loop(STOCK(FUSED[kind][0]()), _fused_model(), x, y, True, FUSED_STEPS,
                        _fused_state)
    opt = mixed_precision.LossScaleOptimizer(FUSED[kind][0](), loss_scale="dynamic")
    got = _custom_loop(opt, _fused_model(), x, y, True, FUSED_STEPS, _fused_state)
    assert opt.step_path == _expected_path(kind)
    _assert_same_states(got, want)


@pytest.mark.parametrize("kind", ["legacy_sgd_nesterov_schedule", "legacy_adam",
                                  "legacy_rmsprop_centered_momentum", "legacy_adagrad", "sgd",
                                  "adam_schedule", "adamw_amsgrad",
                                  "rmsprop_centered_momentum"])
def test_fused_fit_bit_identical(kind, monkeypatch):
    from lossscale import ops  # pylint: disable=import-outside-toplevel

    # fit's gradients reach the fused step scaled: no separate unscale op.
    unscale_calls = []
    monkeypatch.setattr(ops, "unscale_and_check",
                        lambda *a, _original=ops.unscale_and_check, **k: (
                            unscale_calls.append(1), _original(*a, **k))[1])
    x, y = _fused_data(FUSED_STEPS)
    states = []
    for make in (STOCK, lossscale.LossScaleOptimizer):
        model = _fused_model(kind)
        model.compile(make(FUSED[kind][0](), initial_scale=2.0**10, dynamic_growth_steps=GROWTH),
                      "mse")
        recorder = batch_recorder(tf_keras.callbacks, _fused_state)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[recorder])
        states.append(recorder.states)
    assert model.optimizer.step_path == _expected_path(kind)
    assert not unscale_calls
    _assert_moved(states[0])
    _assert_same_states(states[1], states[0])


def test_fused_step_paths():
    var = tf.Variable(tf.zeros([3]))
    grads = [(tf.ones([3]), var)]
    cases = [
        (tf_keras.optimizers.legacy.Adam(clipnorm=1.0), "fused (Adam)"),
        (tf_keras.optimizers.legacy.Adam(clipnorm=1.0, clipvalue=2.0), "fused (Adam)"),
        (tf_keras.optimizers.Adam(global_clipnorm=1.0), "fused (Adam)"),
        (tf_keras.optimizers.Adam(use_ema=True), "fused (Adam)"),
        (tf_keras.optimizers.legacy.Adamax(), "stock: the inner optimizer (Adamax) is not a "
         "stock tf_keras Adagrad, Adam, AdamW, RMSprop or SGD"),
    ]
    for inner, path in cases:
        opt = lossscale.LossScaleOptimizer(inner)
        opt.apply_gradients(grads)
        assert opt.step_path == path
    opt = lossscale.LossScaleOptimizer(tf_keras.optimizers.legacy.SGD(), fused=False)
    assert opt.step_path == "stock: fused=False"
    opt.apply_gradients(grads)
    assert opt.step_path == "stock: fused=False"
    assert opt.get_config()["fused"] is False

    class Custom(tf_keras.optimizers.legacy.SGD):
        def _resource_apply_dense(self, grad, var, apply_state=None):
            return super()._resource_apply_dense(grad, var, apply_state)

    opt = lossscale.LossScaleOptimizer(Custom())
    assert opt.step_path.startswith("stock: the inner optimizer (Custom) is not a stock")
    # A sparse gradient legacy SGD without momentum adds slice by slice:
    # fused, that one variable by its own ResourceScatterAdd.
    opt = lossscale.LossScaleOptimizer(tf_keras.optimizers.legacy.SGD())
    sparse = tf.IndexedSlices(tf.ones([1]), tf.constant([0]), tf.constant([3]))
    before = var.numpy().copy()
    opt.apply_gradients([(sparse, var)])
    assert opt.step_path == "fused (SGD)"
    np.testing.assert_array_equal(var.numpy(), before + np.array([-0.01, 0, 0], np.float32))


def test_fused_skipped_step_leaves_every_variable():
    for make in (lambda: tf_keras.optimizers.legacy.Adam(), lambda: tf_keras.optimizers.AdamW()):
        var = tf.Variable(np.arange(5, dtype=np.float32))
        opt = lossscale.LossScaleOptimizer(make())
        opt.apply_gradients([(tf.ones([5]), var)])
        before = [v.numpy().copy() for v in [var] + _inner_variables(opt)]
        opt.apply_gradients([(tf.constant([1.0, np.inf, 1.0, 1.0, 1.0]), var)])
        assert opt.step_path.startswith("fused")
        after = [v.numpy() for v in [var] + _inner_variables(opt)]
        # iterations advances on a skipped step, as in tf_keras; nothing else moves.
        assert int(opt.iterations.numpy()) == 2
        for b, a in zip(before[:1] + before[2:], after[:1] + after[2:]):
            assert_same_bits(a, b, "a skipped step moved a variable")


def test_fused_compat_names():
    # Each private tf_keras name the fused step reaches through _compat is
    # still there and means what it meant.
    var = tf.Variable(tf.ones([3]))
    other = tf.Variable(tf.ones([2]))
    adam = tf_keras.optimizers.Adam(_schedule(), amsgrad=True)
    adam.build([var])
    before = [s.numpy().copy() for s in _compat.tf_keras_optimizer_slots(adam, "m", [var])]
    adam.apply_gradients([(tf.ones([3]), var)])
    for kind in ("m", "v", "v_hat"):
        (slot,) = _compat.tf_keras_optimizer_slots(adam, kind, [var])
        assert slot.shape == var.shape and slot.name.startswith(kind.replace("_", ""))
    assert not np.array_equal(before[0], _compat.tf_keras_optimizer_slots(adam, "m", [var])[0])
    assert _compat.tf_keras_unknown_variable(adam, [var]) is None
    assert _compat.tf_keras_unknown_variable(adam, [var, other]) is other
    schedule, recorded = _compat.tf_keras_learning_rate_schedule(adam)
    assert schedule is adam._learning_rate and recorded is adam.learning_rate
    assert _compat.tf_keras_learning_rate_schedule(tf_keras.optimizers.SGD(0.1)) == (None, None)
    assert not _compat.tf_keras_uses_dtensor(adam)
    assert _compat.tf_keras_same_update_as(adam, tf_keras.optimizers.Adam)
    assert not _compat.tf_keras_same_update_as(adam, tf_keras.optimizers.AdamW)
    moved, kept = tf.Variable(tf.ones([3])), tf.Variable(tf.ones([2]))
    ema = tf_keras.optimizers.SGD(use_ema=True, ema_momentum=0.5)
    ema.build([moved, kept])
    moved.assign([3.0, 5.0, 7.0])
    kept.assign([9.0, 9.0])
    _compat.tf_keras_update_moving_averages(ema, [moved])
    averages = _compat.tf_keras_optimizer_slots(ema, "average", [moved, kept])
    np.testing.assert_array_equal(averages[0].numpy(), [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(averages[1].numpy(), [1.0, 1.0])
    _compat.tf_keras_overwrite_with_moving_averages(ema, [moved])
    np.testing.assert_array_equal(moved.numpy(), [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(kept.numpy(), [9.0, 9.0])

    legacy = tf_keras.optimizers.legacy.SGD(0.5, momentum=0.25, decay=0.5)
    _compat.tf_keras_legacy_create_weights(legacy, [var])
    assert legacy.get_slot(var, "momentum").shape == var.shape
    legacy.iterations.assign(2)
    assert float(_compat.tf_keras_legacy_learning_rate(legacy)) == np.float32(0.5) / np.float32(2)
    assert float(_compat.tf_keras_legacy_hyper(legacy, "momentum")) == np.float32(0.25)
    assert _compat.tf_keras_legacy_has_momentum(legacy)
    assert not _compat.tf_keras_legacy_has_momentum(tf_keras.optimizers.legacy.SGD())
    assert not _compat.tf_keras_legacy_aggregates_its_own_way(legacy)
    assert _compat.tf_keras_legacy_aggregates_its_own_way(
        tf_keras.optimizers.legacy.SGD(gradient_aggregator=lambda grads_and_vars: grads_and_vars))
    assert _compat.tf_keras_legacy_same_update_as(legacy, tf_keras.optimizers.legacy.SGD)
    # tf_keras' warning when a loop neither scaled nor unscaled.
    opt = STOCK(tf_keras.optimizers.legacy.SGD())
    warned = []
    logger = tf.get_logger()
    original = logger.warning
    logger.warning = lambda msg, *a, **k: warned.append(msg)
    try:
        _compat.tf_keras_warn_about_scaling(opt)
    finally:
        logger.warning = original
    assert warned and "get_scaled_loss" in warned[0]
