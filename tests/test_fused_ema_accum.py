"""EMA and gradient accumulation on the fused step, against stock Keras.

The oracle is stock ``keras.optimizers.LossScaleOptimizer(inner)`` with an
inner optimizer of every fused family that sets ``use_ema`` (several
``ema_momentum`` values, ``ema_overwrite_frequency`` None and several
periods), ``gradient_accumulation_steps`` (2, 3 and 4) or both, twin models
as in ``test_fused_step``, overflow forced on steps that fall both where the
inner optimizer only accumulates and where it updates. After every step
every model variable, every slot, every EMA copy and accumulator,
``iterations``, ``dynamic_scale`` and ``step_counter`` must be
bit-identical, under ``mixed_float16`` and ``mixed_bfloat16``, in
``tf.function`` and eagerly, with constant and scheduled learning rates, a
scale with an inexact reciprocal, across a ``.keras`` save and load
mid-accumulation, and through ``fit`` (whose end overwrites the variables
with their EMA), and on an embedding model, whose sparse gradient Keras'
accumulation densifies, clipped too (Keras clips the averages). The step
must say it was fused. A ``LossScale`` rule is held to its own stock path,
TensorFlow 2.4's loop to TensorFlow's own ``DynamicLossScale`` driving the
stock inner optimizer; gradients they cannot accumulate (float16 after
unscaling in their own dtype) raise before anything moves. What takes the
stock path says why: an average over a count that is not a power of two in a
graph, a ``tf.distribute`` strategy, and Muon.

An update step is one fused op: it reads each gradient and its
accumulator, averages them as stock does (a division eagerly, the product
by ``1 / steps`` TensorFlow's graph optimizer makes of it in a
``tf.function``), updates and zeroes the accumulator; only the
accumulators of variables without a gradient are zeroed apart.  AdamW
and SGD over 2, 3 and 4 steps (and over 3 with constant folding or the
arithmetic optimizer off), a variable whose gradient is None on some
steps, the accumulators kept in their own buffers, and the op's own
checks of its accumulators (each refused before anything moves).
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from helpers import assert_same_bits, batch_recorder, bits, keras3_train_step, tf_dynamic
from test_fused_step import (INF, NAN, RUN_IDS, RUNS, Ours, Stock, assert_fused,
                             assert_same_state, assert_twins_agree, batches, build_model,
                             excluding_biases, make_pair, own_state, schedule, state,
                             state_reader, step_fn, tf24_twins, twin_models)

opt_ = keras.optimizers


def adamw_excluding_biases(**kw):
    return excluding_biases(opt_.AdamW(**kw))


# Every fused family with EMA, with accumulation, and with both.  A
# schedule with weight decay decays by the graph's own factor
# (test_fused_step), on the update steps alone with accumulation.
EMA = {
    "sgd_momentum": lambda: opt_.SGD(0.02, momentum=0.9, use_ema=True),
    "sgd_nesterov_schedule": lambda: opt_.SGD(schedule(), momentum=0.9, nesterov=True,
                                              use_ema=True, ema_momentum=0.9,
                                              ema_overwrite_frequency=5),
    "adam": lambda: opt_.Adam(0.003, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=1),
    "adamw_exclude": lambda: adamw_excluding_biases(learning_rate=0.003, weight_decay=0.004,
                                                    use_ema=True, ema_overwrite_frequency=3),
    "rmsprop_efficientnet": lambda: opt_.RMSprop(rho=0.9, momentum=0.9, epsilon=0.001,
                                                 use_ema=True),
    "adagrad_schedule": lambda: opt_.Adagrad(schedule(), use_ema=True, ema_momentum=0.999,
                                             ema_overwrite_frequency=7),
    "adamax_decay": lambda: opt_.Adamax(0.003, weight_decay=0.01, use_ema=True,
                                        ema_momentum=0.75),
    "nadam_schedule": lambda: opt_.Nadam(schedule(), beta_1=0.8, use_ema=True,
                                         ema_overwrite_frequency=4),
    "lion_decay": lambda: opt_.Lion(0.0005, weight_decay=0.01, use_ema=True, ema_momentum=0.9,
                                    ema_overwrite_frequency=2),
}

ACCUMULATE = {
    "sgd_momentum": lambda: opt_.SGD(0.02, momentum=0.9, gradient_accumulation_steps=2),
    "sgd_weight_decay": lambda: opt_.SGD(0.02, momentum=0.5, weight_decay=0.01,
                                         gradient_accumulation_steps=4),
    "adam_amsgrad_schedule": lambda: opt_.Adam(schedule(), amsgrad=True,
                                               gradient_accumulation_steps=4),
    "adamw_exclude": lambda: adamw_excluding_biases(learning_rate=0.003, weight_decay=0.004,
                                                    gradient_accumulation_steps=4),
    "rmsprop_centered_decay": lambda: excluding_biases(opt_.RMSprop(
        0.002, rho=0.8, momentum=0.5, epsilon=1e-3, centered=True, weight_decay=0.01,
        gradient_accumulation_steps=2)),
    "adagrad_decay": lambda: opt_.Adagrad(0.05, initial_accumulator_value=0.37, epsilon=1e-5,
                                          weight_decay=0.02, gradient_accumulation_steps=2),
    "adamax_schedule": lambda: opt_.Adamax(schedule(), beta_1=0.8, beta_2=0.95, epsilon=1e-4,
                                           gradient_accumulation_steps=4),
    "nadam_decay": lambda: opt_.Nadam(0.003, weight_decay=0.01, gradient_accumulation_steps=2),
    "lion_schedule": lambda: opt_.Lion(schedule(), beta_1=0.8, beta_2=0.95,
                                       gradient_accumulation_steps=4),
    "adamw_schedule_decay": lambda: adamw_excluding_biases(
        learning_rate=schedule(), weight_decay=0.01, gradient_accumulation_steps=4),
    "adamw_bert_polynomial_3": lambda: opt_.AdamW(
        keras.optimizers.schedules.PolynomialDecay(0.01, 50, end_learning_rate=0.001),
        weight_decay=0.01, epsilon=1e-6, gradient_accumulation_steps=3),
    "sgd_nesterov_cosine_decay": lambda: opt_.SGD(
        keras.optimizers.schedules.CosineDecay(0.02, 40, warmup_target=0.05, warmup_steps=5),
        momentum=0.9, nesterov=True, weight_decay=0.004, gradient_accumulation_steps=4),
    "rmsprop_schedule_decay": lambda: opt_.RMSprop(schedule(), momentum=0.9, weight_decay=0.01,
                                                   gradient_accumulation_steps=2),
    # Adafactor's update step by the averages (its op takes no accumulators).
    "adafactor_decay": lambda: opt_.Adafactor(0.01, weight_decay=0.01,
                                              gradient_accumulation_steps=2),
    "adafactor_schedule_3": lambda: opt_.Adafactor(schedule(), gradient_accumulation_steps=3),
    "lion_polynomial_decay": lambda: opt_.Lion(
        keras.optimizers.schedules.PolynomialDecay(0.01, 50, end_learning_rate=0.001),
        weight_decay=0.05, gradient_accumulation_steps=4),
}

BOTH = {
    "adafactor": lambda: opt_.Adafactor(0.01, use_ema=True, ema_overwrite_frequency=3,
                                        gradient_accumulation_steps=4),
    # Lamb's update step by the averages too (its op takes no accumulators).
    "lamb_decay": lambda: opt_.Lamb(0.003, weight_decay=0.01, use_ema=True,
                                    ema_overwrite_frequency=3, gradient_accumulation_steps=2),
    "adam_cosine_decay": lambda: opt_.Adam(
        keras.optimizers.schedules.CosineDecay(0.02, 40, warmup_target=0.05, warmup_steps=5),
        weight_decay=0.02, use_ema=True, ema_overwrite_frequency=3,
        gradient_accumulation_steps=2),
    "adam_schedule": lambda: opt_.Adam(schedule(), use_ema=True, ema_momentum=0.9,
                                       ema_overwrite_frequency=2, gradient_accumulation_steps=2),
    "rmsprop_momentum": lambda: opt_.RMSprop(0.003, momentum=0.9, use_ema=True,
                                             gradient_accumulation_steps=4),
    "sgd_nesterov": lambda: opt_.SGD(0.02, momentum=0.9, nesterov=True, use_ema=True,
                                     ema_overwrite_frequency=3, gradient_accumulation_steps=4),
    "nadam": lambda: opt_.Nadam(0.003, use_ema=True, ema_momentum=0.8,
                                gradient_accumulation_steps=2),
}

# Three steps: an average whose 1 / 3 is inexact.  The value: whether the
# family multiplies the gradient by a scalar (where the graph optimizer
# merges the 1 / 3 in).
THREE = {
    "adam": (lambda: opt_.Adam(0.003, gradient_accumulation_steps=3), False),
    "adamw_ema": (lambda: adamw_excluding_biases(learning_rate=0.003, weight_decay=0.004,
                                                 use_ema=True, gradient_accumulation_steps=3),
                  False),
    "adamax": (lambda: opt_.Adamax(0.003, gradient_accumulation_steps=3), False),
    "sgd_nesterov_ema": (lambda: opt_.SGD(0.02, momentum=0.9, nesterov=True, use_ema=True,
                                          ema_overwrite_frequency=3,
                                          gradient_accumulation_steps=3), True),
    "nadam": (lambda: opt_.Nadam(0.003, gradient_accumulation_steps=3), True),
}

CASES = {**{f"ema-{k}": v for k, v in EMA.items()},
         **{f"accumulate-{k}": v for k, v in ACCUMULATE.items()},
         **{f"both-{k}": v for k, v in BOTH.items()}}

# Overflowing steps: with 2, 3 or 4 accumulation steps some of them fall
# where the inner optimizer would only accumulate and some where it would
# update, within the first 16 steps already (the eager runs).
OVERFLOWS = {1: INF, 2: NAN, 4: -INF, 7: 1e30, 8: INF, 9: NAN, 13: 1e30, 15: INF, 22: NAN,
             27: 1e30, 28: 1e30, 35: INF, 41: NAN, 42: -INF, 50: 1e30, 57: INF}


def factor(step, policy):
    f = OVERFLOWS.get(step, 1.0)
    if f == 1e30 and policy == "mixed_bfloat16":
        f = 1e38
    return np.float32(f)


def lockstep(models, opts, data, policy, *, eager=False):
    """Steps both twins, comparing everything after every step.  Returns
    ``{step: kind}`` for the steps the first twin skipped (every forced
    overflow, and any the scale caused), ``kind`` what its inner optimizer
    would have done had the step been finite: ``"update"`` or
    ``"accumulate"``."""
    steps = [step_fn(m, o, eager) for m, o in zip(models, opts)]
    readers = [state_reader(m, o) for m, o in zip(models, opts)]
    inner = opts[0].inner_optimizer
    n = inner.gradient_accumulation_steps or 1
    skipped = {}
    for i, (x, y) in enumerate(data):
        iterations = int(inner._iterations.numpy())
        for step in steps:
            step(tf.constant(x), tf.constant(y), tf.constant(factor(i, policy)))
        assert_same_state(readers[0](), readers[1](), f"step {i}")
        if int(inner._iterations.numpy()) == iterations:
            skipped[i] = "update" if (iterations + 1) % n == 0 else "accumulate"
    assert set(OVERFLOWS) & set(range(len(data))) <= set(skipped), skipped
    return skipped


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("policy,eager", RUNS, ids=RUN_IDS)
def test_bit_identical_to_stock_every_step(policy, eager, name):
    models, opts = make_pair(CASES[name], policy, dynamic_growth_steps=5)
    steps = 16 if eager else 64
    skipped = lockstep(models, opts, batches(steps, seed=11), policy, eager=eager)
    assert_fused(opts[1])
    inner = opts[1].inner_optimizer
    applied = steps - len(skipped)
    assert int(inner._iterations.numpy()) == applied
    if inner.gradient_accumulation_steps:
        # Skipped steps on both sides of the schedule, and updates made.
        assert set(skipped.values()) == {"update", "accumulate"}, skipped
        assert int(inner.iterations.numpy()) == applied // inner.gradient_accumulation_steps > 0
    if inner.use_ema:
        averages = inner._model_variables_moving_average
        assert all(np.any(a.numpy() != 0) for a in averages)


def test_inexact_reciprocal_scale_accumulates_as_stock():
    """A scale whose reciprocal is inexact (1000): stock divides each
    gradient by it before adding it up, and so does the fused step."""
    models, opts = make_pair(BOTH["sgd_nesterov"], "mixed_float16", initial_scale=1000.0,
                             dynamic_growth_steps=1000)
    lockstep(models, opts, batches(40, seed=13), "mixed_float16")
    assert not math.log2(float(opts[1].dynamic_scale.numpy())).is_integer()
    assert_fused(opts[1])


@pytest.mark.parametrize("name", list(THREE))
def test_average_over_three_steps_fused_where_exact(name):
    """Accumulating over a number of steps that is not a power of two: in a
    graph Keras' average ``(acc + g) / 3`` is a product by ``1 / 3`` that the
    graph optimizer merges into the update's own products (SGD's ``g * lr``),
    which the fused op cannot follow: the stock path, saying why.  Adam and
    Adamax have no such product: fused.  Eagerly the division is a
    division, fused."""
    make_inner, scales_gradient = THREE[name]
    # (policy, eager, steps, initial scale): under bfloat16 a high scale,
    # for the forced overflows to overflow.
    runs = [("mixed_float16", False, 40, 2.0**8), ("mixed_bfloat16", False, 40, 2.0**15),
            ("mixed_float16", True, 16, 2.0**8)]
    for policy, eager, steps, scale in runs:
        models, opts = make_pair(make_inner, policy, initial_scale=scale, dynamic_growth_steps=5)
        skipped = lockstep(models, opts, batches(steps, seed=12), policy, eager=eager)
        assert set(skipped.values()) == {"update", "accumulate"}, skipped
        if eager or not scales_gradient:
            assert_fused(opts[1])
        else:
            assert opts[1].step_path == (
                "stock: gradient_accumulation_steps=3 in a graph (TensorFlow's graph optimizer "
                "merges the average's 1 / 3 into the update's products)"), opts[1].step_path


# The recipe's AdamW (no product of the gradient by a scalar: fused at any
# count) and SGD with momentum (``g * lr``: the graph optimizer merges the
# average's 1 / 3 into it, the stock path), over 2, 3 and 4 steps.
RECIPES = {"adamw": (lambda steps: adamw_excluding_biases(
               learning_rate=0.003, weight_decay=0.004, gradient_accumulation_steps=steps),
               False),
           "sgd_momentum": (lambda steps: opt_.SGD(0.02, momentum=0.9,
                                                   gradient_accumulation_steps=steps), True)}


@pytest.mark.parametrize("steps", [2, 3, 4])
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("policy,eager", RUNS, ids=RUN_IDS)
def test_average_over_two_three_and_four_steps(policy, eager, name, steps):
    """Every step as stock's, overflows on both kinds of step; fused but
    where the graph optimizer merges an inexact ``1 / steps`` into the
    update's products, which says so."""
    make, scales_gradient = RECIPES[name]
    scale = 2.0**15 if policy == "mixed_bfloat16" else 2.0**8
    models, opts = make_pair(lambda: make(steps), policy, initial_scale=scale,
                             dynamic_growth_steps=5)
    count = 16 if eager else 32
    skipped = lockstep(models, opts, batches(count, seed=20 + steps), policy, eager=eager)
    assert set(skipped.values()) == {"update", "accumulate"}, skipped
    assert int(opts[1].inner_optimizer.iterations.numpy()) > 0
    if steps == 3 and scales_gradient and not eager:
        assert opts[1].step_path == (
            "stock: gradient_accumulation_steps=3 in a graph (TensorFlow's graph optimizer "
            "merges the average's 1 / 3 into the update's products)"), opts[1].step_path
    else:
        assert_fused(opts[1])


