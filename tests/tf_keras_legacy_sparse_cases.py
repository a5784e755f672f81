"""tf_keras' legacy optimizers on sparse gradients, run by
``test_tf_keras.py`` in a child pytest with ``TF_USE_LEGACY_KERAS=1``.

An ``Embedding``'s gradient is a ``tf.IndexedSlices``, one slice per token
of the batch, so a token repeated in a batch repeats its row's index.
``tf_keras.optimizers.legacy`` optimizers sum each row's slices first
(``_deduplicate_indexed_slices``), then update by TensorFlow's
``ResourceSparseApply*`` kernels, which move the rows named alone (SGD with
momentum, RMSprop with momentum, Adagrad), or by their own ops, which decay
the slots of every row (Adam, RMSprop without momentum); SGD without
momentum adds the slices one by one (``ResourceScatterAdd``), which the
fused step runs as that op itself.  A clip takes the slices as they came,
before the sum: the fused step clips by the optimizer's own ops.  Every check here
trains with ours and with ``tf_keras``' own ``LossScaleOptimizer`` from the
same weights and data and compares every weight, slot, the loss scale, its
counter and ``iterations`` bit for bit after every step, through
overflowing steps (skipped, the scale backing off) and growing ones.
"""

from tf_keras_cases import (BATCH, GROWTH, STOCK, STRATEGY, _apply_step, _assert_moved,
                            _assert_same_states, _custom_loop, _fused_state, _minimize_step,
                            fit_lockstep)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import lossscale  # noqa: E402

STEPS = 60
VOCAB = 50
TOKENS = 6
# Rows of 20 (two of Eigen's 8-float packets and a tail of 4, where
# TensorFlow's sparse RMSprop takes a true square root) and of 1.
WIDE, NARROW = 20, 1

LEGACY = {
    "sgd": (lambda: tf_keras.optimizers.legacy.SGD(1e-2), "SGD"),
    "sgd_momentum": (lambda: tf_keras.optimizers.legacy.SGD(1e-2, momentum=0.9), "SGD"),
    "sgd_nesterov_schedule": (lambda: tf_keras.optimizers.legacy.SGD(
        tf_keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=3, decay_rate=0.9),
        momentum=0.9, nesterov=True), "SGD"),
    "adam": (lambda: tf_keras.optimizers.legacy.Adam(1e-2), "Adam"),
    "adam_amsgrad": (lambda: tf_keras.optimizers.legacy.Adam(1e-2, amsgrad=True), "Adam"),
    "rmsprop": (lambda: tf_keras.optimizers.legacy.RMSprop(1e-3), "RMSprop"),
    "rmsprop_centered": (lambda: tf_keras.optimizers.legacy.RMSprop(1e-3, centered=True),
                         "RMSprop"),
    "rmsprop_momentum": (lambda: tf_keras.optimizers.legacy.RMSprop(1e-3, momentum=0.5),
                         "RMSprop"),
    "rmsprop_momentum_centered": (lambda: tf_keras.optimizers.legacy.RMSprop(
        1e-3, momentum=0.5, centered=True), "RMSprop"),
    "adagrad": (lambda: tf_keras.optimizers.legacy.Adagrad(1e-2), "Adagrad"),
    # Clips that bite on some steps and some variables and not on others.
    "sgd_clipvalue": (lambda: tf_keras.optimizers.legacy.SGD(1e-2, clipvalue=0.5), "SGD"),
    "sgd_momentum_clipnorm": (lambda: tf_keras.optimizers.legacy.SGD(
        1e-2, momentum=0.9, clipnorm=1.0), "SGD"),
    "adam_clipnorm": (lambda: tf_keras.optimizers.legacy.Adam(1e-2, clipnorm=1.0), "Adam"),
    "rmsprop_clipvalue": (lambda: tf_keras.optimizers.legacy.RMSprop(1e-3, clipvalue=0.5),
                          "RMSprop"),
    "adagrad_global_clipnorm": (lambda: tf_keras.optimizers.legacy.Adagrad(
        1e-2, global_clipnorm=2.0), "Adagrad"),
}


def _data(steps=STEPS):
    """``steps`` batches of ``TOKENS`` token ids (as floats) then 4 features,
    and targets; every ninth batch's features overflow float16 at any
    scale the run reaches.  Each batch repeats tokens and leaves rows out."""
    rng = np.random.default_rng(23)
    ids = rng.integers(0, VOCAB, size=(steps * BATCH, TOKENS)).astype("float32")
    feats = rng.normal(size=(steps * BATCH, 4)).astype("float32")
    for i in range(4, steps, 9):
        feats[i * BATCH:(i + 1) * BATCH] *= 3e3
    y = (rng.normal(size=(steps * BATCH, 1)) * 40).astype("float32")
    return np.concatenate([ids, feats], axis=1), y


