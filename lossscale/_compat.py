"""Every private TensorFlow and Keras name this package relies on, in one place.

The rest of the package uses only public APIs and the functions below, so a
TensorFlow or Keras upgrade means reading this file (and running
``tests/test_compat.py``, which checks each of these against the installed
versions and names the one that moved).  Each function says what it reaches
into and why no public API does the job.

What stays elsewhere, on purpose: the optimizer overrides the hooks of its
base class (``_tf_apply``, ``_common_apply``, ``build``'s ``_variables``,
``_iterations``), which is the contract of subclassing
``keras.optimizers.LossScaleOptimizer``; and ``LossScale`` implements
``Trackable``'s checkpoint hooks (``_trackable_children``,
``_lookup_dependency``, ``_handle_deferred_dependencies``), the contract of
subclassing ``Trackable``.
"""

import sys

import tensorflow as tf

__all__ = [
    "Trackable", "trainer_class", "no_automatic_dependency_tracking", "register_serialized_name",
    "caller_is_keras", "graph_key", "in_xla_context", "strategy_supports_no_merge_call",
    "on_device_or_primary", "strategy_cross_device_ops", "tensorflow_cross_device_ops_classes",
    "wrapped_tf_variable", "tensorflow_loss_scale_module",
    "tensorflow_dynamic_loss_scale_state", "optimizer_trainable_variables",
    "overwrites_with_gradient", "optimizer_iterations", "optimizer_slots",
    "uses_weight_decay", "check_variables_are_known",
    "tf_keras_loss_scale_optimizer_module", "tf_keras_model_class",
    "optimizer_learning_rate_variable", "trackable_children", "lookup_dependency",
    "deferred_dependencies", "nadam_u_product", "same_update_as",
    "gradient_accumulators", "all_gradient_accumulators", "update_moving_averages",
    "overwrite_with_moving_averages",
]

# ------------------------------------------------------------- TensorFlow

# The base class of TensorFlow's own LossScale: what tf.train.Checkpoint
# saves and restores.  Only exported under tf.__internal__.
Trackable = tf.__internal__.tracking.Trackable


def graph_key():
    """Key of the graph variables are created in (None when eager), as
    TensorFlow's ``LossScale`` keys its weights: a graph's ``_graph_key``."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()._graph_key  # pylint: disable=protected-access


def in_xla_context():
    """Whether the graph being built is compiled by XLA (``jit_compile=True``),
    which has no kernel for a custom op.  No public API says so."""
    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - private API moved
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()))


def strategy_supports_no_merge_call():
    """Whether the current strategy runs without merge calls (multi-worker),
    as Keras's own optimizers ask it."""
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def on_device_or_primary(variable):
    """The copy of a mirrored variable for the current replica's device, as
    a replica sees it (public only through a read, not as a variable)."""
    return variable._get_on_device_or_primary()  # pylint: disable=protected-access


def strategy_cross_device_ops(strategy):
    """The cross-device op a ``MirroredStrategy`` or
    ``MultiWorkerMirroredStrategy`` all-reduces floating-point values with
    (its ``_cross_device_ops``: the one given to its constructor, or the one
    it picked); no public API names it."""
    return strategy.extended._cross_device_ops  # pylint: disable=protected-access


def tensorflow_cross_device_ops_classes():
    """TensorFlow's own cross-device ops: the public ones and
    ``CollectiveAllReduce`` (what ``MultiWorkerMirroredStrategy``, and
    ``MirroredStrategy`` by default, all-reduce with), which is not exported."""
    from tensorflow.python.distribute import cross_device_ops

    return (tf.distribute.ReductionToOneDevice, tf.distribute.HierarchicalCopyAllReduce,
            tf.distribute.NcclAllReduce, cross_device_ops.CollectiveAllReduce)


def tensorflow_loss_scale_module():
    """TensorFlow's own (deprecated) loss-scale module, or None where it is gone."""
    try:
        from tensorflow.python.training.experimental import loss_scale as module
    except ImportError:  # pragma: no cover - TensorFlow without the v1 classes
        return None
    return module


def tensorflow_dynamic_loss_scale_state(reference):
    """``(weights, current_loss_scale, good_steps)`` of TensorFlow's
    ``DynamicLossScale``: its ``{(name, graph key): variable}`` dict and its
    two variables, which it exposes only as private members."""
    # pylint: disable=protected-access
    return reference._weights, reference._current_loss_scale, reference._num_good_steps


# ------------------------------------------------------------------ Keras
# Imported where used: this module is imported by the parts of the package
# that need no Keras.

