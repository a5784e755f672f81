"""The package on legacy Keras (``tf_keras``, Keras 2): policy, optimizer, compile hook.

TensorFlow 2.4's Keras was Keras 2; on today's TensorFlow it is ``tf_keras``,
which ``tf.keras`` resolves to when ``TF_USE_LEGACY_KERAS`` is set and
``tf_keras`` is installed.  This module is what ``lossscale.experimental``,
``lossscale.Policy``, ``lossscale.LossScaleOptimizer``, ``patch_keras`` and
``LossScaleMonitor`` turn to when that Keras is the one in use, or when the
user hands them ``tf_keras`` objects:

* ``Policy``: a ``tf_keras.mixed_precision.Policy`` (layers accept it) with
  the loss-scale half of ``lossscale.policy.Policy``
  (``lossscale._policy_loss_scale``: the same recipe, the same serialization;
  ``tf_keras`` reads it back as its own ``Policy``);
* ``LossScaleOptimizer``: a drop-in for
  ``tf_keras.mixed_precision.LossScaleOptimizer``.  It *is* ``tf_keras``'s
  class (``LossScaleOptimizerV3``, or the legacy one for
  ``tf_keras.optimizers.legacy`` optimizers), so every rule of its
  ``apply_gradients`` stays theirs; the unscaling and the dynamic scale's
  check and update run as the native ops, on TensorFlow 2.4's rule, which is
  ``tf_keras``'s, and for a stock SGD, Adam, AdamW, RMSprop or (legacy)
  Adagrad the step itself is fused (``lossscale._fused``), on one replica
  and under ``MirroredStrategy`` and ``MultiWorkerMirroredStrategy``: the
  results are bit-identical;
* the compile hook: ``tf_keras``'s ``Model`` wraps a plain optimizer in its
  ``_get_optimizer``; ``GET_OPTIMIZER`` replaces that method, through
  ``lossscale._compile_hook`` (which also holds the rule it follows), once
  ``set_policy``, a ``Policy`` with an explicit loss scale or
  ``patch_keras()`` asks: it wraps following a ``Policy``'s loss scale, and
  a plain ``"mixed_float16"`` policy's optimizer in ours too after
  ``patch_keras()``.  Keras 3's ``compile`` is left alone.

Every private ``tf_keras`` name used here comes from ``lossscale._compat``.
"""

import tensorflow as tf
import tf_keras

from lossscale import _compat, _compile_hook, _fused, _step
from lossscale import ops
from lossscale._policy_loss_scale import PolicyLossScale
from lossscale._which_keras import KERAS_NAME

_lso = _compat.tf_keras_loss_scale_optimizer_module()


# ------------------------------------------------------------------ policy

class Policy(PolicyLossScale, tf_keras.mixed_precision.Policy):
    """``lossscale.experimental.Policy`` under ``tf_keras``: a ``tf_keras`` policy with a loss scale.

    Layers read ``name``, ``compute_dtype`` and ``variable_dtype`` as from
    ``tf_keras.mixed_precision.Policy(name)``; ``Model.compile`` wraps the
    optimizer following ``loss_scale`` (see ``lossscale.policy.Policy`` for
    the arguments; the loss scale is resolved exactly as there, by the same
    code).  A saved model holds ``{'name': ...}`` and the explicit loss
    scale, which ``tf_keras`` drops when it reads the policy back as its own.

    An explicit loss scale is TensorFlow 2.4's request to compile with it:
    constructing such a policy installs ``tf_keras``' compile hook (once),
    and leaves Keras 3's ``compile`` alone.
    """

    def __init__(self, name, loss_scale="auto"):
        super().__init__(name)
        self._init_loss_scale(name, loss_scale)
        if self.loss_scale is not None and not self._using_default_loss_scale:
            _compile_hook.install(GET_OPTIMIZER)


def set_policy(policy):
    """``set_policy`` on ``tf_keras``'s global policy; a name makes our ``Policy``."""
    if isinstance(policy, str):
        policy = Policy(policy)
    elif policy is not None and not isinstance(policy, tf_keras.mixed_precision.Policy):
        raise TypeError(f"set_policy: {KERAS_NAME} is in use and takes a policy name or a "
                        f"tf_keras.mixed_precision.Policy, got {type(policy).__name__} "
                        f"({policy!r}).")
    tf_keras.mixed_precision.set_global_policy(policy)
    # TensorFlow 2.4's set_policy: compile follows the policy's loss scale.
    _compile_hook.install(GET_OPTIMIZER)


def global_policy():
    """``tf_keras``'s global dtype policy."""
    return tf_keras.mixed_precision.global_policy()


