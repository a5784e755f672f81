"""TensorFlow ops of dynamic loss scaling: fused unscale + finite check, and the
loss-scale update on resource variables.

Each function runs one native op from the custom-op library
(``_core/tf/*.cc``, calling the C core) for the whole gradient list, or —
with identical results — plain TensorFlow ops (``lossscale._fallback``) when
the native op cannot run here:

* the library is missing, was built for another TensorFlow, or the
  environment variable ``LOSSSCALE_FORCE_FALLBACK=1`` is set
  (``native_available()`` says which, and the loader warns once);
* a tensor or variable is not on the CPU (the kernels are CPU kernels and a
  gradient list is never copied between devices behind the caller's back).
  Inside a ``tf.function`` a tensor pinned to no device counts as on the CPU
  only on a machine without accelerators; pin it with
  ``tf.device("/CPU:0")`` otherwise;
* the code is being compiled by XLA (``tf.function(jit_compile=True)``),
  which has no kernel for a custom op.

On the native path each unscaled gradient takes over its input's buffer
whenever TensorFlow allows it (the input is an intermediate nobody else
reads, e.g. a gradient made inside the same ``tf.function``), so no
gradient-sized memory is allocated; otherwise small outputs share one
allocation per dtype.  An eager tensor the caller still holds is never
overwritten.

"Identical" means bit for bit: unscaled values equal TensorFlow's own
``g * tf.cast(1 / scale, g.dtype)`` (with TensorFlow's CPU flushing of
subnormals), and the update gives the same float32 scale as the same rule
written with TensorFlow ops.

The update op keeps the loss-scale state in up to four variables: ``scale``
(float32) and ``counter`` (int32 or int64: steps since the last growth or
overflow) always, and two optional int64 ones, ``overflow_run``
(consecutive non-finite steps not yet backed off; needed for
``hysteresis > 1``) and ``skipped`` (total skipped steps).  The optional
ones are passed to the op as lists of zero or one resource, so callers
holding only ``(scale, counter)`` — the Keras 3 optimizer's
``dynamic_scale``/``step_counter`` — use the same op.

None of these ops has a gradient.
"""

import functools

import numpy as np
import tensorflow as tf

from lossscale import _compat, _fallback, _loader
from lossscale._config import DEFAULT_GROWTH_STEPS, as_float32, op_config

__all__ = ["native_available", "unscale_and_check", "all_finite", "all_finite_grouped",
           "update_loss_scale"]

_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
for _name in _loader.OP_NAMES:
    try:
        tf.no_gradient(_name)
    except KeyError:  # already registered (module reloaded)
        pass


# ----------------------------------------------------------------- status

class NativeStatus:
    """Whether the native op library is loaded and usable, and why (not)."""

    __slots__ = ("available", "reason")

    def __init__(self, available, reason):
        self.available = bool(available)
        self.reason = str(reason)

    def __bool__(self):
        return self.available

    def __repr__(self):
        return f"NativeStatus(available={self.available}, reason={self.reason!r})"


def native_available():
    """``NativeStatus``: truthy when the native ops can be used in this process.

    ``.reason`` is ``"loaded"``, ``"forced by LOSSSCALE_FORCE_FALLBACK"``,
    ``"built for TensorFlow X, running Y"``, ``"library not found"``, ...
    A true answer still leaves individual calls on the fallback when their
    tensors are not on the CPU or XLA is compiling.
    """
    module, reason = _loader.load()
    return NativeStatus(module is not None, reason)


# ------------------------------------------------------- path selection

@functools.lru_cache(maxsize=None)
def _accelerators_present():
    try:
        return any(d.device_type.upper() != "CPU" for d in tf.config.list_logical_devices())
    except Exception:
        return True


def _on_cpu(device):
    if device:
        kind = tf.DeviceSpec.from_string(device).device_type
        if kind:
            return kind.upper() == "CPU"
    # Not pinned (a graph tensor): the placer decides, and only a machine
    # without accelerators guarantees it picks the CPU.
    return not _accelerators_present()


def native_library_for(devices):
    """The op library when the native path may run for tensors on
    ``devices`` (device strings), else None: the library is loaded, XLA is
    not compiling, and every device is the CPU."""
    return _native_library(devices)


def device_of(x):
    """The device a tensor or variable lives on ("" when not pinned)."""
    return _device_of(x)


def _native_library(devices):
    """The op library when the native path may run for tensors on `devices`."""
    module, _ = _loader.load()
    if module is None or _compat.in_xla_context():
        return None
    if not all(_on_cpu(d) for d in devices):
        return None
    return module


