"""The package on legacy Keras (``tf_keras``, Keras 2): policy, optimizer, compile hook.

TensorFlow 2.4's Keras was Keras 2; on today's TensorFlow it is ``tf_keras``,
which ``tf.keras`` resolves to when ``TF_USE_LEGACY_KERAS`` is set and
``tf_keras`` is installed.  This module is what ``lossscale.experimental``,
``lossscale.Policy``, ``lossscale.LossScaleOptimizer``, ``patch_keras`` and
``LossScaleMonitor`` turn to when that Keras is the one in use, or when the
user hands them ``tf_keras`` objects:

* ``Policy``: a ``tf_keras.mixed_precision.Policy`` (layers accept it) with
  the loss scale of ``lossscale.policy.Policy`` (the same recipe, the same
  serialization: ``tf_keras`` reads it back as its own ``Policy``);
* ``LossScaleOptimizer``: a drop-in for
  ``tf_keras.mixed_precision.LossScaleOptimizer``.  It *is* ``tf_keras``'s
  class (``LossScaleOptimizerV3``, or the legacy one for
  ``tf_keras.optimizers.legacy`` optimizers), so every rule of its
  ``apply_gradients`` stays theirs; only the unscaling and the dynamic scale's
  check and update run as the native ops, on TensorFlow 2.4's rule, which is
  ``tf_keras``'s: the results are bit-identical;
* the compile hook: ``tf_keras``'s ``Model`` wraps a plain optimizer in its
  ``_get_optimizer``; ours wraps it following a ``Policy``'s loss scale
  (always once ``set_policy`` or an explicit loss scale asked for it), and a
  plain ``"mixed_float16"`` policy's in ours too after ``patch_keras()``.
"""

import tensorflow as tf
import tf_keras

from lossscale import _compat
from lossscale import ops
from lossscale import policy as _keras3_policy
from lossscale._which_keras import KERAS_NAME

_lso = _compat.tf_keras_loss_scale_optimizer_module()


# ------------------------------------------------------------------ policy

class Policy(tf_keras.mixed_precision.Policy):
    """``lossscale.experimental.Policy`` under ``tf_keras``: a ``tf_keras`` policy with a loss scale.

    Layers read ``name``, ``compute_dtype`` and ``variable_dtype`` as from
    ``tf_keras.mixed_precision.Policy(name)``; ``Model.compile`` wraps the
    optimizer following ``loss_scale`` (see ``lossscale.policy.Policy`` for
    the arguments; the loss scale is resolved exactly as there).  A saved
    model holds ``{'name': ...}`` and the explicit loss scale, which
    ``tf_keras`` drops when it reads the policy back as its own.
    """

    def __init__(self, name, loss_scale="auto"):
        super().__init__(name)
        recipe = _keras3_policy.Policy(name, loss_scale)
        self._loss_scale = recipe.loss_scale
        self._using_default_loss_scale = recipe._using_default_loss_scale  # pylint: disable=protected-access
        if self._loss_scale is not None and not self._using_default_loss_scale:
            # An explicit loss scale is TensorFlow 2.4's request to compile with it.
            hook_compile()

    # The loss-scale half is the Keras 3 policy's, unchanged.
    loss_scale = _keras3_policy.Policy.loss_scale
    __repr__ = _keras3_policy.Policy.__repr__
    __eq__ = _keras3_policy.Policy.__eq__
    __hash__ = None
    get_config = _keras3_policy.Policy.get_config
    from_config = _keras3_policy.Policy.__dict__["from_config"]


def set_policy(policy):
    """``set_policy`` on ``tf_keras``'s global policy; a name makes our ``Policy``."""
    if isinstance(policy, str):
        policy = Policy(policy)
    elif policy is not None and not isinstance(policy, tf_keras.mixed_precision.Policy):
        raise TypeError(f"set_policy: {KERAS_NAME} is in use and takes a policy name or a "
                        f"tf_keras.mixed_precision.Policy, got {type(policy).__name__} "
                        f"({policy!r}).")
    tf_keras.mixed_precision.set_global_policy(policy)
    hook_compile()


def global_policy():
    """``tf_keras``'s global dtype policy."""
    return tf_keras.mixed_precision.global_policy()


# --------------------------------------------------------------- optimizer