@pytest.mark.parametrize("option", ["constant_folding", "arithmetic_optimization"])
def test_average_over_three_steps_with_a_graph_pass_off(option):
    """Without constant folding stock's graph divides by 3, as eagerly, and
    the fused step divides too (SGD's product is then nothing to merge
    into); without the arithmetic optimizer it multiplies by 1 / 3 and
    merges nothing: SGD fuses as well."""
    previous = tf.config.optimizer.get_experimental_options().get(option, True)
    tf.config.optimizer.set_experimental_options({option: False})
    try:
        for name in RECIPES:
            models, opts = make_pair(lambda: RECIPES[name][0](3), "mixed_float16",
                                     initial_scale=2.0**8, dynamic_growth_steps=5)
            skipped = lockstep(models, opts, batches(24, seed=23), "mixed_float16")
            assert set(skipped.values()) == {"update", "accumulate"}, skipped
            assert_fused(opts[1])
    finally:
        tf.config.optimizer.set_experimental_options({option: previous})


def traced_ops(opt, variables, grads):
    """The fused step's ops in one traced ``apply`` (its ``cond`` branches
    included): ``(family, num_accumulators, accumulation, steps)`` of each
    ``LossScaleApplyOptimizer``, and ``N`` of each
    ``LossScaleZeroVariables``."""
    graph = tf.function(lambda: opt.apply(grads, variables)).get_concrete_function().graph
    gd = graph.as_graph_def()
    nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]
    fused = sorted((n.attr["family"].s.decode(), n.attr["num_accumulators"].i,
                    n.attr["accumulation"].s.decode(), n.attr["accumulation_steps"].i)
                   for n in nodes if n.op == "LossScaleApplyOptimizer")
    zeroed = [n.attr["N"].i for n in nodes if n.op == "LossScaleZeroVariables"]
    return fused, zeroed


