"""An independent numpy float32 model of the Keras 3 optimizers' steps that
the fused families reproduce (SGD, Adam / AdamW, ...; ``FAMILIES``).

The oracle of the fused optimizer step at every layer that runs it.  Written
from Keras' own source (``BaseOptimizer._clip_gradients`` with the
clip numbers given, ``_apply_weight_decay``, then each optimizer's
``update_step``; on an update step of ``gradient_accumulation_steps``,
``_backend_apply_gradients``' average of each gradient with its
accumulator first, ``accumulated``): every elementwise op is one numpy
float32 op, in Keras' order, so each result is rounded on its own as
TensorFlow's op-by-op float32 arithmetic rounds it.  numpy keeps subnormals, so this is
the IEEE (``flush_denormals=False``) model.  Also here: the cases the tests
share with their subprocesses, one call of the core for a case, and the
step on a sparse gradient (its slices densified as TensorFlow densifies an
IndexedSlices, then this model).
"""

import ml_dtypes
import numpy as np

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
GRAD_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
               "bfloat16": BF16}

# Optimizer configurations: Keras' defaults where the test does not care.
CONFIGS = {
    "sgd": dict(opt="sgd", lr=0.01, momentum=0.0, nesterov=False),
    "sgd_momentum": dict(opt="sgd", lr=0.01, momentum=0.9, nesterov=False),
    "sgd_nesterov": dict(opt="sgd", lr=0.01, momentum=0.9, nesterov=True),
    "sgd_momentum_decay": dict(opt="sgd", lr=0.05, momentum=0.5, nesterov=False,
                               weight_decay=0.01, mask=True),
    "adam": dict(opt="adam", lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 amsgrad=False),
    "adam_amsgrad": dict(opt="adam", lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                         amsgrad=True),
    "adamw": dict(opt="adam", lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                  amsgrad=False, weight_decay=0.004, mask=True),
    "adamw_amsgrad_odd": dict(opt="adam", lr=0.003, beta_1=0.8, beta_2=0.99, epsilon=1e-3,
                              amsgrad=True, weight_decay=0.1, mask=True),
    # graph: the step as a tf.function runs it, rewritten by Grappler (its
    # arithmetic optimizer divides by Rsqrt, its constant folding pushes
    # epsilon down the centered sum); rsqrt_only: the first alone; order:
    # tf_keras' lr * g * rsqrt(d) as the arithmetic optimizer regroups it,
    # g * (lr * rsqrt(d)) ("lr_rsqrt") or lr * (g * rsqrt(d)) ("g_rsqrt").
    "rmsprop": dict(opt="rmsprop", lr=0.001, rho=0.9, momentum=0.0, epsilon=1e-7,
                    centered=False, graph=False),
    "rmsprop_momentum": dict(opt="rmsprop", lr=0.001, rho=0.9, momentum=0.9, epsilon=1e-7,
                             centered=False, graph=False),
    "rmsprop_centered_momentum_decay": dict(opt="rmsprop", lr=0.003, rho=0.8, momentum=0.5,
                                            epsilon=1e-3, centered=True, graph=False,
                                            weight_decay=0.01, mask=True),
    "rmsprop_centered_graph": dict(opt="rmsprop", lr=0.001, rho=0.9, momentum=0.0,
                                   epsilon=1e-7, centered=True, graph=True),
    "rmsprop_momentum_decay_graph": dict(opt="rmsprop", lr=0.003, rho=0.95, momentum=0.9,
                                         epsilon=1e-6, centered=False, graph=True,
                                         weight_decay=0.004, mask=True),
    "rmsprop_centered_rsqrt_only": dict(opt="rmsprop", lr=0.001, rho=0.9, momentum=0.5,
                                        epsilon=1e-3, centered=True, graph=True,
                                        rsqrt_only=True),
    "rmsprop_lr_rsqrt_graph": dict(opt="rmsprop", lr=0.003, rho=0.9, momentum=0.0,
                                   epsilon=1e-7, centered=False, graph=True, rsqrt_only=True,
                                   order="lr_rsqrt"),
    "rmsprop_centered_momentum_g_rsqrt_graph": dict(opt="rmsprop", lr=0.001, rho=0.95,
                                                    momentum=0.9, epsilon=1e-6, centered=True,
                                                    graph=True, order="g_rsqrt",
                                                    weight_decay=0.004, mask=True),
    "adagrad": dict(opt="adagrad", lr=0.001, initial_accumulator_value=0.1, epsilon=1e-7,
                    graph=False),
    "adagrad_decay_odd": dict(opt="adagrad", lr=0.05, initial_accumulator_value=0.37,
                              epsilon=1e-4, graph=False, weight_decay=0.02, mask=True),
    "adagrad_graph": dict(opt="adagrad", lr=0.01, initial_accumulator_value=0.1, epsilon=1e-7,
                          graph=True),
    "adagrad_decay_graph": dict(opt="adagrad", lr=0.05, initial_accumulator_value=0.0,
                                epsilon=1e-5, graph=True, weight_decay=0.02, mask=True),
    "adamax": dict(opt="adamax", lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7),
    "adamax_decay_odd": dict(opt="adamax", lr=0.01, beta_1=0.8, beta_2=0.95, epsilon=1e-3,
                             weight_decay=0.05, mask=True),
    "nadam": dict(opt="nadam", lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7),
    "nadam_decay_odd": dict(opt="nadam", lr=0.004, beta_1=0.85, beta_2=0.99, epsilon=1e-4,
                            weight_decay=0.02, mask=True),
    "lion": dict(opt="lion", lr=0.001, beta_1=0.9, beta_2=0.99),
    # tf_keras' legacy optimizers: TensorFlow's ResourceApply* kernels.
    "legacy_sgd": dict(opt="legacy_sgd", lr=0.01, momentum=0.0, nesterov=False),
    "legacy_sgd_momentum": dict(opt="legacy_sgd", lr=0.01, momentum=0.9, nesterov=False),
    "legacy_sgd_nesterov": dict(opt="legacy_sgd", lr=0.03, momentum=0.7, nesterov=True),
    "legacy_adam": dict(opt="legacy_adam", lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                        amsgrad=False),
    "legacy_adam_amsgrad_odd": dict(opt="legacy_adam", lr=0.003, beta_1=0.8, beta_2=0.99,
                                    epsilon=1e-3, amsgrad=True),
    "legacy_rmsprop": dict(opt="legacy_rmsprop", lr=0.001, rho=0.9, momentum=0.0, epsilon=1e-7,
                           centered=False),
    "legacy_rmsprop_centered": dict(opt="legacy_rmsprop", lr=0.001, rho=0.9, momentum=0.0,
                                    epsilon=1e-7, centered=True),
    "legacy_rmsprop_momentum": dict(opt="legacy_rmsprop", lr=0.003, rho=0.8, momentum=0.5,
                                    epsilon=1e-3, centered=False),
    "legacy_rmsprop_centered_momentum": dict(opt="legacy_rmsprop", lr=0.001, rho=0.95,
                                             momentum=0.9, epsilon=1e-6, centered=True),
    "legacy_adagrad": dict(opt="legacy_adagrad", lr=0.01, initial_accumulator_value=0.1,
                           epsilon=1e-7),
    "lion_decay_odd": dict(opt="lion", lr=0.003, beta_1=0.7, beta_2=0.95, weight_decay=0.1,
                           mask=True),
    # tf_keras' current Adam / AdamW: Keras 3's dense update, a sparse
    # gradient its own (legacy_rows_step).
    "tf_keras_adam": dict(opt="tf_keras_adam", lr=0.001, beta_1=0.9, beta_2=0.999,
                          epsilon=1e-7, amsgrad=False),
    "tf_keras_adamw_amsgrad_odd": dict(opt="tf_keras_adam", lr=0.003, beta_1=0.8, beta_2=0.99,
                                       epsilon=1e-3, amsgrad=True, weight_decay=0.1,
                                       mask=True),
    # tf_keras' current SGD: ApplyKerasMomentum's dense update (the slot
    # kept at momentum 0 too), a sparse gradient its own (legacy_rows_step).
    "tf_keras_sgd_nesterov": dict(opt="tf_keras_sgd", lr=0.03, momentum=0.7, nesterov=True),
    "tf_keras_sgd_nesterov_decay_odd": dict(opt="tf_keras_sgd", lr=0.01, momentum=0.9,
                                            nesterov=True, weight_decay=0.1, mask=True),
    "tf_keras_sgd_no_momentum": dict(opt="tf_keras_sgd", lr=0.01, momentum=0.0, nesterov=True),
    # tf_keras' current RMSprop: Keras 3's dense update with TensorFlow's
    # Rsqrt, (lr * g) * rsqrt(d) eagerly (rsqrt_only), g * (lr * rsqrt(d))
    # in a graph; a sparse gradient its own (legacy_rows_step).
    "tf_keras_rmsprop": dict(opt="tf_keras_rmsprop", lr=0.001, rho=0.9, momentum=0.0,
                             epsilon=1e-7, centered=False, graph=True, rsqrt_only=True),
    "tf_keras_rmsprop_centered_momentum": dict(opt="tf_keras_rmsprop", lr=0.003, rho=0.8,
                                               momentum=0.5, epsilon=1e-3, centered=True,
                                               graph=True, rsqrt_only=True),
    "tf_keras_rmsprop_momentum_decay_graph": dict(opt="tf_keras_rmsprop", lr=0.003, rho=0.95,
                                                  momentum=0.9, epsilon=1e-7, centered=False,
                                                  graph=True, order="lr_rsqrt",
                                                  weight_decay=0.004, mask=True),
    "tf_keras_rmsprop_centered_graph": dict(opt="tf_keras_rmsprop", lr=0.001, rho=0.9,
                                            momentum=0.0, epsilon=1e-6, centered=True,
                                            graph=True, order="lr_rsqrt"),
    # Keras' clipping (``clip``: the core's mode and value; ``clip_scalars``
    # gives each variable's divisor or the one factor).
    "sgd_momentum_clipvalue": dict(opt="sgd", lr=0.01, momentum=0.9, nesterov=False,
                                   clip=("value", 0.03)),
    "adam_clipnorm": dict(opt="adam", lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                          amsgrad=False, clip=("norm", 0.7)),
    "adamw_amsgrad_clipglobal": dict(opt="adam", lr=0.003, beta_1=0.8, beta_2=0.99,
                                     epsilon=1e-3, amsgrad=True, weight_decay=0.1, mask=True,
                                     clip=("global", None)),
    "rmsprop_centered_clipnorm_graph": dict(opt="rmsprop", lr=0.001, rho=0.9, momentum=0.5,
                                            epsilon=1e-7, centered=True, graph=True,
                                            clip=("norm", 3.3)),
    "adagrad_clipvalue": dict(opt="adagrad", lr=0.001, initial_accumulator_value=0.1,
                              epsilon=1e-7, graph=False, clip=("value", 1e-3)),
    "adamax_clipglobal_tiny": dict(opt="adamax", lr=0.001, beta_1=0.9, beta_2=0.999,
                                   epsilon=1e-7, clip=("global", 1e-39)),
    "nadam_clipnorm": dict(opt="nadam", lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                           clip=("norm", 0.05)),
    "lion_clipvalue": dict(opt="lion", lr=0.001, beta_1=0.9, beta_2=0.99, clip=("value", 2.5)),
    # Keras' accumulating step: the variable is the accumulator (its
    # learning rate is never read).
    "accumulate": dict(opt="accumulate", lr=0.0),
}


