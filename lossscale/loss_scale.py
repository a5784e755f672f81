"""The loss-scale objects of TensorFlow 2.4, with the step in native code.

``LossScale``, ``FixedLossScale`` and ``DynamicLossScale`` behave as
TensorFlow 2.4's ``tf.mixed_precision.experimental`` classes (still shipped as
``tf.compat.v1.mixed_precision``): the same constructor arguments, variables,
checkpoint layout, configs and loss-scale trajectory, float32 step for float32
step.  What differs is the cost of a step: ``DynamicLossScale.update`` runs one
native op that checks every gradient of the list and one native op that
advances the scale, instead of two ops per gradient plus a graph of ``cond``s.
A few keyword-only extensions (a floor and a cap on the scale, a separate
back-off factor, hysteresis, a skipped-step counter) are off by default, so
an object built with the seed's arguments is indistinguishable from
TensorFlow's.  ``get``, ``serialize`` and ``deserialize`` read and write the
``{'class_name': ..., 'config': ...}`` form that TensorFlow 2.4's Keras used.

In TensorFlow 2.4 these classes *were* ``tf.compat.v1.mixed_precision``'s, so
code of that time hands them to every function that takes a loss scale:
``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer``,
``enable_mixed_precision_graph_rewrite``, ``tf_keras``' wrapping of its
optimizers.  Those check ``isinstance`` against TensorFlow's classes, so each
class here is also a subclass of TensorFlow's namesake (where TensorFlow still
ships them): TensorFlow's code then calls this package's ``__call__``,
``update`` and ``get_config``, and checkpoints its variables.
"""

import abc
import math
import operator

import numpy as np
import tensorflow as tf

from lossscale import _compat, ops
from lossscale._config import (DEFAULT_GROWTH_STEPS, DEFAULT_INITIAL_SCALE, FLOAT32_MAX,
                               dynamic_loss_scale_config, is_real_number)

__all__ = ["LossScale", "FixedLossScale", "DynamicLossScale", "CrossReplicaContextError",
           "get", "serialize", "deserialize", "from_tensorflow_2_3_optimizer_config"]



class CrossReplicaContextError(RuntimeError, AttributeError):
    """``update()`` was called in a replica context of a ``tf.distribute`` strategy.

    Also an ``AttributeError``: that is what TensorFlow's own ``LossScale``
    raises in the same place, so code written against it keeps catching it.
    """


# TensorFlow's own abstract LossScale and its two concrete classes, the bases
# that make an object of this module one of TensorFlow's (see the module
# docstring); a plain Trackable and no extra base where TensorFlow has dropped
# them.
_TENSORFLOW = _compat.tensorflow_loss_scale_module()
_TensorFlowLossScale = _TENSORFLOW.LossScale if _TENSORFLOW else _compat.Trackable
_TensorFlowFixedLossScale = _TENSORFLOW.FixedLossScale if _TENSORFLOW else object
_TensorFlowDynamicLossScale = _TENSORFLOW.DynamicLossScale if _TENSORFLOW else object


