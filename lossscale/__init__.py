"""lossscale: dynamic loss scaling for mixed-precision training, native hot path.

``lossscale.core`` works on numpy arrays and needs no TensorFlow.  The
TensorFlow / Keras API (``LossScale``, ``FixedLossScale``,
``DynamicLossScale``, ``Policy``, ``LossScaleOptimizer``...) is imported
on first use, so ``import lossscale`` stays cheap.
"""

__version__ = "0.1.0"

_LAZY = {}
_LAZY.update(dict.fromkeys(
    ["LossScale", "FixedLossScale", "DynamicLossScale", "get", "serialize", "deserialize"],
    "lossscale.loss_scale"))
_LAZY["LossScaleOptimizer"] = "lossscale.optimizer"
_LAZY["Policy"] = "lossscale.policy"
_LAZY.update(dict.fromkeys(["patch_keras", "unpatch_keras"], "lossscale.keras_patch"))
_LAZY["LossScaleMonitor"] = "lossscale.callbacks"

# Submodules reachable as attributes without an explicit import; the first
# two are Keras's.
_SUBMODULES = ("experimental", "callbacks", "ops", "core")

# What ``help(lossscale)`` and ``from lossscale import *`` list.
__all__ = sorted(_LAZY) + list(_SUBMODULES)


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib

        if name in ("experimental", "callbacks"):
            _register_keras_objects()

        return importlib.import_module(f"lossscale.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lossscale' has no attribute {name!r}")
    import importlib

    if module != "lossscale.loss_scale":
        _register_keras_objects()
    if name in ("Policy", "LossScaleOptimizer"):
        from lossscale import _which_keras

        if _which_keras.tf_keras_in_use():
            # tf.keras is tf_keras: its layers and models take these.
            module = "lossscale._tf_keras"

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + list(_SUBMODULES))


def _register_keras_objects():
    """Registers the Keras-serializable classes so that ``load_model`` finds them.

    Keras looks custom classes up in its registry, which a class enters only
    when its module is imported; with lazy imports that may never happen
    before a model is loaded.  Done at import when Keras is already loaded
    (it is then cheap), and otherwise on first use of the Keras API."""
    import importlib
    import sys

    for module in ("lossscale.optimizer", "lossscale.experimental", "lossscale.policy"):
        importlib.import_module(module)
    if "tf_keras" in sys.modules:
        importlib.import_module("lossscale._tf_keras")


import sys as _sys  # noqa: E402

if "keras" in _sys.modules:
    _register_keras_objects()
del _sys