def trainer_class():
    """The class whose ``compile`` every Keras model's ``compile`` is
    (``keras.src.trainers.trainer.Trainer``); public Keras exposes only the
    backend-specific subclasses."""
    from keras.src.trainers.trainer import Trainer

    return Trainer


def no_automatic_dependency_tracking(method):
    """Keras's decorator that keeps a method's attribute assignments out of
    the object's tracked state (``keras.src.utils.tracking``)."""
    from keras.src.utils import tracking

    return tracking.no_automatic_dependency_tracking(method)


def register_serialized_name(cls, public_cls):
    """Have Keras write ``cls`` under the registered name of ``public_cls``.

    Only the class -> name direction is registered (Keras's export registry,
    ``keras.src.api_export``): Keras still reads that name as ``public_cls``.
    """
    from keras.src import api_export

    api_export.REGISTERED_OBJS_TO_NAMES[cls] = api_export.get_name_from_symbol(public_cls)


def caller_is_keras():
    """True when the function that called ours was called from Keras itself.

    Keras's serializers call ``get_config`` with no argument saying who asks;
    the caller's module (two frames up: ours, then the ``get_config`` that
    asks) is the only way to tell.
    """
    caller = sys._getframe(2).f_globals.get("__name__", "")  # pylint: disable=protected-access
    return caller == "keras" or caller.startswith("keras.")


def wrapped_tf_variable(variable):
    """The ``tf.Variable`` inside a ``keras.Variable`` on the TensorFlow
    backend (its ``_value``), or None; ``keras.Variable.value`` would read it."""
    inner = getattr(variable, "_value", None)
    return inner if isinstance(inner, tf.Variable) else None


def optimizer_trainable_variables(optimizer):
    """The variables a built Keras optimizer was built for, in order."""
    return optimizer._trainable_variables  # pylint: disable=protected-access


def overwrites_with_gradient(optimizer, variable):
    """Whether Keras assigns the gradient to ``variable`` instead of applying
    it (``overwrite_with_gradient`` variables, e.g. float8 scales)."""
    return optimizer._overwrite_variable_with_gradient(variable)  # pylint: disable=protected-access


def optimizer_iterations(optimizer):
    """The variable behind ``optimizer.iterations`` (the property only reads it)."""
    return optimizer._iterations  # pylint: disable=protected-access


def optimizer_slots(optimizer, kind, variables):
    """The slot variables of ``variables`` in a stock Keras optimizer, where
    its ``update_step`` finds them: ``"momentum"`` (SGD, RMSprop), ``"m"``,
    ``"v"``, ``"v_hat"`` (Adam; Nadam's and Lion's ``m``, ``v`` too),
    ``"velocity"``, ``"average_gradient"`` (RMSprop), ``"accumulator"``
    (Adagrad), ``"adamax_m"``, ``"u"`` (Adamax), ``"adafactor_r"``,
    ``"adafactor_c"``, ``"adafactor_v"`` (Adafactor); ``"average"``, the EMA
    copy of ``use_ema`` (None where Keras keeps none).  Keras keeps them in lists
    indexed by ``_get_variable_index``, private but SGD's."""
    slots = _slot_list(optimizer, kind)
    return [slots[optimizer._get_variable_index(v)]  # pylint: disable=protected-access
            for v in variables]


def _slot_list(optimizer, kind):
    """The list a Keras 3 or current ``tf_keras`` optimizer keeps the slots
    of ``kind`` in (the two name them alike)."""
    attribute = {"momentum": "momentums", "m": "_momentums", "v": "_velocities",
                 "v_hat": "_velocity_hats", "velocity": "_velocities",
                 "average_gradient": "_average_gradients",
                 "accumulator": "_accumulators", "adamax_m": "_m", "u": "_u",
                 "average": "_model_variables_moving_average",
                 "adafactor_r": "_r", "adafactor_c": "_c", "adafactor_v": "_v"}[kind]
    slots = getattr(optimizer, attribute, None)
    if slots is None:  # RMSprop keeps its momentums private
        slots = getattr(optimizer, "_" + attribute)
    return slots


def plain_resource_variable(value):
    """A resource variable of ``value`` made by its own class, which no
    strategy's variable creator intercepts (a ``tf.Variable`` under a
    strategy's scope is mirrored)."""
    from tensorflow.python.ops import resource_variable_ops

    return resource_variable_ops.ResourceVariable(value)


