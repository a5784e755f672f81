"""tf_keras' optimizers clipping on the fused step, run by
``test_tf_keras.py`` in a child pytest with ``TF_USE_LEGACY_KERAS=1``.

``tf_keras.optimizers.legacy`` optimizers clip in ``_transform_gradients``
with TensorFlow's own ``clip_by_value``, ``clip_by_norm`` and
``clip_by_global_norm`` (whose norm sums each gradient's ``l2_loss``), then
hand the clipped gradient to a ``ResourceApply*`` kernel.  The current ones
(``tf_keras.optimizers``) clip with the same ops in ``_clip_gradients``,
then update in Python-level ops, which TensorFlow's graph optimizer may
rewrite together with the clip's.  The fused step takes the norms as stock
takes them and clips in its one pass; every check here trains with ours
and with ``tf_keras``' own ``LossScaleOptimizer`` from the same weights and
data and compares every weight, slot, the loss scale, its counter and
``iterations`` bit for bit after every step, through overflowing steps
(skipped, the scale backing off) and growing ones.
"""

from tf_keras_cases import (BATCH, FUSED_STEPS, GROWTH, STOCK, STRATEGY, _apply_step,
                            _assert_moved, _assert_same_states, _custom_loop, _fused_data,
                            _fused_model, _fused_state, _minimize_step, _schedule, _scoped,
                            fit_lockstep)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import lossscale  # noqa: E402

LEGACY = {
    "sgd_momentum": (lambda **clip: tf_keras.optimizers.legacy.SGD(1e-2, momentum=0.9, **clip),
                     "SGD"),
    "sgd_nesterov_schedule": (lambda **clip: tf_keras.optimizers.legacy.SGD(
        tf_keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=3, decay_rate=0.9),
        momentum=0.9, nesterov=True, **clip), "SGD"),
    "adam": (lambda **clip: tf_keras.optimizers.legacy.Adam(1e-2, **clip), "Adam"),
    "adam_amsgrad": (lambda **clip: tf_keras.optimizers.legacy.Adam(1e-2, amsgrad=True, **clip),
                     "Adam"),
    "rmsprop_centered_momentum": (lambda **clip: tf_keras.optimizers.legacy.RMSprop(
        1e-3, momentum=0.5, centered=True, **clip), "RMSprop"),
    "adagrad": (lambda **clip: tf_keras.optimizers.legacy.Adagrad(1e-2, **clip), "Adagrad"),
}

# Values that clip on most steps of the data (the gradients' norms are in
# the tens to thousands) and, for clipvalue, on some elements only.
CLIPS = {"clipnorm": 3.0, "global_clipnorm": 7.5, "clipvalue": 0.75}


CURRENT = {
    "sgd": (lambda **clip: tf_keras.optimizers.SGD(1e-2, **clip), "SGD"),
    "sgd_momentum": (lambda **clip: tf_keras.optimizers.SGD(1e-2, momentum=0.9, **clip),
                     "SGD"),
    "sgd_nesterov_schedule_decay": (lambda **clip: tf_keras.optimizers.SGD(
        _schedule(), momentum=0.9, nesterov=True, weight_decay=0.01, **clip), "SGD"),
    "adam": (lambda **clip: tf_keras.optimizers.Adam(1e-2, **clip), "Adam"),
    "adamw_amsgrad": (lambda **clip: tf_keras.optimizers.AdamW(
        1e-3, weight_decay=0.004, amsgrad=True, **clip), "AdamW"),
    "rmsprop_centered_momentum": (lambda **clip: tf_keras.optimizers.RMSprop(
        1e-3, momentum=0.5, centered=True, **clip), "RMSprop"),
}


def _current_model():
    # A rank-0 weight besides the one-element bias: TensorFlow's graph
    # optimizer orders the current optimizers' chains of products by size,
    # and ties by the names of their tensors.
    return _fused_model("rmsprop")


