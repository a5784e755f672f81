"""The fused optimizer step of lossscale.LossScaleOptimizer against stock Keras.

The oracle is stock ``keras.optimizers.LossScaleOptimizer(inner)``: twin
models built under the ``mixed_float16`` and the ``mixed_bfloat16`` global
policy, identical weights and batches, overflow forced on chosen steps (some
of them consecutive), one trained with the stock optimizer and one with
ours.  After every step every model variable, every slot (``momentum``,
``m``, ``v``, ``v_hat``, ``velocity``, ``average_gradient``,
``accumulator``), ``iterations``, ``dynamic_scale`` and ``step_counter``
must be bit-identical, for SGD (plain, momentum, Nesterov, weight decay),
Adam (amsgrad off and on), AdamW with an exclusion, RMSprop (plain,
momentum, centered with weight decay and an exclusion) and Adagrad (an
initial accumulator value, weight decay), with
constant and scheduled learning rates, in ``tf.function`` and eagerly, under
``MirroredStrategy`` over two logical CPUs, across a ``.keras`` save and
load, and with a scale whose reciprocal is inexact.  The TensorFlow 2.4 loop
of ``experimental.LossScaleOptimizer`` is checked against TensorFlow's own
``DynamicLossScale`` driving the stock inner optimizer.  Bad input (a gradient
of the wrong shape or dtype, a variable list that does not match, a
non-finite or negative learning rate) must raise and change nothing.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from helpers import (bits, keras3_train_step, tf24_reference_step, tf24_train_step, tf_dynamic,
                     tied_size_decay_case)
from test_optimizer_distributed import run_worker

if not hasattr(lossscale.LossScaleOptimizer(keras.optimizers.SGD()), "step_path"):
    pytest.skip("LossScaleOptimizer has no step_path yet (the fused step is not wired in)",
                allow_module_level=True)

Stock = keras.optimizers.LossScaleOptimizer
Ours = lossscale.LossScaleOptimizer
INF, NAN = float("inf"), float("nan")


# ------------------------------------------------------ the path taken
# ``step_path`` is the optimizer's own report of the path it took ("fused
# ..." or "stock ..." and why); every expectation about its text is here.

STOCK_REASONS = {"fused=False": "fused=False",
                 "update_step": "SGDWithOwnUpdate"}


def assert_fused(opt):
    assert opt.step_path.startswith("fused"), opt.step_path


def assert_stock(opt, why):
    assert opt.step_path.startswith("stock"), opt.step_path
    assert STOCK_REASONS[why] in opt.step_path, opt.step_path


# ------------------------------------------------------------- helpers


def sequential_under(policy, seed, first_layers):
    """``first_layers()`` then Flatten, Dense(8, tanh) and a float32 Dense(1),
    made under ``policy`` from the random seed ``seed``, restoring the old
    policy."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        return keras.Sequential(first_layers() + [
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1, dtype="float32"),
        ])
    finally:
        keras.mixed_precision.set_global_policy(previous)


def build_model(policy, seed=0):
    """A small Conv2D + Dense model made under ``policy``."""
    return sequential_under(policy, seed, lambda: [keras.Input((6, 6, 2)),
                                                   keras.layers.Conv2D(3, 3, activation="relu")])


def twin_models(policy):
    a, b = build_model(policy, 0), build_model(policy, 1)
    b.set_weights(a.get_weights())
    return a, b


def schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=7, decay_rate=0.9)


def excluding_biases(opt):
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


def excluding_layer(opt):
    opt.exclude_from_weight_decay(var_names=["conv2d"])
    return opt


def adamw_excluding_biases(**kw):
    return excluding_biases(keras.optimizers.AdamW(**kw))


INNERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.02, momentum=0.9),
    "sgd_nesterov_schedule": lambda: keras.optimizers.SGD(schedule(), momentum=0.9,
                                                          nesterov=True),
    "sgd_weight_decay": lambda: keras.optimizers.SGD(0.02, momentum=0.5, weight_decay=0.01),
    "adam": lambda: keras.optimizers.Adam(0.003),
    "adam_amsgrad_schedule": lambda: keras.optimizers.Adam(schedule(), amsgrad=True),
    "adamw_exclude": lambda: adamw_excluding_biases(learning_rate=0.003, weight_decay=0.004),
    # A pattern that matches a layer's name: Keras' TensorFlow backend
    # matches it against the variable's path ("conv2d/kernel:0"), not its
    # name ("kernel"), as KerasHub's BERT recipe excludes "layer_norm".
    "adamw_exclude_layer": lambda: excluding_layer(
        keras.optimizers.AdamW(learning_rate=0.003, weight_decay=0.004)),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.003),
    "rmsprop_momentum_schedule": lambda: keras.optimizers.RMSprop(schedule(), momentum=0.9),
    "rmsprop_rho_decay_schedule": lambda: keras.optimizers.RMSprop(
        schedule(), rho=0.8, epsilon=1e-4, weight_decay=0.02),
    "rmsprop_centered_decay_exclude": lambda: excluding_biases(
        keras.optimizers.RMSprop(0.002, rho=0.8, momentum=0.5, epsilon=1e-3, centered=True,
                                 weight_decay=0.01)),
    "adagrad_schedule": lambda: keras.optimizers.Adagrad(schedule()),
    "adagrad_decay": lambda: keras.optimizers.Adagrad(
        0.05, initial_accumulator_value=0.37, epsilon=1e-5, weight_decay=0.02),
    "adamax_decay": lambda: keras.optimizers.Adamax(0.003, weight_decay=0.01),
    "adamax_schedule": lambda: keras.optimizers.Adamax(schedule(), beta_1=0.8, beta_2=0.95,
                                                       epsilon=1e-4),
    "nadam_decay": lambda: keras.optimizers.Nadam(0.003, weight_decay=0.01),
    "nadam_schedule": lambda: keras.optimizers.Nadam(schedule(), beta_1=0.8, beta_2=0.95,
                                                     epsilon=1e-4),
    "lion_decay": lambda: keras.optimizers.Lion(0.0005, weight_decay=0.01),
    "lion_schedule": lambda: keras.optimizers.Lion(schedule(), beta_1=0.8, beta_2=0.95),
    "adafactor": lambda: keras.optimizers.Adafactor(),
    "adafactor_schedule": lambda: keras.optimizers.Adafactor(
        schedule(), beta_2_decay=-0.5, epsilon_2=1e-2, clip_threshold=0.5),
    "adafactor_decay_exclude": lambda: excluding_biases(keras.optimizers.Adafactor(
        0.02, weight_decay=0.01, relative_step=False, epsilon_1=1e-20)),
    "lamb": lambda: keras.optimizers.Lamb(0.003),
    "lamb_schedule_decay_exclude": lambda: excluding_biases(keras.optimizers.Lamb(
        schedule(), beta_1=0.8, beta_2=0.95, epsilon=1e-4, weight_decay=0.01)),
}

# Steps whose loss is multiplied by a non-finite or huge factor; some in a
# row.  1e30 keeps a float32 loss finite and overflows float16 gradients
# on the way back; under bfloat16 it is raised until the scaled loss
# overflows float32.
OVERFLOWS = {3: INF, 4: INF, 5: NAN, 29: -INF, 60: 1e30, 61: 1e30, 100: NAN, 150: INF,
             151: 1e30, 152: NAN, 153: INF, 220: 1e30, 290: NAN}


def factor(step, policy):
    f = OVERFLOWS.get(step, 1.0)
    if f == 1e30 and policy == "mixed_bfloat16":
        f = 1e38
    return np.float32(f)


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((4, 6, 6, 2)).astype(np.float32),
             rng.standard_normal((4, 1)).astype(np.float32)) for _ in range(steps)]


def step_fn(model, opt, eager=False):
    """Keras 3's custom loop: ``scale_loss``, then ``apply`` on the scaled gradients."""
    step = keras3_train_step(model, opt)
    return step if eager else tf.function(step)


def own_state(inner):
    """The inner optimizer's scalar state outside its ``variables`` once a
    wrapper built it (Nadam's ``_u_product``)."""
    extra = getattr(inner, "_u_product", None)
    return [] if extra is None or any(v is extra for v in inner.variables) else [extra]


def optimizer_variables(opt):
    return list(opt.variables) + own_state(opt.inner_optimizer)


def path(variable):
    # A LossScale's variables are tf.Variables, which have a name only.
    return getattr(variable, "path", variable.name)


def state(model, opt):
    """(path, bits) of every model variable and every optimizer variable."""
    return [(path(v), bits(v.numpy())) for v in list(model.variables) + optimizer_variables(opt)]


def state_reader(model, opt):
    """``state`` as one graph call: reading ~40 variables one by one eagerly
    costs more than the training step itself."""
    variables = list(model.variables) + optimizer_variables(opt)
    read = tf.function(lambda: [tf.identity(v) for v in variables])
    return lambda: [(path(v), bits(t.numpy())) for v, t in zip(variables, read())]


def assert_same_state(a, b, where):
    """Twins' variables line up by position (their paths differ by the layer numbers)."""
    assert len(a) == len(b), f"{where}: {len(a)} variables against {len(b)}"
    bad = [p for (_, x), (p, y) in zip(a, b) if x != y]
    assert not bad, f"{where}: {bad} differ from stock"


