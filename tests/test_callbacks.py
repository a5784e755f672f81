"""``lossscale.LossScaleMonitor``: the loss scale and skipped steps in the
logs, and the warning for a scale stuck at its floor.

Oracles: the optimizer's own state read by an independent callback after
ours (the stock ``keras.optimizers.LossScaleOptimizer`` included), the
overflow steps injected by construction (targets of +inf give an inf loss
and non-finite gradients; float32 compute and small scales keep every other
step finite), and TensorFlow's ``tf.compat.v1.mixed_precision.DynamicLossScale``.
"""

import csv
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lossscale
from lossscale import experimental
from lossscale import loss_scale as loss_scale_module
from lossscale.callbacks import LossScaleMonitor
from lossscale.optimizer import LossScaleOptimizer

N = 12
OVERFLOW_STEPS = (2, 5, 6)
EPOCHS = 2


def _data(overflow_steps=OVERFLOW_STEPS, n=N):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    y[list(overflow_steps)] = np.inf
    return x, y


def _model(optimizer, **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


def _current_scale(optimizer):
    """The scale straight from the optimizer's variables."""
    if getattr(optimizer, "loss_scale_object", None) is not None:
        return float(optimizer.loss_scale_object._current_loss_scale.numpy())  # pylint: disable=protected-access
    return float(optimizer.dynamic_scale.numpy())


class _Recorder(keras.callbacks.Callback):
    """Runs after the monitor: what it put in the logs, and the truth."""

    def __init__(self):
        super().__init__()
        self.epoch_logs, self.epoch_truth, self.batch_logs = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs or {}))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))
        self.epoch_truth.append(_current_scale(self.model.optimizer))


OPTIMIZERS = {
    "stock": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=8.0, dynamic_growth_steps=3),
    "ours-keras-rule": lambda: LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=8.0, dynamic_growth_steps=3),
    "ours-counted": lambda: LossScaleOptimizer(
        keras.optimizers.SGD(0.01), loss_scale=loss_scale_module.DynamicLossScale(
            initial_loss_scale=8, increment_period=3, count_skipped_steps=True)),
    "ours-uncounted": lambda: LossScaleOptimizer(
        keras.optimizers.SGD(0.01), loss_scale=loss_scale_module.DynamicLossScale(
            initial_loss_scale=8, increment_period=3)),
    "experimental": lambda: experimental.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), loss_scale=loss_scale_module.DynamicLossScale(
            initial_loss_scale=8, increment_period=3)),
}


def test_exported():
    assert lossscale.LossScaleMonitor is LossScaleMonitor
    assert lossscale.callbacks.LossScaleMonitor is LossScaleMonitor


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_logs_scale_and_skipped_steps(kind):
    x, y = _data()
    model = _model(OPTIMIZERS[kind]())
    recorder = _Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small growth periods: the floor warning may fire
        history = model.fit(x, y, batch_size=1, epochs=EPOCHS, shuffle=False, verbose=0,
                            callbacks=[LossScaleMonitor(), recorder])
    skipped = [len(OVERFLOW_STEPS) * (epoch + 1) for epoch in range(EPOCHS)]
    assert history.history["loss_scale"] == recorder.epoch_truth
    assert history.history["skipped_steps"] == skipped
    assert [logs["loss_scale"] for logs in recorder.epoch_logs] == recorder.epoch_truth
    assert "loss_scale" not in recorder.batch_logs[0]  # batch logs only on request


def test_scale_matches_tensorflow_rule():
    x, y = _data()
    model = _model(OPTIMIZERS["ours-counted"]())
    history = model.fit(x, y, batch_size=1, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[LossScaleMonitor(patience=10**6)])
    oracle = tf.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=8, increment_period=3)
    want = []
    for _ in range(EPOCHS):
        for step in range(N):
            oracle.update([tf.constant([np.inf if step in OVERFLOW_STEPS else 0.0])])
        want.append(float(oracle()))
    assert history.history["loss_scale"] == want


