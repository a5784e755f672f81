"""Keras 3's loss-scale optimizer with its hot path on the native ops.

``LossScaleOptimizer`` is a drop-in for ``keras.optimizers.LossScaleOptimizer``
on the TensorFlow backend, and a subclass of it, so ``Model.compile`` does not
wrap it a second time.  It has the same constructor, the same variables
(``step_counter`` then ``dynamic_scale``, created by the same ``build``), the
same ``scale_loss``, config and ``iterations``, and its ``apply`` takes
*scaled* gradients as the stock one does.  With the same arguments it leaves
every variable, the scale, the counter and ``iterations`` bit-identical to
the stock optimizer, step for step, overflow steps included.  What differs is
the cost of a step: the finite check and the unscale of the whole gradient
list are one native op, and the scale update is another, instead of three ops
per gradient and a graph of ``cond``s.

Exactness notes, each checked against the stock optimizer in the tests:

* Stock Keras checks the *scaled* gradients and unscales by dividing,
  ``g / scale``, in the dtype ``result_type(g, float32)``: float16 and
  bfloat16 gradients come out float32.  The native op multiplies by
  ``1 / scale`` in the gradient's own dtype.  Both give the same bits when
  the scale is a power of two whose reciprocal is a normal float32 (2**-126
  to 2**126), and only then.  The op, asked to divide, tests the scale
  itself at run time: any other scale (``initial_scale=1000.``, a scale
  grown past 2**126, one assigned by hand) gets TensorFlow's division in the
  same op, so the graph has no ``cond`` between the two.  Gradients are
  promoted to the stock result dtype first.
* Under ``MirroredStrategy`` the stock optimizer trusts the first replica's
  finite flag; here the flags of all replicas are combined, so an overflow on
  any replica skips the step everywhere (the stock one then applies the
  non-finite gradients).  Where all replicas agree both give the same bits.

With ``loss_scale=`` a ``LossScale`` (``FixedLossScale``, ``DynamicLossScale``
with its extensions) the optimizer follows that object instead: its
variables are the optimizer's loss-scale state, the gradients are unscaled
as TensorFlow 2.4 did (times ``1 / scale``, dtype kept), checked after
unscaling, and the object's rule advances the scale.
"""

import numbers

import keras
import tensorflow as tf
from keras.src.utils import tracking

from lossscale import _fused_step
from lossscale import loss_scale as loss_scale_module
from lossscale import ops as native_ops

__all__ = ["LossScaleOptimizer"]

_StockLossScaleOptimizer = keras.optimizers.LossScaleOptimizer

# The step is written for graph mode as it is; AutoGraph would only re-trace
# it (and the loader below it) through its converter.
_plain_python = tf.autograph.experimental.do_not_convert

_DEFAULT_INITIAL_SCALE = 2.0**15
_FLOAT32_MAX = 3.4028234663852886e38
_DEFAULT_GROWTH_STEPS = 2000

def _promote(grad):
    """``grad`` in the dtype stock Keras divides it in: ``result_type(g, float32)``."""
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    dtype = keras.backend.result_type(values.dtype.name, "float32", float)
    if values.dtype == dtype:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)


def _cond(pred, true_fn, false_fn):
    """``tf.cond`` that also takes a Python bool; both branches return None."""
    if isinstance(pred, bool):
        (true_fn if pred else false_fn)()
        return

    def run(fn):
        def branch():
            fn()
        return branch

    tf.cond(pred, run(true_fn), run(false_fn))


def _as_float_flag(finite):
    # Strategies reduce numbers, not booleans.
    return tf.cast(finite, tf.float32)


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _loss_scale_variables(loss_scale):
    """The variables of a ``LossScale`` object, in its checkpoint order (by name)."""
    with tf.init_scope():
        graph_key = loss_scale_module._graph_key()  # pylint: disable=protected-access
    weights = getattr(loss_scale, "_weights", {}) or {}
    return [v for (_, g), v in sorted(weights.items(), key=lambda item: item[0][0])
            if g == graph_key]


