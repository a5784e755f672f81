"""Sparse (``tf.IndexedSlices``) gradients on the fused step, against stock Keras.

The oracle is stock ``keras.optimizers.LossScaleOptimizer(inner)``, as in
``test_fused_step.py``: twins with identical weights and batches, overflow
forced on chosen steps, one trained by the stock optimizer and one by ours,
every model variable, slot, ``iterations``, ``dynamic_scale`` and
``step_counter`` compared bit for bit after every step.  The sparse
gradients are a real ``keras.layers.Embedding``'s (GradientTape; its
tokens repeat within a batch and never reach some rows) and hand-made
``tf.IndexedSlices`` (duplicate and unsorted indices, rows never touched,
several tables beside a dense variable, no slice at all, int32 and int64
indices, float16 / bfloat16 / float32 values, a non-finite value injected),
under ``mixed_float16`` and ``mixed_bfloat16``, in ``tf.function`` and
eagerly.  Adam (amsgrad, a schedule), AdamW, SGD with momentum (Nesterov,
a schedule), Adamax (weight decay), Lion (a schedule), Adagrad (a
schedule; weight decay) and RMSprop without momentum, not centered (a
schedule, weight decay) take the kernels' sparse forms, Adagrad's and
RMSprop's tables moved on the rows their slices index alone (RMSprop's
velocity decayed on every row); SGD without momentum or with weight decay,
RMSprop with momentum or centered and Nadam take the fused step with the sparse
variable updated by the inner optimizer's own ops inside it
(``_fused.BY_OWN_UPDATE``); Adagrad keeps the stock path where a row of
its divisor could be 0 or NaN, and says why.  A sparse gradient whose
indices leave the table, or whose slices are not its rows' shape, raises
with the variable's name and changes nothing.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from lossscale import _fused
from helpers import bits, keras3_train_step
from test_fused_step import (INNERS, OVERFLOWS, RUN_IDS, RUNS, assert_same_state, factor,
                             sequential_under)

Stock = keras.optimizers.LossScaleOptimizer
Ours = lossscale.LossScaleOptimizer
INF = float("inf")

# The configurations whose sparse gradient a kernel takes, and those whose
# sparse variable the inner optimizer's own update moves inside the fused
# step (every other variable by the kernels).
KERNEL_SPARSE = ["adam", "adam_amsgrad_schedule", "adamw_exclude", "sgd_momentum",
                 "sgd_nesterov_schedule", "adamax_decay", "lion_schedule", "adagrad_schedule",
                 "adagrad_decay", "rmsprop", "rmsprop_rho_decay_schedule"]
OWN_UPDATE = ["sgd", "sgd_weight_decay", "rmsprop_momentum_schedule",
              "rmsprop_centered_decay_exclude", "nadam_decay"]
FUSED = KERNEL_SPARSE + OWN_UPDATE
VOCAB, USED, SEQ, DIM = 60, 40, 5, 6  # tokens < USED: rows USED.. never touched


def embedding_model(policy, seed=0):
    """Embedding -> Dense under ``policy``: a sparse gradient beside dense ones."""
    return sequential_under(policy, seed, lambda: [keras.Input((SEQ,), dtype="int32"),
                                                   keras.layers.Embedding(VOCAB, DIM)])


def token_batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, USED, (4, SEQ)).astype(np.int32),
             rng.standard_normal((4, 1)).astype(np.float32)) for _ in range(steps)]


def state_of(variables):
    read = tf.function(lambda: [tf.identity(v.value) for v in variables])
    return lambda: [(v.path, bits(t.numpy())) for v, t in zip(variables, read())]


def all_variables(model, opt):
    return list(model.variables) + list(opt.variables)


def assert_step_path(opt, name):
    assert name in FUSED
    assert opt.step_path.startswith("fused"), opt.step_path


def embedding_lockstep(name, policy, eager, steps, seed=0, make_inner=None):
    models = [embedding_model(policy, 0), embedding_model(policy, 1)]
    models[1].set_weights(models[0].get_weights())
    make_inner = make_inner or INNERS[name]
    opts = [Stock(make_inner(), dynamic_growth_steps=10),
            Ours(make_inner(), dynamic_growth_steps=10)]
    for model, opt in zip(models, opts):
        opt.build(model.trainable_variables)
    kinds = []

    def record(grads):
        kinds.append(type(grads[0]).__name__)
        return grads

    stepper = [keras3_train_step(m, o) for m, o in zip(models, opts)]
    steps_fn = [(lambda s: (lambda x, y, f: s(x, y, f, record)))(s) for s in stepper]
    if not eager:
        steps_fn = [tf.function(s) for s in steps_fn]
    readers = [state_of(all_variables(m, o)) for m, o in zip(models, opts)]
    for i, (x, y) in enumerate(token_batches(steps, seed)):
        f = tf.constant(factor(i, policy))
        for step in steps_fn:
            step(tf.constant(x), tf.constant(y), f)
        assert_same_state(readers[0](), readers[1](), f"step {i}")
    assert set(kinds) == {"IndexedSlices"}, kinds
    return models, opts


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("policy,eager", RUNS, ids=RUN_IDS)
def test_embedding_model_bit_identical_to_stock_every_step(policy, eager, name):
    steps = 24 if eager else 96
    models, opts = embedding_lockstep(name, policy, eager, steps)
    assert_step_path(opts[1], name)
    # Steps were skipped (the forced overflows, and any the scale's growth
    # brings on), the others applied.
    skipped = sum(i in OVERFLOWS for i in range(steps))
    assert 0 < int(opts[1].iterations.numpy()) <= steps - skipped


@pytest.mark.parametrize("name", FUSED)
def test_which_sparse_variables_take_their_own_update(name):
    """The plan sends a sparse gradient to a kernel's sparse form, or, where
    no kernel reproduces its update, to the inner optimizer's own ops; the
    dense gradient beside it always to a kernel."""
    table = keras.Variable(np.ones((10, 3), np.float32), name="emb_table")
    dense = keras.Variable(np.ones((4,), np.float32), name="dense")
    inner = INNERS[name]()
    inner.build([table, dense])
    grads = [tf.IndexedSlices(tf.ones((2, 3)), tf.constant([1, 1]), tf.constant([10, 3])),
             tf.ones((4,))]
    plan = _fused.decide(inner, grads=grads, variables=[table, dense]).plan
    assert plan is not None
    assert (plan.forms[0] is _fused.BY_OWN_UPDATE) == (name in OWN_UPDATE), plan.forms
    assert plan.forms[1] is None


@pytest.mark.parametrize("kw", [dict(rho=0.0), dict(rho=1.0), dict(epsilon=0.0),
                                dict(momentum=0.5), dict(centered=True)],
                         ids=["rho_0", "rho_1", "epsilon_0", "momentum", "centered"])
def test_rmsprop_scatter_only_where_stock_takes_the_slices_rows(kw):
    """RMSprop's sparse gradient takes the kernel's scatter only where no row
    of stock's divisor can be 0 or NaN (rho and 1 - rho positive, epsilon a
    positive normal float32), without momentum, not centered; otherwise the
    inner optimizer's own update moves the table inside the fused step."""
    table = keras.Variable(np.ones((10, 3), np.float32), name="emb_table")
    dense = keras.Variable(np.ones((4,), np.float32), name="dense")
    grads = [tf.IndexedSlices(tf.ones((2, 3)), tf.constant([1, 1]), tf.constant([10, 3])),
             tf.ones((4,))]
    forms = []
    for options in ({}, kw):
        inner = keras.optimizers.RMSprop(0.01, **options)
        inner.build([table, dense])
        forms.append(_fused.decide(inner, grads=grads, variables=[table, dense]).plan.forms[0])
    assert isinstance(forms[0], _fused.SparseForm) and forms[0] is not _fused.BY_OWN_UPDATE
    assert forms[1] is _fused.BY_OWN_UPDATE