# --------------------------------------------------------------- optimizer

class _NativeDynamicLossScaleState(_compat.tf_keras_dynamic_loss_scale_state_class()):
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


class _NativeOps:
    """What ours changes in a ``tf_keras`` loss-scale optimizer: the unscaling
    (tf_keras multiplies by ``tf.cast(1 / scale, g.dtype)``, which is what
    the native op computes), the dynamic state's update and, for a stock
    inner optimizer ``lossscale._fused`` has a family for, the step itself:
    ``apply_gradients`` (which takes unscaled gradients, as tf_keras') is
    then the read-only finite check, the scale's update and one native op
    that applies the inner optimizer's update to every variable and slot,
    bit-identical to tf_keras' own step.  In ``minimize``, and in
    TensorFlow 2.4's custom loop in a ``tf.function`` when the gradients
    applied are the very ones ``get_unscaled_gradients`` returned, the step
    takes the scaled gradients and that one op unscales them too.
    ``step_path`` says which path a step took and why; ``fused=False``
    turns it off."""

    def __init__(self, inner_optimizer, dynamic=True, initial_scale=None,
                 dynamic_growth_steps=None, *, fused=True):
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be True or False, got {fused!r}.")
        super().__init__(inner_optimizer, dynamic, initial_scale, dynamic_growth_steps)
        # The state tf_keras made (variables, tracking) stays; only its update changes.
        _compat.tf_keras_update_dynamic_state_with(self, _NativeDynamicLossScaleState)
        self._fused = fused
        self._step_path = None
        # Set while minimize (fit's train step) runs, and then from its
        # get_unscaled_gradients to its apply_gradients: the gradients are
        # handed over still scaled, for the fused step to unscale on the fly.
        self._minimizing = False
        self._gradients_scaled = False
        # In a tf.function, what the last get_unscaled_gradients returned:
        # ``(graph, {id(unscaled): (unscaled, scaled)})`` (``_scaled_originals``).
        self._unscaled_in_graph = None

    @property
    def fused(self):
        """Whether steps may take the fused native path (the ``fused`` argument)."""
        return self._fused

    @property
    def step_path(self):
        """Which path the optimizer step takes, and why: ``"fused (Adam)"``, or
        ``"stock: <reason>"``.  Set by the last step traced or run; before
        any step, what the configuration alone decides."""
        if self._step_path is not None:
            return self._step_path
        return self._decide().path

    def _decide(self, grads=None, variables=None):
        decision = _fused.decide(self.inner_optimizer, enabled=self._fused,
                                 grads=grads, variables=variables)
        if grads is not None:
            self._step_path = decision.path
        return decision

    def get_unscaled_gradients(self, grads):
        _compat.tf_keras_note_gradients_unscaled(self)
        if self._minimizing and self._fused and self.initial_scale >= 1:
            # minimize's own gradients, on their way to its apply_gradients.
            # A scale >= 1 (tf_keras' rule keeps it so) cannot overflow a
            # finite gradient when unscaling, so checking the scaled ones
            # gives tf_keras' verdict.
            self._gradients_scaled = True
            return list(grads)
        if not tf.inside_function():
            unscaled, _ = ops.unscale_and_check(list(grads), self.loss_scale)
            return unscaled
        # TensorFlow 2.4's custom loop in a tf.function: tf_keras' own
        # stateless multiplies, each remembered with the scaled gradient it
        # came from.  When apply_gradients gets exactly these, the fused step
        # takes the scaled ones and unscales them in its one pass, as in
        # minimize; the multiplies are then left without a consumer, and
        # the function's pruning drops them.
        grads = list(grads)
        unscaled = super().get_unscaled_gradients(grads)
        self._unscaled_in_graph = (tf.compat.v1.get_default_graph(), {
            id(u): (u, g) for u, g in zip(unscaled, grads) if u is not None})
        return unscaled

    def _scaled_originals(self, grads_and_vars):
        """``grads_and_vars`` with the scaled gradients they came from, when
        every gradient is one this graph's last ``get_unscaled_gradients``
        returned and the step may unscale them itself (fused, a scale >= 1
        as in ``minimize``); else None.  Forgets them either way."""
        remembered, self._unscaled_in_graph = self._unscaled_in_graph, None
        if (remembered is None or not self._fused or self.initial_scale < 1
                or remembered[0] is not tf.compat.v1.get_default_graph()):
            return None
        pairs = []
        for pair in grads_and_vars:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                return None
            unscaled, scaled = remembered[1].get(id(pair[0]), (None, None))
            if unscaled is None or unscaled is not pair[0]:
                return None
            pairs.append((scaled, pair[1]))
        return pairs

    def minimize(self, *args, **kwargs):
        """tf_keras' ``minimize`` (what ``fit``'s train step calls): on the
        fused path the gradients reach the step scaled, and the one native
        pass unscales them too."""
        self._minimizing = True
        try:
            return super().minimize(*args, **kwargs)
        finally:
            self._minimizing = False
            self._gradients_scaled = False

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        scaled, self._gradients_scaled = self._gradients_scaled, False
        grads_and_vars = list(grads_and_vars)
        # The custom loop's unscaled gradients, in a tf.function: the fused
        # step unscales their scaled originals instead.
        originals = self._scaled_originals(grads_and_vars)
        plan = self._fused_plan(originals or grads_and_vars)
        if plan is not None:
            return self._fused_apply(plan, unscale="multiply" if scaled or originals
                                     else "none", aggregate=self._aggregates(args, kwargs))
        if scaled:
            # What get_unscaled_gradients gives outside minimize.
            unscaled, _ = ops.unscale_and_check([g for g, _ in grads_and_vars], self.loss_scale)
            grads_and_vars = list(zip(unscaled, [v for _, v in grads_and_vars]))
        return super().apply_gradients(grads_and_vars, *args, **kwargs)

    def _fused_plan(self, grads_and_vars):
        """The fused ``Plan`` for these pairs, or None for tf_keras' own step."""
        if (not grads_and_vars or tf.distribute.in_cross_replica_context()
                or any(not isinstance(p, (tuple, list)) or len(p) != 2 for p in grads_and_vars)):
            return None  # tf_keras' own step says what is wrong
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        self._build_before_deciding(variables)
        plan = self._decide(grads, variables).plan
        if plan is not None:
            self._build_for_fused(plan.variables)
        return plan

    def _fused_apply(self, plan, unscale, aggregate=True):
        """The fused step over ``plan``: gradients unscaled already
        (``"none"``) or still scaled (``"multiply"``, as tf_keras unscales).

        Under several replicas, tf_keras' order: each replica's gradients
        unscaled, then, unless ``aggregate`` is off (the caller summed them,
        ``apply_gradients``' ``experimental_aggregate_gradients=False`` or
        ``skip_gradients_aggregation=True``), summed over the replicas, so
        that an overflow on any replica is one on all of them; the check
        reads the sums and every replica updates its own copies by them.
        Without the sum, the replicas' flags are combined: all skip or all
        apply (tf_keras' own trusts the first replica's)."""
        _compat.tf_keras_warn_about_scaling(self)
        # The scale the gradients were made with: read before it moves.
        scale = tf.convert_to_tensor(self.loss_scale, tf.float32)
        if aggregate:
            # tf_keras' unscaling is the native op's product (times
            # tf.cast(1 / scale, g.dtype)): ``ops`` serves as the rule.
            unscale = plan.sum_replicas(ops, scale, unscale)
        # A clip with a sparse gradient: tf_keras' own clip, before the pass.
        unscale = plan.clip_by_own_ops(ops, scale, unscale)
        state = self._loss_scale
        if isinstance(state, _NativeDynamicLossScaleState):
            def advance(finite):
                if plan.replicated and not aggregate:
                    finite = _step.all_replicas_finite(tf.distribute.get_replica_context(),
                                                       finite)
                # Each replica steps its own copies of the state, by the
                # same flag.
                return _step.update_copies(state._step, finite,
                                           [state.current_loss_scale, state.counter])
        else:
            def advance(finite):
                del finite
                return True
        # A skipped step advances iterations, as tf_keras'.
        _fused.check_and_apply(plan, scale=scale, advance=advance, unscale=unscale,
                               advance_iterations_always=True)
        return self.inner_optimizer.iterations

    def get_config(self):
        config = super().get_config()
        if not self._fused:
            config["fused"] = False
        return config