def _run(make, inner, clip, use_function, make_step=_apply_step, steps=FUSED_STEPS,
         model=_fused_model):
    """``make`` (a loss-scale optimizer class) around ``inner(clip=value)``
    in ``_custom_loop``."""
    x, y = _fused_data(steps)
    opt = make(inner(**{clip: CLIPS[clip]}), initial_scale=2.0**10, dynamic_growth_steps=GROWTH)
    return opt, _custom_loop(opt, model(), x, y, use_function, steps, _fused_state, make_step)


def _assert_clipped(inner, clip, want, model=_fused_model):
    """The clip changed the run: unclipped, stock's weights differ."""
    x, y = _fused_data(FUSED_STEPS)
    opt = STOCK(inner(), initial_scale=2.0**10, dynamic_growth_steps=GROWTH)
    free = _custom_loop(opt, model(), x, y, True, FUSED_STEPS, _fused_state)
    assert any(not np.array_equal(a, b) for a, b in zip(free[-1], want[-1])), \
        f"{clip}={CLIPS[clip]} never clipped"


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("kind", sorted(LEGACY))
def test_legacy_clip_custom_loop_bit_identical(kind, clip, use_function):
    _, want = _run(STOCK, LEGACY[kind][0], clip, use_function)
    opt, got = _run(lossscale.LossScaleOptimizer, LEGACY[kind][0], clip, use_function)
    assert opt.step_path == f"fused ({LEGACY[kind][1]})", opt.step_path
    _assert_moved(want)
    _assert_same_states(got, want)
    if use_function and kind in ("adam", "sgd_momentum"):
        _assert_clipped(LEGACY[kind][0], clip, want)


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("kind", ["adam", "sgd_momentum"])
def test_legacy_clip_minimize_bit_identical(kind, clip):
    # TensorFlow 2.4's minimize: the gradients reach the step scaled.
    _, want = _run(STOCK, LEGACY[kind][0], clip, True, _minimize_step)
    opt, got = _run(lossscale.LossScaleOptimizer, LEGACY[kind][0], clip, True, _minimize_step)
    assert opt.step_path == f"fused ({LEGACY[kind][1]})", opt.step_path
    _assert_same_states(got, want)


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("kind", ["adam", "rmsprop_centered_momentum"])
def test_legacy_clip_fit_bit_identical(kind, clip):
    _fit_bit_identical(LEGACY[kind], clip, _fused_model)


def _fit_bit_identical(kind, clip, make_model):
    """``fit`` with ours and with stock around ``kind``'s (``(make,
    family)``) optimizer clipped by ``clip``: the same states, fused."""
    opt, states, _ = fit_lockstep(
        make_model, lambda cls: cls(kind[0](**{clip: CLIPS[clip]}), initial_scale=2.0**10,
                                    dynamic_growth_steps=GROWTH), *_fused_data(FUSED_STEPS))
    assert opt.step_path == f"fused ({kind[1]})"
    _assert_moved(states[0])
    _assert_same_states(states[1], states[0])


def test_legacy_global_clip_of_an_overflowing_norm():
    """Finite gradients whose l2_loss overflows float32: stock's factor is
    then 0 (clip * min(1/inf, 1/clip)) plus NaN (inf - inf), and every
    weight takes NaN; the norm alone does not say the step overflowed, the
    read-only check does, as for stock (which applies it)."""
    states = []
    for make in (STOCK, lossscale.LossScaleOptimizer):
        var = tf.Variable(np.linspace(-1.0, 1.0, 5, dtype=np.float32))
        opt = make(tf_keras.optimizers.legacy.SGD(1e-2, global_clipnorm=1.0),
                   initial_scale=1.0, dynamic=False)
        grads = [tf.constant(np.full(5, 3e19, np.float32))]

        @tf.function
        def step(opt=opt, var=var):
            opt.apply_gradients(zip(grads, [var]))

        step()
        states.append([var.numpy(), opt.iterations.numpy()])
    assert opt.step_path == "fused (SGD)"
    assert np.isnan(states[0][0]).all()
    _assert_same_states([states[1]], [states[0]])


