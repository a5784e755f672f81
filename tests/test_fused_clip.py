"""Keras' gradient clipping on the fused step, against stock Keras.

The oracle is stock ``keras.optimizers.LossScaleOptimizer(inner)`` with
the inner optimizer's ``clipnorm``, ``clipvalue`` or ``global_clipnorm``:
stock unscales the gradients (``float32(g) / scale``), the inner optimizer
clips them with TensorFlow's ops, then updates.  Ours must leave every
model variable, slot, ``iterations``, ``dynamic_scale`` and
``step_counter`` bit-identical after every step, with ``step_path`` saying
fused:

* every fused family, each clip option, thresholds that clip some
  variables or steps and not others, overflow steps, ``tf.function`` and
  eager, under ``mixed_float16`` and ``mixed_bfloat16`` (the model's
  float32 gradients);
* float16, bfloat16 and mixed gradient lists applied directly, with a
  learning-rate schedule and a loss scale grown from below 2**39 to far
  above it, where the norms of float16 gradients switch from the scaled
  values to the stock ``g / scale`` (``_fused._squared_norms``); that
  switch is checked on its own against TensorFlow's ops on gradients
  whose squares the scaled way would get wrong;
* TensorFlow 2.4's loop (``experimental.LossScaleOptimizer``, gradients
  already unscaled) and the ``loss_scale=`` mode (gradients times
  ``1 / scale``) against TensorFlow's ``DynamicLossScale`` driving the
  stock inner optimizer;
* with ``gradient_accumulation_steps``, Keras clips each update step's
  averages: every family and each clip, in a graph and
  eagerly; over 3 steps in a graph the stock path, saying why;
* a clip that is not a positive finite number raises ``ValueError`` naming
  it, and changes nothing; float16 gradients that the inner optimizer
  would clip in float16 take the stock path, saying so.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from lossscale import _fused
from helpers import bits, keras3_train_step, mse_loss, tf_dynamic
from test_fused_step import (Ours, Stock, assert_fused, assert_same_state, assert_twins_agree,
                             batches, excluding_biases, factor, lockstep, make_pair, schedule,
                             state, tf24_twins, twin_models)

# One inner optimizer per fused family (AdamW is Adam's), a schedule and
# weight decay among them; ``clip`` is the clip keyword.
FAMILY_INNERS = {
    "sgd_nesterov_schedule": lambda **clip: keras.optimizers.SGD(
        schedule(), momentum=0.9, nesterov=True, **clip),
    "adam": lambda **clip: keras.optimizers.Adam(0.003, **clip),
    "adamw_exclude": lambda **clip: excluding_biases(
        keras.optimizers.AdamW(0.003, weight_decay=0.004, **clip)),
    "rmsprop_centered_decay": lambda **clip: keras.optimizers.RMSprop(
        0.002, rho=0.8, momentum=0.5, epsilon=1e-3, centered=True, weight_decay=0.01, **clip),
    "adagrad_decay": lambda **clip: keras.optimizers.Adagrad(
        0.05, initial_accumulator_value=0.37, epsilon=1e-5, weight_decay=0.02, **clip),
    "adamax_schedule": lambda **clip: keras.optimizers.Adamax(
        schedule(), beta_1=0.8, beta_2=0.95, epsilon=1e-4, **clip),
    "nadam_decay": lambda **clip: keras.optimizers.Nadam(0.003, weight_decay=0.01, **clip),
    "lion": lambda **clip: keras.optimizers.Lion(0.0005, **clip),
    "adafactor_decay": lambda **clip: keras.optimizers.Adafactor(0.01, weight_decay=0.01,
                                                                 **clip),
    "lamb_decay_exclude": lambda **clip: excluding_biases(
        keras.optimizers.Lamb(0.003, weight_decay=0.01, **clip)),
}

CLIPS = ["clipnorm", "clipvalue", "global_clipnorm"]

RUNS = [("mixed_float16", False, 80), ("mixed_bfloat16", False, 80),
        ("mixed_float16", True, 10)]


def test_every_family_is_covered():
    covered = {_fused.family_of(make()).name for make in FAMILY_INNERS.values()}
    assert covered == {f.name for f in _fused.FAMILIES}


def true_gradients(policy, steps):
    """The unscaled gradients of the twins' first model over the first
    batches, untrained: what the clip thresholds are chosen from."""
    model = twin_models(policy)[0]
    out = []
    for x, y in batches(steps):
        with tf.GradientTape() as tape:
            loss = mse_loss(model, tf.constant(x), tf.constant(y), tf.constant(1.0, tf.float32))
        out.append([g.numpy().astype(np.float64) for g in
                    tape.gradient(loss, model.trainable_variables)])
    return out


def clip_measures(policy, clip):
    """What ``clip`` compares with its threshold on the untrained model's
    first batches: the per-variable norms, the global norms, or (of the
    first batch) the magnitudes."""
    grads = true_gradients(policy, 6)
    if clip == "clipnorm":
        return np.array([np.linalg.norm(g) for step in grads for g in step])
    if clip == "global_clipnorm":
        return np.array([np.sqrt(sum(np.sum(g * g) for g in step)) for step in grads])
    return np.concatenate([np.abs(g).reshape(-1) for g in grads[0]])


def threshold(policy, clip):
    """A clip value that clips some of the gradients and not others: the
    median per-variable norm, global norm or nonzero magnitude."""
    values = clip_measures(policy, clip)
    if clip == "clipvalue":
        values = values[values != 0]
    return float(np.median(values))


def clipped_somewhere_not_everywhere(policy, clip, value):
    """Whether the threshold clips on the untrained model's first batches
    and also leaves something unclipped (the test's own premise)."""
    measures = clip_measures(policy, clip)
    return measures.min() < value < measures.max()


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("name", list(FAMILY_INNERS))
@pytest.mark.parametrize("policy,eager,steps", RUNS,
                         ids=[f"{p}-{'eager' if e else 'function'}" for p, e, _ in RUNS])
def test_bit_identical_to_stock_every_step(policy, eager, steps, name, clip):
    value = threshold(policy, clip)
    assert clipped_somewhere_not_everywhere(policy, clip, value)
    models, opts = make_pair(functools.partial(FAMILY_INNERS[name], **{clip: value}), policy,
                             dynamic_growth_steps=10)
    scales = lockstep(models, opts, batches(steps), policy, eager=eager)
    assert_fused(opts[1])
    assert min(b / a for a, b in zip(scales, scales[1:])) < 1  # overflow steps were skipped


# Keras clips an update step's averages under gradient accumulation: every
# family, each clip,
# over 4 steps in a graph and 3 eagerly (a count that is not a power of two
# keeps the stock path in a graph: test below).
ACCUMULATE_RUNS = [("mixed_float16", False, 48, 4), ("mixed_bfloat16", False, 48, 4),
                   ("mixed_float16", True, 16, 3)]


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("name", list(FAMILY_INNERS))
@pytest.mark.parametrize("policy,eager,steps,every", ACCUMULATE_RUNS,
                         ids=[f"{p}-{'eager' if e else 'function'}-{n}"
                              for p, e, _, n in ACCUMULATE_RUNS])
def test_accumulated_averages_clipped_as_stock(policy, eager, steps, every, name, clip):
    """With ``gradient_accumulation_steps`` Keras clips each update step's
    averages ``(g + acc) / steps``, by their norms, and none of the steps
    that only accumulate: the fused update step makes the averages with
    Keras' ops, takes their norms and updates by them, bit for bit."""
    value = threshold(policy, clip)
    models, opts = make_pair(functools.partial(FAMILY_INNERS[name], **{clip: value},
                                               gradient_accumulation_steps=every),
                             policy, dynamic_growth_steps=10)
    scales = lockstep(models, opts, batches(steps), policy, eager=eager)
    assert_fused(opts[1])
    assert min(b / a for a, b in zip(scales, scales[1:])) < 1  # overflow steps were skipped
    assert int(opts[1].inner_optimizer.iterations.numpy()) >= 2  # updates were made


@pytest.mark.parametrize("clip", CLIPS)
def test_accumulation_over_three_steps_clipped_in_a_graph_takes_the_stock_path(clip):
    """In a graph the average's division by 3 becomes a product by 1 / 3
    that TensorFlow's graph optimizer merges into the clip's products: the
    stock path, saying so, and still stock's bits."""
    models, opts = make_pair(functools.partial(FAMILY_INNERS["adam"], **{clip: 0.05},
                                               gradient_accumulation_steps=3),
                             "mixed_float16", dynamic_growth_steps=10)
    lockstep(models, opts, batches(12), "mixed_float16")
    assert opts[1].step_path.startswith(
        "stock: clipping with gradient_accumulation_steps=3 in a graph"), opts[1].step_path


SGD_GLOBAL = {
    "plain": lambda: keras.optimizers.SGD(0.02, global_clipnorm=0.01),
    "momentum": lambda: keras.optimizers.SGD(0.02, momentum=0.9, global_clipnorm=0.01),
    "nesterov_cosine": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.CosineDecay(0.05, 30), momentum=0.9, nesterov=True,
        global_clipnorm=0.01),
}


