"""tf_keras' current optimizers (``tf_keras.optimizers``) with sparse
gradients and with EMA on the fused step, run by ``test_tf_keras.py`` in a
child pytest with ``TF_USE_LEGACY_KERAS=1``.

Their ``apply_gradients`` sums a sparse gradient's duplicate slices per row
(``_deduplicate_sparse_grad``) before ``update_step`` scatters the sums
(Adam's and AdamW's after decaying ``m`` and ``v`` on every row, RMSprop's
times lr and the rsqrt of the rows' denominators gathered);
with ``use_ema`` it moves the averages of the step's variables after their
updates (``ema_momentum * average + (1 - ema_momentum) * var``) and, every
``ema_overwrite_frequency`` steps, overwrites the variables with them.
Every check trains with ours and with ``tf_keras``' own
``LossScaleOptimizer`` from the same weights and data and compares every
weight, slot, average, the loss scale, its counter and ``iterations`` bit
for bit after every step, through overflowing steps (skipped, the scale
backing off) and growing ones.
"""

from tf_keras_cases import (BATCH, GROWTH, STOCK, STRATEGY, _apply_step, _assert_moved,
                            _assert_same_states, _custom_loop, _fused_model, _fused_state,
                            _minimize_step, fit_lockstep)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import lossscale  # noqa: E402
from lossscale import _compat  # noqa: E402
from helpers import assert_same_bits, overflowing_batches  # noqa: E402

STEPS = 63
ROWS, IDS = 29, 6


def _sparse_data(steps):
    """Ids (duplicates within a batch, rows no batch takes) and targets;
    every ninth batch's targets overflow float16 at any scale a run
    reaches."""
    rng = np.random.default_rng(13)
    ids = rng.integers(0, ROWS - 3, size=(steps * BATCH, IDS)).astype("int32")
    y = (rng.normal(size=(steps * BATCH, 1)) * 40).astype("float32")
    for i in range(4, steps, 9):
        y[i * BATCH:(i + 1) * BATCH] *= 3e3
    return ids, y


def _sparse_model():
    """An ``Embedding`` (its gradient a ``tf.IndexedSlices``) under
    mixed_float16, then dense layers (a one-element bias among them).  Its
    rows are 7 wide: the K rows a batch names, gathered (RMSprop's
    denominators), end in a tail of TensorFlow's Rsqrt but where K is a
    multiple of 8."""
    tf_keras.utils.set_random_seed(5)
    model = tf_keras.Sequential([
        tf_keras.Input((IDS,), dtype="int32"),
        tf_keras.layers.Embedding(ROWS, 7, dtype="mixed_float16"),
        tf_keras.layers.Flatten(dtype="mixed_float16"),
        tf_keras.layers.Dense(11, activation="relu", dtype="mixed_float16"),
        tf_keras.layers.Dense(1, dtype="float32")])
    return model


def _dense_data(steps):
    return overflowing_batches(steps, BATCH, seed=11, first=4, every=9, factor=3e3)


