"""tf_keras' optimizers on the fused step under ``MirroredStrategy`` over two
logical CPUs, run by ``test_tf_keras.py`` in a child pytest with
``TF_USE_LEGACY_KERAS=1``.

``tf_keras``' loss-scale optimizer unscales each replica's gradients, sums
them over the replicas, checks the sums, and then has its inner optimizer
apply them to every copy; the fused step does the same in one pass per
replica.  Per case three models train side by side from the same weights on
the same data, each replica on its own batch:

* ``stock``: ``tf_keras``' own ``LossScaleOptimizer``, every spoiled step
  spoiled on *every* replica;
* ``ours``: ``lossscale.LossScaleOptimizer`` fed the same;
* ``one``: ours with each spoiled step spoiled on *one* replica only (the
  sums are then non-finite on every replica: the step is skipped
  everywhere).

A skipped step leaves nothing of its gradients, so all three hold the same
bits after every step: every copy of every variable, slot, the loss scale,
its counter and ``iterations``; the copies of each agree; a spoiled step
leaves ``one``'s weights as they were; and ``step_path`` says fused.
"""

from helpers import batch_recorder, replica_factor, two_cpu_replicas

STRATEGY = two_cpu_replicas()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import lossscale  # noqa: E402

STOCK = tf_keras.mixed_precision.LossScaleOptimizer
GROWTH = 2
INITIAL_SCALE = 2.0**10
REPLICAS = 2
PER_REPLICA = 4
STEPS = 8
LONG_STEPS = 32

INNER = {
    "adam": (lambda: tf_keras.optimizers.Adam(1e-2), "Adam"),
    "adamw": (lambda: tf_keras.optimizers.AdamW(1e-3, weight_decay=0.004), "AdamW"),
    "sgd_momentum": (lambda: tf_keras.optimizers.SGD(1e-2, momentum=0.9), "SGD"),
    # EMA: each device's averages moved by the strategy's update (without
    # ema_overwrite_frequency, which stays stock under a strategy).
    "sgd_nesterov_ema": (lambda: tf_keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True,
                                                         use_ema=True, ema_momentum=0.9),
                         "SGD"),
    "adamw_amsgrad_ema": (lambda: tf_keras.optimizers.AdamW(1e-3, weight_decay=0.004,
                                                            amsgrad=True, use_ema=True),
                          "AdamW"),
    "rmsprop": (lambda: tf_keras.optimizers.RMSprop(1e-3, momentum=0.5, centered=True),
                "RMSprop"),
    "legacy_sgd_momentum": (lambda: tf_keras.optimizers.legacy.SGD(1e-2, momentum=0.9), "SGD"),
    "legacy_adam": (lambda: tf_keras.optimizers.legacy.Adam(1e-2), "Adam"),
    "legacy_rmsprop": (lambda: tf_keras.optimizers.legacy.RMSprop(1e-3, momentum=0.5,
                                                                  centered=True), "RMSprop"),
    "legacy_adagrad": (lambda: tf_keras.optimizers.legacy.Adagrad(1e-2), "Adagrad"),
    # The legacy optimizers clip the sums (tf_keras' loss-scale optimizer
    # sums the gradients before its inner optimizer clips them).
    "legacy_adam_global_clipnorm": (lambda: tf_keras.optimizers.legacy.Adam(
        1e-2, global_clipnorm=2.0), "Adam"),
    "legacy_sgd_clipnorm": (lambda: tf_keras.optimizers.legacy.SGD(
        1e-2, momentum=0.9, clipnorm=1.0), "SGD"),
    "legacy_rmsprop_clipvalue": (lambda: tf_keras.optimizers.legacy.RMSprop(
        1e-3, clipvalue=0.5), "RMSprop"),
    # So do the current ones (RMSprop's with a one-element variable, the
    # bias here, stays stock in a graph: tf_keras_clip_cases).
    "adamw_clipvalue": (lambda: tf_keras.optimizers.AdamW(1e-3, weight_decay=0.004,
                                                          clipvalue=0.5), "AdamW"),
    "sgd_global_clipnorm": (lambda: tf_keras.optimizers.SGD(1e-2, global_clipnorm=2.0),
                            "SGD"),
}
# The one many-step run of each of fit and the custom loop.
LONG = {"fit": "legacy_adam", "loop": "adamw"}

