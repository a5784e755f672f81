"""Each private TensorFlow / Keras name ``lossscale._compat`` relies on is still there
and still means what it meant.

One test per trick; a failure names the trick and the private name that
moved, so a TensorFlow or Keras upgrade that breaks one says which.
"""

import keras
import pytest
import tensorflow as tf

from lossscale import _compat


def test_trackable_is_tensorflows_checkpoint_base():
    assert issubclass(tf.compat.v1.mixed_precision.DynamicLossScale, _compat.Trackable), (
        "tf.__internal__.tracking.Trackable is no longer the base class of TensorFlow's own "
        "LossScale: LossScale objects may no longer checkpoint")


def test_graph_key():
    assert _compat.graph_key() is None, "graph_key: not None when executing eagerly"
    with tf.Graph().as_default() as g:
        assert _compat.graph_key() is not None, (
            "graph_key: tf.Graph._graph_key is gone (LossScale weights are keyed by it)")
        assert _compat.graph_key() == g._graph_key  # pylint: disable=protected-access


def test_in_xla_context():
    seen = {}

    @tf.function(jit_compile=True)
    def compiled():
        seen["xla"] = _compat.in_xla_context()
        return tf.constant(0.0)

    @tf.function
    def plain():
        seen["plain"] = _compat.in_xla_context()
        return tf.constant(0.0)

    compiled()
    plain()
    assert seen == {"xla": True, "plain": False}, (
        "in_xla_context: tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext "
        f"no longer tells an XLA-compiled function apart ({seen}); the native op would be "
        "placed where XLA has no kernel")


def test_strategy_supports_no_merge_call():
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        mirrored = _compat.strategy_supports_no_merge_call()
    assert mirrored is False, (
        "tf.__internal__.distribute.strategy_supports_no_merge_call: MirroredStrategy should "
        "use merge calls")


def test_on_device_or_primary():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        v = tf.Variable(3.0)

    def replica_fn():
        copy = _compat.on_device_or_primary(v)
        assert isinstance(copy, tf.Variable), (
            "on_device_or_primary: DistributedValues._get_on_device_or_primary no longer "
            "returns the replica's tf.Variable")
        return copy.read_value()

    assert float(strategy.run(replica_fn)) == 3.0


def test_strategy_cross_device_ops():
    given = tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"], cross_device_ops=given)
    assert _compat.strategy_cross_device_ops(strategy) is given, (
        "strategy_cross_device_ops: MirroredExtended._cross_device_ops is no longer the "
        "cross-device op a MirroredStrategy was given")
    picked = _compat.strategy_cross_device_ops(tf.distribute.MirroredStrategy(["/cpu:0"]))
    assert type(picked) in _compat.tensorflow_cross_device_ops_classes(), (
        "strategy_cross_device_ops: the op MirroredStrategy picks by default "
        f"({type(picked).__name__}) is not one of TensorFlow's own the fused step knows")
    assert all(issubclass(c, tf.distribute.CrossDeviceOps)
               for c in _compat.tensorflow_cross_device_ops_classes()), (
        "tensorflow_cross_device_ops_classes: tensorflow.python.distribute.cross_device_ops."
        "CollectiveAllReduce is no longer a CrossDeviceOps")


def test_tensorflow_loss_scale_module_and_state():
    module = _compat.tensorflow_loss_scale_module()
    assert module is not None, (
        "tensorflow.python.training.experimental.loss_scale is gone: TensorFlow's own "
        "loss-scale objects can no longer be converted")
    assert module.DynamicLossScale is tf.compat.v1.mixed_precision.DynamicLossScale
    reference = module.DynamicLossScale(64.0, 3)
    weights, scale, good_steps = _compat.tensorflow_dynamic_loss_scale_state(reference)
    assert float(scale.numpy()) == 64.0 and int(good_steps.numpy()) == 0, (
        "tensorflow_dynamic_loss_scale_state: TensorFlow's DynamicLossScale no longer keeps "
        "_current_loss_scale / _num_good_steps")
    assert sorted(name for name, _ in weights) == ["current_loss_scale", "good_steps"], (
        "tensorflow_dynamic_loss_scale_state: TensorFlow's DynamicLossScale._weights is no "
        "longer {(name, graph key): variable}")