# Each case: (the inner optimizer's maker, the class step_path names).  On
# the Embedding model:
SPARSE = {
    "sgd": (lambda: tf_keras.optimizers.SGD(1e-2), "SGD"),
    "sgd_momentum": (lambda: tf_keras.optimizers.SGD(1e-2, momentum=0.9), "SGD"),
    "sgd_momentum_decay_ema_overwrite": (lambda: tf_keras.optimizers.SGD(
        1e-2, momentum=0.9, weight_decay=0.004, use_ema=True, ema_momentum=0.9,
        ema_overwrite_frequency=5), "SGD"),
    "sgd_ema": (lambda: tf_keras.optimizers.SGD(1e-2, use_ema=True), "SGD"),
    # Nesterov's adds the sums times -lr to the weight before m * momentum
    # (the core's tf_keras_sgd family).
    "sgd_nesterov": (lambda: tf_keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
                     "SGD"),
    "sgd_nesterov_decay_ema_overwrite": (lambda: tf_keras.optimizers.SGD(
        3e-2, momentum=0.7, nesterov=True, weight_decay=0.004, use_ema=True,
        ema_momentum=0.9, ema_overwrite_frequency=5), "SGD"),
    # Adam's sparse update is its own (m and v decayed on every row, the
    # sums' terms scattered): the core's tf_keras_adam family.
    "adam": (lambda: tf_keras.optimizers.Adam(1e-2), "Adam"),
    "adam_amsgrad": (lambda: tf_keras.optimizers.Adam(1e-2, beta_1=0.8, beta_2=0.99,
                                                      epsilon=1e-3, amsgrad=True), "Adam"),
    "adamw": (lambda: tf_keras.optimizers.AdamW(1e-3, weight_decay=0.004), "AdamW"),
    "adamw_amsgrad_ema_overwrite": (lambda: tf_keras.optimizers.AdamW(
        3e-3, weight_decay=0.1, amsgrad=True, use_ema=True, ema_momentum=0.9,
        ema_overwrite_frequency=7), "AdamW"),
    # RMSprop's sparse update is its own (velocity decayed on every row, the
    # sums times lr and the rsqrt of the named rows' denominators gathered):
    # the core's tf_keras_rmsprop family.
    "rmsprop": (lambda: tf_keras.optimizers.RMSprop(1e-3), "RMSprop"),
    "rmsprop_momentum": (lambda: tf_keras.optimizers.RMSprop(1e-3, rho=0.8, momentum=0.9),
                         "RMSprop"),
    "rmsprop_centered": (lambda: tf_keras.optimizers.RMSprop(3e-3, centered=True,
                                                             epsilon=1e-6), "RMSprop"),
    "rmsprop_centered_momentum": (lambda: tf_keras.optimizers.RMSprop(
        1e-3, momentum=0.5, centered=True), "RMSprop"),
    "rmsprop_decay_ema_overwrite": (lambda: tf_keras.optimizers.RMSprop(
        1e-3, weight_decay=0.004, use_ema=True, ema_momentum=0.9,
        ema_overwrite_frequency=5), "RMSprop"),
    "rmsprop_centered_momentum_decay_ema_overwrite": (lambda: tf_keras.optimizers.RMSprop(
        3e-3, rho=0.95, momentum=0.7, centered=True, weight_decay=0.01, use_ema=True,
        ema_overwrite_frequency=4), "RMSprop"),
}

# On tf_keras_cases' dense model (with a rank-0 weight for RMSprop):
EMA = {
    "adam_ema": (lambda: tf_keras.optimizers.Adam(1e-2, use_ema=True), "Adam"),
    "adam_ema_overwrite": (lambda: tf_keras.optimizers.Adam(
        1e-2, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=4), "Adam"),
    "adamw_amsgrad_ema_overwrite": (lambda: tf_keras.optimizers.AdamW(
        1e-3, weight_decay=0.004, amsgrad=True, use_ema=True, ema_overwrite_frequency=7),
        "AdamW"),
    "sgd_nesterov_ema_overwrite": (lambda: tf_keras.optimizers.SGD(
        1e-2, momentum=0.9, nesterov=True, use_ema=True, ema_momentum=0.9,
        ema_overwrite_frequency=3), "SGD"),
    "sgd_ema": (lambda: tf_keras.optimizers.SGD(1e-2, use_ema=True), "SGD"),
    "rmsprop_ema": (lambda: tf_keras.optimizers.RMSprop(1e-3, use_ema=True), "RMSprop"),
    "rmsprop_centered_momentum_ema_overwrite": (lambda: tf_keras.optimizers.RMSprop(
        1e-3, momentum=0.5, centered=True, use_ema=True, ema_overwrite_frequency=6),
        "RMSprop"),
}

# kind -> (maker, class name, model, data).
CASES = dict([(f"sparse_{k}", (make, name, _sparse_model, _sparse_data))
              for k, (make, name) in SPARSE.items()]
             + [(f"dense_{k}", (make, name, lambda k=k: _fused_model(k), _dense_data))
                for k, (make, name) in EMA.items()])


def _make(cls, inner):
    return cls(inner, initial_scale=2.0**10, dynamic_growth_steps=GROWTH)


def _run(cls, kind, use_function, make_step=_apply_step, steps=STEPS):
    make, _, model, data = CASES[kind]
    x, y = data(steps)
    opt = _make(cls, make())
    return opt, _custom_loop(opt, model(), x, y, use_function, steps, _fused_state, make_step)