def nadam_u_product(optimizer):
    """Nadam's running product of its momentum schedule, the scalar state
    its ``_backend_update_step`` moves once per applied step."""
    return optimizer._u_product  # pylint: disable=protected-access


def gradient_accumulators(optimizer, variables):
    """The accumulators of ``variables`` in a Keras optimizer built with
    ``gradient_accumulation_steps`` (its ``_accumulated_gradients``, indexed
    by ``_get_variable_index``), where its apply adds each gradient."""
    accumulated = optimizer._accumulated_gradients  # pylint: disable=protected-access
    return [accumulated[optimizer._get_variable_index(v)]  # pylint: disable=protected-access
            for v in variables]


def all_gradient_accumulators(optimizer):
    """Every gradient accumulator of a Keras optimizer built with
    ``gradient_accumulation_steps``: those its update step zeroes
    (``_backend_reset_gradient_accumulators`` assigns zeros to each)."""
    return list(optimizer._accumulated_gradients)  # pylint: disable=protected-access


def moving_average_numbers(optimizer, dtype="float32"):
    """This step's EMA momentum and ``1 - momentum`` (``dtype`` tensors), as
    Keras computes them for every variable in
    ``_update_model_variables_moving_average`` (momentum 0 on the first
    step): ``average = momentum * average + (1 - momentum) * var``."""
    from keras import ops

    not_first_step = ops.not_equal(optimizer.iterations, 0)
    momentum = ops.multiply(ops.cast(not_first_step, dtype), optimizer.ema_momentum)
    return momentum, ops.subtract(1, momentum)


def variable_key(optimizer, variable):
    """The key ``optimizer`` keeps ``variable``'s slots by (one for a Keras
    variable, its ``tf.Variable`` and a mirrored variable's copies)."""
    return optimizer._var_key(variable)  # pylint: disable=protected-access


def update_moving_averages(optimizer, done=()):
    """Moves the EMA of every variable ``optimizer`` was built for, as Keras
    does after each applied step with ``use_ema``
    (``_update_model_variables_moving_average``), but for the variables in
    ``done`` (moved already, by the fused op): those left, with Keras'
    numbers and ops."""
    variables = optimizer._trainable_variables  # pylint: disable=protected-access
    if not done:
        optimizer._update_model_variables_moving_average(  # pylint: disable=protected-access
            variables)
        return
    from keras import ops

    done = {variable_key(optimizer, v) for v in done}
    for var, average in zip(variables, _slot_list(optimizer, "average")):
        if average is not None and variable_key(optimizer, var) not in done:
            momentum, rest = moving_average_numbers(optimizer, var.dtype)
            average.assign(ops.add(ops.multiply(momentum, average), ops.multiply(rest, var)))


def overwrite_with_moving_averages(optimizer):
    """Assigns each variable ``optimizer`` was built for its EMA, as Keras
    does every ``ema_overwrite_frequency`` steps
    (``_overwrite_model_variables_with_average_value``)."""
    optimizer._overwrite_model_variables_with_average_value(  # pylint: disable=protected-access
        optimizer._trainable_variables)  # pylint: disable=protected-access


def uses_weight_decay(optimizer, variable):
    """Whether Keras applies ``weight_decay`` to ``variable`` (not excluded
    by ``exclude_from_weight_decay``).  Keras' TensorFlow backend asks about
    the ``tf.Variable`` under a Keras variable (its ``_apply_weight_decay``),
    whose name is the variable's path (``"dense/kernel:0"``, not
    ``"kernel"``), so a ``var_names`` pattern is matched against the path;
    and Keras keeps the first answer for the variable: the question must be
    asked as stock asks it."""
    value = getattr(variable, "value", None)
    if _is_keras_variable(variable) and isinstance(value, tf.Variable):
        variable = value
    return optimizer._use_weight_decay(variable)  # pylint: disable=protected-access


def _is_keras_variable(variable):
    import keras  # pylint: disable=import-outside-toplevel

    return isinstance(variable, keras.Variable)


def clip_gradients(optimizer, grads):
    """``grads`` clipped by ``optimizer``'s own ``_clip_gradients``: Keras'
    clipnorm, global_clipnorm or clipvalue, its ops in its order."""
    return optimizer._clip_gradients(grads)  # pylint: disable=protected-access


def check_variables_are_known(optimizer, variables):
    """Raises Keras' own ValueError (naming the variable) when ``optimizer``
    was not built with every one of ``variables``, as its ``apply`` does."""
    optimizer._check_variables_are_known(variables)  # pylint: disable=protected-access