# Clip values that clip some steps and some variables and not others on
# the embedding model's first steps (global norms there are about 0.1-2).
SPARSE_CLIPS = {"clipnorm": 0.05, "global_clipnorm": 0.3, "clipvalue": 0.01}


@pytest.mark.parametrize("clip", list(SPARSE_CLIPS))
@pytest.mark.parametrize("name", ["adam", "adamw_exclude", "sgd", "sgd_momentum",
                                  "sgd_weight_decay", "rmsprop", "adagrad_decay",
                                  "adamax_decay", "nadam_decay", "lion_schedule"])
@pytest.mark.parametrize("policy,eager", RUNS, ids=RUN_IDS)
def test_clipped_sparse_gradient_bit_identical_to_stock(policy, eager, name, clip):
    """Keras' global_clipnorm makes a sparse gradient dense (see
    _fused.DENSIFIED_BY_CLIP), for every family whatever its own sparse
    form; clipnorm and clipvalue clip its slices, which then take their
    family's sparse form.  Fused where that holds (SGD with global_clipnorm
    and weight decay in a graph keeps its own reason), the same bits either
    way."""
    def make_inner():
        inner = INNERS[name]()
        setattr(inner, clip, SPARSE_CLIPS[clip])
        return inner

    _, opts = embedding_lockstep(name, policy, eager, 12 if eager else 40,
                                 make_inner=make_inner)
    path = opts[1].step_path
    if clip == "global_clipnorm" and name == "sgd_weight_decay" and not eager:
        assert path.startswith("stock: global_clipnorm and weight decay with SGD"), path
    else:
        assert path.startswith("fused"), path


