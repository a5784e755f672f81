"""TensorFlow 2.4's mixed-precision ``experimental`` namespace, on the native ops.

Code written for ``tf.keras.mixed_precision.experimental`` and
``tf.mixed_precision.experimental`` changes one import line::

    from lossscale import experimental as mixed_precision

and keeps its ``LossScale``, ``FixedLossScale``, ``DynamicLossScale``,
``Policy`` and ``LossScaleOptimizer(optimizer, loss_scale)``, including the
custom-loop contract of that optimizer: ``get_scaled_loss``, then
``get_unscaled_gradients`` (one native op for the whole list), then
``apply_gradients`` on the *unscaled* gradients, which checks them, steps the
loss scale by the ``LossScale`` object's rule and skips the step on overflow.
``set_policy``, ``global_policy`` and ``get_layer_policy`` are there too.
"""

import warnings

import tensorflow as tf

from lossscale import _step
from lossscale import _which_keras
from lossscale import loss_scale as loss_scale_module
from lossscale import ops as native_ops
from lossscale import optimizer as optimizer_module
from lossscale.loss_scale import DynamicLossScale, FixedLossScale, LossScale

import keras

__all__ = ["LossScale", "FixedLossScale", "DynamicLossScale", "Policy", "LossScaleOptimizer",
           "set_policy", "global_policy", "get_layer_policy"]


def __getattr__(name):
    # The Policy lives in its own module, imported on first use.
    if name == "Policy":
        if _which_keras.tf_keras_in_use():
            from lossscale._tf_keras import Policy
        else:
            from lossscale.policy import Policy

        globals()["Policy"] = Policy
        return Policy
    raise AttributeError(f"module 'lossscale.experimental' has no attribute {name!r}")


