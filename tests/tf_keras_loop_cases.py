"""TensorFlow 2.4's custom loop in a ``tf.function`` on ``tf_keras``: the
unscale folded into the fused step.  Run by ``test_tf_keras.py`` in a child
pytest with ``TF_USE_LEGACY_KERAS=1``.

In a graph, ``get_unscaled_gradients`` returns ``tf_keras``' own stateless
multiplies; when ``apply_gradients`` gets exactly those, the fused step takes
the scaled gradients they came from and unscales them in its one pass, as
in ``minimize``.  Every check trains twice from the same weights and data,
once with ``tf_keras``' own ``LossScaleOptimizer`` (the oracle) and once
with ours, and compares every variable, slot, the loss scale, its counter
and ``iterations`` bit for bit after every step; some batches overflow at
any scale, so steps are skipped and the scale moves both ways.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import lossscale
from helpers import assert_same_bits, overflowing_batches

STOCK = tf_keras.mixed_precision.LossScaleOptimizer
STEPS = 60
BATCH = 8
GROWTH = 2

INNER = {
    "legacy_adam": lambda: tf_keras.optimizers.legacy.Adam(1e-2),
    "legacy_sgd_momentum": lambda: tf_keras.optimizers.legacy.SGD(1e-2, momentum=0.9),
    "legacy_rmsprop": lambda: tf_keras.optimizers.legacy.RMSprop(1e-3, momentum=0.5),
    "adam": lambda: tf_keras.optimizers.Adam(1e-2),
    "adamw": lambda: tf_keras.optimizers.AdamW(1e-3, weight_decay=0.004),
    "sgd": lambda: tf_keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda: tf_keras.optimizers.RMSprop(1e-3),
}


@pytest.fixture(autouse=True)
def _reset():
    yield
    tf_keras.mixed_precision.set_global_policy("float32")


def _data():
    # Every seventh batch overflows the half-precision gradients at any scale.
    return overflowing_batches(STEPS, BATCH, seed=13, first=3, every=7, factor=3e4)


def _model(policy):
    tf_keras.utils.set_random_seed(5)
    model = tf_keras.Sequential([
        tf_keras.layers.Dense(37, activation="relu", dtype=policy),
        tf_keras.layers.Dense(1, dtype="float32")])
    model.build((None, 4))
    return model


def _state(model, opt):
    variables = opt.inner_optimizer.variables
    variables = list(variables() if callable(variables) else variables)
    # A fixed scale has no counter: the scale stands in for it.
    counter = opt.loss_scale if opt.dynamic_counter is None else opt.dynamic_counter
    return [np.asarray(v.numpy()) for v in model.weights + variables
            + [opt.loss_scale, counter, opt.iterations]]


def _run(make, kind, policy, use_grads):
    """Trains in a tf.function; ``use_grads(grads)`` -> (the gradients to
    apply, what the step returns besides).  Returns the states after every
    step, the returns, the optimizer and the last trace's unscaled gradients."""
    x, y = _data()
    model = _model(policy)
    opt = make(INNER[kind]())
    traced = []

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(xb), tf.float32) - yb))
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        traced[:] = [grads]
        applied, extra = use_grads(grads)
        opt.apply_gradients(zip(applied, model.trainable_variables))
        return extra

    states, returns = [], []
    for i in range(STEPS):
        returns.append(step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]))
        states.append(_state(model, opt))
    graph = step.get_concrete_function(x[:BATCH], y[:BATCH]).graph
    return states, returns, opt, traced[0], graph


def _ours(inner):
    return lossscale.LossScaleOptimizer(inner, initial_scale=2.0**10,
                                        dynamic_growth_steps=GROWTH)


def _stock(inner):
    return STOCK(inner, initial_scale=2.0**10, dynamic_growth_steps=GROWTH)


def _assert_same_runs(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w)
        for j, (a, b) in enumerate(zip(g, w)):
            assert_same_bits(a, b, f"step {i}, state {j}")


def _assert_moved(states):
    scales = [float(s[-3]) for s in states]
    assert any(b < a for a, b in zip(scales, scales[1:])), "the run never backed off"
    assert any(b > a for a, b in zip(scales, scales[1:])), "the run never grew"
    assert [int(s[-1]) for s in states] == list(range(1, STEPS + 1))


def _nodes(graph):
    """Every node of ``graph`` and of the functions it calls (conds' branches)."""
    graph_def = graph.as_graph_def()
    yield from graph_def.node
    for function in graph_def.library.function:
        yield from function.node_def