def slot_names(cfg):
    """The slots a configuration keeps, in the kernel's order."""
    return FAMILIES[cfg["opt"]]["slots"](cfg)


def decay_mask(cfg, n):
    """Which variables decay: all but every third one (AdamW's exclusions)."""
    if cfg.get("weight_decay") is None:
        return None
    return [i % 3 != 1 for i in range(n)] if cfg.get("mask") else [True] * n


def adam_alpha(lr, beta_1, beta_2, t):
    """Keras' ``lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)`` in float32."""
    t = F32(t)
    b1p = np.power(F32(beta_1), t)
    b2p = np.power(F32(beta_2), t)
    return F32(F32(lr) * np.sqrt(F32(1) - b2p)) / (F32(1) - b1p)


def unscaled(grad, scale, mode):
    """The float32 gradient the optimizer sees.

    divide: Keras 3, ``float32(g) / float32(scale)``.  multiply: TensorFlow
    2.4, ``g * (1 / scale)`` with the float32 reciprocal rounded to the
    gradient's dtype and the product rounded to it."""
    if scale is None:
        return grad.astype(F32)
    if mode == "divide":
        return grad.astype(F32) / F32(scale)
    reciprocal = (F32(1) / F32(scale)).astype(grad.dtype)
    return (grad * reciprocal).astype(grad.dtype).astype(F32)


def accumulated(grad, accumulator, scale, mode, steps, average):
    """Keras' average on an update step of ``gradient_accumulation_steps``
    (``_backend_apply_gradients``: ``(g + acc_g) / steps``), op by op: the
    gradient unscaled as the optimizer sees it, plus the accumulator (the
    gradient first, as Keras writes it), rounded; then divided by
    float32(steps) as Keras runs it eagerly (``average="divide"``), or,
    ``"multiply"``, times the float32 reciprocal TensorFlow's constant
    folding makes of the divisor in a tf.function (``Reciprocal`` of the
    constant, rounded once)."""
    total = unscaled(grad, scale, mode) + accumulator
    if average == "divide":
        return total / F32(steps)
    return total * (F32(1) / F32(steps))


def clip_scalars(cfg, n):
    """Each variable's clip number for a configuration with ``clip``: for
    "norm" divisors of max(l2norm, clipnorm)'s kinds (clipnorm itself, a
    larger one, a huge one, inf: every gradient 0); for "global" the one
    factor (``clip``'s second entry, else 0.37)."""
    mode, value = cfg["clip"]
    if mode == "global":
        return [float(F32(0.37 if value is None else value))] * n
    kinds = [F32(value), F32(value) * F32(3.7), F32(1e30), F32(np.inf)]
    return [float(kinds[i % 4]) for i in range(n)]


def clipped(cfg, g, i, n):
    """Keras' clip of the unscaled gradient ``g`` of variable ``i`` of
    ``n``: clip_by_value's Minimum then Maximum, clip_by_norm's
    ``(g * c) / divisor``, clip_by_global_norm's ``g * factor``."""
    if cfg.get("clip") is None:
        return g
    mode, value = cfg["clip"]
    if mode == "value":
        return np.maximum(np.minimum(g, F32(value)), -F32(value))
    scalar = F32(clip_scalars(cfg, n)[i])
    return (g * F32(value)) / scalar if mode == "norm" else g * scalar


def keras_step(cfg, variables, grads, slots, *, lr, t, scale=None, mode="divide",
               terms=None, accumulators=None, accumulation_steps=None,
               accumulation="divide"):
    """Keras' step on copies: ``(variables, slots)`` after it.  ``slots`` is a
    dict name -> list of arrays; ``lr`` the float32 learning rate of this
    step, ``t`` Adam's ``iterations + 1``; ``terms``, per variable, what
    the family takes in place of one function of g (Adam's g * g, Adamax's
    |g|, Lion's g * (1 - beta_2): a sparse gradient's, summed per row), or
    None for a variable whose family computes its own.  ``accumulators``
    (per variable, with ``accumulation_steps``): the update step of a
    gradient accumulation, each gradient ``accumulated`` with its
    accumulator (averaged as ``accumulation`` says) before the clip and the
    update (the accumulators themselves, which Keras then zeroes, are left
    to the caller)."""
    lr = F32(lr)
    out_vars = [v.copy() for v in variables]
    out_slots = {k: [a.copy() for a in arrays] for k, arrays in slots.items()}
    mask = decay_mask(cfg, len(variables))
    with np.errstate(all="ignore"):
        if mask is not None:
            wd = F32(cfg["weight_decay"])
            for i, w in enumerate(out_vars):
                if mask[i]:
                    out_vars[i] = w - (w * wd) * lr
        for i, grad in enumerate(grads):
            g = (unscaled(grad, scale, mode) if accumulators is None
                 else accumulated(grad, accumulators[i], scale, mode, accumulation_steps,
                                  accumulation))
            g = clipped(cfg, g, i, len(grads))
            out_vars[i] = FAMILIES[cfg["opt"]]["update"](
                cfg, g, out_vars[i], {k: a[i] for k, a in out_slots.items()}, lr, t,
                lambda name, value, i=i: out_slots[name].__setitem__(i, value),
                **({} if terms is None or terms[i] is None else {"terms": terms[i]}))
    return out_vars, out_slots


# ------------------------------------------------------------------ families
# Each family: the slots a configuration keeps, its update of one variable
# (``update(cfg, g, w, slots, lr, t, store)`` -> the new variable, each
# new slot value given to ``store(name, value)``), and the numbers the
# core's kernel takes (``hyper(cfg, lr, t)``, in its family_<name>.h order).

def _sgd_slots(cfg):
    return ["momentum"] if cfg["momentum"] != 0 else []


def _sgd_update(cfg, g, w, slots, lr, t, store):
    if cfg["momentum"] == 0:
        return w - g * lr
    mu = F32(cfg["momentum"])
    m = slots["momentum"] * mu - g * lr
    store("momentum", m)
    return w + (m * mu - g * lr) if cfg["nesterov"] else w + m