# ------------------------------------------------------------- inputs

def _device_of(x):
    if isinstance(x, tf.Variable):
        return x.device
    return getattr(x, "device", "") or ""


def _gradient_list(grads, caller):
    if grads is None or isinstance(grads, (tf.Tensor, tf.Variable, tf.IndexedSlices, np.ndarray,
                                           str, bytes, dict, set, frozenset)):
        raise TypeError(f"{caller}: grads must be a list of tensors, IndexedSlices or None, "
                        f"got {type(grads).__name__}")
    try:
        return list(grads)
    except TypeError:
        raise TypeError(f"{caller}: grads must be a list of tensors, IndexedSlices or None, "
                        f"got {type(grads).__name__}") from None


def _dense_values(grads, caller):
    """(values, devices, slots): the float tensors to process, the devices they
    live on, and for each gradient its index into values (None for None)."""
    values, devices, slots = [], [], []
    for i, g in enumerate(grads):
        if g is None:
            slots.append(None)
            continue
        source = g.values if isinstance(g, tf.IndexedSlices) else g
        device = _device_of(source)
        try:
            value = tf.convert_to_tensor(source)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{caller}: grads[{i}] is not convertible to a tensor "
                            f"({type(g).__name__}): {exc}") from None
        if value.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{caller}: grads[{i}] has dtype {value.dtype.name}; expected "
                            "float16, bfloat16, float32 or float64")
        slots.append(len(values))
        values.append(value)
        devices.append(device or _device_of(value))
    return values, devices, slots


def _rebuild(grads, slots, outputs):
    result = []
    for g, slot in zip(grads, slots):
        if slot is None:
            result.append(None)
        elif isinstance(g, tf.IndexedSlices):
            result.append(tf.IndexedSlices(outputs[slot], g.indices, g.dense_shape))
        else:
            result.append(outputs[slot])
    return result


def _scale_tensor(scale, caller):
    """(float32 scalar tensor, device of the scale)."""
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{caller}: scale must be a float32 scalar, got a bool")
    if isinstance(scale, (int, float, np.integer, np.floating)):
        with tf.device("/device:CPU:0"):
            t = tf.constant(float(scale), tf.float32)
        return t, t.device if tf.executing_eagerly() else "/device:CPU:0"
    device = _device_of(_as_tf_variable(scale) if _is_variable(scale) else scale)
    try:
        t = tf.convert_to_tensor(scale)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{caller}: scale must be a float32 scalar tensor or variable: {exc}") \
            from None
    if t.dtype != tf.float32:
        raise TypeError(f"{caller}: scale must be float32 (the loss scale, not its inverse), "
                        f"got {t.dtype.name}")
    if t.shape.rank is not None and t.shape.rank != 0:
        raise ValueError(f"{caller}: scale must be a scalar, got shape {t.shape}")
    return t, device or _device_of(t)


def _is_variable(v):
    return isinstance(v, tf.Variable) or _compat.wrapped_tf_variable(v) is not None


def _as_tf_variable(v):
    if isinstance(v, tf.Variable):
        return v
    inner = _compat.wrapped_tf_variable(v)
    if inner is not None:
        return inner
    raise TypeError(f"expected a tf.Variable or keras.Variable, got {type(v).__name__}")


# ---------------------------------------------------------- unscale/check

@tf.autograph.experimental.do_not_convert
def unscale_and_check(grads, scale, *, check_inputs=False, divide=False):
    """Unscales a gradient list and checks it for inf/NaN in one op.

    Args:
      grads: list of `tf.Tensor` (or anything convertible, e.g. a variable's
        value), `tf.IndexedSlices` (values processed, indices and dense shape
        kept) or None (passed through at its position).  dtypes float16,
        bfloat16, float32, float64, mixed freely.
      scale: the loss scale (not its inverse): float32 scalar tensor,
        variable or Python number.
      check_inputs: the finite flag describes the inputs (the scaled
        gradients, as Keras 3 checks them) instead of the results.
      divide: every result is ``g / tf.cast(scale, g.dtype)`` instead, as
        Keras 3 unscales (the one fused pass whenever that is the same
        thing as multiplying by ``1 / scale``).

    Returns:
      ``(unscaled, all_finite)``: the list with every gradient multiplied by
      ``tf.cast(1 / scale, g.dtype)`` — bit-identical to TensorFlow computing
      that expression — and a bool scalar tensor.  An empty or all-None list
      gives ``(list, True)``.
    """
    grads = _gradient_list(grads, "unscale_and_check")
    with tf.name_scope("unscale_and_check"):
        values, devices, slots = _dense_values(grads, "unscale_and_check")
        scale_t, scale_device = _scale_tensor(scale, "unscale_and_check")
        if not values:
            return [None] * len(grads), tf.constant(True)
        module = _native_library(devices + [scale_device])
        if module is not None:
            outputs, finite = module.loss_scale_unscale_and_check(
                values, scale_t, check_inputs=bool(check_inputs), divide=bool(divide))
        else:
            outputs, finite = _fallback.unscale_and_check(values, scale_t, bool(check_inputs),
                                                    bool(divide))
        return _rebuild(grads, slots, list(outputs)), finite


