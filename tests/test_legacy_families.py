"""The core's ``legacy_*`` families against TensorFlow's own training ops,
and the ``rmsprop`` family's forms against tf_keras' current RMSprop.

Oracle: TensorFlow's ``ResourceApplyGradientDescent``,
``ResourceApplyKerasMomentum``, ``ResourceApplyAdam``,
``ResourceApplyAdamWithAmsgrad``, ``ResourceApplyRMSProp``,
``ResourceApplyCenteredRMSProp`` and ``ResourceApplyAdagradV2`` (the
kernels tf_keras' legacy optimizers run), and for RMSprop without momentum
tf_keras' own float32 ops, run eagerly on the CPU.  Random data over
lengths around every vector width and TensorFlow's packets, with zeros,
signed zeros, subnormals and huge values; several steps carrying the slots;
the core with subnormals flushed, as TensorFlow's CPU kernels compute.  The
scalars the core takes are computed with TensorFlow's ops as
``lossscale._fused`` computes them (Adam's alpha from the step's beta
powers), so the test also holds them to what the kernels derive inside.

tf_keras' ``RMSprop.update_step`` runs eagerly and in a tf.function, where
TensorFlow's graph optimizer regroups its ``lr * g * rsqrt(d)`` and pushes
epsilon down the centered sum: the test names the form each of its runs
takes, by the rules the graph optimizer follows, and holds the kernel of
that form to tf_keras' numbers.
"""

import numpy as np
import pytest
import tensorflow as tf

from lossscale import core

F32 = np.float32
SHAPES = [(1,), (3,), (7,), (8,), (9,), (16,), (17,), (33,), (1000,), (1003,), (13, 7)]
STEPS = 3


def _random(rng, shape, scale=1.0, nonneg=False):
    a = (rng.standard_normal(shape) * scale).astype(F32)
    flat = a.reshape(-1)
    k = max(1, flat.size // 8)
    flat[rng.integers(0, flat.size, k)] = 0.0
    flat[rng.integers(0, flat.size, k)] = -0.0
    flat[rng.integers(0, flat.size, k)] = (rng.standard_normal(k) * 1e-39).astype(F32)
    flat[rng.integers(0, flat.size, k)] = (rng.standard_normal(k) * 1e30).astype(F32)
    return np.abs(a) if nonneg else a


def _bits(a):
    return np.ascontiguousarray(a, dtype=F32).view(np.uint32)


def _same_or_both_nan(got, want, what):
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    both_nan = np.isnan(got) & np.isnan(want)
    differ = (_bits(got) != _bits(want)) & ~both_nan
    if differ.any():
        i = int(np.flatnonzero(differ.reshape(-1))[0])
        raise AssertionError(f"{what}: element {i}: got {got.reshape(-1)[i]!r}, "
                             f"want {want.reshape(-1)[i]!r}")


def _tf_step(kind, cfg, var, slots, grad, lr, t):
    """TensorFlow's own step on tf.Variables, as tf_keras' legacy optimizer
    calls it; returns the numbers the core takes (``hyper``)."""
    f = lambda x: tf.constant(F32(x))  # noqa: E731
    lr_t = f(lr)
    g = tf.constant(grad)
    if kind == "sgd":
        if cfg["momentum"]:
            tf.raw_ops.ResourceApplyKerasMomentum(
                var=var.handle, accum=slots[0].handle, lr=lr_t, grad=g,
                momentum=f(cfg["momentum"]), use_nesterov=cfg["nesterov"])
        else:
            tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=lr_t, delta=g)
        return [1.0 if cfg["momentum"] else 0.0, 1.0 if cfg["nesterov"] else 0.0,
                cfg["momentum"]]
    if kind == "adam":
        beta_1, beta_2 = f(cfg["beta_1"]), f(cfg["beta_2"])
        local_step = tf.cast(tf.constant(t, tf.int64), tf.float32)
        b1p, b2p = tf.pow(beta_1, local_step), tf.pow(beta_2, local_step)
        args = dict(var=var.handle, m=slots[0].handle, v=slots[1].handle, beta1_power=b1p,
                    beta2_power=b2p, lr=lr_t, beta1=beta_1, beta2=beta_2,
                    epsilon=f(cfg["epsilon"]), grad=g)
        if cfg["amsgrad"]:
            tf.raw_ops.ResourceApplyAdamWithAmsgrad(vhat=slots[2].handle, **args)
        else:
            tf.raw_ops.ResourceApplyAdam(**args)
        alpha = lr_t * tf.sqrt(1 - b2p) / (1 - b1p)
        # A dense gradient: the scalar-first grouping (sparse only) is 0.
        return [1.0 if cfg["amsgrad"] else 0.0, 0.0, float(1 - beta_1), float(1 - beta_2),
                cfg["epsilon"], float(alpha)]
    if kind == "rmsprop":
        rho, eps, mu = f(cfg["rho"]), f(cfg["epsilon"]), f(cfg["momentum"])
        if cfg["momentum"]:
            if cfg["centered"]:
                tf.raw_ops.ResourceApplyCenteredRMSProp(
                    var=var.handle, mg=slots[2].handle, ms=slots[0].handle,
                    mom=slots[1].handle, lr=lr_t, rho=rho, momentum=mu, epsilon=eps, grad=g)
            else:
                tf.raw_ops.ResourceApplyRMSProp(
                    var=var.handle, ms=slots[0].handle, mom=slots[1].handle, lr=lr_t, rho=rho,
                    momentum=mu, epsilon=eps, grad=g)
        else:
            # tf_keras' legacy RMSprop._resource_apply_dense without momentum.
            rms = slots[0].assign(rho * slots[0] + (1.0 - rho) * tf.square(g))
            denom = rms
            if cfg["centered"]:
                mg = slots[1].assign(rho * slots[1] + (1.0 - rho) * g)
                denom = rms - tf.square(mg)
            var.assign(var - lr_t * g / (tf.sqrt(denom) + eps))
        return [1.0 if cfg["momentum"] else 0.0, 1.0 if cfg["centered"] else 0.0, 0.0,
                float(rho), float(1.0 - rho), cfg["momentum"], cfg["epsilon"]]
    tf.raw_ops.ResourceApplyAdagradV2(var=var.handle, accum=slots[0].handle, lr=lr_t,
                                      epsilon=f(cfg["epsilon"]), grad=g)
    return [cfg["epsilon"]]