def _sgd_hyper(cfg, lr, t):
    return [cfg["momentum"], 1.0 if cfg["nesterov"] else 0.0]


def _adam_slots(cfg):
    return ["m", "v", "v_hat"] if cfg["amsgrad"] else ["m", "v"]


def _adam_update(cfg, g, w, slots, lr, t, store, terms=None):
    alpha = adam_alpha(lr, cfg["beta_1"], cfg["beta_2"], t)
    m = slots["m"] + (g - slots["m"]) * F32(1 - cfg["beta_1"])
    gg = g * g if terms is None else terms
    v = slots["v"] + (gg - slots["v"]) * F32(1 - cfg["beta_2"])
    store("m", m)
    store("v", v)
    if cfg["amsgrad"]:
        v = np.maximum(slots["v_hat"], v)
        store("v_hat", v)
    return w - (m * alpha) / (np.sqrt(v) + F32(cfg["epsilon"]))


def _adam_hyper(cfg, lr, t):
    return [1 - cfg["beta_1"], 1 - cfg["beta_2"], cfg["epsilon"],
            1.0 if cfg["amsgrad"] else 0.0,
            float(adam_alpha(lr, cfg["beta_1"], cfg["beta_2"], t))]


def tf_rsqrt(d):
    """TensorFlow's own CPU Rsqrt of the whole tensor (its packets and its
    tail differ), what a tf.function's step multiplies by."""
    import tensorflow as tf

    return tf.math.rsqrt(tf.constant(d)).numpy()


def _divide_by_sqrt(cfg, x, d):
    """Keras' ``x / sqrt(d)``; ``x * rsqrt(d)`` as Grappler rewrites it."""
    return x * tf_rsqrt(d) if cfg["graph"] else x / np.sqrt(d)


def _rmsprop_slots(cfg):
    return (["velocity"] + (["momentum"] if cfg["momentum"] > 0 else [])
            + (["average_gradient"] if cfg["centered"] else []))


def _rmsprop_update(cfg, g, w, slots, lr, t, store):
    rho, c = F32(cfg["rho"]), F32(1 - cfg["rho"])
    v = rho * slots["velocity"] + c * (g * g)
    store("velocity", v)
    if cfg["centered"]:
        a = rho * slots["average_gradient"] + c * g
        store("average_gradient", a)
        # In a graph, constant folding pushes epsilon down the sum.
        d = ((F32(cfg["epsilon"]) - a * a) + v if _push_down(cfg)
             else (v - a * a) + F32(cfg["epsilon"]))
    else:
        d = v + F32(cfg["epsilon"])
    order = cfg.get("order")
    if order == "lr_rsqrt":
        step = g * (lr * tf_rsqrt(d))
    elif order == "g_rsqrt":
        step = lr * (g * tf_rsqrt(d))
    else:
        step = _divide_by_sqrt(cfg, lr * g, d)
    if cfg["momentum"] > 0:
        m = F32(cfg["momentum"]) * slots["momentum"] + step
        store("momentum", m)
        return w - m
    return w - step


def _push_down(cfg):
    return cfg["graph"] and not cfg.get("rsqrt_only")


# family_rmsprop.h's ls_rmsprop_form of each order.
RMSPROP_FORMS = {"lr_rsqrt": 2.0, "g_rsqrt": 3.0}


def _rmsprop_hyper(cfg, lr, t):
    form = RMSPROP_FORMS.get(cfg.get("order"), 1.0 if cfg["graph"] else 0.0)
    return [cfg["rho"], 1 - cfg["rho"], cfg["epsilon"], cfg["momentum"],
            1.0 if cfg["momentum"] > 0 else 0.0, 1.0 if cfg["centered"] else 0.0, form,
            1.0 if _push_down(cfg) else 0.0]


def _adagrad_update(cfg, g, w, slots, lr, t, store):
    acc = slots["accumulator"] + g * g
    store("accumulator", acc)
    return w - _divide_by_sqrt(cfg, lr * g, acc + F32(cfg["epsilon"]))


def _adagrad_hyper(cfg, lr, t):
    return [cfg["epsilon"], 1.0 if cfg["graph"] else 0.0]
def tf_maximum(a, b):
    """TensorFlow's Maximum on the CPU (its vector body): a where a is NaN,
    else (a > b) ? a : b."""
    return np.where(np.isnan(a), a, np.where(a > b, a, b))


def tf_sign(a):
    """TensorFlow's Sign on the CPU (its vector body): copysign(1, a) where
    0 < |a|, else |a| (+0 for -0, |NaN| for NaN)."""
    m = np.abs(a)
    return np.where(F32(0) < m, np.copysign(F32(1), a), m)


def _adamax_update(cfg, g, w, slots, lr, t, store, terms=None):
    m = slots["m"] + (g - slots["m"]) * F32(1 - cfg["beta_1"])
    u = tf_maximum(F32(cfg["beta_2"]) * slots["u"], np.abs(g) if terms is None else terms)
    store("m", m)
    store("u", u)
    c1_t = F32(1) - np.power(F32(cfg["beta_1"]), F32(t))
    return w - (lr * m) / (c1_t * (u + F32(cfg["epsilon"])))


def _adamax_hyper(cfg, lr, t):
    return [1 - cfg["beta_1"], cfg["beta_2"], cfg["epsilon"],
            float(F32(1) - np.power(F32(cfg["beta_1"]), F32(t)))]


def nadam_scalars(cfg, t):
    """Keras' Nadam at step ``t`` (every step before it applied), float32 op
    by op: ``_u_product`` as ``_backend_update_step`` leaves it, then
    ``update_step``'s u_t_1, 1 - u_product_t_1, 1 - u_t, 1 - u_product_t
    and 1 - beta_2^t."""
    one, half, decay = F32(1), F32(0.5), F32(0.96)
    beta_1, beta_2 = F32(cfg["beta_1"]), F32(cfg["beta_2"])
    u_product = F32(1)
    for s in range(1, t + 1):
        u_product = (u_product * beta_1) * (one - half * np.power(decay, F32(s)))
    u_t = beta_1 * (one - half * np.power(decay, F32(t)))
    u_t_1 = beta_1 * (one - half * np.power(decay, F32(t + 1)))
    return [u_t_1, one - u_product * u_t_1, one - u_t, one - u_product,
            one - np.power(beta_2, F32(t))]


def _nadam_update(cfg, g, w, slots, lr, t, store):
    u_t_1, d_t_1, c_t, d_t, c2_t = nadam_scalars(cfg, t)
    m = slots["m"] + (g - slots["m"]) * (F32(1) - F32(cfg["beta_1"]))
    v = slots["v"] + (np.square(g) - slots["v"]) * (F32(1) - F32(cfg["beta_2"]))
    store("m", m)
    store("v", v)
    m_hat = (u_t_1 * m) / d_t_1 + (c_t * g) / d_t
    v_hat = v / c2_t
    return w - (m_hat * lr) / (np.sqrt(v_hat) + F32(cfg["epsilon"]))


def _nadam_hyper(cfg, lr, t):
    return [float(F32(1) - F32(cfg["beta_1"])), float(F32(1) - F32(cfg["beta_2"])),
            cfg["epsilon"]] + [float(x) for x in nadam_scalars(cfg, t)]


def _lion_c1(cfg):
    """The number Lion's kernel multiplies g by in its sign: 1 - beta_1, or
    ``c1`` where given (1 for a sparse gradient whose slices carry 1 -
    beta_1 as their slice factor)."""
    return F32(cfg["c1"]) if "c1" in cfg else F32(1) - F32(cfg["beta_1"])


def _lion_update(cfg, g, w, slots, lr, t, store, terms=None):
    beta_1, beta_2 = F32(cfg["beta_1"]), F32(cfg["beta_2"])
    m = slots["m"]
    w = w - lr * tf_sign(m * beta_1 + g * _lion_c1(cfg))
    store("m", m * beta_2 + (g * (F32(1) - beta_2) if terms is None else terms))
    return w


def _lion_hyper(cfg, lr, t):
    beta_1, beta_2 = F32(cfg["beta_1"]), F32(cfg["beta_2"])
    return [float(beta_1), float(_lion_c1(cfg)), float(beta_2), float(F32(1) - beta_2)]


# tf_keras' legacy optimizers: TensorFlow's training_ops.cc functors (and,
# for RMSprop without momentum, tf_keras' own ops), every number float32 as
# the kernel gets it from tf_keras' hyperparameter variables.

def _legacy_sgd_slots(cfg):
    return ["momentum"] if cfg["momentum"] != 0 else []