def test_update_step_is_one_fused_op():
    """In a graph the update step is the family's op over every variable
    with its accumulator (averaged by the reciprocal, as the graph
    optimizer rewrites stock's division), and no other op zeroes an
    accumulator; a variable without a gradient leaves its accumulator to
    LossScaleZeroVariables, alone."""
    model = build_model("mixed_float16")
    variables = model.trainable_variables
    n = len(variables)
    opt = lossscale.LossScaleOptimizer(opt_.AdamW(0.003, gradient_accumulation_steps=4))
    opt.build(variables)
    grads = [tf.ones(v.shape, tf.float16) for v in variables]
    fused, zeroed = traced_ops(opt, variables, grads)
    assert_fused(opt)
    assert fused == sorted([("adam", n, "multiply", 4), ("accumulate", 0, "none", 0)]), fused
    assert zeroed == []
    fused, zeroed = traced_ops(opt, variables, grads[:-1] + [None])
    assert fused == sorted([("adam", n - 1, "multiply", 4), ("accumulate", 0, "none", 0)]), fused
    assert zeroed == [1]


def test_accumulating_step_takes_a_sparse_gradient_by_rows():
    """A step that only accumulates hands an embedding table's slices to the
    native op (one op of its own, its indices beside them) and makes no
    dense copy of them: its branch has no UnsortedSegmentSum; the update
    step densifies them, as Keras' average does."""
    table = keras.Variable(np.ones((50, 8), np.float32), name="emb_table")
    dense = keras.Variable(np.ones((4,), np.float32), name="dense")
    opt = lossscale.LossScaleOptimizer(opt_.Adam(0.01, gradient_accumulation_steps=4))
    opt.build([table, dense])
    grads = [tf.IndexedSlices(tf.ones((3, 8), tf.float16), tf.constant([7, 1, 7]),
                              tf.constant([50, 8])), tf.ones((4,), tf.float16)]
    graph = tf.function(lambda: opt.apply(grads, [table, dense])).get_concrete_function().graph
    assert_fused(opt)
    gd = graph.as_graph_def()
    bodies = [list(gd.node)] + [list(f.node_def) for f in gd.library.function]
    accumulating = [body for body in bodies if any(
        n.op == "LossScaleApplyOptimizer" and n.attr["family"].s == b"accumulate"
        for n in body)]
    assert len(accumulating) == 1
    adds = sorted((n.attr["num_sparse"].i, list(n.attr["sparse"].list.i))
                  for n in accumulating[0] if n.op == "LossScaleApplyOptimizer")
    assert adds == [(0, []), (1, [0])], adds
    assert not any(n.op == "UnsortedSegmentSum" for n in accumulating[0])
    assert any(n.op == "UnsortedSegmentSum" for body in bodies for n in body)


