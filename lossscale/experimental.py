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
``set_policy``, ``global_policy`` and ``get_layer_policy`` are there too, and
``Model.compile`` then wraps optimizers by the policy's loss scale, as
TensorFlow 2.4's did.  The optimizer forwards the wrapped optimizer's
hyperparameters (``lr``, ``beta_1``, ``clipnorm``...), has TensorFlow 2.4's
``weights``/``get_weights``/``set_weights``/``variables()`` and an assignable
``iterations``, and reads TensorFlow 2.x optimizer configs.
"""

import inspect
import warnings

import numpy as np
import tensorflow as tf

from lossscale import _compat, _step, _which_keras, keras_patch
from lossscale import loss_scale as loss_scale_module
from lossscale import ops as native_ops
from lossscale import optimizer as optimizer_module
from lossscale.loss_scale import DynamicLossScale, FixedLossScale, LossScale
from lossscale._config import DEFAULT_GROWTH_STEPS, DEFAULT_INITIAL_SCALE

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


# Constructor arguments of every Keras 3 optimizer that are bookkeeping, not
# hyperparameters of the update (TensorFlow 2.4 did not forward them).
_NOT_HYPERPARAMETERS = frozenset(["name", "use_ema", "ema_momentum", "ema_overwrite_frequency",
                                  "loss_scale_factor", "gradient_accumulation_steps"])


def _hyperparameter_names(optimizer):
    """``learning_rate`` and the numeric constructor arguments of ``optimizer``'s
    config (``beta_1``, ``momentum``, ``clipnorm``...): what TensorFlow 2.4 kept
    in ``_hyper`` or forwarded.  Flags such as ``nesterov`` are not."""
    arguments = set(inspect.signature(type(optimizer).__init__).parameters)
    arguments |= set(inspect.signature(keras.optimizers.Optimizer.__init__).parameters)
    names = {"learning_rate"}
    for key, value in optimizer.get_config().items():
        if key in arguments and key not in _NOT_HYPERPARAMETERS and not isinstance(value, bool):
            names.add(key)
    return frozenset(names)


class _VariablesList(list):
    """Keras 3's ``optimizer.variables`` list that TensorFlow 2.4 code can also
    call, ``optimizer.variables()``, for TensorFlow 2.4's meaning (``weights``)."""

    def __init__(self, variables, optimizer):
        super().__init__(variables)
        self._optimizer = optimizer

    def __call__(self):
        return self._optimizer.weights


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
        self._hyperparameter_names = _hyperparameter_names(self.inner_optimizer)
        # Keras's base class gave this optimizer its own clipnorm, clipvalue...;
        # as in TensorFlow 2.4, those names are the wrapped optimizer's.
        for name in self._hyperparameter_names:
            self.__dict__.pop(name, None)

    # TensorFlow 2.4 forwarded the wrapped optimizer's hyperparameters (its
    # `_hyper` names, and clipnorm/clipvalue): `opt.beta_1` reads and sets
    # `opt.inner_optimizer.beta_1`; `lr` is `learning_rate`.  Nothing else.

    def __getattr__(self, name):
        # Only reached for attributes this optimizer does not have.
        hyperparameters = self.__dict__.get("_hyperparameter_names", ())
        if name == "lr" and "learning_rate" in hyperparameters:
            return self.learning_rate
        if name in hyperparameters:
            return getattr(self.__dict__["inner_optimizer"], name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        hyperparameters = self.__dict__.get("_hyperparameter_names", ())
        if name == "lr" and "learning_rate" in hyperparameters:
            name = "learning_rate"
        if name in hyperparameters and name != "learning_rate":
            setattr(self.inner_optimizer, name, value)
            return
        super().__setattr__(name, value)

    def __dir__(self):
        names = set(super().__dir__()) | set(self.__dict__.get("_hyperparameter_names", ()))
        if "learning_rate" in names:
            names.add("lr")
        return sorted(names)

    # TensorFlow 2.4's optimizer state API.

    @property
    def iterations(self):
        """The wrapped optimizer's step counter; assigning sets its value."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, value):
        # Keras 3 makes the counter at construction, so the value is assigned
        # to it (TensorFlow 2.4 adopted the variable itself).
        dtype = tf.int64 if isinstance(value, int) else getattr(value, "dtype", tf.float32)
        if isinstance(value, bool) or not tf.as_dtype(dtype).is_integer:
            raise TypeError(f"iterations must be an integer or an integer variable, got {value!r}.")
        _compat.optimizer_iterations(self.inner_optimizer).assign(
            tf.cast(tf.convert_to_tensor(value), tf.int64))

    @property
    def weights(self):
        """As TensorFlow 2.4's: the wrapped optimizer's ``iterations``, then its slots."""
        rate = _compat.optimizer_learning_rate_variable(self.inner_optimizer)
        return [v for v in self.inner_optimizer.variables if v is not rate]

    def get_weights(self):
        """The values of ``weights``, as numpy arrays."""
        return [np.array(v.numpy()) for v in self.weights]

    def set_weights(self, weights):
        """Sets ``weights`` from numpy arrays, as TensorFlow 2.4's ``set_weights``."""
        params = self.weights
        weights = list(weights)
        if len(params) != len(weights):
            raise ValueError(
                f"You called `set_weights(weights)` on optimizer {self.name} with a weight "
                f"list of length {len(weights)}, but the optimizer was expecting "
                f"{len(params)} weights. Provided weights: {str(weights)[:50]}...")
        for param, weight in zip(params, weights):
            if tuple(param.shape) != np.shape(weight):
                raise ValueError(f"Optimizer weight shape {tuple(param.shape)} not compatible "
                                 f"with provided weight shape {np.shape(weight)}")
        for param, weight in zip(params, weights):
            param.assign(weight)

    @property
    def variables(self):
        """Keras 3's list of variables; called, as in TensorFlow 2.4, ``weights``."""
        return _VariablesList(super().variables, self)

    # To a checkpoint, TensorFlow 2.4's optimizer was the wrapped optimizer
    # plus its `loss_scale`, so that a checkpoint of either restores into the
    # other.  SavedModel keeps Keras's own layout.

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "checkpoint":
            return super()._trackable_children(save_type, **kwargs)
        children = dict(_compat.trackable_children(self.inner_optimizer, save_type, **kwargs))
        children["loss_scale"] = self._loss_scale_object
        return children

    def _lookup_dependency(self, name, cached_dependencies=None):
        if cached_dependencies is None:
            # Tracking this optimizer's own attributes.
            return super()._lookup_dependency(name)
        if name == "loss_scale":
            return self._loss_scale_object
        return cached_dependencies.get(name)

    @property
    def _deferred_dependencies(self):
        # Restorations of children not made yet are the wrapped optimizer's.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            return super()._deferred_dependencies
        return _compat.deferred_dependencies(inner)

    def _handle_deferred_dependencies(self, name, trackable):
        # This optimizer's own attributes are not what its checkpoint names.
        del name, trackable

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
        plan = self._decide(grads, trainable_variables, unscale="none").plan
        if plan is not None:
            # TensorFlow 2.4's check of the unscaled gradients, the rule and
            # the inner update, fused.
            self._fused_apply(plan, unscale="none")
            return self.iterations
        tf.distribute.get_replica_context().merge_call(
            self._apply_unscaled_cross_replica, args=(grads, trainable_variables))
        return self.iterations

    @_step.plain_python
    def _apply_unscaled_cross_replica(self, distribution, grads, trainable_variables):
        # The LossScale's own update: checks the (per-replica) gradients,
        # combines the flags and steps the scale, as TensorFlow 2.4 did.
        _, should_apply = self.loss_scale_object.update(grads)
        self._apply_for_each_replica(distribution, should_apply, grads, trainable_variables)

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
                    config.pop("initial_scale", DEFAULT_INITIAL_SCALE),
                    config.pop("dynamic_growth_steps", DEFAULT_GROWTH_STEPS))
            else:
                config["loss_scale"] = FixedLossScale(config.pop("initial_scale"))
                config.pop("dynamic_growth_steps", None)
            config["optimizer"] = inner
        inner_config = config.pop("optimizer")
        optimizer = _tf2_optimizer(inner_config, custom_objects)
        if optimizer is None:
            optimizer = keras.saving.deserialize_keras_object(
                inner_config, custom_objects=custom_objects)
        return cls(optimizer, **config)