@pytest.mark.parametrize("kwargs,why", [
    (dict(initial_accumulator_value=-0.5), "negative or non-finite initial_accumulator_value"),
    (dict(epsilon=0.0), "epsilon that is not a positive normal float32"),
    (dict(epsilon=1e-45), "epsilon that is not a positive normal float32"),
], ids=["negative_initial", "zero_epsilon", "subnormal_epsilon"])
def test_adagrad_whose_divisor_could_be_zero_keeps_the_stock_path(kwargs, why):
    """Where a row of sqrt(accumulator + epsilon) could be 0 or NaN, stock's
    divide takes in more rows than the slices' (its union path): the step is
    left to stock, saying why.  (With a negative initial value stock's own
    union path fails in Keras; with a zero epsilon it runs, and ours with it,
    the same bits.)"""
    table = keras.Variable(np.ones((10, 3), np.float32), name="emb_table")
    inner = keras.optimizers.Adagrad(0.05, **kwargs)
    inner.build([table])
    grads = [tf.IndexedSlices(tf.ones((2, 3)), tf.constant([1, 1]), tf.constant([10, 3]))]
    decision = _fused.decide(inner, grads=grads, variables=[table])
    assert decision.plan is None
    assert decision.path.startswith("stock: Keras' Adagrad with a sparse gradient"), decision.path
    assert why in decision.path, decision.path
    if kwargs.get("epsilon") == 0.0:
        INNERS["adagrad_divisor"] = lambda: keras.optimizers.Adagrad(0.05, **kwargs)
        try:
            _, opts = embedding_lockstep("adagrad_divisor", "mixed_float16", False, 8, seed=5)
        finally:
            del INNERS["adagrad_divisor"]
        assert why in opts[1].step_path, opts[1].step_path


def test_adagrad_table_step_reads_only_the_indexed_rows():
    """Stock's step takes the square root of the whole accumulator every step
    (and checks it whole for zeros and NaNs); the fused step's graph has no
    op over a table-shaped tensor but the scatters into it."""
    table = keras.Variable(np.ones((1000, 8), np.float32), name="emb_table")
    opt = Ours(keras.optimizers.Adagrad(0.05), dynamic_growth_steps=10)
    opt.build([table])
    grads = [tf.IndexedSlices(tf.ones((3, 8), tf.float16), tf.constant([4, 4, 9]),
                              tf.constant([1000, 8]))]
    graph = tf.function(lambda: opt.apply(grads, [table])).get_concrete_function().graph
    assert opt.step_path == "fused (Adagrad)"
    # (A read of the table that nothing consumes, as tf.shape leaves one, moves no data.)
    table_shaped = [op.type for op in graph.get_operations()
                    if any(out.shape.as_list() == [1000, 8] and out.consumers()
                           for out in op.outputs if out.shape.rank is not None)]
    assert table_shaped == [], table_shaped
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adagrad(0.05))
    stock.build([table])
    stock_graph = tf.function(lambda: stock.apply(grads, [table])).get_concrete_function().graph
    assert "Sqrt" in [op.type for op in stock_graph.get_operations()
                      if any(out.shape.as_list() == [1000, 8] for out in op.outputs
                             if out.shape.rank is not None)]