def test_accumulators_stay_in_their_own_buffers():
    """Over two cycles of accumulating and updating steps every accumulator
    is written in place, never copied first: each keeps its buffer (the
    update's op zeroes it there, where the next accumulating step adds)."""
    from lossscale import _loader

    address = _loader.load()[0].loss_scale_debug_buffer_address
    model = build_model("mixed_float16")
    variables = model.trainable_variables
    opt = lossscale.LossScaleOptimizer(opt_.AdamW(0.003, gradient_accumulation_steps=4),
                                       initial_scale=2.0**8)
    opt.build(variables)
    accumulators = opt.inner_optimizer._accumulated_gradients
    addresses = tf.function(lambda: [address(a.value)[1] for a in accumulators])
    step = step_fn(model, opt)
    first = [int(a) for a in addresses()]
    for i, (x, y) in enumerate(batches(8, seed=40)):
        step(tf.constant(x), tf.constant(y), tf.constant(np.float32(1.0)))
        assert [int(a) for a in addresses()] == first, f"step {i}"
        if i % 4 == 3:
            assert not any(np.any(a.numpy()) for a in accumulators), f"step {i}"
    assert int(opt.inner_optimizer.iterations.numpy()) == 2
    assert_fused(opt)


@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("eager", [False, True], ids=["function", "eager"])
def test_variable_without_gradient_accumulates_as_stock(eager, steps):
    """A variable whose gradient is None on some steps: stock adds nothing
    to its accumulator then, and zeroes it with the others on an update
    step; every state as stock's after every step."""
    models, opts = make_pair(lambda: opt_.Adam(0.003, gradient_accumulation_steps=steps),
                             "mixed_float16", initial_scale=2.0**8, dynamic_growth_steps=5)

    def drop_last(grads):
        return list(grads[:-1]) + [None]

    def stepper(model, opt):
        step = keras3_train_step(model, opt)
        plain = step if eager else tf.function(step)
        dropped = (lambda x, y, f: step(x, y, f, drop_last)) if eager else \
            tf.function(lambda x, y, f: step(x, y, f, drop_last))
        return plain, dropped

    steppers = [stepper(m, o) for m, o in zip(models, opts)]
    readers = [state_reader(m, o) for m, o in zip(models, opts)]
    accumulators = opts[1].inner_optimizer._accumulated_gradients
    zeroed_while_dropped = False
    for i, (x, y) in enumerate(batches(18, seed=30)):
        dropped = i % 3 != 0
        for plain, without in steppers:
            (without if dropped else plain)(tf.constant(x), tf.constant(y),
                                            tf.constant(factor(i, "mixed_float16")))
        assert_same_state(readers[0](), readers[1](), f"step {i}")
        if dropped and not np.any(accumulators[-1].numpy()):
            zeroed_while_dropped = True
    assert zeroed_while_dropped
    assert_fused(opts[1])


