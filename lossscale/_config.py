"""The settings of a loss-scale rule, read and checked once, in one place.

``ScaleConfig`` is what the C core's ``ls_scale_config`` holds: the rule and
its parameters.  It is immutable, and making one checks it as
``ls_scale_config_check`` does (the core checks again, as the backstop), so
a ``ScaleConfig`` that exists is one the native op and its TensorFlow
fallback accept.  The package's three faces read their own arguments into
one, each keeping the error contract its users know:

* ``op_config`` -- ``ops.update_loss_scale``: strict types (a TypeError for
  a wrong one) and messages that start with the op's name;
* ``dynamic_loss_scale_config`` -- TensorFlow 2.4's ``DynamicLossScale``:
  ValueError for everything, integral floats taken as integers, the initial
  scale, a floor above 0 and a cap at least the initial scale;
* ``check_keras_rule_arguments`` and ``keras_rule_config`` -- Keras 3's
  ``LossScaleOptimizer``: the initial scale and growth period, with the
  multiplier Keras fixes at 2.

``ScaleConfig``'s own messages name the setting and say the rule it breaks
("multiplier must be a positive finite float32, got 0.0").
"""

import dataclasses
import math
import numbers
from typing import Optional

import numpy as np

__all__ = ["ScaleConfig", "RULES", "op_config", "dynamic_loss_scale_config",
           "check_keras_rule_arguments", "keras_rule_config", "is_real_number",
           "FLOAT32_MAX", "INT64_MAX", "DEFAULT_INITIAL_SCALE", "DEFAULT_GROWTH_STEPS",
           "as_float32"]

RULES = ("tf24", "keras3")
# The defaults of both rules, as TensorFlow 2.4 and Keras 3 set them: start
# high (a scale too high comes down far faster than one too low goes up),
# grow after this many finite steps in a row.
DEFAULT_INITIAL_SCALE = 2**15
DEFAULT_GROWTH_STEPS = 2000
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38