# ------------------------------------------------ hand-made IndexedSlices

TABLES = {"table_a": (30, 3), "table_b": (11, 4)}  # rows >= 20 of table_a never indexed


def slices_steps(steps, dtype, seed):
    """Per step: for each table (values, indices) -- duplicate and unsorted
    indices, some steps with no slice, a non-finite value on the overflow
    steps -- and a dense gradient; all scaled as a scaled loss makes them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        f = float(OVERFLOWS.get(i, 1.0))
        per_table = []
        for name, (rows, cols) in TABLES.items():
            n = 0 if (i % 11 == 7 and name == "table_b") else int(rng.integers(1, 9))
            reach = 20 if name == "table_a" else rows
            indices = rng.integers(0, reach, n)
            if n >= 3:
                indices[1] = indices[n - 1]  # a duplicate, apart
            values = rng.standard_normal((n, cols)) * 2.0**8
            if f != 1.0 and n and name == "table_a":
                # In the last slice: a later slice of the same row would hide
                # it from stock's check (see test_non_finite_slice_...).
                values[n - 1, 1] = f if f != 1e30 else INF
            per_table.append((values.astype(dtype), indices))
        dense = (rng.standard_normal((4, 3)) * 2.0**8).astype(dtype)
        out.append((per_table, dense))
    return out


def slices_lockstep(name, dtype, eager, steps, index_dtype=tf.int32, rows_known=False):
    """Stock and ours in lockstep over ``slices_steps``: eagerly, or in a
    ``tf.function`` traced once with the number of slices unknown, as
    ``Model.fit`` traces a batch of any size (``rows_known``: traced anew
    for each step's numbers of slices, which the graph then knows)."""
    rng = np.random.default_rng(2)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in TABLES.items()}
    init["kernel"] = rng.standard_normal((4, 3)).astype(np.float32)
    twins, opts = [], []
    for make in (Stock, Ours):
        variables = [keras.Variable(init[n], name=n) for n in init]
        opt = make(INNERS[name](), initial_scale=2.0**8, dynamic_growth_steps=7)
        opt.build(variables)
        twins.append(variables)
        opts.append(opt)

    def step_of(opt, variables):
        def step(values_a, indices_a, values_b, indices_b, dense):
            shapes = [tf.constant(s, tf.int64) for s in TABLES.values()]
            grads = [tf.IndexedSlices(values_a, indices_a, shapes[0]),
                     tf.IndexedSlices(values_b, indices_b, shapes[1]), dense]
            opt.apply(grads, variables)
        if eager:
            return step
        if rows_known:
            return tf.function(step)
        tf_dtype = tf.as_dtype(dtype)
        signature = [tf.TensorSpec([None, TABLES["table_a"][1]], tf_dtype),
                     tf.TensorSpec([None], index_dtype),
                     tf.TensorSpec([None, TABLES["table_b"][1]], tf_dtype),
                     tf.TensorSpec([None], index_dtype), tf.TensorSpec([4, 3], tf_dtype)]
        return tf.function(step, input_signature=signature)

    steps_fn = [step_of(o, v) for o, v in zip(opts, twins)]
    readers = [state_of(v + list(o.variables)) for v, o in zip(twins, opts)]
    for i, (per_table, dense) in enumerate(slices_steps(steps, dtype, seed=i_seed(name))):
        (va, ia), (vb, ib) = per_table
        args = (tf.constant(va), tf.constant(ia, index_dtype), tf.constant(vb),
                tf.constant(ib, index_dtype), tf.constant(dense))
        for step in steps_fn:
            step(*args)
        assert_same_state(readers[0](), readers[1](), f"step {i}")
    return twins, opts


def i_seed(name):
    return sum(map(ord, name))


