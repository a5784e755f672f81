"""The loss-scale optimizer's step, apart from the optimizer: its two rules and
what both optimizers share.

A rule is what changes between ``LossScaleOptimizer()`` (the Keras 3 rule,
``KerasRule``) and ``LossScaleOptimizer(loss_scale=...)`` (a ``LossScale``
object's rule, ``LossScaleObjectRule``); the optimizers hold one and never
ask which.  A step asks its rule, in order:

* ``scale()`` -- the current loss scale, a float32 scalar tensor;
* ``unscale_and_check(grads)`` -- the unscaled gradients and the finite flag,
  by the rule's recipe: ``divide`` (Keras 3: ``g / scale`` in float32,
  gradients promoted by ``prepare``) or not (times ``1 / scale`` in the
  gradient's dtype), and ``check_scaled`` (the flag describes the scaled
  gradients, as Keras 3 checks them) or not (the unscaled ones);
* ``advance(finite, unscaled)`` -- step the scale from the flag of every
  replica combined, on every mirrored copy of its variables; returns
  should_apply (a bool or a bool tensor).  A rule the native update op
  runs says so with ``scale_config()`` (its ``ScaleConfig``) and
  ``update_variables()`` (``scale, counter, overflow_run, skipped``, None
  where absent), which is all ``advance`` uses then: ``unscaled`` is read
  only by a ``LossScale`` of the user's own, whose ``update`` takes them.

Besides the rules: ``update_copies`` (a state step on every copy of
mirrored variables), ``cond``, ``check_gradients`` and the other small
pieces ``optimizer`` and ``experimental`` both use.
"""

import keras
import tensorflow as tf

from lossscale import _compat
from lossscale import loss_scale as loss_scale_module
from lossscale import ops as native_ops
from lossscale._config import keras_rule_config

__all__ = ["KerasRule", "LossScaleObjectRule", "update_copies", "cond", "as_float_flag", "all_replicas_finite",
           "tf_variable", "check_gradients", "plain_python"]

# The step is written for graph mode as it is; AutoGraph would only re-trace
# it (and the loader below it) through its converter.
plain_python = tf.autograph.experimental.do_not_convert


def tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def as_float_flag(finite):
    # Strategies reduce numbers, not booleans.
    return tf.cast(finite, tf.float32)


def all_replicas_finite(context, finite):
    """Whether ``finite`` holds on every replica of the replica context
    ``context``: one all-reduce of the flags, the same answer on each."""
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, as_float_flag(finite))
    return tf.equal(total, context.num_replicas_in_sync)


def cond(pred, true_fn, false_fn):
    """``tf.cond`` that also takes a Python bool; both branches return None."""
    if isinstance(pred, bool):
        (true_fn if pred else false_fn)()
        return

    def run(fn):
        def branch():
            fn()
        return branch

    tf.cond(pred, run(true_fn), run(false_fn))


def update_copies(step, finite, variables):
    """``step(finite, *variables)`` on every copy of mirrored variables.

    Each copy is stepped on its own device with the copies of the other
    variables that live there, so the native op runs once per device.
    Returns ``finite`` (the rules apply the gradients exactly when finite).
    """
    first = variables[0]
    if not isinstance(first, tf.distribute.DistributedValues):
        return step(finite, *variables)
    if not tf.distribute.in_cross_replica_context():
        # In a replica context (a strategy without merge calls, or the
        # fused step): every replica steps its own copy, all from the same
        # combined flag.
        return step(finite, *[None if v is None else _compat.on_device_or_primary(v)
                              for v in variables])

    def local(copy, *others):
        on_device = [None if v is None else _copy_on(v, copy.device) for v in others]
        return step(finite, copy, *on_device)

    tf.distribute.get_strategy().extended.update(first, local, args=variables[1:], group=False)
    return finite


def _copy_on(variable, device):
    if not isinstance(variable, tf.distribute.DistributedValues):
        return variable
    for copy in variable.values:
        if copy.device == device:
            return copy
    raise ValueError(f"no copy of {variable.name} on {device}")


# ------------------------------------------------------------------ rules

class _Rule:
    """The interface both rules implement (see the module docstring)."""

    divide = False
    check_scaled = False

    def prepare(self, grad):
        """``grad`` in the dtype the rule unscales it in."""
        return grad

    def scale(self):
        """The current loss scale, a float32 scalar tensor."""
        raise NotImplementedError

    def scale_loss(self, loss):
        """``loss`` times the scale, as ``LossScaleOptimizer.scale_loss``."""
        raise NotImplementedError

    def unscale_and_check(self, grads, scale=None):
        """``(unscaled, finite)`` for a list of gradients (no None), one native
        op; by ``scale`` when given (the scale already read), else ``scale()``."""
        return native_ops.unscale_and_check([self.prepare(g) for g in grads],
                                            self.scale() if scale is None else scale,
                                            check_inputs=self.check_scaled, divide=self.divide)

    def scale_config(self):
        """The ``ScaleConfig`` the native update op steps by, or None when the
        scale is not stepped by it."""
        return None

    def update_variables(self):
        """``(scale, counter, overflow_run, skipped)`` for the update op."""
        raise NotImplementedError

    def advance(self, finite, unscaled=None):
        """Steps the scale by ``scale_config()``; returns should_apply."""
        del unscaled
        config = self.scale_config()

        def step(is_finite, scale, counter, overflow_run=None, skipped=None):
            return native_ops.update_with_config(config, is_finite, scale, counter,
                                                 overflow_run=overflow_run, skipped=skipped)

        return update_copies(step, finite, self.update_variables())

    def native_step_supported(self):
        """False when the stock optimizer must take the step instead."""
        return True

    # How the fused step (``lossscale._fused``) unscales under this
    # rule: "divide" (Keras 3) or "multiply" (TensorFlow 2.4).
    fused_unscale = "multiply"

    def fused_reason(self):
        """Why this rule keeps steps off the fused path, or None."""
        return None if self.native_step_supported() else \
            "a growth period the native rule does not take"

    def checkpointed_variables(self):
        """The variables the optimizer saves as its loss-scale state, or None
        when the stock ``build`` makes them."""
        return None


