"""The native ops written with plain TensorFlow ops, for where they cannot run.

``ops`` calls these when the op library is missing or forced off, a tensor
is not on the CPU, or XLA is compiling.  They give the native ops' results
bit for bit: unscaling is TensorFlow's own ``g * tf.cast(1 / scale, g.dtype)``
(or ``g / tf.cast(scale, g.dtype)``), and the update is the rule of
``lossscale.h`` in float32, one rounding per operation, as the core
computes it.  Arguments are already checked by ``ops``.
"""

import tensorflow as tf

from lossscale._config import as_float32

__all__ = ["all_finite", "unscale_and_check", "update_loss_scale"]


def all_finite(values):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])


def unscale_and_check(values, scale, check_inputs, divide=False):
    if scale.shape.rank is None:
        scale = tf.ensure_shape(scale, [])
    if divide:
        outputs = [v / tf.cast(scale, v.dtype) for v in values]
    else:
        inv = 1.0 / scale
        outputs = [v * tf.cast(inv, v.dtype) for v in values]
    return outputs, all_finite(values if check_inputs else outputs)


def _float32(value):
    # A cap beyond float32 is no cap: inf.
    return tf.constant(as_float32(value), tf.float32)


def _divide(x, c):
    """``x / c`` for a constant ``c``, as an IEEE division.

    Grappler's constant folding and XLA's simplifier both turn a division by
    a constant into a multiplication by its float32 reciprocal, which rounds
    differently when ``c`` is not a power of two (``x / 3`` vs
    ``x * (1/3)``).  A denominator that depends on ``x`` (and equals ``c``
    whenever the quotient is not NaN anyway) keeps the division, so the
    fallback computes what the core and eager TensorFlow compute.
    """
    return x / tf.where(tf.math.is_nan(x), x, c)


def update_loss_scale(finite, scale, counter, overflow_run, skipped, config):
    """One step of ``config``'s rule (a ``ScaleConfig``) on the variables;
    returns ``finite``, ordered after the update."""
    s = tf.convert_to_tensor(scale)
    c = tf.convert_to_tensor(counter)
    multiplier = _float32(config.multiplier)
    zero = tf.zeros([], c.dtype)
    one = tf.ones([], c.dtype)
    period = tf.constant(config.increment_period, c.dtype)
    k = tf.convert_to_tensor(skipped) if skipped is not None else None
    new_run = None
    if config.rule == "keras3":
        grow = tf.equal(c, period - one)
        scale_if_finite = tf.where(grow, s * multiplier, s)
        counter_if_finite = tf.where(grow, zero, c + one)
        new_scale = tf.where(finite, scale_if_finite, _divide(s, multiplier))
    else:
        grow = c + one >= period
        grown = tf.minimum(s * multiplier, _float32(config.max_loss_scale))
        scale_if_finite = tf.where(grow & tf.math.is_finite(grown), grown, s)
        counter_if_finite = tf.where(grow, zero, c + one)
        if config.backoff_factor is not None:
            lowered = s * _float32(config.backoff_factor)
        else:
            lowered = _divide(s, multiplier)
        lowered = tf.maximum(lowered, _float32(config.min_loss_scale))
        if overflow_run is not None:
            run = tf.convert_to_tensor(overflow_run) + 1
            back_off = run >= config.hysteresis
            scale_if_not = tf.where(back_off, lowered, s)
            new_run = tf.where(finite, tf.zeros([], tf.int64),
                               tf.where(back_off, tf.zeros([], tf.int64), run))
        else:
            scale_if_not = lowered
        new_scale = tf.where(finite, scale_if_finite, scale_if_not)
    new_counter = tf.where(finite, counter_if_finite, zero)
    updates = [scale.assign(new_scale, read_value=False),
               counter.assign(new_counter, read_value=False)]
    if new_run is not None:
        updates.append(overflow_run.assign(new_run, read_value=False))
    if k is not None:
        updates.append(skipped.assign(tf.where(finite, k, k + 1), read_value=False))
    with tf.control_dependencies([u for u in updates if u is not None]):
        return tf.identity(finite)