def _keras_momentum_update(cfg, g, w, slots, lr, t, store):
    """ApplyKerasMomentum's update."""
    mu = F32(cfg["momentum"])
    m = slots["momentum"] * mu - g * lr
    store("momentum", m)
    return w + (m * mu - g * lr) if cfg["nesterov"] else w + m


def _legacy_sgd_update(cfg, g, w, slots, lr, t, store):
    if cfg["momentum"] == 0:
        return w - g * lr  # ApplyGradientDescent
    return _keras_momentum_update(cfg, g, w, slots, lr, t, store)


def _legacy_sgd_hyper(cfg, lr, t):
    return [1.0 if cfg["momentum"] != 0 else 0.0, 1.0 if cfg["nesterov"] else 0.0,
            cfg["momentum"]]


def _tf_keras_sgd_hyper(cfg, lr, t):
    return [1.0, 1.0 if cfg["nesterov"] else 0.0, cfg["momentum"]]


def legacy_adam_scalars(cfg, lr, t):
    """1 - beta_1, 1 - beta_2 (float32), epsilon and ApplyAdam's alpha."""
    beta_1, beta_2 = F32(cfg["beta_1"]), F32(cfg["beta_2"])
    return [F32(1) - beta_1, F32(1) - beta_2, F32(cfg["epsilon"]),
            adam_alpha(lr, beta_1, beta_2, t)]


def _legacy_adam_update(cfg, g, w, slots, lr, t, store):
    c1, c2, eps, alpha = legacy_adam_scalars(cfg, lr, t)
    m = slots["m"] + (g - slots["m"]) * c1
    v = slots["v"] + (g * g - slots["v"]) * c2
    store("m", m)
    store("v", v)
    if cfg["amsgrad"]:
        # Eigen's vhat.cwiseMax(v): std::max, vhat unless v > vhat.
        v = np.where(v > slots["v_hat"], v, slots["v_hat"])
        store("v_hat", v)
    return w - (m * alpha) / (np.sqrt(v) + eps)


def _legacy_adam_hyper(cfg, lr, t):
    return ([1.0 if cfg["amsgrad"] else 0.0, 0.0]
            + [float(x) for x in legacy_adam_scalars(cfg, lr, t)])


def _legacy_rmsprop_slots(cfg):
    return (["velocity"] + (["momentum"] if cfg["momentum"] > 0 else [])
            + (["average_gradient"] if cfg["centered"] else []))


def _legacy_rmsprop_update(cfg, g, w, slots, lr, t, store):
    rho = F32(cfg["rho"])
    c, eps = F32(1) - rho, F32(cfg["epsilon"])
    if cfg["momentum"] > 0:  # ApplyRMSProp / ApplyCenteredRMSProp
        ms = slots["velocity"] + (g * g - slots["velocity"]) * c
        store("velocity", ms)
        if cfg["centered"]:
            mg = slots["average_gradient"] + (g - slots["average_gradient"]) * c
            store("average_gradient", mg)
            d = (ms - mg * mg) + eps
        else:
            d = ms + eps
        mom = slots["momentum"] * F32(cfg["momentum"]) + (g * lr) / np.sqrt(d)
        store("momentum", mom)
        return w - mom
    rms = rho * slots["velocity"] + c * (g * g)  # tf_keras' own ops
    store("velocity", rms)
    d = rms
    if cfg["centered"]:
        mg = rho * slots["average_gradient"] + c * g
        store("average_gradient", mg)
        d = rms - mg * mg
    return w - (lr * g) / (np.sqrt(d) + eps)


def _legacy_rmsprop_hyper(cfg, lr, t):
    rho = F32(cfg["rho"])
    return [1.0 if cfg["momentum"] > 0 else 0.0, 1.0 if cfg["centered"] else 0.0, 0.0, float(rho),
            float(F32(1) - rho), cfg["momentum"], cfg["epsilon"]]


def _legacy_adagrad_update(cfg, g, w, slots, lr, t, store):
    acc = slots["accumulator"] + g * g  # ApplyAdagradV2
    store("accumulator", acc)
    return w - (g * lr) / (np.sqrt(acc) + F32(cfg["epsilon"]))


FAMILIES = {
    "sgd": dict(slots=_sgd_slots, update=_sgd_update, hyper=_sgd_hyper),
    "adam": dict(slots=_adam_slots, update=_adam_update, hyper=_adam_hyper, nonneg=("v",)),
    "rmsprop": dict(slots=_rmsprop_slots, update=_rmsprop_update, hyper=_rmsprop_hyper,
                    nonneg=("velocity",)),
    "adagrad": dict(slots=lambda cfg: ["accumulator"], update=_adagrad_update,
                    hyper=_adagrad_hyper, nonneg=("accumulator",), initial="accumulator"),
    "adamax": dict(slots=lambda cfg: ["m", "u"], update=_adamax_update, hyper=_adamax_hyper,
                   nonneg=("u",)),
    "nadam": dict(slots=lambda cfg: ["m", "v"], update=_nadam_update, hyper=_nadam_hyper,
                  nonneg=("v",)),
    "lion": dict(slots=lambda cfg: ["m"], update=_lion_update, hyper=_lion_hyper),
    "legacy_sgd": dict(slots=_legacy_sgd_slots, update=_legacy_sgd_update,
                       hyper=_legacy_sgd_hyper),
    "legacy_adam": dict(slots=_adam_slots, update=_legacy_adam_update, hyper=_legacy_adam_hyper,
                        nonneg=("v",)),
    "legacy_rmsprop": dict(slots=_legacy_rmsprop_slots, update=_legacy_rmsprop_update,
                           hyper=_legacy_rmsprop_hyper, nonneg=("velocity",)),
    "legacy_adagrad": dict(slots=lambda cfg: ["accumulator"], update=_legacy_adagrad_update,
                           hyper=lambda cfg, lr, t: [cfg["epsilon"]], nonneg=("accumulator",),
                           initial="accumulator"),
    "tf_keras_adam": dict(slots=_adam_slots, update=_adam_update, hyper=_adam_hyper,
                          nonneg=("v",)),
    "tf_keras_sgd": dict(slots=lambda cfg: ["momentum"], update=_keras_momentum_update,
                         hyper=_tf_keras_sgd_hyper),
    "tf_keras_rmsprop": dict(slots=_rmsprop_slots, update=_rmsprop_update, hyper=_rmsprop_hyper,
                             nonneg=("velocity",)),
    # Keras' ``var.assign(var + grad)`` of an accumulating step.
    "accumulate": dict(slots=lambda cfg: [], update=lambda cfg, g, w, slots, lr, t, store: w + g,
                       hyper=lambda cfg, lr, t: []),
}


def core_step(core, cfg, variables, grads, slots, *, lr, t, scale=None, mode="divide",
              flush_denormals=False, terms=None, indices=None, slice_factor=None,
              accumulators=None, accumulation_steps=None, accumulation="divide", hyper=None,
              decay=None):
    """The same step through the core, in place: ``core.sgd_step_`` /
    ``core.adam_step_`` for those two, ``core.optimizer_step_`` for every
    other family and for ``terms``, sparse gradients (``indices``, with
    ``slice_factor``) or an accumulation's update step (``accumulators``,
    with ``accumulation_steps`` and ``accumulation``, zeroed by it);
    ``decay``, each variable's ls_decay, in place of the configuration's
    mask."""
    common = dict(learning_rate=float(F32(lr)), weight_decay=cfg.get("weight_decay"),
                  decay=decay_mask(cfg, len(variables)) if decay is None else decay,
                  scale=scale, unscale=mode,
                  flush_denormals=flush_denormals)
    if cfg.get("clip") is not None:
        clip, value = cfg["clip"]
        common.update(clip=clip, clip_value=None if clip == "global" else value)
        if clip != "value":
            scalars = clip_scalars(cfg, len(variables))
            common["clip_scalars"] = scalars[0] if clip == "global" else scalars
    if accumulators is not None:
        common.update(accumulators=accumulators, accumulation_steps=accumulation_steps,
                      accumulation=accumulation)
    if terms is not None or indices is not None or accumulators is not None:
        sparse = {} if indices is None else {"indices": indices, "slice_factor": slice_factor}
        return core.optimizer_step_(cfg["opt"], variables, grads,
                                    [slots[k] for k in slot_names(cfg)],
                                    hyper=(FAMILIES[cfg["opt"]]["hyper"](cfg, lr, t)
                                           if hyper is None else hyper),
                                    terms=terms, **sparse, **common)
    if cfg["opt"] == "sgd":
        return core.sgd_step_(variables, grads, slots.get("momentum"),
                              momentum=cfg["momentum"], nesterov=cfg["nesterov"], **common)
    if cfg["opt"] == "adam":
        return core.adam_step_(variables, grads, slots["m"], slots["v"], slots.get("v_hat"),
                               alpha=float(adam_alpha(lr, cfg["beta_1"], cfg["beta_2"], t)),
                               beta_1=cfg["beta_1"], beta_2=cfg["beta_2"],
                               epsilon=cfg["epsilon"], **common)
    return core.optimizer_step_(cfg["opt"], variables, grads,
                                [slots[k] for k in slot_names(cfg)],
                                hyper=FAMILIES[cfg["opt"]]["hyper"](cfg, lr, t), **common)