def _assert_sparse(kind):
    """The sparse cases' model has a sparse gradient, with duplicate
    indices, and rows without one."""
    if kind.startswith("sparse"):
        model = _sparse_model()
        ids, y = _sparse_data(1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids) - y))
        grad = tape.gradient(loss, model.trainable_variables)[0]
        assert isinstance(grad, tf.IndexedSlices)
        taken = np.unique(grad.indices.numpy())
        assert len(taken) < len(grad.indices) and len(taken) < ROWS


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_custom_loop_bit_identical(kind, use_function):
    # TensorFlow 2.4's custom loop: get_scaled_loss, get_unscaled_gradients,
    # apply_gradients.
    _, want = _run(STOCK, kind, use_function)
    opt, got = _run(lossscale.LossScaleOptimizer, kind, use_function)
    assert opt.step_path == f"fused ({CASES[kind][1]})", opt.step_path
    _assert_sparse(kind)
    _assert_moved(want)
    _assert_same_states(got, want)


@pytest.mark.parametrize("kind", ["sparse_sgd_momentum", "sparse_sgd_momentum_decay_ema_overwrite",
                                  "sparse_sgd_nesterov_decay_ema_overwrite", "sparse_adam", "sparse_adamw_amsgrad_ema_overwrite",
                                  "sparse_rmsprop_momentum",
                                  "sparse_rmsprop_centered_momentum_decay_ema_overwrite",
                                  "dense_adam_ema_overwrite",
                                  "dense_rmsprop_centered_momentum_ema_overwrite"])
def test_minimize_bit_identical(kind):
    # TensorFlow 2.4's minimize: the gradients reach the step scaled.
    _, want = _run(STOCK, kind, True, _minimize_step)
    opt, got = _run(lossscale.LossScaleOptimizer, kind, True, _minimize_step)
    assert opt.step_path == f"fused ({CASES[kind][1]})", opt.step_path
    _assert_same_states(got, want)


@pytest.mark.parametrize("kind", ["sparse_sgd", "sparse_sgd_momentum_decay_ema_overwrite",
                                  "sparse_sgd_nesterov",
                                  "sparse_adam_amsgrad", "sparse_adamw",
                                  "sparse_adamw_amsgrad_ema_overwrite", "sparse_rmsprop_centered",
                                  "sparse_rmsprop_decay_ema_overwrite", "dense_adam_ema",
                                  "dense_adamw_amsgrad_ema_overwrite",
                                  "dense_sgd_nesterov_ema_overwrite",
                                  "dense_rmsprop_centered_momentum_ema_overwrite"])
def test_fit_bit_identical(kind):
    # fit's train step (minimize), then finalize_variable_values: with EMA
    # the model's weights become their averages when training ends.
    make, name, make_model, data = CASES[kind]
    opt, states, finals = fit_lockstep(make_model, lambda cls: _make(cls, make()),
                                       *data(STEPS))
    assert opt.step_path == f"fused ({name})", opt.step_path
    assert len(states[0]) == STEPS
    _assert_moved(states[0])
    _assert_same_states(states[1], states[0])
    _assert_same_states([finals[1]], [finals[0]])


def test_averages_move_and_overwrite():
    # The EMA runs are not vacuous: the averages differ from the weights,
    # and an overwrite makes them equal, on its steps alone.
    def state(model, opt):
        weights = model.trainable_weights
        averages = _compat.tf_keras_optimizer_slots(opt.inner_optimizer, "average", weights)
        return [w.numpy() for w in weights], [a.numpy() for a in averages]

    opt = _make(STOCK, EMA["adam_ema_overwrite"][0]())
    x, y = _dense_data(12)
    states = _custom_loop(opt, _fused_model(), x, y, False, 12, state)
    equal = [all(np.array_equal(w, a) for w, a in zip(*s)) for s in states]
    assert any(equal) and not all(equal), equal