def op_setup():
    """Two SGD variables with momentum, their accumulators, and the raw
    fused op over them: ``call(accumulators, **attrs)``."""
    from lossscale import _loader

    module, _ = _loader.load()
    rng = np.random.default_rng(31)
    values = [rng.standard_normal(4).astype(np.float32),
              rng.standard_normal((2, 3)).astype(np.float32)]
    w = [tf.Variable(v, name=f"w{i}") for i, v in enumerate(values)]
    m = [tf.Variable(np.full(v.shape, 0.01, np.float32), name=f"m{i}") for i, v in
         enumerate(values)]
    acc = [tf.Variable(rng.standard_normal(v.shape).astype(np.float32), name=f"acc{i}")
           for i, v in enumerate(values)]
    grads = [(rng.standard_normal(v.shape) * 1000).astype(np.float16) for v in values]

    def call(accumulators, sparse=None, **attrs):
        kw = dict(accumulation="divide", accumulation_steps=3)
        kw.update(attrs)
        indices = [] if sparse is None else [tf.constant(np.arange(4, dtype=np.int64))]
        module.loss_scale_apply_optimizer(
            tf.constant(True), [v.handle for v in w], [v.handle for v in m],
            [tf.constant(g) for g in grads], tf.constant(1000.0), tf.constant(0.5),
            tf.constant(0.0), [], [], [], [], [], indices,
            [tf.constant(1.0)] if sparse else [], [a.handle for a in accumulators],
            family="sgd", hyper=[0.9, 0.0], decay=[0, 0], unscale="divide",
            sparse=sparse or [], **kw)

    return w, m, acc, grads, call


def test_fused_op_accumulators_checked_before_anything_moves():
    """Accumulators: one per variable with an average and a count of steps,
    each an initialized float32 variable of its variable's shape, none also
    a variable, slot or another's accumulator, on dense gradients; or an
    error naming what is wrong and no write."""
    w, m, acc, _, call = op_setup()
    short = tf.Variable(np.zeros(5, np.float32), name="short")
    wide = tf.Variable(np.zeros((2, 3), np.float64), name="wide")
    cases = [
        (lambda: call(acc[:1]), "accumulators are none or one per variable"),
        (lambda: call(acc, accumulation="none"), "accumulators are none or one per variable"),
        (lambda: call([], accumulation="divide"), "accumulators are none or one per variable"),
        (lambda: call(acc, accumulation_steps=0), r"accumulation 'divide', steps 0"),
        (lambda: call([short, acc[1]]), r"'short[^']*' has shape \[5\], its gradient has "
                                        r"shape \[4\]"),
        (lambda: call([acc[0], wide]), r"'wide[^']*' must be float32, got double"),
        (lambda: call([acc[0], w[1]]), "passed twice"),
        (lambda: call([acc[0], m[0]]), "passed twice"),
        (lambda: call([acc[0], acc[0]]), "passed twice"),
        (lambda: call(acc, sparse=[0]), "accumulators take dense gradients"),
    ]
    before = [bits(v.numpy()) for v in w + m + acc + [short, wide]]
    for bad, pattern in cases:
        with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
            bad()
        assert [bits(v.numpy()) for v in w + m + acc + [short, wide]] == before, pattern


@pytest.mark.parametrize("accumulation", ["divide", "multiply"])
def test_fused_op_averages_updates_and_zeroes(accumulation):
    """The op's update step against numpy: SGD with momentum on ``(g /
    scale + acc) / 3`` (or times float32(1 / 3)), each accumulator +0 after
    it, in its own buffer: a tensor read from it before keeps its values."""
    w, m, acc, grads, call = op_setup()
    f32 = np.float32
    old_w, old_m, old_acc = ([v.numpy() for v in vs] for vs in (w, m, acc))
    held = [a.read_value() for a in acc]
    call(acc, accumulation=accumulation)
    for i in range(2):
        u = grads[i].astype(f32) / f32(1000.0)
        total = u + old_acc[i]
        avg = total / f32(3) if accumulation == "divide" else total * (f32(1) / f32(3))
        mom = old_m[i] * f32(0.9) - avg * f32(0.5)
        assert_same_bits(m[i].numpy(), mom, f"momentum {i}")
        assert_same_bits(w[i].numpy(), old_w[i] + mom, f"variable {i}")
        assert_same_bits(acc[i].numpy(), np.zeros(old_acc[i].shape, f32), f"accumulator {i}")
        assert_same_bits(held[i].numpy(), old_acc[i], f"held value of accumulator {i}")


@pytest.mark.parametrize("eager", [False, True], ids=["function", "eager"])
def test_skipped_step_leaves_accumulators_and_averages_as_they_were(eager):
    """An overflow skips the inner optimizer's apply altogether: on stock and
    here, neither an accumulator nor an EMA copy moves, whether the step
    would have accumulated or updated."""
    models, opts = make_pair(BOTH["adam_schedule"], "mixed_float16", initial_scale=2.0**8,
                             dynamic_growth_steps=100)
    steps = [step_fn(m, o, eager) for m, o in zip(models, opts)]

    def extra(opt):
        inner = opt.inner_optimizer
        return [bits(v.numpy()) for v in
                list(inner._accumulated_gradients) + list(inner._model_variables_moving_average)]

    kinds = set()
    for i, (x, y) in enumerate(batches(12, seed=3)):
        skip = i in (3, 4, 8)
        if skip:
            kinds.add((int(opts[1].inner_optimizer._iterations.numpy()) + 1) % 2)
        before = [extra(o) for o in opts]
        for step in steps:
            step(tf.constant(x), tf.constant(y), tf.constant(np.float32(INF if skip else 1.0)))
        after = [extra(o) for o in opts]
        assert after[0] == after[1], f"step {i}"
        if skip:
            assert after == before, f"step {i}"
        else:
            assert after[1] != before[1], f"step {i}"
    assert kinds == {0, 1}
    assert_fused(opts[1])