@keras.saving.register_keras_serializable(package="lossscale.experimental")
class LossScaleOptimizer(optimizer_module.LossScaleOptimizer):
    """TensorFlow 2.4's ``LossScaleOptimizer(optimizer, loss_scale)``.

    Custom training loops use it as in TensorFlow 2.4::

        with tf.GradientTape() as tape:
            loss = loss_fn()
            scaled_loss = opt.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, vars)
        grads = opt.get_unscaled_gradients(scaled_grads)
        opt.apply_gradients(zip(grads, vars))  # checks, steps the scale, may skip

    or ``opt.minimize(loss, var_list, tape=tape)``.  ``apply_gradients``
    takes *unscaled* gradients; a skipped step leaves every variable as it
    was but, as in TensorFlow 2.4, still advances ``iterations``.  Keras 3's
    ``fit`` scales the loss with ``scale_loss`` instead and hands the scaled
    gradients to ``apply_gradients``: after ``scale_loss`` (until
    ``get_unscaled_gradients``), and always in ``apply``, the gradients are
    taken as scaled, as any Keras 3 loss-scale optimizer takes them.

    Args:
      optimizer: The Keras optimizer to wrap.
      loss_scale: ``"dynamic"`` (a ``DynamicLossScale()``), a number (a
        ``FixedLossScale``), a ``LossScale`` (its rule is followed, its
        extensions included), or a serialized one.
      name: The optimizer's name.
    """

    _skipped_steps_advance_iterations = True

    def __new__(cls, optimizer=None, *args, **kwargs):
        if optimizer is not None and _which_keras.is_tf_keras_object(optimizer):
            # TensorFlow 2.4's optimizer for a tf_keras one: tf_keras' drop-in.
            from lossscale import _tf_keras  # pylint: disable=import-outside-toplevel

            loss_scale = kwargs.get("loss_scale", args[0] if args else "dynamic")
            return _tf_keras.from_loss_scale(optimizer, loss_scale)
        return super().__new__(cls)

    def __init__(self, optimizer, loss_scale="dynamic", name=None):
        if loss_scale is None:
            raise ValueError('loss_scale must be "dynamic", a number or a LossScale, got None.')
        super().__init__(optimizer, name=name, loss_scale=loss_scale_module.get(loss_scale))
        # Set by scale_loss (Keras 3's train step), cleared by
        # get_unscaled_gradients (TensorFlow 2.4's loop): whether the next
        # apply_gradients gets scaled gradients.
        self._next_gradients_scaled = False
        self._delegating = True

    # TensorFlow 2.4 delegated the wrapped optimizer's hyperparameters:
    # `opt.beta_1` reads and sets `opt.inner_optimizer.beta_1`; `lr` is
    # `learning_rate`.

    def __getattr__(self, name):
        # Only reached for attributes this optimizer does not have.
        inner = self.__dict__.get("inner_optimizer")
        if self.__dict__.get("_delegating") and not name.startswith("_") and inner is not None:
            if name == "lr":
                return self.learning_rate
            if hasattr(inner, name):
                return getattr(inner, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        if self.__dict__.get("_delegating") and not name.startswith("_"):
            if name == "lr":
                name = "learning_rate"
            inner = self.__dict__.get("inner_optimizer")
            own = any(name in vars(k) for k in type(self).__mro__) or name in self.__dict__
            if not own and inner is not None and hasattr(inner, name):
                setattr(inner, name, value)
                return
        super().__setattr__(name, value)

    @_step.plain_python
    def scale_loss(self, loss):
        """Keras 3's ``scale_loss``: the gradients then go to ``apply``/``apply_gradients``
        scaled, as Keras 3's train step hands them over."""
        self._next_gradients_scaled = True
        return super().scale_loss(loss)

    # TensorFlow 2.4's properties.

    @property
    def dynamic(self):
        """Whether the loss scale is dynamic."""
        return isinstance(self.loss_scale_object, DynamicLossScale)

    @property
    def dynamic_counter(self):
        """Finite steps since the scale last changed (a variable), None if fixed."""
        if isinstance(self.loss_scale_object, DynamicLossScale):
            return self.loss_scale_object.good_steps
        return None

    @_step.plain_python
    def get_scaled_loss(self, loss):
        """``loss`` times the loss scale, in the loss's dtype; a callable gives a callable."""
        if not callable(loss) and not hasattr(loss, "dtype"):
            raise TypeError(f"get_scaled_loss: loss must be a tensor or a callable returning "
                            f"one, got {type(loss).__name__}.")
        if callable(loss):
            def scaled_loss():
                value = loss()
                return value * tf.cast(self.loss_scale, value.dtype)
            return scaled_loss
        return loss * tf.cast(self.loss_scale, loss.dtype)

    @_step.plain_python
    def get_unscaled_gradients(self, grads):
        """Every gradient times ``1 / loss_scale`` (None kept), in one native op."""
        if grads is None or isinstance(grads, (tf.Tensor, tf.IndexedSlices, str, bytes)) \
                or not hasattr(grads, "__iter__"):
            raise TypeError(f"get_unscaled_gradients: grads must be a list of gradients, "
                            f"got {type(grads).__name__}.")
        unscaled, _ = native_ops.unscale_and_check(list(grads), self.loss_scale)
        self._next_gradients_scaled = False
        return list(unscaled)

    @_step.plain_python
    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        """Applies *unscaled* gradients unless one is non-finite; steps the loss scale.

        After ``scale_loss`` (Keras 3's ``fit`` and train step) the gradients
        are the scaled ones instead, unscaled here as ``apply`` does.

        Under a ``tf.distribute`` strategy the replicas' flags are combined,
        so every replica skips or applies together.  ``name`` and
        ``experimental_aggregate_gradients`` are accepted for TensorFlow 2.4
        code and ignored: the wrapped Keras 3 optimizer aggregates.
        """
        del name, experimental_aggregate_gradients
        if self._next_gradients_scaled:
            # Keras 3's train step: scale_loss, then the scaled gradients.  The
            # flag stays set when they are rejected, for the corrected call.
            result = super().apply_gradients(grads_and_vars)
            self._next_gradients_scaled = False
            return result
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply_gradients() must be called in a replica context.")
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        for i, pair in enumerate(grads_and_vars):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"apply_gradients: item {i} is a {type(pair).__name__}, not "
                                "a (gradient, variable) pair.")
        grads = [g for g, _ in grads_and_vars]
        trainable_variables = [v for _, v in grads_and_vars]
        # Before the loss scale moves: a mistake leaves every state as it was.
        _step.check_gradients(grads, trainable_variables, "apply_gradients")
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if self._fused_reason(grads, trainable_variables) is None:
            # TensorFlow 2.4's check of the unscaled gradients, the rule and
            # the inner update, fused.
            self._fused_apply(grads, trainable_variables, unscale="none")
            return self.iterations
        tf.distribute.get_replica_context().merge_call(
            self._apply_unscaled_cross_replica, args=(grads, trainable_variables))
        return self.iterations

    @_step.plain_python
    def _apply_unscaled_cross_replica(self, distribution, grads, trainable_variables):
        # The LossScale's own update: checks the (per-replica) gradients,
        # combines the flags and steps the scale, as TensorFlow 2.4 did.
        _, should_apply = self.loss_scale_object.update(grads)

        def apply():
            distribution.extended.call_for_each_replica(
                lambda g: self.inner_optimizer.apply(
                    g, trainable_variables=trainable_variables),
                args=(grads,))

        _step.cond(should_apply, apply, self._skip_step)

    @_step.plain_python
    def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
        """Scales ``loss``, computes and unscales its gradients, applies them.

        As TensorFlow 2.4: ``loss`` is a callable, or a tensor computed under
        ``tape``; ``var_list`` is a list of variables or a callable returning
        one.
        """
        if not callable(loss) and tape is None:
            raise ValueError("`tape` is required when a `Tensor` loss is passed.")
        tape = tape if tape is not None else tf.GradientTape()
        with tape:
            if callable(loss):
                if not callable(var_list):
                    tape.watch([_step.tf_variable(v) for v in tf.nest.flatten(var_list)])
                loss = loss()
            scaled_loss = self.get_scaled_loss(loss)
        if callable(var_list):
            var_list = var_list()
        var_list = tf.nest.flatten(var_list)
        grads = tape.gradient(scaled_loss, var_list, grad_loss)
        return self.apply_gradients(zip(self.get_unscaled_gradients(grads), var_list), name)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": loss_scale_module.serialize(self.loss_scale_object),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        if not isinstance(config, dict) or not ("optimizer" in config
                                                or "inner_optimizer" in config):
            raise ValueError(f"{cls.__name__}.from_config: config must be a dict with an "
                             f"'optimizer' entry, got {config!r}.")
        config = dict(config)
        if "inner_optimizer" in config:
            # The form of TensorFlow 2.4's non-experimental optimizer.
            inner = config.pop("inner_optimizer")
            if config.pop("dynamic", True):
                config["loss_scale"] = DynamicLossScale(
                    config.pop("initial_scale", 2**15),
                    config.pop("dynamic_growth_steps", 2000))
            else:
                config["loss_scale"] = FixedLossScale(config.pop("initial_scale"))
                config.pop("dynamic_growth_steps", None)
            config["optimizer"] = inner
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects)
        return cls(optimizer, **config)