@tf.autograph.experimental.do_not_convert
def all_finite(grads):
    """True (bool scalar tensor) when every element of every gradient is finite.

    Same inputs as `unscale_and_check`; reads only.  Empty: True.
    """
    return _all_finite(grads, "all_finite", group_bytes=None)


# Gradients up to this size are checked together with their neighbours in
# the list; larger ones get an op each.  Measured on ResNet-50 gradients made
# in the same graph: an op per tensor reads each gradient while it is still
# in cache right after its producer, and one op over the whole list waits
# for all of them and streams them back from memory (slower than the stock
# per-tensor check); thousands of tiny tensors still want few ops.
GROUP_BYTES = 1 << 16
# A group's op checks on its own thread below this many bytes (many run
# side by side on TensorFlow's inter-op threads), on the intra-op pool
# from it; `all_finite`'s one op always splits its pass over the pool.
SPLIT_GROUP_FROM_BYTES = 32 << 20


@tf.autograph.experimental.do_not_convert
def all_finite_grouped(grads, group_bytes=GROUP_BYTES):
    """`all_finite` as a step should run it inside the graph that makes the
    gradients: one op per large gradient, small neighbours grouped up to
    ``group_bytes``, the flags combined.  Same result as `all_finite`.
    TensorFlow's inter-op threads run the ops side by side as their
    gradients are made; each op under ``SPLIT_GROUP_FROM_BYTES`` checks on
    its own thread."""
    return _all_finite(grads, "all_finite_grouped", group_bytes)


def _all_finite(grads, caller, group_bytes):
    """The finite check of ``grads`` in groups of up to ``group_bytes`` (None:
    one group), one op each, the flags combined."""
    with tf.name_scope(caller):
        values, devices, _ = _dense_values(_gradient_list(grads, caller), caller)
        if not values:
            return tf.constant(True)
        module = _native_library(devices)
        if module is None:
            return _fallback.all_finite(values)
        if group_bytes is None:
            return module.loss_scale_all_finite(values)
        flags, group, size = [], [], 0
        for v in values:
            nbytes = v.shape.num_elements()
            nbytes = None if nbytes is None else nbytes * v.dtype.size
            if group and (nbytes is None or size + nbytes > group_bytes):
                flags.append(module.loss_scale_all_finite(
                    group, split_from_bytes=SPLIT_GROUP_FROM_BYTES))
                group, size = [], 0
            group.append(v)
            size += nbytes or 0
        flags.append(module.loss_scale_all_finite(group, split_from_bytes=SPLIT_GROUP_FROM_BYTES))
        return flags[0] if len(flags) == 1 else tf.reduce_all(tf.stack(flags))


# ------------------------------------------------------------------ update

def _state_variable(name, v, dtypes):
    if v is None:
        return None
    try:
        var = _as_tf_variable(v)
    except TypeError:
        raise TypeError(f"update_loss_scale: {name} must be a tf.Variable or keras.Variable, "
                        f"got {type(v).__name__}") from None
    if var.dtype not in dtypes:
        raise TypeError(f"update_loss_scale: {name} must be a variable of dtype "
                        f"{' or '.join(d.name for d in dtypes)}, got {var.dtype.name}")
    if var.shape.rank is not None and var.shape.rank != 0:
        raise ValueError(f"update_loss_scale: {name} must be a scalar variable, "
                         f"got shape {var.shape}")
    return var