def test_fit_bit_identical_to_stock_every_batch():
    """``fit`` under mixed_float16, a scale high enough to overflow its first
    steps, EMA and accumulation: every batch as stock, and the end of
    training's overwrite with the EMA (``finalize_variable_values``) too."""
    models = twin_models("mixed_float16")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((96, 6, 6, 2)).astype(np.float32)
    y = rng.standard_normal((96, 1)).astype(np.float32)
    recorders = []
    for model, cls in zip(models, (Stock, Ours)):
        model.compile(optimizer=cls(adamw_excluding_biases(
            learning_rate=0.003, weight_decay=0.004, use_ema=True, ema_momentum=0.9,
            gradient_accumulation_steps=2), initial_scale=2.0**20, dynamic_growth_steps=4),
            loss="mse")
        recorders.append(batch_recorder(keras.callbacks, state))
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[recorders[-1]])
    assert len(recorders[0].states) == len(recorders[1].states) == 24
    for i, (a, b) in enumerate(zip(recorders[0].states, recorders[1].states)):
        assert_same_state(a, b, f"batch {i}")
    assert_same_state(state(models[0], models[0].optimizer),
                      state(models[1], models[1].optimizer), "after fit")
    assert 0 < int(models[1].optimizer.iterations.numpy()) < 12  # some steps were skipped
    assert_fused(models[1].optimizer)


def test_save_and_load_mid_run_then_lockstep(tmp_path):
    """The accumulators, the EMA copies and their schedules' counter come
    back from a ``.keras`` file, and the loaded optimizers go on in lockstep."""
    policy = "mixed_float16"
    models, opts = make_pair(BOTH["adam_schedule"], policy, dynamic_growth_steps=5)
    for model, opt in zip(models, opts):
        model.compile(optimizer=opt, loss="mse")
    data = batches(40, seed=5)
    lockstep(models, opts, data[:19], policy)
    assert int(opts[1].inner_optimizer._iterations.numpy()) % 2 == 1  # mid-accumulation
    loaded = []
    for which, model in zip(("stock", "ours"), models):
        model.save(tmp_path / f"{which}.keras")
        loaded.append(keras.saving.load_model(tmp_path / f"{which}.keras"))
    assert type(loaded[1].optimizer) is Ours
    assert_same_state(state(models[1], opts[1]), state(loaded[1], loaded[1].optimizer),
                      "after load")
    lockstep(loaded, [m.optimizer for m in loaded], data[19:], policy)
    assert_fused(loaded[1].optimizer)


# ------------------------------------- TensorFlow 2.4's loop, experimental


@pytest.mark.parametrize("name", ["ema-adamw_exclude", "accumulate-sgd_weight_decay",
                                  "both-sgd_nesterov", "both-nadam"])
def test_tf24_loop_bit_identical_to_tensorflow_reference(name):
    """``experimental.LossScaleOptimizer.apply_gradients`` on float32
    gradients unscaled by ``get_unscaled_gradients``, against TensorFlow's
    own ``DynamicLossScale`` and the stock inner optimizer: a skipped step
    advances ``iterations`` (TensorFlow 2.4's rule), and with it the
    accumulation's schedule, as the stock inner optimizer counts it."""
    from lossscale import experimental

    models = [build_model("float32", 0), build_model("float32", 0)]
    opt = experimental.LossScaleOptimizer(CASES[name](), experimental.DynamicLossScale(
        2.0**10, 5))
    reference_scale = tf_dynamic(initial_loss_scale=2.0**10, increment_period=5)
    # TensorFlow 2.4's skipped step advances the counter the accumulation
    # follows, the inner optimizer's own.
    reference_inner, reference_step, step = tf24_twins(models, opt, CASES[name], reference_scale)

    def slots(inner):
        return [v for v in inner.variables if all(v is not u for u in own_state(inner))] + \
            own_state(inner)

    for i, (x, y) in enumerate(batches(40, seed=6)):
        # float32 gradients overflow only past float32: the loss times 1e36.
        f = tf.constant(np.float32(1e36 if i in OVERFLOWS else 1.0))
        if not bool(reference_step(x, y, f)):
            reference_inner._iterations.assign_add(1)
        step(x, y, f)
        assert bits(opt.loss_scale.numpy()) == bits(reference_scale().numpy()), f"step {i}"
        assert_twins_agree(models, slots(reference_inner), slots(opt.inner_optimizer),
                           f"step {i}")
    assert int(opt.inner_optimizer._iterations.numpy()) == 40
    assert_fused(opt)