HAND_MADE = [("float16", False), ("bfloat16", False), ("float32", False), ("float16", True)]


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("dtype,eager", HAND_MADE,
                         ids=[f"{d}-{'eager' if e else 'function'}" for d, e in HAND_MADE])
def test_hand_made_slices_bit_identical_to_stock(name, dtype, eager):
    import ml_dtypes

    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                "float32": np.float32}[dtype]
    steps = 20 if eager else 48
    twins, opts = slices_lockstep(name, np_dtype, eager, steps)
    assert_step_path(opts[1], name)
    skipped = sum(i in OVERFLOWS for i in range(steps))
    assert int(opts[1].iterations.numpy()) == steps - skipped
    # Rows never indexed still moved as Keras' dense arithmetic moves them
    # (Adam's moments decay, SGD's momentum carries on); the lockstep above
    # held them to stock.
    assert float(opts[1].dynamic_scale.numpy()) != 2.0**8


def test_int64_indices_bit_identical_to_stock():
    slices_lockstep("adam", np.float16, False, 30, index_dtype=tf.int64)


@pytest.mark.parametrize("name", ["adam", "adagrad_decay", "sgd_momentum", "rmsprop"])
def test_slices_of_known_numbers_bit_identical_to_stock(name):
    # Each step's numbers of slices in the graph: a trace per step.
    slices_lockstep(name, np.float16, False, 16, rows_known=True)


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adam(0.01),
                                  lambda: keras.optimizers.RMSprop(0.01),
                                  lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
                                  lambda: keras.optimizers.Adafactor(0.01),
                                  lambda: keras.optimizers.Lamb(0.01)],
                         ids=["adam", "rmsprop", "rmsprop_own_update", "adafactor_own_update",
                              "lamb"])
def test_tf24_rule_multiplies_the_values_as_its_stock_path(make):
    """With ``loss_scale=`` (TensorFlow 2.4's rule: values times 1 / scale in
    their own dtype) the fused sparse step gives what the same optimizer's
    stock path gives (``fused=False``: the values unscaled, then the inner
    optimizer's own apply), by a kernel's sparse form or by the inner
    optimizer's own update inside the fused step."""
    rng = np.random.default_rng(4)
    init = rng.standard_normal((30, 3)).astype(np.float32)
    results = []
    for fused in (False, True):
        table = keras.Variable(init, name="table")
        opt = Ours(make(), fused=fused, loss_scale=lossscale.DynamicLossScale(2.0**10, 3))
        opt.build([table])
        step = tf.function(lambda v, i: opt.apply(
            [tf.IndexedSlices(v, i, tf.constant([30, 3], tf.int64))], [table]))
        rng = np.random.default_rng(5)
        states = []
        for k in range(30):
            values = (rng.standard_normal((6, 3)) * 2.0**10).astype(np.float16)
            if k in (4, 9):
                values[2, 0] = np.inf
            step(tf.constant(values), tf.constant(rng.integers(0, 20, 6), tf.int32))
            states.append([bits(v.numpy()) for v in [table] + list(opt.variables)])
        results.append((states, opt.step_path))
    assert results[0][1].startswith("stock") and results[1][1].startswith("fused"), results[1][1]
    for k, (a, b) in enumerate(zip(results[0][0], results[1][0])):
        assert a == b, f"step {k}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "stock_path"])
def test_non_finite_slice_hidden_by_a_later_duplicate_skips_the_step(fused):
    """Where ours differs from stock Keras on purpose.  Stock checks an
    IndexedSlices by densifying its finite flags with
    ``tensor_scatter_nd_update``: of a row indexed twice only the last
    slice's flag is kept, so a NaN slice followed by a finite one of the
    same row passes the check and stock applies the NaN.  Ours checks every
    slice, on the fused path as on its stock path: the step is skipped, the
    scale halves, no variable moves."""
    grads = [tf.IndexedSlices(tf.constant([[np.nan, 1.0], [2.0, 3.0]], tf.float16),
                              tf.constant([4, 4]), tf.constant([6, 2]))]
    init = np.ones((6, 2), np.float32)
    stock_table = keras.Variable(init, name="table")
    stock = Stock(keras.optimizers.Adam(0.01))
    stock.apply(grads, [stock_table])
    assert np.isnan(stock_table.numpy()[4]).any()  # stock's check let the NaN through
    table = keras.Variable(init, name="table")
    ours = Ours(keras.optimizers.Adam(0.01), fused=fused)
    ours.apply(grads, [table])
    assert ours.step_path.startswith("fused" if fused else "stock"), ours.step_path
    assert bits(table.numpy()) == bits(init)
    assert float(ours.dynamic_scale.numpy()) == float(stock.initial_scale) / 2
    assert int(ours.iterations.numpy()) == 0


