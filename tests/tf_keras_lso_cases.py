"""``tf_keras``' own loss-scale optimizer tests, as checks of ours: run by
``test_tf_keras.py`` in a child pytest with ``TF_USE_LEGACY_KERAS=1``.

The behaviours ``tf_keras/mixed_precision/loss_scale_optimizer_test.py``
tests, each checked against ``tf_keras``' own class on the same input:
configs of every form (``tf_keras``' for both optimizer kinds, TensorFlow
2.3's fixed and dynamic, the refused multiplier) read by ``from_config``
and by ``tf_keras.optimizers.deserialize``; ``weights``/``get_weights``/
``set_weights``/``variables()``; checkpoints written by one and restored by
the other; hyperparameters read and set through the wrapper; ``iterations``;
the loss scale's steps with finite and non-finite gradients, clipping,
slots and float16 losses, eagerly, in ``tf.function`` and under a
``MirroredStrategy`` (one CPU replica), every variable bit for bit; the
scaling warnings; and the errors, by class and message.  Where ours
differs on purpose (one public class for both optimizer kinds), the check
says so.
"""

import os
import re
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.python.platform import tf_logging
from tf_keras.src.mixed_precision import loss_scale_optimizer as stock_module

import lossscale
from lossscale import _tf_keras
from helpers import assert_same_bits

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "run by test_tf_keras.py"

OURS = lossscale.LossScaleOptimizer
KINDS = ["legacy", "v3"]
OUR_CLASS = {"legacy": _tf_keras.LegacyLossScaleOptimizer, "v3": _tf_keras.LossScaleOptimizerV3}
STOCK_CLASS = {"legacy": stock_module.LossScaleOptimizer, "v3": stock_module.LossScaleOptimizerV3}
STRATEGIES = {"default": tf.distribute.get_strategy,
              "mirrored": lambda: tf.distribute.MirroredStrategy(["cpu:0"])}


def _sgd(kind, *args, **kwargs):
    cls = tf_keras.optimizers.legacy.SGD if kind == "legacy" else tf_keras.optimizers.SGD
    return cls(*args, **kwargs)


def _pair(kind, *args, make_inner=None, **kwargs):
    """Ours and the stock optimizer, each over its own fresh inner optimizer."""
    make_inner = make_inner or (lambda: _sgd(kind, 2.0, momentum=0.5))
    return (OURS(make_inner(), *args, **kwargs),
            tf_keras.mixed_precision.LossScaleOptimizer(make_inner(), *args, **kwargs))


def _state(opt, var):
    state = [var, opt.loss_scale, opt.iterations]
    if opt.dynamic:
        state.append(opt.dynamic_counter)
    return [np.asarray(tf.convert_to_tensor(v).numpy()) for v in state]


def _assert_same_state(ours, stock, ours_var, stock_var, what):
    for i, (a, b) in enumerate(zip(_state(ours, ours_var), _state(stock, stock_var))):
        assert_same_bits(a, b, f"{what}, state {i}")


def _lockstep(ours, stock, losses, strategy=None, use_tf_function=False, init=(5.0, -3.0)):
    """``minimize`` each loss of ``losses`` (functions of the variable) with both
    optimizers, comparing the state after every step."""
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        ours_var, stock_var = tf.Variable(list(init)), tf.Variable(list(init))
    for step, loss in enumerate(losses):
        for opt, var in ((ours, ours_var), (stock, stock_var)):
            def run(opt=opt, var=var, loss=loss):
                opt.minimize(lambda: loss(var), var_list=[var])

            strategy.run(tf.function(run) if use_tf_function else run)
        _assert_same_state(ours, stock, ours_var, stock_var, f"step {step}")
    return ours_var, stock_var


def _error(fn):
    with pytest.raises(Exception) as info:  # The oracle's class is compared.
        fn()
    return type(info.value), str(info.value)


# ---------------------------------------------------------------- configs

def _keras2_sgd_config():
    return {"class_name": "SGD", "config": {"learning_rate": 2.0, "momentum": 0.5, "decay": 0.0,
                                            "nesterov": False, "name": "SGD"}}