def tf24_twins(models, opt, make_inner, reference_scale, *, count_skipped=False,
               train_step=tf24_train_step):
    """TensorFlow 2.4's loop on both twins, compiled: ``opt`` on ``models[1]``;
    on ``models[0]`` TensorFlow's own ``reference_scale`` around a stock
    ``make_inner()``.  Returns ``(reference_inner, reference_step, step)``."""
    reference_inner = make_inner()
    reference_inner.build(models[0].trainable_variables)
    reference_step = tf.function(tf24_reference_step(models[0], reference_inner, reference_scale,
                                                     count_skipped=count_skipped))
    return reference_inner, reference_step, tf.function(train_step(models[1], opt))


def assert_twins_agree(models, reference_slots, slots, where):
    """Each twin's variables, then the slots given for it, agree bit for bit."""
    assert_same_state(
        [(v.path, bits(v.numpy())) for v in models[0].variables + list(reference_slots)],
        [(v.path, bits(v.numpy())) for v in models[1].variables + list(slots)], where)


def lockstep(models, opts, data, policy, *, eager=False, first=0):
    """Steps both twins over ``data``, comparing after every step; returns scales."""
    steps = [step_fn(m, o, eager) for m, o in zip(models, opts)]
    readers = [state_reader(m, o) for m, o in zip(models, opts)]
    scales = []
    for i, (x, y) in enumerate(data, start=first):
        f = tf.constant(factor(i, policy))
        for step in steps:
            step(tf.constant(x), tf.constant(y), f)
        assert_same_state(readers[0](), readers[1](), f"step {i}")
        scales.append(float(opts[0].dynamic_scale.numpy()))
    return scales


def make_pair(make_inner, policy, **kw):
    """``(models, opts)``: the twins under ``policy``, and stock's and our
    optimizer around two ``make_inner()``, built on them."""
    models = twin_models(policy)
    opts = [Stock(make_inner(), **kw), Ours(make_inner(), **kw)]
    for model, opt in zip(models, opts):
        opt.build(model.trainable_variables)
    return models, opts


# ----------------------------------------------------- lockstep with stock


# Eagerly on one policy only: what eager changes (the ops' dispatch) does
# not depend on the gradients' dtype, and the file's run time stays short.
RUNS = [("mixed_float16", False), ("mixed_float16", True), ("mixed_bfloat16", False)]
RUN_IDS = [f"{p}-{'eager' if e else 'function'}" for p, e in RUNS]


@pytest.mark.parametrize("name", list(INNERS))
@pytest.mark.parametrize("policy,eager", RUNS, ids=RUN_IDS)
def test_bit_identical_to_stock_every_step(policy, eager, name):
    models, opts = make_pair(INNERS[name], policy, dynamic_growth_steps=10)
    steps = 40 if eager else 320
    scales = lockstep(models, opts, batches(steps), policy, eager=eager)
    assert_fused(opts[1])
    # Steps were skipped, and the scale moved both ways.
    assert 0 < int(opts[1].iterations.numpy()) <= steps - sum(i in OVERFLOWS for i in range(steps))
    moves = [b / a for a, b in zip(scales, scales[1:]) if a != b]
    assert min(moves) < 1 and (eager or max(moves) > 1), scales


@pytest.mark.parametrize("name", ["sgd_momentum", "adam_amsgrad_schedule", "adafactor", "lamb"])
def test_inexact_reciprocal_scale_divides_as_stock(name):
    models, opts = make_pair(INNERS[name], "mixed_float16", initial_scale=1000.0,
                             dynamic_growth_steps=1000)
    lockstep(models, opts, batches(120, seed=3), "mixed_float16")
    assert not math.log2(float(opts[1].dynamic_scale.numpy())).is_integer()
    assert_fused(opts[1])


@pytest.mark.parametrize("eager", [False, True], ids=["function", "eager"])
def test_nadam_skipped_step_leaves_u_product_as_stock(eager):
    """Nadam moves ``_u_product`` once per applied step, before its updates:
    a skipped step (an overflow) must leave it bit for bit as it was, as
    stock leaves it, and an applied one move it as stock does."""
    models, opts = make_pair(INNERS["nadam_schedule"], "mixed_float16", dynamic_growth_steps=10)
    steps = [step_fn(m, o, eager) for m, o in zip(models, opts)]

    def u_products():
        return [bits(o.inner_optimizer._u_product.numpy()) for o in opts]

    applied = []
    for i, (x, y) in enumerate(batches(12, seed=2)):
        before, iterations = u_products(), int(opts[1].iterations.numpy())
        f = tf.constant(np.float32(INF if i in (5, 6, 9) else 1.0))
        for step in steps:
            step(tf.constant(x), tf.constant(y), f)
        after = u_products()
        applied.append(int(opts[1].iterations.numpy()) > iterations)
        assert after[0] == after[1], f"step {i}"
        assert (after != before) == applied[-1], f"step {i}"
    assert_fused(opts[1])
    assert not any(applied[i] for i in (5, 6, 9)) and sum(applied) >= 3, applied