def test_tf24_loop_bit_identical_to_tensorflow_reference():
    """``experimental.LossScaleOptimizer.apply_gradients`` on unscaled sparse
    gradients (the fused step takes them as they are) against TensorFlow
    2.4's arithmetic: TensorFlow's own ``DynamicLossScale`` checks them, the
    stock inner optimizer applies them, a skipped step still advances
    ``iterations``."""
    from lossscale import experimental
    from helpers import tf_dynamic

    rng = np.random.default_rng(8)
    init = rng.standard_normal((30, 3)).astype(np.float32)
    ref_table, table = keras.Variable(init, name="table"), keras.Variable(init, name="table")
    reference_scale = tf_dynamic(initial_loss_scale=2.0**10, increment_period=5)
    reference = keras.optimizers.Adam(0.01)
    reference.build([ref_table])
    opt = experimental.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                          experimental.DynamicLossScale(2.0**10, 5))

    def sparse(values, indices):
        return tf.IndexedSlices(values, indices, tf.constant([30, 3], tf.int64))

    @tf.function
    def reference_step(values, indices):
        g = sparse(values, indices)
        _, should_apply = reference_scale.update([g])
        def apply():
            reference.apply([g], [ref_table])

        def skip():
            reference.iterations.assign_add(1)

        tf.cond(should_apply, apply, skip)

    step = tf.function(lambda v, i: opt.apply_gradients([(sparse(v, i), table)]))
    for k in range(40):
        values = rng.standard_normal((7, 3)).astype(np.float16)
        if k in OVERFLOWS:
            values[6, 2] = np.inf
        indices = tf.constant(rng.integers(0, 20, 7), tf.int32)
        reference_step(tf.constant(values), indices)
        step(tf.constant(values), indices)
        want = [bits(v.numpy()) for v in [ref_table] + list(reference.variables)]
        got = [bits(v.numpy()) for v in [table] + list(opt.inner_optimizer.variables)]
        assert got == want, f"step {k}"
        assert bits(opt.loss_scale.numpy()) == bits(reference_scale().numpy()), f"step {k}"
    assert opt.step_path.startswith("fused"), opt.step_path


# ------------------------------------------------------------ bad input


# A family whose kernel takes the sparse terms, and one whose table is
# updated on its indexed rows (Adagrad's scatters).
BAD_INNERS = {"adam": lambda: keras.optimizers.Adam(0.01),
              "adagrad": lambda: keras.optimizers.Adagrad(0.01),
              # The sparse variable by the inner optimizer's own update.
              "sgd": lambda: keras.optimizers.SGD(0.01),
              "rmsprop": lambda: keras.optimizers.RMSprop(0.01, clipnorm=1.0),
              # Steps that only accumulate: the slices to the accumulate op.
              "adam_accumulate": lambda: keras.optimizers.Adam(0.01,
                                                               gradient_accumulation_steps=4)}


def bad_setup(inner="adam"):
    table = keras.Variable(np.arange(30, dtype=np.float32).reshape(10, 3), name="emb_table")
    kernel = keras.Variable(np.ones((2, 2), np.float32), name="kernel")
    opt = Ours(BAD_INNERS[inner](), dynamic_growth_steps=10)
    opt.build([table, kernel])
    good = [tf.IndexedSlices(tf.ones((2, 3), tf.float16), tf.constant([1, 1]),
                             tf.constant([10, 3])), tf.ones((2, 2), tf.float16)]
    opt.apply(good, [table, kernel])
    return opt, [table, kernel]


def snapshot(opt, variables):
    return [bits(v.numpy()) for v in variables + list(opt.variables)]