# --------------------------------------------------------------- tf_keras
# Legacy Keras 2 (lossscale._tf_keras), imported only where it is in use.

def tf_keras_loss_scale_optimizer_module():
    """``tf_keras``'s loss-scale optimizer module: its ``LossScaleOptimizerV3``,
    legacy ``LossScaleOptimizer``, ``BaseLossScaleOptimizer`` and the
    ``_DynamicLossScaleState`` their dynamic scale lives in, which the public
    ``tf_keras.mixed_precision.LossScaleOptimizer`` (a factory) does not name."""
    from tf_keras.src.mixed_precision import loss_scale_optimizer

    return loss_scale_optimizer


def tf_keras_model_class():
    """The class whose ``_get_optimizer`` every ``tf_keras`` model's ``compile``
    wraps its optimizer with (``tf_keras.src.engine.training.Model``); no
    public hook decides the loss-scale wrapping."""
    from tf_keras.src.engine import training

    return training.Model


def same_update_as(optimizer, cls):
    """Whether ``optimizer`` updates as the stock ``cls`` does: a subclass may
    override ``update_step`` or the whole step, ``_backend_update_step``
    (where Nadam moves its own state)."""
    kind = type(optimizer)
    return (kind.update_step is cls.update_step
            and kind._backend_update_step is cls._backend_update_step)  # pylint: disable=protected-access


def optimizer_learning_rate_variable(optimizer):
    """The variable a Keras optimizer keeps its learning rate in, or None when
    the rate is a schedule or a callable (``learning_rate`` reads it through)."""
    import keras

    rate = getattr(optimizer, "_learning_rate", None)  # pylint: disable=protected-access
    return rate if isinstance(rate, keras.Variable) else None


def trackable_children(trackable, save_type="checkpoint", **kwargs):
    """What a checkpoint saves under ``trackable``: ``{name: child}``, from
    the ``Trackable`` hook that has no public counterpart."""
    return trackable._trackable_children(save_type, **kwargs)  # pylint: disable=protected-access


def lookup_dependency(trackable, name, cached_dependencies=None):
    """The child ``name`` of ``trackable`` a checkpoint restores into, or None."""
    return trackable._lookup_dependency(name, cached_dependencies)  # pylint: disable=protected-access


def deferred_dependencies(trackable):
    """The restorations ``trackable`` holds for children not made yet."""
    return trackable._deferred_dependencies  # pylint: disable=protected-access


# =====================================================================
# tf_keras: the compile hook and the native loss-scale optimizer
# (lossscale._compile_hook, lossscale._tf_keras).  New functions of this
# section go below; the sections above are for everything else.

__all__ += [
    "tf_keras_optimizer_wrapping_method", "tf_keras_dynamic_loss_scale_state_class",
    "tf_keras_update_dynamic_state_with", "tf_keras_note_gradients_unscaled",
]


def tf_keras_optimizer_wrapping_method():
    """``(class, name)`` of the method that wraps ``compile``'s optimizer in
    every ``tf_keras`` model: ``Model._get_optimizer(self, optimizer)``, which
    takes what was passed to ``compile`` (an optimizer, a name or a nest of
    them) and returns what the model trains with.  It is where ``tf_keras``
    decides on loss-scale wrapping, and no public hook exists; the compile
    hook (``lossscale._compile_hook``) replaces it."""
    return tf_keras_model_class(), "_get_optimizer"


def tf_keras_dynamic_loss_scale_state_class():
    """``tf_keras``' ``_DynamicLossScaleState``: the trackable that holds a
    dynamic loss-scale optimizer's ``current_loss_scale`` and ``good_steps``
    variables and whose ``update(grads)`` steps them.  Not exported."""
    module = tf_keras_loss_scale_optimizer_module()
    return module._DynamicLossScaleState  # pylint: disable=protected-access


def tf_keras_update_dynamic_state_with(optimizer, state_class):
    """Has the dynamic loss-scale state of ``optimizer``, a ``tf_keras``
    loss-scale optimizer just constructed, update by ``state_class``, a
    subclass of ``tf_keras_dynamic_loss_scale_state_class()`` that adds no
    state; nothing happens for a fixed loss scale.

    ``tf_keras`` makes the state (its ``_loss_scale``) inside the optimizer's
    constructor and offers no way to choose its class.  Changing the class of
    that very object keeps its variables, their creation order and their
    tracking, so checkpoints and ``get_config`` stay exactly ``tf_keras``'.
    """
    state = optimizer._loss_scale  # pylint: disable=protected-access
    if isinstance(state, tf_keras_dynamic_loss_scale_state_class()):
        state.__class__ = state_class