@pytest.mark.parametrize("name", list(SGD_GLOBAL))
def test_sgd_global_clipnorm_fused_eagerly_and_in_a_graph(name):
    """SGD's `u * factor * lr`: eagerly as written; in a graph TensorFlow's
    graph optimizer may reorder it to `u * (factor * lr)`
    (``_fused._graph_reorders_clip``).  Fused both ways, the same bits."""
    for eager in (True, False):
        models, opts = make_pair(SGD_GLOBAL[name], "mixed_float16", dynamic_growth_steps=10)
        lockstep(models, opts, batches(12 if eager else 40), "mixed_float16", eager=eager)
        assert_fused(opts[1])


def either_kind_of_function_states(make_inner, shapes, returns, steps=8):
    """Stock's and ours' variables and optimizer variables after each of
    ``steps`` applies, in a tf.function that returns a value or nothing, on
    variables of ``shapes`` (the fifth step overflows)."""
    states = []
    for cls in (keras.optimizers.LossScaleOptimizer, lossscale.LossScaleOptimizer):
        rng = np.random.default_rng(7)
        variables = [keras.Variable(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        opt = cls(make_inner(), initial_scale=1024.0, dynamic_growth_steps=3)
        opt.build(variables)

        @tf.function
        def step(grads):
            opt.apply(grads, variables)
            if returns:
                return tf.constant(0.0)
            return None

        history = []
        for i in range(steps):
            grads = [rng.standard_normal(s).astype(np.float32) * np.float32(300.0)
                     for s in shapes]
            if i == 4:
                grads[-1].reshape(-1)[0] = np.inf
            step([tf.constant(g) for g in grads])
            history.append([bits(np.asarray(v.numpy()))
                            for v in variables + list(opt.variables)])
        if cls is lossscale.LossScaleOptimizer:
            assert_fused(opt)
        states.append(history)
    return states


def assert_same_history(states):
    for i, (a, b) in enumerate(zip(*states)):
        assert a == b, f"step {i}: {[k for k, (x, y) in enumerate(zip(a, b)) if x != y]}"


KINDS = dict(argnames="returns", argvalues=[True, False],
             ids=["returns_a_value", "returns_nothing"])


@pytest.mark.parametrize(**KINDS)
@pytest.mark.parametrize("shapes", [[(), (1,), (19,), (37, 19)], [(37, 19)]],
                         ids=["four_variables", "one_variable"])
@pytest.mark.parametrize("name", list(SGD_GLOBAL))
def test_sgd_global_clipnorm_in_either_kind_of_function(name, shapes, returns):
    """The graph optimizer reorders stock's chain in a tf.function that returns
    a value (every variable of rank >= 1) and not in one that returns nothing
    (its gradients' all-reduce IdentityN stays, unless there is one
    gradient): the fused step reads which, and is stock's bits in each."""
    assert_same_history(either_kind_of_function_states(SGD_GLOBAL[name], shapes, returns))


@pytest.mark.parametrize(**KINDS)
@pytest.mark.parametrize("clip", [None] + CLIPS)
@pytest.mark.parametrize("name", list(FAMILY_INNERS))
def test_every_family_in_either_kind_of_function(name, clip, returns):
    """What the graph optimizer rewrites can hang on whether the function
    returns a value (centered RMSprop's `(v - s) + eps`, pushed down only
    then: ``_fused._graph_pushes_down``): every family, with each clip and
    none, on a rank-0, a one-element and larger variables, in both kinds."""
    kwargs = {clip: 0.01} if clip else {}
    assert_same_history(either_kind_of_function_states(
        functools.partial(FAMILY_INNERS[name], **kwargs), [(), (1,), (19,), (37, 19)],
        returns, steps=6))


def test_graph_reorders_clip_reads_the_order_tensorflow_ran():
    """The probe's premise, on TensorFlow's own ops: its lanes tell the two
    orders apart, and in a function that returns a value it reads the
    reordered chain."""
    factor, lr = np.float32(0.7310585), np.float32(0.0123)
    lanes = _fused._PROBE_LANES
    apart = ((lanes * factor) * lr).view(np.uint32)
    merged = (lanes * (factor * lr)).view(np.uint32)
    assert not np.array_equal(apart, merged)
    probe = tf.function(lambda f, l: _fused._graph_reorders_clip(f, l, 5))
    assert bool(probe(tf.constant(factor), tf.constant(lr)).numpy())
    # A power-of-two learning rate: the two orders agree on every value.
    assert bool(probe(tf.constant(factor), tf.constant(np.float32(2.0**-7))).numpy())


# --------------------------------------- 16-bit gradients, a growing scale

SHAPES = [(7,), (33, 5), (1000,), (3,), (4, 4, 2)]


def direct_gradients(rng, dtypes, overflow):
    """Gradients as a 16-bit (or float32) backward pass leaves them: random
    magnitudes over many binades, zeros, the smallest subnormals, and a
    non-finite value when ``overflow``."""
    out = []
    for shape, dtype in zip(SHAPES, dtypes):
        g = rng.standard_normal(shape) * np.exp2(rng.uniform(-10, 8, shape))
        flat = g.reshape(-1)
        flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = 0.0
        if dtype == tf.float16:
            flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = 2.0**-24
        elif dtype == tf.bfloat16:
            flat[rng.integers(0, flat.size, max(1, flat.size // 10))] = 2.0**-126
        out.append(tf.cast(tf.constant(g, tf.float32), dtype))
    if overflow:
        k = int(rng.integers(0, len(out)))
        g = out[k].numpy().reshape(-1)
        g[int(rng.integers(0, g.size))] = overflow
        out[k] = tf.constant(g.reshape(SHAPES[k]), out[k].dtype)
    return out


DTYPE_LISTS = {
    "float16": [tf.float16] * len(SHAPES),
    "bfloat16": [tf.bfloat16] * len(SHAPES),
    "mixed": [tf.float16, tf.float32, tf.bfloat16, tf.float16, tf.float32],
}

DIRECT_OVERFLOWS = {2: np.inf, 9: np.nan, 10: -np.inf, 23: np.inf}


@pytest.mark.parametrize("eager", [False, True], ids=["function", "eager"])
@pytest.mark.parametrize("clip,value", [("clipnorm", 2.0**-28), ("global_clipnorm", 2.0**-26),
                                        ("clipvalue", 2.0**-33)])
@pytest.mark.parametrize("dtypes", list(DTYPE_LISTS))
def test_low_precision_gradients_and_a_scale_past_the_scaled_norm(dtypes, clip, value, eager):
    """The scale starts at 2**30 and doubles every good step to far past
    2**39; the true gradients (g / scale) shrink with it, so the clip
    thresholds clip at first and not later."""
    variables = [[keras.Variable(np.full(s, 0.5, np.float32), name=f"w{i}")
                  for i, s in enumerate(SHAPES)] for _ in range(2)]
    inners = [keras.optimizers.Adam(schedule(), **{clip: value}) for _ in range(2)]
    opts = [Stock(inners[0], initial_scale=2.0**30, dynamic_growth_steps=1),
            Ours(inners[1], initial_scale=2.0**30, dynamic_growth_steps=1)]
    for opt, vs in zip(opts, variables):
        opt.build(vs)

    def apply(opt, vs):
        step = lambda grads: opt.apply(grads, vs)  # noqa: E731
        return step if eager else tf.function(step)

    steps = [apply(opt, vs) for opt, vs in zip(opts, variables)]
    rng = np.random.default_rng(5)
    scales, clipped = [], set()
    for i in range(30):
        grads = direct_gradients(rng, DTYPE_LISTS[dtypes], DIRECT_OVERFLOWS.get(i))
        if i not in DIRECT_OVERFLOWS:
            clipped.add(clips(clip, value, grads, float(opts[0].dynamic_scale.numpy())))
        for step in steps:
            step(grads)
        assert_same_state(
            [(v.path, bits(v.numpy())) for v in variables[0] + list(opts[0].variables)],
            [(v.path, bits(v.numpy())) for v in variables[1] + list(opts[1].variables)],
            f"step {i}")
        scales.append(float(opts[1].dynamic_scale.numpy()))
    assert_fused(opts[1])
    assert scales[0] < 2.0**39 < 2.0**50 < scales[-1], scales
    assert clipped == {True, False}


def clips(clip, value, grads, scale):
    """Whether ``clip`` at ``value`` changes any of these gradients
    unscaled (in float64: near enough to tell)."""
    u = [g.numpy().astype(np.float64) / scale for g in grads]
    if clip == "clipnorm":
        return any(np.linalg.norm(x) > value for x in u)
    if clip == "global_clipnorm":
        return np.sqrt(sum(np.sum(x * x) for x in u)) > value
    return any(np.any(np.abs(x) > value) for x in u)


def stock_squared_norm(g, scale):
    """What stock Keras sums: ``reduce_sum(square(float32(g) / scale))``."""
    return tf.reduce_sum(tf.square(tf.cast(g, tf.float32) / scale))


@pytest.mark.parametrize("eager", [False, True], ids=["function", "eager"])
def test_squared_norms_are_stock_on_both_sides_of_the_bound(eager):
    """Float16 values whose unscaled squares fall below float32's normal
    range once the scale passes 2**39 (TensorFlow flushes them to zero),
    next to values that set the sum's last bits: the scaled sum, rescaled,
    is then wrong, and ``_squared_norms`` must take the stock way."""
    rng = np.random.default_rng(2)
    tiny = np.full(4096, 2.0**-24)
    tiny[::7] = 2.0**-14
    grads = [tf.constant(tiny.astype(np.float16)),
             tf.constant((rng.standard_normal(1001) * 4).astype(np.float16)),
             tf.constant((rng.standard_normal(257) * 100).astype(np.float32)),
             tf.constant(np.array([0, 0, 0], np.float16))]

    def both(scale):
        return (_fused._squared_norms(grads, scale, "divide"),
                [stock_squared_norm(g, scale) for g in grads])

    run = both if eager else tf.function(both)
    # the bound, one past it, well past, below 1, not a power of two
    for scale in [2.0**39, 2.0**40, 2.0**45, 2.0**15, 2.0**-3, 1000.0, 3.0 * 2.0**40]:
        got, want = run(tf.constant(scale, tf.float32))
        for k, (a, b) in enumerate(zip(got, want)):
            assert bits(a.numpy()) == bits(b.numpy()), (scale, k, a.numpy(), b.numpy())
    # The case the bound exists for: past it, the rescaled scaled sum differs.
    scale = tf.constant(2.0**45, tf.float32)
    naive = tf.reduce_sum(tf.square(tf.cast(grads[0], tf.float32))) * (1 / scale) * (1 / scale)
    assert bits(naive.numpy()) != bits(stock_squared_norm(grads[0], scale).numpy())


# ----------------------------------------------- TensorFlow 2.4's loop


CLIPPED_ADAMS = [("clipnorm", 0.02), ("global_clipnorm", 0.05), ("clipvalue", 0.002)]


def tf24_lockstep(opt, make_inner, reference_scale, seed, **twins):
    """40 steps of ``opt`` on one twin and of TensorFlow's ``reference_scale``
    around a stock ``make_inner()`` on the other (``tf24_twins``), the scale
    and every variable compared after each."""
    models = twin_models("mixed_float16")
    opt.build(models[1].trainable_variables)
    reference_inner, reference_step, step = tf24_twins(models, opt, make_inner, reference_scale,
                                                       **twins)
    for i, (x, y) in enumerate(batches(40, seed=seed)):
        f = tf.constant(factor(i, "mixed_float16"))
        reference_step(x, y, f)
        step(x, y, f)
        assert bits(opt.loss_scale.numpy()) == bits(reference_scale().numpy()), i
        assert_twins_agree(models, reference_inner.variables, opt.inner_optimizer.variables,
                           f"step {i}")
    assert_fused(opt)


@pytest.mark.parametrize("clip,value", CLIPPED_ADAMS)
def test_tf24_loop_bit_identical_to_tensorflow_reference(clip, value):
    """``experimental.LossScaleOptimizer.apply_gradients`` on unscaled
    gradients: TensorFlow's own ``DynamicLossScale`` checks them and the
    stock inner optimizer clips and applies them."""
    from lossscale import experimental

    make = functools.partial(keras.optimizers.Adam, 0.003, **{clip: value})
    opt = experimental.LossScaleOptimizer(make(), experimental.DynamicLossScale(2.0**10, 5))
    tf24_lockstep(opt, make, tf_dynamic(initial_loss_scale=2.0**10, increment_period=5), seed=6,
                  count_skipped=True)


@pytest.mark.parametrize("clip,value", CLIPPED_ADAMS)
def test_loss_scale_object_mode_bit_identical_to_tensorflow_reference(clip, value):
    """With ``loss_scale=`` a ``DynamicLossScale`` the gradients are unscaled
    as TensorFlow 2.4 did (times ``1 / scale``) before the inner optimizer
    clips them: TensorFlow's own ``DynamicLossScale`` driving the stock
    inner optimizer is the reference."""
    make = functools.partial(keras.optimizers.Adam, 0.003, **{clip: value})
    ours = Ours(make(), loss_scale=lossscale.DynamicLossScale(2.0**10, 3, 2.0))
    tf24_lockstep(ours, make,
                  tf_dynamic(initial_loss_scale=2.0**10, increment_period=3, multiplier=2.0),
                  seed=11, train_step=keras3_train_step)


# --------------------------------------------------------- bad input


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 1e39, "0.5", True],
                         ids=["negative", "nan", "inf", "overflows_float32", "string", "bool"])
@pytest.mark.parametrize("clip", CLIPS)
def test_bad_clip_value_raises_naming_it_and_changes_nothing(clip, value, mode):
    """Stock Keras takes any of these at construction and then ignores a
    negative or NaN one, or turns every gradient into NaN with an infinite
    one: ours refuses each with an error that names it."""
    models = twin_models("mixed_float16")
    model = models[0]
    inner = keras.optimizers.Adam(0.003)
    opt = Ours(inner, dynamic_growth_steps=10)
    opt.build(model.trainable_variables)
    setattr(inner, clip, value)
    x, y = batches(1)[0]
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(mse_loss(model, tf.constant(x), tf.constant(y),
                                       tf.constant(1.0)))
    grads = tape.gradient(loss, model.trainable_variables)
    before = state(model, opt)
    apply = (lambda: opt.apply(grads, model.trainable_variables))
    with pytest.raises(ValueError, match=f"{clip} must be a positive finite number"):
        apply() if mode == "eager" else tf.function(apply)()
    assert_same_state(state(model, opt), before, "after the bad call")


def test_clip_of_zero_clips_nothing_as_stock():
    inner = keras.optimizers.SGD(0.1, clipnorm=0.0)
    assert _fused.clip_of(inner) is None
    assert Ours(inner).step_path.startswith("fused")


def test_clip_held_in_a_variable_takes_the_stock_path():
    inner = keras.optimizers.SGD(0.1)
    inner.clipnorm = tf.Variable(1.0)
    assert Ours(inner).step_path == "stock: the inner optimizer's clipnorm is not a number"


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_unscaled_16_bit_gradients_clipped_by_the_inner_optimizer_take_the_stock_path(dtype):
    """TensorFlow 2.4's loop hands the inner optimizer 16-bit gradients as
    they are, which Keras clips in their own dtype."""
    from lossscale import experimental

    variables = [keras.Variable(np.ones(5, np.float32))]
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1, clipvalue=0.5), "dynamic")
    opt.apply_gradients(zip([tf.ones(5, dtype)], variables))
    assert opt.step_path == (f"stock: clipping {dtype.name} gradients (the inner optimizer "
                             f"clips them in {dtype.name})")