def as_float32(value):
    """``value`` rounded to float32, as a Python float (beyond float32: inf);
    range errors are the caller's to name."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """A loss-scale rule and its parameters, checked when made.

    Attributes:
      rule: ``"tf24"`` (TensorFlow 2.4's ``DynamicLossScale`` with its
        extensions) or ``"keras3"`` (Keras 3's ``LossScaleOptimizer``).
      increment_period: finite steps in a row before the scale grows.
      multiplier: growth factor, and back-off divisor when
        ``backoff_factor`` is None.
      backoff_factor: None, or the factor in (0, 1) a back-off multiplies by.
      min_loss_scale: floor of a back-off (``"tf24"``).
      max_loss_scale: cap on growth (``"tf24"``); ``math.inf`` for none.
      hysteresis: consecutive non-finite steps per back-off (``"tf24"``).

    Numbers are kept as given and computed with in float32, as the core
    does; the checks are on their float32 values.
    """

    rule: str = "tf24"
    increment_period: int = DEFAULT_GROWTH_STEPS
    multiplier: float = 2.0
    backoff_factor: Optional[float] = None
    min_loss_scale: float = 1.0
    max_loss_scale: float = math.inf
    hysteresis: int = 1

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        for name in ("increment_period", "hysteresis"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            if value > INT64_MAX:
                raise ValueError(f"{name} must be <= 2**63 - 1, got {value}")
        multiplier = as_float32(self.multiplier)
        if not (multiplier > 0 and math.isfinite(multiplier)):
            raise ValueError(f"multiplier must be a positive finite float32, "
                             f"got {self.multiplier!r}")
        if self.backoff_factor is not None and not 0.0 < as_float32(self.backoff_factor) < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        floor = as_float32(self.min_loss_scale)
        if not (floor >= 0 and math.isfinite(floor)):
            raise ValueError(f"min_loss_scale must be a finite number >= 0, "
                             f"got {self.min_loss_scale!r}")
        if not as_float32(self.max_loss_scale) >= floor:
            raise ValueError(f"max_loss_scale ({self.max_loss_scale!r}) must be >= "
                             f"min_loss_scale ({self.min_loss_scale!r})")

    @property
    def cap(self):
        """``max_loss_scale``, or None when growth is not capped."""
        return None if math.isinf(self.max_loss_scale) else self.max_loss_scale


# ------------------------------------------------ ops.update_loss_scale

def _op_number(caller, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{caller}: {name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range: inf, refused as such
        return math.copysign(math.inf, value)


def _op_integer(caller, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{caller}: {name} must be an integer, got {value!r}")
    return int(value)


def op_config(caller, rule, increment_period, multiplier, backoff_factor, min_loss_scale,
              max_loss_scale, hysteresis):
    """The ``ScaleConfig`` of ``ops.update_loss_scale``'s keyword arguments.

    ``max_loss_scale=None`` is no cap.  Raises TypeError for a wrong type,
    ValueError for a value out of range, each message led by ``caller``.
    """
    if rule not in RULES:
        raise ValueError(f"{caller}: rule must be one of {RULES}, got {rule!r}")
    settings = dict(
        rule=rule,
        increment_period=_op_integer(caller, "increment_period", increment_period),
        multiplier=_op_number(caller, "multiplier", multiplier),
        backoff_factor=(None if backoff_factor is None
                        else _op_number(caller, "backoff_factor", backoff_factor)),
        min_loss_scale=_op_number(caller, "min_loss_scale", min_loss_scale),
        max_loss_scale=(math.inf if max_loss_scale is None
                        else _op_number(caller, "max_loss_scale", max_loss_scale)),
        hysteresis=_op_integer(caller, "hysteresis", hysteresis),
    )
    try:
        return ScaleConfig(**settings)
    except ValueError as exc:
        raise ValueError(f"{caller}: {exc}") from None


# ------------------------------------------------------ DynamicLossScale

def is_real_number(value):
    # numbers.Real: Python ints and floats (bool included, as TensorFlow
    # accepts it) and numpy's scalars; never a tensor, a string or an array.
    return isinstance(value, numbers.Real)


def _real(name, value, *, minimum=None, exclusive=False, below=None, allow_inf=False):
    """``float(value)``, or a ValueError naming the argument and the rule it breaks."""
    if not is_real_number(value):
        raise ValueError(f"{name} must be a Python int or float, got {value!r}.")
    try:
        value = float(value)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"{name} must be finite, got an int too large for a float.") from None
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value}.")
    if minimum is not None and (value <= minimum if exclusive else value < minimum):
        raise ValueError(f"{name} must be {'>' if exclusive else '>='} {minimum}, got {value}.")
    if below is not None and not value < below:
        raise ValueError(f"{name} must be < {below}, got {value}.")
    return value


def _positive_float32(name, value):
    """``value`` (already checked positive) stays positive and finite in float32,
    the dtype the native step computes in."""
    rounded = as_float32(value)
    if not 0.0 < rounded < math.inf:
        raise ValueError(f"{name} must be a positive float32, got {value} "
                         f"(in float32: {rounded}).")
    return value


def _positive_real(name, value, **limits):
    return _positive_float32(name, _real(name, value, minimum=0.0, exclusive=True, **limits))


def _integer(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be an integer, got {value!r}.")
    value = int(value)
    if not minimum <= value <= INT64_MAX:
        raise ValueError(f"{name} must be in [{minimum}, 2**63 - 1], got {value}.")
    return value


def dynamic_loss_scale_config(initial_loss_scale, increment_period, multiplier, *,
                              min_loss_scale, max_loss_scale, backoff_factor, hysteresis):
    """``(initial_loss_scale, ScaleConfig)`` of ``DynamicLossScale``'s arguments.

    Raises ValueError naming the argument; numbers are kept as the Python
    numbers the object's config reports.
    """
    initial = _real("initial_loss_scale", initial_loss_scale, minimum=0.0, exclusive=True)
    if initial > FLOAT32_MAX:
        raise ValueError(f"initial_loss_scale must fit in float32, got {initial}.")
    _positive_float32("initial_loss_scale", initial)
    increment_period = _integer("increment_period", increment_period, 1)
    multiplier = _positive_real("multiplier", multiplier)
    # A floor of 0 would let the scale reach 0, where growth never lifts it.
    min_loss_scale = _positive_real("min_loss_scale", min_loss_scale)
    cap = math.inf
    if max_loss_scale is not None:
        cap = _real("max_loss_scale", max_loss_scale, allow_inf=True)
        if math.isinf(cap):
            cap = math.inf
        elif cap < min_loss_scale:
            raise ValueError(f"max_loss_scale ({cap}) must be >= "
                             f"min_loss_scale ({min_loss_scale}).")
        elif cap < initial:
            raise ValueError(f"max_loss_scale ({cap}) must be >= "
                             f"initial_loss_scale ({initial}).")
        else:
            _positive_float32("max_loss_scale", cap)
    if backoff_factor is not None:
        backoff_factor = _positive_real("backoff_factor", backoff_factor, below=1.0)
    return initial, ScaleConfig(
        rule="tf24", increment_period=increment_period, multiplier=multiplier,
        backoff_factor=backoff_factor, min_loss_scale=min_loss_scale, max_loss_scale=cap,
        hysteresis=_integer("hysteresis", hysteresis, 1))


# ------------------------------------------------------ LossScaleOptimizer

def check_keras_rule_arguments(initial_scale, dynamic_growth_steps):
    """The ValueError the optimizer gives at once for an initial scale that is
    not a positive finite float32 or a growth period that is not a number
    (the stock optimizer would only trip over them later)."""
    if isinstance(initial_scale, bool) or not isinstance(initial_scale, numbers.Real):
        raise ValueError(f"initial_scale must be a Python int or float, got {initial_scale!r}.")
    if not 0.0 < initial_scale <= FLOAT32_MAX:  # False for NaN
        raise ValueError(f"initial_scale must be a positive finite float32, got "
                         f"{initial_scale!r}.")
    if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps,
                                                                numbers.Real):
        raise ValueError(f"dynamic_growth_steps must be an integer, got "
                         f"{dynamic_growth_steps!r}.")


def keras_rule_config(dynamic_growth_steps):
    """The Keras 3 rule's ``ScaleConfig``, or None for a growth period the
    native rule does not take (the stock optimizer then steps)."""
    if not (isinstance(dynamic_growth_steps, numbers.Integral)
            and not isinstance(dynamic_growth_steps, bool)
            and 1 <= dynamic_growth_steps <= INT64_MAX):
        return None
    return ScaleConfig(rule="keras3", increment_period=int(dynamic_growth_steps),
                       multiplier=2.0)