def tf_keras_note_gradients_unscaled(optimizer):
    """Records on a ``tf_keras`` loss-scale optimizer that its
    ``get_unscaled_gradients`` ran, as ``tf_keras``' own does (its
    ``apply_gradients`` warns when a custom loop forgot to unscale)."""
    optimizer._gradients_have_been_unscaled = True  # pylint: disable=protected-access


class TfKerasBatchHooks:
    """Mixin before ``keras.callbacks.Callback`` for a Keras 3 callback that
    ``tf_keras``' ``fit`` runs too: ``tf_keras``' ``CallbackList`` asks each
    callback which batch hooks it implements
    (``_implements_{train,test,predict}_batch_hooks``), methods Keras 3's
    ``Callback`` lacks.  The answer is ``tf_keras``' own: whether the class
    overrides that mode's ``on_*_batch_begin`` or ``on_*_batch_end``."""

    def _overrides_batch_hooks(self, mode):
        import keras

        base = keras.callbacks.Callback
        return any(getattr(type(self), hook) is not getattr(base, hook)
                   for hook in (f"on_{mode}_batch_begin", f"on_{mode}_batch_end"))

    def _implements_train_batch_hooks(self):
        return self._overrides_batch_hooks("train")

    def _implements_test_batch_hooks(self):
        return self._overrides_batch_hooks("test")

    def _implements_predict_batch_hooks(self):
        return self._overrides_batch_hooks("predict")


__all__ += ["TfKerasBatchHooks"]


# ------------------------------------------------- tf_keras: the fused step
# (lossscale._fused's tf_keras families)

__all__ += [
    "tf_keras_same_update_as", "tf_keras_optimizer_slots", "tf_keras_unknown_variable",
    "tf_keras_learning_rate_schedule", "tf_keras_uses_dtensor", "tf_keras_legacy_same_update_as",
    "tf_keras_legacy_learning_rate", "tf_keras_legacy_hyper", "tf_keras_legacy_has_momentum",
    "tf_keras_legacy_create_weights", "tf_keras_warn_about_scaling",
    "tf_keras_update_moving_averages", "tf_keras_overwrite_with_moving_averages",
]


def tf_keras_same_update_as(optimizer, cls):
    """Whether a current ``tf_keras`` optimizer updates as the stock ``cls``:
    a subclass may override ``update_step`` or the weight decay
    (``_apply_weight_decay``)."""
    kind = type(optimizer)
    return (kind.update_step is cls.update_step
            and kind._apply_weight_decay is cls._apply_weight_decay)  # pylint: disable=protected-access


def tf_keras_optimizer_slots(optimizer, kind, variables):
    """The slot variables of ``variables`` in a current ``tf_keras`` optimizer,
    where its ``update_step`` finds them: in the lists Keras 3 names alike,
    indexed by ``_index_dict[_var_key(variable)]``."""
    slots = _slot_list(optimizer, kind)
    index = optimizer._index_dict  # pylint: disable=protected-access
    return [slots[index[optimizer._var_key(v)]] for v in variables]  # pylint: disable=protected-access


def tf_keras_update_moving_averages(optimizer, variables):
    """Moves the EMA of ``variables`` as a current ``tf_keras`` optimizer
    with ``use_ema`` does after an applied step's updates
    (``_update_model_variables_moving_average``: ``ema_momentum * average +
    (1 - ema_momentum) * var``)."""
    optimizer._update_model_variables_moving_average(  # pylint: disable=protected-access
        list(variables))


def tf_keras_overwrite_with_moving_averages(optimizer, variables):
    """Assigns ``variables`` their EMA, as a current ``tf_keras`` optimizer
    does every ``ema_overwrite_frequency`` steps
    (``_overwrite_model_variables_with_average_value``)."""
    optimizer._overwrite_model_variables_with_average_value(  # pylint: disable=protected-access
        list(variables))


def tf_keras_unknown_variable(optimizer, variables):
    """The first of ``variables`` a built current ``tf_keras`` optimizer has
    no slots for (its ``_update_step`` raises a KeyError for it), or None."""
    index = optimizer._index_dict  # pylint: disable=protected-access
    return next((v for v in variables
                 if optimizer._var_key(v) not in index), None)  # pylint: disable=protected-access