@tf_keras.saving.register_keras_serializable(package="lossscale")
class LossScaleOptimizerV3(_NativeOps, _lso.LossScaleOptimizerV3):
    """``tf_keras``'s ``LossScaleOptimizerV3`` (for ``tf_keras.optimizers.*``) on the native ops."""

    def _build_before_deciding(self, variables):
        # As tf_keras' apply_gradients, before anything else.
        with tf.init_scope():
            self.build(variables)

    def _build_for_fused(self, variables):
        del variables

    @staticmethod
    def _aggregates(args, kwargs):
        """Whether ``apply_gradients(grads_and_vars, *args, **kwargs)`` sums
        the gradients over the replicas, as tf_keras' reads its arguments."""
        skip = args[0] if args else kwargs.get("skip_gradients_aggregation", False)
        return not skip and kwargs.get("experimental_aggregate_gradients", True)


@tf_keras.saving.register_keras_serializable(package="lossscale")
class LegacyLossScaleOptimizer(_NativeOps, _lso.LossScaleOptimizer):
    """``tf_keras``'s legacy ``LossScaleOptimizer`` (for ``tf_keras.optimizers.legacy.*``)
    on the native ops."""

    def _build_before_deciding(self, variables):
        del variables

    def _build_for_fused(self, variables):
        # What the inner optimizer's apply_gradients creates first.  tf_keras
        # creates it only in the applying branch: after a skipped first eager
        # step its slots exist here (zeros) and not yet there.
        _compat.tf_keras_legacy_create_weights(self.inner_optimizer, variables)

    @staticmethod
    def _aggregates(args, kwargs):
        """Whether ``apply_gradients(grads_and_vars, *args, **kwargs)`` sums
        the gradients over the replicas, as tf_keras' reads its arguments
        (``name``, then ``experimental_aggregate_gradients``)."""
        if len(args) > 1:
            return args[1]
        return kwargs.get("experimental_aggregate_gradients", True)


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

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The optimizer of a config of ``tf_keras``' loss-scale optimizers, as
        their ``from_config`` reads it: ``inner_optimizer``, ``dynamic``,
        ``initial_scale``, ``dynamic_growth_steps`` (``tf_keras``' form, which
        was TensorFlow 2.4's), or TensorFlow 2.3's ``optimizer`` and
        ``loss_scale``, whose ``DynamicLossScale`` must have multiplier 2
        (TensorFlow 2.4's and ``tf_keras``' message otherwise).  The inner
        optimizer's config says whether it is a legacy one, as
        ``tf_keras.optimizers.deserialize`` reads it, and the class is then
        the one that fits it, as for the constructor.

        Raises:
          ValueError: ``config`` is not one of those forms, or its loss scale
            is one ``tf_keras``' rule cannot follow.
        """
        from lossscale import loss_scale as loss_scale_module  # pylint: disable=import-outside-toplevel

        if not isinstance(config, dict) or not ("inner_optimizer" in config
                                                or "optimizer" in config):
            raise ValueError(f"LossScaleOptimizer.from_config: config must be a dict with an "
                             f"'inner_optimizer' (or TensorFlow 2.3's 'optimizer') entry, got "
                             f"{config!r}.")
        config = dict(config)
        loss_scale = None
        if "loss_scale" in config:
            loss_scale = loss_scale_module.from_tensorflow_2_3_optimizer_config(
                config.pop("loss_scale"))
            if not isinstance(loss_scale, (loss_scale_module.FixedLossScale,
                                           loss_scale_module.DynamicLossScale)):
                raise ValueError("Serialized LossScaleOptimizers with a LossScale that is "
                                 "neither a FixedLossScale nor a DynamicLossScale can no longer "
                                 "be deserialized")
            config["inner_optimizer"] = config.pop("optimizer")
        inner = config.pop("inner_optimizer")
        if not isinstance(inner, (tf_keras.optimizers.Optimizer,
                                  tf_keras.optimizers.legacy.Optimizer)):
            inner = tf_keras.optimizers.deserialize(inner, custom_objects=custom_objects)
        if loss_scale is None:
            return cls(inner, **config)
        if config:
            raise ValueError(f"LossScaleOptimizer.from_config: a TensorFlow 2.3 config has only "
                             f"'optimizer' and 'loss_scale', got also {sorted(config)}.")
        return from_loss_scale(inner, loss_scale)


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

def _wrap(model, original, wrapper, optimizer):
    if wrapper.kind == _compile_hook.STOCK:
        return original(model, optimizer)
    optimizer = tf_keras.optimizers.get(optimizer)
    if wrapper.kind == _compile_hook.NONE or is_loss_scale_optimizer(optimizer):
        return optimizer
    loss_scale = wrapper.fresh_loss_scale()
    if loss_scale is None:
        return LossScaleOptimizer(optimizer)
    return from_loss_scale(optimizer, loss_scale)


def _make_get_optimizer(original):
    def _get_optimizer(self, optimizer):
        wrapper = _compile_hook.wrapper_for(self.dtype_policy, "tf_keras")
        return tf.nest.map_structure(lambda opt: _wrap(self, original, wrapper, opt), optimizer)

    return _get_optimizer


# tf_keras' Model method that wraps compile's optimizer, as the compile hook
# patches it (``lossscale._compile_hook.wrapper_for`` decides).
GET_OPTIMIZER = _compile_hook.Patch("tf_keras", *_compat.tf_keras_optimizer_wrapping_method(),
                                    _make_get_optimizer)