# tf_keras clips a sparse gradient's slices as they came (clip_by_norm by
# their norm, clip_by_global_norm by their l2_loss among the others'),
# before it sums a row's duplicates: the fused step clips by its own ops.
_CLIPPED_SPARSE = {
    "sgd_momentum_clipnorm": (lambda: tf_keras.optimizers.SGD(1e-2, momentum=0.9, clipnorm=1.0),
                              "SGD"),
    "sgd_global_clipnorm": (lambda: tf_keras.optimizers.SGD(1e-2, global_clipnorm=1.0), "SGD"),
    "adam_clipvalue": (lambda: tf_keras.optimizers.Adam(1e-2, clipvalue=1.0), "Adam"),
    "adamw_global_clipnorm_ema": (lambda: tf_keras.optimizers.AdamW(
        1e-2, weight_decay=0.01, global_clipnorm=0.5, use_ema=True), "AdamW"),
    "rmsprop_clipnorm": (lambda: tf_keras.optimizers.RMSprop(1e-3, clipnorm=0.5), "RMSprop"),
}


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("kind", sorted(_CLIPPED_SPARSE))
def test_clipped_sparse_gradients_fused_bit_identical(kind, use_function):
    make, name = _CLIPPED_SPARSE[kind]
    runs = []
    for cls in (STOCK, lossscale.LossScaleOptimizer):
        opt = _make(cls, make())
        x, y = _sparse_data(STEPS)
        runs.append(_custom_loop(opt, _sparse_model(), x, y, use_function, STEPS, _fused_state))
    assert opt.step_path == f"fused ({name})", opt.step_path
    _assert_moved(runs[0])
    _assert_same_states(runs[1], runs[0])


def test_ema_overwrite_under_a_strategy_is_stock():
    # The EMA alone fuses under a strategy (tf_keras_mirrored_cases), its
    # overwrite does not.
    strategy = tf.distribute.OneDeviceStrategy("CPU:0")
    with strategy.scope():
        var = tf.Variable(tf.ones([3]))
        opt = lossscale.LossScaleOptimizer(tf_keras.optimizers.SGD(
            use_ema=True, ema_overwrite_frequency=2))
    strategy.run(lambda: opt.apply_gradients([(tf.ones([3]), var)]))
    assert opt.step_path == _EMA_UNDER_A_STRATEGY


_IN_ORDER = {
    "sgd_momentum_ema_overwrite": (lambda: tf_keras.optimizers.SGD(
        0.1, momentum=0.5, use_ema=True, ema_overwrite_frequency=2), "SGD"),
    "adam_amsgrad": (lambda: tf_keras.optimizers.Adam(0.1, amsgrad=True), "Adam"),
    "adamw_ema_overwrite": (lambda: tf_keras.optimizers.AdamW(
        0.1, weight_decay=0.05, use_ema=True, ema_overwrite_frequency=2), "AdamW"),
    # The rows gathered in the order of their first slice (4, 0, 2, 5):
    # twelve elements, a packet of TensorFlow's Rsqrt and a tail of four.
    "rmsprop": (lambda: tf_keras.optimizers.RMSprop(0.1), "RMSprop"),
    "rmsprop_centered_momentum_ema_overwrite": (lambda: tf_keras.optimizers.RMSprop(
        0.1, rho=0.8, momentum=0.5, centered=True, weight_decay=0.05, use_ema=True,
        ema_overwrite_frequency=2), "RMSprop"),
}