@pytest.mark.parametrize("kind", ["stock", "ours-counted"])
def test_batch_logs(kind):
    x, y = _data()
    model = _model(OPTIMIZERS[kind]())
    recorder = _Recorder()
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0,
              callbacks=[LossScaleMonitor(patience=10**6, log_batches=True), recorder])
    want = [sum(1 for s in OVERFLOW_STEPS if s <= step) for step in range(N)]
    assert [logs["skipped_steps"] for logs in recorder.batch_logs] == want
    assert recorder.batch_logs[-1]["loss_scale"] == recorder.epoch_truth[-1]


def test_steps_per_execution():
    x, y = _data()
    model = _model(OPTIMIZERS["stock"](), steps_per_execution=2)
    history = model.fit(x, y, batch_size=1, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[LossScaleMonitor(patience=10**6)])
    assert history.history["skipped_steps"] == [3, 6]
    assert history.history["loss_scale"][-1] == float(model.optimizer.dynamic_scale)


def test_counts_restart_with_each_fit():
    x, y = _data()
    model = _model(OPTIMIZERS["ours-counted"]())
    monitor = LossScaleMonitor(patience=10**6)
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[monitor])
    history = model.fit(x[:4], y[:4], batch_size=1, shuffle=False, verbose=0, callbacks=[monitor])
    assert history.history["skipped_steps"] == [1]


def test_csv_logger_after_it_sees_the_entries(tmp_path):
    x, y = _data()
    model = _model(OPTIMIZERS["stock"]())
    path = tmp_path / "log.csv"
    history = model.fit(x, y, batch_size=1, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[LossScaleMonitor(patience=10**6),
                                   keras.callbacks.CSVLogger(str(path))])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss_scale"]) for r in rows] == history.history["loss_scale"]
    assert [int(r["skipped_steps"]) for r in rows] == [3, 6]


# ----------------------------------------------------------------------
# The floor warning


def _all_overflow(n=10):
    return _data(overflow_steps=range(n), n=n)


def test_warns_when_stuck_at_the_floor_stock():
    x, y = _all_overflow()
    model = _model(OPTIMIZERS["stock"]())
    # 8 -> 4 -> 2 -> 1 after three steps, then at or below 1 for good.
    with pytest.warns(UserWarning, match=r"at or below its minimum \(1\) for 5 steps"):
        model.fit(x, y, batch_size=1, shuffle=False, verbose=0,
                  callbacks=[LossScaleMonitor(patience=5)])


def test_warns_with_the_loss_scale_floor_and_default_patience():
    x, y = _all_overflow(n=12)
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.01),
                                   loss_scale=loss_scale_module.DynamicLossScale(
                                       initial_loss_scale=8, increment_period=2,
                                       min_loss_scale=4))
    model = _model(optimizer)
    # Floor 4 reached after one step; default patience: two growth periods.
    with pytest.warns(UserWarning, match=r"minimum \(4\) for 4 steps") as record:
        model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[LossScaleMonitor()])
    assert sum("minimum" in str(w.message) for w in record) == 1  # once per stretch


def test_no_warning_when_training_is_healthy():
    x, y = _data(overflow_steps=())
    model = _model(OPTIMIZERS["stock"]())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = model.fit(x, y, batch_size=1, epochs=EPOCHS, shuffle=False, verbose=0,
                            callbacks=[LossScaleMonitor(patience=1)])
    assert history.history["skipped_steps"] == [0, 0]


def test_no_floor_for_a_fixed_scale():
    x, y = _data(overflow_steps=())
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.01), loss_scale=1)
    model = _model(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = model.fit(x, y, batch_size=1, shuffle=False, verbose=0,
                            callbacks=[LossScaleMonitor(patience=1)])
    assert history.history["loss_scale"] == [1.0]


def test_plain_optimizer_warns_and_logs_nothing():
    x, y = _data(overflow_steps=())
    model = _model(keras.optimizers.SGD(0.01))
    with pytest.warns(UserWarning, match="not a loss-scale optimizer"):
        history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0,
                            callbacks=[LossScaleMonitor()])
    assert "loss_scale" not in history.history


@pytest.mark.parametrize("kwargs", [{"patience": 0}, {"patience": 2.5}, {"patience": True},
                                    {"min_scale": float("nan")}, {"min_scale": "1"}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        LossScaleMonitor(**kwargs)
