"""The numpy-level core: fused finite-check and unscale over numpy arrays.

Thin re-export of the compiled bindings (``lossscale._native``); no
TensorFlow is imported here.
"""

import numbers

import numpy as np

from lossscale import _native
from lossscale._native import (  # noqa: F401
    adam_step_,
    all_finite,
    get_num_threads,
    optimizer_families,
    optimizer_step_,
    sgd_step_,
    simd_best,
    simd_level,
    simd_levels,
    squared_norms,
    unscale_,
)

__all__ = ["all_finite", "unscale_", "simd_level", "simd_best", "simd_levels",
           "set_num_threads", "get_num_threads", "round_to_dtype", "sgd_step_", "adam_step_",
           "optimizer_step_", "optimizer_families", "squared_norms"]

_INT_MAX = 2**31 - 1


def set_num_threads(n):
    """Threads used for large inputs; ``n <= 0`` restores the default (all cores).

    A count beyond what the library can use is capped by it."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
        raise TypeError(f"set_num_threads: n must be an integer, got {type(n).__name__}")
    # The C library takes an int: clamp, keeping the sign's meaning.
    _native.set_num_threads(max(-1, min(int(n), _INT_MAX)))


def round_to_dtype(value, dtype):
    """``value`` rounded to nearest-even in ``dtype`` (what unscale multiplies by)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"round_to_dtype: value must be a real number, got "
                        f"{type(value).__name__}")
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"round_to_dtype: dtype {dtype!r} is not a numpy dtype ({exc})") from None
    return _native.round_to_dtype(value, dtype)
