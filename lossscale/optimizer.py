"""Keras 3's loss-scale optimizer with its hot path on the native ops.

``LossScaleOptimizer`` is a drop-in for ``keras.optimizers.LossScaleOptimizer``
on the TensorFlow backend, and a subclass of it, so ``Model.compile`` does not
wrap it a second time.  It has the same constructor, the same variables
(``step_counter`` then ``dynamic_scale``, created by the same ``build``), the
same ``scale_loss``, config and ``iterations``, and its ``apply`` takes
*scaled* gradients as the stock one does.  With the same arguments it leaves
every variable, the scale, the counter and ``iterations`` bit-identical to
the stock optimizer, step for step, overflow steps included.  What differs is
the cost of a step.

For a stock inner optimizer of a fused family (``SGD``, ``Adam``,
``AdamW``, ``RMSprop``, ``Adagrad``, ``Adamax``, ``Nadam``, ``Lion``,
``Adafactor``: ``lossscale._fused.FAMILIES``) the step is fused: a
read-only finite check of the scaled gradients (one small native op per large gradient, inside
the graph that makes them, so each gradient is read while still in
cache), the scale
update (one native op), then ONE native op that unscales every gradient on
the fly and applies the inner optimizer's update to every variable and
slot, in one pass over memory: no unscaled copy of the gradients, no op per
variable.  Its arithmetic is Keras' float32 op by op, in Keras' order, so
variables and slots come out bit-identical.  An inner optimizer's clipping
(``clipnorm``, ``clipvalue``, ``global_clipnorm``) happens in that same pass;
its EMA and gradient accumulation run around that op with Keras' own ops,
on Keras' schedule.  A sparse gradient (an ``Embedding``'s
``IndexedSlices``) fuses for Adam, AdamW, Adamax, Lion and SGD with
momentum: its values are unscaled, the terms Keras densifies are summed per
row by TensorFlow's own conversion, and a second native op applies them.
Adafactor, whose update takes means over each variable, runs its own op:
three streaming passes over each gradient, its means in the order of
TensorFlow's Mean kernel.
``step_path`` says which path a step took and why; ``fused=False`` turns it
off.  Anything the fused path does not do (constraints, sparse gradients of
the other families, a strategy other than Mirrored or MultiWorkerMirrored, a
non-CPU device, XLA...) takes the path
below: the finite check and the unscale of the whole gradient list are one
native op, and the scale update is another, instead of three ops per
gradient and a graph of ``cond``s; then the inner optimizer's own step.

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
* Stock Keras checks a sparse gradient by densifying its finite flags with
  ``tensor_scatter_nd_update``, which keeps only the last slice's flag of a
  row indexed twice: a NaN slice followed by a finite one of the same row
  passes and stock applies the NaN.  Here every slice is checked (on the
  fused path as on the stock one), so that step is skipped.
* Under ``MirroredStrategy`` the stock optimizer trusts the first replica's
  finite flag; here an overflow on any replica skips the step everywhere
  (the stock one then applies the non-finite gradients).  Where all
  replicas agree both give the same bits.  The fused step checks the
  all-reduced sums (no collective of its own), so it also skips where every
  replica's gradients are finite and their sum is not, which stock applies.

With ``loss_scale=`` a ``LossScale`` (``FixedLossScale``, ``DynamicLossScale``
with its extensions) the optimizer follows that object instead: its
variables are the optimizer's loss-scale state, the gradients are unscaled
as TensorFlow 2.4 did (times ``1 / scale``, dtype kept), checked after
unscaling, and the object's rule advances the scale.  Which of the two rules
a step follows is one object the optimizer holds (``lossscale._step``).
"""

import inspect

import keras
import tensorflow as tf

from lossscale import _compat, _step, _which_keras
from lossscale import _fused
from lossscale import loss_scale as loss_scale_module
from lossscale import ops as native_ops
from lossscale._config import (DEFAULT_GROWTH_STEPS, DEFAULT_INITIAL_SCALE,
                               check_keras_rule_arguments)

__all__ = ["LossScaleOptimizer", "inner_optimizer_from_config", "tensorflow_2_config"]

_StockLossScaleOptimizer = keras.optimizers.LossScaleOptimizer

# Keras' defaults (its initial scale is a float).
_DEFAULT_INITIAL_SCALE = float(DEFAULT_INITIAL_SCALE)
_DEFAULT_GROWTH_STEPS = DEFAULT_GROWTH_STEPS