def _tf23_config(loss_scale):
    return {"optimizer": _keras2_sgd_config(), "loss_scale": loss_scale}


_TF23_FIXED = {"class_name": "FixedLossScale", "config": {"loss_scale_value": 2.0}}
_TF23_DYNAMIC = {"class_name": "DynamicLossScale",
                 "config": {"initial_loss_scale": 2.0, "increment_period": 3, "multiplier": 2.0}}


def _config_of(form, kind, dynamic):
    """A config of ``form`` and the stock class that reads it."""
    if form == "tf2_3":
        return _tf23_config(_TF23_DYNAMIC if dynamic else _TF23_FIXED), STOCK_CLASS["legacy"]
    arguments = dict(initial_scale=2.0, dynamic_growth_steps=3) if dynamic else \
        dict(dynamic=False, initial_scale=2.0)
    writer = {"ours": OURS, "stock": tf_keras.mixed_precision.LossScaleOptimizer}[form]
    return writer(_sgd(kind, 2.0, momentum=0.5), **arguments).get_config(), STOCK_CLASS[kind]


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("form, kind", [("ours", "legacy"), ("ours", "v3"), ("stock", "legacy"),
                                        ("stock", "v3"), ("tf2_3", "legacy")])
def test_from_config_of_every_form(form, kind, dynamic):
    config, stock_class = _config_of(form, kind, dynamic)
    ours = OURS.from_config(dict(config))
    stock = stock_class.from_config(dict(config))
    assert type(ours) is OUR_CLASS[kind] and isinstance(ours, stock_class)
    assert ours.get_config() == stock.get_config()
    assert (ours.dynamic, ours.initial_scale, ours.dynamic_growth_steps) == (
        stock.dynamic, stock.initial_scale, stock.dynamic_growth_steps)
    assert (ours.dynamic_counter is None) == (not dynamic)
    assert float(ours.learning_rate) == float(stock.learning_rate) == 2.0
    assert float(ours.inner_optimizer.momentum) == 0.5
    # The optimizer read back trains as the stock one read back.
    nan_step = lambda v: v * float("nan")  # noqa: E731
    _lockstep(ours, stock, [lambda v: v * 2.0] * 4 + [nan_step] + [lambda v: v * v] * 3)


@pytest.mark.parametrize("multiplier", [4.0, 3.0, 1.0])
def test_from_config_refuses_a_multiplier_other_than_2(multiplier):
    config = _tf23_config({"class_name": "DynamicLossScale",
                           "config": {"initial_loss_scale": 2.0, "increment_period": 3,
                                      "multiplier": multiplier}})
    want = _error(lambda: STOCK_CLASS["legacy"].from_config(dict(config)))
    assert want[0] is ValueError and want[1].startswith(
        "Cannot deserialize LossScaleOptimizer with a DynamicLossScale whose multiplier is not 2. "
        "Got DynamicLossScale: DynamicLossScale(")
    assert _error(lambda: OURS.from_config(dict(config))) == want


def test_from_config_refuses_a_config_of_no_form():
    for config in ({"loss_scale": _TF23_FIXED}, {"learning_rate": 1.0}, None):
        with pytest.raises(ValueError, match="inner_optimizer"):
            OURS.from_config(config)
    # What tf_keras' rule cannot follow is named: TensorFlow 2.3 had no such setting.
    config = _tf23_config({"class_name": "DynamicLossScale", "config": {"hysteresis": 2}})
    with pytest.raises(ValueError, match="hysteresis"):
        OURS.from_config(config)


@pytest.mark.parametrize("kind", KINDS)
def test_serialization_round_trips(kind):
    ours, stock = _pair(kind, initial_scale=2.0, dynamic_growth_steps=3)
    again = tf_keras.optimizers.deserialize(tf_keras.optimizers.serialize(ours))
    assert type(again) is OUR_CLASS[kind]
    assert again.get_config() == ours.get_config() == stock.get_config()
    # The stock one's serialized form reads back as the stock one, as before.
    stock_again = tf_keras.optimizers.deserialize(tf_keras.optimizers.serialize(stock))
    assert type(stock_again) is STOCK_CLASS[kind]
    _lockstep(again, stock_again, [lambda v: v * 2.0] * 3)


