"""An independent numpy float32 model of the documented loss-scale rules.

The oracle of every test that checks the extensions (hysteresis, floor,
cap, back-off factor, skipped counter) or the Keras 3 rule, whichever layer
runs them: the C core, the TensorFlow op, or the Python API.  Written from
the rules as `_core/include/lossscale.h` and the docstrings state them, with
TensorFlow's CPU arithmetic: every float32 result flushed to zero when
subnormal.
"""

import math

import numpy as np

F32 = np.float32
TINY = float(np.finfo(np.float32).tiny)


def ftz(x):
    """float32 value with TensorFlow's flush-to-zero applied."""
    x = F32(x)
    return F32(math.copysign(0.0, x)) if x != 0 and abs(x) < TINY else x


def f32_mul(a, b):
    with np.errstate(all="ignore"):
        return ftz(ftz(a) * ftz(b))


def f32_div(a, b):
    with np.errstate(all="ignore"):
        return ftz(ftz(a) / ftz(b))


def tf24_step(state, finite, *, period=2000, multiplier=2.0, backoff_factor=None,
              min_loss_scale=1.0, max_loss_scale=None, hysteresis=1):
    """One step of the TF 2.4 rule with the extensions.

    ``state`` and the result: ``(scale, good_steps, overflow_run, skipped)``.

    finite:     run := 0; if good + 1 >= period: grown = scale * multiplier,
                capped at max_loss_scale, taken if finite; good := 0;
                else good += 1.
    non-finite: good := 0, skipped += 1, run += 1; when run reaches
                hysteresis: run := 0, scale = max(scale * backoff_factor, or
                scale / multiplier, min_loss_scale).
    """
    scale, good, run, skipped = state
    if finite:
        if good + 1 >= period:
            grown = f32_mul(scale, multiplier)
            if max_loss_scale is not None and grown > F32(max_loss_scale):
                grown = F32(max_loss_scale)
            return (grown if np.isfinite(grown) else scale), 0, 0, skipped
        return scale, good + 1, 0, skipped
    run += 1
    if run < hysteresis:
        return scale, 0, run, skipped + 1
    lowered = (f32_mul(scale, backoff_factor) if backoff_factor is not None
               else f32_div(scale, multiplier))
    floor = F32(min_loss_scale)
    return (lowered if lowered >= floor else floor), 0, 0, skipped + 1


def keras3_step(state, finite, *, period=2000, multiplier=2.0):
    """One step of Keras 3's rule: grow when counter == period - 1, halve
    (divide by the multiplier) on overflow, no floor."""
    scale, good, run, skipped = state
    if finite:
        if good == period - 1:
            return f32_mul(scale, multiplier), 0, run, skipped
        return scale, good + 1, run, skipped
    return f32_div(scale, multiplier), 0, run, skipped + 1