def _check_constructor_arguments(inner_optimizer, initial_scale, dynamic_growth_steps):
    """Clear errors for what the stock optimizer would only trip over later."""
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        hint = ""
        if _which_keras.is_tf_keras_object(inner_optimizer):
            hint = (f" It is a {_which_keras.KERAS_NAME} optimizer: with TF_USE_LEGACY_KERAS=1 "
                    "lossscale.LossScaleOptimizer is the tf_keras one, and "
                    "lossscale.experimental.LossScaleOptimizer takes either Keras.")
        raise TypeError(f"inner_optimizer must be a Keras 3 keras.optimizers.Optimizer, got "
                        f"{type(inner_optimizer).__name__}.{hint}")
    check_keras_rule_arguments(initial_scale, dynamic_growth_steps)


def inner_optimizer_from_config(config, custom_objects=None):
    """The Keras 3 optimizer of a serialized optimizer: Keras 3's form, or
    TensorFlow 2.x's (Keras 2) ``{'class_name': 'SGD', 'config': {...}}``;
    an optimizer is itself."""
    if isinstance(config, keras.optimizers.Optimizer):
        return config
    optimizer = _keras2_optimizer(config, custom_objects)
    if optimizer is None:
        optimizer = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
    return optimizer


def tensorflow_2_config(config, custom_objects=None):
    """``(inner_optimizer, loss_scale)`` of a config TensorFlow 2.3 or 2.4's
    ``tf.keras.mixed_precision`` loss-scale optimizer wrote, or None for any
    other config.

    TensorFlow 2.3 wrote ``{'optimizer', 'loss_scale'}``, and TensorFlow 2.4
    read it refusing a ``DynamicLossScale`` whose multiplier is not 2
    (``loss_scale.from_tensorflow_2_3_optimizer_config``); TensorFlow 2.4's
    own form is ``{'inner_optimizer', 'dynamic', 'initial_scale',
    'dynamic_growth_steps'}``, TensorFlow 2.4's rule with multiplier 2.  The
    optimizer inside is a Keras 2 one (``inner_optimizer_from_config``).
    """
    if not isinstance(config, dict):
        return None
    if set(config) == {"optimizer", "loss_scale"}:
        loss_scale = loss_scale_module.from_tensorflow_2_3_optimizer_config(config["loss_scale"])
    elif "inner_optimizer" in config and "dynamic" in config:
        if config["dynamic"]:
            loss_scale = loss_scale_module.DynamicLossScale(
                config.get("initial_scale", DEFAULT_INITIAL_SCALE),
                config.get("dynamic_growth_steps", DEFAULT_GROWTH_STEPS))
        else:
            loss_scale = loss_scale_module.FixedLossScale(config.get("initial_scale"))
    else:
        return None
    inner = config["optimizer"] if "optimizer" in config else config["inner_optimizer"]
    return inner_optimizer_from_config(inner, custom_objects), loss_scale