@pytest.mark.parametrize("name", ["sgd_nesterov_schedule", "adamw_exclude"])
def test_save_and_load_mid_run_then_lockstep(name, tmp_path):
    policy = "mixed_float16"
    models, opts = make_pair(INNERS[name], policy, dynamic_growth_steps=5)
    for model, opt in zip(models, opts):
        model.compile(optimizer=opt, loss="mse")
    data = batches(120, seed=5)
    lockstep(models, opts, data[:60], policy)
    loaded = []
    for which, model in zip(("stock", "ours"), models):
        model.save(tmp_path / f"{which}.keras")
        loaded.append(keras.saving.load_model(tmp_path / f"{which}.keras"))
    assert type(loaded[1].optimizer) is Ours
    before = state(models[1], opts[1])
    assert_same_state(before, state(loaded[1], loaded[1].optimizer), "after load")
    lockstep(loaded, [m.optimizer for m in loaded], data[60:], policy, first=60)
    assert_fused(loaded[1].optimizer)


@pytest.mark.parametrize("option", ["constant_folding", "arithmetic_optimization"])
def test_graph_pass_switched_off_as_stock(option):
    """With one of Grappler's passes off, the stock step keeps what that pass
    rewrites (RMSprop's centered sum, its division by sqrt) as Keras wrote
    it, and the fused step follows."""
    previous = tf.config.optimizer.get_experimental_options().get(option, True)
    tf.config.optimizer.set_experimental_options({option: False})
    try:
        models, opts = make_pair(INNERS["rmsprop_centered_decay_exclude"], "mixed_float16",
                                 dynamic_growth_steps=10)
        lockstep(models, opts, batches(60, seed=7), "mixed_float16")
        assert_fused(opts[1])
    finally:
        tf.config.optimizer.set_experimental_options({option: previous})


# Weight decay large enough that the grouping of `var * wd * lr` decides the
# last bit of many results, for every family that decays.
DECAYING = {
    "sgd": lambda: keras.optimizers.SGD(0.37, weight_decay=0.83),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.37, momentum=0.7, weight_decay=0.83),
    "adamw": lambda: keras.optimizers.AdamW(0.37, weight_decay=0.83),
    "adagrad": lambda: keras.optimizers.Adagrad(0.37, epsilon=1e-5, weight_decay=0.83),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(0.37, momentum=0.5, centered=True,
                                                         weight_decay=0.83),
    "adamax": lambda: keras.optimizers.Adamax(0.37, weight_decay=0.83),
    "nadam": lambda: keras.optimizers.Nadam(0.37, weight_decay=0.83),
    "lion": lambda: keras.optimizers.Lion(0.37, weight_decay=0.83),
}


def compiled_apply(opt, variables):
    return tf.function(lambda grads: opt.apply(grads, variables))


def assert_tied_size_decay_as_stock(make_inner):
    """30 variables of each of the shapes (), (1,), (1, 1) and (3,), each
    name its own, stepped in a graph by ours (fused) and stock: the same
    bits after three steps."""
    shapes, start, steps = tied_size_decay_case()
    finals = []
    for cls in (Stock, Ours):
        variables = [keras.Variable(a) for a in start]
        opt = cls(make_inner(), initial_scale=1.0)
        opt.build(variables)
        apply = compiled_apply(opt, variables)
        for grads in steps:
            apply(grads)
        finals.append([(f"variable {i} of shape {s}", bits(v.numpy()))
                       for i, (s, v) in enumerate(zip(shapes, variables))])
    assert_fused(opt)
    assert_same_state(finals[0], finals[1], "after three steps")


@pytest.mark.parametrize("name", list(DECAYING))
def test_weight_decay_of_one_element_variables_in_a_graph_as_stock(name):
    """In a graph the graph optimizer regroups the decay's `var * wd * lr`
    by the factors' sizes, and, where they tie (a one-element variable), by
    their tensors' names."""
    assert_tied_size_decay_as_stock(DECAYING[name])


# ------------------------------------- TensorFlow 2.4's loop, experimental


