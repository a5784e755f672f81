"""Finds and loads the TensorFlow op library (``_lossscale_ops.so``) on first use.

The library sits next to this file and is compiled against one TensorFlow
minor (recorded by ``setup.py`` in ``lossscale._build_info.TF_VERSION``, and
pinned by the wheel's ``tensorflow`` extra); custom-op libraries have no
stable ABI across minors, so one built for another minor is never loaded.
Whatever goes wrong — no library, no build record, another TensorFlow, a
load error — ``load()`` answers ``(None, reason)``, warns once with the
command that fixes it (``fix_command``), and the callers in
``lossscale.ops`` use plain TensorFlow ops instead.  The environment
variable ``LOSSSCALE_FORCE_FALLBACK=1`` asks for that fallback explicitly
(read at every call, no warning).
"""

import importlib
import json
import os
import shlex
import sys
import threading
import warnings
from urllib.parse import unquote, urlparse

FORCE_FALLBACK_ENV = "LOSSSCALE_FORCE_FALLBACK"
LIBRARY_NAME = "_lossscale_ops.so"

# Every op of the library, as registered: ``lossscale.ops`` marks each as having
# no gradient, and a library lacking one (stale, built from older sources) is
# treated as unusable, so that the callers fall back instead of failing later.
OP_NAMES = ("LossScaleUnscaleAndCheck", "LossScaleAllFinite", "LossScaleUpdate",
            "LossScaleDebugBufferAddress", "LossScaleApplyOptimizer")


def python_name(op_name):
    """The name ``tf.load_op_library`` gives an op's function: snake case."""
    return "".join("_" + c.lower() if c.isupper() else c for c in op_name).lstrip("_")


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
        f"To use the native ops: {fix_command(reason)}",
        RuntimeWarning,
        stacklevel=4,
    )


def fix_command(reason):
    """The shell command that makes the op library usable here, for a
    ``reason`` of ``load()``: rebuild lossscale against the TensorFlow
    installed here, from wherever it came from (this checkout, or the
    directory or sdist pip installed it from); for a wheel built for another
    TensorFlow (or with none importable), install the TensorFlow it was
    built for."""
    if reason.startswith("forced by"):
        return f"unset {FORCE_FALLBACK_ENV}"
    python = shlex.quote(sys.executable)
    checkout = _checkout()
    if checkout is not None:
        return (f"cd {shlex.quote(checkout)} && "
                f"{python} setup.py --quiet build_ext --inplace")
    source = _installed_from()
    built_for = _recorded_tf_version()
    wrong_tensorflow = reason.startswith(("built for", "TensorFlow cannot be imported"))
    if built_for and wrong_tensorflow and (source is None or source.endswith(".whl")):
        major, minor = (int(p) for p in built_for.split(".")[:2])
        return (f"{python} -m pip install "
                f"'tensorflow>={major}.{minor},<{major}.{minor + 1}'")
    if source is None or source.endswith(".whl"):
        source = "--no-binary lossscale lossscale"
    else:
        source = shlex.quote(source)
    # --no-cache-dir: pip would otherwise reuse the wheel it built before.
    return f"{python} -m pip install --force-reinstall --no-deps --no-cache-dir {source}"


def _checkout():
    """The source checkout lossscale is imported from (built in place), or None."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.exists(os.path.join(root, "setup.py")) else None


def _installed_from():
    """The local directory or archive pip installed lossscale from (PEP 610), or None."""
    try:
        from importlib.metadata import distribution

        url = json.loads(distribution("lossscale").read_text("direct_url.json") or "{}")
    except Exception:
        return None
    parsed = urlparse(url.get("url", ""))
    return unquote(parsed.path) if parsed.scheme == "file" else None


def _recorded_tf_version():
    try:
        info = importlib.import_module("lossscale._build_info")
    except Exception:
        return None
    return getattr(info, "TF_VERSION", None)


def _minor(version):
    return tuple(version.split(".")[:2])


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
    if _minor(built_for) != _minor(tf.__version__):
        return None, f"built for TensorFlow {built_for}, running {tf.__version__}"
    try:
        module = _modules.get(path)
        if module is None:
            module = tf.load_op_library(path)
            _modules[path] = module
    except Exception as exc:
        return None, f"load error: {exc}"
    missing = [python_name(op) for op in OP_NAMES if not hasattr(module, python_name(op))]
    if missing:
        return None, f"library lacks ops {', '.join(missing)}"
    return module, "loaded"