def set_policy(policy):
    """Sets the global dtype policy; a name makes a ``lossscale.Policy``.

    Under ``tf_keras`` (``TF_USE_LEGACY_KERAS=1``), or given a ``tf_keras``
    policy, it is ``tf_keras``' global policy that is set."""
    if _which_keras.wants_tf_keras(policy):
        from lossscale import _tf_keras  # pylint: disable=import-outside-toplevel

        return _tf_keras.set_policy(policy)
    if _which_keras.tf_keras_in_use():
        warnings.warn(f"set_policy: {policy!r} is a Keras 3 policy: it sets Keras 3's global "
                      f"policy, while tf.keras is {_which_keras.KERAS_NAME} "
                      "(TF_USE_LEGACY_KERAS is set), whose layers do not see it.", stacklevel=2)
    if isinstance(policy, str):
        policy = __getattr__("Policy")(policy)
    keras.mixed_precision.set_global_policy(policy)


def global_policy():
    """The global dtype policy (``tf_keras``' when it is the Keras in use)."""
    if _which_keras.tf_keras_in_use():
        from lossscale import _tf_keras  # pylint: disable=import-outside-toplevel

        return _tf_keras.global_policy()
    return keras.mixed_precision.global_policy()


def get_layer_policy(layer):
    """The dtype policy of ``layer``."""
    if _which_keras.is_tf_keras_object(layer) and hasattr(layer, "dtype_policy"):
        return layer.dtype_policy
    if not isinstance(layer, keras.layers.Layer):
        raise ValueError(f"get_policy can only be called on a layer, but got: {layer}")
    return layer.dtype_policy