def _model():
    tf_keras.utils.set_random_seed(5)
    inputs = tf_keras.Input((TOKENS + 4,))
    ids = tf_keras.layers.Lambda(lambda t: tf.cast(t[:, :TOKENS], tf.int32))(inputs)
    feats = tf_keras.layers.Lambda(lambda t: t[:, TOKENS:])(inputs)
    wide = tf_keras.layers.Embedding(VOCAB, WIDE, dtype="mixed_float16")(ids)
    narrow = tf_keras.layers.Embedding(VOCAB, NARROW, dtype="mixed_float16")(ids)
    flat = [tf_keras.layers.Flatten(dtype="mixed_float16")(e) for e in (wide, narrow)]
    joined = tf_keras.layers.Concatenate(dtype="mixed_float16")(flat + [feats])
    hidden = tf_keras.layers.Dense(7, activation="relu", dtype="mixed_float16")(joined)
    return tf_keras.Model(inputs, tf_keras.layers.Dense(1, dtype="float32")(hidden))


def _make(cls, kind):
    return cls(LEGACY[kind][0](), initial_scale=2.0**10, dynamic_growth_steps=GROWTH)


def _run(make, kind, use_function, make_step=_apply_step, steps=STEPS):
    x, y = _data(steps)
    opt = _make(make, kind)
    return opt, _custom_loop(opt, _model(), x, y, use_function, steps, _fused_state, make_step)


def test_the_data_repeat_and_leave_out_rows():
    x, _ = _data()
    for i in range(STEPS):
        ids = x[i * BATCH:(i + 1) * BATCH, :TOKENS].astype(int).ravel()
        assert len(set(ids)) < ids.size, f"batch {i} repeats no token"
        assert len(set(ids)) < VOCAB, f"batch {i} names every row"


def test_the_embeddings_gradients_are_sparse():
    x, y = _data(1)
    model = _model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[:BATCH]) - y[:BATCH]))
    grads = tape.gradient(loss, model.trainable_variables)
    assert sum(isinstance(g, tf.IndexedSlices) for g in grads) == 2


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("kind", sorted(LEGACY))
def test_legacy_sparse_custom_loop_bit_identical(kind, use_function):
    _, want = _run(STOCK, kind, use_function)
    opt, got = _run(lossscale.LossScaleOptimizer, kind, use_function)
    assert opt.step_path == f"fused ({LEGACY[kind][1]})", opt.step_path
    _assert_moved(want)
    _assert_same_states(got, want)


@pytest.mark.parametrize("kind", ["adam_amsgrad", "rmsprop_momentum_centered", "sgd_momentum",
                                  "rmsprop_centered", "adagrad"])
def test_legacy_sparse_minimize_bit_identical(kind):
    # TensorFlow 2.4's minimize: the gradients reach the step scaled.
    _, want = _run(STOCK, kind, True, _minimize_step)
    opt, got = _run(lossscale.LossScaleOptimizer, kind, True, _minimize_step)
    assert opt.step_path == f"fused ({LEGACY[kind][1]})", opt.step_path
    _assert_same_states(got, want)


@pytest.mark.parametrize("kind", sorted(LEGACY))
def test_legacy_sparse_fit_bit_identical(kind):
    opt, states, _ = fit_lockstep(_model, lambda cls: _make(cls, kind), *_data())
    assert opt.step_path == f"fused ({LEGACY[kind][1]})"
    _assert_moved(states[0])
    _assert_same_states(states[1], states[0])


def _table():
    return tf.Variable(np.arange(15, dtype=np.float32).reshape(5, 3) / 7)


def _slices(indices, rows=None):
    values = np.linspace(-1.0, 2.0, 3 * len(indices), dtype=np.float32).reshape(-1, 3)
    return tf.IndexedSlices(tf.constant(values), tf.constant(indices, tf.int64),
                            tf.constant([5 if rows is None else rows, 3], tf.int64))