@pytest.mark.parametrize("kind", KINDS)
def test_serialization_with_a_custom_optimizer(kind):
    sgd_class = type(_sgd(kind))

    class MySGD(sgd_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.my_attribute = 123

    ours = OURS(MySGD(2.0, momentum=0.5), initial_scale=2.0, dynamic_growth_steps=3)
    config = ours.get_config()
    again = OURS.from_config(config, custom_objects={"MySGD": MySGD})
    assert type(again.inner_optimizer) is MySGD and again.inner_optimizer.my_attribute == 123
    assert (float(again.loss_scale), again.dynamic_growth_steps) == (2.0, 3)
    again = tf_keras.optimizers.deserialize(tf_keras.optimizers.serialize(ours),
                                            custom_objects={"MySGD": MySGD})
    assert type(again) is OUR_CLASS[kind] and type(again.inner_optimizer) is MySGD


# ---------------------------------------------------------------- state

def test_weight_methods():
    ours, stock = _pair("legacy", initial_scale=2.0, dynamic_growth_steps=1,
                        make_inner=lambda: _sgd("legacy", 1.0))
    ours_var, stock_var = _lockstep(ours, stock, [lambda v: v * 2])
    for opt in (ours, stock):
        assert len(opt.weights) == 1 and int(opt.weights[0].numpy()) == 1
        assert opt.get_weights()[0] == 1 and int(opt.variables()[0].numpy()) == 1
        opt.set_weights([np.array(2)])
        assert int(opt.variables()[0].numpy()) == 2
    _assert_same_state(ours, stock, ours_var, stock_var, "after set_weights")


def test_iterations_are_the_inner_optimizers():
    ours, stock = _pair("legacy", dynamic=False, initial_scale=10.0)
    for opt in (ours, stock):
        opt.iterations = 7
        assert int(opt.iterations) == 7 and int(opt.inner_optimizer.iterations) == 7


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("write, read", [("ours", "stock"), ("stock", "ours"), ("ours", "ours")])
def test_checkpoints_move_between_ours_and_stock(kind, write, read, tmp_path):
    sgd_class = type(_sgd(kind))

    class MySGD(sgd_class):
        """Tracks an extra variable, which the checkpoint must carry."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.my_var = tf.Variable(0.0)
            self._track_trackable(self.my_var, "my_var")

    make = {"ours": OURS, "stock": tf_keras.mixed_precision.LossScaleOptimizer}
    var = tf.Variable([2.0])
    inner = MySGD(1.0, momentum=1.0)
    opt = make[write](inner, initial_scale=4.0, dynamic_growth_steps=2)
    for loss in (lambda: var + 1.0, lambda: var * float("inf"), lambda: var / 2.0):
        opt.minimize(loss, var_list=[var])
    inner.my_var.assign(1.0)
    path = tf.train.Checkpoint(optimizer=opt, var=var).save(str(tmp_path / "ckpt"))

    var2 = tf.Variable([0.0])
    inner2 = MySGD(1.0, momentum=1.0)
    opt2 = make[read](inner2, initial_scale=1.0, dynamic_growth_steps=2)
    status = tf.train.Checkpoint(optimizer=opt2, var=var2).restore(path)
    status.assert_existing_objects_matched()
    assert float(var2.numpy()[0]) == float(var.numpy()[0]) and float(inner2.my_var) == 1.0
    assert_same_bits(opt2.loss_scale.numpy(), opt.loss_scale.numpy(), "scale")
    assert int(opt2.dynamic_counter.numpy()) == int(opt.dynamic_counter.numpy())
    assert int(opt2.iterations.numpy()) == int(opt.iterations.numpy())
    # The slots, made by the next step, restore too: both go on identically.
    for o, v in ((opt, var), (opt2, var2)):
        o.minimize(lambda v=v: v * 3.0, var_list=[v])
    _assert_same_state(opt2, opt, var2, var, "after restore")


# ------------------------------------------------------- hyperparameters

def test_hyperparameters_are_the_inner_optimizers():
    make_adam = lambda: tf_keras.optimizers.legacy.Adam(learning_rate=1.0, beta_1=0.5,  # noqa: E731
                                                        beta_2=0.9)
    ours, stock = _pair("legacy", make_inner=make_adam)
    for lso in (ours, stock):
        opt = lso.inner_optimizer
        assert float(lso.beta_1) == 0.5 and isinstance(lso.beta_1, tf.Variable)
        assert lso.lr is opt.lr and lso.lr is lso.learning_rate
        lso.beta_1 = 0.25
        assert float(opt.beta_1) == 0.25 and lso.beta_1 is opt.beta_1
        opt.beta_1 = 0.75
        assert float(lso.beta_1) == 0.75
        lso.lr = 2.0
        assert float(opt.learning_rate) == 2.0 and lso.lr is opt.lr
    make_v3 = lambda: tf_keras.optimizers.Adam(learning_rate=1.0, beta_1=0.5)  # noqa: E731
    ours, stock = _pair("v3", make_inner=make_v3)
    for lso in (ours, stock):
        lso.learning_rate = tf.Variable(0.005)
        assert lso.learning_rate is lso.inner_optimizer.learning_rate
        lso.use_ema, lso.ema_momentum = True, 0.88
        assert (lso.inner_optimizer.use_ema, lso.inner_optimizer.ema_momentum) == (True, 0.88)


@pytest.mark.parametrize("kind", KINDS)
def test_other_inner_attributes_are_not_exposed(kind):
    ours, stock = _pair(kind, make_inner=lambda: _sgd(kind))
    if kind == "legacy":
        for lso in (ours, stock):
            assert {"learning_rate", "lr", "minimize", "loss_scale"} <= set(dir(lso))
            assert "nesterov" not in dir(lso) and "nesterov" in dir(lso.inner_optimizer)
    for lso in (ours, stock):
        assert lso.inner_optimizer.nesterov is False
        # The message names the class: ours is LegacyLossScaleOptimizer or
        # LossScaleOptimizerV3 (the stock ones: LossScaleOptimizer(V3)).
        with pytest.raises(AttributeError,
                           match=f"'{type(lso).__name__}' object has no attribute 'nesterov'"):
            lso.nesterov  # pylint: disable=pointless-statement
        lso.nesterov = True
        assert lso.nesterov is True and lso.inner_optimizer.nesterov is False


def test_a_wrapped_wrapper_exposes_the_learning_rate():
    for kind in KINDS:
        base = type(_sgd(kind)).__mro__[1]

        class MyOptimizer(base):
            def __init__(self):
                super().__init__("MyOptimizer")
                self.inner_optimizer = _sgd(kind, learning_rate=1.0)

            @property
            def learning_rate(self):
                return self.inner_optimizer.learning_rate

            @learning_rate.setter
            def learning_rate(self, value):
                self.inner_optimizer.learning_rate = value

            def get_config(self):
                return {}

        opt = OURS(MyOptimizer())
        assert float(opt.learning_rate) == 1.0
        opt.learning_rate = 2.0
        assert float(opt.inner_optimizer.inner_optimizer.learning_rate) == 2.0


# ----------------------------------------------------------------- steps

def _double(v):
    return v * 2.0


def _square(v):
    return v * v / 8.0


def _sum(v):
    return tf.reduce_sum(v) * 3.0


def _nan(v):
    return v * float("nan")


def _inf(v):
    return v * float("inf")


def _losses():
    finite = [_double, _square, _sum]
    return finite * 2 + [_nan] + finite + [_inf] + finite


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("use_tf_function", [False, True])
@pytest.mark.parametrize("arguments", [dict(initial_scale=2, dynamic_growth_steps=1),
                                       dict(initial_scale=2**15, dynamic_growth_steps=2),
                                       dict(dynamic=False, initial_scale=10.0)],
                         ids=["dynamic-1", "dynamic-2", "fixed"])
def test_steps_in_lockstep(kind, strategy, use_tf_function, arguments):
    strategy = STRATEGIES[strategy]()
    with strategy.scope():
        ours, stock = _pair(kind, **arguments)
    losses = _losses() if arguments.get("dynamic", True) else _losses()[:6]
    _lockstep(ours, stock, losses, strategy, use_tf_function)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_tf_function", [False, True])
@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_clipping_in_lockstep(kind, use_tf_function, clip):
    ours, stock = _pair(kind, initial_scale=2, dynamic_growth_steps=1,
                        make_inner=lambda: _sgd(kind, 2.0, **{clip: 2.0}))
    _lockstep(ours, stock, [lambda v: v * 4.0, lambda v: v * float("inf"), lambda v: v * 4.0],
              use_tf_function=use_tf_function)


@pytest.mark.parametrize("kind", KINDS)
def test_float16_loss_and_slots_in_lockstep(kind):
    ours, stock = _pair(kind, initial_scale=2, dynamic_growth_steps=1,
                        make_inner=lambda: _sgd(kind, 1.0, momentum=1.0))
    _lockstep(ours, stock, [lambda v: tf.cast(v, "float16"), lambda v: v,
                            lambda v: tf.cast(v * float("inf"), "float16"), lambda v: v])
    if kind == "legacy":
        assert ours.get_slot_names() == stock.get_slot_names() == ["momentum"]


def test_a_custom_aggregator_that_makes_a_nan():
    def gradient_aggregator(grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        last_grad, last_var = grads_and_vars[-1]
        grads_and_vars[-1] = (last_grad * float("NaN"), last_var)
        return grads_and_vars

    ours, stock = _pair("legacy", initial_scale=2, dynamic_growth_steps=2,
                        make_inner=lambda: _sgd("legacy", 1.0,
                                                gradient_aggregator=gradient_aggregator))
    ours_var, _ = _lockstep(ours, stock, [lambda v: v * 2])
    assert ours_var.numpy().tolist() == [5.0, -3.0] and float(ours.loss_scale) == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_scaled_loss_and_unscaled_gradients(kind):
    ours, stock = _pair(kind, dynamic=False, initial_scale=2)
    for loss in (tf.constant(5.0), tf.constant(5.0, "float16")):
        assert_same_bits(ours.get_scaled_loss(loss).numpy(), stock.get_scaled_loss(loss).numpy())
        assert_same_bits(ours.get_scaled_loss(lambda loss=loss: loss)().numpy(),
                         stock.get_scaled_loss(lambda loss=loss: loss)().numpy())
    grads = [tf.constant(3.0), None, tf.constant(-4.0, "float16"),
             tf.IndexedSlices(tf.constant([[4.0, 2.0], [8.0, 5.0]]), tf.constant([1, 3]),
                              dense_shape=tf.constant([5, 2]))]
    got, want = ours.get_unscaled_gradients(grads), stock.get_unscaled_gradients(grads)
    assert got[1] is None and isinstance(got[3], tf.IndexedSlices)
    for g, w in ((got[0], want[0]), (got[2], want[2]), (got[3].values, want[3].values)):
        assert g.dtype == w.dtype
        assert_same_bits(g.numpy(), w.numpy())
    assert got[3].indices.numpy().tolist() == [1, 3]


@pytest.mark.parametrize("kind", KINDS)
def test_scaling_warnings(kind):
    var = tf.Variable(1.0)

    def warnings(before):
        calls = []
        for opt in _pair(kind):
            with mock.patch.object(tf_logging, "warning") as warn:
                before(opt)
                opt.apply_gradients([(tf.constant(1.0), var)])
            calls.append([c[0][0] for c in warn.call_args_list])
        return calls

    for before in (lambda o: None, lambda o: o.get_scaled_loss(tf.constant(1.0)),
                   lambda o: o.get_unscaled_gradients([tf.constant(1.0)])):
        ours, stock = warnings(before)
        assert ours == stock and ours and "You forgot to call" in ours[0]
    ours, stock = warnings(lambda o: (o.get_scaled_loss(tf.constant(1.0)),
                                      o.get_unscaled_gradients([tf.constant(1.0)])))
    assert ours == stock == []


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("kind", KINDS)
def test_errors_as_tf_keras(kind):
    stock_make = tf_keras.mixed_precision.LossScaleOptimizer
    cases = [
        lambda make: make(_sgd(kind), dynamic=False),
        lambda make: make(_sgd(kind), dynamic=False, initial_scale=1, dynamic_growth_steps=2),
        lambda make: make(_sgd(kind), "dynamic"),
        lambda make: make(make(_sgd(kind))),
    ]
    for case in cases:
        # The same but for the repr of the optimizer a message names.
        ours, stock = (_error(lambda case=case, make=make: case(make))
                       for make in (OURS, stock_make))
        assert ours[0] is stock[0]
        assert re.sub(r"<\S+ object at 0x[0-9a-f]+>", "<>", ours[1]) == re.sub(
            r"<\S+ object at 0x[0-9a-f]+>", "<>", stock[1])
    for make in (OURS, stock_make):
        inner = _sgd(kind)
        make(inner)
        with pytest.raises(ValueError, match='"inner_optimizer" is already wrapped by a '
                                             "LossScaleOptimizer"):
            make(inner)


@pytest.mark.parametrize("kind", KINDS)
def test_unsupported_strategy(kind):
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    for make in (OURS, tf_keras.mixed_precision.LossScaleOptimizer):
        with strategy.scope(), pytest.raises(
                ValueError, match="Loss scaling is not supported with the tf.distribute.Strategy: "
                                  "CentralStorageStrategy"):
            make(_sgd(kind))


def test_one_class_for_both_kinds():
    # Where ours differs on purpose: tf_keras' LossScaleOptimizerV3 refuses a
    # legacy optimizer and its LossScaleOptimizer a new one (TypeError); our
    # one public class, like tf_keras' exported one, takes either and gives
    # the class that fits it.
    assert type(OURS(_sgd("legacy"))) is OUR_CLASS["legacy"]
    assert type(OURS(_sgd("v3"))) is OUR_CLASS["v3"]
    with pytest.raises(TypeError, match="only the new experimental optimizer"):
        stock_module.LossScaleOptimizerV3(_sgd("legacy"))
    with pytest.raises(TypeError, match="inner_optimizer must be a tf_keras.optimizers.Optimizer"):
        OURS(1)


@pytest.mark.parametrize("arguments", [dict(initial_scale=2, dynamic_growth_steps=1),
                                       dict(dynamic=False, initial_scale=10.0)],
                         ids=["dynamic", "fixed"])
def test_legacy_steps_in_graph_mode(arguments):
    # tf_keras' legacy optimizers also run in a TF1 graph, under a Session.
    def run(make):
        graph = tf.Graph()
        with graph.as_default():
            var = tf.Variable([5.0, -3.0])
            poison = tf.compat.v1.placeholder(tf.float32, ())
            opt = make(_sgd("legacy", 1.0, momentum=0.5), **arguments)
            train = opt.minimize(lambda: var * var * poison, var_list=[var])
            fetch = [var, opt.loss_scale, opt.iterations]
            with tf.compat.v1.Session(graph=graph) as session:
                session.run(tf.compat.v1.global_variables_initializer())
                states = []
                for step in range(8):
                    session.run(train, {poison: np.inf if step in (2, 3) else 1.0})
                    states.append(session.run(fetch))
        return states

    ours, stock = run(OURS), run(tf_keras.mixed_precision.LossScaleOptimizer)
    for step, (got, want) in enumerate(zip(ours, stock)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_bits(np.asarray(a), np.asarray(b), f"step {step}, state {i}")