class LossScale(_TensorFlowLossScale, metaclass=abc.ABCMeta):
    """Base class for all loss scales.

    This is an abstract base class, so you cannot instantiate it directly.
    Use one of its concrete subclasses instead:

    * ``lossscale.DynamicLossScale`` (recommended)
    * ``lossscale.FixedLossScale``

    Using loss scaling through a loss-scale optimizer is simpler than using
    these objects directly.

    Loss scaling multiplies the loss by a number, the loss scale, and divides
    every gradient by the same number::

        loss = ...
        loss *= loss_scale
        grads = gradients(loss, vars)
        grads /= loss_scale

    Mathematically this changes nothing, but with float16 tensors it keeps
    small intermediate gradients from underflowing to zero: every
    intermediate gradient is multiplied by the same number.

    Calling an instance returns the loss scale as a scalar float32 tensor;
    ``update()`` updates it from the values of the gradients.  Optimizers use
    these objects to scale the loss and the gradients.

    Most functions that accept a ``LossScale`` also accept an int or a float
    (such as 8), which makes a ``FixedLossScale``, or the string
    ``"dynamic"``, which makes a ``DynamicLossScale``.

    The variables of a subclass (``_add_weight``) are tracked under their
    names, per graph, so ``tf.train.Checkpoint`` saves and restores them.
    """

    def __init__(self):
        self._weights = {}

    @abc.abstractmethod
    def __call__(self):
        """Returns the current loss scale as a scalar ``float32`` tensor."""

    @abc.abstractmethod
    def update(self, grads):
        """Updates the value of the loss scale.

        The loss scale may be updated from the values of ``grads``.  The
        tensor returned by calling this object only changes when this update
        runs: eagerly, the scale is updated at once, so ``__call__`` then
        returns the new value; in a graph, this returns an op that updates the
        scale when it runs.

        Also returns ``should_apply_gradients``: when False, the gradients must
        not be applied to the variables this step, because non-finite
        gradients were found and the loss scale was updated to make them less
        likely next step.  Some loss scales always return True, as they cannot
        adjust themselves to non-finite gradients.

        Under a ``tf.distribute`` strategy this may only be called in a
        cross-replica context.

        Args:
          grads: A nested structure of unscaled gradients, each the gradient
            of the loss with respect to a weight, already divided by the loss
            scale.  ``None`` gradients are accepted and ignored.

        Returns:
          update_op: eagerly ``None``; in a graph, what updates the loss
            scale when run: a bool tensor for ``DynamicLossScale`` (as
            TensorFlow's), a no-op for ``FixedLossScale``.
          should_apply_gradients: a bool or a scalar bool tensor.  If False,
            skip applying ``grads`` this step.
        """

    def _add_weight(self, name, initial_value, dtype=None):
        """Creates a non-trainable variable tracked as ``name`` in the current graph.

        Raises:
          RuntimeError: a variable ``name`` was already added in this graph.
        """
        variable = tf.compat.v1.Variable(
            initial_value=initial_value,
            name=name,
            dtype=dtype,
            trainable=False,
            use_resource=True,
            synchronization=tf.VariableSynchronization.AUTO,
            # Loss-scale variables are never aggregated: every replica
            # computes the same update from the same combined finite flag.
            aggregation=tf.VariableAggregation.NONE)
        key = (name, _compat.graph_key())
        if self._weights.get(key) is not None:
            raise RuntimeError(f"Duplicate variables detected. {key}")
        self._weights[key] = variable
        self._handle_deferred_dependencies(name=name, trackable=variable)
        return variable

    def tracked_weights(self):
        """``{name: variable}`` of the current graph, sorted by name: the
        variables a checkpoint saves, in the order it lists them."""
        graph_key = _compat.graph_key()
        # A subclass that never called LossScale.__init__ has no weights.
        weights = getattr(self, "_weights", None) or {}
        return {name: v for (name, g), v in sorted(weights.items(), key=lambda i: i[0][0])
                if g == graph_key}

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """The weights of the current graph, by name (what checkpoints save)."""
        weights = self.tracked_weights()
        weights.update(super()._trackable_children(save_type, **kwargs))
        return weights

    def _lookup_dependency(self, name, cached_dependencies=None):
        """A weight of the current graph by name (what checkpoints restore into)."""
        unconditional = super()._lookup_dependency(name, cached_dependencies)
        if unconditional is not None:
            return unconditional
        return self._weights.get((name, _compat.graph_key()))

    @abc.abstractmethod
    def get_config(self):
        """Returns the config of this loss scale."""

    @classmethod
    def from_config(cls, config):
        """Creates the loss scale from its config.

        Raises:
          ValueError: ``config`` is not a dict with string keys.
          TypeError: a key is not an argument of the class (named in the message).
        """
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise ValueError(f"{cls.__name__}.from_config: config must be a dict of "
                             f"arguments, got {config!r}.")
        return cls(**config)