def float16_gradients(model, scale, seed):
    """Gradients of ``scale`` times the loss, made float16 (as a custom loop
    may hand them over)."""
    x, y = batches(1, seed=seed)[0]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32) - y))
        loss = loss * scale
    return [tf.cast(g, tf.float16) for g in tape.gradient(loss, model.trainable_variables)]


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_float16_gradients_accumulate_as_stock(mode):
    """Keras 3's rule divides float16 gradients by the scale in float32
    before the inner optimizer adds them up: as stock, every step."""
    models, opts = make_pair(BOTH["adam_schedule"], "mixed_float16", initial_scale=2.0**8,
                             dynamic_growth_steps=3)
    readers = [state_reader(m, o) for m, o in zip(models, opts)]
    for i in range(10):
        for model, opt in zip(models, opts):
            grads = float16_gradients(model, opt.dynamic_scale, seed=i)
            if i == 4:
                grads[1] = grads[1] * np.float16(np.inf)
            apply = lambda g, opt=opt, model=model: opt.apply(g, model.trainable_variables)
            (apply if mode == "eager" else tf.function(apply))(grads)
        assert_same_state(readers[0](), readers[1](), f"step {i}")
    assert 0 < int(opts[1].inner_optimizer.iterations.numpy())
    assert_fused(opts[1])


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("loop", ["tf24", "loss_scale"])
def test_float16_gradients_that_cannot_accumulate_raise_and_change_nothing(loop, mode):
    """Unscaled in their own dtype (TensorFlow 2.4's loop, or a ``LossScale``
    rule), float16 gradients stay float16, which stock Keras cannot add to
    its float32 accumulators (it fails inside its step): a ValueError naming
    the argument and the variable, before anything moves."""
    from lossscale import experimental

    model = build_model("mixed_float16")
    inner = opt_.Adam(0.003, gradient_accumulation_steps=2)
    if loop == "tf24":
        opt = experimental.LossScaleOptimizer(inner, experimental.DynamicLossScale(2.0**10, 5))

        def apply(grads):
            opt.apply_gradients(zip(grads, model.trainable_variables))
    else:
        opt = Ours(inner, loss_scale=lossscale.DynamicLossScale(2.0**10, 5))

        def apply(grads):
            opt.apply(grads, model.trainable_variables)
    opt.build(model.trainable_variables)
    grads = float16_gradients(model, 1.0, seed=0)
    before = state(model, opt)
    with pytest.raises(ValueError, match="gradient_accumulation_steps.*float16"):
        (apply if mode == "eager" else tf.function(apply))(grads)
    assert_same_state(state(model, opt), before, "after the bad call")


@pytest.mark.parametrize("name", ["ema-adamw_exclude", "accumulate-sgd_weight_decay",
                                  "both-adam_schedule"])
def test_loss_scale_rule_bit_identical_to_its_stock_path(name):
    """A ``LossScale`` rule (TensorFlow 2.4's unscale, ``g * (1 / scale)`` in
    the gradient's own dtype) with EMA, accumulation or both: the fused step
    against the same optimizer's stock path."""
    models = twin_models("mixed_float16")
    opts = [Ours(CASES[name](), loss_scale=lossscale.DynamicLossScale(2.0**10, 5),
                 fused=fused) for fused in (False, True)]
    for model, opt in zip(models, opts):
        opt.build(model.trainable_variables)
    skipped = lockstep(models, opts, batches(40, seed=8), "mixed_float16")
    if opts[1].inner_optimizer.gradient_accumulation_steps:
        assert set(skipped.values()) == {"update", "accumulate"}, skipped
    assert opts[0].step_path == "stock: fused=False"
    assert_fused(opts[1])


# ------------------------------------------------------- not fused


@pytest.mark.parametrize("make_inner,why", [
    (lambda: opt_.Muon(0.003), "Muon orthogonalises each gradient matrix"),
], ids=["muon"])
def test_stock_path_says_why_not_fused(make_inner, why):
    models, opts = make_pair(make_inner, "mixed_float16", dynamic_growth_steps=5)
    assert opts[1].step_path.startswith(f"stock: {why}"), opts[1].step_path
    lockstep(models, opts, batches(10, seed=9), "mixed_float16")
    assert opts[1].step_path.startswith(f"stock: {why}"), opts[1].step_path


@pytest.mark.parametrize("name,why", [
    ("ema-adam", "EMA with ema_overwrite_frequency in a tf.function under a tf.distribute "
                 "strategy"),
    ("accumulate-sgd_momentum", "gradient accumulation under a tf.distribute strategy")])
def test_under_a_strategy_stock_path_as_stock_fails(name, why):
    """Keras' accumulation steps and its EMA's overwrites make the
    strategy's merge call, which stock Keras' cond around the inner step
    does not allow in a tf.function: under ``MirroredStrategy``, even with
    one replica, stock fails, and ours takes the stock path (and fails as it
    does) rather than a fused step of its own.  (An EMA without overwrites
    fuses there: test_fused_distributed_sparse.)"""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    for cls in (Stock, Ours):
        with strategy.scope():
            model = build_model("mixed_float16")
            opt = cls(CASES[name](), initial_scale=2.0**8)
            opt.build(model.trainable_variables)
        replica = step_fn(model, opt, eager=True)
        x, y = batches(1)[0]
        with pytest.raises(RuntimeError, match="merge_call"):
            tf.function(lambda: strategy.run(replica, args=(x, y, tf.constant(1.0))))()
    assert opt.step_path.startswith(f"stock: {why}"), opt.step_path


def fused_ops_and_assigns(opt, variables):
    """The ``LossScaleApplyOptimizer`` nodes of one traced ``apply`` (its
    ``cond`` branches included) as ``(num_averages, num_variables)``, and
    how many ``AssignVariableOp`` nodes it has (Keras' EMA assigns each
    average; nothing else in an applied step of these families assigns)."""
    grads = [tf.ones(v.shape, v.dtype) for v in variables]
    graph = tf.function(lambda: opt.apply(grads, variables)).get_concrete_function().graph
    gd = graph.as_graph_def()
    nodes = list(gd.node) + [n for f in gd.library.function for n in f.node_def]
    ops = [(n.attr["num_averages"].i, n.attr["num_variables"].i) for n in nodes
           if n.op == "LossScaleApplyOptimizer"]
    return ops, sum(n.op == "AssignVariableOp" for n in nodes)