CASES = {
    "sgd": dict(momentum=0.0, nesterov=False),
    "sgd_momentum": dict(momentum=0.9, nesterov=False),
    "sgd_nesterov": dict(momentum=0.7, nesterov=True),
    "adam": dict(beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False),
    "adam_amsgrad": dict(beta_1=0.8, beta_2=0.99, epsilon=1e-3, amsgrad=True),
    "rmsprop": dict(rho=0.9, momentum=0.0, epsilon=1e-7, centered=False),
    "rmsprop_centered": dict(rho=0.9, momentum=0.0, epsilon=1e-7, centered=True),
    "rmsprop_momentum": dict(rho=0.8, momentum=0.5, epsilon=1e-3, centered=False),
    "rmsprop_centered_momentum": dict(rho=0.95, momentum=0.9, epsilon=1e-6, centered=True),
    "adagrad": dict(epsilon=1e-7),
}


def _slot_count(kind, cfg):
    if kind == "sgd":
        return 1 if cfg["momentum"] else 0
    if kind == "adam":
        return 3 if cfg["amsgrad"] else 2
    if kind == "rmsprop":
        return 1 + bool(cfg["momentum"]) + bool(cfg["centered"])
    return 1


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_tensorflows_training_op(case, shape):
    kind = case.split("_")[0]
    cfg = CASES[case]
    rng = np.random.default_rng(abs(hash((case, shape))) % 2**32)
    n_slots = _slot_count(kind, cfg)
    # Adam's v and vhat, RMSprop's ms and Adagrad's accumulator are >= 0
    # in training; the others any sign.
    nonneg = {"adam": (1, 2), "rmsprop": (0,), "adagrad": (0,)}.get(kind, ())
    var = _random(rng, shape)
    slots = [_random(rng, shape, 1e-2, nonneg=k in nonneg) for k in range(n_slots)]
    if kind == "adam" and cfg["amsgrad"]:
        # Ties with v, and signed zeros, decide which operand the max keeps.
        slots[2] = np.where(rng.random(shape) < 0.5, slots[1],
                            np.where(slots[1] == 0, -slots[1], slots[2])).astype(F32)
    with tf.device("CPU:0"):
        tf_var = tf.Variable(var)
        tf_slots = [tf.Variable(s) for s in slots]
        for t in range(1, STEPS + 1):
            grad = _random(rng, shape, 0.1)
            lr = [0.01, 0.003, 2.5][t - 1]
            hyper = _tf_step(kind, cfg, tf_var, tf_slots, grad, lr, t)
            assert core.optimizer_step_(f"legacy_{kind}", [var], [grad], [[s] for s in slots],
                                        hyper=hyper, learning_rate=lr,
                                        flush_denormals=True) is True
            _same_or_both_nan(var, tf_var.numpy(), f"step {t}: the variable")
            for k, (s, want) in enumerate(zip(slots, tf_slots)):
                _same_or_both_nan(s, want.numpy(), f"step {t}: slot {k}")


# ------------------------------------------- tf_keras' current RMSprop