class FixedLossScale(LossScale, _TensorFlowFixedLossScale):
    """Loss scale with a fixed value.

    The loss scale is never updated: an instance always returns the same
    number when called, and ``update`` always says to apply the gradients.
    """

    def __init__(self, loss_scale_value):
        """Creates the fixed loss scale.

        Args:
          loss_scale_value: A Python (or numpy) int or float, at least 1.  Its
            best value depends on the model: too small may cost model quality,
            too big may produce inf or NaN.  A relatively big number is
            harmless as long as no inf or NaN shows up during training.

        Raises:
          ValueError: ``loss_scale_value`` is not a number, is below 1, or is
            not finite in float32.
        """
        super().__init__()
        if not is_real_number(loss_scale_value):
            raise ValueError("loss_scale_value must be a Python int or float.")
        if loss_scale_value < 1:
            raise ValueError("loss_scale_value must be at least 1.")
        if loss_scale_value != loss_scale_value or loss_scale_value == math.inf:  # NaN or inf
            raise ValueError(f"loss_scale_value must be finite, got {loss_scale_value}.")
        if loss_scale_value > FLOAT32_MAX:
            # The scale is a float32 tensor: this one would be inf.
            raise ValueError(f"loss_scale_value must fit in float32, got {loss_scale_value}.")
        # A Python float, not a tensor: a tensor made here could live on
        # another device or in another graph than where it is used.
        self._loss_scale_value = float(loss_scale_value)

    def __call__(self):
        return tf.convert_to_tensor(self._loss_scale_value)

    def update(self, grads):
        del grads
        return tf.no_op(), True

    def __repr__(self):
        return f"FixedLossScale({self._loss_scale_value})"

    def get_config(self):
        return {"loss_scale_value": self._loss_scale_value}