@pytest.mark.parametrize("name", list(INNERS))
def test_tf24_loop_bit_identical_to_tensorflow_reference(name):
    """``experimental.LossScaleOptimizer.apply_gradients`` on unscaled
    gradients against TensorFlow 2.4's arithmetic: TensorFlow's own
    ``DynamicLossScale`` checks the unscaled gradients, the stock inner
    optimizer applies them, and a skipped step still advances ``iterations``."""
    from lossscale import experimental

    models = twin_models("mixed_float16")
    opt = experimental.LossScaleOptimizer(INNERS[name](), experimental.DynamicLossScale(
        2.0**10, 5))
    reference_scale = tf_dynamic(initial_loss_scale=2.0**10, increment_period=5)
    reference_inner, reference_step, step = tf24_twins(models, opt, INNERS[name],
                                                       reference_scale, count_skipped=True)

    def slots(inner):
        # Nadam's _u_product last, listed or not (a wrapper's build leaves it
        # out, and Adafactor's 0-d placeholders for the r and c of variables
        # it does not factor: never read, listed only where built bare).
        own = own_state(inner) or [v for v in inner.variables
                                   if v is getattr(inner, "_u_product", None)]
        placeholders = [p for p in getattr(inner, "_r", []) + getattr(inner, "_c", [])
                        if p is not None and len(p.shape) == 0]
        return [v for v in inner.variables
                if v is not inner.iterations and all(v is not u for u in own + placeholders)
                ] + own

    for i, (x, y) in enumerate(batches(100, seed=6)):
        f = tf.constant(factor(i, "mixed_float16"))
        reference_step(x, y, f)
        step(x, y, f)
        where = f"step {i}"
        assert bits(opt.loss_scale.numpy()) == bits(reference_scale().numpy()), where
        assert int(opt.dynamic_counter.numpy()) == int(reference_scale._num_good_steps.numpy())
        assert int(opt.iterations.numpy()) == int(reference_inner.iterations.numpy()) == i + 1
        assert_twins_agree(models, slots(reference_inner), slots(opt.inner_optimizer), where)
    assert_fused(opt)


# ------------------------------------------------------- the stock path


class SGDWithOwnUpdate(keras.optimizers.SGD):
    """A subclass with its own update rule: the fused step must not run."""

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient * 0.5, variable, learning_rate)


@pytest.mark.parametrize("why,make_inner,ours_kw", [
    ("fused=False", lambda: keras.optimizers.Adam(0.003), {"fused": False}),
    ("update_step", lambda: SGDWithOwnUpdate(0.02, momentum=0.9), {}),
])
def test_stock_path_when_fusing_is_off_or_unsupported(why, make_inner, ours_kw):
    models = twin_models("mixed_float16")
    opts = [Stock(make_inner(), dynamic_growth_steps=10),
            Ours(make_inner(), dynamic_growth_steps=10, **ours_kw)]
    lockstep(models, opts, batches(24, seed=9), "mixed_float16")
    assert_stock(opts[1], why)


class WarmUpSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The Transformer's warm-up: rsqrt(d) * min(rsqrt(step), step * w ** -1.5)."""

    def __call__(self, step):
        step = tf.cast(step, tf.float32) + 1.0
        return tf.math.rsqrt(256.0) * tf.minimum(tf.math.rsqrt(step), step * 10.0 ** -1.5)

    def get_config(self):
        return {}


# Every schedule Keras ships and one of a user's, each with a family that decays.
SCHEDULE_DECAYS = {
    "sgd_exponential": lambda: keras.optimizers.SGD(schedule(), weight_decay=0.01),
    "lion_exponential": lambda: keras.optimizers.Lion(schedule(), weight_decay=0.01),
    "adamw_polynomial_exclude": lambda: excluding_biases(keras.optimizers.AdamW(
        keras.optimizers.schedules.PolynomialDecay(0.003, 100, end_learning_rate=0.0),
        weight_decay=0.01, epsilon=1e-6)),
    "adagrad_cosine": lambda: keras.optimizers.Adagrad(
        keras.optimizers.schedules.CosineDecay(0.05, 50), weight_decay=0.02),
    "adamw_cosine_warmup": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.CosineDecay(0.01, 40, warmup_target=0.05, warmup_steps=5),
        weight_decay=0.05),
    "rmsprop_piecewise": lambda: keras.optimizers.RMSprop(
        keras.optimizers.schedules.PiecewiseConstantDecay([5, 15], [0.003, 0.002, 0.001]),
        momentum=0.5, centered=True, weight_decay=0.3),
    "nadam_inverse_time": lambda: keras.optimizers.Nadam(
        keras.optimizers.schedules.InverseTimeDecay(0.004, 5, 0.7), weight_decay=0.02),
    "adamax_restarts": lambda: keras.optimizers.Adamax(
        keras.optimizers.schedules.CosineDecayRestarts(0.003, 7), weight_decay=0.05),
    "adam_warm_up": lambda: keras.optimizers.Adam(WarmUpSchedule(), weight_decay=0.004),
}


def decay_probe(make_inner):
    """``_fused.decay_factor_probe`` of a built ``make_inner()`` in a
    ``tf.function``: ``(factor, taken)`` as numpy values."""
    from lossscale import _fused

    inner = make_inner()
    inner.build([keras.Variable(np.ones((3, 4), np.float32))])
    inner.iterations.assign(6)
    factor, taken = tf.function(lambda: _fused.decay_factor_probe(inner))()
    return factor.numpy(), bool(taken.numpy())