@pytest.mark.parametrize("kind", sorted(_IN_ORDER))
def test_sparse_rows_sum_in_order(kind):
    # Duplicate indices in any order, a row no slice takes, and values whose
    # sums round by their order: ours and stock's after each step.
    make, name = _IN_ORDER[kind]
    rng = np.random.default_rng(3)
    values = (rng.normal(size=(9, 3)) * np.exp2(rng.integers(-12, 12, size=(9, 1)))).astype(
        np.float32)
    indices = tf.constant([4, 0, 4, 2, 0, 4, 5, 2, 4])
    for use_function in (False, True):
        states = []
        for cls in (STOCK, lossscale.LossScaleOptimizer):
            var = tf.Variable(np.arange(18, dtype=np.float32).reshape(6, 3) / 7)
            opt = _make(cls, make())

            def step(k):
                grads = tf.IndexedSlices(tf.constant(values) * k * opt.loss_scale, indices,
                                         tf.constant([6, 3]))
                opt.apply_gradients([(opt.get_unscaled_gradients([grads])[0], var)])

            if use_function:
                step = tf.function(step)
            states.append([])
            for k in (1.0, 3.0, -2.0, 0.5):
                step(tf.constant(k))
                states[-1].append([var.numpy()] + [v.numpy() for v in
                                                   opt.inner_optimizer.variables])
        assert opt.step_path == f"fused ({name})", opt.step_path
        for a, b in zip(states[1], states[0]):
            for x, w in zip(a, b):
                assert_same_bits(x, w, "sparse step")


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
def test_sparse_rmsprop_one_element(use_function):
    # A one-element variable's lr * g * rsqrt(d) is regrouped in a graph by
    # the names of its tensors: stock there, fused eagerly; both as stock.
    rng = np.random.default_rng(5)
    values = (rng.normal(size=(3, 1)) * np.exp2(rng.integers(-6, 6, size=(3, 1)))).astype(
        np.float32)
    states = []
    for cls in (STOCK, lossscale.LossScaleOptimizer):
        var = tf.Variable([[0.25]])
        opt = _make(cls, tf_keras.optimizers.RMSprop(1e-3, momentum=0.5))

        def step(k):
            grads = tf.IndexedSlices(tf.constant(values) * k * opt.loss_scale,
                                     tf.constant([0, 0, 0]), tf.constant([1, 1]))
            opt.apply_gradients([(opt.get_unscaled_gradients([grads])[0], var)])

        if use_function:
            step = tf.function(step)
        states.append([])
        for k in np.linspace(-3.0, 3.0, 24).astype(np.float32):
            step(tf.constant(k))
            states[-1].append([var.numpy()] + [v.numpy() for v in opt.inner_optimizer.variables])
    want = ("stock: a sparse (IndexedSlices) gradient of a one-element variable "
            f"({var.name}) in a graph (TensorFlow's graph optimizer orders tf_keras RMSprop's "
            "lr * g * rsqrt(d) of the gathered rows by the names of its tensors)"
            if use_function else "fused (RMSprop)")
    assert opt.step_path == want, opt.step_path
    for a, b in zip(states[1], states[0]):
        for x, w in zip(a, b):
            assert_same_bits(x, w, "sparse step")


_EMA_UNDER_A_STRATEGY = ("stock: tf_keras' EMA with ema_overwrite_frequency under a "
                         "tf.distribute strategy (it overwrites the variables by the strategy's "
                         "update calls)")


@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("kind, path", [("sgd_momentum", "fused (SGD)"),
                                        ("adam_amsgrad", "fused (Adam)"),
                                        ("rmsprop_centered_momentum", "fused (RMSprop)"),
                                        ("sgd_ema", "fused (SGD)"),
                                        ("sgd_momentum_decay_ema_overwrite",
                                         _EMA_UNDER_A_STRATEGY),
                                        ("adam_clipvalue", "fused (Adam)"),
                                        ("sgd_global_clipnorm", "fused (SGD)"),
                                        ("adamw_global_clipnorm_ema", "fused (AdamW)")])
def test_sparse_under_mirrored_strategy_bit_identical(kind, path, use_function):
    # Two replicas, each on its own half of the batch: tf_keras sums the
    # replicas' gradients (a sparse one's slices concatenated in replica
    # order), then sums a row's duplicates; the fused step takes the
    # concatenation as one replica's.
    steps = 14
    ids, y = _sparse_data(steps)
    runs = []
    for cls in (STOCK, lossscale.LossScaleOptimizer):
        with STRATEGY.scope():
            model = _sparse_model()
            opt = _make(cls, {**SPARSE, **_CLIPPED_SPARSE}[kind][0]())

        def replica_step(xb, yb, model=model, opt=opt):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
                scaled = opt.get_scaled_loss(loss)
            grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
            opt.apply_gradients(zip(grads, model.trainable_variables))

        def step(xb, yb, replica_step=replica_step):
            STRATEGY.run(replica_step, args=(xb, yb))

        if use_function:
            step = tf.function(step)
        states = []
        for i in range(steps):
            batch = slice(i * BATCH, (i + 1) * BATCH)
            dataset = STRATEGY.experimental_distribute_values_from_function(
                lambda context, batch=batch: (
                    ids[batch][context.replica_id_in_sync_group::2],
                    y[batch][context.replica_id_in_sync_group::2]))
            step(*dataset)
            states.append([np.asarray(v.numpy()) for v in
                           model.weights + list(opt.inner_optimizer.variables)
                           + [opt.loss_scale, opt.dynamic_counter, opt.iterations]])
        runs.append(states)
    assert opt.step_path == path, opt.step_path
    _assert_moved(runs[0])
    _assert_same_states(runs[1], runs[0])
