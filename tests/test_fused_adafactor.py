"""Keras' Adafactor on the fused step (the LossScaleApplyAdafactor op),
against stock ``keras.optimizers.LossScaleOptimizer(Adafactor(...))``.

Adafactor's update takes means inside the step: each row's and each
column's mean of ``g * g + epsilon_1`` (its factored moments ``r`` and
``c``), the mean of ``r``, and the RMS of the variable and of the step
``u``.  The op makes them in TensorFlow's Mean order on this device, which
depends on the shape TensorFlow's reduction helper leaves once it drops
axes of 1: a full reduction (shards and trees), an inner-most axis (a tree
per row) or a middle one (packets of 8 outputs over 4 accumulators).  The
shapes below take each: ranks 0 to 4, axes of 1 in every place, rows under
and over 16 and not a multiple of 4, columns that split the packets across
slices, rows over a tree's leaf, variables of two shards.  Each case is a
lockstep against stock through the public optimizer, eagerly and in a
``tf.function`` (where Grappler makes ``g / sqrt(v)`` TensorFlow's Rsqrt),
overflow steps among them, every variable and slot compared bit for bit.
The model-level lockstep (both mixed policies, clips, weight decay,
schedules, MirroredStrategy) is in test_fused_step, test_fused_clip and
test_fused_distributed; here also: the EMA, a sparse gradient (its
variable by Adafactor's own update inside the fused step; stock under
several replicas), the agreement probe, and the
op's own checks of bad input (each refused before anything moves).
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from lossscale import _fused
from lossscale import ops as native_ops
from helpers import bits
from test_fused_step import Ours, Stock, assert_fused

SHAPES = [(), (1,), (40,), (7, 13), (64, 100), (1, 9), (33, 1), (17, 24), (18, 40),
          (5, 40, 17), (3, 21, 13), (3, 3, 16, 24), (1, 1, 64, 32), (3, 1, 5), (2, 1, 1),
          (2, 16, 1), (3, 20, 3)]
# Over a leaf's 8,192 values in a row, over two shards of the full reduction
# (about 258,000 values at two threads), one row of them, one column of them.
LARGE = [(3, 20000), (600, 500), (1, 300007), (300001, 1), (20, 16, 1000)]

CONFIGS = {
    "default": {},
    "keywords": dict(learning_rate=0.05, beta_2_decay=-0.5, epsilon_1=1e-20,
                     epsilon_2=1e-2, clip_threshold=0.5, relative_step=False),
    "schedule": dict(learning_rate=keras.optimizers.schedules.ExponentialDecay(0.02, 5, 0.8)),
}


def lockstep(shapes, graph, steps, kw, scale=2.0**10, inf_at=(3,), seed=0, use_ema=False,
             make=keras.optimizers.Adafactor):
    """Ours and stock around two ``make(**kw)`` (Adafactor) on twin
    variables, fed the same scaled gradients (times inf at the steps
    ``inf_at``); every variable, slot and the optimizers' own state compared
    after each step.  Returns ours."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    twins = [[keras.Variable(x, name=f"w{i}") for i, x in enumerate(init)] for _ in range(2)]
    opts = [cls(make(use_ema=use_ema, **kw), initial_scale=scale, dynamic_growth_steps=2)
            for cls in (Stock, Ours)]
    def applier(opt, variables):
        def apply(grads):
            opt.apply(grads, variables)
        return tf.function(apply) if graph else apply

    applies = [applier(opt, variables) for opt, variables in zip(opts, twins)]
    for step in range(steps):
        grads = [(rng.standard_normal(s) * rng.uniform(0.01, 10) * scale).astype(np.float32)
                 for s in shapes]
        if step in inf_at:
            grads[step % len(grads)][...] = np.inf
        for apply in applies:
            apply([tf.constant(g) for g in grads])
        for a, b in zip(opts[0].variables + twins[0], opts[1].variables + twins[1]):
            assert bits(a.numpy()) == bits(b.numpy()), f"step {step}: {a.path} differs from stock"
    return opts[1]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_shape_bit_identical_to_stock(config, graph):
    ours = lockstep(SHAPES, graph, 12, CONFIGS[config])
    assert ours.step_path == "fused (Adafactor)", ours.step_path
    assert int(ours.iterations.numpy()) == 11  # the overflow step skipped


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_large_variables_bit_identical_to_stock(graph):
    ours = lockstep(LARGE, graph, 3, {}, inf_at=())
    assert ours.step_path == "fused (Adafactor)", ours.step_path