class DynamicLossScale(LossScale, _TensorFlowDynamicLossScale):
    """Loss scale that adjusts itself as training progresses.

    The goal is to keep the loss scale as high as possible without the
    gradients overflowing; as long as they do not overflow, a higher loss
    scale never hurts.

    The scale starts at ``initial_loss_scale``.  Every ``increment_period``
    consecutive steps with finite gradients, it is multiplied by
    ``multiplier``.  When a NaN or an inf gradient is found, that step's
    gradients are not applied and the scale is divided by ``multiplier``
    (never below 1).  In float32, step by step, exactly as TensorFlow 2.4:

    * finite gradients: if ``good_steps + 1 >= increment_period``, the scale
      becomes ``scale * multiplier`` if that is finite (else it is kept) and
      ``good_steps`` becomes 0; otherwise ``good_steps`` grows by one;
    * non-finite gradients: ``good_steps`` becomes 0 and the scale becomes
      ``max(scale / multiplier, 1)``.

    The state lives in two non-trainable variables tracked as
    ``current_loss_scale`` (float32) and ``good_steps`` (int64), so a
    checkpoint written with ``tf.compat.v1.mixed_precision.DynamicLossScale``
    restores into this class and back.

    Extensions, keyword-only; each one at its default keeps the rule above
    (and then the object has exactly TensorFlow's two variables and config):

    * ``min_loss_scale`` (default 1, must be > 0): the floor a back-off
      never goes below.
      An initial scale below the floor is kept until the first back-off, as
      in TensorFlow (whose floor is 1).
    * ``max_loss_scale`` (default None: no cap; at least
      ``initial_loss_scale`` and ``min_loss_scale``): growth stops here; a
      growth step that would pass it sets the scale to it.
    * ``backoff_factor`` (default None): when set, a back-off multiplies the
      scale by this number in (0, 1) instead of dividing it by
      ``multiplier``.
    * ``hysteresis`` (default 1): how many *consecutive* non-finite steps
      back the scale off once.  Every non-finite step is skipped and resets
      ``good_steps``; the scale only backs off on the ``hysteresis``-th
      non-finite step in a row, and a finite step resets the run.  The run
      length is state: a variable tracked as ``overflow_run`` (int64), only
      present when ``hysteresis > 1``.
    * ``count_skipped_steps`` (default False): keep the total number of
      skipped (non-finite) steps in a variable tracked as ``skipped_steps``
      (int64), readable through the ``skipped_steps`` property.

    Where this class and TensorFlow's part ways, on purpose: arguments are
    checked when the object is made (TensorFlow takes, say, a zero
    ``increment_period`` or a negative ``multiplier`` without a word); and a
    back-off is the division ``scale / multiplier`` in every mode, whereas
    TensorFlow's class, inside a ``tf.function``, has Grappler turn it into
    ``scale * (1 / multiplier)``, one float32 ulp away when the multiplier is
    not a power of two (eagerly, both divide).
    """

    def __init__(self,
                 initial_loss_scale=DEFAULT_INITIAL_SCALE,  # Starting high is cheap: see below.
                 increment_period=DEFAULT_GROWTH_STEPS,
                 multiplier=2.0,
                 *,
                 min_loss_scale=1.0,
                 max_loss_scale=None,
                 backoff_factor=None,
                 hysteresis=1,
                 count_skipped_steps=False):
        """Creates the dynamic loss scale.

        Args:
          initial_loss_scale: A Python float, the loss scale to start with.
            Better start high: a scale that is too high comes down far more
            quickly than one that is too low goes up.  The default, 2**15, is
            about half the largest float16 value.
          increment_period: The scale grows every ``increment_period``
            consecutive steps with finite gradients; a non-finite gradient
            resets the count to zero.
          multiplier: What the scale is multiplied by when it grows, and
            divided by when it backs off.
          min_loss_scale: Floor of the scale after a back-off.
          max_loss_scale: Cap on the scale when it grows; None for none.
          backoff_factor: None to divide the scale by ``multiplier`` on
            back-off, or a number in (0, 1) to multiply it by instead.
          hysteresis: Consecutive non-finite steps before the scale backs off
            (every one of them is skipped).
          count_skipped_steps: Keep a tracked counter of skipped steps.

        Raises:
          ValueError: an argument is not a number of the right kind or is out
            of its range (named in the message).
        """
        super().__init__()
        self._configure(initial_loss_scale, increment_period, multiplier,
                        min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
                        backoff_factor=backoff_factor, hysteresis=hysteresis,
                        count_skipped_steps=count_skipped_steps)
        self._current_loss_scale = self._add_weight(
            name="current_loss_scale", dtype=tf.float32, initial_value=self._initial_loss_scale)
        # Consecutive steps with finite gradients since the last non-finite
        # one or the last change of the scale.
        self._num_good_steps = self._add_weight(name="good_steps", dtype=tf.int64, initial_value=0)
        # Extension state exists only when asked for, so that an object with
        # the seed's arguments checkpoints exactly like TensorFlow's.
        self._overflow_run = None
        if self._config.hysteresis > 1:
            self._overflow_run = self._add_weight(name="overflow_run", dtype=tf.int64,
                                                  initial_value=0)
        self._skipped_steps = None
        if self._count_skipped_steps:
            self._skipped_steps = self._add_weight(name="skipped_steps", dtype=tf.int64,
                                                   initial_value=0)

    def _configure(self, initial_loss_scale, increment_period, multiplier, *, min_loss_scale=1.0,
                   max_loss_scale=None, backoff_factor=None, hysteresis=1,
                   count_skipped_steps=False):
        """Checks the arguments and keeps them (as the Python numbers the config reports)."""
        self._initial_loss_scale, self._config = dynamic_loss_scale_config(
            initial_loss_scale, increment_period, multiplier, min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale, backoff_factor=backoff_factor, hysteresis=hysteresis)
        if not isinstance(count_skipped_steps, (bool, np.bool_)):
            raise ValueError(f"count_skipped_steps must be a bool, got {count_skipped_steps!r}.")
        self._count_skipped_steps = bool(count_skipped_steps)

    @classmethod
    def _wrapping(cls, reference):
        """An instance over the variables of TensorFlow's DynamicLossScale ``reference``.

        Both objects then read and update the same state (and checkpoint it
        the same way), so passing TensorFlow's object anywhere this package
        takes a loss scale changes nothing but the cost of a step.
        """
        obj = cls.__new__(cls)
        LossScale.__init__(obj)
        obj._configure(**reference.get_config())
        obj._weights, obj._current_loss_scale, obj._num_good_steps = (
            _compat.tensorflow_dynamic_loss_scale_state(reference))
        obj._overflow_run = None
        obj._skipped_steps = None
        return obj

    # The settings and state variables, read-only.
    initial_loss_scale = property(operator.attrgetter("_initial_loss_scale"))
    increment_period = property(operator.attrgetter("_config.increment_period"))
    multiplier = property(operator.attrgetter("_config.multiplier"))
    min_loss_scale = property(operator.attrgetter("_config.min_loss_scale"))
    max_loss_scale = property(operator.attrgetter("_config.cap"),
                              doc="The cap on growth, or None when there is none.")
    backoff_factor = property(operator.attrgetter("_config.backoff_factor"),
                              doc="None when a back-off divides by ``multiplier``.")
    hysteresis = property(operator.attrgetter("_config.hysteresis"))
    skipped_steps = property(
        operator.attrgetter("_skipped_steps"),
        doc="The int64 variable counting skipped steps, or None when not counted.")
    good_steps = property(
        operator.attrgetter("_num_good_steps"),
        doc="The int64 variable counting finite steps since the scale last changed.")
    scale_config = property(operator.attrgetter("_config"),
                            doc="The rule and its settings, a ``lossscale._config.ScaleConfig``.")

    def __call__(self):
        return tf.convert_to_tensor(self._current_loss_scale)

    @property
    def state_variables(self):
        """``(scale, good_steps, overflow_run, skipped_steps)``: the variables one
        step of the rule updates, None for an extension not kept."""
        return (self._current_loss_scale, self._num_good_steps, self._overflow_run,
                self._skipped_steps)

    def step_state(self, is_finite, scale, good_steps, overflow_run=None, skipped=None):
        """One native step of this object's rule on one copy of ``state_variables``
        (a mirrored variable has one per device); returns should_apply."""
        return ops.update_with_config(self._config, is_finite, scale, good_steps,
                                      overflow_run=overflow_run, skipped=skipped)

    def update(self, grads):
        """Updates the loss scale from whether every gradient is finite.

        One native op checks the whole gradient list (per replica under a
        strategy, where the flags are then combined) and one native op
        advances the state.  See ``LossScale.update`` for the contract.
        """
        grads = tf.nest.flatten(grads)
        variables = self.state_variables
        if tf.distribute.has_strategy():
            if not tf.distribute.in_cross_replica_context():
                raise CrossReplicaContextError(
                    "LossScale.update() may only be called in a cross-replica context "
                    "of a tf.distribute strategy, not inside a replica function "
                    "(strategy.run): call it on the per-replica gradients outside it, "
                    "or through tf.distribute.get_replica_context().merge_call.")
            distribution = tf.distribute.get_strategy()

            def replica_is_finite(grads):
                # A float, because strategies cannot reduce booleans.
                return tf.cast(ops.all_finite(grads), tf.float32)

            is_finite_float = distribution.extended.call_for_each_replica(
                replica_is_finite, args=(grads,))
            reduced = distribution.reduce(tf.distribute.ReduceOp.SUM, is_finite_float, axis=None)
            is_finite = tf.equal(reduced, distribution.num_replicas_in_sync)
            if isinstance(self._current_loss_scale, tf.distribute.DistributedValues):
                # One update per copy of the variables, each on its device.
                updates = distribution.extended.update(
                    self._current_loss_scale,
                    lambda scale, *rest: self.step_state(is_finite, scale, *rest),
                    args=variables[1:], group=False)
                update_op = tf.group(tf.nest.flatten(updates))
            else:
                update_op = self.step_state(is_finite, *variables)
        else:
            is_finite = ops.all_finite(grads)
            update_op = self.step_state(is_finite, *variables)
        # should_apply is the flag itself, not the update's output: as in
        # TensorFlow, reading it in a graph does not run the update.
        if tf.executing_eagerly():
            return None, is_finite
        if not isinstance(update_op, tf.Tensor):
            # As TensorFlow's, the update is a bool tensor that tf.identity and
            # Session.run take, not an Operation.
            with tf.control_dependencies([update_op]):
                update_op = tf.identity(is_finite)
        return update_op, is_finite

    def _extension_config(self):
        """The extensions not at their default, as config entries."""
        config = {}
        if self.min_loss_scale != 1.0:
            config["min_loss_scale"] = self.min_loss_scale
        if self.max_loss_scale is not None:
            config["max_loss_scale"] = self.max_loss_scale
        if self.backoff_factor is not None:
            config["backoff_factor"] = self.backoff_factor
        if self.hysteresis != 1:
            config["hysteresis"] = self.hysteresis
        if self._count_skipped_steps:
            config["count_skipped_steps"] = True
        return config

    def __repr__(self):
        extensions = "".join(f", {k}={v}" for k, v in self._extension_config().items())
        if tf.executing_eagerly():
            return (f"DynamicLossScale(current_loss_scale={self._current_loss_scale.numpy()!s}, "
                    f"num_good_steps={self._num_good_steps.numpy()!s}, "
                    f"initial_loss_scale={self.initial_loss_scale}, "
                    f"increment_period={self.increment_period}, "
                    f"multiplier={self.multiplier}{extensions})")
        return (f"DynamicLossScale(initial_loss_scale={self.initial_loss_scale}, "
                f"increment_period={self.increment_period}, "
                f"multiplier={self.multiplier}{extensions})")

    def get_config(self):
        """TensorFlow's three keys, plus each extension that is not at its default."""
        config = {
            "initial_loss_scale": self.initial_loss_scale,
            "increment_period": self.increment_period,
            "multiplier": self.multiplier,
        }
        config.update(self._extension_config())
        return config