def _update_copies(step, finite, variables):
    """``step(finite, *variables)`` on every copy of mirrored variables.

    Each copy is stepped on its own device with the copies of the other
    variables that live there, so the native op runs once per device.
    Returns ``finite`` (the rules apply the gradients exactly when finite).
    """
    first = variables[0]
    if not isinstance(first, tf.distribute.DistributedValues):
        return step(finite, *variables)
    if not tf.distribute.in_cross_replica_context():
        # A strategy without merge calls: every replica steps its own copy,
        # all from the same combined flag.
        # pylint: disable=protected-access
        return step(finite, *[None if v is None else v._get_on_device_or_primary()
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


def _check_constructor_arguments(inner_optimizer, initial_scale, dynamic_growth_steps):
    """Clear errors for what the stock optimizer would only trip over later."""
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"inner_optimizer must be a keras.optimizers.Optimizer, got "
                        f"{type(inner_optimizer).__name__}.")
    if isinstance(initial_scale, bool) or not isinstance(initial_scale, numbers.Real):
        raise ValueError(f"initial_scale must be a Python int or float, got {initial_scale!r}.")
    if not 0.0 < initial_scale <= _FLOAT32_MAX:  # False for NaN
        raise ValueError(f"initial_scale must be a positive finite float32, got "
                         f"{initial_scale!r}.")
    if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps,
                                                                numbers.Real):
        raise ValueError(f"dynamic_growth_steps must be an integer, got "
                         f"{dynamic_growth_steps!r}.")


def _is_gradient_like(grad):
    return isinstance(grad, (tf.Tensor, tf.IndexedSlices, tf.Variable, keras.Variable)) or (
        hasattr(grad, "dtype") and hasattr(grad, "shape"))


def _check_gradients(grads, trainable_variables, caller):
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


def _growth_steps_supported(steps):
    return (isinstance(steps, numbers.Integral) and not isinstance(steps, bool)
            and 1 <= steps <= 2**63 - 1)