def test_trainer_class_is_every_models_compile():
    trainer = _compat.trainer_class()
    assert "compile" in trainer.__dict__, (
        "keras.src.trainers.trainer.Trainer no longer defines compile: patch_keras would "
        "patch nothing")
    assert keras.Model.compile is trainer.__dict__["compile"], (
        "keras.Model.compile is no longer keras.src.trainers.trainer.Trainer.compile")


def test_no_automatic_dependency_tracking():
    class Holder(keras.layers.Layer):
        @_compat.no_automatic_dependency_tracking
        def keep(self, value):
            self.kept = value

        def track(self, value):
            self.tracked = value

    layer = Holder()
    layer.track(keras.Variable(1.0))
    layer.keep(keras.Variable(2.0))
    assert [float(w.numpy()) for w in layer.weights] == [1.0], (
        "keras.src.utils.tracking.no_automatic_dependency_tracking no longer keeps an "
        "assignment out of Keras's tracking")


def test_register_serialized_name():
    class PlainPolicy(keras.DTypePolicy):
        pass

    _compat.register_serialized_name(PlainPolicy, keras.DTypePolicy)
    serialized = keras.saving.serialize_keras_object(PlainPolicy("float32"))
    assert serialized["module"] == "keras" and serialized["class_name"] == "DTypePolicy", (
        "register_serialized_name: keras.src.api_export.REGISTERED_OBJS_TO_NAMES no longer "
        f"decides the name Keras writes ({serialized})")


def test_caller_is_keras():
    class Asks:
        def get_config(self):
            return _compat.caller_is_keras()

    assert Asks().get_config() is False, "caller_is_keras: a test module taken for Keras"
    from lossscale.policy import Policy

    serialized = keras.saving.serialize_keras_object(Policy("mixed_float16", loss_scale=8))
    assert "loss_scale" not in serialized["config"], (
        "caller_is_keras: Keras's serializer no longer calls get_config from a keras.* "
        "module two frames up (sys._getframe(2))")


def test_wrapped_tf_variable():
    v = keras.Variable(2.0)
    inner = _compat.wrapped_tf_variable(v)
    assert isinstance(inner, tf.Variable), (
        "wrapped_tf_variable: keras.Variable._value is no longer the tf.Variable")
    assert inner is v.value or float(inner.numpy()) == 2.0
    assert _compat.wrapped_tf_variable(tf.constant(1.0)) is None


def _built_optimizer():
    var = keras.Variable([1.0, 2.0])
    opt = keras.optimizers.SGD(0.1)
    opt.build([var])
    return opt, var


def test_optimizer_trainable_variables():
    opt, var = _built_optimizer()
    assert list(_compat.optimizer_trainable_variables(opt)) == [var], (
        "optimizer_trainable_variables: keras Optimizer._trainable_variables moved")


def test_overwrites_with_gradient():
    opt, var = _built_optimizer()
    assert _compat.overwrites_with_gradient(opt, var) is False
    var.overwrite_with_gradient = True
    assert _compat.overwrites_with_gradient(opt, var) is True, (
        "overwrites_with_gradient: keras Optimizer._overwrite_variable_with_gradient "
        "no longer reads overwrite_with_gradient")


def test_optimizer_iterations():
    opt, _ = _built_optimizer()
    counter = _compat.optimizer_iterations(opt)
    counter.assign_add(3)
    assert int(opt.iterations.numpy()) == 3, (
        "optimizer_iterations: keras Optimizer._iterations is no longer the variable behind "
        "iterations")