def tf_keras_learning_rate_schedule(optimizer):
    """``(schedule, variable)`` of a current ``tf_keras`` optimizer built with
    a learning-rate schedule: ``apply_gradients`` first records
    ``schedule(iterations)`` in ``variable`` (``_current_learning_rate``),
    which ``learning_rate`` then reads; ``(None, None)`` for a plain rate."""
    from tf_keras.src.optimizers.schedules import learning_rate_schedule

    schedule = optimizer._learning_rate  # pylint: disable=protected-access
    if isinstance(schedule, learning_rate_schedule.LearningRateSchedule):
        return schedule, optimizer._current_learning_rate  # pylint: disable=protected-access
    return None, None


def tf_keras_uses_dtensor(optimizer):
    """Whether a current ``tf_keras`` optimizer runs under DTensor (a mesh),
    where its step skips the strategy logic."""
    return bool(optimizer._mesh or optimizer._run_with_dtensor)  # pylint: disable=protected-access


def tf_keras_legacy_same_update_as(optimizer, cls):
    """Whether a legacy ``tf_keras`` optimizer updates as the stock ``cls``:
    a subclass may override the dense update or the scalars it prepares."""
    kind = type(optimizer)
    return (kind._resource_apply_dense is cls._resource_apply_dense  # pylint: disable=protected-access
            and kind._prepare_local is cls._prepare_local  # pylint: disable=protected-access
            and kind._decayed_lr is cls._decayed_lr)  # pylint: disable=protected-access


def tf_keras_legacy_learning_rate(optimizer):
    """A legacy ``tf_keras`` optimizer's learning rate of this step, float32,
    as its ``_prepare_local`` computes it (the schedule at ``iterations``,
    then the ``decay``)."""
    return tf.identity(optimizer._decayed_lr(tf.float32))  # pylint: disable=protected-access


def tf_keras_legacy_transform_gradients(optimizer, grads, variables):
    """``grads`` clipped by a legacy ``tf_keras`` optimizer's own
    ``_transform_gradients`` (its clipvalue, clipnorm and global_clipnorm, in
    that order, its ops in its order)."""
    pairs = optimizer._transform_gradients(list(zip(grads, variables)))  # pylint: disable=protected-access
    return [g for g, _ in pairs]


def tf_keras_legacy_apply_sparse(optimizer, values, variable, indices):
    """A sparse gradient's update of ``variable`` by a legacy ``tf_keras``
    optimizer's own ``_resource_apply_sparse_duplicate_indices`` (what its
    ``apply_gradients`` runs for an ``IndexedSlices``, its scalars prepared
    for the variable's device and dtype as its fallback prepares them)."""
    return optimizer._resource_apply_sparse_duplicate_indices(  # pylint: disable=protected-access
        values, variable, indices)


def tf_keras_legacy_hyper(optimizer, name):
    """The float32 value of a legacy ``tf_keras`` optimizer's hyperparameter
    (its variable, or what a callable gives), read as its step reads it."""
    return tf.identity(optimizer._get_hyper(name, tf.float32))  # pylint: disable=protected-access


def tf_keras_legacy_aggregates_its_own_way(optimizer):
    """Whether a legacy ``tf_keras`` optimizer was given a
    ``gradient_aggregator`` of its own (its default is
    ``optimizer_utils.all_reduce_sum_gradients``)."""
    from tf_keras.src.optimizers import utils as optimizer_utils

    return optimizer.gradient_aggregator is not optimizer_utils.all_reduce_sum_gradients


def tf_keras_legacy_has_momentum(optimizer):
    """Whether a legacy ``tf_keras`` SGD or RMSprop keeps momentum slots (its
    ``_momentum``, set from the constructor's ``momentum``)."""
    return bool(optimizer._momentum)  # pylint: disable=protected-access


def tf_keras_legacy_create_weights(optimizer, variables):
    """Creates a legacy ``tf_keras`` optimizer's ``iterations``, hyperparameter
    variables and the slots of ``variables``, as its ``apply_gradients``
    does first (in its name scope, lifted out of any function)."""
    with tf.name_scope(optimizer._name), tf.init_scope():  # pylint: disable=protected-access
        optimizer._create_all_weights(variables)  # pylint: disable=protected-access


def tf_keras_warn_about_scaling(optimizer):
    """``tf_keras``' warning when a custom loop forgot to scale the loss or to
    unscale the gradients, as its loss-scale optimizers' ``apply_gradients``
    gives it."""
    # pylint: disable=protected-access
    tf_keras_loss_scale_optimizer_module()._maybe_warn_about_scaling(
        optimizer._loss_has_been_scaled, optimizer._gradients_have_been_unscaled)