@keras.saving.register_keras_serializable(package="lossscale")
class LossScaleOptimizer(_StockLossScaleOptimizer):
    """An optimizer that scales the loss dynamically to prevent underflow.

    A drop-in for ``keras.optimizers.LossScaleOptimizer`` (TensorFlow
    backend): wrap an optimizer, scale the loss with ``scale_loss``, hand the
    scaled gradients to ``apply``/``apply_gradients``.  Those are unscaled
    and checked; on any non-finite gradient the step is skipped (no variable
    changes, ``iterations`` does not advance) and the scale halves; after
    ``dynamic_growth_steps`` finite steps in a row it doubles.

    Args:
      inner_optimizer: The ``keras.optimizers.Optimizer`` to wrap.
      initial_scale: The initial loss scale.  Best high: a scale that is too
        high comes down far faster than one that is too low goes up.
      dynamic_growth_steps: Finite steps in a row after which the scale
        doubles.
      name: The optimizer's name.
      loss_scale: Keyword-only.  A ``lossscale.LossScale`` (or anything
        ``lossscale.get`` takes, except None) whose rule to follow instead of
        the Keras one; then ``initial_scale`` and ``dynamic_growth_steps``
        must stay at their defaults.  Create it (or this optimizer) under the
        ``tf.distribute`` strategy's scope, as its variables are made with
        it.

    Besides the stock attributes: ``loss_scale`` (the current scale, a
    float32 tensor), ``loss_scale_object`` (the ``LossScale``, or None) and
    ``skipped_steps`` (a counter variable when the ``LossScale`` keeps one,
    else None).

    Unlike the stock optimizer, bad arguments fail at once: an
    ``inner_optimizer`` that is not a Keras optimizer (TypeError), an
    ``initial_scale`` that is not a positive finite float32 (ValueError); and
    ``apply``/``apply_gradients`` check that the gradients pair up with the
    variables (count, shape, a numeric dtype) before any state moves.
    """

    # TensorFlow 2.4 advanced `iterations` on a skipped step too; Keras 3
    # does not.
    _skipped_steps_advance_iterations = False

    def __init__(self, inner_optimizer, initial_scale=_DEFAULT_INITIAL_SCALE,
                 dynamic_growth_steps=_DEFAULT_GROWTH_STEPS, name=None, *,
                 loss_scale=None, fused=True, **kwargs):
        _check_constructor_arguments(inner_optimizer, initial_scale, dynamic_growth_steps)
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be True or False, got {fused!r}.")
        if loss_scale is not None:
            loss_scale = loss_scale_module.get(loss_scale)
            if not isinstance(loss_scale, loss_scale_module.LossScale):
                raise ValueError(f"loss_scale must be a lossscale.LossScale, got {loss_scale!r}.")
            if (initial_scale != _DEFAULT_INITIAL_SCALE
                    or dynamic_growth_steps != _DEFAULT_GROWTH_STEPS):
                raise ValueError(
                    "Pass either loss_scale or initial_scale/dynamic_growth_steps, not both: "
                    "the LossScale object carries its own initial scale and growth period.")
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)
        self._loss_scale_object = loss_scale
        self._fused = fused
        self._step_path = None
        if loss_scale is not None:
            # Reported as TensorFlow 2.4's optimizer reported them.
            dynamic = isinstance(loss_scale, loss_scale_module.DynamicLossScale)
            if dynamic:
                self.initial_scale = loss_scale.initial_loss_scale
                self.dynamic_growth_steps = loss_scale.increment_period
            elif isinstance(loss_scale, loss_scale_module.FixedLossScale):
                self.initial_scale = loss_scale._loss_scale_value  # pylint: disable=protected-access
                self.dynamic_growth_steps = None
            else:
                self.initial_scale = None
                self.dynamic_growth_steps = None

    # ------------------------------------------------------------------
    # State

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        if self._loss_scale_object is None:
            super().build(var_list)
            return
        # The LossScale's variables are the loss-scale state; listing them
        # with the optimizer's saves and restores them with it.
        for variable in _loss_scale_variables(self._loss_scale_object):
            self._variables.append(variable)
        self.inner_optimizer.build(var_list)
        super(_StockLossScaleOptimizer, self).build(var_list)

    @property
    def loss_scale_object(self):
        """The ``LossScale`` this optimizer follows, or None for the Keras rule."""
        return self._loss_scale_object

    @property
    def loss_scale(self):
        """The current loss scale, a scalar float32 tensor."""
        if self._loss_scale_object is not None:
            return self._loss_scale_object()
        if self.built:
            return tf.convert_to_tensor(_tf_variable(self.dynamic_scale))
        return tf.constant(self.initial_scale, tf.float32)

    @property
    def skipped_steps(self):
        """The variable counting skipped steps, when the ``LossScale`` keeps one."""
        return getattr(self._loss_scale_object, "skipped_steps", None)

    @property
    def fused(self):
        """Whether steps may take the fused native path (the ``fused`` argument)."""
        return self._fused

    @property
    def step_path(self):
        """Which path the optimizer step takes, and why: ``"fused (Adam)"``, or
        ``"stock: <reason>"`` for what the fused path does not do.  Set by the
        last step traced or run; before any step, what the configuration
        alone decides."""
        if self._step_path is not None:
            return self._step_path
        return self._describe_path(self._rule_reason() or _fused_step.static_reason(
            self.inner_optimizer))

    def _describe_path(self, reason):
        if reason is None:
            return f"fused ({type(self.inner_optimizer).__name__})"
        return f"stock: {reason}"

    def _rule_reason(self):
        """Why the loss-scale rule keeps steps off the fused path, or None."""
        if not self._fused:
            return "fused=False"
        ls = self._loss_scale_object
        if ls is None:
            return None if self._keras_rule_supported() else "a growth period the native rule does not take"
        if isinstance(ls, loss_scale_module.FixedLossScale):
            return None
        if isinstance(ls, loss_scale_module.DynamicLossScale):
            # The fused check reads the scaled gradients; TensorFlow 2.4
            # checks the unscaled ones.  The same verdict while the scale
            # cannot drop below 1 (then g / scale cannot overflow).
            if ls.min_loss_scale >= 1.0:
                return None
            return "a DynamicLossScale whose min_loss_scale is below 1"
        return f"a custom LossScale ({type(ls).__name__})"

    def _fused_reason(self, grads, trainable_variables):
        reason = self._rule_reason() or _fused_step.step_reason(
            self.inner_optimizer, grads, trainable_variables)
        self._step_path = self._describe_path(reason)
        return reason

    def _fused_apply(self, grads, trainable_variables, unscale=None):
        """The step on the fused path: the read-only check of the gradients
        (as they come, in the graph beside their producers), the rule, then
        one native update pass that unscales on the fly."""
        ls = self._loss_scale_object
        if unscale is None:
            unscale = "divide" if ls is None else "multiply"
        # The scale the gradients were made with: read before the rule moves it.
        scale = tf.convert_to_tensor(
            _tf_variable(self.dynamic_scale) if ls is None else ls(), tf.float32)
        scalars = _fused_step.Scalars(self.inner_optimizer)
        finite = native_ops.all_finite_grouped([g for g in grads if g is not None])
        # A bad learning rate fails before the loss scale moves.
        with tf.control_dependencies(scalars.checks):
            finite = tf.identity(finite)
        should_apply = self._advance_scale(finite, None)
        if isinstance(should_apply, bool):
            should_apply = tf.constant(should_apply)
        _fused_step.apply(self.inner_optimizer, grads, trainable_variables, scalars,
                          scale=scale, unscale=unscale, should_apply=should_apply,
                          advance_iterations_always=self._skipped_steps_advance_iterations)

    @_plain_python
    def scale_loss(self, loss):
        if self._loss_scale_object is None:
            return super().scale_loss(loss)
        return keras.ops.multiply(loss, self._loss_scale_object())

    # ------------------------------------------------------------------
    # The step

    def _keras_rule_supported(self):
        return _growth_steps_supported(self.dynamic_growth_steps)

    @_plain_python
    def check_finite(self, grads):
        return native_ops.all_finite([g for g in grads if g is not None])

    def _unscale_and_check(self, grads, trainable_variables):
        """Unscaled gradients (None and overwrite-with-gradient ones as they
        came) and whether every gradient is finite, as a bool tensor."""
        tvs = trainable_variables or self._trainable_variables
        positions, passthrough = [], []
        for i, (g, v) in enumerate(zip(grads, tvs)):
            if g is None:
                continue
            if self._overwrite_variable_with_gradient(v):
                passthrough.append(g)
            else:
                positions.append(i)

        if self._loss_scale_object is not None:
            # TensorFlow 2.4: times 1/scale in the gradient's dtype, checked
            # after unscaling.
            unscaled, finite = native_ops.unscale_and_check(
                [grads[i] for i in positions], self._loss_scale_object())
        else:
            # Keras 3: divided by the scale in result_type(g, float32),
            # checked before unscaling.
            scale = tf.convert_to_tensor(_tf_variable(self.dynamic_scale))
            unscaled, finite = native_ops.unscale_and_check(
                [_promote(grads[i]) for i in positions], scale, check_inputs=True, divide=True)

        if passthrough:
            finite = tf.logical_and(finite, native_ops.all_finite(passthrough))
        out = list(grads)
        for i, g in zip(positions, unscaled):
            out[i] = g
        return out, finite

    def _advance_scale(self, finite, unscaled):
        """Steps the loss scale; returns should_apply.

        ``finite`` is the flag of every replica combined.  Under a strategy
        that uses merge calls this runs in the cross-replica context and
        steps every copy of the variables.
        """
        ls = self._loss_scale_object
        if ls is None:
            def keras_rule(is_finite, scale, counter):
                return native_ops.update_loss_scale(
                    is_finite, scale, counter, rule="keras3",
                    increment_period=int(self.dynamic_growth_steps), multiplier=2.0)

            return _update_copies(keras_rule, finite, (
                _tf_variable(self.dynamic_scale), _tf_variable(self.step_counter)))
        if isinstance(ls, loss_scale_module.FixedLossScale):
            return True
        if isinstance(ls, loss_scale_module.DynamicLossScale):
            # pylint: disable=protected-access
            return _update_copies(ls._update_state, finite, (
                ls._current_loss_scale, ls._num_good_steps, ls._overflow_run,
                ls._skipped_steps))
        # Any other LossScale: its own update, on the unscaled gradients.
        _, should_apply = ls.update(unscaled)
        return should_apply

    def _skip_step(self):
        if self._skipped_steps_advance_iterations:
            self.inner_optimizer._iterations.assign_add(1)  # pylint: disable=protected-access

    def apply(self, grads, trainable_variables=None):
        if isinstance(grads, (tf.Tensor, tf.IndexedSlices, str, bytes)) or not hasattr(
                grads, "__iter__"):
            raise TypeError(f"apply: grads must be a list of gradients, got "
                            f"{type(grads).__name__}.")
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            _check_gradients(grads, trainable_variables, "apply")
        elif self.built and grads:
            _check_gradients(grads, self._trainable_variables, "apply")
        return super().apply(grads, trainable_variables)

    def apply_gradients(self, grads_and_vars):
        pairs = list(grads_and_vars)
        if not pairs:
            raise ValueError("apply_gradients: grads_and_vars is empty; expected "
                             "(gradient, variable) pairs.")
        for i, pair in enumerate(pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"apply_gradients: item {i} is a {type(pair).__name__}, not "
                                "a (gradient, variable) pair.")
        grads, trainable_variables = zip(*pairs)
        self.apply(list(grads), list(trainable_variables))
        # As the stock one: this optimizer's own counter, for compat with tf.keras.
        return self._iterations

    @classmethod
    def from_config(cls, config, custom_objects=None):
        if not isinstance(config, dict) or "inner_optimizer" not in config:
            raise ValueError(f"{cls.__name__}.from_config: config must be a dict with an "
                             f"'inner_optimizer' entry, got {config!r}.")
        return super().from_config(dict(config), custom_objects=custom_objects)

    @_plain_python
    def _common_apply(self, grads, trainable_variables=None):
        if self._loss_scale_object is None and not self._keras_rule_supported():
            # A growth period the native rule does not take: stock steps.
            super()._common_apply(grads, trainable_variables=trainable_variables)
            return
        unscaled, finite = self._unscale_and_check(grads, trainable_variables)
        replica_context = tf.distribute.get_replica_context()
        if (tf.distribute.has_strategy() and replica_context is not None
                and replica_context.num_replicas_in_sync > 1):
            # No merge call (e.g. MultiWorkerMirroredStrategy): combine the
            # replicas' flags so that all of them skip or apply together.
            total = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, _as_float_flag(finite))
            finite = tf.equal(total, replica_context.num_replicas_in_sync)
        should_apply = self._advance_scale(finite, unscaled)

        def apply():
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

        _cond(should_apply, apply, self._skip_step)

    @_plain_python
    def _tf_apply(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        variables = list(trainable_variables or self._trainable_variables)
        if self._fused_reason(grads, variables) is None:
            self._fused_apply(list(grads), variables)
            return
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._common_apply(grads, trainable_variables=trainable_variables)
            return
        if self._loss_scale_object is None and not self._keras_rule_supported():
            super()._tf_apply(grads, trainable_variables=trainable_variables)
            return
        tf.distribute.get_replica_context().merge_call(
            self._apply_cross_replica, args=(grads, trainable_variables))

    @_plain_python
    def _apply_cross_replica(self, distribution, grads, trainable_variables):
        def unscale_and_check(grads):
            unscaled, finite = self._unscale_and_check(grads, trainable_variables)
            return unscaled, _as_float_flag(finite)

        unscaled, finite_per_replica = distribution.extended.call_for_each_replica(
            unscale_and_check, args=(grads,))
        total = distribution.reduce(tf.distribute.ReduceOp.SUM, finite_per_replica, axis=None)
        finite = tf.equal(total, distribution.num_replicas_in_sync)
        should_apply = self._advance_scale(finite, unscaled)

        def apply():
            # A cond branch in the cross-replica context: the inner
            # optimizer's own merge call would not be allowed in a replica
            # context under a cond.
            distribution.extended.call_for_each_replica(
                lambda g: self.inner_optimizer.apply(
                    g, trainable_variables=trainable_variables),
                args=(unscaled,))

        _cond(should_apply, apply, self._skip_step)

    # ------------------------------------------------------------------
    # Config

    def get_config(self):
        config = super().get_config()
        if not self._fused:
            config["fused"] = False
        if self._loss_scale_object is not None:
            del config["initial_scale"]
            del config["dynamic_growth_steps"]
            config["loss_scale"] = loss_scale_module.serialize(self._loss_scale_object)
        return config