def _tf2_optimizer(config, custom_objects):
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


def set_policy(policy):
    """Sets the global dtype policy, as TensorFlow 2.4's ``set_policy``.

    A name makes a ``lossscale.Policy``; None restores the default (a policy
    of ``keras.config.floatx()``).  ``Model.compile`` then wraps optimizers
    by the policy's loss scale (``lossscale.keras_patch``).  Under
    ``tf_keras`` (``TF_USE_LEGACY_KERAS=1``), or given a ``tf_keras``
    policy, it is ``tf_keras``' global policy that is set.

    Raises:
      ValueError: the policy's compute dtype is not a floating-point one.
    """
    if _which_keras.wants_tf_keras(policy):
        from lossscale import _tf_keras  # pylint: disable=import-outside-toplevel

        return _tf_keras.set_policy(policy)
    if _which_keras.tf_keras_in_use():
        warnings.warn(f"set_policy: {policy!r} is a Keras 3 policy: it sets Keras 3's global "
                      f"policy, while tf.keras is {_which_keras.KERAS_NAME} "
                      "(TF_USE_LEGACY_KERAS is set), whose layers do not see it.", stacklevel=2)
    if policy is None:
        keras.mixed_precision.set_global_policy(keras.config.floatx())
        return None
    if isinstance(policy, str):
        policy = __getattr__("Policy")(policy)
    if isinstance(policy, keras.DTypePolicy) and not (
            policy.compute_dtype and tf.as_dtype(policy.compute_dtype).is_floating):
        raise ValueError('set_policy can only be used to set the global policy to '
                         'floating-point policies, such as "float32" and '
                         f'"mixed_float16", but got policy: {policy.name}')
    keras.mixed_precision.set_global_policy(policy)
    if isinstance(policy, __getattr__("Policy")):
        keras_patch.install_policy_hook(policy)


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