@pytest.mark.parametrize("inner", list(BAD_INNERS))
@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("indices,why", [
    ([3, 10], "index past its last row"),
    ([-1, 2], "negative index"),
], ids=["past", "negative"])
def test_index_out_of_range_raises_and_changes_nothing(indices, why, mode, inner):
    opt, variables = bad_setup(inner)
    before = snapshot(opt, variables)
    grads = [tf.IndexedSlices(tf.ones((2, 3), tf.float16), tf.constant(indices),
                              tf.constant([10, 3])), tf.ones((2, 2), tf.float16)]
    apply = (lambda: opt.apply(grads, variables)) if mode == "eager" else \
        tf.function(lambda: opt.apply(grads, variables))
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"emb_table.*{why}"):
        apply()
    assert snapshot(opt, variables) == before
    assert opt.step_path.startswith("fused"), opt.step_path


@pytest.mark.parametrize("inner", list(BAD_INNERS))
def test_slices_of_another_row_shape_raise_and_change_nothing(inner):
    """Statically known: at once, naming the variable; known only when the
    step runs (a tf.function over unknown shapes): its run-time check."""
    opt, variables = bad_setup(inner)
    before = snapshot(opt, variables)
    bad = [tf.IndexedSlices(tf.ones((2, 4), tf.float16), tf.constant([1, 2]),
                            tf.constant([10, 3])), tf.ones((2, 2), tf.float16)]
    with pytest.raises(ValueError, match="emb_table"):
        opt.apply(bad, variables)
    assert snapshot(opt, variables) == before

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float16),
                                  tf.TensorSpec([None], tf.int32)])
    def step(values, indices):
        opt.apply([tf.IndexedSlices(values, indices, tf.constant([10, 3])),
                   tf.ones((2, 2), tf.float16)], variables)

    with pytest.raises(tf.errors.InvalidArgumentError, match="emb_table.*another shape"):
        step(tf.ones((2, 4), tf.float16), tf.constant([1, 2]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="emb_table.*one index per slice"):
        step(tf.ones((2, 3), tf.float16), tf.constant([1, 2, 3]))
    assert snapshot(opt, variables) == before
    step(tf.ones((2, 3), tf.float16), tf.constant([1, 2]))
    assert snapshot(opt, variables) != before


def test_op_refuses_a_term_where_it_does_not_apply():
    """The op's gradient terms: one per variable, for a family that takes one,
    unscale 'none', each its gradient's shape; else an error and no write."""
    from lossscale import _loader

    module, _ = _loader.load()
    w = tf.Variable(np.ones(4, np.float32), name="w")
    m = tf.Variable(np.zeros(4, np.float32), name="m")
    v = tf.Variable(np.zeros(4, np.float32), name="v")
    adam = dict(family="adam", hyper=[0.1, 0.001, 1e-7, 0.0], decay=[0])

    def call(terms, unscale="none", **kw):
        args = dict(adam, **kw)
        slots = [m.handle, v.handle] if args["family"] == "adam" else [m.handle]
        scalars = [tf.constant(0.01)] if args["family"] == "adam" else []
        module.loss_scale_apply_optimizer(
            tf.constant(True), [w.handle], slots, [tf.ones(4)], tf.constant(1.0),
            tf.constant(0.1), tf.constant(0.0), scalars, [], terms, [], [], [], [], [],
            unscale=unscale, **args)

    before = [bits(x.numpy()) for x in (w, m, v)]
    with pytest.raises(tf.errors.InvalidArgumentError, match="'sgd': no"):
        call([tf.ones(4)], family="sgd", hyper=[0.9, 0.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="unscale 'divide'"):
        call([tf.ones(4)], unscale="divide")
    with pytest.raises(tf.errors.InvalidArgumentError, match="gradient term of variable 'w"):
        call([tf.ones(5)])
    assert [bits(x.numpy()) for x in (w, m, v)] == before
    call([tf.fill([4], 4.0)])
    # v = 0 + (4 - 0) * 0.001: the term, not g * g = 1.
    assert bits(v.numpy()) == bits(np.full(4, np.float32(4.0) * np.float32(0.001)))