@pytest.mark.parametrize("name", list(SCHEDULE_DECAYS))
def test_schedule_with_weight_decay_fused_in_a_graph_and_eagerly(name):
    """In a graph the decay's product takes the schedule's constants: the
    fused pass decays by the one factor the graph optimizer makes of it
    (``_fused.decay_factor_probe``), which its probe finds for every
    schedule here; eagerly the kernel decays as written.  The same bits as
    stock both ways."""
    make_inner = SCHEDULE_DECAYS[name]
    assert decay_probe(make_inner)[1], "the probe found no single factor"
    for eager, steps in ((False, 40), (True, 16)):
        models = twin_models("mixed_float16")
        opts = [Stock(make_inner(), dynamic_growth_steps=10),
                Ours(make_inner(), dynamic_growth_steps=10)]
        lockstep(models, opts, batches(steps, seed=9), "mixed_float16", eager=eager)
        assert_fused(opts[1])


def test_decay_probe_tells_a_chain_left_as_written():
    """The probe's lanes tell the chain's two orders apart: with the graph
    optimizer's arithmetic pass off, `var * wd * lr` runs as written and the
    probe says it is no single factor (the factor a numpy product of the
    same numbers would give is then wrong for some lanes)."""
    make_inner = SCHEDULE_DECAYS["adamw_cosine_warmup"]
    assert decay_probe(make_inner)[1]
    previous = tf.config.optimizer.get_experimental_options().get("arithmetic_optimization")
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    try:
        assert not decay_probe(make_inner)[1]
    finally:
        tf.config.optimizer.set_experimental_options(
            {"arithmetic_optimization": True if previous is None else previous})


def test_schedule_with_weight_decay_where_the_probe_finds_no_factor(monkeypatch):
    """Were the graph optimizer to leave the decay's chain some other way,
    the fused pass decays nothing and Keras' own ops decay first: still the
    same bits as stock."""
    from lossscale import _fused

    probe = _fused.decay_factor_probe
    monkeypatch.setattr(_fused, "decay_factor_probe",
                        lambda inner: (probe(inner)[0], tf.constant(False)))
    make_inner = SCHEDULE_DECAYS["adamw_polynomial_exclude"]
    models = twin_models("mixed_float16")
    opts = [Stock(make_inner(), dynamic_growth_steps=10),
            Ours(make_inner(), dynamic_growth_steps=10)]
    lockstep(models, opts, batches(24, seed=9), "mixed_float16")
    assert_fused(opts[1])


@pytest.mark.parametrize("name", ["sgd_exponential", "adamw_cosine_warmup", "lion_exponential"])
def test_schedule_decay_of_one_element_variables_in_a_graph_as_stock(name):
    """With a schedule, a one-element variable's decay (its factors tie in
    size, and names order them) runs as Keras' own ops, the others' by the
    factor."""
    assert_tied_size_decay_as_stock(SCHEDULE_DECAYS[name])


def test_schedule_with_weight_decay_and_accumulation_fused_in_a_graph():
    """With accumulation too the decay is the probe's factor, on the update
    steps alone, where Keras' update step decays (test_fused_ema_accum
    steps every family so)."""
    models = twin_models("mixed_float16")
    make_inner = lambda: keras.optimizers.AdamW(  # noqa: E731
        schedule(), weight_decay=0.01, gradient_accumulation_steps=2)
    opts = [Stock(make_inner(), dynamic_growth_steps=10),
            Ours(make_inner(), dynamic_growth_steps=10)]
    lockstep(models, opts, batches(24, seed=9), "mixed_float16")
    assert_fused(opts[1])


# ------------------------------------------------------------ bad input


class ConstantSchedule(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, value):
        self.value = value

    def __call__(self, step):
        return tf.constant(self.value, tf.float32) + 0.0 * tf.cast(step, tf.float32)

    def get_config(self):
        return {"value": self.value}


def bad_setup(make_inner):
    model = build_model("mixed_float16")
    opt = Ours(make_inner(), dynamic_growth_steps=10)
    opt.build(model.trainable_variables)
    # A few good steps first, so slots, iterations and the counter are not zero.
    step = step_fn(model, opt, eager=True)
    for x, y in batches(3, seed=4):
        step(x, y, tf.constant(1.0))
    with tf.GradientTape() as tape:
        x, y = batches(1, seed=8)[0]
        pred = tf.cast(model(x, training=True), tf.float32)
        loss = opt.scale_loss(tf.reduce_mean(tf.square(pred - y)))
    grads = tape.gradient(loss, model.trainable_variables)
    return model, opt, grads


