"""The fused optimizer step: stock Keras SGD / Adam / AdamW updates with the
unscale folded in, as one native op over the whole variable list.

``static_reason`` and ``step_reason`` say whether a step can take the fused
path and, if not, why (the reason a user reads in
``LossScaleOptimizer.step_path``); ``Scalars`` and ``apply`` run it.
The fused op writes exactly what the inner optimizer's own ``apply`` would
(variables, slots, ``iterations``), bit for bit: every per-element
operation rounds as Keras' float32 op-by-op arithmetic does, and the scalars
Keras derives from ``iterations`` (the learning rate of a schedule, Adam's
``alpha``) are computed here with the same TensorFlow ops, in the same
order, as Keras computes them.

What the fused path does not do is left to the stock path: clipping, EMA,
gradient accumulation, an inner ``loss_scale_factor``, sparse gradients,
variable constraints or ``overwrite_with_gradient``, variables that are not
float32, gradients that are not float16/bfloat16/float32, subclasses that
override ``update_step``, several replicas, and any place the native op
cannot run (library missing, not on the CPU, XLA).
"""

import keras
import tensorflow as tf

from lossscale import _compat, _step
from lossscale import ops as native_ops

_GRAD_DTYPES = (tf.float16, tf.bfloat16, tf.float32)

# The inner optimizers the fused kernels reproduce, by the class whose
# update_step they implement.
_FAMILIES = (
    (keras.optimizers.AdamW, "adam"),
    (keras.optimizers.Adam, "adam"),
    (keras.optimizers.SGD, "sgd"),
)


def family(inner):
    """``"sgd"``, ``"adam"`` or None: the fused kernel that reproduces ``inner``."""
    for cls, name in _FAMILIES:
        if isinstance(inner, cls):
            # A subclass with its own update rule is not the stock one.
            if type(inner).update_step is not cls.update_step:
                return None
            return name
    return None


def static_reason(inner):
    """Why ``inner``'s configuration keeps the step off the fused path, or None."""
    if family(inner) is None:
        return (f"the inner optimizer ({type(inner).__name__}) is not a stock SGD, Adam "
                "or AdamW")
    for attr in ("clipnorm", "clipvalue", "global_clipnorm"):
        if getattr(inner, attr, None) is not None:
            return f"the inner optimizer sets {attr}"
    if getattr(inner, "use_ema", False):
        return "the inner optimizer uses EMA"
    if getattr(inner, "gradient_accumulation_steps", None):
        return "the inner optimizer accumulates gradients"
    if getattr(inner, "loss_scale_factor", None) is not None:
        return "the inner optimizer sets loss_scale_factor"
    for attr in ("beta_1", "beta_2", "epsilon", "momentum"):
        value = getattr(inner, attr, 0.0)
        if callable(value) or isinstance(value, (tf.Tensor, tf.Variable)):
            return f"the inner optimizer's {attr} is not a number"
    return None


def step_reason(inner, grads, variables):
    """Why this step (these gradients and variables) cannot be fused, or None."""
    reason = static_reason(inner)
    if reason is not None:
        return reason
    replica_context = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and (
            replica_context is None or replica_context.num_replicas_in_sync > 1):
        return "a tf.distribute strategy with several replicas"
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if not pairs:
        return "no gradients"
    devices = []
    for g, v in pairs:
        if isinstance(g, tf.IndexedSlices):
            return f"the gradient of {v.name} is sparse (IndexedSlices)"
        if getattr(v, "overwrite_with_gradient", False):
            return f"{v.name} is overwritten with its gradient"
        if getattr(v, "constraint", None) is not None:
            return f"{v.name} has a constraint"
        if tf.as_dtype(v.dtype) != tf.float32:
            return f"{v.name} is {tf.as_dtype(v.dtype).name}, not float32"
        if tf.as_dtype(g.dtype) not in _GRAD_DTYPES:
            return f"the gradient of {v.name} is {tf.as_dtype(g.dtype).name}"
        devices.append(native_ops.device_of(_step.tf_variable(v)))
        devices.append(native_ops.device_of(g))
    if native_ops.native_library_for(devices) is None:
        status = native_ops.native_available()
        if not status:
            return f"the native op library is not available ({status.reason})"
        return "a tensor is not on the CPU, or XLA is compiling"
    return None