@tf.autograph.experimental.do_not_convert
def update_loss_scale(finite, scale, counter, *, overflow_run=None, skipped=None, rule="tf24",
                      increment_period=DEFAULT_GROWTH_STEPS, multiplier=2.0, backoff_factor=None,
                      min_loss_scale=1.0, max_loss_scale=None, hysteresis=1):
    """Advances the loss scale one step, in place, and returns ``finite``.

    Variables: ``scale`` float32, ``counter`` int32/int64 (good steps),
    optional ``overflow_run`` and ``skipped`` int64 (see the module doc).

    Rules (float32 arithmetic, as TensorFlow computes them):

    * ``"tf24"`` — TensorFlow 2.4 ``DynamicLossScale`` with extensions.
      Finite: if ``counter + 1 >= increment_period``, the scale becomes
      ``min(scale * multiplier, max_loss_scale)`` when that is finite (else it
      stays) and the counter 0; otherwise ``counter += 1``; ``overflow_run``
      becomes 0.  Non-finite: counter 0, ``skipped += 1``,
      ``overflow_run += 1``; when it reaches ``hysteresis`` (consecutive
      non-finite steps) it resets to 0 and the scale backs off to
      ``max(scale / multiplier, min_loss_scale)`` (``scale * backoff_factor``
      when that is given).
    * ``"keras3"`` — Keras 3 ``LossScaleOptimizer``: finite: scale
      ``*= multiplier`` and counter 0 when ``counter == increment_period - 1``,
      else ``counter += 1``; non-finite: counter 0, ``scale /= multiplier``
      (no floor), ``skipped += 1``.

    Returns the bool scalar ``finite`` (should the gradients be applied),
    ordered after the update.
    """
    config = op_config("update_loss_scale", rule, increment_period, multiplier,
                       backoff_factor, min_loss_scale, max_loss_scale, hysteresis)
    return update_with_config(config, finite, scale, counter, overflow_run=overflow_run,
                              skipped=skipped)


@tf.autograph.experimental.do_not_convert
def update_with_config(config, finite, scale, counter, *, overflow_run=None, skipped=None):
    """``update_loss_scale`` with the rule given as a checked ``ScaleConfig``.

    For callers that hold their settings in one (the loss-scale objects and
    the optimizer's rules): the settings are not read again every step.
    """
    scale_var = _state_variable("scale", scale, (tf.float32,))
    if scale_var is None:
        raise TypeError("update_loss_scale: scale must be a tf.Variable or keras.Variable")
    counter_var = _state_variable("counter", counter, (tf.int32, tf.int64))
    if counter_var is None:
        raise TypeError("update_loss_scale: counter must be a tf.Variable or keras.Variable")
    run_var = _state_variable("overflow_run", overflow_run, (tf.int64,))
    skipped_var = _state_variable("skipped", skipped, (tf.int64,))
    if config.hysteresis > 1 and run_var is None:
        raise ValueError("update_loss_scale: hysteresis > 1 needs an overflow_run variable")
    state = [v for v in (scale_var, counter_var, run_var, skipped_var) if v is not None]
    if len({id(v) for v in state}) != len(state):
        raise ValueError("update_loss_scale: scale, counter, overflow_run and skipped must be "
                         "distinct variables")
    try:
        finite = tf.convert_to_tensor(finite, tf.bool)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"update_loss_scale: finite must be a bool scalar: {exc}") from None
    if finite.dtype != tf.bool:  # a graph tensor is passed through as it is
        raise TypeError(f"update_loss_scale: finite must be a bool scalar, got dtype "
                        f"{finite.dtype.name}")
    if finite.shape.rank is not None and finite.shape.rank != 0:
        raise ValueError(f"update_loss_scale: finite must be a scalar, got shape {finite.shape}")

    with tf.name_scope("update_loss_scale"):
        distributed = any(isinstance(v, tf.distribute.DistributedValues) for v in state)
        module = None if distributed else _native_library([v.device for v in state])
        if module is not None:
            return module.loss_scale_update(
                finite, scale_var.handle, counter_var.handle,
                [run_var.handle] if run_var is not None else [],
                [skipped_var.handle] if skipped_var is not None else [],
                Tcounter=counter_var.dtype, rule=config.rule,
                increment_period=config.increment_period,
                multiplier=as_float32(config.multiplier),
                backoff_factor=as_float32(config.backoff_factor or 0.0),
                min_loss_scale=as_float32(config.min_loss_scale),
                max_loss_scale=as_float32(config.max_loss_scale),
                hysteresis=config.hysteresis)
        return _fallback.update_loss_scale(finite, scale_var, counter_var, run_var, skipped_var,
                                           config)


def _debug_buffer_address(x):
    """Testing aid: ``(x, address of x's buffer)`` through the native library."""
    module, reason = _loader.load()
    if module is None:
        raise RuntimeError(f"native op library unavailable: {reason}")
    return module.loss_scale_debug_buffer_address(x)