@pytest.mark.parametrize("options", [
    {"clipnorm": 0.0}, {"global_clipnorm": 0}, {"clipvalue": 0.5, "clipnorm": 1.0},
    {"clipvalue": 0.5, "global_clipnorm": 1.0}, {"clipvalue": 0.01, "clipnorm": 0},
], ids=["clipnorm_0", "global_clipnorm_0", "clipvalue_clipnorm", "clipvalue_global_clipnorm",
        "clipvalue_clipnorm_0"])
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
def test_legacy_clips_the_kernels_do_not_take_fuse_exactly(options, use_function):
    """A clip of 0 (the legacy optimizers clip by it) and two clips at
    once, each in turn: the optimizer's own clip ops before the fused
    pass, every state bit-identical, the overflowing steps skipped."""
    x, y = _fused_data(12)
    runs = []
    for make in (STOCK, lossscale.LossScaleOptimizer):
        opt = make(tf_keras.optimizers.legacy.Adam(1e-2, **options), initial_scale=2.0**10,
                   dynamic_growth_steps=GROWTH)
        runs.append(_custom_loop(opt, _fused_model(), x, y, use_function, 12, _fused_state))
    assert opt.step_path == "fused (Adam)", opt.step_path
    _assert_same_states(runs[1], runs[0])


def test_legacy_two_clips_check_every_value():
    var = tf.Variable([1.0, 2.0])
    opt = lossscale.LossScaleOptimizer(tf_keras.optimizers.legacy.Adam(
        clipvalue=0.5, clipnorm=float("inf")))
    with pytest.raises(ValueError, match="clipnorm must be a positive finite number"):
        opt.apply_gradients([(tf.constant([0.5, 0.25]), var)])
    np.testing.assert_array_equal(var.numpy(), [1.0, 2.0])
    assert int(opt.iterations.numpy()) == 0


@pytest.mark.parametrize("clip, value", [("clipnorm", float("inf")),
                                         ("global_clipnorm", float("nan")),
                                         ("clipvalue", 1e300)])
def test_legacy_bad_clip_fails_before_anything_moves(clip, value):
    # (A negative one tf_keras refuses itself, when the optimizer is made.)
    var = tf.Variable([1.0, 2.0])
    opt = lossscale.LossScaleOptimizer(tf_keras.optimizers.legacy.Adam(**{clip: value}))
    with pytest.raises(ValueError, match=f"{clip} must be a positive finite number"):
        opt.apply_gradients([(tf.constant([0.5, 0.25]), var)])
    np.testing.assert_array_equal(var.numpy(), [1.0, 2.0])
    assert int(opt.iterations.numpy()) == 0


# ------------------------------------------- tf_keras' current optimizers
#
# What TensorFlow's graph optimizer does to their clipped step (read from
# the optimized graphs): the clipped gradient feeds several of the
# update's ops (Adam's g - m and g * g, RMSprop's g * g and lr * g, SGD's
# -g), so no chain of products takes the clip's in: SGD's -(u * factor) *
# lr and -((u * c) / norm) * lr keep the Neg between them, in a function
# that returns a value or not.  What it does change is the order of a
# one-element variable's lr * g * rsqrt(d) in RMSprop: the three factors
# tie in size and sort by name, and clipped, g is the clip's op, named
# after lr's read in the optimizer's scope: g * (lr * rsqrt(d)), whatever
# the scope the step is made in.


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("kind", sorted(CURRENT))
def test_current_clip_custom_loop_bit_identical(kind, clip, use_function):
    inner = CURRENT[kind][0]
    _, want = _run(STOCK, inner, clip, use_function, model=_current_model)
    opt, got = _run(lossscale.LossScaleOptimizer, inner, clip, use_function,
                    model=_current_model)
    assert opt.step_path == f"fused ({CURRENT[kind][1]})", opt.step_path
    _assert_moved(want)
    _assert_same_states(got, want)
    if use_function and kind in ("adam", "rmsprop_centered_momentum", "sgd"):
        _assert_clipped(inner, clip, want, _current_model)


