"""Keras callbacks that make loss scaling visible while a model trains.

``LossScaleMonitor`` adds the current loss scale and the number of skipped
(overflowing) steps to the logs Keras hands to later callbacks, so
``History``, ``TensorBoard`` and ``CSVLogger`` record them, and warns when
the scale stays at its floor -- a run whose gradients overflow at every
scale is a run that has diverged.
"""

import math
import numbers
import sys
import warnings

import keras

from lossscale import _compat
from lossscale._config import DEFAULT_GROWTH_STEPS

__all__ = ["LossScaleMonitor"]


def _is_finite(number):
    try:
        return math.isfinite(number)
    except OverflowError:  # an int beyond the float range
        return False


def _tf_keras():
    from lossscale import _tf_keras as module  # pylint: disable=import-outside-toplevel

    return module


def _read(value):
    """A Python float from a variable (Keras or TensorFlow) or a scalar tensor."""
    return float(value.numpy() if hasattr(value, "numpy") else value)


# TfKerasBatchHooks: what tf_keras' CallbackList asks a callback (it then
# calls the batch hooks it is told of).
class LossScaleMonitor(_compat.TfKerasBatchHooks, keras.callbacks.Callback):
    """Logs the loss scale and the skipped steps; warns when the scale is stuck low.

    At the end of every epoch (and of every batch with ``log_batches=True``)
    it sets ``logs["loss_scale"]``, the optimizer's current loss scale, and
    ``logs["skipped_steps"]``, how many steps of this ``fit`` call were skipped
    because a gradient was not finite.  Put it before ``TensorBoard`` or
    ``CSVLogger`` in the callback list so they see the two entries
    (``History`` always does).

    Works with ``lossscale.LossScaleOptimizer`` and the stock
    ``keras.optimizers.LossScaleOptimizer``.  Skipped steps are read from the
    optimizer's own counter where it keeps one (a ``DynamicLossScale`` with
    ``count_skipped_steps=True``); otherwise they are the steps run minus the
    steps the inner optimizer applied.  An optimizer that advances
    ``iterations`` on skipped steps too (TensorFlow 2.4's) and keeps no
    counter has its skipped steps read off the scale and its good-step
    counter: exact with one step per batch, except that a growth blocked at
    ``max_loss_scale`` counts as a skip; with ``steps_per_execution > 1``
    only the back-offs are seen.

    Args:
      patience: Steps in a row with the scale at or below ``min_scale`` after
        which a ``UserWarning`` is issued (once, until the scale rises again).
        Defaults to two growth periods of the optimizer
        (``dynamic_growth_steps``, or the ``DynamicLossScale``'s
        ``increment_period``): a scale that could not grow once in that time
        keeps overflowing at its floor.
      min_scale: The floor to watch.  Defaults to the ``min_loss_scale`` of the
        optimizer's ``DynamicLossScale``, else 1 (the floor of TensorFlow's
        rule; the stock Keras rule has none and keeps halving).  Nothing is
        watched for a fixed loss scale.
      log_batches: Also add the two entries to the logs of every batch.
    """

    def __init__(self, patience=None, min_scale=None, log_batches=False):
        super().__init__()
        if patience is not None and (
                isinstance(patience, bool) or not isinstance(patience, numbers.Integral)
                or patience < 1):
            raise ValueError(f"patience must be an int >= 1 or None, got {patience!r}.")
        if min_scale is not None and not (
                isinstance(min_scale, numbers.Real) and not isinstance(min_scale, bool)
                and _is_finite(min_scale)):
            raise ValueError(f"min_scale must be a finite number or None, got {min_scale!r}.")
        self.patience = patience
        self.min_scale = min_scale
        self.log_batches = log_batches
        self._optimizer = None
        self._tf_keras = False

    # ------------------------------------------------------------------
    # Reading the optimizer

    def _scale(self):
        opt = self._optimizer
        if self._tf_keras:
            return _read(opt.loss_scale)
        loss_scale_object = getattr(opt, "loss_scale_object", None)
        if loss_scale_object is not None:
            return _read(loss_scale_object())
        if opt.built:
            return _read(opt.dynamic_scale)
        return float(opt.initial_scale)

    def _floor(self):
        if self.min_scale is not None:
            return float(self.min_scale)
        from lossscale import loss_scale as loss_scale_module  # pylint: disable=import-outside-toplevel

        loss_scale_object = getattr(self._optimizer, "loss_scale_object", None)
        if self._tf_keras and not self._optimizer.dynamic:
            return None
        if isinstance(loss_scale_object, loss_scale_module.FixedLossScale):
            return None
        if isinstance(loss_scale_object, loss_scale_module.DynamicLossScale):
            return float(loss_scale_object.min_loss_scale)
        return 1.0

    def _patience(self):
        if self.patience is not None:
            return self.patience
        loss_scale_object = getattr(self._optimizer, "loss_scale_object", None)
        period = getattr(loss_scale_object, "increment_period", None)
        if period is None:
            period = getattr(self._optimizer, "dynamic_growth_steps", None) or DEFAULT_GROWTH_STEPS
        return 2 * int(period)

    def _count_skips_from_scale(self, scale, new_steps):
        # A skipped step backs the scale off -- or, at its floor, leaves it
        # and resets the good-step counter, which a finite step only does
        # while growing the scale.
        if scale < self._last_scale:
            self._skips_seen += 1
            return
        good_steps = getattr(self._optimizer, "dynamic_counter", None)
        if (new_steps == 1 and good_steps is not None and scale == self._last_scale
                and int(_read(good_steps)) == 0):
            self._skips_seen += 1

    def _skipped(self):
        if self._counter_variable is not None:
            return int(_read(self._counter_variable)) - self._counter_at_start
        if self._iterations_skip_too:
            return self._skips_seen
        applied = int(_read(self._optimizer.iterations)) - self._iterations_at_start
        return self._steps_run() - applied

    def _steps_run(self):
        return self._steps_before_epoch + self._steps_this_epoch

    # ------------------------------------------------------------------
    # Callback hooks

    def on_train_begin(self, logs=None):
        opt = getattr(self.model, "optimizer", None)
        # tf_keras' optimizers (stock or ours) advance iterations on skipped steps.
        self._tf_keras = "tf_keras" in sys.modules and _tf_keras().is_loss_scale_optimizer(opt)
        if not (self._tf_keras or isinstance(opt, keras.optimizers.LossScaleOptimizer)):
            warnings.warn(f"LossScaleMonitor: the model's optimizer ({type(opt).__name__}) is "
                          "not a loss-scale optimizer; there is nothing to monitor.",
                          stacklevel=2)
            self._optimizer = None
            return
        self._optimizer = opt
        # Ours keeps one when its DynamicLossScale counts skipped steps.
        self._counter_variable = getattr(opt, "skipped_steps", None)
        self._counter_at_start = (int(_read(self._counter_variable))
                                  if self._counter_variable is not None else 0)
        self._iterations_skip_too = (self._tf_keras or getattr(
            opt, "_skipped_steps_advance_iterations", False))
        self._iterations_at_start = int(_read(opt.iterations))
        self._steps_before_epoch = 0
        self._steps_this_epoch = 0
        self._skips_seen = 0
        self._last_scale = self._scale()
        self._floor_value = self._floor()
        self._patience_value = self._patience() if self._floor_value is not None else None
        self._steps_at_floor = 0
        self._warned = False

    def on_epoch_begin(self, epoch, logs=None):
        if self._optimizer is None:
            return
        self._steps_before_epoch += self._steps_this_epoch
        self._steps_this_epoch = 0

    def on_train_batch_end(self, batch, logs=None):
        if self._optimizer is None:
            return
        steps_in_epoch = batch + 1
        total = (self.params or {}).get("steps")
        if total:
            steps_in_epoch = min(steps_in_epoch, total)
        new_steps = steps_in_epoch - self._steps_this_epoch
        self._steps_this_epoch = steps_in_epoch
        scale = self._observe(new_steps)
        if self.log_batches and logs is not None:
            logs["loss_scale"] = scale
            logs["skipped_steps"] = self._skipped()

    def on_epoch_end(self, epoch, logs=None):
        if self._optimizer is None or logs is None:
            return
        logs["loss_scale"] = self._scale()
        logs["skipped_steps"] = self._skipped()

    # ------------------------------------------------------------------

    def _observe(self, new_steps):
        scale = self._scale()
        if self._iterations_skip_too and self._counter_variable is None:
            self._count_skips_from_scale(scale, new_steps)
        self._last_scale = scale
        floor = self._floor_value
        if floor is None:
            return scale
        if scale <= floor:
            self._steps_at_floor += new_steps
            if self._steps_at_floor >= self._patience_value and not self._warned:
                self._warned = True
                warnings.warn(
                    f"The loss scale has been at or below its minimum ({floor:g}) for "
                    f"{self._steps_at_floor} steps in a row (now {scale:g}): the gradients "
                    "overflow even at the lowest scale, so every step is skipped. The "
                    "model has probably diverged (NaN or inf in the loss or the weights).",
                    stacklevel=2)
        else:
            self._steps_at_floor = 0
            self._warned = False
        return scale