# step % 8 -> (which replica, the value its loss is multiplied by): with a
# growth period of 2 the scale halves, grows and halves again in 8 steps.
SPOILED = {1: ("all", np.inf), 4: (1, np.nan), 7: (0, -np.inf)}


@pytest.fixture(autouse=True)
def _reset():
    yield
    tf_keras.mixed_precision.set_global_policy("float32")


def spoil(step):
    return SPOILED.get(step % 8)


def factor(step, replica, one_sided):
    """What replica ``replica``'s loss is multiplied by at ``step``."""
    return replica_factor(spoil(step), replica, one_sided)


def batch(step, replica, n=PER_REPLICA):
    rng = np.random.default_rng([17, step, replica])
    x = rng.standard_normal((n, 4)).astype(np.float32)
    return x, (np.tanh(x[:, :1] - 0.5 * x[:, 3:4]) * 4).astype(np.float32)


def per_replica(fn):
    """A per-replica value: ``fn(replica)`` on each replica."""
    return STRATEGY.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(fn(ctx.replica_id_in_sync_group)))


def build_model():
    tf_keras.utils.set_random_seed(5)
    model = tf_keras.Sequential([
        tf_keras.layers.Dense(37, activation="relu", dtype="mixed_float16"),
        tf_keras.layers.Dense(1, dtype="float32")])
    model.build((None, 4))
    return model


def copies(variable):
    """The bytes of every copy of ``variable``."""
    return [np.asarray(c.numpy()).tobytes() for c in getattr(variable, "values", [variable])]


def inner_variables(opt):
    variables = opt.inner_optimizer.variables
    return list(variables() if callable(variables) else variables)


def state(model, opt):
    """Every copy of the model's weights and the inner optimizer's variables
    (slots, the recorded learning rate), then of ``iterations``, the loss
    scale and its counter: all but the last three are what a skipped step
    leaves."""
    loss_scale = opt._loss_scale  # pylint: disable=protected-access
    others = [v for v in inner_variables(opt) if v is not opt.iterations]
    return [copies(v) for v in model.weights + others
            + [opt.iterations, loss_scale.current_loss_scale, loss_scale.counter]]


def make(kind, name):
    with STRATEGY.scope():
        model = build_model()
        cls = STOCK if name == "stock" else lossscale.LossScaleOptimizer
        opt = cls(INNER[kind][0](), initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH)
    return model, opt


def check_runs(runs, before_one, steps):
    """The three runs' states after each step (``runs[name][step]``) and
    ``one``'s before each step: the same bits everywhere, copies agreeing,
    spoiled steps leaving ``one`` as it was, the scale moving both ways."""
    for step in range(steps):
        for name in ("ours", "one"):
            assert len(runs[name][step]) == len(runs["stock"][step])
            for i, (got, want) in enumerate(zip(runs[name][step], runs["stock"][step])):
                assert got == want, f"{name}, step {step}: state {i} differs from stock"
        for name, states in runs.items():
            bad = [i for i, c in enumerate(states[step]) if len(set(c)) != 1]
            assert not bad, f"{name}, step {step}: the copies of states {bad} disagree"
        n = 4  # the model's weights
        moved = runs["one"][step][:n] != before_one[step][:n]
        assert moved == (spoil(step) is None), (
            f"step {step} {'moved' if moved else 'left'} the weights of the one-sided run")
        if spoil(step) is not None:
            assert runs["one"][step][:-3] == before_one[step][:-3], (
                f"step {step}: the skipped step moved a slot")
    scales = [np.frombuffer(s[-2][0], np.float32)[0] for s in runs["stock"]]
    assert any(b < a for a, b in zip(scales, scales[1:])), "the run never backed off"
    assert any(b > a for a, b in zip(scales, scales[1:])), "the run never grew"


# ------------------------------------------------------------------ fit