_BUILTIN_CLASSES = {
    "FixedLossScale": FixedLossScale,
    "DynamicLossScale": DynamicLossScale,
}


def _from_tensorflow(identifier):
    """Ours for one of TensorFlow's loss-scale objects, or None if it is not one."""
    if _TENSORFLOW is None or not isinstance(identifier, _TENSORFLOW.LossScale):
        return None
    if type(identifier) is _TENSORFLOW.FixedLossScale:
        return FixedLossScale(identifier.get_config()["loss_scale_value"])
    if type(identifier) is _TENSORFLOW.DynamicLossScale:
        return DynamicLossScale._wrapping(identifier)  # pylint: disable=protected-access
    return None


def serialize(loss_scale):
    """The ``{'class_name': ..., 'config': ...}`` form of ``loss_scale`` (None for None)."""
    if loss_scale is None:
        return None
    if not hasattr(loss_scale, "get_config"):
        raise ValueError(f"Cannot serialize {loss_scale!r}: it has no get_config().")
    return {"class_name": type(loss_scale).__name__, "config": loss_scale.get_config()}


def deserialize(config, custom_objects=None):
    """A loss scale from ``serialize``'s form, or from a class name alone.

    Args:
      config: ``{'class_name': name, 'config': dict}`` (extra keys such as
        Keras 3's ``module`` are ignored), a class name (the class is then
        built with no arguments), or None.
      custom_objects: ``{name: class}`` for loss-scale classes of your own;
        they take precedence over the built-in names.

    Raises:
      ValueError: the config is not of that form, or names an unknown class.
    """
    if config is None:
        return None
    if custom_objects is not None and not isinstance(custom_objects, dict):
        raise ValueError(f"custom_objects must be a dict {{name: class}}, got {custom_objects!r}")
    classes = dict(_BUILTIN_CLASSES)
    classes.update(custom_objects or {})
    if isinstance(config, str):
        cls = classes.get(config)
        if cls is None:
            raise ValueError(f"Unknown loss scale: {config}. Please ensure this object is "
                             "passed to the `custom_objects` argument.")
        return cls()
    if not isinstance(config, dict) or "class_name" not in config or "config" not in config:
        raise ValueError(f"Improper config format: {config}")
    if not isinstance(config["class_name"], str) or not isinstance(config["config"], dict):
        raise ValueError(f"Improper config format: {config} ('class_name' must be a string "
                         "and 'config' a dict)")
    cls = classes.get(config["class_name"])
    if cls is None:
        raise ValueError(f"Unknown loss scale: {config['class_name']}. Please ensure this "
                         "object is passed to the `custom_objects` argument.")
    if not callable(getattr(cls, "from_config", None)):
        raise ValueError(f"custom_objects[{config['class_name']!r}] is {cls!r}, not a loss-scale "
                         "class with a from_config method.")
    return cls.from_config(dict(config["config"]))