@pytest.mark.parametrize("inner,name", [
    (lambda: tf_keras.optimizers.legacy.SGD(1e-2), "SGD"),
    (lambda: tf_keras.optimizers.legacy.Adam(clipnorm=1.0), "Adam"),
    (lambda: tf_keras.optimizers.legacy.Adagrad(global_clipnorm=1.0), "Adagrad"),
    (lambda: tf_keras.optimizers.legacy.RMSprop(clipvalue=1.0), "RMSprop"),
    (lambda: tf_keras.optimizers.legacy.SGD(0.5, momentum=0.5, clipvalue=0.7), "SGD"),
], ids=["sgd", "adam_clipnorm", "adagrad_global_clipnorm", "rmsprop_clipvalue",
        "sgd_momentum_clipvalue"])
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
def test_legacy_hand_made_slices_bit_identical(inner, name, use_function):
    """Slices that repeat a row and clips that bite on them, beside a dense
    gradient that overflows on one step: the step fused (SGD without
    momentum by its own ResourceScatterAdd, a clip by the optimizer's own
    ops), every state as tf_keras' own, the overflowing step skipped."""
    states = []
    for make in (STOCK, lossscale.LossScaleOptimizer):
        var = _table()
        dense = tf.Variable(np.ones(4, np.float32))
        opt = make(inner(), initial_scale=4.0)

        def step(grad, dense_grad):
            grads = opt.get_unscaled_gradients([grad, dense_grad])
            opt.apply_gradients(zip(grads, [var, dense]))

        if use_function:
            step = tf.function(step)
        for k in range(4):
            scaled = _slices([3, 0, 3, 1])
            scaled = tf.IndexedSlices(scaled.values * 4.0, scaled.indices, scaled.dense_shape)
            step(scaled, tf.constant([1.0, 2.0, np.inf if k == 2 else 3.0, 4.0]))
        states.append([var.numpy(), dense.numpy()]
                      + [v.numpy() for v in opt.inner_optimizer.variables()]
                      + [opt.loss_scale.numpy()])
    assert opt.step_path == f"fused ({name})", opt.step_path
    assert not np.array_equal(states[0][0], _table().numpy())
    _assert_same_states([states[1]], [states[0]])


def test_legacy_sgd_without_momentum_under_a_strategy_is_stock():
    """Under several replicas the slices' own scatter stays stock's, saying why."""
    opt, states, _ = fit_lockstep(_model, lambda cls: _make(cls, "sgd"), *_data(6), STRATEGY)
    assert opt.step_path.startswith("stock: tf_keras' legacy SGD without momentum adds a "
                                    "sparse gradient's slices to "), opt.step_path
    assert opt.step_path.endswith(
        ", and its own update does not run under several replicas"), opt.step_path
    _assert_same_states(states[1], states[0])


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam", "rmsprop", "adagrad", "sgd",
                                  "adam_clipnorm", "adagrad_global_clipnorm"])
@pytest.mark.parametrize("indices,rows,match", [
    ([0, 5], None, "has an index past its last row; no variable was changed"),
    ([0, -1], None, "has a negative index; no variable was changed"),
    ([0, 1, 2], 5, "has not one index per slice; no variable was changed"),
], ids=["past", "negative", "count"])
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
def test_legacy_sparse_bad_slices_change_nothing(kind, indices, rows, match, use_function):
    var = _table()
    opt = lossscale.LossScaleOptimizer(LEGACY[kind][0](), initial_scale=4.0)
    opt.apply_gradients([(_slices([1, 1]), var)])
    assert opt.step_path == f"fused ({LEGACY[kind][1]})", opt.step_path
    before = [v.numpy().copy() for v in [var] + opt.inner_optimizer.variables()
              + [opt.loss_scale]]
    grad = _slices(indices, rows)
    if match.startswith("has not one"):
        grad = tf.IndexedSlices(grad.values[:2], tf.constant(indices, tf.int64), grad.dense_shape)

    def step():
        opt.apply_gradients([(grad, var)])

    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        (tf.function(step) if use_function else step)()
    after = [v.numpy() for v in [var] + opt.inner_optimizer.variables() + [opt.loss_scale]]
    _assert_same_states([after], [before])


@pytest.mark.parametrize("kind", ["sgd_nesterov_schedule", "adam_amsgrad", "rmsprop_centered",
                                  "rmsprop_momentum_centered", "adagrad", "adam_clipnorm",
                                  "rmsprop_clipvalue"])
def test_legacy_sparse_mirrored_fit_bit_identical(kind):
    """Under MirroredStrategy (two replicas): the all-reduce concatenates the
    replicas' slices, which tf_keras then sums per row as one replica's."""
    opt, states, _ = fit_lockstep(_model, lambda cls: _make(cls, kind), *_data(24), STRATEGY)
    assert opt.step_path == f"fused ({LEGACY[kind][1]})"
    assert len(states[0]) == 24
    _assert_moved(states[0])
    _assert_same_states(states[1], states[0])