def _grappler_reassociates_products():
    """Whether the stock step built here will have ``var * wd * lr``
    reordered to ``var * (wd * lr)``: in a graph that TensorFlow's graph
    optimizer rewrites (its arithmetic optimizer minimises broadcasts in
    chains of multiplies), not eagerly."""
    if tf.executing_eagerly():
        return False
    options = tf.config.optimizer.get_experimental_options()
    return (not options.get("disable_meta_optimizer", False)
            and options.get("arithmetic_optimization", True))


def _decay_form(inner, variable, reassociated):
    """The core's ls_decay for ``variable``: 0 none, 1 op by op, 2 reordered."""
    if inner.weight_decay is None or not _compat.uses_weight_decay(inner, variable):
        return 0
    # A one-element variable has nothing to broadcast: the graph optimizer
    # leaves its product alone.
    size = 1
    for d in variable.shape:
        size *= int(d)
    return 2 if reassociated and size > 1 else 1


def _handle(v):
    return _step.tf_variable(v).handle


class Scalars:
    """The step's scalars, computed as Keras computes them, and the checks
    that must pass before any state moves."""

    def __init__(self, inner):
        name = inner.name
        lr = tf.cast(inner.learning_rate, tf.float32)
        self.checks = [
            tf.debugging.assert_all_finite(
                lr, f"{name}: the learning rate is not finite; no variable was changed"),
            tf.debugging.assert_greater_equal(
                lr, tf.constant(0.0, tf.float32),
                message=f"{name}: the learning rate is negative; no variable was changed"),
        ]
        self.learning_rate = lr
        wd = inner.weight_decay
        self.weight_decay = tf.constant(0.0 if wd is None else float(wd), tf.float32)
        self.alpha = None
        if family(inner) == "adam":
            # Keras' Adam.update_step, scalars only.
            local_step = tf.cast(inner.iterations + 1, tf.float32)
            beta_1_power = tf.pow(tf.cast(inner.beta_1, tf.float32), local_step)
            beta_2_power = tf.pow(tf.cast(inner.beta_2, tf.float32), local_step)
            self.alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)


def apply(inner, grads, variables, scalars, *, scale, unscale, should_apply,
          advance_iterations_always=False):
    """The fused step: when ``should_apply`` (a bool tensor), ``inner``'s
    update of ``variables`` by ``grads`` unscaled by ``scale`` — ``"divide"``
    (Keras 3), ``"multiply"`` (TensorFlow 2.4) or ``"none"`` — and
    ``iterations`` advanced; when not, nothing changes.  ``scalars`` is the
    step's ``Scalars``, made before the loss scale moved; ``step_reason``
    must have said None for these arguments.  With
    ``advance_iterations_always`` a skipped step advances ``iterations`` too,
    as TensorFlow 2.4's optimizer did."""
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    grads = [tf.convert_to_tensor(g) for g, _ in pairs]
    variables = [v for _, v in pairs]
    reassociated = _grappler_reassociates_products()
    decay = [_decay_form(inner, v, reassociated) for v in variables]
    scale = tf.convert_to_tensor(scale, tf.float32)
    handles = [_handle(v) for v in variables]
    library = native_ops.native_library_for([])
    lr, wd = scalars.learning_rate, scalars.weight_decay
    if family(inner) == "sgd":
        momentum = float(inner.momentum)
        momentums = [_handle(m) for m in _compat.optimizer_slots(inner, "momentum", variables)] \
            if momentum != 0 else []
        library.loss_scale_apply_sgd(
            should_apply, handles, momentums, grads, scale, lr, wd,
            momentum=momentum, nesterov=bool(inner.nesterov), decay=decay, unscale=unscale)
    else:
        v_hat = [_handle(s) for s in _compat.optimizer_slots(inner, "v_hat", variables)] if inner.amsgrad else []
        library.loss_scale_apply_adam(
            should_apply, handles, [_handle(s) for s in _compat.optimizer_slots(inner, "m", variables)],
            [_handle(s) for s in _compat.optimizer_slots(inner, "v", variables)], v_hat, grads, scale, lr,
            scalars.alpha, wd, one_minus_beta_1=1 - inner.beta_1,
            one_minus_beta_2=1 - inner.beta_2, epsilon=float(inner.epsilon), decay=decay,
            unscale=unscale)
    iterations = _compat.optimizer_iterations(inner)
    if advance_iterations_always:
        iterations.assign_add(1)
    else:
        iterations.assign_add(tf.cast(should_apply, iterations.dtype))