def random_values(rng, shape, *, scale=1.0, special=False):
    """float32 normal values times ``scale`` with some zeros and, with
    ``special``, subnormal and huge magnitudes."""
    a = (rng.standard_normal(shape) * scale).astype(F32)
    flat = a.reshape(-1)
    k = max(1, flat.size // 10)
    flat[rng.integers(0, flat.size, k)] = 0.0
    if special:
        tiny = float(np.finfo(F32).tiny)
        flat[rng.integers(0, flat.size, k)] = (rng.standard_normal(k) * tiny / 64).astype(F32)
        flat[rng.integers(0, flat.size, k)] = (rng.standard_normal(k) * 1e37).astype(F32)
    return a


def make_grads(rng, shapes, dtype, scale, *, special=False):
    """Gradients as a scaled loss makes them: true values times ``scale``,
    rounded to ``dtype``, kept finite."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    out = []
    for shape in shapes:
        g = rng.standard_normal(shape) * 0.05 * (1.0 if scale is None else scale)
        flat = g.reshape(-1)
        k = max(1, flat.size // 10)
        flat[rng.integers(0, flat.size, k)] = 0.0
        if special:
            tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
            flat[rng.integers(0, flat.size, k)] = rng.standard_normal(k) * tiny / 8
            flat[rng.integers(0, flat.size, k)] = rng.standard_normal(k) * fmax / 4
        out.append(np.clip(g, -fmax, fmax).astype(dtype))
    return out


def make_state(rng, cfg, shapes, *, special=False):
    """Variables and slots as after some training: the slots a family keeps
    non-negative (its ``nonneg``: Adam's v) are, v_hat >= v, and one that
    starts at a value (its ``initial``: Adagrad's accumulator) is above it."""
    variables = [random_values(rng, s, special=special) for s in shapes]
    nonneg = FAMILIES[cfg["opt"]].get("nonneg", ())
    slots = {}
    for name in slot_names(cfg):
        if name == "v_hat":
            slots[name] = [np.maximum(v, np.abs(random_values(rng, v.shape, scale=1e-4)))
                           for v in slots["v"]]
        elif name in nonneg:
            slots[name] = [np.abs(random_values(rng, s, scale=1e-4, special=special))
                           for s in shapes]
            if name == FAMILIES[cfg["opt"]].get("initial"):  # Adagrad's start
                slots[name] = [a + F32(cfg["initial_accumulator_value"]) for a in slots[name]]
        else:
            slots[name] = [random_values(rng, s, scale=0.01, special=special) for s in shapes]
    return variables, slots


# The cases every SIMD level runs: lengths around every vector width (4, 8
# and 16 floats) and their multiples, subnormal and huge values, both modes.
SIMD_SHAPES = [(n,) for n in (1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65,
                              127, 1000)] + [(13, 7)]
SIMD_UNSCALES = [(None, "divide"), (2.0**15, "divide"), (3.0, "divide"),
                 (2.0**-3, "multiply"), (1000.0, "multiply")]
SIMD_STEPS = 2


def simd_cases():
    """``(key, cfg, grad dtype, scale, mode, flush_denormals, seed)`` for each case."""
    seed = 0
    for name, cfg in CONFIGS.items():
        for dtype in GRAD_DTYPES:
            for scale, mode in SIMD_UNSCALES:
                for flush in (False, True):
                    seed += 1
                    yield (f"{name}/{dtype}/{mode}-{scale}/flush={flush}", cfg, dtype, scale,
                           mode, flush, seed)


def make_terms(rng, cfg, shapes):
    """What a sparse gradient's term summed per row may be for ``cfg``'s
    family: zeros, subnormals and huge values (up to inf) among them,
    non-negative but for Lion's."""
    out = []
    for shape in shapes:
        a = random_values(rng, shape, scale=1e-3, special=True)
        if cfg["opt"] != "lion":
            a = np.abs(a)
        a.reshape(-1)[rng.integers(0, a.size, max(1, a.size // 50))] = np.inf
        out.append(a)
    return out


# The families whose kernel takes a sparse gradient's term.
TERM_CONFIGS = [name for name, cfg in CONFIGS.items()
                if cfg["opt"] in ("adam", "adamax", "lion")]


def simd_term_cases():
    """``(key, cfg, grad dtype, flush_denormals, seed)``: each family that
    takes a gradient term, given one, on already unscaled float32 gradients."""
    seed = 10_000
    for name in TERM_CONFIGS:
        for flush in (False, True):
            seed += 1
            yield f"{name}/terms/flush={flush}", CONFIGS[name], "float32", flush, seed


# One configuration of each family (rmsprop and adagrad in their Rsqrt
# forms, whose vector loops stop at TensorFlow's packets) for the update
# step of a gradient accumulation; its averages (divided or times the
# reciprocal, over a count of steps that is a power of two and one that is
# not), and the unscales taken in turn.
ACCUMULATE_CONFIGS = ["sgd_momentum", "sgd_nesterov", "adamw", "adamw_amsgrad_odd",
                      "rmsprop_centered_graph", "rmsprop_momentum", "adagrad_graph",
                      "adamax_decay_odd", "nadam", "lion_decay_odd", "legacy_sgd_nesterov",
                      "legacy_adam_amsgrad_odd", "legacy_rmsprop_centered_momentum",
                      "legacy_adagrad", "accumulate", "sgd_momentum_clipvalue",
                      "adam_clipnorm"]
ACCUMULATE_AVERAGES = [(3, "divide"), (3, "multiply"), (4, "divide"), (5, "multiply")]


def simd_accumulate_cases():
    """``(key, cfg, grad dtype, scale, mode, steps, average, flush, seed)``
    for each accumulation case."""
    seed = 30_000
    for name in ACCUMULATE_CONFIGS:
        for dtype in GRAD_DTYPES:
            for steps, average in ACCUMULATE_AVERAGES:
                for flush in (False, True):
                    seed += 1
                    scale, mode = SIMD_UNSCALES[seed % len(SIMD_UNSCALES)]
                    yield (f"{name}/{dtype}/{mode}-{scale}/accumulated-{average}-{steps}/"
                           f"flush={flush}", CONFIGS[name], dtype, scale, mode, steps, average,
                           flush, seed)


def simd_runs():
    """Each case of ``simd_cases``, of ``simd_term_cases``, then of
    ``simd_accumulate_cases`` as ``(key, cfg, flush_denormals, variables,
    slots, steps)``: the state made from the case's seed, and ``steps``
    yielding ``(t, grads, kwargs)`` for each of ``SIMD_STEPS`` steps
    (``kwargs``: the unscale's ``scale`` and ``mode``, the gradient
    ``terms``, or the unscale and an accumulation's update step: fresh
    ``accumulators`` of subnormal and huge values among others, their
    ``accumulation_steps`` and ``accumulation``), drawn from the same
    generator as the state, in that order."""
    for key, cfg, dtype, scale, mode, flush, seed in simd_cases():
        rng = np.random.default_rng(seed)
        variables, slots = make_state(rng, cfg, SIMD_SHAPES, special=True)
        yield (key, cfg, flush, variables, slots,
               _simd_steps(rng, cfg, dtype, scale, {"scale": scale, "mode": mode}))
    for key, cfg, dtype, flush, seed in simd_term_cases():
        rng = np.random.default_rng(seed)
        variables, slots = make_state(rng, cfg, SIMD_SHAPES, special=True)
        yield key, cfg, flush, variables, slots, _simd_steps(rng, cfg, dtype, None, None)
    for key, cfg, dtype, scale, mode, steps, average, flush, seed in simd_accumulate_cases():
        rng = np.random.default_rng(seed)
        variables, slots = make_state(rng, cfg, SIMD_SHAPES, special=True)
        yield (key, cfg, flush, variables, slots,
               _simd_steps(rng, cfg, dtype, scale, {"scale": scale, "mode": mode},
                           accumulation=(steps, average)))


def _simd_steps(rng, cfg, dtype, scale, unscale, accumulation=None):
    for step in range(SIMD_STEPS):
        grads = make_grads(rng, SIMD_SHAPES, GRAD_DTYPES[dtype], scale, special=True)
        kwargs = unscale if unscale is not None else {"terms": make_terms(rng, cfg, SIMD_SHAPES)}
        if accumulation is not None:
            kwargs = dict(kwargs, accumulators=make_accumulators(rng, SIMD_SHAPES, special=True),
                          accumulation_steps=accumulation[0], accumulation=accumulation[1])
        yield step + 1, grads, kwargs


def make_accumulators(rng, shapes, *, special=False):
    """Gradient accumulators as a few accumulating steps leave them: sums of
    unscaled gradients (with ``special``, subnormal and huge ones)."""
    return [random_values(rng, s, scale=0.1, special=special) for s in shapes]


def flat_bits(variables, slots):
    """Every variable then every slot (by name), as one uint32 array."""
    arrays = variables + [a for k in sorted(slots) for a in slots[k]]
    return np.concatenate([a.reshape(-1) for a in arrays]).view(np.uint32)


# ---------------------------------------------------------- sparse gradients
# A sparse gradient (TensorFlow's IndexedSlices: slices and the rows they
# belong to) feeds the families whose update of an element reads that
# element alone.  Keras' ops densify it as TensorFlow converts an
# IndexedSlices (UnsortedSegmentSum: each row's slices added in their order
# onto 0); where an op maps the slices first (Adam's square, Adamax's abs,
# Lion's g * (1 - beta_2)), the mapped values are summed the same way.

# The configurations a sparse gradient may feed, weight decay on (every
# third variable excluded).
SPARSE_CONFIGS = {
    "sgd": dict(CONFIGS["sgd"], weight_decay=0.01, mask=True),
    "sgd_momentum": dict(CONFIGS["sgd_momentum"], weight_decay=0.01, mask=True),
    "sgd_nesterov": dict(CONFIGS["sgd_nesterov"], weight_decay=0.02, mask=True),
    "adam": dict(CONFIGS["adam"], weight_decay=0.004, mask=True),
    "adam_amsgrad": dict(CONFIGS["adam_amsgrad"], weight_decay=0.004, mask=True),
    "adamw_amsgrad_odd": CONFIGS["adamw_amsgrad_odd"],
    "adamax": dict(CONFIGS["adamax"], weight_decay=0.004, mask=True),
    "adamax_decay_odd": CONFIGS["adamax_decay_odd"],
    "lion": dict(CONFIGS["lion"], weight_decay=0.004, mask=True),
    "lion_decay_odd": CONFIGS["lion_decay_odd"],
}

# Each sparse family under each of Keras' clips (values near the unscaled
# gradients' magnitudes, so that some are clipped and some not).
SPARSE_CLIP_CONFIGS = {
    f"{base}_clip{mode}": dict(SPARSE_CONFIGS[base], clip=(mode, value))
    for base in ("sgd_nesterov", "adam_amsgrad", "adamax", "lion")
    for mode, value in (("value", 0.03), ("norm", 0.05), ("global", None))}


def keras_sparse_form(cfg, lr):
    """``(cfg, lr, slice_factor)`` as Keras' update runs on slices: SGD's
    slices times the learning rate (``gradient * lr`` keeps them sparse),
    then a kernel learning rate of 1; Lion's times 1 - beta_1, then a
    kernel 1 - beta_1 of 1; the others' as they are."""
    if cfg["opt"] == "sgd":
        return cfg, F32(1), F32(lr)
    if cfg["opt"] == "lion":
        return dict(cfg, c1=1.0), F32(lr), F32(1) - F32(cfg["beta_1"])
    return cfg, F32(lr), None


def sparse_forms(cfg, lr):
    """``{form: (cfg, lr, slice_factor)}``: Keras' (``keras_sparse_form``)
    and a slice factor of 0.37; under the global clip, which takes none,
    the configuration as it is."""
    if cfg.get("clip") is not None and cfg["clip"][0] == "global":
        return {"global": (cfg, F32(lr), None)}
    return {"keras": keras_sparse_form(cfg, lr), "odd": (cfg, F32(lr), F32(0.37))}


def slice_term(cfg, u):
    """What the family sums per row in place of a function of the dense
    gradient (``keras_step``'s ``terms``), of slice values ``u``: Adam's
    squares, Adamax's magnitudes, Lion's u * (1 - beta_2); None for SGD."""
    if cfg["opt"] == "adam":
        return u * u
    if cfg["opt"] == "adamax":
        return np.abs(u)
    if cfg["opt"] == "lion":
        return u * (F32(1) - F32(cfg["beta_2"]))
    return None


def densify(values, indices, rows):
    """TensorFlow's conversion of an IndexedSlices to a tensor of ``rows``
    rows, in float32: each slice added onto its row in slice order, every
    row starting at +0 (so 0 + -0 is +0; a row no slice names stays +0)."""
    out = np.zeros((rows,) + values.shape[1:], F32)
    with np.errstate(all="ignore"):
        for k, row in enumerate(indices):
            out[row] = out[row] + values[k]
    return out


def sparse_keras_step(cfg, variables, grads, slots, *, indices, lr, t, scale=None,
                      mode="divide", slice_factor=None):
    """Keras' step where ``indices[i]`` (not None) makes ``grads[i]`` the
    slices of a sparse gradient: each slice value unscaled and clipped as a
    dense gradient's, times ``slice_factor``, then densified, its term
    summed alike; under the global clip the sums are clipped instead and
    the family computes its own term.  ``(variables, slots)`` after it."""
    n = len(variables)
    global_clip = cfg.get("clip") is not None and cfg["clip"][0] == "global"
    inner = cfg if global_clip else {k: v for k, v in cfg.items() if k != "clip"}
    factor = F32(1) if slice_factor is None else F32(slice_factor)
    dense, terms = [], []
    with np.errstate(all="ignore"):
        for i, (w, grad, index) in enumerate(zip(variables, grads, indices)):
            u = unscaled(grad, scale, mode)
            if not global_clip:
                u = clipped(cfg, u, i, n)
            if index is None:
                dense.append(u)
                terms.append(None)
                continue
            dense.append(densify(u * factor, index, w.shape[0]))
            term = None if global_clip else slice_term(cfg, u)
            terms.append(None if term is None else densify(term, index, w.shape[0]))
    return keras_step(inner, variables, dense, slots, lr=lr, t=t, terms=terms)


def make_indices(rng, rows, count):
    """``count`` row indices as an IndexedSlices may hold them: in no order,
    with repeats (one row an eighth of them), and a quarter of the rows
    (when there are 4 or more) never named."""
    named = rng.choice(rows, size=rows - rows // 4, replace=False)
    index = rng.choice(named, size=count)
    if count >= 8:
        index[rng.choice(count, size=count // 8, replace=False)] = named[0]
    return index.astype(np.int64)


def make_slices(rng, shape, count, dtype, scale, *, special=False):
    """``count`` slices of rows of a variable of ``shape`` as a scaled loss
    makes them (``make_grads``), some of them -0."""
    if count == 0:
        return np.zeros((0,) + tuple(shape[1:]), dtype)
    values = make_grads(rng, [(count,) + tuple(shape[1:])], dtype, scale, special=special)[0]
    flat = values.reshape(-1)
    flat[rng.integers(0, flat.size, max(1, flat.size // 20))] = -0.0
    return values


# Sparse gradients of every SIMD tail length, rows of one element and
# several, a variable of several of the core's 4096-element blocks whose
# rows straddle them, one with no slice, and a dense gradient among them.
SPARSE_SIMD_SHAPES = ([((n,), n + n // 2) for n in (1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 65)]
                      + [((13, 7), 20), ((9, 16), 9), ((6, 5), 0), ((300, 37), 500),
                         ((47,), None)])
SPARSE_SIMD_UNSCALES = [(None, "divide"), (3.0, "divide"), (1000.0, "multiply")]


# tf_keras' legacy optimizers sum a sparse gradient's slices per row
# (_deduplicate_indexed_slices), then update: SGD's momentum, RMSprop's with
# momentum and Adagrad by TensorFlow's ResourceSparseApply* kernels, on the
# rows named alone; Adam and RMSprop without momentum by tf_keras' own ops,
# the slots of every row decayed first.  scalar_first: a graph's (k * g) * g
# for tf_keras' (g * g) * k.
SPARSE_LEGACY_CONFIGS = {
    "legacy_sgd_momentum": CONFIGS["legacy_sgd_momentum"],
    "legacy_sgd_nesterov": CONFIGS["legacy_sgd_nesterov"],
    "legacy_adam": CONFIGS["legacy_adam"],
    "legacy_adam_amsgrad_odd_graph": dict(CONFIGS["legacy_adam_amsgrad_odd"], scalar_first=True),
    "legacy_rmsprop": CONFIGS["legacy_rmsprop"],
    "legacy_rmsprop_centered_graph": dict(CONFIGS["legacy_rmsprop_centered"], scalar_first=True),
    "legacy_rmsprop_momentum": CONFIGS["legacy_rmsprop_momentum"],
    "legacy_rmsprop_centered_momentum": CONFIGS["legacy_rmsprop_centered_momentum"],
    "legacy_adagrad": CONFIGS["legacy_adagrad"],
    "legacy_adagrad_clipvalue": dict(CONFIGS["legacy_adagrad"], clip=("value", 0.03)),
    # tf_keras' current Adam sums the slices per row as the legacy ones do
    # (_deduplicate_sparse_grad), then decays m and v everywhere and
    # scatter-adds the sums' terms (the dense numbers).
    "tf_keras_adam": CONFIGS["tf_keras_adam"],
    "tf_keras_adamw_amsgrad_odd": CONFIGS["tf_keras_adamw_amsgrad_odd"],
    "tf_keras_adam_clipvalue": dict(CONFIGS["tf_keras_adam"], clip=("value", 0.03)),
    # Its SGD decays m everywhere, then scatter-adds the sums times -lr to m
    # and, with Nesterov, to w, before w + m * momentum.
    "tf_keras_sgd_nesterov": CONFIGS["tf_keras_sgd_nesterov"],
    "tf_keras_sgd_nesterov_decay_odd": CONFIGS["tf_keras_sgd_nesterov_decay_odd"],
    "tf_keras_sgd_no_momentum_clipvalue": dict(CONFIGS["tf_keras_sgd_no_momentum"],
                                               clip=("value", 0.03)),
    # Its RMSprop decays velocity (and average_gradient) everywhere,
    # scatter-adds the sums' terms, then moves the rows named by the sums
    # times lr and TensorFlow's Rsqrt of their denominators gathered, in
    # the order of their first slice.
    "tf_keras_rmsprop": CONFIGS["tf_keras_rmsprop"],
    "tf_keras_rmsprop_centered_momentum": CONFIGS["tf_keras_rmsprop_centered_momentum"],
    "tf_keras_rmsprop_momentum_decay_graph": CONFIGS["tf_keras_rmsprop_momentum_decay_graph"],
    "tf_keras_rmsprop_centered_graph_clipvalue": dict(CONFIGS["tf_keras_rmsprop_centered_graph"],
                                                      clip=("value", 0.03)),
}


def summed(cfg):
    """Whether a configuration's family sums a sparse gradient's slices per
    row as tf_keras does (the core's LS_OPTIM_SUMMED_FAMILIES)."""
    return cfg["opt"].startswith("legacy_") or cfg["opt"].startswith("tf_keras_")


def legacy_sparse_hyper(cfg, lr, t):
    """A legacy family's numbers for a sparse gradient: the dense ones with
    the scalar-first form; Adam's beta_1, beta_2 and tf_keras'
    lr * (sqrt(1 - beta_2^t) / (1 - beta_1^t)) in place of 1 - beta and
    ApplyAdam's alpha."""
    first = 1.0 if cfg.get("scalar_first") else 0.0
    if cfg["opt"].startswith("tf_keras_"):
        return FAMILIES[cfg["opt"]]["hyper"](cfg, lr, t)
    if cfg["opt"] == "legacy_adam":
        b1, b2 = F32(cfg["beta_1"]), F32(cfg["beta_2"])
        alpha = F32(lr) * (np.sqrt(F32(1) - b2 ** F32(t)) / (F32(1) - b1 ** F32(t)))
        return [1.0 if cfg["amsgrad"] else 0.0, first, float(b1), float(b2),
                float(F32(cfg["epsilon"])), float(F32(alpha))]
    hyper = FAMILIES[cfg["opt"]]["hyper"](cfg, lr, t)
    if cfg["opt"] == "legacy_rmsprop":
        hyper[2] = first
    return hyper


def _row_rsqrt(d):
    """Eigen's rsqrt of each row of ``d`` (rows, n), as TensorFlow's sparse
    RMSprop takes it a row at a time: TensorFlow's own packets (its Rsqrt
    of the packet columns, whole packets) and 1 / sqrt on the last n % 8."""
    p = d.shape[1] - d.shape[1] % 8
    out = np.empty_like(d)
    if p:
        out[:, :p] = tf_rsqrt(np.ascontiguousarray(d[:, :p]).ravel()).reshape(-1, p)
    with np.errstate(all="ignore"):
        out[:, p:] = F32(1) / np.sqrt(d[:, p:])
    return out


def legacy_rows_step(cfg, variables, grads, slots, *, indices, lr, t, hyper, scale=None,
                     mode="divide", slice_factor=None):
    """tf_keras' legacy step of sparse gradients (every ``indices[i]`` given):
    each slice value unscaled and clipped, a row's slices summed onto +0 in
    their order, then the family's sparse update with the numbers
    ``hyper`` (``legacy_sparse_hyper``).  ``(variables, slots)`` after it."""
    assert slice_factor is None
    opt, lr, n = cfg["opt"], F32(lr), len(variables)
    variables = [v.copy() for v in variables]
    slots = {k: [s.copy() for s in v] for k, v in slots.items()}
    mask = decay_mask(cfg, n)
    with np.errstate(all="ignore"):
        for i, index in enumerate(indices):
            if mask is not None and mask[i]:
                # tf_keras' _apply_weight_decay, before the update.
                variables[i][...] = variables[i] - (variables[i] * F32(cfg["weight_decay"])) * lr
            w = variables[i].reshape(variables[i].shape[0], -1)
            s = {k: v[i].reshape(w.shape) for k, v in slots.items()}
            u = clipped(cfg, unscaled(grads[i], scale, mode), i, n)
            g = densify(u, index, w.shape[0]).reshape(w.shape)
            named = np.unique(index)
            g = g[named]

            def square(k):
                return (k * g) * g if hyper[{"legacy_adam": 1, "legacy_rmsprop": 2}[opt]] \
                    else (g * g) * k
            if opt == "tf_keras_adam":
                # m.assign_add(-m * c1), then the sums times c1 scattered
                # (v alike, tf.square's); rows named none add nothing.
                c1, c2, eps, alpha = (F32(hyper[k]) for k in (0, 1, 2, 4))
                s["m"][:] = s["m"] + -(s["m"] * c1)
                s["v"][:] = s["v"] + -(s["v"] * c2)
                s["m"][named] = s["m"][named] + g * c1
                s["v"][named] = s["v"][named] + np.square(g) * c2
                v = s["v"]
                if hyper[3]:
                    s["v_hat"][:] = np.maximum(s["v_hat"], v)
                    v = s["v_hat"]
                w[:] = w - (s["m"] * alpha) / (np.sqrt(v) + eps)
            elif opt == "tf_keras_sgd":
                # m.assign(m * mu) on every row, then the sums times -lr
                # scattered onto m and (Nesterov) w; w + m * mu after.
                mu = F32(hyper[2])
                d = -(g * lr)
                s["momentum"][:] = s["momentum"] * mu
                s["momentum"][named] = s["momentum"][named] + d
                if hyper[1]:
                    w[named] = w[named] + d
                    w[:] = w + s["momentum"] * mu
                else:
                    w[:] = w + s["momentum"]
            elif opt == "tf_keras_rmsprop":
                # Unique's rows, in the order of their first slice: the
                # gathered denominators' order, whose Rsqrt rounds an
                # element by its place in that tensor.
                rho, k, eps, mu = (F32(hyper[j]) for j in range(4))
                first = named[np.argsort(np.unique(index, return_index=True)[1])]
                gf = densify(u, index, w.shape[0]).reshape(w.shape)[first]
                v = s["velocity"]
                v[:] = rho * v
                v[first] = v[first] + (gf * gf) * k
                if hyper[5]:
                    a = s["average_gradient"]
                    a[:] = rho * a
                    a[first] = a[first] + gf * k
                    d = (eps - a * a) + v if hyper[7] else (v - a * a) + eps
                else:
                    d = v + eps
                r = tf_rsqrt(np.ascontiguousarray(d[first]))
                step = {2.0: lambda: gf * (lr * r), 3.0: lambda: lr * (gf * r),
                        1.0: lambda: (lr * gf) * r}[hyper[6]]()
                if hyper[4]:
                    m = s["momentum"]
                    m[:] = mu * m
                    m[first] = m[first] + step
                    w[:] = w + -m
                else:
                    w[first] = w[first] + -step
            elif opt == "legacy_sgd":
                mu = F32(hyper[2])
                m = s["momentum"][named] * mu - g * lr
                s["momentum"][named] = m
                w[named] = w[named] + (m * mu - g * lr) if hyper[1] else w[named] + m
            elif opt == "legacy_adagrad":
                acc = s["accumulator"][named] + g * g
                s["accumulator"][named] = acc
                w[named] = w[named] - (g * lr) / (np.sqrt(acc) + F32(hyper[0]))
            elif opt == "legacy_rmsprop":
                rho, k, mu, eps = (F32(x) for x in hyper[3:7])
                if hyper[0]:
                    ms = s["velocity"][named] * rho + (g * g) * k
                    s["velocity"][named] = ms
                    d = ms + eps
                    if hyper[1]:
                        mg = s["average_gradient"][named] * rho + g * k
                        s["average_gradient"][named] = mg
                        d = d - mg * mg
                    mom = s["momentum"][named] * mu + (_row_rsqrt(d) * lr) * g
                    s["momentum"][named] = mom
                    w[named] = w[named] - mom
                else:
                    s["velocity"][:] = s["velocity"] * rho
                    ms = s["velocity"][named] + square(k)
                    s["velocity"][named] = ms
                    d = ms
                    if hyper[1]:
                        s["average_gradient"][:] = s["average_gradient"] * rho
                        mg = s["average_gradient"][named] + g * k
                        s["average_gradient"][named] = mg
                        d = ms - mg * mg
                    w[named] = w[named] - (lr * g) / (np.sqrt(d) + eps)
            else:
                b1, b2, eps, alpha = (F32(x) for x in hyper[2:6])
                s["m"][:] = s["m"] * b1
                s["v"][:] = s["v"] * b2
                s["m"][named] = s["m"][named] + g * (F32(1) - b1)
                s["v"][named] = s["v"][named] + square(F32(1) - b2)
                v = s["v"]
                if hyper[0]:
                    s["v_hat"][:] = np.maximum(s["v_hat"], v)
                    v = s["v_hat"]
                w[:] = w - (alpha * s["m"]) / (np.sqrt(v) + eps)
    return variables, slots


def sparse_simd_runs():
    """Each sparse configuration (plain, clipped, Adagrad's scattered rows,
    the legacy families' sums, accumulate's added rows) under each grad
    dtype and unscale, flushing or not, as ``(key, cfg, flush_denormals,
    variables, slots, steps)``; ``steps`` yields ``(t, grads, kwargs)`` for
    ``SIMD_STEPS`` steps, ``kwargs`` the learning rate, unscale, indices and
    slice factor (``sparse_forms``).  Slices of subnormal and huge values
    among them."""
    seed = 20_000
    rows = {**SPARSE_ROW_CONFIGS, **SPARSE_LEGACY_CONFIGS, **SPARSE_ACCUMULATE_CONFIGS}
    for name, cfg in (list(SPARSE_CONFIGS.items()) + list(SPARSE_CLIP_CONFIGS.items())
                      + list(rows.items())):
        forms = ({"rows": (cfg, F32(cfg["lr"]), None)} if name in rows
                 else sparse_forms(cfg, cfg["lr"]))
        for form, (run_cfg, lr, factor) in forms.items():
            for dtype in GRAD_DTYPES:
                for scale, mode in SPARSE_SIMD_UNSCALES:
                    for flush in (False, True):
                        seed += 1
                        rng = np.random.default_rng(seed)
                        variables, slots = make_state(
                            rng, run_cfg, [s for s, count in SPARSE_SIMD_SHAPES
                                           if count is not None or not summed(run_cfg)],
                            special=True)
                        yield (f"{name}/{form}/{dtype}/{mode}-{scale}/flush={flush}", run_cfg,
                               flush, variables, slots,
                               _sparse_simd_steps(rng, GRAD_DTYPES[dtype], scale, mode, lr,
                                                  factor, run_cfg))


def _sparse_simd_steps(rng, dtype, scale, mode, lr, factor, cfg):
    legacy = summed(cfg)
    for step in range(SIMD_STEPS):
        grads, indices = [], []
        for shape, count in SPARSE_SIMD_SHAPES:
            if count is None and legacy:
                # A legacy sparse gradient's numbers are its own: no dense
                # gradient in the same call.
                continue
            if count is None:
                grads.append(make_grads(rng, [shape], dtype, scale, special=True)[0])
                indices.append(None)
                continue
            indices.append(make_indices(rng, shape[0], count))
            grads.append(make_slices(rng, shape, count, dtype, scale, special=True))
        kwargs = dict(lr=lr, scale=scale, mode=mode, indices=indices, slice_factor=factor)
        if legacy:
            kwargs["hyper"] = legacy_sparse_hyper(cfg, lr, step + 1)
        yield step + 1, grads, kwargs


# Adagrad takes a sparse gradient as Keras' update scatters it: the squared
# slices added to the accumulator's rows one by one (ResourceScatterAdd),
# then each slice's (lr * u) / sqrt(accumulator + epsilon), with the
# accumulator's new rows, subtracted from the variable's one by one
# (ResourceScatterSub); rows no slice names are left as they are.
# Keras' accumulating step on a sparse gradient: densified, added to the
# accumulator (the core adds each named row's sum to that row alone; the
# model adds the whole densified gradient, +0 on the other rows).
SPARSE_ACCUMULATE_CONFIGS = {"accumulate": CONFIGS["accumulate"]}

# RMSprop without momentum, not centered, alike: every velocity decayed,
# rho * v plus the densified (1 - rho) * (u * u) (a row's slices added in
# their order onto 0: Keras adds the squares densified), then each slice's
# (lr * u) / sqrt(v + epsilon) subtracted from the variable's rows one by
# one (ResourceScatterSub).
SPARSE_ROW_CONFIGS = {
    "adagrad": CONFIGS["adagrad"],
    "adagrad_decay_odd": CONFIGS["adagrad_decay_odd"],
    "adagrad_clipvalue": dict(CONFIGS["adagrad"], clip=("value", 0.03)),
    "adagrad_clipnorm": dict(CONFIGS["adagrad_decay_odd"], clip=("norm", 0.05)),
    "rmsprop": CONFIGS["rmsprop"],
    "rmsprop_decay_odd": dict(CONFIGS["rmsprop"], lr=0.003, rho=0.8, epsilon=1e-3,
                              weight_decay=0.01, mask=True),
    "rmsprop_clipvalue": dict(CONFIGS["rmsprop"], clip=("value", 0.03)),
    "rmsprop_clipnorm": dict(CONFIGS["rmsprop"], rho=0.95, clip=("norm", 0.05)),
}


# The slot a row family's scatter moves.
_ROW_SLOTS = {"adagrad": "accumulator", "rmsprop": "velocity"}


def _scattered_slot(cfg, slot, u, index):
    """A row family's slot after a sparse gradient's slices ``u`` (rows
    ``index``): Adagrad's accumulator plus each slice's square in their
    order (ResourceScatterAdd); RMSprop's velocity, every row decayed, plus
    the slices' ``(1 - rho) * (u * u)`` densified (a row's added in their
    order onto 0)."""
    slot = slot.copy()
    if cfg["opt"] == "adagrad":
        for k, row in enumerate(index):
            slot[row] = slot[row] + u[k] * u[k]
        return slot
    assert cfg["momentum"] == 0 and not cfg["centered"] and not cfg["graph"]
    rest = F32(1 - cfg["rho"])
    squares = np.zeros_like(slot)
    for k, row in enumerate(index):
        squares[row] = squares[row] + rest * (u[k] * u[k])
    return F32(cfg["rho"]) * slot + squares


def rows_step(cfg, variables, grads, slots, *, indices, lr, t, scale=None, mode="divide"):
    """Keras' step of a row family (Adagrad; RMSprop without momentum, not
    centered) where ``indices[i]`` (not None) makes ``grads[i]`` the slices
    of a sparse gradient (each slice value unscaled and clipped as a dense
    gradient's): its slot moved as ``_scattered_slot`` says, then each
    slice's ``(lr * u) / sqrt(slot + epsilon)`` subtracted from its row in
    their order, as Keras scatters them; the dense ones as ``keras_step``.
    ``(variables, slots)`` after it."""
    lr = F32(lr)
    eps = F32(cfg["epsilon"])
    name = _ROW_SLOTS[cfg["opt"]]
    n = len(variables)
    variables = [v.copy() for v in variables]
    state = [a.copy() for a in slots[name]]
    mask = decay_mask(cfg, n)
    with np.errstate(all="ignore"):
        for i, index in enumerate(indices):
            w = variables[i]
            if mask is not None and mask[i]:
                w = w - (w * F32(cfg["weight_decay"])) * lr
            u = clipped(cfg, unscaled(grads[i], scale, mode), i, n)
            if index is None:
                w = FAMILIES[cfg["opt"]]["update"](
                    cfg, u, w, {name: state[i]}, lr, t,
                    lambda _, value, i=i: state.__setitem__(i, value))
            else:
                state[i] = _scattered_slot(cfg, state[i], u, index)
                for k, row in enumerate(index):
                    w[row] = w[row] - (lr * u[k]) / np.sqrt(state[i][row] + eps)
            variables[i] = w
    return variables, {name: state}