def from_tensorflow_2_3_optimizer_config(serialized):
    """The loss scale of the ``loss_scale`` entry of a TensorFlow 2.3
    ``LossScaleOptimizer`` config, read as TensorFlow 2.4 read it.

    TensorFlow 2.4's loss-scale optimizers, the experimental one and the
    other, only follow the dynamic rule with multiplier 2, so their
    ``from_config`` refused a ``DynamicLossScale`` with any other: so does
    this, with their message.

    Raises:
      ValueError: a ``DynamicLossScale`` whose multiplier is not 2; or
        ``serialized`` is not what ``get`` takes.
    """
    loss_scale = get(serialized)
    if isinstance(loss_scale, DynamicLossScale) and loss_scale.multiplier != 2:
        raise ValueError("Cannot deserialize LossScaleOptimizer with a DynamicLossScale whose "
                         f"multiplier is not 2. Got DynamicLossScale: {loss_scale}")
    return loss_scale


_ACCEPTED_IDENTIFIERS = (
    "'dynamic' (a DynamicLossScale), an int or float of at least 1 (a FixedLossScale), "
    "a LossScale, a dict from serialize(), None (no loss scale), or one of "
    "tf.compat.v1.mixed_precision's loss scales")


def get(identifier):
    """A loss-scale object from an identifier.

    * an int or a float: ``FixedLossScale(identifier)``;
    * ``"dynamic"``: ``DynamicLossScale()``;
    * a ``LossScale``: itself;
    * None: None;
    * a dict: ``deserialize(identifier)``;
    * one of TensorFlow's own ``tf.compat.v1.mixed_precision`` loss scales:
      the equivalent object of this package (for a ``DynamicLossScale``, one
      that shares its variables).

    Raises:
      ValueError: anything else.
    """
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if is_real_number(identifier):
        try:
            return FixedLossScale(identifier)
        except ValueError as exc:
            # Named as the caller passed it: get() is what loss_scale= goes through.
            raise ValueError(f"Invalid loss_scale={identifier!r}: a number is a FixedLossScale, "
                             f"and {exc}") from None
    if isinstance(identifier, str) and identifier == "dynamic":
        return DynamicLossScale()
    if isinstance(identifier, LossScale):
        return identifier
    if identifier is None:
        return None
    converted = _from_tensorflow(identifier)
    if converted is not None:
        return converted
    hint = ""
    if isinstance(identifier, str) and identifier.strip().lower() == "dynamic":
        hint = " (did you mean 'dynamic'?)"
    raise ValueError(f"Could not interpret loss scale identifier: {identifier!r}{hint}. Accepted: "
                     f"{_ACCEPTED_IDENTIFIERS}.")