def _keras2_optimizer(config, custom_objects):
    """The Keras 3 optimizer of a TensorFlow 2.x (Keras 2) optimizer config,
    ``{'class_name': 'SGD', 'config': {...}}``, or None for any other form.

    Keras 2's ``decay`` (``lr / (1 + decay * iterations)``) becomes the same
    ``InverseTimeDecay`` schedule, as Keras 3 has no ``decay`` argument.
    """
    if not (isinstance(config, dict) and isinstance(config.get("config"), dict)
            and isinstance(config.get("class_name"), str)):
        return None
    module = config.get("module")
    if module is not None and not module.startswith("keras.optimizers.legacy") and (
            "decay" not in config["config"]):
        return None
    name = config["class_name"]
    cls = (custom_objects or {}).get(name) or getattr(keras.optimizers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
        raise ValueError(f"Unknown optimizer {name!r} in a TensorFlow 2.x optimizer config; "
                         f"pass its Keras 3 class in custom_objects.")
    arguments = dict(config["config"])
    decay = arguments.pop("decay", 0.0)
    rate = arguments.get("learning_rate",
                         inspect.signature(cls).parameters["learning_rate"].default)
    if isinstance(rate, dict):
        rate = keras.optimizers.schedules.deserialize(rate, custom_objects=custom_objects)
    if decay:
        if not isinstance(rate, (int, float)):
            raise ValueError(f"A TensorFlow 2.x optimizer config with both decay={decay} and a "
                             "learning-rate schedule has no Keras 3 equivalent.")
        rate = keras.optimizers.schedules.InverseTimeDecay(rate, decay_steps=1, decay_rate=decay)
    arguments["learning_rate"] = rate
    return cls(**arguments)


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
      fused: Keyword-only.  Whether steps may take the fused native path
        (default True); ``step_path`` says which path a step took.

    Besides the stock attributes: ``loss_scale`` (the current scale, a
    float32 tensor), ``loss_scale_object`` (the ``LossScale``, or None),
    ``skipped_steps`` (a counter variable when the ``LossScale`` keeps one,
    else None) and ``step_path`` (``"fused (Adam)"``, or ``"stock: <why
    not>"``).

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
        self._rule = (_step.KerasRule(self) if loss_scale is None
                      else _step.LossScaleObjectRule(loss_scale))
        self._fused = fused
        self._step_path = None
        if loss_scale is not None:
            # Reported as TensorFlow 2.4's optimizer reported them.
            dynamic = isinstance(loss_scale, loss_scale_module.DynamicLossScale)
            if dynamic:
                self.initial_scale = loss_scale.initial_loss_scale
                self.dynamic_growth_steps = loss_scale.increment_period
            elif isinstance(loss_scale, loss_scale_module.FixedLossScale):
                self.initial_scale = loss_scale.get_config()["loss_scale_value"]
                self.dynamic_growth_steps = None
            else:
                self.initial_scale = None
                self.dynamic_growth_steps = None

    # ------------------------------------------------------------------
    # State

    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        state = self._rule.checkpointed_variables()
        if state is None:
            super().build(var_list)
            return
        # The LossScale's variables are the loss-scale state; listing them
        # with the optimizer's saves and restores them with it.
        for variable in state:
            self._variables.append(variable)
        self.inner_optimizer.build(var_list)
        super(_StockLossScaleOptimizer, self).build(var_list)

    @property
    def loss_scale_object(self):
        """The ``LossScale`` this optimizer follows, or None for the Keras rule."""
        return self._loss_scale_object

    @property
    def scale_rule(self):
        """The rule that scales, unscales and steps (``lossscale._step``)."""
        return self._rule

    @property
    def loss_scale(self):
        """The current loss scale, a scalar float32 tensor."""
        return self._rule.scale()

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
        ``"stock: <reason>"`` when the fused path does not do what the step
        needs.  Set by the last step traced or run; before any step, what the
        configuration alone decides."""
        if self._step_path is not None:
            return self._step_path
        return self._decide().path

    @_step.plain_python
    def scale_loss(self, loss):
        return self._rule.scale_loss(loss)

    # ------------------------------------------------------------------
    # The fused step

    def _decide(self, grads=None, variables=None, unscale=None):
        """``lossscale._fused.decide`` for this optimizer: its ``fused`` switch,
        its rule, its inner optimizer; with ``grads``, for this step (and
        recorded for ``step_path``), unscaled as ``unscale`` says (default:
        as the rule unscales, as ``_fused_apply`` will)."""
        decision = _fused.decide(self.inner_optimizer, enabled=self._fused,
                                 rule_reason=self._rule.fused_reason(),
                                 grads=grads, variables=variables,
                                 unscale=unscale or self._rule.fused_unscale)
        if grads is not None:
            self._step_path = decision.path
        return decision

    def _fused_apply(self, plan, unscale=None):
        """The step on the fused path: the read-only check of the gradients
        (as they come, inside the graph that makes them, a few small ones
        per op; with a norm to clip by, the norms), the rule, then one
        native pass that unscales, clips and updates every variable and
        slot.  Under several replicas, each replica's gradients are
        unscaled (and clipped) and all-reduced first, as stock does, and
        the check and the pass read the sums."""
        # Mistakes fail before any state moves, with the stock step's message.
        _compat.check_variables_are_known(self.inner_optimizer, plan.variables)
        # The scale the gradients were made with: read before the rule moves it.
        scale = tf.convert_to_tensor(self._rule.scale(), tf.float32)
        # Under several replicas the check reads the sums, the same on every
        # replica.
        unscale = plan.sum_replicas(self._rule, scale, unscale or self._rule.fused_unscale)
        _fused.check_and_apply(plan, scale=scale, advance=self._rule.advance, unscale=unscale,
                               advance_iterations_always=self._skipped_steps_advance_iterations)

    # ------------------------------------------------------------------
    # The step

    @_step.plain_python
    def check_finite(self, grads):
        return native_ops.all_finite([g for g in grads if g is not None])

    def _unscale_and_check(self, grads, trainable_variables):
        """Unscaled gradients (None and overwrite-with-gradient ones as they
        came) and whether every gradient is finite, as a bool tensor."""
        tvs = trainable_variables or _compat.optimizer_trainable_variables(self)
        positions, passthrough = [], []
        for i, (g, v) in enumerate(zip(grads, tvs)):
            if g is None:
                continue
            if _compat.overwrites_with_gradient(self, v):
                passthrough.append(g)
            else:
                positions.append(i)
        unscaled, finite = self._rule.unscale_and_check([grads[i] for i in positions])
        if passthrough:
            finite = tf.logical_and(finite, native_ops.all_finite(passthrough))
        out = list(grads)
        for i, g in zip(positions, unscaled):
            out[i] = g
        return out, finite

    def _skip_step(self):
        if self._skipped_steps_advance_iterations:
            _compat.optimizer_iterations(self.inner_optimizer).assign_add(1)

    def apply(self, grads, trainable_variables=None):
        if isinstance(grads, (tf.Tensor, tf.IndexedSlices, str, bytes)) or not hasattr(
                grads, "__iter__"):
            raise TypeError(f"apply: grads must be a list of gradients, got "
                            f"{type(grads).__name__}.")
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            _step.check_gradients(grads, trainable_variables, "apply")
        elif self.built and grads:
            _step.check_gradients(grads, _compat.optimizer_trainable_variables(self), "apply")
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
        """The optimizer of a Keras 3 config (the stock optimizer's or
        ours), or of one TensorFlow 2.3 or 2.4's ``tf.keras`` loss-scale
        optimizer wrote (``tensorflow_2_config``: TensorFlow 2.4's reading,
        its refusal of a multiplier other than 2 included), which then
        follows that loss scale (``loss_scale=``), as TensorFlow 2.4 did."""
        tensorflow = tensorflow_2_config(config, custom_objects)
        if tensorflow is not None:
            inner, loss_scale = tensorflow
            return cls(inner, loss_scale=loss_scale)
        if not isinstance(config, dict) or "inner_optimizer" not in config:
            raise ValueError(f"{cls.__name__}.from_config: config must be a dict with an "
                             f"'inner_optimizer' entry, got {config!r}.")
        return super().from_config(dict(config), custom_objects=custom_objects)

    @_step.plain_python
    def _common_apply(self, grads, trainable_variables=None):
        if not self._rule.native_step_supported():
            # A growth period the native rule does not take: stock steps.
            super()._common_apply(grads, trainable_variables=trainable_variables)
            return
        unscaled, finite = self._unscale_and_check(grads, trainable_variables)
        replica_context = tf.distribute.get_replica_context()
        if (tf.distribute.has_strategy() and replica_context is not None
                and replica_context.num_replicas_in_sync > 1):
            # No merge call (e.g. MultiWorkerMirroredStrategy): combine the
            # replicas' flags so that all of them skip or apply together.
            finite = _step.all_replicas_finite(replica_context, finite)
        should_apply = self._rule.advance(finite, unscaled)

        def apply():
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

        _step.cond(should_apply, apply, self._skip_step)

    @_step.plain_python
    def _tf_apply(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        variables = list(trainable_variables or _compat.optimizer_trainable_variables(self))
        plan = self._decide(list(grads), variables).plan
        if plan is not None:
            self._fused_apply(plan)
            return
        if _compat.strategy_supports_no_merge_call():
            self._common_apply(grads, trainable_variables=trainable_variables)
            return
        if not self._rule.native_step_supported():
            super()._tf_apply(grads, trainable_variables=trainable_variables)
            return
        tf.distribute.get_replica_context().merge_call(
            self._apply_cross_replica, args=(grads, trainable_variables))

    @_step.plain_python
    def _apply_cross_replica(self, distribution, grads, trainable_variables):
        def unscale_and_check(grads):
            unscaled, finite = self._unscale_and_check(grads, trainable_variables)
            return unscaled, _step.as_float_flag(finite)

        unscaled, finite_per_replica = distribution.extended.call_for_each_replica(
            unscale_and_check, args=(grads,))
        total = distribution.reduce(tf.distribute.ReduceOp.SUM, finite_per_replica, axis=None)
        finite = tf.equal(total, distribution.num_replicas_in_sync)
        should_apply = self._rule.advance(finite, unscaled)
        self._apply_for_each_replica(distribution, should_apply, unscaled, trainable_variables)

    def _apply_for_each_replica(self, distribution, should_apply, grads, trainable_variables):
        """The inner optimizer's step on each replica's ``grads`` when
        ``should_apply``, else the skip: a cond branch in the cross-replica
        context, since the inner optimizer's own merge call would not be
        allowed in a replica context under a cond."""
        def apply():
            distribution.extended.call_for_each_replica(
                lambda g: self.inner_optimizer.apply(
                    g, trainable_variables=trainable_variables),
                args=(grads,))

        _step.cond(should_apply, apply, self._skip_step)

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
