"""Finds and loads the TensorFlow op library (``_lossscale_ops.so``) on first use.

The library sits next to this file and is compiled against one TensorFlow
release (recorded by ``setup.py`` in ``lossscale._build_info.TF_VERSION``);
custom-op libraries have no stable ABI, so one built for another release is
never loaded.  Whatever goes wrong — no library, no build record, another
TensorFlow, a load error — ``load()`` answers ``(None, reason)``, warns once,
and the callers in ``lossscale.ops`` use plain TensorFlow ops instead.  The
environment variable ``LOSSSCALE_FORCE_FALLBACK=1`` asks for that fallback
explicitly (read at every call, no warning).
"""

import importlib
import os
import threading
import warnings

FORCE_FALLBACK_ENV = "LOSSSCALE_FORCE_FALLBACK"
LIBRARY_NAME = "_lossscale_ops.so"

# Ops the Python side needs; a library lacking one is treated as unusable.
REQUIRED_OPS = ("loss_scale_unscale_and_check", "loss_scale_all_finite", "loss_scale_update")

_lock = threading.Lock()
_state = None          # (module or None, reason) once decided
_warned = False
_modules = {}          # path -> module: tf.load_op_library runs once per file


def library_path():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)


def fallback_forced():
    value = os.environ.get(FORCE_FALLBACK_ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def load():
    """``(module, reason)``; ``module`` is None when the fallback must be used."""
    global _state
    if fallback_forced():
        return None, f"forced by {FORCE_FALLBACK_ENV}"
    state = _state
    if state is None:
        with _lock:
            if _state is None:
                _state = _try_load()
                if _state[0] is None:
                    _warn_once(_state[1])
            state = _state
    return state


def reset():
    """Forget the decision (and the warning) so the next ``load()`` decides again."""
    global _state, _warned
    with _lock:
        _state = None
        _warned = False


def _warn_once(reason):
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"lossscale: the TensorFlow op library is not used ({reason}); "
        "falling back to plain TensorFlow ops (same results, slower). "
        "Rebuild lossscale against the installed TensorFlow to get the native ops.",
        RuntimeWarning,
        stacklevel=4,
    )


def _recorded_tf_version():
    try:
        info = importlib.import_module("lossscale._build_info")
    except Exception:
        return None
    return getattr(info, "TF_VERSION", None)


def _try_load():
    path = library_path()
    if not os.path.exists(path):
        return None, "library not found"
    built_for = _recorded_tf_version()
    if built_for is None:
        return None, "no record of the TensorFlow version the library was built for"
    try:
        import tensorflow as tf
    except Exception as exc:  # pragma: no cover - TensorFlow is a dependency here
        return None, f"TensorFlow cannot be imported ({exc})"
    if built_for != tf.__version__:
        return None, f"built for TensorFlow {built_for}, running {tf.__version__}"
    try:
        module = _modules.get(path)
        if module is None:
            module = tf.load_op_library(path)
            _modules[path] = module
    except Exception as exc:
        return None, f"load error: {exc}"
    missing = [name for name in REQUIRED_OPS if not hasattr(module, name)]
    if missing:
        return None, f"library lacks ops {', '.join(missing)}"
    return module, "loaded"