def apply_in(mode, opt, grads, variables):
    if mode == "eager":
        return opt.apply(grads, variables)
    return tf.function(lambda: opt.apply(grads, variables))()


BAD_ERRORS = (ValueError, TypeError, tf.errors.InvalidArgumentError)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("inner", ["sgd_momentum", "adam_amsgrad_schedule"])
@pytest.mark.parametrize("bad", ["transposed", "broadcastable", "extra_dim"])
def test_gradient_of_wrong_shape_raises_and_changes_nothing(bad, inner, mode):
    model, opt, grads = bad_setup(INNERS[inner])
    variables = model.trainable_variables
    k = 2  # the Dense kernel
    g = grads[k]
    grads = list(grads)
    grads[k] = {"transposed": tf.transpose(g), "broadcastable": g[:1, :1],
                "extra_dim": g[None]}[bad]
    before = state(model, opt)
    with pytest.raises(BAD_ERRORS, match=variables[k].name):
        apply_in(mode, opt, grads, variables)
    assert_same_state(state(model, opt), before, "after the bad call")


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("dtype", [tf.float64, tf.int32, tf.complex64])
def test_gradient_of_other_dtype_as_stock_or_clear_error(dtype, mode):
    """Stock Keras casts some dtypes: ours gives its bits, or raises and changes nothing."""
    models, opts = make_pair(INNERS["adam"], "mixed_float16", dynamic_growth_steps=10)
    grads = []
    for model, opt in zip(models, opts):
        with tf.GradientTape() as tape:
            x, y = batches(1, seed=8)[0]
            pred = tf.cast(model(x, training=True), tf.float32)
            loss = opt.scale_loss(tf.reduce_mean(tf.square(pred - y)))
        g = list(tape.gradient(loss, model.trainable_variables))
        g[1] = tf.cast(g[1], dtype)
        grads.append(g)
    try:
        apply_in(mode, opts[0], grads[0], models[0].trainable_variables)
        stock_error = None
    except Exception as e:  # noqa: BLE001 - whatever stock raises, ours must raise too
        stock_error = e
    before = state(models[1], opts[1])
    if stock_error is None:
        apply_in(mode, opts[1], grads[1], models[1].trainable_variables)
        assert_same_state(state(*[models[0], opts[0]]), state(models[1], opts[1]), "after")
    else:
        with pytest.raises(BAD_ERRORS):
            apply_in(mode, opts[1], grads[1], models[1].trainable_variables)
        assert_same_state(state(models[1], opts[1]), before, "after the bad call")


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("bad", ["too_few_grads", "unknown_variable", "swapped"])
def test_variable_list_not_matching_raises_and_changes_nothing(bad, mode):
    model, opt, grads = bad_setup(INNERS["adam"])
    variables = list(model.trainable_variables)
    grads = list(grads)
    if bad == "too_few_grads":
        grads = grads[:-1]
    elif bad == "unknown_variable":
        stranger = keras.Variable(np.zeros(variables[1].shape, np.float32), name="stranger")
        variables[1] = stranger
    else:
        variables[0], variables[2] = variables[2], variables[0]
    before = state(model, opt)
    # Stock Keras names the variable it does not know in a ValueError.
    with pytest.raises(BAD_ERRORS, match="stranger" if bad == "unknown_variable" else ""):
        apply_in(mode, opt, grads, variables)
    assert_same_state(state(model, opt), before, "after the bad call")


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("lr", [NAN, INF, -1.0], ids=["nan", "inf", "negative"])
@pytest.mark.parametrize("source", ["schedule", "variable"])
@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_bad_learning_rate_raises_and_changes_nothing(family, source, lr, mode):
    """A schedule returning it, or the learning-rate variable assigned it."""
    cls = keras.optimizers.SGD if family == "sgd" else keras.optimizers.Adam
    kw = {"momentum": 0.9} if family == "sgd" else {}
    first = ConstantSchedule(0.01) if source == "schedule" else 0.01
    model, opt, grads = bad_setup(lambda: cls(first, **kw))
    opt.inner_optimizer.learning_rate = ConstantSchedule(lr) if source == "schedule" else lr
    before = state(model, opt)
    with pytest.raises(BAD_ERRORS, match="(?i)learning.?rate"):
        apply_in(mode, opt, grads, model.trainable_variables)
    assert_same_state(state(model, opt), before, "after the bad call")


# ------------------------------------------------- two replicas, one step