TF_KERAS_RMSPROP = {
    "plain": dict(rho=0.9, momentum=0.0, epsilon=1e-7, centered=False),
    "momentum": dict(rho=0.8, momentum=0.5, epsilon=1e-3, centered=False),
    "centered_momentum": dict(rho=0.95, momentum=0.9, epsilon=1e-6, centered=True),
}
RMSPROP_SHAPES = [(), (1,), (1, 1), (7,), (9,), (1003,), (13, 7)]
RMSPROP_STEPS = 8
# family_rmsprop.h's forms: (lr * g) * rsqrt(d), g * (lr * rsqrt(d)),
# lr * (g * rsqrt(d)).
LR_G, LR_RSQRT, G_RSQRT = 1.0, 2.0, 3.0


def _rmsprop_form(shape, where):
    """The order of tf_keras' lr * g * rsqrt(d) in a run ``where``: eagerly
    as written; in a tf.function, the graph optimizer's MinimizeBroadcasts
    sorts the chain's factors by size (stably) and multiplies the first
    two first.  A rank-0 chain has nothing to broadcast and is left alone;
    a larger one takes lr, the scalar, with rsqrt(d); a one-element one's
    factors tie, and keep the canonical order of a product's inputs, by
    name: rsqrt(d) ("RMSprop/Rsqrt"), then lr ("<scope>/RMSprop/ReadVariableOp")
    or the gradient (the argument "g"), whichever sorts first."""
    if where == "eager" or len(shape) == 0:
        return LR_G
    if int(np.prod(shape)) > 1:
        return LR_RSQRT
    return LR_RSQRT if where == "function" else G_RSQRT


@pytest.mark.parametrize("where", ["eager", "function", "function_z"])
@pytest.mark.parametrize("shape", RMSPROP_SHAPES, ids=lambda s: "x".join(map(str, s)) or "0")
@pytest.mark.parametrize("case", sorted(TF_KERAS_RMSPROP))
def test_rmsprop_forms_match_tf_keras_rmsprop(case, shape, where):
    """``function``: a tf.function that returns the variable (the graph
    optimizer, knowing the outputs, pushes epsilon down the centered sum);
    ``function_z``: one that returns nothing, its step under the name scope
    "z" (lr's name then sorts after the gradient's)."""
    tf_keras = pytest.importorskip("tf_keras")
    from lossscale import _compat  # pylint: disable=import-outside-toplevel

    cfg = TF_KERAS_RMSPROP[case]
    rng = np.random.default_rng(abs(hash((case, shape, where))) % 2**32)
    kinds = (["velocity"] + (["momentum"] if cfg["momentum"] else [])
             + (["average_gradient"] if cfg["centered"] else []))
    # The core's arrays flat (its kernel sees the elements alone); tf_keras'
    # in the shape.  One element takes ordinary values (the special ones
    # would each replace the last).
    flat = (int(np.prod(shape)),)

    def values(scale=1.0, nonneg=False):
        if flat[0] > 1:
            return _random(rng, flat, scale, nonneg)
        a = (rng.standard_normal(flat) * scale).astype(F32)
        return np.abs(a) if nonneg else a

    var = values()
    slots = [values(1e-2, nonneg=kind == "velocity") for kind in kinds]
    push_down = cfg["centered"] and where == "function"
    hyper = [cfg["rho"], 1 - cfg["rho"], cfg["epsilon"], cfg["momentum"],
             1.0 if cfg["momentum"] else 0.0, 1.0 if cfg["centered"] else 0.0,
             _rmsprop_form(shape, where), 1.0 if push_down else 0.0]
    with tf.device("CPU:0"):
        tf_var = tf.Variable(var.reshape(shape))
        opt = tf_keras.optimizers.RMSprop(0.01, rho=cfg["rho"], momentum=cfg["momentum"],
                                          epsilon=cfg["epsilon"], centered=cfg["centered"])
        opt.build([tf_var])
        tf_slots = [_compat.tf_keras_optimizer_slots(opt, kind, [tf_var])[0] for kind in kinds]
        for tf_slot, s in zip(tf_slots, slots):
            tf_slot.assign(s.reshape(shape))

        def step(g):
            opt.apply_gradients([(g, tf_var)])
            return tf_var.read_value()

        def step_z(g):
            with tf.name_scope("z"):
                opt.apply_gradients([(g, tf_var)])

        run = {"eager": step, "function": tf.function(step),
               "function_z": tf.function(step_z)}[where]
        for t in range(1, RMSPROP_STEPS + 1):
            grad = values(0.1)
            lr = [0.01, 0.003, 2.5][t % 3]
            opt.learning_rate = lr
            run(tf.constant(grad.reshape(shape)))
            assert core.optimizer_step_("rmsprop", [var], [grad], [[s] for s in slots],
                                        hyper=hyper, learning_rate=lr,
                                        flush_denormals=True) is True
            _same_or_both_nan(var, tf_var.numpy().reshape(flat), f"step {t}: the variable")
            for kind, s, want in zip(kinds, slots, tf_slots):
                _same_or_both_nan(s, want.numpy().reshape(flat), f"step {t}: {kind}")