def test_optimizer_slots_are_the_ones_update_step_writes():
    import numpy as np

    var = keras.Variable(np.zeros(3, np.float32))
    other = keras.Variable(np.zeros(2, np.float32))
    adam = keras.optimizers.Adam(0.1, amsgrad=True)
    adam.build([other, var])
    adam.apply([np.zeros(2, np.float32), np.full(3, 2.0, np.float32)], [other, var])
    m, = _compat.optimizer_slots(adam, "m", [var])
    v, = _compat.optimizer_slots(adam, "v", [var])
    v_hat, = _compat.optimizer_slots(adam, "v_hat", [var])
    assert np.allclose(m.numpy(), 0.2) and np.allclose(v.numpy(), 0.004), (
        "optimizer_slots: Adam._momentums/_velocities/_get_variable_index moved")
    assert np.array_equal(v_hat.numpy(), v.numpy()), "optimizer_slots: Adam._velocity_hats moved"
    sgd = keras.optimizers.SGD(0.1, momentum=0.5)
    sgd.build([other, var])
    sgd.apply([np.zeros(2, np.float32), np.ones(3, np.float32)], [other, var])
    momentum, = _compat.optimizer_slots(sgd, "momentum", [var])
    assert np.allclose(momentum.numpy(), -0.1), "optimizer_slots: SGD.momentums moved"


def test_uses_weight_decay():
    import numpy as np

    kept = keras.Variable(np.zeros(2, np.float32), name="kept")
    excluded = keras.Variable(np.zeros(2, np.float32), name="excluded_bias")
    opt = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["excluded"])
    opt.build([kept, excluded])
    assert _compat.uses_weight_decay(opt, kept) is True
    assert _compat.uses_weight_decay(opt, excluded) is False, (
        "uses_weight_decay: keras Optimizer._use_weight_decay moved")


def test_check_variables_are_known():
    import numpy as np

    known = keras.Variable(np.zeros(2, np.float32), name="known")
    stranger = keras.Variable(np.zeros(2, np.float32), name="stranger")
    opt = keras.optimizers.SGD(0.1)
    opt.build([known])
    _compat.check_variables_are_known(opt, [known])
    with pytest.raises(ValueError, match="stranger"):
        _compat.check_variables_are_known(opt, [stranger])


def test_tf_keras_loss_scale_optimizer_module():
    import tf_keras  # pylint: disable=import-outside-toplevel

    module = _compat.tf_keras_loss_scale_optimizer_module()
    for name in ("LossScaleOptimizerV3", "LossScaleOptimizer", "BaseLossScaleOptimizer",
                 "_DynamicLossScaleState"):
        assert hasattr(module, name), (
            f"tf_keras_loss_scale_optimizer_module: tf_keras' module has no {name} any more")
    assert tf_keras.mixed_precision.LossScaleOptimizer is module.BaseLossScaleOptimizer
    lso = module.BaseLossScaleOptimizer(tf_keras.optimizers.SGD())
    assert type(lso) is module.LossScaleOptimizerV3
    assert type(lso._loss_scale) is module._DynamicLossScaleState, (  # pylint: disable=protected-access
        "tf_keras' dynamic LossScaleOptimizer no longer keeps its state in a "
        "_DynamicLossScaleState in _loss_scale")
    assert callable(module._DynamicLossScaleState.update)  # pylint: disable=protected-access


def test_tf_keras_model_class_wraps_in_get_optimizer():
    import tf_keras  # pylint: disable=import-outside-toplevel

    model_class = _compat.tf_keras_model_class()
    assert issubclass(tf_keras.Model, model_class)
    assert "_get_optimizer" in model_class.__dict__, (
        "tf_keras_model_class: tf_keras' Model no longer wraps the optimizer in _get_optimizer")
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, dtype="mixed_float16")])
    model.build((None, 2))
    seen = []
    original = model_class.__dict__["_get_optimizer"]

    def spy(self, optimizer):
        seen.append(optimizer)
        return original(self, optimizer)

    model_class._get_optimizer = spy  # pylint: disable=protected-access
    try:
        model.compile("sgd", "mse")
    finally:
        model_class._get_optimizer = original  # pylint: disable=protected-access
    assert seen == ["sgd"], "tf_keras' compile no longer calls Model._get_optimizer"


def test_optimizer_learning_rate_variable():
    optimizer = keras.optimizers.SGD(0.25)
    rate = _compat.optimizer_learning_rate_variable(optimizer)
    assert rate is not None and any(rate is v for v in optimizer.variables), (
        "optimizer_learning_rate_variable: Optimizer._learning_rate is no longer the "
        "learning-rate variable among optimizer.variables")
    assert float(rate.numpy()) == 0.25
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert _compat.optimizer_learning_rate_variable(keras.optimizers.SGD(schedule)) is None