def spoiled_data(steps, one_sided):
    """``fit``'s data, global batches of 8 (the first 4 rows replica 0's):
    a non-finite input in the spoiled replicas' halves."""
    parts = [np.concatenate(p) for p in zip(*[batch(s, r) for s in range(steps)
                                              for r in range(REPLICAS)])]
    x, y = parts
    for step in range(steps):
        for replica in range(REPLICAS):
            value = factor(step, replica, one_sided)
            if value != 1:
                x[(step * REPLICAS + replica) * PER_REPLICA + 1, 2] = value
    return x, y


@pytest.mark.parametrize("kind", sorted(INNER))
def test_mirrored_fit_bit_identical(kind):
    steps = LONG_STEPS if kind == LONG["fit"] else STEPS
    runs, before_one = {}, []
    for name in ("stock", "ours", "one"):
        model, opt = make(kind, name)
        with STRATEGY.scope():
            model.compile(opt, "mse")
        if name == "one":
            before_one.append(state(model, opt))
        recorder = batch_recorder(tf_keras.callbacks, state)
        x, y = spoiled_data(steps, one_sided=name == "one")
        model.fit(x, y, batch_size=REPLICAS * PER_REPLICA, shuffle=False, verbose=0,
                  callbacks=[recorder])
        runs[name] = recorder.states
        if name != "stock":
            assert opt.step_path == f"fused ({INNER[kind][1]})", opt.step_path
    assert [len(r) for r in runs.values()] == [steps] * 3
    before_one.extend(runs["one"][:-1])
    check_runs(runs, before_one, steps)
    assert int(opt.iterations.numpy()) == steps


# ---------------------------------------------------------- custom loops

def replica_step(model, opt, mode):
    """One replica's step: ``"scaled"``, TensorFlow 2.4's loop (the scaled
    loss, the unscaled gradients, ``apply_gradients``); ``"plain"``,
    ``apply_gradients`` of the loss's own gradients; ``"summed"``, the
    scaled loop with the gradients summed over the replicas by the step
    itself and applied without the optimizer's own sum."""
    def replica(x, y, f):
        with tf.GradientTape() as tape:
            pred = tf.cast(model(x), tf.float32)
            loss = tf.reduce_mean(tf.square(pred - y)) * f / REPLICAS
            if mode != "plain":
                loss = opt.get_scaled_loss(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        if mode != "plain":
            grads = opt.get_unscaled_gradients(grads)
        pairs = zip(grads, model.trainable_variables)
        if mode == "summed":
            grads = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, grads)
            pairs = zip(grads, model.trainable_variables)
            if isinstance(opt.inner_optimizer, tf_keras.optimizers.legacy.Optimizer):
                opt.apply_gradients(pairs, experimental_aggregate_gradients=False)
            else:
                opt.apply_gradients(pairs, skip_gradients_aggregation=True)
        else:
            opt.apply_gradients(pairs)
    return replica


def custom_loop(kind, mode="scaled", eager=False, steps=STEPS):
    runs, before_one = {}, []
    for name in ("stock", "ours", "one"):
        model, opt = make(kind, name)
        replica = replica_step(model, opt, mode)

        def step(x, y, f, replica=replica):
            STRATEGY.run(replica, args=(x, y, f))

        if not eager:
            step = tf.function(step)
        runs[name] = []
        for s in range(steps):
            if name == "one":
                before_one.append(state(model, opt))
            step(per_replica(lambda r, s=s: batch(s, r)[0]),
                 per_replica(lambda r, s=s: batch(s, r)[1]),
                 per_replica(lambda r, s=s, name=name: factor(s, r, name == "one")))
            runs[name].append(state(model, opt))
        if name != "stock":
            assert opt.step_path == f"fused ({INNER[kind][1]})", opt.step_path
    check_runs(runs, before_one, steps)
    assert int(opt.iterations.numpy()) == steps


@pytest.mark.parametrize("kind", sorted(INNER))
def test_mirrored_custom_loop_bit_identical(kind):
    custom_loop(kind, steps=LONG_STEPS if kind == LONG["loop"] else STEPS)


