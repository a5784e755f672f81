"""Which Keras the user works with: Keras 3, or legacy Keras 2 (``tf_keras``).

``tf.keras`` is ``tf_keras`` when ``TF_USE_LEGACY_KERAS`` is set (TensorFlow's
own test of it) and ``tf_keras`` is installed; objects the user passes say it
too.  Nothing here imports either Keras, so the rest of the package can ask
before importing the one it needs (``lossscale._tf_keras`` for ``tf_keras``).
"""

import importlib.util
import os
import sys

__all__ = ["KERAS_NAME", "tf_keras_installed", "tf_keras_in_use", "is_tf_keras_object",
           "wants_tf_keras"]

KERAS_NAME = "tf_keras (legacy Keras 2)"


def tf_keras_installed():
    """Whether ``tf_keras`` can be imported."""
    return "tf_keras" in sys.modules or importlib.util.find_spec("tf_keras") is not None


def tf_keras_in_use():
    """Whether ``tf.keras`` is ``tf_keras``, decided as TensorFlow decides it."""
    return (os.environ.get("TF_USE_LEGACY_KERAS", None) in ("true", "True", "1")
            and tf_keras_installed())


def is_tf_keras_object(obj):
    """Whether ``obj`` is an instance of a ``tf_keras`` class (or of a subclass)."""
    return any(k.__module__.split(".")[0] == "tf_keras" for k in type(obj).__mro__)


def wants_tf_keras(obj):
    """Whether ``obj`` (a name or None: the Keras in use decides) is for ``tf_keras``."""
    if obj is None or isinstance(obj, str):
        return tf_keras_in_use()
    return is_tf_keras_object(obj)