@pytest.mark.parametrize("name", list(EMA))
def test_averages_move_in_the_fused_op(name):
    """Without accumulation every average moves in the op that updates its
    variable, right after it (one pass: no Keras EMA op left but the
    overwrite's, under its own cond); with accumulation (an average moves on
    steps that only accumulate too) Keras' own ops move them."""
    model = build_model("mixed_float16")
    variables = model.trainable_variables
    inner = EMA[name]()
    opt = lossscale.LossScaleOptimizer(inner)
    opt.build(variables)
    ops, assigns = fused_ops_and_assigns(opt, variables)
    assert_fused(opt)
    assert ops and all(averages == n for averages, n in ops), ops
    # The same optimizer without EMA: its own assigns (Nadam's u_product).
    plain = lossscale.LossScaleOptimizer(
        type(inner).from_config({**inner.get_config(), "use_ema": False}))
    plain.build(variables)
    _, plain_assigns = fused_ops_and_assigns(plain, variables)
    overwrite = len(variables) if inner.ema_overwrite_frequency else 0
    assert assigns == plain_assigns + overwrite
    both = BOTH["adam_schedule"]()
    opt = lossscale.LossScaleOptimizer(both)
    opt.build(variables)
    ops, assigns = fused_ops_and_assigns(opt, variables)
    assert ops and all(averages == 0 for averages, _ in ops), ops
    assert assigns >= len(variables)


SPARSE_EMA = {"adam": lambda: opt_.Adam(0.01, use_ema=True, ema_momentum=0.9),
              "adagrad": lambda: opt_.Adagrad(0.05, use_ema=True, ema_momentum=0.8,
                                              ema_overwrite_frequency=5),
              "adamw_clip": lambda: opt_.AdamW(0.01, weight_decay=0.01, global_clipnorm=0.3,
                                               use_ema=True)}


@pytest.mark.parametrize("name", list(SPARSE_EMA))
@pytest.mark.parametrize("policy,eager", RUNS, ids=RUN_IDS)
def test_embedding_model_with_ema_bit_identical_to_stock(policy, eager, name):
    """An embedding table's sparse gradient beside dense ones: its average
    moves in the op over its dense terms (Adam), in the op over its
    densified gradient (global_clipnorm) or by Keras' ops after its rows
    (Adagrad); every average as stock's after every step."""
    from test_fused_sparse import embedding_lockstep

    _, opts = embedding_lockstep(None, policy, eager, 16 if eager else 48,
                                 make_inner=SPARSE_EMA[name])
    assert_fused(opts[1])
    averages = opts[1].inner_optimizer._model_variables_moving_average
    assert all(np.any(a.numpy() != 0) for a in averages)


# Every accumulating family, with EMA too, and over a count whose 1 / 3 is
# inexact (Adam's update takes it as it is in a graph too).
SPARSE_ACCUMULATE = {
    **ACCUMULATE, "both-rmsprop_momentum": BOTH["rmsprop_momentum"], "both-nadam": BOTH["nadam"],
    "three-adam": THREE["adam"][0],
    # Keras clips the averages, the table's densified: clip values that clip
    # some steps and variables of the embedding model and not others
    # (test_fused_sparse's).
    "adamw_global_clipnorm": lambda: opt_.AdamW(0.01, weight_decay=0.01, global_clipnorm=0.3,
                                                gradient_accumulation_steps=2),
    "adam_clipnorm": lambda: opt_.Adam(0.01, clipnorm=0.05, gradient_accumulation_steps=4),
    "sgd_momentum_clipvalue": lambda: opt_.SGD(0.05, momentum=0.9, clipvalue=0.01,
                                               gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("name", list(SPARSE_ACCUMULATE))
@pytest.mark.parametrize("policy,eager", RUNS, ids=RUN_IDS)
def test_embedding_model_with_accumulation_bit_identical_to_stock(policy, eager, name):
    """An embedding table's sparse gradient with gradient accumulation:
    Keras' add to its accumulator (and of its accumulator, on an update
    step) densifies it, so a step that only accumulates adds each named
    row's sum (made as TensorFlow's conversion makes it) to that row, and
    an update step densifies it as TensorFlow does for the fused update;
    every variable, slot and accumulator as stock's after every step,
    overflows on steps that would accumulate and on steps that would
    update."""
    from test_fused_sparse import embedding_lockstep

    _, opts = embedding_lockstep(None, policy, eager, 40 if eager else 64,
                                 make_inner=SPARSE_ACCUMULATE[name])
    assert_fused(opts[1])
    inner = opts[1].inner_optimizer
    # An update step ran and steps that accumulate after it (embedding_lockstep
    # checked that the table's gradient was sparse on every step).
    assert int(inner.iterations.numpy()) > inner.gradient_accumulation_steps


def test_sparse_gradient_with_accumulation_is_densified_for_every_family():
    """The plan densifies a sparse gradient under accumulation whatever its
    family's own sparse form (a kernel's slices, the inner optimizer's own
    update, or none: Adagrad with a negative initial accumulator), and
    leaves the dense one beside it as it is; without accumulation the same
    families keep their own forms."""
    from lossscale import _fused

    table = keras.Variable(np.ones((10, 3), np.float32), name="emb_table")
    dense = keras.Variable(np.ones((4,), np.float32), name="dense")
    grads = [tf.IndexedSlices(tf.ones((2, 3)), tf.constant([1, 1]), tf.constant([10, 3])),
             tf.ones((4,))]
    makers = {**SPARSE_ACCUMULATE,
              "adagrad_negative": lambda: opt_.Adagrad(0.05, initial_accumulator_value=-0.5,
                                                       gradient_accumulation_steps=2)}
    for name, make in makers.items():
        inner = make()
        inner.build([table, dense])
        plan = _fused.decide(inner, grads=grads, variables=[table, dense]).plan
        assert plan is not None, name
        assert plan.forms == [_fused.DENSIFIED_BY_ACCUMULATION, None], (name, plan.forms)
        alone = type(inner).from_config({**inner.get_config(),
                                         "gradient_accumulation_steps": None})
        alone.build([table, dense])
        decision = _fused.decide(alone, grads=grads, variables=[table, dense])
        assert decision.plan is None or decision.plan.forms[0] is not \
            _fused.DENSIFIED_BY_ACCUMULATION, name