@pytest.mark.parametrize("kind, mode, eager", [
    ("adam", "scaled", True), ("legacy_sgd_momentum", "scaled", True),
    ("rmsprop", "plain", False), ("legacy_adagrad", "plain", False),
    ("sgd_momentum", "summed", False), ("legacy_adam", "summed", False)])
def test_mirrored_custom_loop_variants_bit_identical(kind, mode, eager):
    # Eagerly, apply_gradients of the loss's own gradients (tf_keras warns
    # that the loss was not scaled), and gradients the loop sums itself.
    custom_loop(kind, mode, eager)


@pytest.mark.parametrize("kind", ["adam", "legacy_adam"])
def test_mirrored_unsummed_overflow_on_one_replica_skips_every_copy(kind):
    # apply_gradients told not to sum, of gradients nobody summed: each
    # replica applies its own, and an overflow on one replica skips the
    # step on all of them (tf_keras' own trusts the first replica's flag).
    model, opt = make(kind, "ours")

    def unsummed(x, y, f):
        with tf.GradientTape() as tape:
            loss = opt.get_scaled_loss(tf.reduce_mean(tf.square(
                tf.cast(model(x), tf.float32) - y)) * f)
        grads = opt.get_unscaled_gradients(tape.gradient(loss, model.trainable_variables))
        pairs = zip(grads, model.trainable_variables)
        if isinstance(opt.inner_optimizer, tf_keras.optimizers.legacy.Optimizer):
            opt.apply_gradients(pairs, experimental_aggregate_gradients=False)
        else:
            opt.apply_gradients(pairs, skip_gradients_aggregation=True)

    step = tf.function(lambda x, y, f: STRATEGY.run(unsummed, args=(x, y, f)))
    for s, (who, spoiled) in enumerate([(None, 1.0), (1, np.nan), (0, np.inf), (None, 1.0)]):
        before = state(model, opt)
        step(per_replica(lambda r, s=s: batch(s, r)[0]),
             per_replica(lambda r, s=s: batch(s, r)[1]),
             per_replica(lambda r, who=who, v=spoiled: np.float32(v if r == who else 1.0)))
        after = state(model, opt)
        weights = after[:4]
        if who is None:
            # Each replica's own gradients: the copies part.
            assert any(len(set(c)) == 2 for c in weights), f"step {s}: the copies agree"
        else:
            assert after[:-3] == before[:-3], f"step {s}: the one-sided overflow moved a copy"
            scale = np.frombuffer(after[-2][0], np.float32)[0]
            assert scale == np.frombuffer(before[-2][0], np.float32)[0] / 2
        # The loss scale and its counter: one flag for every replica.
        assert all(len(set(c)) == 1 for c in after[-2:]), f"step {s}: the scales part"
    assert opt.step_path == f"fused ({INNER[kind][1]})", opt.step_path
    assert int(opt.iterations.numpy()) == 4


@pytest.mark.parametrize("kind", ["adam", "legacy_adam"])
def test_mirrored_mismatched_variables_raise_before_anything_moves(kind):
    # Replica 1 applies its variables in another order: a ValueError that
    # names them, and every copy of every variable as it was.
    model, opt = make(kind, "ours")

    @tf.function
    def step(x, y):
        def replica(x, y):
            variables = list(model.trainable_variables)
            with tf.GradientTape() as tape:
                loss = opt.get_scaled_loss(tf.reduce_mean(tf.square(
                    tf.cast(model(x), tf.float32) - y)))
            grads = opt.get_unscaled_gradients(tape.gradient(loss, variables))
            r = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
            pairs = list(zip(grads, variables))
            if r == 1:
                pairs = pairs[2:] + pairs[:2]
            opt.apply_gradients(pairs)
        STRATEGY.run(replica, args=(x, y))

    if not isinstance(opt.inner_optimizer, tf_keras.optimizers.legacy.Optimizer):
        # Its slots, which a first apply_gradients makes before anything else.
        with STRATEGY.scope():
            opt.build(model.trainable_variables)
    before = state(model, opt)
    with pytest.raises(ValueError, match="The replicas' steps differ: replica 1 applies"):
        step(per_replica(lambda r: batch(0, r)[0]), per_replica(lambda r: batch(0, r)[1]))
    assert state(model, opt) == before