def test_scale_without_an_exact_reciprocal_divides_as_stock():
    """A scale that is not a power of two: the op divides each gradient by
    it, as stock (a power of two multiplies by its exact reciprocal)."""
    ours = lockstep(SHAPES[:8], True, 6, {}, scale=1000.0)
    assert_fused(ours)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_ema_bit_identical_to_stock(graph):
    """Keras' own ops move the averages after the op's update (and
    overwrite the variables on their schedule)."""
    ours = lockstep(SHAPES[:9], graph, 8, dict(ema_momentum=0.9, ema_overwrite_frequency=3),
                    use_ema=True)
    assert_fused(ours)


SPARSE_CLIPS = [{}, dict(clipnorm=0.5), dict(global_clipnorm=0.5),
                dict(clipvalue=0.1, weight_decay=0.01, use_ema=True)]


@pytest.mark.parametrize("kw", SPARSE_CLIPS, ids=["plain", "clipnorm", "global_clipnorm",
                                                  "clipvalue_decay_ema"])
@pytest.mark.parametrize("scale", [2.0**10, 1000.0], ids=["power_of_two", "inexact"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_sparse_gradient_bit_identical_to_stock(graph, scale, kw):
    """An embedding table's slices (a row named twice, rows never named)
    beside dense variables: Keras squares the slices before it densifies
    them, which the op does not take, so the table moves by Adafactor's own
    update inside the fused step and the rest by the op (under
    ``global_clipnorm`` Keras densifies the table's gradient, and the op
    takes it).  A step with an overflow is skipped by both."""
    sparse_lockstep(keras.optimizers.Adafactor, graph, scale, kw)


def sparse_lockstep(make, graph, scale, kw, dtype=np.float16, steps=8):
    """Ours and stock around ``make(0.01, **kw)``, an embedding table's
    slices (a row named twice, rows never named) beside two dense
    variables, gradients of ``dtype``, an overflow at step 3; every
    variable and slot compared after each step.  Returns ours."""
    rng = np.random.default_rng(7)
    init = [rng.standard_normal(s).astype(np.float32) for s in [(12, 6), (5, 7), (6,)]]
    twins = [[keras.Variable(x) for x in init] for _ in range(2)]
    opts = [cls(make(0.01, **kw), initial_scale=scale) for cls in (Stock, Ours)]

    def stepper(opt, variables):
        opt.build(variables)

        def step(table, dense, bias):
            opt.apply([table, dense, bias], variables)

        return tf.function(step) if graph else step

    appliers = [stepper(opt, variables) for opt, variables in zip(opts, twins)]
    for k in range(steps):
        values = (rng.standard_normal((5, 6)) * rng.uniform(0.1, 4) * scale / 1024).astype(dtype)
        table = tf.IndexedSlices(tf.constant(values), tf.constant([4, 0, 4, 9, 1]),
                                 tf.constant([12, 6]))
        dense = rng.standard_normal((5, 7)) * (np.inf if k == 3 else 1.0)
        grads = [table, tf.constant(dense, dtype), tf.constant(rng.standard_normal(6), dtype)]
        for step in appliers:
            step(*grads)
        for a, b in zip(twins[0] + list(opts[0].variables), twins[1] + list(opts[1].variables)):
            assert bits(a.numpy()) == bits(b.numpy()), (k, a.path)
    assert_fused(opts[1])
    assert int(opts[1].iterations.numpy()) == steps - 1
    assert not np.array_equal(twins[1][0].numpy()[4], init[0][4])
    return opts[1]


def sparse_form(make):
    """The plan's form of a sparse gradient for ``make()``, its table and
    optimizer."""
    table = keras.Variable(np.ones((10, 4), np.float32), name="table")
    inner = make()
    inner.build([table])
    grads = [tf.IndexedSlices(tf.ones((2, 4)), tf.constant([1, 1]), tf.constant([10, 4]))]
    (form,) = _fused.decide(inner, grads=grads, variables=[table]).plan.forms
    return form, table, inner


def test_sparse_gradient_under_replicas_stays_stock_and_says_why(monkeypatch):
    form, table, inner = sparse_form(keras.optimizers.Adafactor)
    assert form is _fused.BY_OWN_UPDATE
    # The own update is a replica's: under several, the step is stock.
    monkeypatch.setattr(_fused, "_replicas", lambda: 2)
    family = next(f for f in _fused.FAMILIES if f.name == "adafactor")
    path = family.sparse(inner, table)
    assert path.startswith("Keras' Adafactor squares a sparse gradient's slices"), path
    assert path.endswith("its own update does not run under several replicas"), path


def test_means_agree_with_tensorflow_here():
    """The probe's verdict on this machine: the op's orders are this
    TensorFlow's (the x86 wheels' AVX packets)."""
    library = native_ops.native_library_for([])
    assert _fused._adafactor_agrees(library)


def test_a_build_that_adds_in_another_order_takes_the_stock_path(monkeypatch):
    monkeypatch.setitem(_fused._ADAFACTOR_AGREES, "agree", False)
    ours = lockstep(SHAPES[:6], False, 4, {})
    assert ours.step_path.startswith("stock: TensorFlow's Mean here does not add in the order"), \
        ours.step_path


# ------------------------------------------------------- the op's checks

def op_case():
    """A factored and a plain variable with their slots, and the op's
    arguments as the fused step passes them."""
    made = {name: tf.Variable(value, name=name) for name, value in (
        ("w", np.arange(12, dtype=np.float32).reshape(3, 4)), ("r", np.ones(3, np.float32)),
        ("c", np.ones(4, np.float32)), ("v", np.zeros((3, 4), np.float32)),
        ("b", np.ones(5, np.float32)), ("vb", np.zeros(5, np.float32)))}
    args = dict(apply=tf.constant(True), variables=[made["w"].handle, made["b"].handle],
                r=[made["r"].handle], c=[made["c"].handle],
                v=[made["v"].handle, made["vb"].handle],
                grads=[tf.ones((3, 4)), tf.ones(5)], scale=tf.constant(2.0),
                rho=tf.constant(0.01), beta=tf.constant(0.5), rest=tf.constant(0.5),
                factored=[0], epsilon_1=1e-30, epsilon_2=1e-3, clip_threshold=1.0)
    return made, args


def library():
    return native_ops.native_library_for([])


def snapshot(made):
    return {name: v.numpy().tobytes() for name, v in made.items()}


def test_op_steps_the_case():
    made, args = op_case()
    before = snapshot(made)
    library().loss_scale_apply_adafactor(**args)
    after = snapshot(made)
    assert all(after[k] != before[k] for k in ("w", "r", "c", "v", "b", "vb"))


def test_op_does_nothing_when_the_step_does_not_apply():
    made, args = op_case()
    before = snapshot(made)
    library().loss_scale_apply_adafactor(**{**args, "apply": tf.constant(False)})
    assert snapshot(made) == before


@pytest.mark.parametrize("bad,message", [
    (lambda made, a: {**a, "r": [tf.Variable(np.ones(4, np.float32)).handle]},
     "has shape [4], expected [3]"),
    (lambda made, a: {**a, "c": [tf.Variable(np.ones(3, np.float32)).handle]},
     "has shape [3], expected [4]"),
    (lambda made, a: {**a, "v": [made["v"].handle, tf.Variable(np.ones(4, np.float32)).handle]},
     "has shape [4], expected [5]"),
    (lambda made, a: {**a, "grads": [tf.ones((4, 3)), tf.ones(5)]}, "has shape"),
    (lambda made, a: {**a, "factored": [1], "r": [made["r"].handle], "c": [made["c"].handle]},
     "has rank 2, factored is false"),
    (lambda made, a: {**a, "variables": [made["w"].handle, made["w"].handle]},
     "passed twice"),
    (lambda made, a: {**a, "v": [made["v"].handle, tf.Variable(np.ones(5, np.float64)).handle]},
     "must be float32"),
    (lambda made, a: {**a, "rho": tf.constant([0.01, 0.01])}, "must be a scalar"),
], ids=["r_shape", "c_shape", "v_shape", "grad_shape", "rank", "twice", "dtype", "rho_shape"])
def test_op_refuses_bad_input_and_changes_nothing(bad, message):
    made, args = op_case()
    before = snapshot(made)
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(message)):
        library().loss_scale_apply_adafactor(**bad(made, args))
    assert snapshot(made) == before


def test_op_refuses_factored_positions_out_of_order():
    made, args = op_case()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="factored"):
        library().loss_scale_apply_adafactor(**{**args, "factored": [0, 0]})