@pytest.mark.parametrize("make_step", [_minimize_step, _scoped("Apply"), _scoped("train")],
                         ids=["minimize", "scope_Apply", "scope_train"])
@pytest.mark.parametrize("kind, clip", [("rmsprop_centered_momentum", "clipvalue"),
                                        ("sgd", "global_clipnorm"), ("adam", "clipnorm")])
def test_current_clip_variants_bit_identical(kind, clip, make_step):
    # TensorFlow 2.4's minimize (the gradients reach the step scaled), and
    # the step made under name scopes that order an unclipped one-element
    # variable's RMSprop step both ways (test_fused_rmsprop_one_element_order_
    # follows_the_graph): clipped, one way.
    inner = CURRENT[kind][0]
    _, want = _run(STOCK, inner, clip, True, make_step, model=_current_model)
    opt, got = _run(lossscale.LossScaleOptimizer, inner, clip, True, make_step,
                    model=_current_model)
    assert opt.step_path == f"fused ({CURRENT[kind][1]})", opt.step_path
    _assert_same_states(got, want)


@pytest.mark.parametrize("kind, clip", [("sgd_momentum", "global_clipnorm"),
                                        ("adam", "clipvalue"), ("adamw_amsgrad", "clipnorm"),
                                        ("rmsprop_centered_momentum", "global_clipnorm")])
def test_current_clip_fit_bit_identical(kind, clip):
    # fit's train function returns its logs (the graph optimizer then
    # drops the Identity of each gradient's way into the step's cond).
    _fit_bit_identical(CURRENT[kind], clip, _current_model)


@pytest.mark.parametrize("devices", [2, 1])
def test_current_rmsprop_clip_of_one_element_variables_under_mirrored_is_stock(devices):
    # A MirroredStrategy's update scope renames lr's read, and its order
    # with the clip's op differs per replica (replica 0 multiplies
    # g * rsqrt(d) first, replica 1 lr * rsqrt(d)), with one replica too.
    # The other families' clips fuse there (tf_keras_mirrored_cases), as
    # RMSprop's eagerly and under OneDeviceStrategy.
    strategy = STRATEGY if devices == 2 else tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        var = tf.Variable([1.0])
        wide = tf.Variable([1.0, 2.0])
        opt = lossscale.LossScaleOptimizer(tf_keras.optimizers.RMSprop(clipvalue=0.5))

    @tf.function
    def step():
        strategy.run(lambda: opt.apply_gradients([(tf.constant([0.5, 0.25]), wide),
                                                  (tf.constant([0.5]), var)]))

    step()
    assert opt.step_path == (
        f"stock: clipvalue with a one-element variable ({var.name}) under a MirroredStrategy "
        "in a graph (TensorFlow's graph optimizer orders tf_keras RMSprop's lr * g * rsqrt(d) "
        "by names the strategy's update scopes change)")


def test_current_rmsprop_clip_under_one_device_strategy_bit_identical():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    x, y = _fused_data(12)
    runs = []
    for make in (STOCK, lossscale.LossScaleOptimizer):
        with strategy.scope():
            model = _current_model()
            opt = make(CURRENT["rmsprop_centered_momentum"][0](clipvalue=CLIPS["clipvalue"]),
                       initial_scale=2.0**10, dynamic_growth_steps=GROWTH)
        step = _apply_step(opt, model)
        run = tf.function(lambda xb, yb, step=step: strategy.run(step, args=(xb, yb)))
        runs.append([])
        for i in range(12):
            run(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
            runs[-1].append(_fused_state(model, opt))
    assert opt.step_path == "fused (RMSprop)", opt.step_path
    _assert_same_states(runs[1], runs[0])
