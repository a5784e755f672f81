"""The numpy-level core: fused finite-check and unscale over numpy arrays.

Thin re-export of the compiled bindings (``lossscale._native``); no
TensorFlow is imported here.
"""

from lossscale._native import (  # noqa: F401
    all_finite,
    get_num_threads,
    round_to_dtype,
    set_num_threads,
    simd_best,
    simd_level,
    unscale_,
)

__all__ = ["all_finite", "unscale_", "simd_level", "simd_best",
           "set_num_threads", "get_num_threads", "round_to_dtype"]