class KerasRule(_Rule):
    """Keras 3's rule, on the optimizer's ``dynamic_scale`` and ``step_counter``.

    The scale doubles after ``dynamic_growth_steps`` finite steps and halves
    on a non-finite one; gradients are divided by the scale in
    ``result_type(g, float32)`` and checked before unscaling, as stock Keras.
    """

    divide = True
    check_scaled = True
    fused_unscale = "divide"

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def prepare(self, grad):
        """``grad`` in the dtype stock Keras divides it in: ``result_type(g, float32)``."""
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        dtype = keras.backend.result_type(values.dtype.name, "float32", float)
        if values.dtype == dtype:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
        return tf.cast(grad, dtype)

    def scale(self):
        if self._optimizer.built:
            return tf.convert_to_tensor(tf_variable(self._optimizer.dynamic_scale))
        return tf.constant(self._optimizer.initial_scale, tf.float32)

    def scale_loss(self, loss):
        return keras.optimizers.LossScaleOptimizer.scale_loss(self._optimizer, loss)

    def scale_config(self):
        # Read at every step: the stock optimizer reads the attribute then too.
        return keras_rule_config(self._optimizer.dynamic_growth_steps)

    def native_step_supported(self):
        return self.scale_config() is not None

    def update_variables(self):
        return (tf_variable(self._optimizer.dynamic_scale),
                tf_variable(self._optimizer.step_counter), None, None)


class LossScaleObjectRule(_Rule):
    """The rule of a ``LossScale`` object, on its own variables.

    Gradients are multiplied by ``1 / scale`` in their own dtype and checked
    after unscaling, as TensorFlow 2.4 did; a ``DynamicLossScale`` steps by
    its rule (every extension included), a ``FixedLossScale`` never moves,
    and any other ``LossScale`` runs its own ``update``.
    """

    def __init__(self, loss_scale):
        self.loss_scale = loss_scale

    def scale(self):
        return self.loss_scale()

    def scale_loss(self, loss):
        return keras.ops.multiply(loss, self.loss_scale())

    def scale_config(self):
        if isinstance(self.loss_scale, loss_scale_module.DynamicLossScale):
            return self.loss_scale.scale_config
        return None

    def update_variables(self):
        if self.scale_config() is None:
            raise NotImplementedError(f"{self.loss_scale!r} is not stepped by the update op")
        return self.loss_scale.state_variables

    def advance(self, finite, unscaled=None):
        if self.scale_config() is not None:
            return super().advance(finite)
        if isinstance(self.loss_scale, loss_scale_module.FixedLossScale):
            return True
        # Any other LossScale: its own update, on the unscaled gradients.
        _, should_apply = self.loss_scale.update(unscaled)
        return should_apply

    def fused_reason(self):
        ls = self.loss_scale
        if isinstance(ls, loss_scale_module.FixedLossScale):
            return None
        if isinstance(ls, loss_scale_module.DynamicLossScale):
            # The fused step checks the gradients as they come (scaled);
            # TensorFlow 2.4 checks them unscaled.  The verdicts agree while
            # the scale cannot drop below 1: then g / scale cannot overflow.
            if ls.min_loss_scale >= 1.0:
                return None
            return "a DynamicLossScale whose min_loss_scale is below 1"
        return f"a LossScale of its own kind ({type(ls).__name__})"

    def checkpointed_variables(self):
        with tf.init_scope():
            return list(self.loss_scale.tracked_weights().values())


# ------------------------------------------------------- gradient checks

def _is_gradient_like(grad):
    return isinstance(grad, (tf.Tensor, tf.IndexedSlices, tf.Variable, keras.Variable)) or (
        hasattr(grad, "dtype") and hasattr(grad, "shape"))


def check_gradients(grads, trainable_variables, caller):
    """Every gradient fits its variable: checked before any state moves, so a
    mistake raises with the optimizer, the scale and every variable as they were."""
    if len(grads) != len(trainable_variables):
        raise ValueError(f"{caller}: got {len(grads)} gradients for "
                         f"{len(trainable_variables)} variables; they must pair up one to one.")
    for i, (g, v) in enumerate(zip(grads, trainable_variables)):
        if g is None:
            continue
        if not _is_gradient_like(g):
            try:
                g = tf.convert_to_tensor(g)
            except (TypeError, ValueError):
                raise TypeError(f"{caller}: gradient {i} is a {type(g).__name__}, not a "
                                "tensor, IndexedSlices or None.") from None
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        dtype = tf.as_dtype(values.dtype)
        if not (dtype.is_floating or dtype.is_integer):
            raise TypeError(f"{caller}: gradient {i} has dtype {dtype.name}; expected a "
                            "floating-point (or integer) gradient.")
        var_shape = tf.TensorShape(v.shape)
        grad_shape = tf.TensorShape(values.shape)
        if isinstance(g, tf.IndexedSlices):
            compatible = (grad_shape.rank is None or var_shape.rank is None
                          or grad_shape[1:].is_compatible_with(var_shape[1:]))
        else:
            compatible = grad_shape.is_compatible_with(var_shape)
        if not compatible:
            raise ValueError(f"{caller}: gradient {i} has shape {grad_shape}, its variable "
                             f"{getattr(v, 'name', i)!r} has shape {var_shape}.")