class _NativeDynamicLossScaleState(_lso._DynamicLossScaleState):  # pylint: disable=protected-access
    """``tf_keras``'s dynamic loss-scale state, its ``update`` on the native ops.

    Same variables, same checkpoint layout; the check and the step of the
    scale (TensorFlow 2.4's rule: grow by the multiplier after
    ``growth_steps`` finite steps if the result is finite, halve down to 1 on
    a non-finite one) are one native op each.
    """

    def _step(self, is_finite, scale, counter):
        return ops.update_loss_scale(is_finite, scale, counter, rule="tf24",
                                     increment_period=self.growth_steps,
                                     multiplier=self.multiplier)

    def update(self, grads):
        grads = tf.nest.flatten(grads)
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            distribution = tf.distribute.get_strategy()
            # The gradients are all-reduced: every replica's flag is the same.
            is_finite = distribution.experimental_local_results(
                distribution.extended.call_for_each_replica(ops.all_finite, args=(grads,)))[0]
            scale = self.current_loss_scale
            if isinstance(scale, tf.distribute.DistributedValues):
                update_op = tf.group(tf.nest.flatten(distribution.extended.update(
                    scale, lambda s, c: self._step(is_finite, s, c), args=(self.counter,),
                    group=False)))
                return update_op, is_finite
        else:
            is_finite = ops.all_finite(grads)
        return self._step(is_finite, self.current_loss_scale, self.counter), is_finite


def _use_native_state(optimizer):
    # The state tf_keras made (variables, tracking) stays; only its update changes.
    state = optimizer._loss_scale  # pylint: disable=protected-access
    if isinstance(state, _lso._DynamicLossScaleState):  # pylint: disable=protected-access
        state.__class__ = _NativeDynamicLossScaleState


class _NativeOps:
    """What ours changes in a ``tf_keras`` loss-scale optimizer: the unscaling
    (tf_keras multiplies by ``tf.cast(1 / scale, g.dtype)``, which is what
    the native op computes) and the dynamic state's update."""

    def __init__(self, inner_optimizer, dynamic=True, initial_scale=None,
                 dynamic_growth_steps=None):
        super().__init__(inner_optimizer, dynamic, initial_scale, dynamic_growth_steps)
        _use_native_state(self)

    def get_unscaled_gradients(self, grads):
        self._gradients_have_been_unscaled = True
        unscaled, _ = ops.unscale_and_check(list(grads), self.loss_scale)
        return unscaled


@tf_keras.saving.register_keras_serializable(package="lossscale")
class LossScaleOptimizerV3(_NativeOps, _lso.LossScaleOptimizerV3):
    """``tf_keras``'s ``LossScaleOptimizerV3`` (for ``tf_keras.optimizers.*``) on the native ops."""


@tf_keras.saving.register_keras_serializable(package="lossscale")
class LegacyLossScaleOptimizer(_NativeOps, _lso.LossScaleOptimizer):
    """``tf_keras``'s legacy ``LossScaleOptimizer`` (for ``tf_keras.optimizers.legacy.*``)
    on the native ops."""


class _Dispatch(type):
    """Makes ``LossScaleOptimizer(opt, ...)`` the class that fits ``opt``, as
    ``tf_keras.mixed_precision.LossScaleOptimizer`` does."""

    def __call__(cls, inner_optimizer, *args, **kwargs):
        if isinstance(inner_optimizer, tf_keras.optimizers.legacy.Optimizer):
            return LegacyLossScaleOptimizer(inner_optimizer, *args, **kwargs)
        if isinstance(inner_optimizer, tf_keras.optimizers.Optimizer):
            return LossScaleOptimizerV3(inner_optimizer, *args, **kwargs)
        hint = ""
        if type(inner_optimizer).__module__.split(".")[0] == "keras":
            hint = (" It is a Keras 3 optimizer: wrap it in lossscale.LossScaleOptimizer "
                    "with TF_USE_LEGACY_KERAS unset, or use tf.keras.optimizers.")
        raise TypeError(f"{KERAS_NAME} is in use: inner_optimizer must be a "
                        f"tf_keras.optimizers.Optimizer or tf_keras.optimizers.legacy."
                        f"Optimizer, got {type(inner_optimizer).__name__}.{hint}")

    def __instancecheck__(cls, obj):
        return isinstance(obj, (LossScaleOptimizerV3, LegacyLossScaleOptimizer))


class LossScaleOptimizer(metaclass=_Dispatch):
    """``tf_keras.mixed_precision.LossScaleOptimizer(inner_optimizer, dynamic=True,
    initial_scale=None, dynamic_growth_steps=None)``, bit-identical, on the native ops.

    Gives a ``LossScaleOptimizerV3`` for a ``tf_keras.optimizers.Optimizer``
    and a ``LegacyLossScaleOptimizer`` for a
    ``tf_keras.optimizers.legacy.Optimizer``; both are instances of
    ``tf_keras.mixed_precision.LossScaleOptimizer``.
    """