def test_trackable_children_lookup_and_deferred_dependencies():
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    children = _compat.trackable_children(optimizer)
    assert children["_iterations"] is _compat.optimizer_iterations(optimizer), (
        "trackable_children: Trackable._trackable_children no longer lists a Keras "
        "optimizer's counter under _iterations")
    assert _compat.lookup_dependency(optimizer, "_iterations", children) is \
        children["_iterations"], "lookup_dependency: Trackable._lookup_dependency moved"
    assert _compat.lookup_dependency(optimizer, "_iterations") is children["_iterations"]
    assert isinstance(_compat.deferred_dependencies(optimizer), dict), (
        "deferred_dependencies: Trackable._deferred_dependencies is no longer a dict")


def test_same_update_as_sees_an_overridden_step():
    """A subclass that overrides update_step, or the whole step (where Nadam
    moves its state), is not the stock optimizer to the fused families."""
    import keras

    from lossscale import _compat

    class OwnUpdate(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)

    class OwnStep(keras.optimizers.Nadam):
        def _backend_update_step(self, grads, trainable_variables, learning_rate):
            return super()._backend_update_step(grads, trainable_variables, learning_rate)

    assert _compat.same_update_as(keras.optimizers.Adam(), keras.optimizers.Adam)
    assert _compat.same_update_as(keras.optimizers.AdamW(), keras.optimizers.AdamW)
    assert not _compat.same_update_as(OwnUpdate(), keras.optimizers.Adam)
    assert not _compat.same_update_as(OwnStep(), keras.optimizers.Nadam)
    assert hasattr(keras.optimizers.Nadam, "_backend_update_step")


def test_gradient_accumulators_and_their_reset():
    """Where Keras keeps each variable's accumulator, and which of them its
    update step zeroes (all)."""
    import numpy as np

    variables = [keras.Variable(np.ones((2, 3), np.float32), name="a"),
                 keras.Variable(np.ones(4, np.float32), name="b")]
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
    optimizer.build(variables)
    accumulators = _compat.gradient_accumulators(optimizer, variables[::-1])
    assert [tuple(a.shape) for a in accumulators] == [(4,), (2, 3)], (
        "gradient_accumulators: _accumulated_gradients no longer follows _get_variable_index")
    assert all("gradient_accumulator" in a.name for a in accumulators)
    every = _compat.all_gradient_accumulators(optimizer)
    assert sorted(id(a) for a in every) == sorted(id(a) for a in accumulators)
    for a in every:
        a.assign(np.full(a.shape, 0.5, np.float32))
    optimizer._backend_reset_gradient_accumulators()
    assert all(not a.numpy().any() for a in every), (
        "all_gradient_accumulators: Keras' reset zeroes other variables now")


def test_moving_averages_update_and_overwrite():
    """Keras' EMA step (``ema_momentum`` from the second step on) over every
    variable the optimizer was built for, and its overwrite of them."""
    import numpy as np

    variables = [keras.Variable(np.full(3, 2.0, np.float32), name="a"),
                 keras.Variable(np.full(2, -1.0, np.float32), name="b")]
    optimizer = keras.optimizers.SGD(use_ema=True, ema_momentum=0.75)
    optimizer.build(variables)
    averages = optimizer._model_variables_moving_average  # pylint: disable=protected-access
    _compat.update_moving_averages(optimizer)
    assert [a.numpy().tolist() for a in averages] == [[2.0] * 3, [-1.0] * 2], (
        "update_moving_averages: the first step no longer copies the variables")
    optimizer.iterations.assign(1)
    for v in variables:
        v.assign(v * 3.0)
    _compat.update_moving_averages(optimizer)
    m = np.float32(0.75)
    want = [m * np.float32(2.0) + (np.float32(1) - m) * np.float32(6.0),
            m * np.float32(-1.0) + (np.float32(1) - m) * np.float32(-3.0)]
    assert [a.numpy()[0] for a in averages] == want, (
        "update_moving_averages: _update_model_variables_moving_average moved")
    _compat.overwrite_with_moving_averages(optimizer)
    assert [v.numpy()[0] for v in variables] == want, (
        "overwrite_with_moving_averages: _overwrite_model_variables_with_average_value moved")
