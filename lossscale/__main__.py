"""``python -m lossscale``: what to paste into a bug report or a request for help.

Prints the package version, the kernel set in use and the best one this CPU
has, the thread count, whether the TensorFlow op library is loaded (and if
not, why and the command that fixes it), and the TensorFlow / Keras versions
running here and the TensorFlow the op library was built for.  Works without
TensorFlow, and never warns: the loader's reason is printed instead.
"""

import os
import platform
import sys
import warnings


def _version_of(module_name):
    try:
        module = __import__(module_name)
    except Exception as exc:
        return f"not importable ({type(exc).__name__}: {exc})"
    return getattr(module, "__version__", "unknown")


def report():
    """The report's lines."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import lossscale
    from lossscale import _loader

    lines = [f"lossscale {lossscale.__version__} ({os.path.dirname(lossscale.__file__)})",
             f"python {platform.python_version()} on {platform.machine()} {platform.system()}"]
    try:
        from lossscale import core

        lines.append(f"kernel set: {core.simd_level()} (best on this CPU: {core.simd_best()})")
        lines.append(f"threads: {core.get_num_threads()}")
    except Exception as exc:
        lines.append(f"lossscale.core: not usable ({type(exc).__name__}: {exc})")
    built_for = _loader._recorded_tf_version()
    lines.append(f"TensorFlow: {_version_of('tensorflow')} "
                 f"(op library built for: {built_for or 'none built'})")
    lines.append(f"Keras: {_version_of('keras')}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, reason = _loader.load()
    if module is not None:
        lines.append(f"TensorFlow op library: loaded ({_loader.library_path()})")
    else:
        lines.append(f"TensorFlow op library: NOT loaded ({reason}); "
                     "lossscale.ops uses plain TensorFlow ops")
        lines.append(f"to fix: {_loader.fix_command(reason)}")
    return lines


def main():
    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