def from_loss_scale(optimizer, loss_scale):
    """TensorFlow 2.4's ``LossScaleOptimizer(optimizer, loss_scale)`` for a ``tf_keras`` optimizer.

    ``"dynamic"``, a number, or a ``lossscale`` fixed or dynamic loss scale
    whose rule ``tf_keras``'s optimizer follows (multiplier 2, none of the
    extensions); anything else is refused, naming what does not fit.
    """
    from lossscale import loss_scale as loss_scale_module  # pylint: disable=import-outside-toplevel

    if loss_scale is None:
        raise ValueError('loss_scale must be "dynamic", a number or a LossScale, got None.')
    loss_scale = loss_scale_module.get(loss_scale)
    if isinstance(loss_scale, loss_scale_module.FixedLossScale):
        return LossScaleOptimizer(optimizer, dynamic=False,
                                  initial_scale=float(loss_scale()))
    if type(loss_scale) is loss_scale_module.DynamicLossScale:  # pylint: disable=unidiomatic-typecheck
        config = loss_scale.get_config()
        rule = {"initial_loss_scale", "increment_period", "multiplier"}
        extra = sorted(k for k in config if k not in rule)
        if config["multiplier"] != 2 or extra:
            raise ValueError(
                f"{KERAS_NAME} is in use: its LossScaleOptimizer follows TensorFlow 2.4's "
                f"dynamic rule with multiplier 2 and nothing else; got {loss_scale!r} "
                f"(multiplier {config['multiplier']}"
                + (f", {', '.join(extra)}" if extra else "") + ").")
        return LossScaleOptimizer(optimizer, dynamic=True,
                                  initial_scale=config["initial_loss_scale"],
                                  dynamic_growth_steps=config["increment_period"])
    raise TypeError(f"{KERAS_NAME} is in use: its LossScaleOptimizer takes a fixed or a "
                    f"dynamic loss scale, got {type(loss_scale).__name__}.")


def is_loss_scale_optimizer(optimizer):
    """Whether ``optimizer`` is a ``tf_keras`` loss-scale optimizer (stock or ours)."""
    return isinstance(optimizer, _lso.BaseLossScaleOptimizer)


# ----------------------------------------------------------- compile hook

_MODEL = _compat.tf_keras_model_class()
_ORIGINAL = None
_HOOK = None
# Whether a plain "mixed_float16" policy gets ours too (patch_keras()).
_WRAP_MIXED_FLOAT16 = False


def _wrap(model, optimizer):
    optimizer = tf_keras.optimizers.get(optimizer)
    if is_loss_scale_optimizer(optimizer):
        return optimizer
    policy = model.dtype_policy
    if isinstance(policy, Policy):
        if policy.loss_scale is None:
            return optimizer
        fresh = type(policy.loss_scale).from_config(policy.loss_scale.get_config())
        return from_loss_scale(optimizer, fresh)
    if policy.name == "mixed_float16":
        if _WRAP_MIXED_FLOAT16:
            return LossScaleOptimizer(optimizer)
        return _lso.BaseLossScaleOptimizer(optimizer)
    return optimizer


def _get_optimizer(self, optimizer):
    return tf.nest.map_structure(lambda opt: _wrap(self, opt), optimizer)


def hook_compile(wrap_mixed_float16=False):
    """Has ``tf_keras``'s ``Model.compile`` wrap by our ``Policy``'s loss scale
    (and, with ``wrap_mixed_float16``, a plain ``"mixed_float16"`` policy's
    optimizer in ours).  Idempotent."""
    global _ORIGINAL, _HOOK, _WRAP_MIXED_FLOAT16
    _WRAP_MIXED_FLOAT16 = _WRAP_MIXED_FLOAT16 or wrap_mixed_float16
    if _HOOK is not None and _MODEL.__dict__.get("_get_optimizer") is _HOOK:
        return
    _ORIGINAL = _MODEL.__dict__["_get_optimizer"]
    _HOOK = _get_optimizer
    _MODEL._get_optimizer = _HOOK  # pylint: disable=protected-access


def unhook_compile():
    """``tf_keras``'s ``Model.compile`` is its own again."""
    global _ORIGINAL, _HOOK, _WRAP_MIXED_FLOAT16
    _WRAP_MIXED_FLOAT16 = False
    if _HOOK is not None and _MODEL.__dict__.get("_get_optimizer") is _HOOK:
        _MODEL._get_optimizer = _ORIGINAL  # pylint: disable=protected-access
    _ORIGINAL = _HOOK = None