def _fused_unscales(graph):
    return sorted(n.attr["unscale"].s.decode() for n in _nodes(graph)
                  if n.op == "LossScaleApplyOptimizer")


def _native_unscales(graph):
    return sum(n.op == "LossScaleUnscaleAndCheck" for n in _nodes(graph))


def _as_they_are(grads):
    return grads, tf.constant(0.0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("kind", sorted(INNER))
def test_custom_loop_in_function_folds_the_unscale(kind, policy):
    want, _, stock, _, _ = _run(_stock, kind, policy, _as_they_are)
    got, _, opt, unscaled, graph = _run(_ours, kind, policy, _as_they_are)
    _assert_same_runs(got, want)
    if policy == "mixed_float16":
        _assert_moved(want)
    assert _native_unscales(graph) == 0
    assert opt.step_path == f"fused ({type(opt.inner_optimizer).__name__})"
    # One fused pass unscales the scaled gradients (RMSprop's, of its
    # one-element bias, in an op of its own, one for each order TensorFlow's
    # graph optimizer may give that step); the returned multiplies feed
    # nothing, and the function's pruning drops them.
    assert _fused_unscales(graph) == ["multiply"] * (3 if kind == "rmsprop" else 1)
    assert all(not g.consumers() for g in unscaled)
    assert float(opt.loss_scale) == float(stock.loss_scale)


def _log(grads):
    # The step returns their global norm: they are computed, and still the
    # very tensors applied, so the step folds and the norms are tf_keras'.
    return grads, tf.linalg.global_norm(grads)


def _clip(grads):
    # Clipped gradients are new tensors: the step takes them unscaled, as before.
    clipped, norm = tf.clip_by_global_norm(grads, 5.0)
    return clipped, norm


@pytest.mark.parametrize("kind,use_grads,unscale", [
    *((k, _log, "multiply") for k in ("legacy_adam", "adamw", "legacy_sgd_momentum")),
    *((k, _clip, "none") for k in ("legacy_adam", "adam", "sgd"))],
    ids=lambda v: getattr(v, "__name__", v))
def test_loop_that_uses_the_unscaled_gradients(kind, use_grads, unscale):
    want, want_norms, _, _, _ = _run(_stock, kind, "mixed_float16", use_grads)
    got, got_norms, opt, _, graph = _run(_ours, kind, "mixed_float16", use_grads)
    _assert_same_runs(got, want)
    for i, (a, b) in enumerate(zip(got_norms, want_norms)):
        assert_same_bits(a.numpy(), b.numpy(), f"norm of step {i}")
    assert _fused_unscales(graph) == [unscale]
    assert opt.step_path == f"fused ({type(opt.inner_optimizer).__name__})"


def test_gradients_of_another_trace_are_not_folded():
    # What get_unscaled_gradients returned in one tf.function means nothing
    # to apply_gradients in another graph, nor once applied.
    model = _model("mixed_float16")
    opt = _ours(INNER["adam"]())
    x = tf.ones([BATCH, 4])

    @tf.function
    def unscale():
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(tf.reduce_sum(tf.cast(model(x), tf.float32)))
        return opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))

    @tf.function
    def apply(grads):
        opt.apply_gradients(zip(grads, model.trainable_variables))

    grads = unscale()
    assert opt._unscaled_in_graph is not None  # pylint: disable=protected-access
    apply(grads)
    assert opt._unscaled_in_graph is None  # pylint: disable=protected-access
    graph = apply.get_concrete_function(grads).graph
    assert _fused_unscales(graph) == ["none"]


@pytest.mark.parametrize("case", ["scale_below_one", "fused_false"])
def test_loop_that_may_not_fold_takes_the_unscaled_gradients(case):
    # A fixed scale below 1 could overflow a finite gradient when unscaling
    # (checking the scaled ones would not give tf_keras' verdict), and
    # fused=False keeps tf_keras' own step: both apply the returned gradients.
    args = ({"dynamic": False, "initial_scale": 0.5} if case == "scale_below_one"
            else {"initial_scale": 2.0**10, "dynamic_growth_steps": GROWTH})
    fused = case != "fused_false"
    want, _, _, _, _ = _run(lambda inner: STOCK(inner, **args), "adam", "mixed_float16",
                            _as_they_are)
    got, _, opt, _, graph = _run(
        lambda inner: lossscale.LossScaleOptimizer(inner, fused=fused, **args), "adam",
        "mixed_float16", _as_they_are)
    _assert_same_runs(got, want)
    assert _fused_unscales(graph) == (["none"] if fused else [])
    assert opt.step_path == ("fused (Adam)" if fused else "stock: fused=False")