WORKER = r'''
import json, sys
import tensorflow as tf

from helpers import two_cpu_replicas

strategy = two_cpu_replicas()
import keras
import lossscale
from test_fused_step import INNERS, batches, build_model, factor, step_fn

report = {"replicas": strategy.num_replicas_in_sync, "mismatch": {}, "paths": {},
          "copies_agree": {}}


def copies_state(model, opt):
    out = []
    for v in list(model.variables) + list(opt.variables):
        value = v.value if isinstance(v, keras.Variable) else v
        out.append([c.numpy().tobytes().hex() for c in getattr(value, "values", [value])])
    return out


def replicated_step_fn(model, opt):
    replica = step_fn(model, opt, eager=True)

    @tf.function
    def step(x, y, f):
        strategy.run(replica, args=(x, y, f))
    return step


for name in ("sgd_momentum", "adam_amsgrad_schedule", "adamw_exclude"):
    pairs = []
    for cls in (keras.optimizers.LossScaleOptimizer, lossscale.LossScaleOptimizer):
        with strategy.scope():
            model = build_model("mixed_float16", 0)
            opt = cls(INNERS[name](), dynamic_growth_steps=5)
            opt.build(model.trainable_variables)
        pairs.append((model, opt))
    steps = [replicated_step_fn(m, o) for m, o in pairs]
    bad = []
    for i, (x, y) in enumerate(batches(40, seed=2)):
        f = tf.constant(factor(i, "mixed_float16"))
        for step in steps:
            step(x, y, f)
        if copies_state(*pairs[0]) != copies_state(*pairs[1]):
            bad.append(i)
    report["mismatch"][name] = bad
    report["paths"][name] = pairs[1][1].step_path
    report["copies_agree"][name] = all(len(set(c)) == 1 for c in copies_state(*pairs[1]))
json.dump(report, sys.stdout)
'''


@pytest.fixture(scope="module")
def mirrored_report():
    return run_worker(WORKER)


def test_mirrored_strategy_two_cpus_bit_identical_to_stock(mirrored_report):
    assert mirrored_report["replicas"] == 2
    mismatch = mirrored_report["mismatch"]
    assert mismatch == {k: [] for k in mismatch}, mismatch
    assert all(mirrored_report["copies_agree"].values()), mirrored_report["copies_agree"]


def test_mirrored_strategy_two_cpus_is_fused(mirrored_report):
    """Several replicas take the fused step (``tests/test_fused_distributed.py``
    holds it to stock over longer runs, one-sided overflows and workers)."""
    for name, path in mirrored_report["paths"].items():
        assert path.startswith("fused ("), (name, path)


# ------------------------------------- a list large enough to be split
# The native op splits a list of more than 2 x 65,536 values into chunks the
# intra-op threads take in turn; chunk bounds fall inside tensors.  Three
# threads (whatever the machine has), sizes that are not multiples of
# anything, one overflow in the last tensor.

SPLIT_WORKER = r'''
import functools, json, sys
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(3)
tf.config.threading.set_inter_op_parallelism_threads(2)
import keras
import numpy as np
import lossscale
from test_fused_step import INNERS


def apply(opt, variables, grads):
    opt.apply(grads, variables)


SIZES = [(1000, 1003), (777_777,), (3,), (65_537,), (501, 999), (129,), (2_000_001,)]
rng = np.random.default_rng(5)
init = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
grads = [[(rng.standard_normal(s) * 256).astype(np.float32) for s in SIZES] for _ in range(6)]
grads[3][-1][-1, ...] = np.inf
report = {"threads": tf.config.threading.get_intra_op_parallelism_threads(), "mismatch": {},
          "paths": {}, "iterations": {}}
for name in ("sgd_momentum", "adam_amsgrad_schedule"):
    runs = []
    for cls in (keras.optimizers.LossScaleOptimizer, lossscale.LossScaleOptimizer):
        variables = [keras.Variable(a, name=f"w{i}") for i, a in enumerate(init)]
        opt = cls(INNERS[name](), initial_scale=256.0, dynamic_growth_steps=2)
        opt.build(variables)
        step = tf.function(functools.partial(apply, opt, variables))
        states = []
        for gs in grads:
            step([tf.constant(g) for g in gs])
            states.append([v.numpy().tobytes() for v in variables + list(opt.variables)])
        runs.append(states)
        report["iterations"][name] = int(opt.iterations.numpy())
    report["mismatch"][name] = [i for i, (a, b) in enumerate(zip(*runs)) if a != b]
    report["paths"][name] = opt.step_path
json.dump(report, sys.stdout)
'''


def test_list_split_over_three_threads_bit_identical_to_stock():
    report = run_worker(SPLIT_WORKER)
    assert report["threads"] == 3
    assert report["mismatch"] == {"sgd_momentum": [], "adam_amsgrad_schedule": []}, report
    assert all(p.startswith("fused") for p in report["paths"].values()), report["paths"]
    # The overflow step was skipped: five of six applied.
    assert report["iterations"] == {"sgd_momentum": 5, "adam_amsgrad_schedule": 5}, report
